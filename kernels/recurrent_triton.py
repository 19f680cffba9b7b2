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

import torch
import triton
import triton.language as tl

from .recurrent import CHUNK


@triton.jit
def _sequence(cu_ptr, slot_ptr, fresh_ptr, seq):
    """Sequence seq's rows [start, end), its state slot, and whether it reads that slot (else zeros: fresh)."""
    start = tl.load(cu_ptr + seq).to(tl.int64)
    end = tl.load(cu_ptr + seq + 1).to(tl.int64)
    return start, end, tl.load(slot_ptr + seq).to(tl.int64), tl.load(fresh_ptr + seq) == 0


@triton.jit
def _read_state(state_ptr, slot, head, rows, cols, n_rows, n_cols, stride_slot, keep):
    """A program's tile (rows, cols) of head `head` in its sequence's slot of state [slots, heads, n_rows, n_cols]:
    the tile's pointers, its mask, and its values in float32 (zeros where the piece starts fresh)."""
    mask = (rows < n_rows)[:, None] & (cols < n_cols)[None, :]
    tile = state_ptr + slot * stride_slot + head * n_rows * n_cols + rows[:, None] * n_cols + cols[None, :]
    return tile, mask, tl.load(tile, mask=mask & keep, other=0.0).to(tl.float32)


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
                       scale, eps, beta_scale, long_from, RAW: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    ks = tl.arange(0, BK)
    vs = tl.program_id(2) * BV + tl.arange(0, BV)
    k_mask, v_mask = ks < key_dim, vs < value_dim
    start, end, slot, keep = _sequence(cu_ptr, slot_ptr, fresh_ptr, seq)
    if end - start < long_from:  # (longer pieces: the chunked kernels)
        tile, tile_mask, s = _read_state(state_ptr, slot, head, ks, vs, key_dim, value_dim, stride_slot, keep)
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
               eps: float, out, block_v: int = 32, num_warps: int = 4, raw: bool = True, long_from: int = 1 << 30):
    """The gated delta rule over each sequence's rows (module docstring), per value head h (key head h // group):
    q and k [T, key heads * key_dim] (raw: L2-normed here, q times scale), v [T, value heads * value_dim], a and b
    [T, value heads] (the raw gate projections, one row stride; g = -exp(a_log) softplus(a + dt_bias), beta =
    sigmoid(b) beta_scale computed here, a_log and dt_bias [value heads] float32; raw false: a and b are g and beta
    already, float32, a_log, dt_bias and beta_scale unread), state [slots, value heads,
    key_dim, value_dim] (float32, bfloat16 or float16: read into float32, rounded back once at the sequence's end);
    out [T, value heads * value_dim] float32 (o_t = S_t^T q_t). Pieces of long_from tokens or more are left alone
    (delta_rule_chunked's)."""
    assert a.stride() == b.stride()  # (one row stride for both)
    _, heads, key_dim, value_dim = state.shape
    group = heads // (q.shape[1] // key_dim)
    block_v = min(block_v, triton.next_power_of_2(value_dim))
    grid = (slots.numel(), heads, triton.cdiv(value_dim, block_v))
    _delta_rule_kernel[grid](
        q, k, v, a, b, a_log, dt_bias, state, out, cu_seqlens, slots, fresh, q.stride(0), v.stride(0), a.stride(0),
        out.stride(0), state.stride(0), group, key_dim, value_dim, scale, eps, beta_scale, long_from, RAW=raw,
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
                long_from, RAW: tl.constexpr, BP: tl.constexpr, BN: tl.constexpr):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    ps = tl.program_id(2) * BP + tl.arange(0, BP)
    ns = tl.arange(0, BN)
    p_mask, n_mask = ps < head_dim, ns < d_state
    start, end, slot, keep = _sequence(cu_ptr, slot_ptr, fresh_ptr, seq)
    if end - start < long_from:  # (longer pieces: the chunked kernels)
        tile, tile_mask, s = _read_state(state_ptr, slot, head, ps, ns, head_dim, d_state, stride_slot, keep)
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
        raw: bool = True, long_from: int = 1 << 30):
    """Mamba-2's recurrence over each sequence's rows (module docstring), per head h (group h // (heads / groups)):
    S <- exp(dt_t a_h) S + dt_t x_t b_t^T; y_t = S c_t + d_h x_t, with dt_t = softplus(raw dt_t + dt_bias_h) and a_h =
    -exp(a_log_h) computed here. x [T, heads * head_dim], dt [T, heads] (the raw projection, any row stride),
    dt_bias, a_log and d [heads] float32 (raw false: dt is the time step already, float32, dt_bias unread), b and c
    [T, groups * d_state], state [slots, heads, head_dim, d_state] (any float dtype, as delta_rule's); out [T, heads *
    head_dim] float32. Pieces of long_from tokens or more are left alone (ssd_chunked's)."""
    assert b.stride() == c.stride()  # (one row stride for both)
    _, heads, head_dim, d_state = state.shape
    per_group = heads // (b.shape[1] // d_state)
    block_p = min(block_p, triton.next_power_of_2(head_dim))
    grid = (slots.numel(), heads, triton.cdiv(head_dim, block_p))
    _ssd_kernel[grid](
        x, dt, dt_bias, a_log, b, c, d, state, out, cu_seqlens, slots, fresh, x.stride(0), dt.stride(0), b.stride(0),
        out.stride(0), state.stride(0), per_group, head_dim, d_state, long_from, RAW=raw, BP=block_p,
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


# Chunked forms for prefills (`delta_rule_chunked`, `ssd_chunked`): a sequence's tokens in chunks of CHUNK
# (kernels/recurrent.py), each chunk's work as tensor-core products, so a program's serial path is one step per chunk
# instead of one per token (the layers' torch forms: runtime/models/gated_deltanet.chunked_delta_rule,
# mamba2.ssd_chunked). DOT_PRECISION: the products' operands in tf32 (10 of float32's 23 mantissa bits, float32
# accumulation): 1.9-5.9x faster than three tf32 passes ("tf32x3", about float32) at Qwen3.5-9B's shapes (session
# 53), and closer to float32 than the bf16 operands of the published chunked kernels
DOT_PRECISION = "tf32"


@triton.jit
def _dot(a, b, PRECISION: tl.constexpr):
    """a @ b of float32 tiles: "bf16" rounds the operands to bfloat16 first, else tl.dot's input_precision."""
    if PRECISION == "bf16":
        return tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16))
    else:
        return tl.dot(a, b, input_precision=PRECISION)


@triton.jit
def _chunk_rows(end, first, C: tl.constexpr):
    """The chunk's in-sequence positions 0..C-1, its rows from `first`, which of them lie in the sequence."""
    ts = tl.arange(0, C)
    rows = first + ts
    return ts, rows, rows < end


@triton.jit
def _load_normed(ptr, rows, valid, cols, col_mask, stride, eps):
    """Rows of q or k [C, BK] float32, each L2-normed (x / sqrt(sum x^2 + eps)); rows outside the sequence zero."""
    x = tl.load(ptr + rows[:, None] * stride + cols[None, :], mask=valid[:, None] & col_mask[None, :],
                other=0.0).to(tl.float32)
    return x / tl.sqrt(tl.sum(x * x, axis=1) + eps)[:, None]


@triton.jit
def _decays(cum, ts, STRICT: tl.constexpr):
    """e^(cum_i - cum_j) for j < i (STRICT) or j <= i, else 0: [C, C] (the exponent taken only where it is <= 0)."""
    if STRICT:
        below = ts[:, None] > ts[None, :]
    else:
        below = ts[:, None] >= ts[None, :]
    return tl.where(below, tl.exp(tl.where(below, cum[:, None] - cum[None, :], 0.0)), 0.0)


@triton.jit
def _unit_lower_inverse(a, ts, C: tl.constexpr, PRECISION: tl.constexpr):
    """(I + A)^-1 of a strictly lower triangular A [C, C] (C a multiple of 16), in blocks of 16 rows: with D the inverse
    of (I + A)'s block diagonal, by forward substitution (row s of every block at once, 16 steps of one product each),
    and N = D L for L, A's strictly block-lower part (N^4 = 0 for C = 64), (I + A)^-1 = (I + N)^-1 D =
    (I - N + N^2 - N^3 ...) D."""
    eye = tl.where(ts[:, None] == ts[None, :], 1.0, 0.0)
    same_block = (ts[:, None] // 16) == (ts[None, :] // 16)
    a_diag = tl.where(same_block, a, 0.0)
    d = eye
    for s in tl.static_range(1, 16):  # each row of D: e_i - sum_j<i (A_diag)_ij D_j, the rows before it done
        row = (ts % 16 == s)[:, None]
        d = tl.where(row, eye - _dot(tl.where(row, a_diag, 0.0), d, PRECISION), d)
    n = -_dot(d, a - a_diag, PRECISION)  # -N
    series = eye + n  # I - N + N^2 - ... : C // 16 terms (N^(C // 16) = 0)
    power = n
    for _ in tl.static_range(2, C // 16):
        power = _dot(power, n, PRECISION)
        series += power
    return _dot(series, d, PRECISION)


@triton.jit
def _delta_rule_prep_kernel(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, w_ptr, u_ptr, p_ptr, cu_ptr, stride_qk, stride_v,
                            stride_gb, stride_w, stride_u, stride_p, group, key_dim, value_dim, scale, eps, long_from,
                            C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, PRECISION: tl.constexpr):
    """Program (sequence, chunk, value head): what the chunk's updates need but its start state, independent of the
    other chunks: with A_ij = beta_i e^(G_i - G_j) k_i.k_j (j < i) and T = (I + A)^-1, W = T (beta e^G k) [C, key_dim]
    and U~ = T (beta v) [C, value_dim], so that the updates are U = U~ - W S0; and the outputs' scores P =
    (e^(G_i - G_j) q_i.k_j, j <= i) [C, C]."""
    seq = tl.program_id(0)
    head = tl.program_id(2)
    start = tl.load(cu_ptr + seq).to(tl.int64)
    end = tl.load(cu_ptr + seq + 1).to(tl.int64)
    first = start + tl.program_id(1) * C
    if first < end and end - start >= long_from:
        ts, rows, valid = _chunk_rows(end, first, C)
        ks, vs = tl.arange(0, BK), tl.arange(0, BV)
        k_mask, v_mask = ks < key_dim, vs < value_dim
        k = _load_normed(k_ptr, rows, valid, (head // group) * key_dim + ks, k_mask, stride_qk, eps)
        g = tl.load(g_ptr + rows * stride_gb + head, mask=valid, other=0.0)
        beta = tl.load(beta_ptr + rows * stride_gb + head, mask=valid, other=0.0)
        cum = tl.cumsum(g, 0)
        a = beta[:, None] * _decays(cum, ts, True) * _dot(k, tl.trans(k), PRECISION)
        t = _unit_lower_inverse(a, ts, C, PRECISION)
        w = _dot(t, k * (beta * tl.exp(cum))[:, None], PRECISION)
        tl.store(w_ptr + rows[:, None] * stride_w + (head * key_dim + ks)[None, :], w,
                 mask=valid[:, None] & k_mask[None, :])
        v = tl.load(v_ptr + rows[:, None] * stride_v + (head * value_dim + vs)[None, :],
                    mask=valid[:, None] & v_mask[None, :], other=0.0).to(tl.float32)
        u = _dot(t, v * beta[:, None], PRECISION)
        tl.store(u_ptr + rows[:, None] * stride_u + (head * value_dim + vs)[None, :], u,
                 mask=valid[:, None] & v_mask[None, :])
        q = _load_normed(q_ptr, rows, valid, (head // group) * key_dim + ks, k_mask, stride_qk, eps) * scale
        scores = _decays(cum, ts, False) * _dot(q, tl.trans(k), PRECISION)
        tl.store(p_ptr + rows[:, None] * stride_p + (head * C + ts)[None, :], scores, mask=valid[:, None])


@triton.jit
def _delta_rule_scan_kernel(q_ptr, k_ptr, g_ptr, w_ptr, u_ptr, p_ptr, state_ptr, out_ptr, cu_ptr, slot_ptr, fresh_ptr,
                            stride_qk, stride_gb, stride_w, stride_u, stride_p, stride_out, stride_slot, group, key_dim,
                            value_dim, scale, eps, long_from, C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                            PRECISION: tl.constexpr):
    """Program (sequence, value head, value tile): the sequence's chunks in order from its state tile S [key_dim, BV]:
    U = U~ - W S; o = e^G (q S) + P U; S <- e^(G_C) S + (e^(G_C - G) k)^T U."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    ks = tl.arange(0, BK)
    vs = tl.program_id(2) * BV + tl.arange(0, BV)
    k_mask, v_mask = ks < key_dim, vs < value_dim
    start, end, slot, keep = _sequence(cu_ptr, slot_ptr, fresh_ptr, seq)
    if end - start >= long_from:  # (shorter pieces: the token loop)
        tile, tile_mask, s = _read_state(state_ptr, slot, head, ks, vs, key_dim, value_dim, stride_slot, keep)
        qk_cols = (head // group) * key_dim + ks
        for first in range(start, end, C):
            ts, rows, valid = _chunk_rows(end, first, C)
            row_v = valid[:, None] & v_mask[None, :]
            q = _load_normed(q_ptr, rows, valid, qk_cols, k_mask, stride_qk, eps) * scale
            k = _load_normed(k_ptr, rows, valid, qk_cols, k_mask, stride_qk, eps)
            g = tl.load(g_ptr + rows * stride_gb + head, mask=valid, other=0.0)
            cum = tl.cumsum(g, 0)
            w = tl.load(w_ptr + rows[:, None] * stride_w + (head * key_dim + ks)[None, :],
                        mask=valid[:, None] & k_mask[None, :], other=0.0)
            u = tl.load(u_ptr + rows[:, None] * stride_u + (head * value_dim + vs)[None, :], mask=row_v, other=0.0)
            u -= _dot(w, s, PRECISION)
            scores = tl.load(p_ptr + rows[:, None] * stride_p + (head * C + ts)[None, :], mask=valid[:, None],
                             other=0.0)
            o = tl.exp(cum)[:, None] * _dot(q, s, PRECISION)
            o += _dot(scores, u, PRECISION)
            tl.store(out_ptr + rows[:, None] * stride_out + (head * value_dim + vs)[None, :], o, mask=row_v)
            last = tl.sum(g, axis=0)  # G at the chunk's last row (rows past the sequence add 0)
            s = tl.exp(last) * s + _dot(tl.trans(k * tl.exp(last - cum)[:, None]), u, PRECISION)
        tl.store(tile, s.to(state_ptr.dtype.element_ty), mask=tile_mask)


def delta_rule_chunked(q, k, v, g, beta, state, slots, fresh, cu_seqlens, scale: float, eps: float, out, max_len: int,
                       long_from: int = 1, block_v: int = 32, num_warps: int = 4, num_stages: int = 1):
    """delta_rule's result (raw false: g and beta float32 [T, value heads], one row stride) for the pieces of long_from
    tokens or more (the others left alone), in chunks of CHUNK tokens: two launches, the chunks' W, U~ and P (float32
    scratch [T, value heads * (key_dim + value_dim + CHUNK)]) in parallel over every chunk, then each sequence's chunks
    in order. max_len: at least the longest piece."""
    assert g.stride() == beta.stride()
    _, heads, key_dim, value_dim = state.shape
    group = heads // (q.shape[1] // key_dim)
    scratch = torch.empty(q.shape[0], heads * (key_dim + value_dim + CHUNK), dtype=torch.float32, device=q.device)
    w, u, p = scratch.split([heads * key_dim, heads * value_dim, heads * CHUNK], dim=1)
    bk, bv_all = max(16, triton.next_power_of_2(key_dim)), max(16, triton.next_power_of_2(value_dim))
    num_seqs = slots.numel()
    _delta_rule_prep_kernel[(num_seqs, triton.cdiv(max_len, CHUNK), heads)](
        q, k, v, g, beta, w, u, p, cu_seqlens, q.stride(0), v.stride(0), g.stride(0), w.stride(0), u.stride(0),
        p.stride(0), group, key_dim, value_dim, scale, eps, long_from, C=CHUNK, BK=bk, BV=bv_all,
        PRECISION=DOT_PRECISION, num_warps=num_warps, num_stages=num_stages)
    block_v = max(16, min(block_v, triton.next_power_of_2(value_dim)))
    _delta_rule_scan_kernel[(num_seqs, heads, triton.cdiv(value_dim, block_v))](
        q, k, g, w, u, p, state, out, cu_seqlens, slots, fresh, q.stride(0), g.stride(0), w.stride(0), u.stride(0),
        p.stride(0), out.stride(0), state.stride(0), group, key_dim, value_dim, scale, eps, long_from, C=CHUNK, BK=bk,
        BV=block_v, PRECISION=DOT_PRECISION, num_warps=num_warps, num_stages=num_stages)
    return out


@triton.jit
def _ssd_chunked_kernel(x_ptr, dt_ptr, a_log_ptr, b_ptr, c_ptr, d_ptr, state_ptr, out_ptr, cu_ptr, slot_ptr, fresh_ptr,
                        stride_x, stride_dt, stride_bc, stride_out, stride_slot, per_group, head_dim, d_state,
                        long_from, C: tl.constexpr, BP: tl.constexpr, BN: tl.constexpr, PRECISION: tl.constexpr):
    """Program (sequence, head, head_dim tile): the sequence's chunks in order from its state tile S [BP, d_state],
    with G the cumulative dt a over the chunk: y = e^G (c S^T) + (e^(G_i - G_j) c_i.b_j, j <= i) (dt x) + d x;
    S <- e^(G_C) S + (e^(G_C - G) dt x)^T b."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    ps = tl.program_id(2) * BP + tl.arange(0, BP)
    ns = tl.arange(0, BN)
    p_mask, n_mask = ps < head_dim, ns < d_state
    start, end, slot, keep = _sequence(cu_ptr, slot_ptr, fresh_ptr, seq)
    if end - start >= long_from:  # (shorter pieces: the token loop)
        tile, tile_mask, s = _read_state(state_ptr, slot, head, ps, ns, head_dim, d_state, stride_slot, keep)
        a = -tl.exp(tl.load(a_log_ptr + head))
        d = tl.load(d_ptr + head)
        bc_cols = (head // per_group) * d_state + ns
        for first in range(start, end, C):
            ts, rows, valid = _chunk_rows(end, first, C)
            row_p = valid[:, None] & p_mask[None, :]
            row_n = valid[:, None] & n_mask[None, :]
            x = tl.load(x_ptr + rows[:, None] * stride_x + (head * head_dim + ps)[None, :], mask=row_p,
                        other=0.0).to(tl.float32)
            dt = tl.load(dt_ptr + rows * stride_dt + head, mask=valid, other=0.0)
            b = tl.load(b_ptr + rows[:, None] * stride_bc + bc_cols[None, :], mask=row_n, other=0.0).to(tl.float32)
            c = tl.load(c_ptr + rows[:, None] * stride_bc + bc_cols[None, :], mask=row_n, other=0.0).to(tl.float32)
            cum = tl.cumsum(dt * a, 0)
            xdt = x * dt[:, None]
            scores = _decays(cum, ts, False) * _dot(c, tl.trans(b), PRECISION)
            y = tl.exp(cum)[:, None] * _dot(c, tl.trans(s), PRECISION)
            y += _dot(scores, xdt, PRECISION) + d * x
            tl.store(out_ptr + rows[:, None] * stride_out + (head * head_dim + ps)[None, :], y, mask=row_p)
            last = tl.sum(dt * a, axis=0)
            s = tl.exp(last) * s + _dot(tl.trans(xdt * tl.exp(last - cum)[:, None]), b, PRECISION)
        tl.store(tile, s.to(state_ptr.dtype.element_ty), mask=tile_mask)


def ssd_chunked(x, dt, a_log, b, c, d, state, slots, fresh, cu_seqlens, out, long_from: int = 1, block_p: int = 64,
                num_warps: int = 4, num_stages: int = 1):
    """ssd's result (raw false: dt the time step, float32) for the pieces of long_from tokens or more (the others left
    alone) in chunks of CHUNK tokens, one launch."""
    assert b.stride() == c.stride()
    _, heads, head_dim, d_state = state.shape
    per_group = heads // (b.shape[1] // d_state)
    block_p = max(16, min(block_p, triton.next_power_of_2(head_dim)))
    _ssd_chunked_kernel[(slots.numel(), heads, triton.cdiv(head_dim, block_p))](
        x, dt, a_log, b, c, d, state, out, cu_seqlens, slots, fresh, x.stride(0), dt.stride(0), b.stride(0),
        out.stride(0), state.stride(0), per_group, head_dim, d_state, long_from, C=CHUNK, BP=block_p,
        BN=max(16, triton.next_power_of_2(d_state)), PRECISION=DOT_PRECISION, num_warps=num_warps,
        num_stages=num_stages)
    return out
