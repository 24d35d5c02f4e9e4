"""Residual add fused into the RMSNorm forward, in Triton (experimental: compile-checked for sm_90 and
sm_100 and run under Triton's interpreter in CI; not yet validated on hardware).

    h = x + r   (summed in fp32, rounded once to h's dtype, stored)
    y = h * rsqrt(mean(h^2) + eps) * (offset + w)   (h as stored, so y equals rms_norm(h))

One program per tile of ROWS rows. Rows of up to TILE_MAX elements stay in registers: x and r are
read once, h and y written once (4 M N e bytes for 16-bit x, r and h: the floor). Wider rows run in
CHUNKS chunks of BLOCK_N: a first pass adds, stores h and sums h^2; a second reads h back (the
program's own row, just written: an L2 hit at these sizes) and stores y. In place (y into x, h into r:
`add_rms_norm_`) is safe: in the one-pass form each thread adds its own x and r elements before any
store, and the reduction orders every load before the y stores; in the two-pass form the first pass
has read all of x before the barrier that starts the second.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from cutile_norms._experimental import experimental_kernel
from cutile_norms._util import pow2_ceil

TILE_MAX = 16384  # elements of a row tile held in registers: 16 warps x 32 threads x 32 values
CHUNK = 4096  # columns per chunk of wider rows
MAX_ROWS = 16


@triton.jit
def add_rms_norm_fwd_kernel(X, R, W, Y, H, RSTD, M, stride_x, stride_r, stride_y, stride_h, eps, offset, N,
                            BLOCK_N: tl.constexpr, CHUNKS: tl.constexpr, ROWS: tl.constexpr,
                            HAS_W: tl.constexpr, STORE_RSTD: tl.constexpr, INT64: tl.constexpr):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    row_ok = rows < M
    if INT64:
        rows = rows.to(tl.int64)
    lanes = tl.arange(0, BLOCK_N)
    x_rows = X + rows[:, None] * stride_x
    r_rows = R + rows[:, None] * stride_r
    y_rows = Y + rows[:, None] * stride_y
    h_rows = H + rows[:, None] * stride_h
    if CHUNKS == 1:
        ok = lanes < N
        mask = row_ok[:, None] & ok[None, :]
        x = tl.load(x_rows + lanes[None, :], mask=mask, other=0.0).to(tl.float32)
        r = tl.load(r_rows + lanes[None, :], mask=mask, other=0.0).to(tl.float32)
        h = (x + r).to(H.dtype.element_ty)
        tl.store(h_rows + lanes[None, :], h, mask=mask)
        hf = h.to(tl.float32)
        rstd = tl.rsqrt(tl.sum(hf * hf, axis=1) / N + eps)
        y = hf * rstd[:, None]
        if HAS_W:
            y = y * (tl.load(W + lanes, mask=ok, other=0.0).to(tl.float32) + offset)[None, :]
        tl.store(y_rows + lanes[None, :], y.to(Y.dtype.element_ty), mask=mask)
    else:
        ssq = tl.zeros([ROWS], dtype=tl.float32)
        for c in range(CHUNKS):
            cols = c * BLOCK_N + lanes
            mask = row_ok[:, None] & (cols < N)[None, :]
            x = tl.load(x_rows + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            r = tl.load(r_rows + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            h = (x + r).to(H.dtype.element_ty)
            tl.store(h_rows + cols[None, :], h, mask=mask)
            hf = h.to(tl.float32)
            ssq += tl.sum(hf * hf, axis=1)
        rstd = tl.rsqrt(ssq / N + eps)
        tl.debug_barrier()  # h's stores (and, in place, every load of x) before the second pass
        for c in range(CHUNKS):
            cols = c * BLOCK_N + lanes
            ok = cols < N
            mask = row_ok[:, None] & ok[None, :]
            y = tl.load(h_rows + cols[None, :], mask=mask, other=0.0).to(tl.float32) * rstd[:, None]
            if HAS_W:
                y = y * (tl.load(W + cols, mask=ok, other=0.0).to(tl.float32) + offset)[None, :]
            tl.store(y_rows + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)
    if STORE_RSTD:
        tl.store(RSTD + rows, rstd, mask=row_ok)


def config(N: int) -> tuple[int, int, int, int]:
    """(BLOCK_N, CHUNKS, ROWS, num_warps) for rows of N elements: whole rows in registers up to
    TILE_MAX, with rows stacked to ~2048 elements per program for narrow ones; wider rows in chunks."""
    if N <= TILE_MAX:
        block = pow2_ceil(N)
        rows = max(1, min(MAX_ROWS, 2048 // block))
        chunks = 1
    else:
        block, rows, chunks = CHUNK, 1, -(-N // CHUNK)
    warps = max(1, min(16, block * rows // 512))
    return block, chunks, rows, warps


@experimental_kernel
def add_rms_norm_fwd(x2d: torch.Tensor, r2d: torch.Tensor, weight: torch.Tensor | None, eps: float, offset: float,
                     h_dtype: torch.dtype, store_rstd: bool, out: tuple | None = None):
    """(y [M, N] in x's dtype, h [M, N] in h_dtype, rstd [M] fp32 or None) for 2-D x and r with unit
    column stride and M >= 1 (validated by the API layer). `out`: (y, h) to write into, 2-D with
    unit column stride (in place: x and r themselves)."""
    M, N = x2d.shape
    device = x2d.device
    if out is None:
        y = torch.empty(M, N, dtype=x2d.dtype, device=device)
        h = torch.empty(M, N, dtype=h_dtype, device=device)
    else:
        y, h = out
    rstd = torch.empty(M, dtype=torch.float32, device=device) if store_rstd else None
    if weight is not None and weight.stride(0) != 1 and N > 1:
        weight = weight.contiguous()
    block, chunks, rows, warps = config(N)
    strides = [t.stride(0) if M > 1 else N for t in (x2d, r2d, y, h)]
    int64 = max(strides) * M + N >= 2 ** 31
    add_rms_norm_fwd_kernel[(-(-M // rows),)](
        x2d, r2d, weight if weight is not None else y, y, h, rstd if store_rstd else y, M, *strides, eps, offset, N,
        BLOCK_N=block, CHUNKS=chunks, ROWS=rows, HAS_W=weight is not None, STORE_RSTD=store_rstd, INT64=int64,
        num_warps=warps)
    return y, h, rstd
