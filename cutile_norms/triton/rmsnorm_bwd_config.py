"""RMSNorm backward in Triton: the launch config and its analytic rule, measured (pure Python: imports
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
class BwdConfig(TileConfig):
    acc_2d: bool = True  # dw accumulated per tile element, summed over the rows once at the end
    tma_stages: int = 0  # split rows: x and dy by TMA, pipelined this many stages (0: pointer loads)

    def short(self) -> str:
        return super().short() + (f", TMA {self.tma_stages} stages where the rows allow" if self.tma_stages else "")


# Measured on an H100, bf16, 2^27 elements (`python bench/tune/triton_rmsnorm.py`; docs/design.md),
# as a ratio to a same-run copy (1.5x its bytes):
#   * rows up to 8192: tiles of TILE_ELEMS (several narrow rows), 16 values per thread (8 when the
#     row is not a power of two: 0.915 against 0.903 at 2880, 0.879 against 0.864 at 5120), each
#     program loading its next tile before it reduces this one (PREFETCH): 0.88-0.96 from 128 to 8192,
#     where tiles of 32768 elements without it gave 0.64-0.89;
#   * wider: rows split into parts of PART_ELEMS (at most SPLIT_MAX) that exchange their partial dot
#     products (`exchange`), 16 values per thread, PREFETCH: 0.905 / 0.824 / 0.864 / 0.835 / 0.746 at
#     16384 / 32768 / 65536 / 131072 / 262144, where parts of 8192 gave 0.80 / 0.74 / 0.66 / 0.60 at
#     32768 and up and more parts per row (64, 128) 0.29-0.60;
#   * split rows on NVIDIA sm_90+ read by TMA (rms_norm_bwd_tma_kernel) where the parts are a power of
#     two that tiles the row, TMA_STAGES pipeliner stages: 0.939 / 0.932 / 0.939 / 0.910 / 0.851 at the
#     same widths (docs/design.md); 2 stages 0.52-0.73,
#     4 stages within 2 % of 3; the pointer kernel above where TMA does not apply.
TILE_ELEMS = 8192
# 16-bit rows of at most NARROW_16 columns that are not a power of two: 16 values per thread too. Measured
# (python bench/tune/triton_rmsnorm.py --only bwd, bf16, 15 widths of 512-3072) against 8 per thread:
# H200 +3 to +5 % at 768-1816 (896: 0.875 against 0.838), H100 -0.9 to +1.7 %; past 2048 columns (a
# 4096-lane block) the H100 keeps 8 (2304-3072: 16 per thread 0.3-1.4 % behind) and the H200 is level.
NARROW_16 = 2048
# 16-bit rows of PAD_32 columns (a 2048-lane block a quarter to half padding): tiles of 2 rows, 32 values
# per thread (4 warps). The wider tile's warps past the row's end hold no column (16 values per thread
# at 1128: 3 of 8 warps along the row idle); with 4 warps each thread's first two vectors are in the
# row. Measured (same command): H200 +7 to +10 % over the best other config at 1128 / 1280 / 1400 /
# 1536 (0.780 / 0.836 / 0.838 / 0.882), H100 +0.9 to +6.5 % at 1128-1400 and -0.7 % at 1536; from
# 1664 the H100 loses 4-5 % with it, so the band stops at 1536. Not the 1024-lane block: at 768 it
# lost 4-5 % on both GPUs.
PAD_32 = (1024, 1536)
PART_ELEMS = 2048
SPLIT_MAX = 32
TMA_STAGES = 3
REDUCE_COLS = 256  # the dw reduction's columns per program


@functools.lru_cache(maxsize=4096)
def analytic_config(N: int, elem_bytes: int, vendor: str, sm_count: int, tile_elems: int = TILE_ELEMS) -> BwdConfig:
    """The measured rules above."""
    lanes = lanes_per_warp(vendor)
    if N <= tile_elems:
        block_n = pow2_ceil(N)
        rows = max(1, min(64, tile_elems // block_n))
        per_thread = 16 if block_n == N or (elem_bytes == 2 and block_n <= NARROW_16) else 8
        if elem_bytes == 2 and PAD_32[0] < N <= PAD_32[1]:
            rows, per_thread = 2, 32
        warps = warps_for(rows * block_n, elem_bytes, lanes, vendor, per_thread=per_thread)
        return BwdConfig(rows=rows, split=1, part=N, block_n=block_n, chunks=1, num_warps=warps,
                         programs_per_sm=max(1, 2048 // (warps * lanes)), prefetch=True)
    split, part, block_n, chunks = split_for(N, PART_ELEMS, min(SPLIT_MAX, sm_count))
    if chunks > 1 and part <= 4 * PART_ELEMS:  # parts up to 8192 stay in registers (measured to 262144)
        block_n, chunks = pow2_ceil(part), 1
    warps = warps_for(block_n, elem_bytes, lanes, vendor)
    return BwdConfig(rows=1, split=split, part=part, block_n=block_n, chunks=chunks, num_warps=warps,
                     programs_per_sm=max(1, 2048 // (warps * lanes)), prefetch=True,
                     tma_stages=TMA_STAGES if vendor == "nvidia" else 0)


def grid_groups(cfg: BwdConfig, M: int, sm_count: int, resident: int = 32) -> int:
    """R, the row groups of the persistent grid: at most one per row tile, one wave in all (`resident`:
    the programs of the compiled kernel one SM holds; a split row's programs wait for each other)."""
    tiles = -(-M // cfg.rows)
    return max(1, min(tiles, min(cfg.programs_per_sm, resident) * sm_count // cfg.split))

def tma_config(cfg: BwdConfig, N: int) -> bool:
    """The config asks for TMA and its parts can be read by it: split rows whose parts are one
    power-of-two box of at least 256 columns, tiling the row exactly."""
    part = cfg.part
    return (cfg.tma_stages > 0 and cfg.split > 1 and cfg.chunks == 1
            and part >= 256 and part & (part - 1) == 0 and part * cfg.split == N)
