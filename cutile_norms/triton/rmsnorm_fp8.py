"""RMSNorm with an FP8 output in Triton: the launch wrapper (the kernel in rmsnorm_fp8_kernel.py, its
launch rule in rmsnorm_fp8_config.py)."""
from __future__ import annotations

import torch

from ..fp8 import kernel_outputs
from ..reference import FP8_MAX, FP8_MIN_AMAX
from .rmsnorm_fp8_config import launch_config
from .rmsnorm_fp8_kernel import rms_norm_fp8_kernel
from .tiling import offset_align


def rms_norm_fp8(x2d: torch.Tensor, r2d: torch.Tensor | None, weight: torch.Tensor | None, eps: float,
                 offset: float, out_dtype: torch.dtype, h_dtype: torch.dtype | None, scale: torch.Tensor | None,
                 scale_ub: float | None, group_size: int | None, ue8m0: bool):
    """(q [M, N] out_dtype, scales, h [M, N] or None, rstd [M] fp32) for rows of up to
    fp8.FP8_KERNEL_MAX_N elements with unit column stride, M >= 1, N a multiple of group_size (the API
    validates). scales: `scale` itself (per tensor), [M] (per row) or [M, N / group_size] row-major fp32."""
    M, N = x2d.shape
    device = x2d.device
    block, rows, warps = launch_config(N, group_size)
    q, scales, h, rstd = kernel_outputs(M, N, out_dtype, h_dtype if r2d is not None else None, scale, group_size,
                                        device)
    if weight is not None and weight.stride(0) != 1 and N > 1:
        weight = weight.contiguous()
    sx = x2d.stride(0) if M > 1 else N
    sr = (r2d.stride(0) if M > 1 else N) if r2d is not None else sx
    rms_norm_fp8_kernel[(-(-M // rows),)](
        x2d, r2d if r2d is not None else x2d, weight if weight is not None else rstd, q,
        h if h is not None else q, scales, scale if scale is not None else rstd, rstd, M, sx, sr, eps, offset,
        float(scale_ub) if scale_ub is not None else 0.0, N,
        BLOCK_N=block, ROWS=rows, GROUP=group_size or 0, STATIC=scale is not None,
        HAS_R=r2d is not None, HAS_W=weight is not None, HAS_UB=scale_ub is not None, UE8M0=ue8m0,
        TOP=FP8_MAX[out_dtype],
        MIN_AMAX=FP8_MIN_AMAX, INT64=max(sx, sr, N) * M + N >= 2 ** 31, ALIGN=offset_align(sx, sr, N),
        HAS_OFFSET=bool(offset != 0), num_warps=warps)
    return q, scales, h, rstd
