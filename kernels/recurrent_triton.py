"""Triton kernels of the hybrid models' state layers (imported only when a kernel runs): the depthwise causal conv,
Gated DeltaNet's delta rule and Mamba-2's SSD recurrence, each over a step's sequences of any lengths at once (a
decode is a sequence of one token), each sequence continuing from its state slot or from zero, its state after its
last token written back to the slot in place.

Sequence i owns the rows cu_seqlens[i] .. cu_seqlens[i + 1] of the step's token-major inputs, the state slot
slots[i], and starts from zero state where fresh[i]. One program runs one sequence's tokens in order, its state tile in
registers: read once, written once, so a step moves each sequence's state through memory twice whatever its length
(the torch path gathers, rescales, updates and scatters it, ~10 passes per token).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _sequence(cu_ptr, slot_ptr, fresh_ptr, seq):
    """Sequence seq's rows [start, end), its state slot, and whether it reads that slot (else zeros: fresh)."""
    start = tl.load(cu_ptr + seq).to(tl.int64)
    end = tl.load(cu_ptr + seq + 1).to(tl.int64)
    return start, end, tl.load(slot_ptr + seq).to(tl.int64), tl.load(fresh_ptr + seq) == 0


@triton.jit
def _softplus(x):
    """torch's softplus (threshold 20: above it, x as is)."""
    return tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))))


@triton.jit
def _causal_conv_kernel(x_ptr, w_ptr, bias_ptr, state_ptr, out_ptr, cu_ptr, slot_ptr, fresh_ptr, channels,
                        stride_x, stride_out, stride_slot, stride_channel,
                        K: tl.constexpr, KP: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr,
                        WRITE_STATE: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr):
    """Program (sequence, channel block, token block): the outputs of BT of the sequence's rows; with WRITE_STATE (every
    piece within one token block) also the sequence's new state, after its reads of the old."""
    seq = tl.program_id(0)
    cols = tl.program_id(1) * BC + tl.arange(0, BC)
    col_mask = cols < channels
    start, end, slot, keep = _sequence(cu_ptr, slot_ptr, fresh_ptr, seq)
    rows = start + tl.program_id(2) * BT + tl.arange(0, BT)
    if start + tl.program_id(2) * BT < end:
        state = state_ptr + slot * stride_slot + cols.to(tl.int64) * stride_channel
        row_mask = (rows < end)[:, None] & col_mask[None, :]
        acc = tl.zeros([BT, BC], dtype=tl.float32)
        for j in tl.static_range(K):
            src = rows - (K - 1) + j  # the input this tap reads: a row of x, or (before the piece) of the state
            in_piece = (src >= start)[:, None]
            xv = tl.load(x_ptr + src[:, None] * stride_x + cols[None, :], mask=row_mask & in_piece,
                         other=0.0).to(tl.float32)
            sv = tl.load(state[None, :] + (K - 1 + src - start)[:, None], mask=row_mask & ~in_piece & keep,
                         other=0.0).to(tl.float32)
            acc += (xv + sv) * tl.load(w_ptr + cols * K + j, mask=col_mask, other=0.0).to(tl.float32)[None, :]
        if HAS_BIAS:
            acc += tl.load(bias_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
        if SILU:
            acc = acc * tl.sigmoid(acc)
        tl.store(out_ptr + rows[:, None] * stride_out + cols[None, :], acc.to(out_ptr.dtype.element_ty), mask=row_mask)
        if WRITE_STATE:
            _write_conv_state(x_ptr, state, start, end, keep, cols, col_mask, stride_x, K, KP)


@triton.jit
def _write_conv_state(x_ptr, state, start, end, keep, cols, col_mask, stride_x, K: tl.constexpr, KP: tl.constexpr):
    """The state after the piece: its last K - 1 inputs (some still the old state's when the piece is shorter)."""
    taps = tl.arange(0, KP)
    src = end - (K - 1) + taps
    in_piece = (src >= start)[None, :]
    tap_mask = col_mask[:, None] & (taps < K - 1)[None, :]
    new = tl.load(x_ptr + src[None, :] * stride_x + cols[:, None], mask=tap_mask & in_piece, other=0.0).to(tl.float32)
    new += tl.load(state[:, None] + (K - 1 + src - start)[None, :], mask=tap_mask & ~in_piece & keep,
                   other=0.0).to(tl.float32)
    tl.debug_barrier()  # every thread's reads of the old state come before any write of the new
    tl.store(state[:, None] + taps[None, :], new.to(state.dtype.element_ty), mask=tap_mask)


@triton.jit
def _conv_state_kernel(x_ptr, state_ptr, cu_ptr, slot_ptr, fresh_ptr, channels, stride_x, stride_slot, stride_channel,
                       K: tl.constexpr, KP: tl.constexpr, BC: tl.constexpr):
    """Program (sequence, channel block): the sequence's new conv state, after every output's read of the old."""
    seq = tl.program_id(0)
    cols = tl.program_id(1) * BC + tl.arange(0, BC)
    start, end, slot, keep = _sequence(cu_ptr, slot_ptr, fresh_ptr, seq)
    state = state_ptr + slot * stride_slot + cols.to(tl.int64) * stride_channel
    _write_conv_state(x_ptr, state, start, end, keep, cols, cols < channels, stride_x, K, KP)


def causal_conv(x, weight, bias, state, slots, fresh, cu_seqlens, silu: bool, out, max_len: int):
    """out[rows of seq i] = (silu of) the depthwise causal conv (weight [C, K], + bias) of x [T, C] after state[slots[i]]
    [C, K - 1] (zeros where fresh[i]); state[slots[i]] becomes the last K - 1 inputs. out [T, C] in any dtype. max_len:
    at least the longest piece (1: a decode step, one launch; else a second launch writes the states)."""
    channels, kernel = weight.shape
    assert state.stride(2) == 1 and weight.is_contiguous()
    block_c = min(128, triton.next_power_of_2(channels))
    block_t = 16 if max_len > 1 else 1
    token_blocks = triton.cdiv(max_len, block_t)
    kp = triton.next_power_of_2(max(kernel - 1, 1))
    grid = (slots.numel(), triton.cdiv(channels, block_c), token_blocks)
    _causal_conv_kernel[grid](
        x, weight, bias if bias is not None else weight, state, out, cu_seqlens, slots, fresh, channels,
        x.stride(0), out.stride(0), state.stride(0), state.stride(1),
        K=kernel, KP=kp, HAS_BIAS=bias is not None, SILU=silu, WRITE_STATE=token_blocks == 1, BT=block_t, BC=block_c)
    if token_blocks > 1:
        _conv_state_kernel[grid[:2]](x, state, cu_seqlens, slots, fresh, channels, x.stride(0), state.stride(0),
                                     state.stride(1), K=kernel, KP=kp, BC=block_c)
    return out


@triton.jit
def _delta_rule_kernel(q_ptr, k_ptr, v_ptr, a_ptr, b_ptr, a_log_ptr, dt_bias_ptr, state_ptr, out_ptr, cu_ptr, slot_ptr,
                       fresh_ptr, stride_qk, stride_v, stride_ab, stride_out, stride_slot, group, key_dim, value_dim,
                       scale, eps, beta_scale, RAW: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    ks = tl.arange(0, BK)
    vs = tl.program_id(2) * BV + tl.arange(0, BV)
    k_mask, v_mask = ks < key_dim, vs < value_dim
    tile_mask = k_mask[:, None] & v_mask[None, :]
    start, end, slot, keep = _sequence(cu_ptr, slot_ptr, fresh_ptr, seq)
    tile = (state_ptr + slot * stride_slot + head * key_dim * value_dim
            + ks[:, None] * value_dim + vs[None, :])
    s = tl.load(tile, mask=tile_mask & keep, other=0.0).to(tl.float32)
    qk_cols = (head // group) * key_dim + ks
    if RAW:
        neg_a = -tl.exp(tl.load(a_log_ptr + head))
        dt_bias = tl.load(dt_bias_ptr + head)
    for t in range(start, end):
        q = tl.load(q_ptr + t * stride_qk + qk_cols, mask=k_mask, other=0.0).to(tl.float32)
        k = tl.load(k_ptr + t * stride_qk + qk_cols, mask=k_mask, other=0.0).to(tl.float32)
        v = tl.load(v_ptr + t * stride_v + head * value_dim + vs, mask=v_mask, other=0.0).to(tl.float32)
        if RAW:  # the gates from the raw projections: g = -exp(A_log) softplus(a + dt_bias), beta = sigmoid(b)
            # rounded to b's dtype (as the model computes it), times beta_scale
            raw_b = tl.load(b_ptr + t * stride_ab + head)
            beta = tl.sigmoid(raw_b.to(tl.float32)).to(raw_b.dtype).to(tl.float32) * beta_scale
            decay = tl.exp(neg_a * _softplus(tl.load(a_ptr + t * stride_ab + head).to(tl.float32) + dt_bias))
        else:  # a holds g, b holds beta (float32)
            decay = tl.exp(tl.load(a_ptr + t * stride_ab + head))
            beta = tl.load(b_ptr + t * stride_ab + head)
        q = q * (scale / tl.sqrt(tl.sum(q * q, axis=0) + eps))
        k = k / tl.sqrt(tl.sum(k * k, axis=0) + eps)
        s = s * decay
        update = (v - tl.sum(s * k[:, None], axis=0)) * beta
        s += k[:, None] * update[None, :]
        tl.store(out_ptr + t * stride_out + head * value_dim + vs, tl.sum(s * q[:, None], axis=0), mask=v_mask)
    tl.store(tile, s.to(state_ptr.dtype.element_ty), mask=tile_mask)


def delta_rule(q, k, v, a, b, a_log, dt_bias, beta_scale: float, state, slots, fresh, cu_seqlens, scale: float,
               eps: float, out, block_v: int = 32, num_warps: int = 4, raw: bool = True):
    """The gated delta rule over each sequence's rows (module docstring), per value head h (key head h // group):
    q and k [T, key heads * key_dim] (raw: L2-normed here, q times scale), v [T, value heads * value_dim], a and b
    [T, value heads] (the raw gate projections, one row stride; g = -exp(a_log) softplus(a + dt_bias), beta =
    sigmoid(b) beta_scale computed here, a_log and dt_bias [value heads] float32; raw false: a and b are g and beta
    already, float32, a_log, dt_bias and beta_scale unread), state [slots, value heads,
    key_dim, value_dim] (float32, bfloat16 or float16: read into float32, rounded back once at the sequence's end);
    out [T, value heads * value_dim] float32 (o_t = S_t^T q_t)."""
    assert a.stride() == b.stride()  # (one row stride for both)
    _, heads, key_dim, value_dim = state.shape
    group = heads // (q.shape[1] // key_dim)
    block_v = min(block_v, triton.next_power_of_2(value_dim))
    grid = (slots.numel(), heads, triton.cdiv(value_dim, block_v))
    _delta_rule_kernel[grid](
        q, k, v, a, b, a_log, dt_bias, state, out, cu_seqlens, slots, fresh, q.stride(0), v.stride(0), a.stride(0),
        out.stride(0), state.stride(0), group, key_dim, value_dim, scale, eps, beta_scale, RAW=raw,
        BK=triton.next_power_of_2(key_dim), BV=block_v, num_warps=num_warps)
    return out


@triton.jit
def _gated_rms_norm_kernel(o_ptr, z_ptr, w_ptr, out_ptr, heads, head_dim, stride_o, stride_z, stride_out, eps,
                           BH: tl.constexpr, BD: tl.constexpr):
    """Program (row, head block): BH heads' w * rms_norm(o) * silu(z), each rounding where the torch form does."""
    row = tl.program_id(0).to(tl.int64)
    hs = tl.program_id(1) * BH + tl.arange(0, BH)
    ds = tl.arange(0, BD)
    mask = (hs < heads)[:, None] & (ds < head_dim)[None, :]
    cols = hs[:, None] * head_dim + ds[None, :]
    z = tl.load(z_ptr + row * stride_z + cols, mask=mask, other=0.0)
    o = tl.load(o_ptr + row * stride_o + cols, mask=mask, other=0.0).to(z.dtype).to(tl.float32)
    normed = (o * tl.rsqrt(tl.sum(o * o, axis=1) / head_dim + eps)[:, None]).to(z.dtype)
    w = tl.load(w_ptr + ds, mask=ds < head_dim, other=0.0)
    weighted = (w.to(tl.float32)[None, :] * normed.to(tl.float32)).to(z.dtype).to(tl.float32)
    zf = z.to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, (weighted * (zf * tl.sigmoid(zf))).to(out_ptr.dtype.element_ty),
             mask=mask)


def gated_rms_norm(o, z, weight, eps: float, out, block_heads: int = 4):
    """Qwen3.5's gated RMSNorm per head: out = (w * rms_norm(o rounded to z's dtype), rounded) * silu(z), in z's dtype;
    o [T, heads * head_dim] float32, z [T, heads * head_dim] (any row stride), weight [head_dim]."""
    head_dim = weight.numel()
    heads = o.shape[1] // head_dim
    block_heads = min(block_heads, triton.next_power_of_2(heads))
    grid = (o.shape[0], triton.cdiv(heads, block_heads))
    _gated_rms_norm_kernel[grid](o, z, weight, out, heads, head_dim, o.stride(0), z.stride(0), out.stride(0), eps,
                                 BH=block_heads, BD=triton.next_power_of_2(head_dim))
    return out


@triton.jit
def _ssd_kernel(x_ptr, dt_ptr, dt_bias_ptr, a_log_ptr, b_ptr, c_ptr, d_ptr, state_ptr, out_ptr, cu_ptr, slot_ptr,
                fresh_ptr, stride_x, stride_dt, stride_bc, stride_out, stride_slot, per_group, head_dim, d_state,
                RAW: tl.constexpr, BP: tl.constexpr, BN: tl.constexpr):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    ps = tl.program_id(2) * BP + tl.arange(0, BP)
    ns = tl.arange(0, BN)
    p_mask, n_mask = ps < head_dim, ns < d_state
    tile_mask = p_mask[:, None] & n_mask[None, :]
    start, end, slot, keep = _sequence(cu_ptr, slot_ptr, fresh_ptr, seq)
    tile = (state_ptr + slot * stride_slot + head * head_dim * d_state
            + ps[:, None] * d_state + ns[None, :])
    s = tl.load(tile, mask=tile_mask & keep, other=0.0).to(tl.float32)
    a = -tl.exp(tl.load(a_log_ptr + head))
    d = tl.load(d_ptr + head)
    if RAW:
        dt_bias = tl.load(dt_bias_ptr + head)
    bc_cols = (head // per_group) * d_state + ns
    for t in range(start, end):
        x = tl.load(x_ptr + t * stride_x + head * head_dim + ps, mask=p_mask, other=0.0).to(tl.float32)
        if RAW:  # the time step from the raw projection: softplus(dt + dt_bias)
            dt = _softplus(tl.load(dt_ptr + t * stride_dt + head).to(tl.float32) + dt_bias)
        else:  # dt holds the time step already, float32
            dt = tl.load(dt_ptr + t * stride_dt + head)
        b = tl.load(b_ptr + t * stride_bc + bc_cols, mask=n_mask, other=0.0).to(tl.float32)
        c = tl.load(c_ptr + t * stride_bc + bc_cols, mask=n_mask, other=0.0).to(tl.float32)
        s = s * tl.exp(dt * a) + (dt * x)[:, None] * b[None, :]
        tl.store(out_ptr + t * stride_out + head * head_dim + ps, tl.sum(s * c[None, :], axis=1) + d * x,
                 mask=p_mask)
    tl.store(tile, s.to(state_ptr.dtype.element_ty), mask=tile_mask)


def ssd(x, dt, dt_bias, a_log, b, c, d, state, slots, fresh, cu_seqlens, out, block_p: int = 16, num_warps: int = 4,
        raw: bool = True):
    """Mamba-2's recurrence over each sequence's rows (module docstring), per head h (group h // (heads / groups)):
    S <- exp(dt_t a_h) S + dt_t x_t b_t^T; y_t = S c_t + d_h x_t, with dt_t = softplus(raw dt_t + dt_bias_h) and a_h =
    -exp(a_log_h) computed here. x [T, heads * head_dim], dt [T, heads] (the raw projection, any row stride),
    dt_bias, a_log and d [heads] float32 (raw false: dt is the time step already, float32, dt_bias unread), b and c
    [T, groups * d_state], state [slots, heads, head_dim, d_state] (any float dtype, as delta_rule's); out [T, heads *
    head_dim] float32."""
    assert b.stride() == c.stride()  # (one row stride for both)
    _, heads, head_dim, d_state = state.shape
    per_group = heads // (b.shape[1] // d_state)
    block_p = min(block_p, triton.next_power_of_2(head_dim))
    grid = (slots.numel(), heads, triton.cdiv(head_dim, block_p))
    _ssd_kernel[grid](
        x, dt, dt_bias, a_log, b, c, d, state, out, cu_seqlens, slots, fresh, x.stride(0), dt.stride(0), b.stride(0),
        out.stride(0), state.stride(0), per_group, head_dim, d_state, RAW=raw, BP=block_p,
        BN=triton.next_power_of_2(d_state), num_warps=num_warps)
    return out


@triton.jit
def _gated_group_norm_kernel(y_ptr, z_ptr, w_ptr, out_ptr, group_size, stride_y, stride_z, stride_out, eps,
                             NORM: tl.constexpr, BLOCK: tl.constexpr):
    """Program (row, group): h = y silu(z) over the group's columns, with NORM its RMSNorm times the weight."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * group_size + tl.arange(0, BLOCK)
    mask = tl.arange(0, BLOCK) < group_size
    y = tl.load(y_ptr + row * stride_y + cols, mask=mask, other=0.0).to(tl.float32)
    z = tl.load(z_ptr + row * stride_z + cols, mask=mask, other=0.0).to(tl.float32)
    h = y * (z * tl.sigmoid(z))
    if NORM:
        h = h * tl.rsqrt(tl.sum(h * h, axis=0) / group_size + eps)
        h = h * tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, h.to(out_ptr.dtype.element_ty), mask=mask)


def gated_group_norm(y, z, weight, groups: int, eps: float, out):
    """Mamba-2's gated norm: out = RMSNorm of y silu(z) over each of `groups` column groups times weight (weight None:
    y silu(z) alone, Falcon-H1's mamba_rms_norm false), in out's dtype; y [T, width] float32, z [T, width] (any row
    stride)."""
    group_size = y.shape[1] // groups
    _gated_group_norm_kernel[(y.shape[0], groups)](
        y, z, weight if weight is not None else y, out, group_size, y.stride(0), z.stride(0), out.stride(0), eps,
        NORM=weight is not None, BLOCK=triton.next_power_of_2(group_size))
    return out
