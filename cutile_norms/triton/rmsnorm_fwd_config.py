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
    """The forward's launch config (TileConfig's fields). fixed_n: one row per program in two passes over
    chunks of block_n with N compiled in (rms_norm_fwd_fixed_kernel; rows 1, split 1, no persistent grid)."""

    fixed_n: bool = False

    def short(self) -> str:
        return super().short() + (", N compiled in" if self.fixed_n else "")


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
#   * NVIDIA, rows of FIXED_MIN_BYTES to FIXED_MAX_BYTES (16-bit to 64 KiB): two passes of one program per
#     row with N compiled in (`fixed_config`), on an H200 0.97-1.02 x copy at 21 bf16 widths of
#     4096-32768 and 5 fp32 ones of 2048-16384, and 0.989-1.025 at 17 bf16 widths of 768-3848
#     (`python bench/tune/triton_rmsnorm.py --only fwd --match "^(analytic$|fixed)" --rounds 3 [--dtype
#     float32]`, medians of 3), where the rules below gave 0.70-0.95 between the powers of two (10240
#     0.721, 17640 0.699, 20480 0.740 bf16) and 0.72-0.95 at 768-3848 (a padded row in registers).
TILE_ELEMS = 4096
ROW_ELEMS = 4096
PART_ELEMS = 4096
SPLIT_FROM = 32768  # rows wider than this split over programs
SPLIT_MAX = 32  # a row's programs wait for each other: at most this many, adjacent in the grid


# From 1.5 KiB: an SM runs at most 32 programs (CTAs), so one row a program keeps 32 rows' bytes in
# flight, 48 KiB at 1.5 KiB rows: bf16 768 / 896 1.009-1.012 x copy; at 1 KiB rows 32 KiB, too few
# (512: 0.79-0.80 with 1 or 2 warps, where several rows a program measured 0.91).
FIXED_MIN_BYTES = 1536
# Up to 112 KiB rows of at most FIXED_MAX_ELEMS elements: past 64 KiB that is fp32 rows only. 16-bit
# rows there hold more elements than 32 warps take in 32 values a thread a pass and fell to 0.83-0.975
# (36864-65536 bf16, chunks of 8192 or 16384), where fp32 rows of the same bytes held 0.958-1.006 at
# 16400-28672 (64-112 KiB); fp32 32768 (128 KiB, 2 rows an SM: 33 MiB of L2) measured 0.876
# (`python bench/tune/triton_rmsnorm.py --only fwd --rounds 3 --dtype float32 --match "^(analytic$|fixed
# (4096|8192|16384)/(16|32)w)" --ns 16400,18432,20480,22312,24576,28672,32768`; the rule before: 0.68-0.89).
FIXED_MAX_BYTES = 112 * 1024
FIXED_MAX_ELEMS = 32768
# fixed_config's warps by row bytes, the measured reason (H200, medians of 3; bf16 / fp32 rows of the
# same bytes agree from 8 KiB): the second pass re-reads x from L2, so an SM's resident rows (2048 threads over
# the program's) times the row's bytes times the SMs must stay within a part of L2, and fewer threads
# a row are better while they do. Under 8 KiB that bound is far, and the chunk (16 values a thread)
# must instead be mostly filled by the row: the fewest warps whose chunk holds 4/5 of the row or
# more. 2 warps (1024-element chunks) 1.000-1.011 at 768-1032 (1 warp over 512: level), where 4
# warps' 2048 chunk, half idle, measured 0.84-0.97; 4 warps 0.990-1.020 at 1304-2560 (2.5-5 KiB; 2 warps 0.966-1.007, 8
# warps 0.950 at 2488 / 2560); 8 warps from 5 KiB (3000 / 3072 / 3584: 1.006 / 1.002 / 1.025 against
# 4 warps' 0.997 / 0.989 / 1.013; bf16 `--ns 512,768,896,1000,1024,1032,1304,1536,1664,1800,2048,2488,2560,
# 3000,3072,3584,3848`).
# 8 warps (8 rows an SM, 12.4 MiB at 12 KiB rows on 132 SMs) measured
# 0.993-0.998 to 12 KiB and lost to 16 warps from 14 KiB (0.994 / 0.972 against 1.003 / 1.002 at
# 7168 / 8192 bf16); 16 warps (4 rows, 18.6 MiB at 36 KiB) held 0.983-1.010 to 35 KiB (17640 bf16:
# 0.983 against 32 warps' 0.961) and lost to 32 warps from 36 KiB (18432 / 20480: 0.982 / 0.980
# against 0.986 / 0.998); 32 warps (2 rows, 16.5 MiB at 64 KiB) held 0.986-1.008 to 64 KiB and fell
# past it in 16-bit rows (80 / 96 / 128 KiB: 0.969 / 0.919 / 0.847, the split rows' 0.909 at 128 KiB).
FIXED_WARPS = ((2560, 2), (5 * 1024, 4), (12 * 1024, 8), (35 * 1024, 16), (FIXED_MAX_BYTES, 32))
FIXED_CHUNK_ELEMS = 8192  # a chunk's elements: 16 values a thread up to 16 warps, 8 at 32 (8192 at 16 / 32
#                           warps measured within 0.3 % of 4096 / 16384 but at 28-35 KiB rows, where 16
#                           warps over 4096 lost 1.6-1.7 %, and at 40-44 KiB, where 32 over 16384 lost 0.6-1.6 %)
# Past 88 KiB rows (fp32) 16 values a thread again: 24576 / 28672 fp32 0.991 / 0.996 over 16384 against
# 0.937 / 0.890 over 8192; to 80 KiB 8192 (16400 / 18432 / 20480: 1.006 / 0.995 / 0.986 against 0.863 /
# 0.932 / 0.972); 22312 (87 KiB) 0.958 / 0.959 either way.
FIXED_WIDE_CHUNK_BYTES = 88 * 1024


def fixed_config(N: int, elem_bytes: int) -> FwdConfig | None:
    """The two-pass config with N compiled in for rows of FIXED_MIN_BYTES to FIXED_MAX_BYTES and at most
    FIXED_MAX_ELEMS elements (NVIDIA), else None: FIXED_WARPS by the row's bytes, chunks of
    FIXED_CHUNK_ELEMS or 16 values a thread (from FIXED_WIDE_CHUNK_BYTES: 16 values a thread)."""
    row_bytes = N * elem_bytes
    if not (FIXED_MIN_BYTES <= row_bytes <= FIXED_MAX_BYTES and N <= FIXED_MAX_ELEMS):
        return None
    warps = next(w for limit, w in FIXED_WARPS if row_bytes <= limit)
    block = 16 * 32 * warps if row_bytes >= FIXED_WIDE_CHUNK_BYTES else min(FIXED_CHUNK_ELEMS, 16 * 32 * warps)
    return FwdConfig(rows=1, split=1, part=N, block_n=block, chunks=-(-N // block), num_warps=warps,
                     programs_per_sm=0, fixed_n=True)


@functools.lru_cache(maxsize=4096)
def analytic_config(N: int, elem_bytes: int, vendor: str, sm_count: int, tile_elems: int = TILE_ELEMS) -> FwdConfig:
    """The measured rules above: on NVIDIA GPUs rows of 1.5-64 KiB (fp32 to 112 KiB) in two passes with N compiled in
    (`fixed_config`); else whole rows in registers when narrow or a power of two up to
    ROW_ELEMS (16-bit: up to 2 x ROW_ELEMS, straight-line); up to SPLIT_FROM, other widths in two
    passes over chunks; wider rows split into parts (kept in registers up to PART_ELEMS, else in two
    passes). One program per row tile (per part)."""
    lanes = lanes_per_warp(vendor)
    if vendor == "nvidia" and (fixed := fixed_config(N, elem_bytes)) is not None:
        return fixed
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
