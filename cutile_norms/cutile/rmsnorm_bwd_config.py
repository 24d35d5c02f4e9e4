"""RMSNorm backward in cuTile: the launch config (a frozen dataclass), the measured config table and
the analytical rule behind it, and the compile-time shape of a launch (pure Python: imports without
cuTile)."""
from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
from dataclasses import dataclass

import torch

from .._platform import DeviceInfo, table_key
from .._util import pow2_ceil
from .rmsnorm_fwd_config import cached_piece_min, row_pieces, split_part

# blocks per row at most: a row's blocks wait for each other, so all of them must fit on the GPU at
# once (2 x 132 blocks on an H100/H200); wider rows give each block more columns
MAX_SPLIT = 64


# ================================================================================================
# Launch config
# ================================================================================================
@dataclass(frozen=True)
class BwdConfig:
    """One launch of the backward kernel: compile-time constants and compiler hints."""

    tile_m: int = 1  # rows per tile (narrow rows); > 1 only with split == 1
    split: int = 1  # blocks per row, each owning split_part(N, split) columns (a power of two)
    piece_min: int = 1 << 30  # smallest power-of-two piece of a part before the padded tail
    blocks_per_sm: int = 2  # the persistent grid: blocks_per_sm x SMs (also the occupancy hint)
    num_worker_warps: int | None = None
    latency: int = 1  # ct.gather/scatter DRAM latency hint
    prefetch: bool = False  # one row per tile: the next row's loads issued before this row's reduction

    def __post_init__(self):
        if self.split < 1 or self.split & (self.split - 1):
            raise ValueError(f"split must be a power of two (the exchanged sums are one tile), got {self.split}")
        if self.tile_m < 1 or self.tile_m & (self.tile_m - 1):
            raise ValueError(f"tile_m must be a power of two, got {self.tile_m}")
        if self.split > 1 and self.tile_m > 1:
            raise ValueError("a split row is one row per tile: tile_m=1 with split > 1")
        if self.prefetch and self.tile_m > 1:
            raise ValueError("prefetch is for one row per tile (tile_m=1)")

    def hints(self) -> dict:
        return {k: v for k, v in (("num_worker_warps", self.num_worker_warps),
                                  ("occupancy", self.blocks_per_sm)) if v is not None}

    def short(self) -> str:
        parts = [f"tile_m={self.tile_m}"]
        if self.split > 1:
            parts.append(f"split={self.split}")
        parts.append(f"piece_min={self.piece_min}" if self.piece_min < (1 << 30) else "one piece")
        parts.append(f"persistent x{self.blocks_per_sm}/SM")
        if self.num_worker_warps:
            parts.append(f"num_worker_warps={self.num_worker_warps}")
        parts.append(f"latency={self.latency}")
        if self.prefetch:
            parts.append("prefetch")
        return " ".join(parts)


PART_ELEMS = 4096  # elements of x per block and row tile: see analytical_config


def analytical_config(N: int, elem_bytes: int) -> BwdConfig:
    """Rules for a width with no measurement. A block holds, per element of its tile, x * rstd and
    g in fp32 between the row sum and dx, plus the weight and dw's accumulator: 4 fp32 values,
    whatever x's dtype. 4096 elements per tile (16 per thread at 8 warps) keep that near 64
    registers, so two blocks fit per SM with room for the addresses. Rows up to 1.25x that stay in
    one block (an exchange per row costs more than 4 registers per thread); wider rows are split
    (over MAX_SPLIT blocks at most: beyond that, a block's part grows and spills)."""
    if N <= PART_ELEMS * 5 // 4:
        tile_m = min(32, 1 << (max(1, PART_ELEMS // N).bit_length() - 1))  # the largest power of two that fits
        return BwdConfig(tile_m=tile_m, piece_min=cached_piece_min(N), num_worker_warps=8 if N * tile_m >= 1024 else 4)
    split = min(MAX_SPLIT, pow2_ceil(-(-N // PART_ELEMS)))
    return BwdConfig(split=split, piece_min=cached_piece_min(split_part(N, split)), num_worker_warps=8)


CONFIG_TABLE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tuning",
                            "rmsnorm_bwd_configs.json")


@functools.lru_cache(maxsize=None)
def measured_configs() -> dict:
    """{key: {dtype: [(N, BwdConfig, ratio_to_copy), ...]}} from the sweep's table
    (bench/tune/cutile_rmsnorm_bwd.py --write-configs); a key is an arch ("sm_90") or, for a GPU model
    measured on its own, "<arch>/<model>" ("sm_90/H200"), as the forward's mode=None tables."""
    try:
        with open(CONFIG_TABLE) as f:
            table = json.load(f)
    except FileNotFoundError:
        return {}
    fields = {f.name for f in dataclasses.fields(BwdConfig)}  # entries may hold fields since retired
    return {arch: {dt: sorted((e["N"], BwdConfig(**{k: v for k, v in e["config"].items() if k in fields}),
                               e["vs_copy"]) for e in rows)
                   for dt, rows in dtypes.items()}
            for arch, dtypes in table.get("configs", {}).items()}


def _scaled(cfg: BwdConfig, measured_n: int, N: int) -> BwdConfig:
    """A config measured at width measured_n used at N: the same shape of work per block (the split
    and the rows per tile scaled with the width, the pieces re-cut for the new part)."""
    if N == measured_n:
        return cfg
    if cfg.split > 1 or N > PART_ELEMS * 5 // 4:
        split = min(MAX_SPLIT, pow2_ceil(max(1, round(cfg.split * N / measured_n))))
        cfg = dataclasses.replace(cfg, split=split, tile_m=1)
    else:
        tile_m = max(1, min(64, 1 << (max(1, cfg.tile_m * measured_n // N).bit_length() - 1)))
        cfg = dataclasses.replace(cfg, tile_m=tile_m)
    return cut_pieces(cfg, N)


@functools.lru_cache(maxsize=4096)
def default_config(N: int, elem_bytes: int, dev: DeviceInfo, dtype: str = "", fp32_weight: bool = False,
                   has_dh: bool = False, full: bool = True) -> BwdConfig:
    """The backward's config for rows of N elements of `dtype` on `dev`: the config measured best at
    the nearest measured width of this GPU model's (else this arch's) table and dtype, scaled to N,
    else the analytical rule; `has_dh`: for the residual add's backward (`_dh_fit`)."""
    return config_and_source(N, elem_bytes, dev, dtype, fp32_weight, has_dh, full)[0]


def _same_width(tables: dict, elem_bytes: int) -> list:
    return [d for d in tables if torch.empty((), dtype=getattr(torch, d)).element_size() == elem_bytes]


def _table_row(by_key: dict, key: str | None, N: int, elem_bytes: int, dtype: str,
               dev: DeviceInfo) -> tuple[BwdConfig, str, int | None, list | None]:
    """(config, source, the measured width used or None, the dtype's rows or None) from table `key`:
    its row nearest N, scaled to N, else the analytical rule."""
    tables = by_key.get(key or "", {})
    # a dtype not measured takes the table of one of the same width (fp16 <-> bf16), else any: the
    # registers a config needs go with elements, not bytes
    same = _same_width(tables, elem_bytes)
    use = dtype if dtype in tables else (same or list(tables) or [None])[0]
    rows = tables.get(use)
    if not rows:
        return (analytical_config(N, elem_bytes),
                f"analytical rule (no measured {dtype} backward table for {dev.arch_name})", None, None)
    n, cfg, ratio = min(rows, key=lambda r: abs(math.log2(r[0]) - math.log2(max(N, 1))))
    return (_scaled(cfg, n, N), f"measured at N={n} on {key} in {use}: {ratio:.3f}x copy "
            f"({os.path.basename(CONFIG_TABLE)})", n, rows)


# A GPU model's rows of some element width that hold for some widths only, and without dh (not measured with
# it); outside them, and with dh, the arch's rows. The H200's fp32 rows of 4-10 KiB: 1024 and 2048 their
# sweeps' best (4 blocks of 8 warps: 4-row tiles, one row), the rest in four bands of one-row tiles, each one
# config at every width swept in it (bench/tune/cutile_rmsnorm_bwd.py --bands): prefetching, 4 blocks of 4
# warps to 1536 columns, 3 of 4 warps to 2047; 3 of 8 warps without it to 2304 (the H100's; a tail piece of up
# to 256), with it from 2305 (a 512 piece). A width takes its nearest row's config: switches at 1548, 2044,
# 2056, 2312. Performance.md 2.58: 0.93-1.01 x copy at 30 widths swept, mode=None 0.87-1.00 at 27 widths after;
# the H100's rows, scaled between their widths, read 0.63-0.99 there (0.63-0.81 at 1320 and 1560-1792). From
# 10 KiB mode=None runs the CuTe DSL backward there (backward_table.H200_FP32_CUTE_BWD_BYTES).
MODEL_ROWS_ONLY = {("sm_90/H200", 4): (1024, 2559)}  # (table key, bytes an element): (first, last column)


def config_and_source(N: int, elem_bytes: int, dev: DeviceInfo, dtype: str = "", fp32_weight: bool = False,
                      has_dh: bool = False, full: bool = True) -> tuple[BwdConfig, str]:
    """(default_config's config, its source); `full`: the launch reads a weight, writes dx and dw (SPILLING_PIECES)."""
    by_key = measured_configs()
    key = table_key(dev, by_key)  # this GPU model's, else its arch's (or the nearest measured arch's)
    only = MODEL_ROWS_ONLY.get((key, elem_bytes))
    if key and "/" in key and ((dtype not in by_key[key] and not _same_width(by_key[key], elem_bytes))
                               or (only and (has_dh or not only[0] <= N <= only[1]))):
        key = key.split("/")[0]  # the model not measured in this dtype (or at N): the arch's rows
    cfg, source, n, rows = _table_row(by_key, key, N, elem_bytes, dtype, dev)
    if has_dh and not fp32_weight and _dh_takes_arch_row(cfg, N, elem_bytes, key):
        key = key.split("/")[0]
        cfg, source, n, rows = _table_row(by_key, key, N, elem_bytes, dtype, dev)
        source += " (with dh: the arch's row in place of this GPU model's multi-row or split one)"
    if fp32_weight and elem_bytes == 2 and cfg.tile_m > 1 and cfg.tile_m * N > PART_ELEMS:
        # an fp32 weight next to 16-bit x: 64-row tiles of N = 128 spilled 232 bytes per thread (ptxas)
        cfg = dataclasses.replace(cfg, tile_m=max(1, 1 << ((PART_ELEMS // N).bit_length() - 1)))
        source += "; rows per tile capped for the fp32 weight"
    if has_dh:
        # the dh rules adjust every table's rows (_dh_takes_arch_row); an fp32 weight keeps _dh_fit's
        narrow = _narrow_dh_blocks(cfg, N, elem_bytes) if not fp32_weight else None
        if narrow is not None:
            cfg = dataclasses.replace(cfg, blocks_per_sm=narrow, prefetch=True)
            source += f"; {narrow} blocks per SM, prefetching (dh, rows of 2-5 KiB)"
        else:
            cfg, why = _dh_fit(cfg, N, elem_bytes, fp32_weight and elem_bytes == 2, n if rows else None)
            source += why
            if not fp32_weight and _one_dh_piece(cfg, N, elem_bytes):
                cfg = dataclasses.replace(cfg, piece_min=pow2_ceil(N))
                source += "; one padded piece (dh, rows of 4-16 KiB)"
    else:
        # No fp32 weight's term: one-row tiles hold the weight in fp32 registers whatever its dtype, in the rows'
        # layout (rmsnorm_bwd.row_align); ptxas counts the same registers and spills with an fp32 weight as with a
        # bf16 one at 22 widths of 2056-262144 (within 16 bytes). The H200's 6144 entry spills 36 bytes against 8
        # and runs the faster for its prefetch: H200, bf16 x, fp32 weight, 5120 / 6144 0.912 / 0.895 x copy
        # against 0.577 / 0.759 without (`python bench/probe/model_widths.py --only bwd --weight-dtype float32`).
        if cfg.prefetch and rows and N > n:
            cfg, why = _prefetch_fit(cfg, N, False, n)
            source += why
        if why := _one_padded_piece(cfg, N, elem_bytes, dtype, fp32_weight, full, key):
            cfg = dataclasses.replace(cfg, piece_min=pow2_ceil(N), blocks_per_sm=2)
            source += f"; one padded {pow2_ceil(N)} piece at 2 blocks per SM ({why})"
        elif _three_blocks(cfg, N, elem_bytes):
            cfg = dataclasses.replace(cfg, blocks_per_sm=3)
            source += "; 3 blocks per SM (at most 3 pieces, 14 values a thread)"
        elif _past_three_blocks(cfg, N, elem_bytes):
            cfg = dataclasses.replace(cfg, blocks_per_sm=2)
            source += "; 2 blocks per SM (more than 14 values a thread spill at 3)"
    return cfg, source


# 16-bit rows in one-row prefetching tiles of at most 3 pieces and 3584 lanes (14 values a thread at 8
# warps) run 3 blocks per SM where the table's config, or _prefetch_fit's estimate of it, left 2. ptxas
# (sm_90, bf16) fits them in 80 registers with 0-20 bytes of spills at every width of 2056-3584 (step 8);
# a fourth piece or one 4096 piece spills 52-116. H100, bf16, 3 M N e bytes over a copy, 3 against 2
# blocks per SM: 3080 0.907 / 0.855, 3112 0.956 / 0.861, 3240 0.962 / 0.867, 3360 0.936 / 0.909, 3456
# 0.949 / 0.923, 3560 0.968 / 0.902 (`python bench/tune/cutile_rmsnorm_bwd.py --ns
# 3080,3112,3240,3360,3456,3560`): 3073-3591 ran 2 (the 2880 entry's 3 demoted by the estimate's 12
# registers for a third piece; the 4096 entry's own 2), as did 2049-2431. Every GPU model's table: the
# registers are the compiler's (one sm_90 build), and the H200's own rows left 2 at 2049-2289 (its 2048
# entry scaled) and 3073-3212 (its 2880 entry, demoted as above). H200, bf16, 3 M N e bytes over a copy,
# 3 blocks at every multiple of 8 there against 2 at 2056 / 2104 / 2200 / 2288 / 3080 / 3112 / 3160 /
# 3208: 2056-2288 0.81-0.89 against 0.50-0.71 (Triton 0.67-0.73), 3080-3208 0.79-0.95 against
# 0.76-0.77 (Triton 0.83-0.85: ahead at 3080 and 3104, level at 3112 and 3128); `python
# bench/probe/model_widths.py --only bwd --kernels None,cutile,triton --random 0 --ns 2056,2064,...,3208`.
THREE_BLOCK_LANES = 3584


def _three_blocks(cfg: BwdConfig, N: int, elem_bytes: int) -> bool:
    """Whether a launch without dh takes 3 blocks per SM for its pieces (see THREE_BLOCK_LANES)."""
    shape = _one_row_shape(cfg, N, elem_bytes)
    if shape is None or cfg.blocks_per_sm >= 3 or not cfg.prefetch:
        return False
    pieces, lanes = shape
    return pieces <= 3 and lanes <= THREE_BLOCK_LANES


# The converse: a one-row prefetching tile of more than THREE_BLOCK_LANES lanes at 3 blocks per SM or more
# runs 2. The H200's 3584 entry (3 blocks, three pieces) scales to one 4096 piece at 3641-3697, which
# ptxas (sm_90, bf16) fits in 80 registers with 68-112 bytes of spills, none at 2 (128 registers). H200,
# bf16, 3 M N e bytes over a copy: 3672 0.677 at 3 blocks (Triton 0.887), 3704 0.899 at 2 (`python
# bench/probe/model_widths.py --only bwd --kernels None,triton --random 0 --ns 3224,3256,...,4088`). No
# other table's row is one (the H100's 4-block rows of 1800-1816 have 4 pieces of 1824 lanes at most).
def _past_three_blocks(cfg: BwdConfig, N: int, elem_bytes: int) -> bool:
    """Whether a launch without dh drops to 2 blocks per SM for its lanes (see the comment above)."""
    shape = _one_row_shape(cfg, N, elem_bytes)
    return shape is not None and cfg.blocks_per_sm >= 3 and cfg.prefetch and shape[1] > THREE_BLOCK_LANES


# A GPU model's own table (the H200's): 16-bit rows in four pieces, or in three that ptxas spills 12-24
# bytes of at 3 blocks per SM, run one padded piece at 2 (the shape from 3641 on: no spills). ptxas (sm_90,
# every multiple of 8 of 2056-3712, a launch with the weight, dx and dw): 3073-3104 (2048 + 1024 + at most
# 32) 16-20 bytes in bf16, 12 in fp16, 8-24 beside an fp32 weight; the multiples of 16 of 3329-3583 (a
# padded 512 third piece) 12 in bf16 only (4 beside an fp32 weight, 0 at 8 (mod 16) and in fp16); no
# weight, or dx or dw alone, none. H200, bf16, 3 M N e bytes over a same-run copy, the pieces against one
# 4096 piece (performance.md 2.55): 3104 0.812 / 0.847, 3360 0.829 / 0.884, 3456 0.841 / 0.911, 3568
# 0.847 / 0.908, four pieces 3600 0.860 / 0.903, 3624 0.842 / 0.892; where nothing spills the pieces lead
# (3432 0.916 / 0.869, 3328 0.953 / 0.896, fp16 3360 0.874 / 0.876). The H100 (the arch's table) keeps its
# pieces: its 3360 at 3 blocks measured 0.936 (2.22).
SPILLING_PIECES = ((3073, 3104), (3329, 3583))  # the second: bf16 rows of a multiple of 16 beside a bf16 weight


def _one_padded_piece(cfg: BwdConfig, N: int, elem_bytes: int, dtype: str, fp32_weight: bool, full: bool,
                      key: str | None) -> str:
    """Why a launch without dh on a GPU model's own table runs one padded piece, "" where it does not."""
    pieces = (_one_row_shape(cfg, N, elem_bytes) or (0,))[0] if key and "/" in key and cfg.prefetch and N <= 4096 else 0
    (lo, hi), (lo2, hi2) = SPILLING_PIECES
    spills = lo <= N <= hi or (lo2 <= N <= hi2 and N % 16 == 0 and dtype == "bfloat16" and not fp32_weight)
    return "four pieces" if pieces == 4 else "three pieces spill at 3" if pieces == 3 and spills and full else ""


def _one_row_shape(cfg: BwdConfig, N: int, elem_bytes: int) -> tuple[int, int] | None:
    """(pieces, lanes) of a 16-bit row in a one-row tile of 8 warps, the one block a row, which the rules
    here adjust (THREE_BLOCK_LANES, NARROW_DH_ROW, ONE_DH_PIECE_LANES, on every table's rows); None for
    any other."""
    if elem_bytes != 2 or cfg.split != 1 or cfg.tile_m != 1 or cfg.num_worker_warps != 8:
        return None
    pieces = row_pieces(N, piece_min(cfg, N))
    return len(pieces), sum(size for _, size in pieces)


# The residual add's backward on 16-bit rows of 2-5 KiB (N = 1025 ... 2560: mode=None runs Triton's fused
# kernel up to 2 KiB) in one-row tiles of 8 warps, prefetching: 4 blocks per SM wherever ptxas fits the
# launch in their 64 registers a thread, else 3 (80 registers, no spills at any of these widths). With
# dh a row is four streams whose latency more blocks hide: H100, bf16, 4 M N e bytes over a copy, 4
# against 3 blocks per SM: 1048 0.903 / 0.827, 1152 0.944 / 0.798, 1344 0.971 / 0.886 (the 1024 column
# config's 3 scaled up, as _dh_fit kept it); where 4 blocks spill, 3 is ahead: 1816 0.967 against 0.751
# (44 bytes of spills), 0.962 / 0.899 as one padded piece of 2048 (28 bytes); `python
# bench/tune/cutile_rmsnorm_bwd.py --dh --ns 1048,1344,1816,1152`. ptxas (sm_90, bf16 x and weight) fits
# 4 blocks where the row's tile is at most 7 lanes a thread (1792) in at most 3 pieces (1032-1704: 64
# registers, none spilled) or one unpadded piece (2048); the 4-piece 1816 and a padded 2048 piece
# (1880-2040) spill 8-44 bytes. An fp32 weight beside 16-bit x keeps _dh_fit's estimate: its 2048 spilled
# 92 bytes at 4 blocks, its 1880 20 at 3. Rows of 2049-2560 (a 2048-column piece and a tail of at most
# 512, 10 lanes a thread) take 3 blocks with their two pieces: ptxas 80 registers, no spills at 2056-2560;
# 2056 / 2200 / 2312 0.969 / 0.982 / 0.989 against 0.882 / 0.911 / 0.924 as one padded piece at 2 blocks
# (`--dh --ns 2056,2200,2312,2512,2560`; 2512 / 2560 took 3 blocks from the 2880 entry already: 0.993 / 0.991).
# Both rules below (and ONE_DH_PIECE_LANES) apply to every table's rows, an H200's own included
# (_dh_takes_arch_row).
NARROW_DH_ROW = (1025, 2560)


def _narrow_dh_blocks(cfg: BwdConfig, N: int, elem_bytes: int) -> int | None:
    """Blocks per SM for a launch with dh on rows of NARROW_DH_ROW (see there), or None outside it."""
    lo, hi = NARROW_DH_ROW
    shape = _one_row_shape(cfg, N, elem_bytes) if lo <= N <= hi else None
    if shape is None:
        return None
    pieces, lanes = shape
    if N > 2048:  # a 2048-column piece and its tail
        return 3 if pieces <= 2 and lanes <= 10 * 256 else None
    fits = (pieces <= 3 and lanes <= 7 * 256) or (pieces == 1 and lanes == N)
    return 4 if fits else 3


# Past that, up to 8192 columns (16-bit rows of 4-16 KiB), a prefetching one-row tile with dh runs the
# row as one padded power-of-two piece where its lanes fit the blocks per SM _dh_fit left (pow2_ceil(N)
# x blocks <= 8192: 16 lanes a thread at 2 blocks, 32 at 1, ptxas 128 / 255 registers, no spills at any
# width checked), rather than its pieces: each piece is a loop of its own over the row's four streams,
# and the padded lanes move no bytes. H100, bf16, 4 M N e over a copy, one piece against the pieces at
# the same blocks: 3112 0.995 / 0.872 (2 blocks), 5320 0.959 / 0.798 and 6440 0.978 / 0.773 (1 block);
# where the piece would not fit (4104, 4680 at 2 blocks: 8192 lanes, 272-276 bytes of spills) the pieces
# stay (0.996, 0.932). `python bench/tune/cutile_rmsnorm_bwd.py --dh --ns 2056,3112,5320,6440`.
ONE_DH_PIECE_LANES = 8192
ONE_DH_PIECE_MAX_N = 8192


# With dh (and a 16-bit weight or none), 16-bit rows of NARROW_DH_ROW[0]-ONE_DH_PIECE_MAX_N columns
# (2-16 KiB) run one-row prefetching tiles on every sm_90 GPU model, adjusted by the rules above and
# ONE_DH_PIECE_LANES. Where a GPU model's own table (measured without dh) holds a multi-row tile or a
# split row there, the arch's row (measured on an H100: one-row tiles at every width of that band)
# replaces it: dh is a fourth stream whose latency only the next row's prefetch hides, and neither a
# multi-row tile nor a split row prefetches (BwdConfig; _dh_fit). Beside an fp32 weight the model's rows
# and _dh_fit's estimate stay (the H200's 1256-1536 and 6640-7656: not measured that way). H200, bf16, 4 M N
# e bytes over a same-run copy, medians of 3, the model's own rows with _dh_fit's adjustment against
# these rules (`python bench/residual.py --parts backward --ns 1280,1536,1664,2312,3584,5320,6144,6584,
# 7168,7432 --runs 3`): 1280 0.735 / 0.866 and 1536 0.804 / 0.970 (2-row tiles before: the arch's row),
# 1664 0.631 / 0.962 (2 blocks per SM before, NARROW_DH_ROW's 4 now), 5320 0.656 / 0.887, 6144 0.835 /
# 0.865 and 6584 0.651 / 0.953 (the row's pieces before, one padded piece now), 7168 0.873 / 0.899 and
# 7432 0.880 / 0.988 (a split row before: the arch's row), 1960 0.847 / 0.902 (3 blocks per SM now), 3584
# 0.974 / 0.971 (three pieces before, one padded 4096 piece now), 2312 unchanged (0.963). The H100's
# configs do not change (its table is the arch's). 1816 (the H200's own 4-warp row, cut in 4 pieces)
# stays 0.83: no rule here touches it.
def _dh_takes_arch_row(cfg: BwdConfig, N: int, elem_bytes: int, key: str | None) -> bool:
    """Whether a launch with dh replaces a GPU model's own row by the arch's (see the comment above)."""
    return (elem_bytes == 2 and bool(key) and "/" in key and NARROW_DH_ROW[0] <= N <= ONE_DH_PIECE_MAX_N
            and (cfg.tile_m > 1 or cfg.split > 1))


def _one_dh_piece(cfg: BwdConfig, N: int, elem_bytes: int) -> bool:
    """Whether a launch with dh on rows of N takes one padded piece (see ONE_DH_PIECE_LANES)."""
    return (NARROW_DH_ROW[1] < N <= ONE_DH_PIECE_MAX_N and cfg.prefetch and _one_row_shape(cfg, N, elem_bytes)
            is not None and pow2_ceil(N) * cfg.blocks_per_sm <= ONE_DH_PIECE_LANES)


def _dh_fit(cfg: BwdConfig, N: int, elem_bytes: int, fp32_weight: bool,
            measured_n: int | None) -> tuple[BwdConfig, str]:
    """The config of a launch that also reads dh (the residual add's backward): always prefetching,
    since dh is a fourth row whose latency the prefetch hides (H100, bf16, 4 M N e bytes over a copy:
    the next row's dh loaded with its x and dy 0.99-1.01 at 3584-10240, this row's dh loaded at the
    row's start 0.72-0.92), with the next row's dh counted in `_prefetch_fit`'s estimate. Where it does
    not fit the config's blocks per SM, fewer blocks, down to one, rather than no prefetch: N = 6144 /
    7168 (their table configs do not prefetch) 0.860 / 0.834 as measured, 0.852 / 0.618 prefetching at
    2 blocks per SM (spills), 0.943 / 0.986 at 1; narrow rows, N = 1048 / 1344 at 3 blocks, 0.708 / 0.852
    without it, 0.840 / 0.898 with it (python bench/residual.py --parts backward --modes
    multi_wave_cached; docs/performance.md 2.16). Multi-row tiles (no prefetch) load dh with x and dy:
    fewer blocks per SM where the estimate exceeds a block's share (the H200's N = 1344 at 4 blocks per
    SM and 64 registers spilled 304 bytes per thread, at 3 and 80 140, at 2 none: ptxas; 12 registers
    a piece past the first, as `_prefetch_fit` counts them)."""
    if cfg.tile_m > 1:
        pieces = len(row_pieces(part_of(cfg, N), piece_min(cfg, N)))
        need = _registers_needed(cfg, N, 4.5 + elem_bytes / 4, pieces - 1)
        blocks = cfg.blocks_per_sm
        while blocks > 1 and need > _register_budget(cfg, blocks):
            blocks -= 1
        return (dataclasses.replace(cfg, blocks_per_sm=blocks),
                f"; {blocks} blocks per SM (dh's registers)" if blocks != cfg.blocks_per_sm else "")
    pf = dataclasses.replace(cfg, prefetch=True)
    # per element beside the estimate's (bf16 x): half a register for 16-bit dh; for fp32 rows one for dh
    # and two for the next row's x and dy at twice the width (N = 8192 / 16384, fp32, prefetching at 2
    # blocks per SM: 160-192 bytes of spills where the 16-bit count said it fit; ptxas)
    fit, why = _prefetch_fit(pf, N, fp32_weight, measured_n, extra_per_elem=0.5 if elem_bytes == 2 else 3.0,
                             registers="the next row's registers, dh's too")
    if fit.prefetch:
        return fit, why + ("; prefetching (dh)" if not cfg.prefetch else "")
    return dataclasses.replace(pf, blocks_per_sm=1), "; prefetching (dh) at 1 block per SM (the next row's registers)"


def _register_budget(cfg: BwdConfig, blocks: int) -> int:
    """A thread's share of an SM's 65536 registers at `blocks` blocks of cfg's warps (at most 255)."""
    return min(255, 65536 // (32 * (cfg.num_worker_warps or 4) * blocks))


def _registers_needed(cfg: BwdConfig, N: int, per_elem: float, pieces_past: int) -> float:
    """`_prefetch_fit`'s estimate of a thread's registers: per_elem per element of its tile (tile_m rows
    of its part), plus 20, plus 12 per piece past the count it was measured with."""
    return per_elem * cfg.tile_m * part_of(cfg, N) / (32 * (cfg.num_worker_warps or 4)) + 20 + 12 * max(0, pieces_past)


def _prefetch_fit(cfg: BwdConfig, N: int, fp32_weight: bool, measured_n: int | None,
                  extra_per_elem: float = 0.0, registers: str = "the next row's registers") -> tuple[BwdConfig, str]:
    """A prefetching config where its registers were not measured (a wider row than the config's, or
    the residual add's backward beside an fp32 weight: _dh_fit): the next row's x and dy wait in
    registers beside this row's fp32 temporaries. Estimate (a fit of ptxas's counts on sm_90, bf16
    x): 4.5 registers per element of the part a thread holds (5.5 with an fp32 weight), plus 20,
    plus 12 per piece more than the measured width's. The counts: N = 3584 at 3 blocks per SM (85
    registers each) spilled 4 bytes per thread, 3616-3632 there (a fourth piece) 52-76, and measured
    0.61-0.69 x copy on an H200 against 0.85 at 2 blocks; with an fp32 weight (before
    rmsnorm_bwd.row_align) 3584 at 3 blocks spilled 88, 6144 at 2 blocks 92; the H200's 6144 config
    at 6264 52; the H100's 5120 config at 5296 (a third piece) fits 128 with none. Where the
    estimate exceeds a block's share of the register file: 2 blocks per SM if that fits, else no
    prefetch. Where it fits the prefetch stays: at 1 block per SM it is what hides a row's latency
    (H200, N = 10728 with the 10240 config: 0.469 x copy without it)."""
    extra = 0
    if measured_n is not None and N > measured_n:
        extra = len(row_pieces(part_of(cfg, N), piece_min(cfg, N))) - len(
            row_pieces(part_of(cfg, measured_n), piece_min(cfg, measured_n)))
    need = _registers_needed(cfg, N, (5.5 if fp32_weight else 4.5) + extra_per_elem, extra)
    if need <= _register_budget(cfg, cfg.blocks_per_sm):
        return cfg, ""
    if cfg.blocks_per_sm > 2 and need <= _register_budget(cfg, 2):
        return dataclasses.replace(cfg, blocks_per_sm=2), f"; 2 blocks per SM ({registers})"
    return dataclasses.replace(cfg, prefetch=False), f"; no prefetch ({registers})"


def part_of(cfg: BwdConfig, N: int) -> int:
    return N if cfg.split == 1 else split_part(N, cfg.split)


def cut_pieces(cfg: BwdConfig, N: int) -> BwdConfig:
    """cfg with its pieces cut for rows of N elements (the fewest that waste <= 1/8 of its part)."""
    return dataclasses.replace(cfg, piece_min=cached_piece_min(part_of(cfg, N)))


def piece_min(cfg: BwdConfig, N: int) -> int:
    return min(cfg.piece_min, pow2_ceil(part_of(cfg, N)))


def dx_2d(cfg: BwdConfig, N: int) -> bool:
    """Whether dx goes out with ct.store at tile indices: every piece of a part starts at a multiple
    of its size within the row (always with one part; with several, when the part is a multiple of
    every piece)."""
    part = part_of(cfg, N)
    return cfg.split == 1 or all(part % size == 0 for _, size in row_pieces(part, piece_min(cfg, N)))


def dx_row_pad(cfg: BwdConfig) -> int:
    """dx's rows are allocated to a multiple of this (whole tiles for ct.store, and the row count's
    "divisible by 16" bit, which a launch specialises on, never changes with M)."""
    return max(16, cfg.tile_m)
