"""Granite 4.0's Mamba-2 mixer in torch ops (float32), for one sequence at a time, state carried in and out: its conv
state [conv_dim, kernel - 1] (the last inputs of the causal depthwise conv over x, B and C) and its SSM state
[heads, head_dim, d_state]. NOT yet wired into the decoder: the step before Granite 4.0's hybrid layers (the state
slots of runtime/models/gated_deltanet.py, generalised to a layer kind's own state tensors).

Per head h (group g = h // (heads / groups)), dt_t = softplus(dt_raw_t + dt_bias) clamped to time_step_limit,
S <- exp(dt_t A_h) S + dt_t x_t B_t^T; y_t = S C_t + D_h x_t. `ssd_step` runs it for one token (decodes);
`ssd_chunked` in chunks of C tokens in closed form (prefill chunks): within a chunk, with a_t the cumulative
dt A, y_t = exp(a_t) S0 C_t + sum_{s <= t} exp(a_t - a_s) dt_s (C_t . B_s) x_s + D x_t and the state at its end
exp(a_C) S0 + sum_s exp(a_C - a_s) dt_s x_s B_s^T. The output is gated and normed per group (y silu(z), RMSNorm over
each group's columns) before out_proj."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def causal_conv(xbc: Tensor, weight: Tensor, bias: Tensor | None, state: Tensor) -> tuple[Tensor, Tensor]:
    """SiLU of the depthwise causal conv of xbc [T, conv_dim] (weight [conv_dim, kernel]) continuing from state
    [conv_dim, kernel - 1]; returns (out [T, conv_dim], the new state)."""
    kernel = weight.shape[1]
    padded = torch.cat([state.t(), xbc], dim=0)  # [kernel - 1 + T, conv_dim]
    windows = padded.unfold(0, kernel, 1)  # [T, conv_dim, kernel]
    out = (windows * weight).sum(-1) + (0 if bias is None else bias)
    return F.silu(out), padded[-(kernel - 1):].t().contiguous()


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
