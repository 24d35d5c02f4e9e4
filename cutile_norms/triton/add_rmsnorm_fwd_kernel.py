"""The residual add fused into the RMSNorm forward, in Triton: the kernel (its launch rule in
add_rmsnorm_fwd_config.py, the wrapper in add_rmsnorm_fwd.py).

    h = x + r   (summed in fp32, rounded once to h's dtype, stored)
    y = h * rsqrt(mean(h^2) + eps) * (offset + w)   (h as stored, so y equals rms_norm(h))

One program per tile of ROWS rows. Rows of up to add_rmsnorm_fwd_config.TILE_MAX elements stay in
registers: x and r are read once, h and y written once (4 M N e bytes for 16-bit x, r and h: the
floor). Wider rows run in CHUNKS chunks of BLOCK_N: a first pass adds, stores h and sums h^2; a second
reads h back (the program's own row, just written: an L2 hit at these sizes) and stores y (the API
sends such rows to the cuTile split form where cuTile runs: cutile/add_rmsnorm_fwd.py). In place (y
into x, h into r: `add_rms_norm_`) is safe: in the one-pass form each thread adds its own x and r
elements before any store, and the reduction orders every load before the y stores; in the two-pass
form the first pass has read all of x before the barrier that starts the second.
"""
from __future__ import annotations

import triton
import triton.language as tl

from ._common import bound, row_offsets, row_tile


@triton.jit
def add_rms_norm_fwd_kernel(X, R, W, Y, H, RSTD, M, stride_x, stride_r, stride_y, stride_h, eps, offset, N,
                            BLOCK_N: tl.constexpr, CHUNKS: tl.constexpr, ROWS: tl.constexpr,
                            HAS_W: tl.constexpr, STORE_RSTD: tl.constexpr, INT64: tl.constexpr,
                            ALIGN: tl.constexpr = 1):
    # ALIGN: the row strides and N are multiples of it (tiling.offset_align), what Triton cannot infer
    # where one is not a multiple of 16
    rows, row_ok = row_tile(tl.program_id(0), M, ROWS, INT64)
    lanes = tl.arange(0, BLOCK_N)
    x_rows = X + row_offsets(rows, stride_x, ALIGN)
    r_rows = R + row_offsets(rows, stride_r, ALIGN)
    y_rows = Y + row_offsets(rows, stride_y, ALIGN)
    h_rows = H + row_offsets(rows, stride_h, ALIGN)
    n = bound(N, BLOCK_N, ALIGN)
    if CHUNKS == 1:
        ok = lanes < n
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
            mask = row_ok[:, None] & (cols < n)[None, :]
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
            ok = cols < n
            mask = row_ok[:, None] & ok[None, :]
            y = tl.load(h_rows + cols[None, :], mask=mask, other=0.0).to(tl.float32) * rstd[:, None]
            if HAS_W:
                y = y * (tl.load(W + cols, mask=ok, other=0.0).to(tl.float32) + offset)[None, :]
            tl.store(y_rows + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)
    if STORE_RSTD:
        tl.store(RSTD + rows, rstd, mask=row_ok)
