"""The fused residual add + RMSNorm backward in Triton: the launch wrapper (the kernel in
add_rmsnorm_bwd_kernel.py, its launch rule in add_rmsnorm_bwd_config.py)."""
from __future__ import annotations

from dataclasses import replace

import torch

from .._platform import DeviceInfo
from ._common import shared_per_block
from .add_rmsnorm_bwd_config import config, tensors_take_tma, tma_rows
from .add_rmsnorm_bwd_kernel import add_rms_norm_bwd_kernel
from .rmsnorm_bwd import launch
from .rmsnorm_bwd_config import analytic_config, tma_rows_config
from .tiling import offset_align


def add_rms_norm_bwd(dy2d: torch.Tensor, dh2d: torch.Tensor | None, h2d: torch.Tensor, weight: torch.Tensor | None,
                     rstd: torch.Tensor, offset: float, need_dw: bool, programs_max: int, g_dtype: torch.dtype,
                     dev: DeviceInfo | None = None):
    """(the grad into h [M, N] in g_dtype, dw in the weight's dtype or None) for rows of up to
    dispatch.FUSED_ADD_BWD_MAX_N elements with unit column stride (dy, dh in any float dtype; rstd [M]). Reads dy, h
    and dh and writes one grad: 4 M N e bytes, where the norm's backward then an add of dh move 6.
    On `dev`'s rows with dh that add_rmsnorm_bwd_config.tma_rows gives, where the tensors take it
    (add_rmsnorm_bwd_config.tensors_take_tma, as dispatch.residual_backward asked): Triton's TMA rows kernel
    reading dh (rmsnorm_bwd.launch); elsewhere the kernel here, the row in registers."""
    by_tma = _by_tma(dy2d, dh2d, h2d, weight, rstd, offset, need_dw, g_dtype, dev)
    if by_tma is not None:
        return by_tma
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


def _by_tma(dy2d, dh2d, h2d, weight, rstd, offset, need_dw, g_dtype, dev):
    """add_rms_norm_bwd's result by the TMA rows kernel, or None where it does not run (its docstring)."""
    M, N = h2d.shape
    take = tma_rows(N, h2d.element_size(), dev) if dh2d is not None else {}
    if not take or not tensors_take_tma(dy2d, dh2d, h2d, g_dtype):
        return None
    sm_count = max(1, dev.sm_count)
    cfg = replace(analytic_config(N, 2, dev.vendor, sm_count), **take)
    # (the rule's tiles fit the H200's 227 KiB a block; on a GPU with less the launch could not take them)
    if tma_rows_config(cfg, shared_per_block(h2d.device), 2, 2, 2, 2) is None:
        return None
    g = torch.empty(M, N, dtype=g_dtype, device=h2d.device)
    need_dw = need_dw and weight is not None
    dw = torch.empty(N, dtype=weight.dtype, device=h2d.device) if need_dw else None
    return launch(cfg, dy2d, h2d, weight, rstd, offset, True, need_dw, sm_count, out=(g, dw), tma_capable=True,
                  dh2d=dh2d)
