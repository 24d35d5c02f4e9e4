"""The launch rule of the fused residual add + RMSNorm forward in Triton (pure Python: imports without
Triton)."""
from __future__ import annotations

from .._util import pow2_ceil

TILE_MAX = 32768  # elements of a row tile held in registers: 1024 threads x 32 values
CHUNK = 4096  # columns per chunk of wider rows
MAX_ROWS = 16


def config(N: int, lanes: int = 32) -> tuple[int, int, int, int]:
    """(BLOCK_N, CHUNKS, ROWS, num_warps) for rows of N elements: whole rows in registers up to
    TILE_MAX, with rows stacked to ~2048 elements per program for narrow ones, 16-32 values a thread
    up to 16384 columns and 32 at 1024 threads past that (`lanes`: threads a warp); wider rows in chunks."""
    if N <= TILE_MAX:
        block = pow2_ceil(N)
        rows = max(1, min(MAX_ROWS, 2048 // block))
        chunks = 1
    else:
        block, rows, chunks = CHUNK, 1, -(-N // CHUNK)
    warps = max(1, min(16, block * rows // 512)) if block * rows <= 16384 else 1024 // lanes
    return block, chunks, rows, warps
