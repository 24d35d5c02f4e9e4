"""The residual add fused into the RMSNorm backward, in Triton: the kernel (its launch rule in
add_rmsnorm_bwd_config.py, the wrapper in add_rmsnorm_bwd.py). The grad into h is the norm's
backward on h plus dh, the grad h receives from later layers, in one pass: dy, h and dh read once,
one grad written (4 M N e bytes, where the norm's backward then an add of dh move 6)."""
from __future__ import annotations

import triton
import triton.language as tl

from ._common import bound, row_offsets, row_tile


@triton.jit
def add_rms_norm_bwd_kernel(DY, DH, H, W, RSTD, G, DWP, M, stride_dy, stride_dh, stride_h, offset, N,
                            BLOCK_N: tl.constexpr, ROWS: tl.constexpr, HAS_W: tl.constexpr, HAS_DH: tl.constexpr,
                            NEED_DW: tl.constexpr, INT64: tl.constexpr, ALIGN: tl.constexpr = 1):
    """The grad into h = rstd * (g - xhat * mean(g * xhat)) + dh (g = dy * (offset + w), xhat = h * rstd)
    for a grid-stride loop over row tiles; each program sums its rows' dy * xhat into its own row of
    the fp32 partials DWP (summed in a fixed order afterwards: the same bits every run). ALIGN: the row
    strides and N are multiples of it (tiling.offset_align)."""
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    ok = cols < bound(N, BLOCK_N, ALIGN)
    if HAS_W:
        w = tl.load(W + cols, mask=ok, other=0.0).to(tl.float32) + offset
    dw_acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for tile in range(pid, tl.cdiv(M, ROWS), tl.num_programs(0)):
        rows, row_ok = row_tile(tile, M, ROWS, INT64)
        mask = row_ok[:, None] & ok[None, :]
        h = tl.load(H + row_offsets(rows, stride_h, ALIGN) + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + row_offsets(rows, stride_dy, ALIGN) + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + rows, mask=row_ok, other=0.0)
        xhat = h * rstd[:, None]
        g = dy
        if HAS_W:
            g = dy * w[None, :]
        dot = tl.sum(g * xhat, axis=1) / N
        gh = rstd[:, None] * (g - xhat * dot[:, None])
        if HAS_DH:
            gh += tl.load(DH + row_offsets(rows, stride_dh, ALIGN) + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        tl.store(G + row_offsets(rows, N, ALIGN) + cols[None, :], gh.to(G.dtype.element_ty), mask=mask)
        if NEED_DW:
            dw_acc += tl.sum(dy * xhat, axis=0)
    if NEED_DW:
        tl.store(DWP + pid * N + cols, dw_acc, mask=ok)
