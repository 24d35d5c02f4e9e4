"""RMSNorm backward in Triton: the launch config and its analytic rule, measured (pure Python: imports
without Triton)."""
from __future__ import annotations

import functools
from dataclasses import dataclass, replace

from .._platform import DeviceInfo, gpu_model
from .._util import pow2_ceil
from .tiling import TileConfig, lanes_per_warp, split_for, warps_for


# ================================================================================================
# Launch config and heuristic
# ================================================================================================
@dataclass(frozen=True)
class BwdConfig(TileConfig):
    acc_2d: bool = True  # dw accumulated per tile element, summed over the rows once at the end
    tma_stages: int = 0  # x and dy by TMA, pipelined this many stages (0: pointer loads)
    tma_rows: int = 0  # whole rows by TMA (rms_norm_bwd_tma_rows_kernel): rows per tile (0: split rows or none)
    tma_pieces: tuple[int, ...] = ()  # ... each row in pieces of these columns (row_pieces; (): one of block_n)

    @property
    def pieces(self) -> tuple[int, ...]:
        """The TMA rows kernel's pieces of a row: tma_pieces, or one piece of block_n columns."""
        return self.tma_pieces or (self.block_n,)

    @property
    def piece_starts(self) -> tuple[int, ...]:
        """The first column of each of `pieces`."""
        return tuple(sum(self.pieces[:i]) for i in range(len(self.pieces)))

    def short(self) -> str:
        if self.tma_rows:
            cols = "+".join(map(str, self.pieces))
            return (f"TMA tiles of {self.tma_rows} rows x {cols} cols, {TMA_ROWS_WARPS} warps, 1 program/SM, "
                    f"{self.tma_stages} stages; where TMA cannot address the rows, does not fit the SM's shared "
                    f"memory or dx is not needed, rms_norm_bwd_kernel: " + super().short())
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
# 16-bit rows of TMA_ROWS_MIN-TMA_ROWS_MAX columns (a multiple of 8: 16-byte rows) on NVIDIA sm_90+:
# rms_norm_bwd_tma_rows_kernel, tiles of rows (4-16: the GPU model's tile_elems) read by TMA into shared memory,
# Triton's pipeliner issuing them STAGES - 1 tiles ahead, dx written back by TMA, 8 warps (32 values a
# thread). The pointer kernel's register prefetch holds one tile ahead, 24-32 KiB of x and dy per SM
# here, short of what the DRAM needs to stream (Little's law: bandwidth x latency / SMs). The stages are
# the fewest that keep the GPU's `in_flight` bytes of x and dy issued ahead (tma_rows_stages). Measured
# (python bench/probe/triton_bwd_rows.py, bf16, medians of 3, docs/performance.md 2.26) against the
# pointer kernel, at the rule's stages:
#   * rows filling 3/4 of their power-of-two block or more: H100 +0.6 to +3.8 % at 768, 896, 960, 992,
#     1536, 1800, 1920, 1984, -1.0 / -1.3 / 0 % at 1000 / 2040 / 2048; H200 +2.2 / +3.9 / +4.5 / +0.2 /
#     +1.5 / +3.0 % at 768 / 896 / 960 / 1800 / 2040 / 2048, -1.5 % at 1536;
#   * rows filling less (a quarter to half of the tile's lanes idle, in shared memory and registers as
#     in the pointer kernel): H100 +0.1 to +8.9 % at 576, 600, 640, 720, 1088, 1120, 1152, 1280, 1368,
#     1480, -0.9 % at 1040; the H200 lost 3-16 % (640, 1040, 1152, 1280, 1480), so there they keep the
#     pointer kernel (TmaRowsRule.min_fill; why the H200 loses there is not known);
#   * 512 columns (a full block, 16 rows a tile): H100 -0.9 %, so the band starts past 512. Past 2048
#     columns (tiles of 1-2 rows of a 4096 or 8192 block) it lost 15-16 % at 4104 and 5000 and was level
#     at 6400-7680 (H100), so those keep the pointer kernel there (an H200's `wide` band: TmaRowsRule).
TMA_ROWS_MIN, TMA_ROWS_MAX = 520, 2048
TMA_ROWS_WARPS = 8
# at most 5: 4 x 32 KiB of x and dy + 16 KiB of dx in shared memory at 8192-element tiles (144 KiB); the H200's
# tiles of up to 16384 take 3 (160 KiB), their 48-56 KiB a stage covering its in_flight in two
TMA_ROWS_STAGES = (3, 5)


@dataclass(frozen=True)
class TmaRowsRule:
    """The narrow rows' TMA kernel on one GPU model: `in_flight`, the bytes of x and dy a program (one per
    SM) keeps issued ahead; `min_fill`, the least share of its block a row fills to take the kernel;
    `tile_elems`, the most elements of its rows a tile holds (tma_rows_tile: the rows a tile takes);
    `pieces`, the most powers of two a row filling less than min_fill may be cut into instead
    (row_pieces: only where they tile it exactly); `wide`, a band of columns past TMA_ROWS_MAX whose rows
    of a multiple of 32 bytes take the kernel too, a row a tile. With dh (the residual add's backward,
    tma_rows_take's `dh`): rows of TMA_ROWS_MIN to `dh_max` columns (0: none), those in a block of more
    than DH_ONE_BLOCK columns only at a multiple of 32 bytes filling `dh_min_fill` of it or in exact
    pieces, and the band `dh_wide`, rows of a multiple of 32 bytes a row a tile, in two exact pieces where
    they tile it (6144)."""
    in_flight: int
    min_fill: float = 0.0
    tile_elems: int = TILE_ELEMS
    pieces: int = 1
    wide: tuple[int, int] = (0, -1)
    dh_max: int = 0
    dh_min_fill: float = 0.0
    dh_wide: tuple[int, int] = (0, -1)

    def __post_init__(self):
        if not 1 <= self.pieces <= 2:  # the kernel's entry points (rmsnorm_bwd_kernel.TMA_ROWS_KERNELS)
            raise ValueError(f"TmaRowsRule.pieces must be 1 or 2, got {self.pieces}")
        for name in ("wide", "dh_wide"):
            lo, hi = getattr(self, name)
            if lo <= hi and not (TMA_ROWS_MAX < lo and hi <= TILE_ELEMS):
                raise ValueError(f"TmaRowsRule.{name} must lie in {TMA_ROWS_MAX + 1}..{TILE_ELEMS}, got {(lo, hi)}")
        if self.dh_max and not TMA_ROWS_MIN <= self.dh_max <= TMA_ROWS_MAX:
            raise ValueError(f"TmaRowsRule.dh_max must be 0 or in {TMA_ROWS_MIN}..{TMA_ROWS_MAX}, got {self.dh_max}")


# On an H100 the target is 52 KiB: at 768 the rule takes 4 stages (3 keep 2 x 24 KiB ahead: 0.939 against
# 0.944; 640 lost 4 % with 3), at 896 / 1800 three (2 x 28 KiB; 4 stages lost 2.2-2.8 %): any target
# over 48 KiB and up to 56 KiB gives those widths the same counts. An H200 moves 1.43 x the H100's bytes
# a second with the same 132 SMs, so by Little's law it needs 1.43 x as many in flight: its measured best
# was the rule's count or within 1 % of it at 768-2048 (896: 4 stages 0.914, 3 stages 0.883). A GPU
# model not named here takes the H100's rule.
# The tile: on an H100, TILE_ELEMS of its rows' elements (rows of 520-1024 columns 8 a tile, up to 2048
# columns 4); tiles of twice as many rows lost there at every width of 520-2048 but 520 (1.5-5.1 %, 896: 0.926
# against 0.949). On an H200 tiles of up to 14336 elements of its rows (7/8 of a 16384-element box: 16 rows of
# up to 896 columns, 8 rows of up to 1792): 768 / 816 / 848 / 896 / 1536 / 1600 / 1664 / 1728 gained 1-11 %
# over the 8192-element tile (896: 0.925 against 0.914, 1536: 0.954 against 0.861); filling more of the larger
# box lost 2-4 % (960 / 1856 / 1920 / 1984 / 2048, 16 or 8 rows against 8 or 4), so the limit sits between
# 1728 x 8 and 1856 x 8 (1800 x 8 = 14400 elements, just over it, keeps 4 rows: 0.868 where 8 gave 0.898; 936
# / 984 / 1000 keep 8 rows where 16 measured 0-4.8 % faster and the pointer kernel, at 984 / 1000, faster
# still). The H200 streams 1.43 x the H100's bytes with the same SMs, so each tile's fixed work (its rows'
# reductions, the barrier waits, dx's store) takes a larger share of the time and is spread over twice the
# bytes; the H100, with that slack, pays for the larger register tile (64 values a thread per tensor: at 8
# warps ptxas reports 280-308 bytes of spill stores, and 16 warps, which do not spill, ran at 0.44-0.57 on the
# H200 at 640-896). Measured: the kernel at both tiles, medians of 3 (docs/performance.md 2.27;
# bench/probe/triton_bwd_rows.py --tiles 8192,14336 times the same launches).
# The H200's rows filling under 3/4 of their block that two powers of two of 128 columns or more tile exactly
# (640, 1152, 1280 in the band) run in those two pieces (rms_norm_bwd_tma_rows2_kernel): no lane idles, in
# registers or shared memory. Measured (same probe, --pieces 1,2, two runs): 1152 0.869 / 0.877 and 1280
# 0.914 / 0.912 against the pointer kernel's 0.807-0.810 / 0.834-0.839 (+8 / +9 %); where one block already
# fills 3/4 the pieces gained nothing (768: 0.920 / 0.918 against one block's 0.924 / 0.919; 1536: 0.925 /
# 0.928 against 0.945 / 0.943). Three pieces lost 7-40 % wherever measured (1664, 1792, 2816, 3328, 3584,
# 6656, 7168), and pieces that leave the last one part past the row's end lost too (896 as 512 + 512: 0.59;
# 1800 as 1024 + 1024: 0.74): only exact tilings, and at most two pieces.
# The H200's `wide` band, 16-bit rows of 6145-8192 columns (where its mode=None runs Triton's backward) that
# are a multiple of 16 columns: a row a tile (8192-element tiles), 4-5 stages. Measured against the pointer
# kernel (medians of 3): +2.6 to +5.4 % at 6272, 6400, 6656, 6912, 7040, 7104, 7168, 7200, 7424, 7680, 7776,
# 7936, 8064, 8192 (7168: 0.935 against 0.892, 7424: 0.961 against 0.915), level at 6160 (0.849 / 0.850);
# rows of 8 (mod 16) columns, each row's copy starting 16 bytes off a 32-byte boundary, lost 15-19 % (6152,
# 6984, 7992, 8008: 0.689-0.782), so they keep the pointer kernel. One row a tile: the 14336-element tiles
# hold two rows up to 7168, which measured 0.908 against one row's 0.935 at 7168 (6656: 0.893 / 0.890).
# With dh (the residual add's backward: dh read by TMA too and added to dx), on the H200, against what its
# mode=None ran there (Triton's fused register kernel up to 1024 columns, the cuTile kernel reading dh above;
# python bench/probe/triton_bwd_rows.py --dh --stages 3 --pieces 1,2, bf16, 2^27 elements, medians of 3, ratio
# to a copy of 2 x its bytes; docs/performance.md 2.49):
#   * rows of one block of up to DH_ONE_BLOCK columns, every width measured: 544-1024 at 0.78-0.96 (544 / 568
#     0.776 / 0.801, 640-1024 0.90-0.96) against the register kernel's 0.45-0.89 (896: 0.955 against 0.863);
#   * 2048-column blocks, rows of a multiple of 16 columns filling at least dh_min_fill of the block: +0.6 to
#     +13 % at 1088, 1152 (in two pieces, 0.971), 1216, 1280, 1312, 1344, 1360, 1376, 1392, 1408, 1440, 1456;
#     below that fill it lost (1040 / 1056 / 1072: 0.722 / 0.749 / 0.798 against 0.819 / 0.827 / 0.821, the
#     crossing between 1072, 52 % of the block, and 1088, 53 %); rows of 8 (mod 16) columns lost 4-17 % at 1032,
#     1048, 1064, 1096, 1176, 1256, 1320, 1368, 1384, 1400 (as the wide band's plain rows, half of them start 16
#     bytes off 32); past dh_max the cuTile kernel's measured configs lead (1472 / 1536 / 1792 / 2048: 0.914 /
#     0.941 / 0.955 / 0.968 against 0.953 / 0.963 / 0.995 / 0.994; 1600 / 1664 within 1 %);
#   * dh_wide, rows of a multiple of 16 columns a row a tile (6144 in two pieces, 4096 + 2048: 0.951, one
#     8192 box 0.922): 0.926-0.979 at 6144, 6176, 6192, 6224, 6240, 6272, 6288, 6368, 6544, 6656, 6800, 6912,
#     7168, 7184, 7424, 7456, 7680, 7856, 7936 against the cuTile kernel's 0.861-0.941 (7168: 0.969 against
#     0.907); level at 6208 and 8192 (0.981 / 0.982, 0.954 / 0.955); 6160 0.842 against 0.858 in one run, 0.932
#     against 0.908 in another; between 2048 and 6144 the cuTile kernel led (2560-5120: TMA 0.73-0.95 against
#     0.91-0.99).
# With dh, 3 stages (TMA_ROWS_STAGES[0]): two tiles of x, dy and dh ahead, 72-96 KiB of boxes in the wide band
# (about the H200's in_flight) and 192 KiB at the narrow rows' 16 x 1024 and 8 x 2048 boxes, where 3 are the most
# that fit 227 KiB (with dx's tile); 3 against 4 stages measured +0.5 to +2.5 % at 1024, 2048, 6272, 6656-7936,
# level at 6144 (0.951 / 0.949), and at 6160 -3.4 % in one run (0.808 / 0.842) where against 5 it gained 2.0 %
# in another (0.932 / 0.912; 6176-6240: +0.9 to +6.4 %).
DH_ONE_BLOCK = 1024
H100_TMA_ROWS = TmaRowsRule(in_flight=52 * 1024)
TMA_ROWS_BY_MODEL = {"H200": TmaRowsRule(in_flight=76 * 1024, min_fill=0.75, tile_elems=14336, pieces=2,
                                         wide=(6145, 8192), dh_max=1456, dh_min_fill=0.53,
                                         dh_wide=(6144, 8192))}  # gpu_model -> rule


def tma_rows_rule(dev: DeviceInfo | None) -> TmaRowsRule:
    """The narrow rows' TMA rule of `dev`'s GPU model (the H100's where it has none of its own)."""
    return TMA_ROWS_BY_MODEL.get(gpu_model(dev.name), H100_TMA_ROWS) if dev is not None else H100_TMA_ROWS


def row_pieces(N: int, most: int, least: int = 128) -> tuple[int, ...]:
    """A row of N columns as the powers of two that tile it exactly (its binary digits, largest first)
    where there are at most `most` of them, each of at least `least` columns; else one piece of
    pow2_ceil(N)."""
    pieces = tuple(1 << b for b in range(N.bit_length() - 1, -1, -1) if N >> b & 1)
    if len(pieces) <= most and pieces[-1] >= least:
        return pieces
    return (pow2_ceil(N),)


def tma_rows_tile(N: int, tile_elems: int) -> int:
    """The rows a tile of the narrow rows' TMA kernel takes: the most, a power of two, whose N-column
    rows hold at most `tile_elems` elements (TILE_ELEMS: TILE_ELEMS // pow2_ceil(N) for N <= TILE_ELEMS)."""
    return 1 << (max(1, tile_elems // N).bit_length() - 1)


def tma_rows_take(N: int, elem_bytes: int, rule: TmaRowsRule, dh: bool = False) -> dict:
    """The TMA rows kernel's fields of BwdConfig for 16-bit rows of N (a multiple of 8) under `rule`, or
    {} where the rule leaves them to the pointer kernel (`dh`: the residual add's backward, its own
    bands: TmaRowsRule)."""
    block = pow2_ceil(N)
    wide = rule.dh_wide if dh else rule.wide
    if TMA_ROWS_MIN <= N <= (rule.dh_max if dh else TMA_ROWS_MAX):
        pieces = (block,)
        if N < rule.min_fill * block:  # too much of the block idle: exact pieces (else row_pieces gives the block)
            pieces = row_pieces(N, rule.pieces)
            if sum(pieces) != N and not (dh and (block <= DH_ONE_BLOCK or N >= rule.dh_min_fill * block)):
                return {}
        if dh and block > DH_ONE_BLOCK and N % 16:
            return {}
        rows = tma_rows_tile(N, rule.tile_elems)
    elif wide[0] <= N <= wide[1] and N % 16 == 0:
        pieces, rows = row_pieces(N, rule.pieces) if dh else (block,), 1
    else:
        return {}
    stages = TMA_ROWS_STAGES[0] if dh else tma_rows_stages(N, rows, elem_bytes, rule.in_flight)
    return dict(tma_rows=rows, tma_stages=stages, tma_pieces=pieces if len(pieces) > 1 else ())


def tma_rows_align(N: int, dh: bool = False) -> int:
    """The bytes the TMA rows kernel's row starts and strides must be a multiple of at rows of N: 32 past
    TMA_ROWS_MAX columns (and, with dh, past DH_ONE_BLOCK), where rows 16 bytes off 32 lost to the other
    kernel (TmaRowsRule's evidence); else 16, TMA's own."""
    return 32 if N > (DH_ONE_BLOCK if dh else TMA_ROWS_MAX) else 16


def tma_rows_stages(N: int, rows: int, elem_bytes: int, in_flight: int) -> int:
    """The pipeliner's stages for tiles of `rows` rows of N: STAGES - 1 tiles of x and dy in flight
    cover `in_flight` bytes, within TMA_ROWS_STAGES."""
    ahead = -(-in_flight // (rows * N * 2 * elem_bytes))
    return max(TMA_ROWS_STAGES[0], min(TMA_ROWS_STAGES[1], 1 + ahead))


@functools.lru_cache(maxsize=4096)
def analytic_config(N: int, elem_bytes: int, vendor: str, sm_count: int, tile_elems: int = TILE_ELEMS,
                    tma_rows: TmaRowsRule = H100_TMA_ROWS) -> BwdConfig:
    """The measured rules above (`tma_rows`: tma_rows_rule of the GPU)."""
    lanes = lanes_per_warp(vendor)
    if N <= tile_elems:
        block_n = pow2_ceil(N)
        rows = max(1, min(64, tile_elems // block_n))
        per_thread = 16 if block_n == N or (elem_bytes == 2 and block_n <= NARROW_16) else 8
        tma = tma_rows_take(N, elem_bytes, tma_rows) if vendor == "nvidia" and elem_bytes == 2 and N % 8 == 0 else {}
        if elem_bytes == 2 and PAD_32[0] < N <= PAD_32[1]:
            rows, per_thread = 2, 32
        warps = warps_for(rows * block_n, elem_bytes, lanes, vendor, per_thread=per_thread)
        return BwdConfig(rows=rows, split=1, part=N, block_n=block_n, chunks=1, num_warps=warps,
                         programs_per_sm=max(1, 2048 // (warps * lanes)), prefetch=True, **tma)
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


def tma_rows_shared_bytes(cfg: BwdConfig, stages: int, x_bytes: int, dy_bytes: int, dh_bytes: int = 0,
                          dx_bytes: int | None = None) -> int:
    """The shared memory rms_norm_bwd_tma_rows_kernel takes at `stages`: Triton's pipeliner keeps
    stages - 1 tiles of x and dy (and dh, dh_bytes > 0), plus one tile of dx (x's bytes unless dx_bytes)
    for its TMA store and 1 KiB of barriers and scratch (compiled for sm_90: 82112 bytes at 3 stages,
    147712 at 5, 16-bit tiles of 8192 elements)."""
    tile = cfg.tma_rows * sum(cfg.pieces)
    return (stages - 1) * tile * (x_bytes + dy_bytes + dh_bytes) + tile * (dx_bytes or x_bytes) + 1024


def tma_rows_config(cfg: BwdConfig, shared_max: int | None = None, x_bytes: int = 2, dy_bytes: int = 2,
                    dh_bytes: int = 0, dx_bytes: int | None = None) -> BwdConfig | None:
    """The launch config of rms_norm_bwd_tma_rows_kernel for `cfg` (tma_rows > 0): its tile, its warps,
    one program per SM, its stages capped to what `shared_max` bytes a block may take (None: no cap); None
    where not even TMA_ROWS_STAGES[0] fit (the GPUs with 99 KiB a block, sm_120, at rows of up to 1536
    16-bit columns take 3 stages; with an fp32 dy fewer fit)."""
    stages = cfg.tma_stages
    while shared_max is not None and stages >= TMA_ROWS_STAGES[0] and \
            tma_rows_shared_bytes(cfg, stages, x_bytes, dy_bytes, dh_bytes, dx_bytes) > shared_max:
        stages -= 1
    if stages < TMA_ROWS_STAGES[0]:
        return None
    return replace(cfg, rows=cfg.tma_rows, num_warps=TMA_ROWS_WARPS, programs_per_sm=1, prefetch=False,
                   tma_stages=stages)


def tma_config(cfg: BwdConfig, N: int) -> bool:
    """The config asks for TMA and its parts can be read by it: split rows whose parts are one
    power-of-two box of at least 256 columns, tiling the row exactly."""
    part = cfg.part
    return (cfg.tma_stages > 0 and cfg.split > 1 and cfg.chunks == 1
            and part >= 256 and part & (part - 1) == 0 and part * cfg.split == N)
