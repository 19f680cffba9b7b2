"""Granite 4.0's Mamba-2 mixer in torch ops (float32), for one sequence at a time, state carried in and out: its conv
state [conv_dim, kernel - 1] (the last inputs of the causal depthwise conv over x, B and C) and its SSM state
[heads, head_dim, d_state]; and `Mamba2`, Granite 4.0's Mamba-2 layer in the attention's place, its states kept per
request in slots as the Gated DeltaNet's are (runtime/models/gated_deltanet.py NOTE (state slots)).

Per head h (group g = h // (heads / groups)), dt_t = softplus(dt_raw_t + dt_bias) clamped to time_step_limit,
S <- exp(dt_t A_h) S + dt_t x_t B_t^T; y_t = S C_t + D_h x_t. `ssd_step` runs it for one token (decodes);
`ssd_chunked` in chunks of C tokens in closed form (prefill chunks): within a chunk, with a_t the cumulative
dt A, y_t = exp(a_t) S0 C_t + sum_{s <= t} exp(a_t - a_s) dt_s (C_t . B_s) x_s + D x_t and the state at its end
exp(a_C) S0 + sum_s exp(a_C - a_s) dt_s x_s B_s^T. The output is gated and normed per group (y silu(z), RMSNorm over
each group's columns) before out_proj. On CUDA the conv and the recurrence run as Triton kernels over the step's sequences at once
(kernels/recurrent.py; the same recurrence token by token, each state read and written once per step)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from llmc.kernels import recurrent
from llmc.runtime.forward_batch import ForwardBatch
from llmc.runtime.layers.linear import Linear
from llmc.runtime.models.gated_deltanet import StateSlots, _weight, bound_or_scratch, state_steps


def causal_conv(xbc: Tensor, weight: Tensor, bias: Tensor | None, state: Tensor,
                silu: bool = True) -> tuple[Tensor, Tensor]:
    """SiLU (unless not `silu`: LFM2's short conv) of the depthwise causal conv of xbc [T, conv_dim] (weight
    [conv_dim, kernel]) continuing from state [conv_dim, kernel - 1]; returns (out [T, conv_dim], the new state)."""
    kernel = weight.shape[1]
    padded = torch.cat([state.t(), xbc], dim=0)  # [kernel - 1 + T, conv_dim]
    windows = padded.unfold(0, kernel, 1)  # [T, conv_dim, kernel]
    out = (windows * weight).sum(-1) + (0 if bias is None else bias)
    return F.silu(out) if silu else out, padded[-(kernel - 1):].t().contiguous()


def conv_step(conv_state: Tensor, slots: Tensor, fresh: Tensor, xbc: Tensor, weight: Tensor) -> Tensor:
    """One token per sequence through the depthwise causal conv (weight [conv_dim, kernel]), before any bias or
    activation: each sequence's window is its slot's conv state (zeros where `fresh`) then xbc [N, conv_dim]; the
    slots of conv_state [slots, conv_dim, kernel - 1] take the window's last kernel - 1 inputs. Device ops only (a
    decode graph replays it); returns [N, conv_dim] in float32."""
    window = torch.cat([conv_state[slots].float() * ~fresh[:, None, None], xbc[:, :, None].float()], dim=-1)
    conv_state[slots] = window[:, :, 1:].to(conv_state.dtype)
    return (window * weight.float()).sum(-1)


def _time_steps(dt: Tensor, dt_bias: Tensor, limit: tuple[float, float]) -> Tensor:
    return F.softplus(dt + dt_bias).clamp(limit[0], limit[1])


def ssd_step(x: Tensor, dt: Tensor, a: Tensor, b: Tensor, c: Tensor, d: Tensor, state: Tensor) -> Tensor:
    """One token: x [heads, head_dim], dt [heads] (after softplus), a [heads] (= -exp(A_log)), b and c [groups,
    d_state], d [heads]; state [heads, head_dim, d_state] updated in place; returns y [heads, head_dim]."""
    per_group = x.shape[0] // b.shape[0]
    b, c = b.repeat_interleave(per_group, 0), c.repeat_interleave(per_group, 0)  # [heads, d_state]
    state.mul_(torch.exp(dt * a)[:, None, None]).add_((dt[:, None] * x)[:, :, None] * b[:, None, :])
    return torch.einsum("hpn,hn->hp", state, c) + d[:, None] * x


def ssd_chunked(x: Tensor, dt: Tensor, a: Tensor, b: Tensor, c: Tensor, d: Tensor, state: Tensor,
                chunk: int) -> Tensor:
    """T tokens: x [T, heads, head_dim], dt [T, heads] (after softplus), b and c [T, groups, d_state]; state as
    ssd_step's, updated in place to the state after the last token; returns y [T, heads, head_dim]."""
    per_group = x.shape[1] // b.shape[1]
    b, c = b.repeat_interleave(per_group, 1), c.repeat_interleave(per_group, 1)  # [T, heads, d_state]
    out = []
    for start in range(0, x.shape[0], chunk):
        xs, dts, bs, cs = (t[start:start + chunk] for t in (x, dt, b, c))
        cum = torch.cumsum(dts * a, dim=0)  # [L, heads]
        decay = cum[:, None, :] - cum[None, :, :]  # [t, s, heads]: a_t - a_s
        causal = torch.ones(len(xs), len(xs), dtype=torch.bool, device=x.device).tril()
        weights = torch.exp(decay.masked_fill(~causal[:, :, None], -torch.inf))
        weights = weights * torch.einsum("thn,shn->tsh", cs, bs) * dts[None, :, :]
        y = torch.einsum("tsh,shp->thp", weights, xs)
        y = y + torch.exp(cum)[:, :, None] * torch.einsum("hpn,thn->thp", state, cs) + d[None, :, None] * xs
        to_end = torch.exp(cum[-1][None, :] - cum) * dts  # [L, heads]
        state.mul_(torch.exp(cum[-1])[:, None, None]).add_(torch.einsum("sh,shp,shn->hpn", to_end, xs, bs))
        out.append(y)
    return torch.cat(out)


def gated_group_norm(y: Tensor, z: Tensor, weight: Tensor, groups: int, eps: float) -> Tensor:
    """RMSNorm of y silu(z) [T, width] over each of `groups` column groups, times weight."""
    h = (y * F.silu(z)).unflatten(-1, (groups, -1))
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return h.flatten(-2) * weight


def mamba2_mixer(hidden: Tensor, w: dict[str, Tensor], cfg: dict, conv_state: Tensor, ssm_state: Tensor,
                 decode: bool) -> tuple[Tensor, Tensor]:
    """One sequence's tokens hidden [T, hidden] through the mixer whose tensors are w (in_proj, conv_weight [conv_dim,
    kernel], conv_bias, dt_bias, A_log, D, norm, out_proj) and sizes cfg (heads, head_dim, groups, d_state, chunk,
    eps, time_step_limit); ssm_state updated in place; returns (out [T, hidden], the new conv state). decode: one
    token by the recurrence, else the chunked form."""
    heads, head_dim, groups, d_state = cfg["heads"], cfg["head_dim"], cfg["groups"], cfg["d_state"]
    width = heads * head_dim
    proj = hidden.float() @ w["in_proj"].float().t()
    z, xbc, dt = proj.split([width, width + 2 * groups * d_state, heads], dim=-1)
    xbc, conv_state = causal_conv(xbc, w["conv_weight"].float(), w.get("conv_bias"), conv_state)
    x, b, c = xbc.split([width, groups * d_state, groups * d_state], dim=-1)
    dt = _time_steps(dt, w["dt_bias"].float(), cfg["time_step_limit"])
    a, d = -torch.exp(w["A_log"].float()), w["D"].float()
    x, b, c = x.unflatten(-1, (heads, head_dim)), b.unflatten(-1, (groups, d_state)), c.unflatten(-1, (groups, d_state))
    if decode:
        y = ssd_step(x[0], dt[0], a, b[0], c[0], d, ssm_state)[None]
    else:
        y = ssd_chunked(x, dt, a, b, c, d, ssm_state, cfg["chunk"])
    y = gated_group_norm(y.flatten(-2), z, w["norm"].float(), groups, cfg["eps"])
    return y @ w["out_proj"].float().t(), conv_state


class Mamba2(StateSlots, nn.Module):
    """A Granite 4.0 Mamba-2 layer in the attention's place: forward(x, batch, cos_sin) as Attention's (the rotary
    table unread); in_proj and out_proj are attn.mamba_in / attn.mamba_out (quantizable), the rest dense. Its conv
    state [slots, conv_dim, kernel - 1] and SSM state [slots, heads, head_dim, d_state] (by default in the model dtype
    and float32: gated_deltanet NOTE (state slots)) are bound by the model runner (`bind_states`); a forward without
    batch.state_slots (the memory profile, calibration) runs every sequence from zero state and keeps nothing."""

    STATE_KIND = "Mamba-2"
    STATE_NAMES = ("conv_state", "ssm_state")

    def __init__(self, config, formats: dict, index: int, dtype: torch.dtype):
        super().__init__()
        prefix = f"layers.{index}.attn."
        self.heads, self.head_dim = config.mamba_num_heads, config.mamba_head_dim
        self.groups, self.d_state = config.mamba_n_groups, config.mamba_d_state
        self.width, self.conv_dim = self.heads * self.head_dim, config.mamba_conv_dim
        self.kernel = config.mamba_conv_kernel
        self.chunk, self.eps = config.mamba_chunk_size, config.rms_norm_eps
        self.has_rope, self.is_local_rope = True, False  # (the model's table is passed, unread)
        hidden = config.hidden_size
        self.mamba_in = Linear(hidden, self.width + self.conv_dim + self.heads, formats[prefix + "mamba_in"], False,
                               dtype)
        self.mamba_out = Linear(self.width, hidden, formats[prefix + "mamba_out"], False, dtype)
        self.conv = _weight((self.conv_dim, self.kernel), dtype)
        self.conv_bias = _weight((self.conv_dim,), dtype) if config.mamba_conv_bias else None
        self.A_log = _weight((self.heads,), torch.float32)
        self.dt_bias = _weight((self.heads,), torch.float32)
        self.D = _weight((self.heads,), torch.float32)
        # the gated RMSNorm's weight, per group of width / groups columns (None: Falcon-H1's mamba_rms_norm false, the
        # output y silu(z) unnormed)
        self.norm = _weight((self.width,), dtype) if config.mamba_rms_norm else None
        self.conv_state: Tensor | None = None  # [slots, conv_dim, kernel - 1] (bind_states)
        self.ssm_state: Tensor | None = None  # [slots, heads, head_dim, d_state]

    def state_shapes(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """One slot's (conv state, SSM state) shapes."""
        return (self.conv_dim, self.kernel - 1), (self.heads, self.head_dim, self.d_state)

    def forward(self, x: Tensor, batch: ForwardBatch, cos_sin: Tensor | None = None) -> Tensor:
        z, xbc, dt = self.mamba_in(x).split([self.width, self.conv_dim, self.heads], dim=-1)
        if recurrent.can_use_triton(x):
            y = self._kernels(xbc, dt, batch)
            norm = None if self.norm is None else self.norm.weight
            return self.mamba_out(recurrent.gated_group_norm(y, z, norm, self.groups, self.eps, x.dtype))
        dt = recurrent.ssd_time_step(dt, self.dt_bias.weight)
        slots = batch.state_slots
        if batch.is_decode and slots is not None:
            y = self._decode(xbc, dt, slots, batch.context_lens)
        else:
            y = self._prefill(xbc, dt, batch, slots)
        if self.norm is None:
            y = y * F.silu(z.float())
        else:
            y = gated_group_norm(y, z.float(), self.norm.weight.float(), self.groups, self.eps)
        return self.mamba_out(y.to(x.dtype))

    def _conv_bias(self) -> Tensor | None:
        return None if self.conv_bias is None else self.conv_bias.weight.float()

    def _kernels(self, xbc: Tensor, dt: Tensor, batch: ForwardBatch) -> Tensor:
        """Every sequence of the step at once: the conv (float32 out) then the SSD recurrence (the time step from the
        raw dt: kernels/recurrent.ssd), each one Triton kernel; the gated norm after them is a third (forward)."""
        steps, device = state_steps(batch), xbc.device
        conv_shape, state_shape = self.state_shapes()
        conv_state = bound_or_scratch(self.conv_state, batch, conv_shape, xbc.dtype, device)
        state = bound_or_scratch(self.ssm_state, batch, state_shape, torch.float32, device)
        bias = None if self.conv_bias is None else self.conv_bias.weight
        conv = recurrent.causal_conv(xbc, self.conv.weight, bias, conv_state, steps, True, torch.float32)
        x, b, c = conv.split([self.width, self.groups * self.d_state, self.groups * self.d_state], dim=-1)
        return recurrent.ssd(x, dt, self.dt_bias.weight, self.A_log.weight, b, c, self.D.weight, state, steps)

    def _decode(self, xbc: Tensor, dt: Tensor, slots: Tensor, context_lens: Tensor) -> Tensor:
        """One token per sequence: device ops only (no host value of the step)."""
        fresh = context_lens == 1  # a one-token prompt: zero state
        conv = conv_step(self.conv_state, slots, fresh, xbc, self.conv.weight)
        conv = F.silu(conv if self.conv_bias is None else conv + self._conv_bias())
        x, b, c = conv.split([self.width, self.groups * self.d_state, self.groups * self.d_state], dim=-1)
        per_group = self.heads // self.groups
        x = x.unflatten(-1, (self.heads, self.head_dim))
        b, c = (t.unflatten(-1, (self.groups, self.d_state)).repeat_interleave(per_group, 1) for t in (b, c))
        a = -torch.exp(self.A_log.weight)
        state = self.ssm_state[slots].float() * ~fresh[:, None, None, None]
        state = state * torch.exp(dt * a)[:, :, None, None] + (dt[:, :, None] * x)[..., None] * b[:, :, None, :]
        self.ssm_state[slots] = state.to(self.ssm_state.dtype)
        y = torch.einsum("nhpd,nhd->nhp", state, c) + self.D.weight[None, :, None] * x
        return y.flatten(1)

    def _prefill(self, xbc: Tensor, dt: Tensor, batch: ForwardBatch, slots: Tensor | None) -> Tensor:
        """The step's leading one-token sequences (its decodes, listed first) together as `_decode`, then sequence by
        sequence: the conv after its conv state, the chunked SSD from its SSM state."""
        context_lens = batch.host_context_lens
        if context_lens is None:
            context_lens = batch.context_lens.tolist()
        outputs, offset = [], 0
        num_decodes = 0
        while slots is not None and num_decodes < len(batch.query_lens) and batch.query_lens[num_decodes] == 1:
            num_decodes += 1
        if num_decodes:
            rows = slice(0, num_decodes)
            outputs.append(self._decode(xbc[rows], dt[rows], slots[rows], batch.context_lens[rows]))
            offset = num_decodes
        a = -torch.exp(self.A_log.weight)
        for i, length in enumerate(batch.query_lens):
            if i < num_decodes:
                continue
            rows = slice(offset, offset + length)
            offset += length
            if slots is None or int(context_lens[i]) == length:  # starts fresh
                conv_state = xbc.new_zeros(self.conv_dim, self.kernel - 1, dtype=torch.float32)
                state = xbc.new_zeros(self.heads, self.head_dim, self.d_state, dtype=torch.float32)
            else:
                conv_state, state = self.conv_state[slots[i]].float(), self.ssm_state[slots[i]].float()
            conv, conv_state = causal_conv(xbc[rows].float(), self.conv.weight.float(), self._conv_bias(), conv_state)
            x, b, c = conv.split([self.width, self.groups * self.d_state, self.groups * self.d_state], dim=-1)
            x = x.unflatten(-1, (self.heads, self.head_dim))
            b, c = (t.unflatten(-1, (self.groups, self.d_state)) for t in (b, c))
            y = ssd_chunked(x, dt[rows], a, b, c, self.D.weight, state, self.chunk)
            if slots is not None:
                self.conv_state[slots[i]] = conv_state.to(self.conv_state.dtype)
                self.ssm_state[slots[i]] = state.to(self.ssm_state.dtype)
            outputs.append(y.flatten(1))
        return torch.cat(outputs)
