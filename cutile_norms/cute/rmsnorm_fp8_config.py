"""The launch config of the FP8-output RMSNorm in CuTe DSL (pure Python: imports without CuTe DSL).

The tile is the tma_smem_cached forward's (rmsnorm_fwd_config.analytic_config) where that is one CTA
per row tile: the same bytes in flight per SM and the same 16-byte vectors per thread, for the same
reasons (docs/design.md); the FP8 epilogue reads the row back from shared memory and writes a byte
per element, so the tile that feeds a copy of the row feeds it too. Rows a cluster would split (past
ONE_CTA_BYTES) are not taken: the FP8 kernels stop at fp8.FP8_KERNEL_MAX_N columns, well below.
"""
from __future__ import annotations

from .rmsnorm_fwd_config import ONE_CTA_BYTES, FwdConfig, analytic_config


# Per-token scales: y kept in registers from the amax pass to the quantizing pass where a thread holds
# at most KEEP_Y_VALUES of a row, else computed again from shared memory. Keeping it saves a shared
# load, a conversion and two multiplies per element, and costs registers: sm_90 ptxas, bf16, 128
# threads, kept / again: 40 values 70 / 62 registers, 64 120 / 90, 80 128 / 108, 96 156 / 120, 128
# 229 / 159; past 80 values that is a CTA fewer per SM (65536 registers), and the CTAs left hold too few
# bytes in flight. H200 (`python bench/tune/cute_fp8.py`), kept / again: 2560 0.891 /
# 0.831, 5120 0.939 / 0.888, 6144 0.950 / 0.903, 10240 0.946 / 0.913; 12288 0.916 / 0.931, 14336 0.789 /
# 0.897, 16384 0.848 / 0.910; at 8192 (64 values, 5 CTAs to 4) 0.899 / 0.914.
KEEP_Y_VALUES = 80


def keeps_y(cfg: FwdConfig) -> bool:
    """Whether a per-token launch keeps y in registers (KEEP_Y_VALUES)."""
    return cfg.nvb * cfg.vec <= KEEP_Y_VALUES


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
