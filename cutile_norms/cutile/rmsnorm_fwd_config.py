"""RMSNorm forward in cuTile: the launch configs (a frozen dataclass), the measured config table and
the analytical heuristic behind it."""
from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
from dataclasses import dataclass

from .._platform import DeviceInfo, table_arch
from .._util import pow2_ceil

# ================================================================================================
# Launch configs
# ================================================================================================
@dataclass(frozen=True)
class FwdConfig:
    """One launch of one kernel. Everything here is a compile-time constant or a compiler hint."""

    kernel: str  # "cached" | "reload" | "split" | "stream"
    tile_m: int = 1  # rows per tile block
    piece_min: int = 1 << 30  # cached/split: smallest power-of-two piece before the padded tail
    split: int = 1  # split: blocks per row (each keeps split_part(N, split) columns on chip)
    packed: bool = False  # cached (one row per tile), split, stream: keep 16-bit x as loaded between its two uses
    chunk: int = 2048  # reload: columns per chunk
    reverse: bool = True  # reload: second pass walks the chunks backwards
    persistent: bool = False  # a persistent grid of blocks_per_sm x SMs (occupancy hint = blocks_per_sm); stream: always
    blocks_per_sm: int = 1
    hoist_w: bool = False  # cached, stream: keep the weight in registers across a persistent loop
    latency: int = 1  # ct.gather/scatter DRAM latency hint
    w_early: bool = False  # split, cached: the weight never delays x's loads
    tie_slot: bool = False  # split: the workspace slot's load goes out with x's (tiles.zero_of)
    num_worker_warps: int | None = None  # compiler hints (None = compiler's choice)
    num_ctas: int | None = None
    occupancy: int | None = None

    def __post_init__(self):
        if self.split < 1 or self.split & (self.split - 1):
            raise ValueError(f"split must be a power of two (the partial sums are one tile), got {self.split}")
        if self.kernel == "stream" and not self.persistent:
            raise ValueError("the stream kernel is a persistent grid: persistent=True")
        if self.tie_slot and self.kernel != "split":
            raise ValueError("tie_slot is a split-kernel field (the other kernels have no workspace)")

    def hints(self) -> dict:
        # a persistent grid sizes itself to blocks_per_sm: tell the compiler that many CTAs must fit
        occupancy = self.blocks_per_sm if self.persistent else self.occupancy
        return {k: v for k, v in (("num_worker_warps", self.num_worker_warps), ("num_ctas", self.num_ctas),
                                  ("occupancy", occupancy)) if v is not None}

    def short(self) -> str:
        parts = [self.kernel, f"tile_m={self.tile_m}"]
        if self.kernel == "split":
            parts.append(f"split={self.split}")
        if self.kernel in ("cached", "split", "stream"):
            parts.append(f"piece_min={self.piece_min}" if self.piece_min < (1 << 30) else "one piece")
            if self.packed:
                parts.append("packed")
            if self.w_early:
                parts.append("w_early")
            if self.tie_slot:
                parts.append("tie_slot")
        else:
            parts.append(f"chunk={self.chunk}" + (" reverse" if self.reverse else ""))
        if self.persistent:
            parts.append(f"persistent x{self.blocks_per_sm}/SM" + (" hoist_w" if self.hoist_w else ""))
        parts.append(f"latency={self.latency}")
        parts += [f"{k}={v}" for k, v in self.hints().items() if not (k == "occupancy" and self.persistent)]
        return " ".join(parts)


def row_pieces(n: int, piece_min: int) -> tuple[tuple[int, int], ...]:
    """Split [0, n) into power-of-two pieces (offset, size), largest first, each offset a multiple
    of its size; what is left below `piece_min` becomes one last piece padded to a power of two."""
    pieces, off = [], 0
    size = 1 << (n.bit_length() - 1)
    while size >= max(piece_min, 1):
        if n - off >= size:
            pieces.append((off, size))
            off += size
        size //= 2
    if off < n:
        pieces.append((off, 1 << (n - off - 1).bit_length()))
    return tuple(pieces)


def _pieces_waste(n: int, piece_min: int) -> float:
    return sum(s for _, s in row_pieces(n, piece_min)) / n - 1.0


def split_part(n: int, split: int) -> int:
    """Columns per block of a row split over `split` blocks: a multiple of 16 elements, so every
    block's columns start 16-byte aligned; the last block's part is short when split does not divide n."""
    return -(-n // (16 * split)) * 16


def cached_piece_min(n: int) -> int:
    """One padded tile when it wastes <= 1/8 of the lanes, else the fewest pieces that do."""
    pm = pow2_ceil(n)
    while pm > 64 and _pieces_waste(n, pm) > 0.125:
        pm //= 2
    return pm


CONFIG_TABLE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tuning",
                            "rmsnorm_fwd_configs.json")
FAMILIES = {  # which configs implement each mode's idea
    "multi_wave_cached": lambda c: c.kernel in ("cached", "split") and not c.persistent,
    "static_persistent": lambda c: c.persistent,
    "multi_wave_reload": lambda c: c.kernel == "reload" and not c.persistent,
}


def _table_config(fields: dict) -> FwdConfig:
    """A table entry's config. Entries swept before w_early existed have no such field: a one-row
    multi-wave cached tile takes it, the others keep their measured loads. Measured on the H200
    with the table's configs, off / on (docs/design.md):
    without it the weight's loads wait for x's sum of squares (SASS), a second DRAM round trip in
    series that nothing hides when a launch has fewer blocks than SMs: bf16 N = 4096, M = 1
    5.4 -> 5.1 us (copy 4.6), fp32 4096 5.9 -> 5.3; at full size a tie or better (bf16 4096
    0.975 -> 0.984, fp16 2048 0.982 -> 0.991, fp32 1024-4096 within +0.3 %). Multi-row tiles and a
    weight held across a persistent loop lost 1-7 % at full size with it (their ties cost per element)."""
    if "w_early" not in fields:
        fields = dict(fields, w_early=fields["kernel"] == "cached" and fields.get("tile_m", 1) == 1
                      and not fields.get("persistent", False))
    return FwdConfig(**fields)


@functools.lru_cache(maxsize=None)
def measured_configs() -> dict:
    """{arch: {mode: [(row_bytes, FwdConfig, ratio_to_copy, dtype), ...]}} from the sweep's table."""
    try:
        with open(CONFIG_TABLE) as f:
            table = json.load(f)
    except FileNotFoundError:
        return {}
    out = {}
    for arch, modes in table.get("configs", {}).items():
        for mode, entries in modes.items():
            out.setdefault(arch, {})[mode] = sorted(
                ((e["row_bytes"], _table_config(e["config"]), e["vs_copy"], e.get("dtype", "")) for e in entries),
                key=lambda t: (t[0], t[3]))
    return out


@functools.lru_cache(maxsize=4096)
def default_config(mode: str, N: int, elem_bytes: int, dev: DeviceInfo, dtype: str = "") -> FwdConfig:
    """The launch config of `mode` for rows of N elements of `dtype` ("bfloat16", ...): the config
    measured best for the nearest row size (bytes) on this arch, among the entries measured in this
    dtype if there are any (tuning/rmsnorm_fwd_configs.json, written by
    bench/tune/cutile_rmsnorm_fwd.py --dtype D --write-configs), else the analytical rule below."""
    tables = measured_configs()
    entries = tables.get(table_arch(dev, tables) or "", {}).get(mode)  # an unmeasured arch: the nearest
    if entries:
        same = [e for e in entries if e[3] == dtype] or entries
        rb = N * elem_bytes
        row_bytes, cfg = min(((e[0], e[1]) for e in same), key=lambda e: abs(math.log2(e[0]) - math.log2(rb)))
        return fit_to_width(cfg, row_bytes // elem_bytes, N, elem_bytes)
    return analytical_config(mode, N, elem_bytes)


# A 16-bit split row between the measured widths: parts of at most 8192 columns (16 KiB), each held
# as one power-of-two piece (the short part's tail masked); rows of up to 4 parts run as the
# 32768-column entry does (unpacked, the weight's loads with x's, 6 blocks per SM), rows of 8 parts
# or more packed, 8 blocks per SM.
SPLIT_PART_COLS_16 = 8192
SPLIT_FEW_PARTS = 4


def split_between(N: int) -> FwdConfig:
    """The split config of a 16-bit row of N columns that no measured entry was swept at.

    Past 32768 columns (8 parts or more): one padded piece kept packed, 8 blocks per SM. mode=None at
    18 widths from 33416 to 262144 (six random): H100 bf16 0.974-0.995, fp16 0.979-0.998; H200 bf16
    0.893-0.970, fp16 0.905-0.973 x copy (docs/performance.md 2.14). The nearest entry's config split
    further into several pieces per part under a raised occupancy hint measured H100 0.83-0.97 and
    H200 0.71-0.92 there (H200 bf16 33416 0.736 -> 0.926, 83352 0.706 -> 0.917, 149992
    0.728 -> 0.894), and the same piece unpacked at 6 blocks per SM 0.3-13 % behind on the H200. One
    packed piece holds 42-48 registers per thread against 64 for the re-cut pieces (ptxas, 128
    threads); the padding's masked lanes cost registers but no DRAM bytes.
    Up to 32768 columns (2 or 4 parts): the 32768-column entry's config (unpacked, the weight's loads
    with x's, 6 blocks per SM), which measured ahead of the packed one on both GPUs there (31080: H100
    1.003 against 0.984, H200 0.969 against 0.946); at 9 widths of 24736-32768 H100 0.995-1.013, H200
    0.952-0.992 (bf16 and fp16).
    Both choices depend only on the part count and the part's width, so they hold between the
    measured widths: every part of a row of 32769-524288 columns is 4097-8192 columns wide whatever N is."""
    split = 2
    while split < 64 and split_part(N, split) > SPLIT_PART_COLS_16:
        split *= 2
    piece = pow2_ceil(split_part(N, split))
    if split <= SPLIT_FEW_PARTS:
        return FwdConfig("split", split=split, piece_min=piece, occupancy=6, w_early=True, tie_slot=True)
    occupancy = max(1, 8 * SPLIT_PART_COLS_16 // piece)  # past 64 parts: wider pieces, fewer blocks
    return FwdConfig("split", split=split, piece_min=piece, packed=True, occupancy=occupancy, tie_slot=True)


def fit_to_width(cfg: FwdConfig, measured_n: int, N: int, elem_bytes: int) -> FwdConfig:
    """A config measured at rows of measured_n elements (the nearest measured row), used at N.

    16-bit split rows take `split_between(N)`. fp32: a block's registers grow with the columns it
    keeps: the 65536-byte entry's split of 4 (8192 columns per block, 6 blocks per SM) applied to a
    wider row made blocks that spilled (bf16 N = 36384: 80-416 bytes per thread, 0.82 x copy on an
    H100). So where a split row's parts come out wider than the measured part, the split doubles
    until they do not, the pieces are re-cut for the new part (`cached_piece_min`) and the occupancy
    hint grows in proportion (the same columns per SM in flight). Where the parts come out narrower
    the config stays as measured, and so does a config with no occupancy hint (the compiler sizes
    its registers)."""
    if N == measured_n or cfg.kernel != "split":
        return cfg
    if elem_bytes == 2:
        return split_between(N)
    if cfg.occupancy is None:
        return cfg
    measured_part = split_part(measured_n, cfg.split)
    split = cfg.split
    while split < 64 and split_part(N, split) > measured_part:
        split *= 2
    if split == cfg.split:
        return cfg
    part = split_part(N, split)
    occupancy = min(16, cfg.occupancy * measured_part // part)
    return dataclasses.replace(cfg, split=split, piece_min=cached_piece_min(part), occupancy=occupancy)


SPLIT_ROW_BYTES = 65536  # the analytical rule splits rows above this (the measured table from 32 KiB rows)


def analytical_config(mode: str, N: int, elem_bytes: int) -> FwdConfig:
    """Rules for an arch without measurements (from the sm_90 sweeps, docs/design.md)."""
    row_bytes = N * elem_bytes
    # rows per tile so one tile moves >= ~8 KiB (narrow rows: one row per block is too little work)
    tile_m = 1 if row_bytes >= 4096 else min(64, pow2_ceil(8192 // row_bytes))
    nww = 8 if row_bytes >= 8192 else None  # 8 warps: half the registers per thread for long rows
    if mode == "multi_wave_cached":
        if row_bytes > SPLIT_ROW_BYTES:
            if elem_bytes == 2:
                return split_between(N)
            # fp32: the H200 sweeps' optimum, 32 KiB per block with 4 blocks per SM (docs/design.md)
            part_bytes, occupancy = 32768, 4
            split = min(64, pow2_ceil(-(-row_bytes // part_bytes)))
            return FwdConfig("split", split=split, piece_min=cached_piece_min(split_part(N, split)),
                             occupancy=occupancy)
        return FwdConfig("cached", tile_m=tile_m, piece_min=cached_piece_min(N), num_worker_warps=nww,
                         w_early=tile_m == 1)  # the weight's loads with x's (_table_config)
    if mode == "static_persistent":
        return FwdConfig("cached", tile_m=tile_m, piece_min=cached_piece_min(N), persistent=True,
                         blocks_per_sm=8 if row_bytes * tile_m <= 16384 else 2, hoist_w=row_bytes <= 4096,
                         latency=1 if row_bytes <= 4096 else 10, num_worker_warps=nww)
    if mode == "multi_wave_reload":
        chunk = min(pow2_ceil(N), 8192 // elem_bytes)
        return FwdConfig("reload", tile_m=tile_m, chunk=chunk, latency=1 if row_bytes <= 65536 else 10)
    raise ValueError(mode)
