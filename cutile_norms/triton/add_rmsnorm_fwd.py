"""The fused residual add + RMSNorm forward in Triton: the launch wrapper (the kernel in
add_rmsnorm_fwd_kernel.py, its launch rule in add_rmsnorm_fwd_config.py)."""
from __future__ import annotations

import torch

from .add_rmsnorm_fwd_config import config
from .add_rmsnorm_fwd_kernel import add_rms_norm_fwd_kernel
from .tiling import offset_align


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
    block, chunks, rows, warps = config(N, 64 if torch.version.hip else 32)
    strides = [t.stride(0) if M > 1 else N for t in (x2d, r2d, y, h)]
    int64 = max(strides) * M + N >= 2 ** 31
    add_rms_norm_fwd_kernel[(-(-M // rows),)](
        x2d, r2d, weight if weight is not None else y, y, h, rstd if store_rstd else y, M, *strides, eps, offset, N,
        BLOCK_N=block, CHUNKS=chunks, ROWS=rows, HAS_W=weight is not None, STORE_RSTD=store_rstd, INT64=int64,
        ALIGN=offset_align(*strides, N), num_warps=warps)
    return y, h, rstd
