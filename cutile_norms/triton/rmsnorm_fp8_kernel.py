"""RMSNorm (optionally after the residual add) with an FP8 output, in Triton: the kernel (its launch
rule in rmsnorm_fp8_config.py, the wrapper in rmsnorm_fp8.py).

    h = x + r (optional; stored)     y = h * rstd * (offset + w)   (fp32, never rounded to 16 bits;
                                     at offset 0 h * rstd * w, the weight as it is)
    q = fp8(y * (1 / s))             s: a given per-tensor scale, or per row, or per 1 x GROUP columns

The dynamic scales follow `reference.fp8_scale` op for op (max(min(amax, ub), 1e-12) / the format's
largest value, IEEE division; UE8M0 rounded up to a power of two from the bits), and q follows
`reference.fp8_quantize` (1 / s with IEEE division once per scale, one multiply per element, clamp
keeping NaN, round to nearest even), so on the GPU the kernel and the reference agree bit for bit
given the kernel's rstd. The kernel is instruction bound at the H200's copy rate, so every instruction
per element counts (sm_90 SASS per element per thread, `python bench/probe/fp8_sass.py`):
  * the reciprocal once per scale: a division per element (div.rn is a multi-instruction sequence)
    ran 0.35-0.75 of a copy of its bytes against 0.84-0.97 (H100, bf16, 2048-16384);
  * no clamp before the conversion: cvt.rn.satfinite rounds, saturates to the format's largest value
    and keeps NaN, which is the reference's clamp; and each amax one NaN-propagating max (max.NaN)
    instead of a max and a count of NaN: 18.8-20.8 instructions against 25.5-27.8, and 0.88-0.96
    against 0.70-0.77 of a copy at 2048 / 4096 / 8192 on an H200, 0.99-1.00 against 0.93-0.99 on an
        H100 (`python bench/residual.py --parts fp8`, docs/performance.md 2.16), the same bits.
Rows of up to fp8.FP8_KERNEL_MAX_N elements (the rule that picks this kernel holds the bound), in
registers as one power-of-two block (`launch_config`): x (and r) read from memory once, q (and h)
written once.
"""
from __future__ import annotations

import triton
import triton.language as tl

from ._common import bound, row_offsets, row_tile, weight_row


@triton.jit
def _scale_of(amax, nan, scale_ub, HAS_UB: tl.constexpr, UE8M0: tl.constexpr, TOP: tl.constexpr,
              MIN_AMAX: tl.constexpr):
    a = amax
    if HAS_UB:
        a = tl.minimum(a, scale_ub)
    s = tl.math.div_rn(tl.maximum(a, MIN_AMAX), TOP)
    if UE8M0:
        bits = s.to(tl.int32, bitcast=True)
        exp = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(tl.int32)
        s = (exp << 23).to(tl.float32, bitcast=True)
    return tl.where(nan, float("nan"), s)


@triton.jit
def _max_nan(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _normed(hf, rstd, w, HAS_W: tl.constexpr):
    """y = h * rstd * (offset + w) in fp32 (w: _load_rows', without an offset the weight as it is), in this
    order (the reference's)."""
    y = hf * rstd[:, None]
    if HAS_W:
        y = y * w[None, :]
    return y


@triton.jit
def _emit(Q, S, rows, row_ok, cols, y, mask, inv_row, scale_ub, N, ROWS: tl.constexpr, SIZE: tl.constexpr,
          GROUP: tl.constexpr, STATIC: tl.constexpr, HAS_UB: tl.constexpr, UE8M0: tl.constexpr,
          TOP: tl.constexpr, MIN_AMAX: tl.constexpr, ALIGN: tl.constexpr):
    """q of SIZE columns `cols` (and, with 1 x GROUP scales, the scales of their groups; the groups past
    N, all zeros, are not stored) stored. q is y * (1 / s) unclamped: its conversion (cvt.rn.satfinite) saturates to
    the format's largest value and keeps NaN, as the reference's clamp does."""
    if GROUP == 0 or STATIC:
        q = y * inv_row[:, None]
    else:  # one scale per 1 x GROUP columns: the block holds whole groups
        G: tl.constexpr = SIZE // GROUP
        yg = tl.reshape(y, (ROWS, G, GROUP))
        amax_g = tl.reduce(tl.abs(yg), 2, _max_nan)  # max.NaN: a NaN of the group is its amax
        s = _scale_of(amax_g, amax_g != amax_g, scale_ub, HAS_UB, UE8M0, TOP, MIN_AMAX)
        gcols = tl.arange(0, G)
        tl.store(S + rows[:, None] * (N // GROUP) + gcols[None, :], s,
                 mask=row_ok[:, None] & (gcols < N // GROUP)[None, :])
        q = tl.reshape(yg * tl.math.div_rn(1.0, s)[:, :, None], (ROWS, SIZE))
    tl.store(Q + row_offsets(rows, N, ALIGN) + cols[None, :], q.to(Q.dtype.element_ty), mask=mask)


@triton.jit
def _load_rows(X, R, W, H, rows, row_ok, cols, stride_x, stride_r, N, offset, HAS_R: tl.constexpr,
               HAS_W: tl.constexpr, H_DTYPE: tl.constexpr, BLOCK_N: tl.constexpr, ALIGN: tl.constexpr,
               HAS_OFFSET: tl.constexpr):
    """`rows` over `cols`: (h as stored in fp32, the weight (+ offset; HAS_OFFSET False: as it is) in
    fp32 (without one: `offset`, unused), the mask, each row's sum of squares of h); h stored. ALIGN: the
    row strides and N are multiples of it (tiling.offset_align)."""
    ok = cols < bound(N, BLOCK_N, ALIGN)
    mask = row_ok[:, None] & ok[None, :]
    hf = tl.load(X + row_offsets(rows, stride_x, ALIGN) + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if HAS_R:
        r = tl.load(R + row_offsets(rows, stride_r, ALIGN) + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        hf = (hf + r).to(H_DTYPE).to(tl.float32)
        tl.store(H + row_offsets(rows, N, ALIGN) + cols[None, :], hf.to(H_DTYPE), mask=mask)
    w = offset  # (unused without a weight)
    if HAS_W:
        w = weight_row(W, cols, ok, offset, HAS_OFFSET)
    return hf, w, mask, tl.sum(hf * hf, axis=1)


@triton.jit
def _amax(y):
    """Per row: the largest |y|, NaN where the row holds one (one max.NaN reduction)."""
    return tl.reduce(tl.abs(y), 1, _max_nan)


@triton.jit
def rms_norm_fp8_kernel(X, R, W, Q, H, S, SCALE, RSTD, M, stride_x, stride_r, eps, offset, scale_ub, N,
                        BLOCK_N: tl.constexpr, ROWS: tl.constexpr, GROUP: tl.constexpr,
                        STATIC: tl.constexpr, HAS_R: tl.constexpr, HAS_W: tl.constexpr, HAS_UB: tl.constexpr,
                        UE8M0: tl.constexpr, TOP: tl.constexpr, MIN_AMAX: tl.constexpr, INT64: tl.constexpr,
                        ALIGN: tl.constexpr = 1, HAS_OFFSET: tl.constexpr = True):
    """ROWS rows in registers, read once, as one power-of-two block of BLOCK_N columns masked past N."""
    rows, row_ok = row_tile(tl.program_id(0), M, ROWS, INT64)
    H_DTYPE: tl.constexpr = H.dtype.element_ty
    cols = tl.arange(0, BLOCK_N)
    hf, w, mask, sumsq = _load_rows(X, R, W, H, rows, row_ok, cols, stride_x, stride_r, N, offset, HAS_R, HAS_W,
                                    H_DTYPE, BLOCK_N, ALIGN, HAS_OFFSET)
    rstd = tl.rsqrt(sumsq / N + eps)
    tl.store(RSTD + rows, rstd, mask=row_ok)
    y = _normed(hf, rstd, w, HAS_W)
    if STATIC:
        inv_row = tl.zeros([ROWS], dtype=tl.float32) + tl.math.div_rn(1.0, tl.load(SCALE))
    elif GROUP == 0:  # one scale per row, from the amax over the row
        amax = _amax(y)
        s = _scale_of(amax, amax != amax, scale_ub, HAS_UB, UE8M0, TOP, MIN_AMAX)
        tl.store(S + rows, s, mask=row_ok)
        inv_row = tl.math.div_rn(1.0, s)
    else:  # (per-group scales: each group's own reciprocal, in _emit)
        inv_row = tl.zeros([ROWS], dtype=tl.float32)
    _emit(Q, S, rows, row_ok, cols, y, mask, inv_row, scale_ub, N, ROWS, BLOCK_N, GROUP, STATIC, HAS_UB,
          UE8M0, TOP, MIN_AMAX, ALIGN)
