"""The hybrid models' state layers on CUDA: the depthwise causal conv, Gated DeltaNet's delta rule and Mamba-2's SSD
recurrence over a step's sequences of any lengths in one launch each (recurrent_triton.py), every sequence continuing
from its state slot (or zero) and leaving its state there. A prefill's pieces of CHUNKED_FROM tokens or more run the
rule and the recurrence in chunks (tensor-core products per 64-token chunk, tf32 operands), its shorter pieces on the
token loop beside them.

The torch form of each (the CPU's path, and the reference the kernels are tested against) lives beside its layer in
runtime/models (gated_deltanet.py, mamba2.py, short_conv.py): the layers call these only where `can_use_triton`.

`StateSteps` describes the step's sequences for the kernels: cu_seqlens [num_seqs + 1] int32 (their rows), slots
[num_seqs] (their state slots) and fresh [num_seqs] bool (a piece starting its sequence reads zeros), all on the
device: a decode step builds them with device ops only (a CUDA graph replays it); and on the host max_len, the longest
piece, and long_pieces, how many have CHUNKED_FROM tokens or more.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from . import can_use_triton, device_num_sms  # noqa: F401 (can_use_triton: the layers' dispatch; tests patch it here)

# (tile, warps) of the delta rule's and the SSD recurrence's kernels for decode steps and for prefills, from
# `benchmarks/bench_hybrid.py --sweep` on an H200 (benchmarks/RESULTS.md, session 51): decodes are bound by the state's
# traffic (wide tiles), prefills by each token's serial latency (narrow tiles, one warp, more programs)
DELTA_RULE_TILES = {"decode": (64, 4), "prefill": (16, 1)}
SSD_TILES = {"decode": (32, 4), "prefill": (4, 1)}
# (tile, warps, stages) of the chunked kernels, from `bench_hybrid.py --sweep-chunked` (RESULTS.md, session 53)
CHUNKED_TILES = {"delta_rule": (64, 4, 1), "ssd": (64, 4, 1)}
# the tile of a step whose long pieces at CHUNKED_TILES' leave SMs idle (pieces x heads x tiles fewer programs than the
# GPU has SMs: one long prompt, a few): twice the programs (session 54, one 2048-token piece: 1.2-1.3x faster at 32)
CHUNKED_NARROW = 32
# a prefill's pieces of CHUNKED_FROM tokens or more run on the chunked kernels (recurrent_triton.delta_rule_chunked,
# ssd_chunked: a sequence's serial path one step per 64-token chunk, its work tensor-core products), the step's shorter
# pieces (its decodes among them) on the token loop, a launch of each
CHUNKED_FROM = 64
CHUNK = 64  # the chunked kernels' chunk (a multiple of 16: recurrent_triton._unit_lower_inverse)
# GATES_IN_KERNEL: a decode step's kernels compute the gates (the delta rule's g and beta, the SSD's time step) from the
# raw projections, saving the small torch launches a step of one token is bound by; a prefill's are computed by torch
# first (a few launches over the whole step), keeping the per-token loop, which bounds a prefill by its serial
# latency, as short as it was (session 52: the time step in the SSD's loop made a 2048-token prefill 0.80-0.89x)


def delta_rule_gates(a: Tensor, b: Tensor, a_log: Tensor, dt_bias: Tensor, beta_scale: float) -> tuple[Tensor, Tensor]:
    """The Gated DeltaNet's gates from its raw projections a, b [T, value heads], float32: g = -exp(a_log)
    softplus(a + dt_bias) and beta = sigmoid(b) (in b's dtype, as the model computes it) times beta_scale."""
    return -a_log.exp() * torch.nn.functional.softplus(a.float() + dt_bias), b.sigmoid().float() * beta_scale


def ssd_time_step(dt: Tensor, dt_bias: Tensor) -> Tensor:
    """Mamba-2's time step from its raw projection dt [T, heads], float32: softplus(dt + dt_bias) (time_step_limit
    (0, inf): unclamped)."""
    return torch.nn.functional.softplus(dt.float() + dt_bias)


@dataclass
class StateSteps:
    cu_seqlens: Tensor
    slots: Tensor
    fresh: Tensor
    max_len: int
    long_pieces: int

    @classmethod
    def of(cls, query_lens: list[int], context_lens: Tensor, slots: Tensor | None, is_decode: bool,
           cache: dict) -> StateSteps:
        """The step's sequences (query_lens on the host, context_lens on the device: a piece whose context is its own
        length starts its sequence). Without slots (the memory profile, calibration: nothing kept) every sequence
        starts fresh on a slot of its own in zeros the layer allocates for the step
        (runtime/models/gated_deltanet.bound_or_scratch). Computed once per step
        (`cache`: the ForwardBatch's kernel_cache), every state layer reading the same."""
        found = cache.get("state_steps")
        if found is None:
            device, num_seqs = context_lens.device, len(query_lens)
            if is_decode:  # one token each: device ops only
                cu_seqlens = torch.arange(num_seqs + 1, dtype=torch.int32, device=device)
                fresh = context_lens == 1
            else:
                lengths = torch.tensor(query_lens, dtype=torch.int32, device=device)
                cu_seqlens = torch.nn.functional.pad(lengths.cumsum(0, dtype=torch.int32), (1, 0))
                fresh = context_lens == lengths
            if slots is None:
                slots, fresh = torch.arange(num_seqs, device=device), torch.ones_like(fresh)
            long_pieces = 0 if is_decode else sum(length >= CHUNKED_FROM for length in query_lens)
            found = cache["state_steps"] = cls(cu_seqlens, slots, fresh, 1 if is_decode else max(query_lens),
                                               long_pieces)
        return found


def causal_conv(x: Tensor, weight: Tensor, bias: Tensor | None, state: Tensor, steps: StateSteps, silu: bool,
                out_dtype: torch.dtype) -> Tensor:
    """(SiLU of) the depthwise causal conv of x [T, C] (weight [C, K], + bias) per sequence after its slot's conv state
    state [slots, C, K - 1], which becomes the sequence's last K - 1 inputs; returns [T, C] in out_dtype."""
    from . import recurrent_triton

    out = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    return recurrent_triton.causal_conv(x, weight, bias, state, steps.slots, steps.fresh, steps.cu_seqlens, silu, out,
                                        steps.max_len)


def delta_rule(q: Tensor, k: Tensor, v: Tensor, a: Tensor, b: Tensor, a_log: Tensor, dt_bias: Tensor, beta_scale: float,
               state: Tensor, steps: StateSteps, scale: float, eps: float) -> Tensor:
    """The gated delta rule per sequence from its slot of state [slots, value heads, key_dim, value_dim] (float32 or
    16-bit: computed in float32, updated in place): q, k [T, key heads * key_dim] (L2-normed in the kernel, q times
    scale), v [T, value heads * value_dim]; the gates from the raw projections a, b [T, value heads] (g = -exp(a_log)
    softplus(a + dt_bias), beta = sigmoid(b) beta_scale: in the kernel for a decode step, GATES_IN_KERNEL); returns
    o [T, value heads * value_dim] float32. A prefill's pieces of CHUNKED_FROM tokens or more: the chunked kernels."""
    from . import recurrent_triton

    out = torch.empty(v.shape, dtype=torch.float32, device=v.device)
    decode = steps.max_len == 1
    tile, warps = DELTA_RULE_TILES["decode" if decode else "prefill"]
    if decode:  # (GATES_IN_KERNEL)
        return recurrent_triton.delta_rule(q, k, v, a, b, a_log, dt_bias, beta_scale, state, steps.slots, steps.fresh,
                                           steps.cu_seqlens, scale, eps, out, tile, warps)
    g, beta = delta_rule_gates(a, b, a_log, dt_bias, beta_scale)
    long_from = CHUNKED_FROM if steps.long_pieces else 1 << 30
    recurrent_triton.delta_rule(q, k, v, g, beta, a_log, dt_bias, beta_scale, state, steps.slots, steps.fresh,
                                steps.cu_seqlens, scale, eps, out, tile, warps, raw=False, long_from=long_from)
    if steps.long_pieces:
        recurrent_triton.delta_rule_chunked(
            q, k, v, g, beta, state, steps.slots, steps.fresh, steps.cu_seqlens, scale, eps, out, steps.max_len,
            long_from, *chunked_tiles("delta_rule", steps.long_pieces * state.shape[1], state.shape[3], v.device))
    return out


def chunked_tiles(kind: str, pieces_by_heads: int, width: int, device: torch.device) -> tuple[int, int, int]:
    """CHUNKED_TILES[kind] (tile, warps, stages) for a step's long pieces times heads over a width (the delta rule's
    value_dim, the SSD's head_dim) tiled into programs: CHUNKED_NARROW where the table's tile leaves SMs idle."""
    tile, warps, stages = CHUNKED_TILES[kind]
    if device.type == "cuda" and pieces_by_heads * -(-width // tile) < device_num_sms(device):
        tile = min(tile, CHUNKED_NARROW)
    return tile, warps, stages


def gated_rms_norm(o: Tensor, z: Tensor, weight: Tensor, eps: float) -> Tensor:
    """Qwen3.5's gated RMSNorm per head of o [T, heads * head_dim] float32 (the delta rule's output) with the gate z
    [T, heads * head_dim]: w * rms_norm(o) * silu(z) in z's dtype, one launch (the torch form: runtime/models/
    gated_deltanet.GatedDeltaNet._gated_norm)."""
    from . import recurrent_triton

    out = torch.empty(o.shape, dtype=z.dtype, device=o.device)
    return recurrent_triton.gated_rms_norm(o, z, weight, eps, out)


def ssd(x: Tensor, dt: Tensor, dt_bias: Tensor, a_log: Tensor, b: Tensor, c: Tensor, d: Tensor, state: Tensor,
        steps: StateSteps) -> Tensor:
    """Mamba-2's recurrence per sequence from its slot of state [slots, heads, head_dim, d_state] (float32 or 16-bit:
    computed in float32, updated in place): x [T, heads * head_dim], dt [T, heads] (the raw projection: softplus(dt +
    dt_bias), in the kernel for a decode step, GATES_IN_KERNEL), dt_bias, a_log (a = -exp(a_log) in the kernel), d
    [heads] float32, b, c [T, groups * d_state]; returns y [T, heads * head_dim] float32. A prefill's pieces of
    CHUNKED_FROM tokens or more: the chunked kernel."""
    from . import recurrent_triton

    out = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    decode = steps.max_len == 1
    tile, warps = SSD_TILES["decode" if decode else "prefill"]
    if decode:  # (GATES_IN_KERNEL)
        return recurrent_triton.ssd(x, dt, dt_bias, a_log, b, c, d, state, steps.slots, steps.fresh, steps.cu_seqlens,
                                    out, tile, warps)
    dt = ssd_time_step(dt, dt_bias)
    long_from = CHUNKED_FROM if steps.long_pieces else 1 << 30
    recurrent_triton.ssd(x, dt, dt_bias, a_log, b, c, d, state, steps.slots, steps.fresh, steps.cu_seqlens, out, tile,
                         warps, raw=False, long_from=long_from)
    if steps.long_pieces:
        recurrent_triton.ssd_chunked(x, dt, a_log, b, c, d, state, steps.slots, steps.fresh, steps.cu_seqlens, out,
                                     long_from, *chunked_tiles("ssd", steps.long_pieces * state.shape[1],
                                                               state.shape[2], x.device))
    return out


def gated_group_norm(y: Tensor, z: Tensor, weight: Tensor | None, groups: int, eps: float,
                     out_dtype: torch.dtype) -> Tensor:
    """Mamba-2's gated norm of the SSD's output y [T, width] float32 with the gate z [T, width]: the RMSNorm of
    y silu(z) over each of `groups` column groups times weight (None: y silu(z) alone), in out_dtype, one launch (the
    torch form: runtime/models/mamba2.gated_group_norm)."""
    from . import recurrent_triton

    out = torch.empty(y.shape, dtype=out_dtype, device=y.device)
    return recurrent_triton.gated_group_norm(y, z, weight, groups, eps, out)
