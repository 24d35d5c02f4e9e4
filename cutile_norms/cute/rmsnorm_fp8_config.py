"""The launch config of the FP8-output RMSNorm in CuTe DSL (pure Python: imports without CuTe DSL).

The tile is the tma_smem_cached forward's (rmsnorm_fwd_config.analytic_config) where that is one CTA
per row tile: the same bytes in flight per SM and the same 16-byte vectors per thread, for the same
reasons (docs/design.md); the FP8 epilogue reads the row back from shared memory and writes a byte
per element, so the tile that feeds a copy of the row feeds it too. Rows of up to SLICE_BYTES that the
forward's threads per row pad get an exact tiling over fewer threads per row (`_config`). Rows a
cluster would split (past ONE_CTA_BYTES) are not taken: the FP8 kernels stop at fp8.FP8_KERNEL_MAX_N
columns, well below.
"""
from __future__ import annotations

import functools

from .rmsnorm_fwd_config import ONE_CTA_BYTES, SLICE_BYTES, TILE_BYTES, FwdConfig, analytic_config

THREADS = 128  # a CTA's threads for rows of up to SLICE_BYTES (the forward's min_threads)
# 16-byte vectors a thread per row at most in the exact tilings below: the fp32 weight and y of 16
# vectors fill the registers (sm_90 ptxas: 1664 as 16 threads x 13 vectors held 217-230, 2 CTAs an SM)
MAX_VECTORS = 8


def fp8_config(N: int, elem_bytes: int, group_size: int | None) -> FwdConfig | None:
    """The config for rows of N elements of `elem_bytes` (None: the kernel does not take them; `refusal`
    says why)."""
    return None if refusal(N, elem_bytes, group_size) else _config(N, elem_bytes)


@functools.lru_cache(maxsize=4096)
def _config(N: int, elem_bytes: int) -> FwdConfig:
    """analytic_config's, except for rows of up to SLICE_BYTES that its threads per row do not tile
    exactly: there the power of two from 16 to THREADS threads per row with the fewest padding vectors
    (at most MAX_VECTORS each; ties to more threads), THREADS / that many rows a pass, as many passes
    as TILE_BYTES holds (at most 16). 2560 bf16 is 64 threads x 5 vectors (was 128 x 3, a sixth
    idle), 3584 64 x 7 (was 128 x 4): on an H200 0.951 / 0.974 of a copy per token against 0.888 /
    0.901 (`python bench/tune/cute_fp8.py`, docs/performance.md 2.17)."""
    cfg = analytic_config(N, elem_bytes)
    vec = 16 // elem_bytes
    vectors = N // vec
    if cfg.cluster_n != 1 or N * elem_bytes > SLICE_BYTES or cfg.tpr * cfg.nvb == vectors:
        return cfg
    fits = [t for t in (16, 32, 64, THREADS) if -(-vectors // t) <= MAX_VECTORS]
    tpr = min(fits, key=lambda t: (t * -(-vectors // t) - vectors, -t))
    if tpr * -(-vectors // tpr) - vectors >= cfg.tpr * cfg.nvb - vectors:
        return cfg
    rpg = THREADS // tpr
    groups = max(1, min(16, TILE_BYTES // (rpg * N * elem_bytes)))
    return FwdConfig(rows=rpg * groups, rpg=rpg, tpr=tpr, nvb=-(-vectors // tpr), cluster_n=1, vec=vec)


def refusal(N: int, elem_bytes: int, group_size: int | None) -> str | None:
    """None where the kernel takes rows of N (with 1 x group_size scales), else why not."""
    vec = 16 // elem_bytes
    if N % vec:
        return f"the CuTe DSL FP8 kernel moves rows in 16-byte bulk copies: N must be a multiple of {vec}, got {N}"
    if N * elem_bytes > ONE_CTA_BYTES:
        return f"the CuTe DSL FP8 kernel holds a row in one CTA's shared memory (up to {ONE_CTA_BYTES} bytes)"
    cfg = _config(N, elem_bytes)
    if group_size and (group_size & (group_size - 1) or N % group_size):
        return f"1 x g group scales need g a power of two dividing N, got g={group_size} at N={N}"
    if group_size and (group_size % vec or group_size // vec > min(cfg.tpr, 32) or cfg.nvb > group_size // vec):
        return (f"the CuTe DSL FP8 kernel reduces a 1 x {group_size} group over the lanes of one warp that "
                f"hold it, one group's scale per lane: groups of {vec * max(1, cfg.nvb)}-{vec * min(cfg.tpr, 32)} "
                f"columns at N={N}")
    return None
