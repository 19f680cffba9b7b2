"""The Gated DeltaNet layer (Qwen3.5's "linear_attention" layers) and its per-request state.

NOTE (state slots): a request's state is its conv state [conv_dim, kernel - 1] (the last inputs of the causal
depthwise conv) and its recurrent state [value heads, key dim, value dim] in every DeltaNet layer (and in
Granite 4.0's Mamba-2 layers, runtime/models/mamba2.py, their conv and SSM states; in LFM2's short convs,
runtime/models/short_conv.py, a conv state alone: each layer kind binds its own tensors), kept in tensors preallocated for max_num_seqs slots plus one scratch slot (`bind_states`). A request's slot is its
persistent-batch row (`Request.batch_row`, `ForwardBatch.state_slots`): taken when it is first scheduled, given
back when it finishes, is aborted or is preempted, as vLLM's mamba cache hands out one slot per running request. A
sequence whose chunk starts at position 0 (a new prompt, or a re-prefill after preemption by recompute) starts from
zero state, read from nothing; a later chunk or a decode starts from its slot; each sequence's state after its
chunk is written back to its slot. So chunked prefill carries the state across chunks and no slot needs clearing.
The states' dtypes are the engine's runtime.mamba_cache_dtype / mamba_ssm_cache_dtype (artifact.state_dtypes: by
default conv states in the model dtype, recurrent states float32); every path computes in float32 and rounds a state
to its dtype only where it is stored, once per step.

The delta rule (per value head, state S [key dim, value dim], q and k L2-normed, q scaled by key_dim^-0.5):
S <- exp(g_t) S; u_t = beta_t (v_t - S^T k_t); S <- S + k_t u_t^T; o_t = S^T q_t. `recurrent_delta_rule` runs it one
token at a time (decodes); `chunked_delta_rule` in chunks of C tokens, solving each chunk's u in one triangular
system (prefill chunks). Both in float32 on torch ops: the CPU's path. On CUDA the conv, the rule (in a decode step
its gates g and beta computed in it from the raw projections) and the gated norm run as three Triton kernels over the
step's sequences at once (kernels/recurrent.py), each sequence's state read and written once per step."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from llmc.kernels import recurrent
from llmc.runtime.forward_batch import ForwardBatch
from llmc.runtime.layers.linear import Linear

L2_NORM_EPS = 1e-6  # q and k: x / sqrt(sum(x^2) + eps), as FLA's l2norm


def _weight(shape: tuple[int, ...], dtype: torch.dtype) -> nn.Module:
    holder = nn.Module()
    holder.register_buffer("weight", torch.empty(shape, dtype=dtype, device="meta"))
    return holder


def state_steps(batch: ForwardBatch) -> recurrent.StateSteps:
    """The step's sequences for the state layers' kernels (kernels/recurrent.StateSteps), once per step."""
    return recurrent.StateSteps.of(batch.query_lens, batch.context_lens, batch.state_slots, batch.is_decode,
                                   batch.kernel_cache)


def bound_or_scratch(state: Tensor | None, batch: ForwardBatch, shape: tuple[int, ...], dtype: torch.dtype,
                     device: torch.device) -> Tensor:
    """A layer's bound state tensor, or (a forward without state slots) zeros of `shape` per sequence of the step,
    thrown away after it."""
    if batch.state_slots is not None:
        return state
    return torch.zeros(batch.num_seqs, *shape, dtype=dtype, device=device)


class StateSlots:
    """A state layer's slots (NOTE (state slots)): STATE_NAMES are its state tensors' attributes (a conv state first,
    then a recurrent state where it has one), `state_shapes()` one slot's shapes in that order."""

    STATE_NAMES: tuple[str, ...] = ()

    def states(self) -> tuple[Tensor, ...]:
        """The bound state tensors [slots, ...], in STATE_NAMES' order."""
        return tuple(getattr(self, name) for name in self.STATE_NAMES)

    def bind_states(self, num_slots: int, device: torch.device, dtypes: tuple[torch.dtype, torch.dtype]) -> None:
        """Zeros for num_slots slots: conv states in dtypes[0], recurrent states in dtypes[1]."""
        for name, shape, dtype in zip(self.STATE_NAMES, self.state_shapes(), dtypes):
            setattr(self, name, torch.zeros(num_slots, *shape, dtype=dtype, device=device))


def l2_normalize(x: Tensor) -> Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + L2_NORM_EPS)


def recurrent_delta_rule(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
                         state: Tensor) -> tuple[Tensor, Tensor]:
    """q, k [N, T, H, dk], v [N, T, H, dv], g and beta [N, T, H] (float32; q and k normed and q scaled already,
    heads grouped to H), state [N, H, dk, dv] → (o [N, T, H, dv], the state after the last token), token by token."""
    outputs = []
    for t in range(q.shape[1]):
        state = state * g[:, t].exp()[..., None, None]
        predicted = torch.einsum("nhkv,nhk->nhv", state, k[:, t])
        update = (v[:, t] - predicted) * beta[:, t, :, None]
        state = state + k[:, t, :, :, None] * update[:, :, None, :]
        outputs.append(torch.einsum("nhkv,nhk->nhv", state, q[:, t]))
    return torch.stack(outputs, dim=1), state


def chunked_delta_rule(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor,
                       chunk_size: int = 64) -> tuple[Tensor, Tensor]:
    """The same as recurrent_delta_rule for one sequence (q, k [T, H, dk], v [T, H, dv], g, beta [T, H], state
    [H, dk, dv]), in chunks: within a chunk with cumulative log decays G (G_i = g_1 + ... + g_i) and start state S0,
    the updates U solve (I + A) U = beta (V - e^G K S0), A_ij = beta_i e^(G_i - G_j) k_i.k_j for j < i; the outputs are
    e^G Q S0 + (e^(G_i - G_j) q_i.k_j, j <= i) U, and the state after it e^(G_C) S0 + sum_j e^(G_C - G_j) k_j u_j^T."""
    outputs = []
    for start in range(0, q.shape[0], chunk_size):
        qc, kc, vc, gc, bc = (x[start:start + chunk_size].transpose(0, 1) for x in (q, k, v, g, beta))  # heads first
        size = qc.shape[1]
        cum = gc.cumsum(-1)  # [H, C]
        diff = cum[:, :, None] - cum[:, None, :]  # G_i - G_j
        lower = torch.ones(size, size, dtype=torch.bool, device=q.device).tril()
        decay = torch.where(lower, diff, float("-inf")).exp()  # e^(G_i - G_j) for j <= i, else 0
        strict = decay * ~torch.eye(size, dtype=torch.bool, device=q.device)
        system = torch.eye(size, device=q.device) + bc[:, :, None] * strict * (kc @ kc.transpose(1, 2))
        rhs = bc[:, :, None] * (vc - cum.exp()[:, :, None] * (kc @ state))
        updates = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)  # [H, C, dv]
        out = cum.exp()[:, :, None] * (qc @ state) + (decay * (qc @ kc.transpose(1, 2))) @ updates
        outputs.append(out.transpose(0, 1))
        tail = (cum[:, -1:] - cum).exp()  # e^(G_C - G_j)
        state = cum[:, -1].exp()[:, None, None] * state + (kc * tail[:, :, None]).transpose(1, 2) @ updates
    return torch.cat(outputs), state


class GatedDeltaNet(StateSlots, nn.Module):
    """A Qwen3.5 linear-attention layer in the attention's place: forward(x, batch, cos_sin) as Attention's (the
    rotary table unread). Its states are bound by the model runner (`bind_states`); a forward without
    batch.state_slots (the memory profile, calibration) runs every sequence from zero state and keeps nothing."""

    STATE_KIND = "Gated DeltaNet"
    STATE_NAMES = ("conv_state", "recurrent_state")

    def __init__(self, config, formats: dict, index: int, dtype: torch.dtype):
        super().__init__()
        prefix = f"layers.{index}.attn."
        self.num_k_heads, self.num_v_heads = config.linear_num_key_heads, config.linear_num_value_heads
        self.k_dim, self.v_dim = config.linear_key_head_dim, config.linear_value_head_dim
        self.key_size, self.value_size = self.num_k_heads * self.k_dim, self.num_v_heads * self.v_dim
        self.conv_dim = 2 * self.key_size + self.value_size
        self.kernel = config.linear_conv_kernel_dim
        # the gated RMSNorm's eps (OLMo Hybrid's own: linear_norm_eps); beta times 2 (OLMo Hybrid's allow_neg_eigval)
        self.eps = config.rms_norm_eps if config.linear_norm_eps is None else config.linear_norm_eps
        self.beta_scale = 2.0 if config.linear_allow_neg_eigval else 1.0
        self.has_rope, self.is_local_rope = True, False  # (the model's table is passed, unread)
        hidden = config.hidden_size
        self.in_qkvz = Linear(hidden, self.conv_dim + self.value_size, formats[prefix + "in_qkvz"], False, dtype)
        self.out = Linear(self.value_size, hidden, formats[prefix + "out"], False, dtype)
        self.in_ba = _weight((2 * self.num_v_heads, hidden), dtype)  # in_proj_b's rows, then in_proj_a's (dense)
        self.conv = _weight((self.conv_dim, self.kernel), dtype)
        self.A_log = _weight((self.num_v_heads,), torch.float32)
        self.dt_bias = _weight((self.num_v_heads,), torch.float32)
        self.norm = _weight((self.v_dim,), dtype)  # the gated RMSNorm's weight (plain w, not 1 + w)
        self.conv_state: Tensor | None = None  # [slots, conv_dim, kernel - 1] (bind_states)
        self.recurrent_state: Tensor | None = None  # [slots, num_v_heads, k_dim, v_dim]

    def state_shapes(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """One slot's (conv state, recurrent state) shapes."""
        return (self.conv_dim, self.kernel - 1), (self.num_v_heads, self.k_dim, self.v_dim)

    def forward(self, x: Tensor, batch: ForwardBatch, cos_sin: Tensor | None = None) -> Tensor:
        projected = self.in_qkvz(x)
        mixed, z = projected.split([self.conv_dim, self.value_size], dim=-1)
        b, a = F.linear(x, self.in_ba.weight).split(self.num_v_heads, dim=-1)
        if recurrent.can_use_triton(x):
            return self.out(self._kernels(mixed, a, b, z, batch))
        g, beta = recurrent.delta_rule_gates(a, b, self.A_log.weight, self.dt_bias.weight, self.beta_scale)
        slots = batch.state_slots
        if batch.is_decode and slots is not None:
            out = self._decode(mixed, g, beta, slots, batch.context_lens)
        else:
            out = self._prefill(mixed, g, beta, batch, slots)
        return self.out(self._gated_norm(out, z).flatten(1))

    def _kernels(self, mixed: Tensor, a: Tensor, b: Tensor, z: Tensor, batch: ForwardBatch) -> Tensor:
        """Every sequence of the step at once, three Triton kernels: the conv (its SiLU output rounded to the model
        dtype, as `_prefill`), the delta rule (its gates g and beta from the raw a, b: kernels/recurrent.delta_rule),
        the gated norm; returns the norm's output [T, value_size] in the model dtype."""
        steps, device = state_steps(batch), mixed.device
        conv_shape, state_shape = self.state_shapes()
        conv_state = bound_or_scratch(self.conv_state, batch, conv_shape, mixed.dtype, device)
        state = bound_or_scratch(self.recurrent_state, batch, state_shape, torch.float32, device)
        conv = recurrent.causal_conv(mixed, self.conv.weight, None, conv_state, steps, True, mixed.dtype)
        q, k, v = conv.split([self.key_size, self.key_size, self.value_size], dim=-1)
        out = recurrent.delta_rule(q, k, v, a, b, self.A_log.weight, self.dt_bias.weight, self.beta_scale, state,
                                   steps, self.k_dim ** -0.5, L2_NORM_EPS)
        return recurrent.gated_rms_norm(out, z, self.norm.weight, self.eps)

    def _split_heads(self, mixed: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """The conv's output [..., conv_dim] (float32) → q, k [..., num_v_heads, k_dim] (normed, grouped, q scaled),
        v [..., num_v_heads, v_dim]."""
        q, k, v = mixed.split([self.key_size, self.key_size, self.value_size], dim=-1)
        group = self.num_v_heads // self.num_k_heads
        q, k = (l2_normalize(t.unflatten(-1, (self.num_k_heads, self.k_dim))).repeat_interleave(group, dim=-2)
                for t in (q, k))
        return q * self.k_dim ** -0.5, k, v.unflatten(-1, (self.num_v_heads, self.v_dim))

    def _decode(self, mixed: Tensor, g: Tensor, beta: Tensor, slots: Tensor, context_lens: Tensor) -> Tensor:
        """One token per sequence: device ops only (no host value of the step)."""
        fresh = (context_lens == 1)  # a one-token prompt: zero state
        window = torch.cat([self.conv_state[slots].float() * ~fresh[:, None, None], mixed[:, :, None].float()], dim=-1)
        self.conv_state[slots] = window[:, :, 1:].to(self.conv_state.dtype)
        conv = F.silu((window * self.conv.weight.float()).sum(-1)).to(mixed.dtype).float()
        q, k, v = self._split_heads(conv)
        state = self.recurrent_state[slots].float() * ~fresh[:, None, None, None]
        out, state = recurrent_delta_rule(q[:, None], k[:, None], v[:, None], g[:, None], beta[:, None], state)
        self.recurrent_state[slots] = state.to(self.recurrent_state.dtype)
        return out[:, 0]

    def _prefill(self, mixed: Tensor, g: Tensor, beta: Tensor, batch: ForwardBatch, slots: Tensor | None) -> Tensor:
        """The step's leading one-token sequences (its decodes, listed first) together as `_decode`, then sequence by
        sequence: the conv over its chunk after its conv state, the chunked delta rule from its state."""
        context_lens = batch.host_context_lens
        if context_lens is None:
            context_lens = batch.context_lens.tolist()
        outputs, offset, width = [], 0, self.kernel - 1
        num_decodes = 0
        while slots is not None and num_decodes < len(batch.query_lens) and batch.query_lens[num_decodes] == 1:
            num_decodes += 1
        if num_decodes:
            rows = slice(0, num_decodes)
            outputs.append(self._decode(mixed[rows], g[rows], beta[rows], slots[rows], batch.context_lens[rows]))
            offset = num_decodes
        for i, length in enumerate(batch.query_lens):
            if i < num_decodes:
                continue
            rows = slice(offset, offset + length)
            offset += length
            starts_fresh = slots is None or int(context_lens[i]) == length
            if starts_fresh:
                conv_state = mixed.new_zeros(self.conv_dim, width, dtype=torch.float32)
                state = mixed.new_zeros(self.num_v_heads, self.k_dim, self.v_dim, dtype=torch.float32)
            else:
                conv_state, state = self.conv_state[slots[i]].float(), self.recurrent_state[slots[i]].float()
            window = torch.cat([conv_state, mixed[rows].t().float()], dim=-1)  # [conv_dim, width + length]
            conv = F.conv1d(window[None], self.conv.weight.float()[:, None], groups=self.conv_dim)[0]
            q, k, v = self._split_heads(F.silu(conv).to(mixed.dtype).float().t())
            out, state = chunked_delta_rule(q, k, v, g[rows], beta[rows], state)
            if slots is not None:
                self.conv_state[slots[i]] = window[:, -width:].to(self.conv_state.dtype)
                self.recurrent_state[slots[i]] = state.to(self.recurrent_state.dtype)
            outputs.append(out)
        return torch.cat(outputs)

    def _gated_norm(self, out: Tensor, z: Tensor) -> Tensor:
        """Qwen3.5's gated RMSNorm per value head: w * rms_norm(o) (rounded to the model dtype first) * silu(z), in
        float32, back in the model dtype. out [T, num_v_heads, v_dim] float32, z [T, value_size]."""
        dtype = z.dtype
        out = out.to(dtype).float()  # (the rule's output in the model dtype, as transformers rounds it)
        normed = (out * torch.rsqrt(out.pow(2).mean(-1, keepdim=True) + self.eps)).to(dtype)
        gated = (self.norm.weight * normed).float() * F.silu(z.unflatten(-1, (self.num_v_heads, self.v_dim)).float())
        return gated.to(dtype)
