"""The fused residual add + RMSNorm backward in Triton: the launch wrapper (the kernel in
add_rmsnorm_bwd_kernel.py, its launch rule in add_rmsnorm_bwd_config.py)."""
from __future__ import annotations

import torch

from .add_rmsnorm_bwd_config import config
from .add_rmsnorm_bwd_kernel import add_rms_norm_bwd_kernel
from .tiling import offset_align


def add_rms_norm_bwd(dy2d: torch.Tensor, dh2d: torch.Tensor | None, h2d: torch.Tensor, weight: torch.Tensor | None,
                     rstd: torch.Tensor, offset: float, need_dw: bool, programs_max: int, g_dtype: torch.dtype):
    """(the grad into h [M, N] in g_dtype, dw in the weight's dtype or None) for rows of up to
    dispatch.FUSED_ADD_BWD_MAX_N elements with unit column stride (dy, dh in any float dtype; rstd [M]). Reads dy, h
    and dh and writes one grad: 4 M N e bytes, where the norm's backward then an add of dh move 6."""
    M, N = h2d.shape
    device = h2d.device
    block, rows, warps = config(N)
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
        NEED_DW=need_dw, INT64=max(strides) * M + N >= 2 ** 31,
        ALIGN=offset_align(*strides, N), num_warps=warps)
    dw = parts.sum(0).to(weight.dtype) if need_dw else None
    return g, dw
