"""RMSNorm (optionally after the residual add) with an FP8 output, in Triton (experimental:
compile-checked for sm_90 and sm_100 and run under Triton's interpreter in CI; not yet validated on
hardware).

    h = x + r (optional; stored)     y = h * rstd * (offset + w)   (fp32, never rounded to 16 bits)
    q = fp8(clamp(y / s))            s: a given per-tensor scale, or per row, or per 1 x GROUP columns

The dynamic scales follow `reference.fp8_scale` op for op (max(min(amax, ub), 1e-12) / the format's
largest value, IEEE division; UE8M0 rounded up to a power of two from the bits), and q follows
`reference.fp8_quantize` (IEEE division, clamp keeping NaN, round to nearest even), so on the GPU the
kernel and the reference agree bit for bit given the kernel's rstd. One program per tile of ROWS rows,
a row of up to fp8.FP8_KERNEL_MAX_N elements in registers (the rule that picks this kernel holds the
bound): x (and r) read once, q (and h) written once.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from cutile_norms._experimental import experimental_kernel
from cutile_norms._util import pow2_ceil
from cutile_norms.triton._common import row_tile
from cutile_norms.reference import FP8_MAX, FP8_MIN_AMAX

MAX_ROWS = 16


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
def _quantize(y, s, TOP: tl.constexpr):
    q = tl.math.div_rn(y, s)
    return tl.where(q != q, q, tl.minimum(tl.maximum(q, -TOP), TOP))


@triton.jit
def rms_norm_fp8_kernel(X, R, W, Q, H, S, SCALE, RSTD, M, stride_x, stride_r, eps, offset, scale_ub, N,
                        BLOCK_N: tl.constexpr, ROWS: tl.constexpr, GROUP: tl.constexpr, STATIC: tl.constexpr,
                        HAS_R: tl.constexpr, HAS_W: tl.constexpr, HAS_UB: tl.constexpr, UE8M0: tl.constexpr,
                        TOP: tl.constexpr, MIN_AMAX: tl.constexpr, INT64: tl.constexpr):
    rows, row_ok = row_tile(tl.program_id(0), M, ROWS, INT64)
    cols = tl.arange(0, BLOCK_N)
    ok = cols < N
    mask = row_ok[:, None] & ok[None, :]
    hf = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if HAS_R:
        r = tl.load(R + rows[:, None] * stride_r + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        h = (hf + r).to(H.dtype.element_ty)
        tl.store(H + rows[:, None] * N + cols[None, :], h, mask=mask)
        hf = h.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(hf * hf, axis=1) / N + eps)
    tl.store(RSTD + rows, rstd, mask=row_ok)
    y = hf * rstd[:, None]
    if HAS_W:
        y = y * (tl.load(W + cols, mask=ok, other=0.0).to(tl.float32) + offset)[None, :]
    if STATIC:
        q = _quantize(y, tl.load(SCALE), TOP)
    elif GROUP == 0:  # one scale per row
        nan = tl.sum((y != y).to(tl.int32), axis=1) > 0
        s = _scale_of(tl.max(tl.abs(y), axis=1), nan, scale_ub, HAS_UB, UE8M0, TOP, MIN_AMAX)
        tl.store(S + rows, s, mask=row_ok)
        q = _quantize(y, s[:, None], TOP)
    else:  # one scale per 1 x GROUP columns
        G: tl.constexpr = BLOCK_N // GROUP
        yg = tl.reshape(y, (ROWS, G, GROUP))
        nan = tl.sum((yg != yg).to(tl.int32), axis=2) > 0
        s = _scale_of(tl.max(tl.abs(yg), axis=2), nan, scale_ub, HAS_UB, UE8M0, TOP, MIN_AMAX)
        gcols = tl.arange(0, G)
        tl.store(S + rows[:, None] * (N // GROUP) + gcols[None, :], s,
                 mask=row_ok[:, None] & (gcols < N // GROUP)[None, :])
        q = tl.reshape(_quantize(yg, s[:, :, None], TOP), (ROWS, BLOCK_N))
    tl.store(Q + rows[:, None] * N + cols[None, :], q.to(Q.dtype.element_ty), mask=mask)


@experimental_kernel
def rms_norm_fp8(x2d: torch.Tensor, r2d: torch.Tensor | None, weight: torch.Tensor | None, eps: float,
                 offset: float, out_dtype: torch.dtype, h_dtype: torch.dtype | None, scale: torch.Tensor | None,
                 scale_ub: float | None, group_size: int | None, ue8m0: bool):
    """(q [M, N] out_dtype, scales, h [M, N] or None, rstd [M] fp32) for rows of up to
    fp8.FP8_KERNEL_MAX_N elements with unit column stride, M >= 1, N a multiple of group_size (the API
    validates). scales: `scale` itself (per tensor), [M] (per row) or [M, N / group_size] row-major fp32."""
    M, N = x2d.shape
    device = x2d.device
    block = max(pow2_ceil(N), group_size or 1)
    rows = max(1, min(MAX_ROWS, 2048 // block))
    warps = max(1, min(16, block * rows // 512))
    q = torch.empty(M, N, dtype=out_dtype, device=device)
    h = torch.empty(M, N, dtype=h_dtype, device=device) if r2d is not None else None
    rstd = torch.empty(M, dtype=torch.float32, device=device)
    if scale is not None:
        scales = scale
    elif group_size:
        scales = torch.empty(M, N // group_size, dtype=torch.float32, device=device)
    else:
        scales = torch.empty(M, dtype=torch.float32, device=device)
    if weight is not None and weight.stride(0) != 1 and N > 1:
        weight = weight.contiguous()
    sx = x2d.stride(0) if M > 1 else N
    sr = (r2d.stride(0) if M > 1 else N) if r2d is not None else sx
    rms_norm_fp8_kernel[(-(-M // rows),)](
        x2d, r2d if r2d is not None else x2d, weight if weight is not None else rstd, q,
        h if h is not None else q, scales, scale if scale is not None else rstd, rstd, M, sx, sr, eps, offset,
        float(scale_ub) if scale_ub is not None else 0.0, N,
        BLOCK_N=block, ROWS=rows, GROUP=group_size or 0, STATIC=scale is not None, HAS_R=r2d is not None,
        HAS_W=weight is not None, HAS_UB=scale_ub is not None, UE8M0=ue8m0, TOP=FP8_MAX[out_dtype],
        MIN_AMAX=FP8_MIN_AMAX, INT64=max(sx, sr, N) * M + N >= 2 ** 31, num_warps=warps)
    return q, scales, h, rstd
