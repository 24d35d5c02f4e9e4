"""The launch config of the FP8-output RMSNorm in CuTe DSL (pure Python: imports without CuTe DSL).

The tile is the tma_smem_cached forward's (rmsnorm_fwd_config.analytic_config) where that is one CTA
per row tile: the same bytes in flight per SM and the same 16-byte vectors per thread, for the same
reasons (docs/design.md); the FP8 epilogue reads the row back from shared memory and writes a byte
per element, so the tile that feeds a copy of the row feeds it too. Rows a cluster would split (past
ONE_CTA_BYTES) are not taken: the FP8 kernels stop at fp8.FP8_KERNEL_MAX_N columns, well below.
"""
from __future__ import annotations

from .rmsnorm_fwd_config import ONE_CTA_BYTES, FwdConfig, analytic_config


def fp8_config(N: int, elem_bytes: int, group_size: int | None) -> FwdConfig | None:
    """The config for rows of N elements of `elem_bytes` (None: the kernel does not take them; `refusal`
    says why)."""
    return None if refusal(N, elem_bytes, group_size) else analytic_config(N, elem_bytes)


def refusal(N: int, elem_bytes: int, group_size: int | None) -> str | None:
    """None where the kernel takes rows of N (with 1 x group_size scales), else why not."""
    vec = 16 // elem_bytes
    if N % vec:
        return f"the CuTe DSL FP8 kernel moves rows in 16-byte bulk copies: N must be a multiple of {vec}, got {N}"
    if N * elem_bytes > ONE_CTA_BYTES:
        return f"the CuTe DSL FP8 kernel holds a row in one CTA's shared memory (up to {ONE_CTA_BYTES} bytes)"
    cfg = analytic_config(N, elem_bytes)
    if group_size and (group_size % vec or group_size // vec > min(cfg.tpr, 32) or cfg.nvb > group_size // vec):
        return (f"the CuTe DSL FP8 kernel reduces a 1 x {group_size} group over the lanes of one warp that "
                f"hold it, one group's scale per lane: groups of {vec * max(1, cfg.nvb)}-{vec * min(cfg.tpr, 32)} "
                f"columns at N={N}")
    return None
