"""RMSNorm forward in Triton: the launch config and its analytic rule, measured (pure Python: imports
without Triton)."""
from __future__ import annotations

import functools
from dataclasses import dataclass

from .._util import pow2_ceil
from .tiling import TileConfig, lanes_per_warp, split_for, warps_for


# ================================================================================================
# Launch config and heuristic
# ================================================================================================
@dataclass(frozen=True)
class FwdConfig(TileConfig):
    """The forward's launch config (TileConfig's fields)."""


# Measured on an H100, bf16, 2^27 elements (`python bench/tune/triton_rmsnorm.py`; docs/design.md),
# as a ratio to a same-run copy:
#   * rows of up to ROW_ELEMS (whole, or nearly whole, powers of two): the row in registers, tiles of
#     TILE_ELEMS (several narrow rows), two 16-byte vectors per thread, one program per tile:
#     0.984-0.998 from 128 to 4096, where a persistent grid walking the tiles gave 0.948-0.962;
#   * 16-bit rows of 7168-8192 (within 7/8 of 2 x ROW_ELEMS): the row in registers, 16 values per
#     thread, as straight-line code (`one_tile`: the weight loaded after the reduction, no tile loop):
#     0.995 / 0.993 at 7168 / 8192, against 0.917 / 0.947 with the loop and the early weight, and
#     0.992 / 0.981 for two passes (2026-11-25; Liger 1.000 / 0.996 in the same runs);
#   * other rows up to 16384: two passes of one program per row over chunks of 16 values per thread
#     (2048 x 4 warps below 6144, 4096 x 8 warps above), the first pass keeping x in L2: 1.003 /
#     0.982 / 0.994 / 0.987 at 2880 / 5120 / 7168 / 8192, where the padded row in registers gave
#     0.966 / 0.831 / 0.912 / 0.950; 8192 x 16 warps at 16384 (0.997);
#   * rows up to 32768 in two passes of one program per row: 0.984 / 0.995 / 0.991 at 8192 / 16384 /
#     32768 (parts of 4096 in registers, below: 0.989 / 0.984 / 0.983 in the same bench);
#   * wider rows: split into parts of PART_ELEMS (at most SPLIT_MAX per row) over programs that
#     exchange their partial sums (`exchange`), each part in registers, 32 values per thread: 0.976 /
#     0.952 at 65536 / 131072; where parts pass PART_ELEMS (262144: 32 parts of 8192) each part in two
#     passes of PART_ELEMS (8 warps): 0.949. One program per row in two passes gave 0.84 / 0.68 / 0.65
#     there (the re-read misses L2: 132 rows of 512 KB in flight).
TILE_ELEMS = 4096
ROW_ELEMS = 4096
PART_ELEMS = 4096
SPLIT_FROM = 32768  # rows wider than this split over programs
SPLIT_MAX = 32  # a row's programs wait for each other: at most this many, adjacent in the grid


@functools.lru_cache(maxsize=4096)
def analytic_config(N: int, elem_bytes: int, vendor: str, sm_count: int, tile_elems: int = TILE_ELEMS) -> FwdConfig:
    """The measured rules above: whole rows in registers when narrow or a power of two up to
    ROW_ELEMS (16-bit: up to 2 x ROW_ELEMS, straight-line); up to SPLIT_FROM, other widths in two
    passes over chunks; wider rows split into parts (kept in registers up to PART_ELEMS, else in two
    passes). One program per row tile (per part)."""
    lanes = lanes_per_warp(vendor)
    block_n = pow2_ceil(N)
    if N <= ROW_ELEMS // 2 or (N <= ROW_ELEMS and 8 * N >= 7 * block_n):
        rows = max(1, min(64, tile_elems // block_n))
        warps = warps_for(rows * block_n, elem_bytes, lanes, vendor)
        return FwdConfig(rows=rows, split=1, part=N, block_n=block_n, chunks=1, num_warps=warps, programs_per_sm=0)
    if elem_bytes == 2 and ROW_ELEMS < N <= 2 * ROW_ELEMS and 8 * N >= 7 * block_n:
        warps = warps_for(block_n, elem_bytes, lanes, vendor, per_thread=16)
        return FwdConfig(rows=1, split=1, part=N, block_n=block_n, chunks=1, num_warps=warps, programs_per_sm=0,
                         one_tile=True)
    if N > SPLIT_FROM:
        split, part, _, _ = split_for(N, PART_ELEMS, min(SPLIT_MAX, sm_count))
        if part > PART_ELEMS:  # parts in two passes of PART_ELEMS
            warps = warps_for(PART_ELEMS, elem_bytes, lanes, vendor, per_thread=16)
            return FwdConfig(rows=1, split=split, part=part, block_n=PART_ELEMS, chunks=-(-part // PART_ELEMS),
                             num_warps=warps, programs_per_sm=0)
        warps = warps_for(pow2_ceil(part), elem_bytes, lanes, vendor, per_thread=32)
        return FwdConfig(rows=1, split=split, part=part, block_n=pow2_ceil(part), chunks=1, num_warps=warps,
                         programs_per_sm=0)
    block_n = 2048 if N < 6144 else 4096 if N <= 8192 else 8192 if N <= 16384 else 16384
    warps = warps_for(block_n, elem_bytes, lanes, vendor, per_thread=16)
    return FwdConfig(rows=1, split=1, part=N, block_n=block_n, chunks=-(-N // block_n), num_warps=warps,
                     programs_per_sm=0)


def grid_programs(cfg: FwdConfig, M: int, sm_count: int, resident: int = 32) -> int:
    """Programs of a launch over M rows: a persistent grid of about one wave (row tiles x split parts;
    `resident`: the programs of the compiled kernel one SM holds), or one program per row tile."""
    tiles = -(-M // cfg.rows)
    if cfg.programs_per_sm == 0:
        return tiles * cfg.split
    groups = max(1, min(tiles, min(cfg.programs_per_sm, resident) * sm_count // cfg.split))
    return groups * cfg.split
