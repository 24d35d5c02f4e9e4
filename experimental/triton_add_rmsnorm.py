"""Residual add fused into the RMSNorm forward and backward, in Triton (experimental: compile-checked for sm_90 and
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
from cutile_norms.triton._common import row_tile

TILE_MAX = 16384  # elements of a row tile held in registers: 16 warps x 32 threads x 32 values
CHUNK = 4096  # columns per chunk of wider rows
MAX_ROWS = 16


@triton.jit
def add_rms_norm_fwd_kernel(X, R, W, Y, H, RSTD, M, stride_x, stride_r, stride_y, stride_h, eps, offset, N,
                            BLOCK_N: tl.constexpr, CHUNKS: tl.constexpr, ROWS: tl.constexpr,
                            HAS_W: tl.constexpr, STORE_RSTD: tl.constexpr, INT64: tl.constexpr):
    rows, row_ok = row_tile(tl.program_id(0), M, ROWS, INT64)
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


# ================================================================================================
# Backward
# ================================================================================================
@triton.jit
def add_rms_norm_bwd_kernel(DY, DH, H, W, RSTD, G, DWP, M, stride_dy, stride_dh, stride_h, offset, N,
                            BLOCK_N: tl.constexpr, ROWS: tl.constexpr, HAS_W: tl.constexpr, HAS_DH: tl.constexpr,
                            NEED_DW: tl.constexpr, INT64: tl.constexpr):
    """The grad into h = rstd * (g - xhat * mean(g * xhat)) + dh (g = dy * (offset + w), xhat = h * rstd)
    for a grid-stride loop over row tiles; each program sums its rows' dy * xhat into its own row of
    the fp32 partials DWP (summed in a fixed order afterwards: the same bits every run)."""
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    ok = cols < N
    if HAS_W:
        w = tl.load(W + cols, mask=ok, other=0.0).to(tl.float32) + offset
    dw_acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for tile in range(pid, tl.cdiv(M, ROWS), tl.num_programs(0)):
        rows, row_ok = row_tile(tile, M, ROWS, INT64)
        mask = row_ok[:, None] & ok[None, :]
        h = tl.load(H + rows[:, None] * stride_h + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + rows[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + rows, mask=row_ok, other=0.0)
        xhat = h * rstd[:, None]
        g = dy
        if HAS_W:
            g = dy * w[None, :]
        dot = tl.sum(g * xhat, axis=1) / N
        gh = rstd[:, None] * (g - xhat * dot[:, None])
        if HAS_DH:
            gh += tl.load(DH + rows[:, None] * stride_dh + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        tl.store(G + rows[:, None] * N + cols[None, :], gh.to(G.dtype.element_ty), mask=mask)
        if NEED_DW:
            dw_acc += tl.sum(dy * xhat, axis=0)
    if NEED_DW:
        tl.store(DWP + pid * N + cols, dw_acc, mask=ok)


def bwd_config(N: int) -> tuple[int, int, int]:
    """(BLOCK_N, ROWS, num_warps) of the backward. Measured on an H100, bf16, 2^27 elements, a
    persistent grid of 2 programs per SM (`python bench/tune/triton_experimental.py --kernel bwd --ns
    1536,2048,2560,4096,5120,8192`, 2026-11-25; ratio to a copy of its bytes): 8192-element tiles
    up to 2048-wide blocks and 16384 above, 64 values a thread (2048: 0.977, 4096: 0.961, 8192:
    0.936, where 2048 elements and 8 values a thread gave 0.921 / 0.886 / 0.784); a width its
    power-of-two block pads by more than 1/8 did best at 16384-element tiles, with 16 warps from
    4096-wide blocks (2560: 0.896, 5120: 0.868; 1536: 8 warps, 0.907). Two programs per SM led four
    and eight at every width."""
    block = pow2_ceil(N)
    padded = 8 * N < 7 * block
    tile = 16384 if padded or block > 2048 else 8192
    rows = max(1, min(MAX_ROWS, tile // block))
    warps = 16 if padded and block >= 4096 else tile // 2048
    return block, rows, max(1, min(16, block * rows // 1024, warps))


@experimental_kernel
def add_rms_norm_bwd(dy2d: torch.Tensor, dh2d: torch.Tensor | None, h2d: torch.Tensor, weight: torch.Tensor | None,
                     rstd: torch.Tensor, offset: float, need_dw: bool, programs_max: int, g_dtype: torch.dtype):
    """(the grad into h [M, N] in g_dtype, dw in the weight's dtype or None) for rows of up to
    dispatch.FUSED_ADD_BWD_MAX_N elements with unit column stride (dy, dh in any float dtype; rstd [M]). Reads dy, h
    and dh and writes one grad: 4 M N e bytes, where the norm's backward then an add of dh move 6."""
    M, N = h2d.shape
    device = h2d.device
    block, rows, warps = bwd_config(N)
    tiles = -(-M // rows)
    programs = max(1, min(tiles, programs_max))
    need_dw = need_dw and weight is not None
    g = torch.empty(M, N, dtype=g_dtype, device=device)
    parts = torch.empty(programs if need_dw else 1, N, dtype=torch.float32, device=device)
    if weight is not None and weight.stride(0) != 1 and N > 1:
        weight = weight.contiguous()
    strides = [t.stride(0) if M > 1 else N for t in (dy2d, dh2d if dh2d is not None else dy2d, h2d)]
    add_rms_norm_bwd_kernel[(programs,)](
        dy2d, dh2d if dh2d is not None else dy2d, h2d, weight if weight is not None else rstd, rstd, g, parts, M,
        *strides, offset, N, BLOCK_N=block, ROWS=rows, HAS_W=weight is not None, HAS_DH=dh2d is not None,
        NEED_DW=need_dw, INT64=max(strides) * M + N >= 2 ** 31, num_warps=warps)
    dw = parts.sum(0).to(weight.dtype) if need_dw else None
    return g, dw
