"""RMSNorm backward in cuTile: the persistent kernel, its launch config and heuristic, the launch wrapper.

Layout (TileGym's order): kernel -> launch config (a frozen dataclass) -> heuristic -> compile-time
signature (for the CI compile checks) -> workspaces and launch wrapper -> the backend.

The math, all in fp32 (w' = offset + w, xhat = x * rstd with rstd saved by the forward):
    g = dy * w'        dx = rstd * (g - xhat * mean(g * xhat))        dw = sum over rows of dy * xhat

One launch, a persistent grid of R row groups x SPLIT column parts (block b: part b % SPLIT of the rows
b // SPLIT, b // SPLIT + R, ...):
  * Each block loads its part of the weight once and keeps it (+ offset, fp32) on chip with its dw
    accumulator (fp32, one per column it owns), then walks its row tiles: x, dy and rstd in, dx out.
  * SPLIT > 1 (rows too long for one block's registers): the blocks of a row exchange their partial
    sums of g * xhat through global memory (a software cluster, as the forward's split kernel does),
    each in an int64 slot of the row: the fp32 bits in the low word, in the high word a flag that
    every launch flips, so the slots never need clearing and a replayed CUDA graph flips them too.
  * PREFETCH (one-row tiles): the next row's x, dy and rstd, and for split rows the old value of its
    exchange slot, are loaded before this row's reduction, so one row's DRAM round trip overlaps the
    previous row's reduction and exchange (H100 bf16: 2880 0.79 -> 0.98 x copy, 8192 0.87 -> 0.96,
    262144 0.60 -> 0.80; bench/NOTES.md, "The backward, second round").
  * dw: with one row group (small M) each block stores its columns of dw directly. Otherwise every
    block stores its fp32 partial (its part of one row of an R x N buffer, which the caller never
    sees) and takes a ticket (an atomic add with release semantics). The last NRED blocks to arrive
    wait until the whole grid has (acquire), then each sums a share of the columns over the R
    partials in a fixed order and stores dw in the weight's dtype: no float atomics, the same bits on
    every run, and no torch op or second launch. The last reducer resets the two counters to 0.
    Only the last NRED arrivals wait (NRED <= half the SMs: `reducers`), so these waits progress
    whenever more than NRED blocks fit on the GPU.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
from dataclasses import dataclass

import cuda.tile as ct
import torch

from .._platform import DeviceInfo, table_arch
from .rmsnorm_fwd import _align_elems, _flat, _raw_stream, _round16
from .rmsnorm_fwd_config import cached_piece_min, split_part
from .rmsnorm_fwd_kernel import _gather_masked, _scatter_masked, row_pieces
from .._workspace import workspace

ConstInt = ct.Constant[int]
ConstBool = ct.Constant[bool]


# blocks per row at most: a row's blocks wait for each other, so all of them must fit on the GPU at
# once (2 x 132 blocks on an H100/H200); wider rows give each block more columns
MAX_SPLIT = 64


# ================================================================================================
# Kernel
# ================================================================================================
def _piece_cols(off, size, TILE_M):
    """Column indices [off, off + size) as a (size,) tile, or (TILE_M, size) in a multi-row tile's layout."""
    cols = ct.arange(size, dtype=ct.int32) + off
    if TILE_M > 1:
        cols = ct.reshape(cols, (1, size)) + ct.zeros((TILE_M, 1), dtype=ct.int32)
    return cols


def _publish(mSync, t, s, dot, SPLIT, prev):
    """Write this block's partial `dot` of row t into its slot (t * SPLIT + s) with the flag this
    launch uses for the slot; returns the flag. The flag (the high word) is the opposite of what the
    last launch over this row left (`prev`: the slot as read before, by this block, the only one
    that writes it), so the slots never need clearing and a replayed CUDA graph flips them too."""
    flag = 1 - (prev >> 32)
    lo = ct.astype(ct.bitcast(dot, ct.uint32), ct.int64)
    ct.atomic_xchg(mSync, t * SPLIT + s, (flag << 32) | lo, memory_order=ct.MemoryOrder.RELAXED)
    return flag


def _collect(mSync, t, SPLIT, flag):
    """The sum of the SPLIT partials of row t once every slot shows `flag`, summed in one fixed order
    (every block of the row gets the same bits).

    The wait polls with atomics (adding 0), not loads: cuTile performs an atomic once per element
    and hands the result to the block, so every warp leaves the loop in the same iteration. A
    loaded tile is loaded by every warp for itself; warps then left the loop at different polls,
    and one that had left paired its next block barrier (in the next row's reduction) with a barrier
    of the loop's in another warp: wrong sums, nondeterministically (H100, split rows, 3 blocks of
    3 rows or more)."""
    idx = ct.arange(SPLIT, dtype=ct.int32) + t * SPLIT
    ok = 0
    total = 0.0
    while ok == 0:
        slots = ct.atomic_add(mSync, idx, ct.zeros((SPLIT,), dtype=ct.int64), check_bounds=False,
                              memory_order=ct.MemoryOrder.RELAXED)
        ok = ct.min(ct.where((slots >> 32) == flag, 1, 0))
        total = ct.sum(ct.bitcast(ct.astype(slots & 0xFFFFFFFF, ct.uint32), ct.float32))
    return total


def _reduce_dw(mDWp, mDW, j, R, NRED, N, NPAD, RED_ROWS, RED_COLS):
    """Reducer j: dw over the column slices j, j + NRED, ... of the row, each the sum of the R partial
    rows taken RED_ROWS at a time in row order (a fixed order: the same bits on every run). The
    slices are narrow enough that every reducer gets one (`red_tile`): the reduction is a few
    dependent L2 round trips per reducer, run by up to half the SMs at once."""
    nslices = ct.static_eval(-(-N // RED_COLS))
    cols0 = ct.reshape(ct.arange(RED_COLS, dtype=ct.int32), (1, RED_COLS))
    rows0 = ct.reshape(ct.arange(RED_ROWS, dtype=ct.int32), (RED_ROWS, 1))
    for sl in range(j, nslices, NRED):
        cols = cols0 + sl * RED_COLS
        acc = ct.zeros((RED_ROWS, RED_COLS), dtype=ct.float32)
        for r0 in range(0, R, RED_ROWS):
            rows = rows0 + r0
            mask = (rows < R) & (cols < N) if ct.static_eval(N % RED_COLS != 0) else rows < R
            acc = acc + ct.gather(mDWp, rows * NPAD + cols, mask=mask, check_bounds=False)
        dw = ct.astype(ct.sum(acc, axis=0, keepdims=True), mDW.dtype)
        if ct.static_eval(N % RED_COLS != 0):
            ct.scatter(mDW, cols, dw, mask=cols < N, check_bounds=False)
        else:
            ct.scatter(mDW, cols, dw, check_bounds=False)


def _load_part(mX, mDY, t, sx, sdy, c0, lim, X_ALIGN, DY_ALIGN, MASK_N, PART, PIECE_MIN, LATENCY):
    """Row t's x and dy over this block's part (columns c0 + [0, lim)), as tuples of its pieces."""
    xbase = ct.assume_divisible_by(t * sx + c0, X_ALIGN)
    dybase = ct.assume_divisible_by(t * sdy + c0, DY_ALIGN)
    tX = ()
    tDY = ()
    for off, size in ct.static_iter(row_pieces(PART, PIECE_MIN)):
        masked = ct.static_eval(MASK_N or off + size > PART)
        tX += (_gather_masked(mX, xbase, off, size, lim, masked, LATENCY),)
        tDY += (_gather_masked(mDY, dybase, off, size, lim, masked, LATENCY),)
    return tX, tDY


@ct.kernel
def rms_norm_bwd_kernel(
        mX, mDY, mW, mRstd, mDX, mDW, mDWp, mTicket, mSync,
        M: int, stride_x: int, stride_dy: int, offset: float, R: int, NRED: int,
        N: ConstInt, TILE_M: ConstInt, SPLIT: ConstInt, PART: ConstInt, PIECE_MIN: ConstInt,
        X_ALIGN: ConstInt, DY_ALIGN: ConstInt, HAS_W: ConstBool, NEED_DX: ConstBool, NEED_DW: ConstBool,
        RED_ROWS: ConstInt, RED_COLS: ConstInt, LATENCY: ConstInt, DX_2D: ConstBool, PREFETCH: ConstBool):
    """Block b owns column part s = b % SPLIT (PART columns from s * PART) of the row tiles
    r = b // SPLIT, r + R, ... (TILE_M rows each; SPLIT > 1 only with TILE_M == 1). The part is held
    in power-of-two pieces (`row_pieces`: 2880 = 2048 + 1024 with the last piece masked) so no
    column is padded to the next power of two. mDX is dx, rows of N, contiguous: flat, or with DX_2D
    2-D with its rows padded to a multiple of max(16, TILE_M), stored with ct.store at the loop's tile
    index (every piece's offset, s * PART included, a multiple of its size): cuTile then knows no two
    iterations write the same elements, where a ct.scatter in the loop had a block barrier before and
    after every store (sm_90 PTX, N = 4096). mDW is dw [N]
    in the weight's dtype (fp32 for a launch over a row chunk, summed by the caller); mDWp holds the
    R fp32 partial rows of NPAD = SPLIT * PART columns; mTicket the two counters (0 between launches); mSync the int64 slots of the exchange (SPLIT > 1)."""
    sx = ct.assume_divisible_by(stride_x, X_ALIGN)
    sdy = ct.assume_divisible_by(stride_dy, DY_ALIGN)
    bid = ct.bid(0)
    r = bid // SPLIT
    s = bid - r * SPLIT
    c0 = s * PART
    NPAD = ct.static_eval(SPLIT * PART)
    MASK_N = ct.static_eval(SPLIT * PART != N)
    lim = ct.minimum(N - c0, PART) if MASK_N else PART

    # the weight of this block's columns (+ offset, fp32), loaded once; and the dw accumulators
    tWrW = ()
    tDW = ()
    for off, size in ct.static_iter(row_pieces(PART, PIECE_MIN)):
        masked = ct.static_eval(MASK_N or off + size > PART)
        wcols = _piece_cols(off, size, TILE_M)
        if HAS_W:
            w = ct.gather(mW, c0 + wcols, mask=wcols < lim if masked else None, check_bounds=False)
            tWrW += (ct.astype(w, ct.float32) + offset,)
        if HAS_W and NEED_DW:
            tDW += (ct.zeros((size,) if TILE_M == 1 else (TILE_M, size), dtype=ct.float32),)

    ntiles = ct.cdiv(M, TILE_M)
    if PREFETCH:  # the first row's x, dy and rstd (r < ntiles: the grid has at most one block per row tile)
        tPX, tPDY = _load_part(mX, mDY, r, sx, sdy, c0, lim, X_ALIGN, DY_ALIGN, MASK_N, PART, PIECE_MIN, LATENCY)
        tPR = ct.gather(mRstd, r, check_bounds=False)
        tPS = ct.gather(mSync, r * SPLIT + s, check_bounds=False) if SPLIT > 1 else 0  # the row's slot
    else:
        tPX, tPDY, tPR, tPS = (), (), 0.0, 0
    for t in range(r, ntiles, R):
        if TILE_M == 1:
            dxbase = t * N + c0
            if PREFETCH:
                # the next row's loads go out before this row's reduction, exchange and stores, so they
                # are in flight through all three (a block's last iteration re-reads the last row: an L2
                # hit, not a branch around the loads)
                tn = ct.minimum(t + R, ntiles - 1)
                tNX, tNDY = _load_part(mX, mDY, tn, sx, sdy, c0, lim, X_ALIGN, DY_ALIGN, MASK_N, PART, PIECE_MIN,
                                       LATENCY)
                tNR = ct.gather(mRstd, tn, check_bounds=False)
                # the exchange slot's last value too, off the exchange's path (a load's round trip)
                tNS = ct.gather(mSync, tn * SPLIT + s, check_bounds=False) if SPLIT > 1 else 0
                tRX, tRDY, rstd, slot = tPX, tPDY, tPR, tPS
                tPX, tPDY, tPR, tPS = tNX, tNDY, tNR, tNS
            else:
                tRX, tRDY = _load_part(mX, mDY, t, sx, sdy, c0, lim, X_ALIGN, DY_ALIGN, MASK_N, PART, PIECE_MIN,
                                       LATENCY)
                rstd = ct.gather(mRstd, t, check_bounds=False)
        else:
            rows = t * TILE_M + ct.arange(TILE_M, dtype=ct.int32)
            row_ok = ct.reshape(rows < M, (TILE_M, 1))
            xbase = ct.reshape(rows * sx, (TILE_M, 1))
            dybase = ct.reshape(rows * sdy, (TILE_M, 1))
            dxbase = ct.reshape(rows * N, (TILE_M, 1))
            rstd = ct.reshape(ct.gather(mRstd, rows, mask=rows < M, check_bounds=False), (TILE_M, 1))
        tXh = ()
        tG = ()
        tDWn = ()
        dot = 0.0 if TILE_M == 1 else ct.zeros((TILE_M, 1), dtype=ct.float32)
        i = 0
        for off, size in ct.static_iter(row_pieces(PART, PIECE_MIN)):
            if TILE_M == 1:
                x = tRX[i]
                dy = tRDY[i]
            else:
                rcols = ct.reshape(ct.arange(size, dtype=ct.int32) + off, (1, size))
                mask = row_ok & (rcols < N) if ct.static_eval(off + size > N) else row_ok
                x = ct.gather(mX, xbase + rcols, mask=mask, check_bounds=False, latency=LATENCY)
                dy = ct.gather(mDY, dybase + rcols, mask=mask, check_bounds=False, latency=LATENCY)
            xh = ct.astype(x, ct.float32) * rstd
            dyf = ct.astype(dy, ct.float32)
            if HAS_W:
                if NEED_DW:
                    tDWn += (tDW[i] + dyf * xh,)
                g = dyf * tWrW[i]
            else:
                g = dyf
            if NEED_DX:
                if TILE_M == 1:
                    dot = dot + ct.sum(g * xh)
                else:
                    dot = dot + ct.sum(g * xh, axis=1, keepdims=True)
            tXh += (xh,)
            tG += (g,)
            i += 1
        if HAS_W and NEED_DW:
            tDW = tDWn
        if NEED_DX:
            if SPLIT > 1:  # the sum over the row's blocks of their partial `dot`: publish, then wait for all
                if not PREFETCH:  # the slot's last value, read here (PREFETCH read it with the row's loads)
                    slot = ct.gather(mSync, t * SPLIT + s, check_bounds=False)
                dot = _collect(mSync, t, SPLIT, _publish(mSync, t, s, dot, SPLIT, slot))
            c = dot * ct.static_eval(1.0 / N)
            i = 0
            for off, size in ct.static_iter(row_pieces(PART, PIECE_MIN)):
                dx = ct.astype((tG[i] - tXh[i] * c) * rstd, mDX.dtype)
                if DX_2D:  # at the loop's own tile index: no block barrier per store (see the docstring)
                    ct.store(mDX, (t, s * ct.static_eval(PART // size) + ct.static_eval(off // size)),
                             ct.reshape(dx, (TILE_M, size)), check_bounds=ct.static_eval(MASK_N or off + size > N),
                             allow_tma=False, latency=LATENCY)
                elif TILE_M == 1:
                    _scatter_masked(mDX, dxbase, off, size, lim, ct.static_eval(MASK_N or off + size > PART), dx,
                                    LATENCY)
                else:
                    rcols = ct.reshape(ct.arange(size, dtype=ct.int32) + off, (1, size))
                    mask = row_ok & (rcols < N) if ct.static_eval(off + size > N) else row_ok
                    ct.scatter(mDX, dxbase + rcols, dx, mask=mask, check_bounds=False, latency=LATENCY)
                i += 1

    if HAS_W and NEED_DW:
        if R == 1:  # one row group: this block's sums are dw
            i = 0
            for off, size in ct.static_iter(row_pieces(PART, PIECE_MIN)):
                dw = tDW[i] if TILE_M == 1 else ct.sum(tDW[i], axis=0)
                _scatter_masked(mDW, c0, off, size, lim, ct.static_eval(MASK_N or off + size > PART),
                                ct.astype(dw, mDW.dtype), 1)
                i += 1
        else:
            i = 0
            for off, size in ct.static_iter(row_pieces(PART, PIECE_MIN)):
                dw = tDW[i] if TILE_M == 1 else ct.sum(tDW[i], axis=0)
                _scatter_masked(mDWp, r * NPAD + c0, off, size, PART, ct.static_eval(off + size > PART), dw, 1)
                i += 1
            # release: the partial's stores (every thread's, ordered by the block barrier before the
            # atomic) are visible to whoever acquires the count this add makes
            ticket = ct.atomic_add(mTicket, 0, 1, memory_order=ct.MemoryOrder.ACQ_REL)
            G = R * SPLIT
            first = G - NRED
            if ticket >= first:
                arrived = ticket + 1
                while arrived < G:  # polled with an atomic: the same value in every warp (see _collect)
                    arrived = ct.atomic_add(mTicket, 0, 0, check_bounds=False, memory_order=ct.MemoryOrder.ACQUIRE)
                _reduce_dw(mDWp, mDW, ticket - first, R, NRED, N, NPAD, RED_ROWS, RED_COLS)
                done = ct.atomic_add(mTicket, 1, 1, memory_order=ct.MemoryOrder.ACQ_REL)
                if done == NRED - 1:  # every reducer has seen all G: the counters go back to 0
                    ct.scatter(mTicket, 0, 0, check_bounds=False)
                    ct.scatter(mTicket, 1, 0, check_bounds=False)


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


def _pow2_ceil(n: int) -> int:
    return 1 << (max(n, 1) - 1).bit_length()


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
    split = min(MAX_SPLIT, _pow2_ceil(-(-N // PART_ELEMS)))
    return BwdConfig(split=split, piece_min=cached_piece_min(split_part(N, split)), num_worker_warps=8)


CONFIG_TABLE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tuning",
                            "rmsnorm_bwd_configs.json")


@functools.lru_cache(maxsize=None)
def measured_configs() -> dict:
    """{arch: {dtype: [(N, BwdConfig, ratio_to_copy), ...]}} from the sweep's table
    (bench/cutile/rmsnorm_bwd_configs.py --write-configs)."""
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
        split = min(MAX_SPLIT, _pow2_ceil(max(1, round(cfg.split * N / measured_n))))
        cfg = dataclasses.replace(cfg, split=split, tile_m=1)
    else:
        tile_m = max(1, min(64, 1 << (max(1, cfg.tile_m * measured_n // N).bit_length() - 1)))
        cfg = dataclasses.replace(cfg, tile_m=tile_m)
    return cut_pieces(cfg, N)


@functools.lru_cache(maxsize=4096)
def default_config(N: int, elem_bytes: int, dev: DeviceInfo, dtype: str = "", fp32_weight: bool = False) -> BwdConfig:
    """The backward's config for rows of N elements of `dtype` on `dev`: the config measured best at
    the nearest measured width of this arch and dtype (scaled to N), else the analytical rule."""
    return config_and_source(N, elem_bytes, dev, dtype, fp32_weight)[0]


def config_and_source(N: int, elem_bytes: int, dev: DeviceInfo, dtype: str = "",
                      fp32_weight: bool = False) -> tuple[BwdConfig, str]:
    by_arch = measured_configs()
    arch = table_arch(dev, by_arch)  # an unmeasured arch borrows the nearest measured one
    tables = by_arch.get(arch or "", {})
    # a dtype not measured takes the table of one of the same width (fp16 <-> bf16), else any: the
    # registers a config needs go with elements, not bytes
    same = [d for d in tables if torch.empty((), dtype=getattr(torch, d)).element_size() == elem_bytes]
    use = dtype if dtype in tables else (same or list(tables) or [None])[0]
    rows = tables.get(use)
    if not rows:
        cfg, source = analytical_config(N, elem_bytes), f"analytical rule (no measured {dtype} backward table for {dev.arch_name})"
    else:
        n, cfg, ratio = min(rows, key=lambda r: abs(math.log2(r[0]) - math.log2(max(N, 1))))
        cfg = _scaled(cfg, n, N)
        source = (f"measured at N={n} on {arch} in {use}: {ratio:.3f}x copy "
                  f"({os.path.basename(CONFIG_TABLE)})")
    if fp32_weight and elem_bytes == 2 and cfg.tile_m > 1 and cfg.tile_m * N > PART_ELEMS:
        # an fp32 weight next to 16-bit x: 64-row tiles of N = 128 spilled 232 bytes per thread (ptxas)
        cfg = dataclasses.replace(cfg, tile_m=max(1, 1 << ((PART_ELEMS // N).bit_length() - 1)))
        source += "; rows per tile capped for the fp32 weight"
    return cfg, source


def part_of(cfg: BwdConfig, N: int) -> int:
    return N if cfg.split == 1 else split_part(N, cfg.split)


def cut_pieces(cfg: BwdConfig, N: int) -> BwdConfig:
    """cfg with its pieces cut for rows of N elements (the fewest that waste <= 1/8 of its part)."""
    return dataclasses.replace(cfg, piece_min=cached_piece_min(part_of(cfg, N)))


def _piece_min(cfg: BwdConfig, N: int) -> int:
    return min(cfg.piece_min, _pow2_ceil(part_of(cfg, N)))


def dx_2d(cfg: BwdConfig, N: int) -> bool:
    """Whether dx goes out with ct.store at tile indices: every piece of a part starts at a multiple
    of its size within the row (always with one part; with several, when the part is a multiple of
    every piece)."""
    part = part_of(cfg, N)
    return cfg.split == 1 or all(part % size == 0 for _, size in row_pieces(part, _piece_min(cfg, N)))


def dx_row_pad(cfg: BwdConfig) -> int:
    """dx's rows are allocated to a multiple of this (whole tiles for ct.store, and the row count's
    "divisible by 16" bit, which a launch specialises on, never changes with M)."""
    return max(16, cfg.tile_m)


def reducers(sm_count: int) -> int:
    """The most blocks that wait at the end to reduce dw: half the SMs, so the grid's other blocks
    always find room to finish whatever else runs on the GPU."""
    return max(1, sm_count // 2)


def red_tile(N: int, sm_count: int) -> tuple[int, int]:
    """The dw reduction's tile (partial rows, columns) per step: columns so that every reducer gets
    a slice (N / reducers, a power of two from 32 to 256), rows so that a step loads 4096 values
    (16 per thread at 8 warps)."""
    cols = min(256, max(32, _pow2_ceil(-(-N // reducers(sm_count)))))
    return 4096 // cols, cols


def constants(cfg: BwdConfig, N: int, x_align: int, dy_align: int, has_w: bool, need_dx: bool, need_dw: bool,
              sm_count: int) -> tuple:
    part = part_of(cfg, N)
    return (N, cfg.tile_m, cfg.split, part, _piece_min(cfg, N), x_align, dy_align, has_w, need_dx, need_dw,
            *red_tile(N, sm_count), cfg.latency, dx_2d(cfg, N), cfg.prefetch)


@functools.lru_cache(maxsize=None)
def kernel_for(hints: tuple) -> ct.kernel:
    return rms_norm_bwd_kernel.replace_hints(**dict(hints)) if hints else rms_norm_bwd_kernel


def export_signature(cfg: BwdConfig, N: int, x_dtype, w_dtype, has_w: bool = True, need_dx: bool = True,
                     need_dw: bool = True, sm_count: int = 132):
    """The KernelSignature a launch on contiguous, well-aligned tensors compiles (for the CI checks)."""
    from cuda.tile.compilation import (
        ArrayConstraint,
        CallingConvention,
        ConstantConstraint,
        KernelSignature,
        ScalarConstraint,
    )

    def arr(dtype, div16: bool):
        return ArrayConstraint(dtype, 1, index_dtype=ct.int32, stride_lower_bound_incl=0, alias_groups=(),
                               may_alias_internally=False, stride_constant=(1,),
                               shape_divisible_by=16 if div16 else 1, base_addr_divisible_by=16)

    elem = {ct.float16: 2, ct.bfloat16: 2, ct.float32: 4}[x_dtype]
    wd = w_dtype if has_w else x_dtype
    if dx_2d(cfg, N):  # rows padded to 16, row stride N (as a launch specialises it)
        vec = 16 // elem
        dx = ArrayConstraint(x_dtype, 2, index_dtype=ct.int32, stride_lower_bound_incl=0, alias_groups=(),
                             may_alias_internally=False, stride_constant=(1 if N == 1 else None, 1),
                             shape_constant=(None, 1 if N == 1 else None),
                             stride_divisible_by=(vec if N % vec == 0 else 1, 1),
                             shape_divisible_by=(16, 16 if N % 16 == 0 else 1), base_addr_divisible_by=16)
    else:
        dx = arr(x_dtype, True)
    params = [arr(x_dtype, N % 16 == 0), arr(x_dtype, N % 16 == 0), arr(wd, N % 16 == 0), arr(ct.float32, True),
              dx, arr(wd, N % 16 == 0), arr(ct.float32, True), arr(ct.int32, True), arr(ct.int64, True)]
    params += [ScalarConstraint(ct.int32)] * 3 + [ScalarConstraint(ct.float32)] + [ScalarConstraint(ct.int32)] * 2
    align = _align_elems(N, elem)
    params += [ConstantConstraint(c) for c in constants(cfg, N, align, align, has_w, need_dx, need_dw, sm_count)]
    return kernel_for(tuple(sorted(cfg.hints().items()))), KernelSignature(params, CallingConvention.cutile_python_v2())


# ================================================================================================
# The launch wrapper
# ================================================================================================
_MAX_FLAT = (1 << 31) - 1  # int32 indexing: longer inputs are launched in row chunks


@functools.lru_cache(maxsize=4096)
def _prepared(cfg: BwdConfig, N: int, x_align: int, dy_align: int, has_w: bool, need_dx: bool, need_dw: bool,
              sm_count: int):
    """(2-D dx?, kernel, compile-time constants, dw partial row length) of one launch signature: worked
    out once, not per call (host time at small M)."""
    return (dx_2d(cfg, N), kernel_for(tuple(sorted(cfg.hints().items()))),
            constants(cfg, N, x_align, dy_align, has_w, need_dx, need_dw, sm_count), cfg.split * part_of(cfg, N))


def grid_rows(cfg: BwdConfig, M: int, sm_count: int) -> int:
    """R, the row groups of the persistent grid: at most one per row tile, about blocks_per_sm x SMs
    blocks in all."""
    tiles = -(-M // cfg.tile_m)
    return max(1, min(tiles, cfg.blocks_per_sm * sm_count // cfg.split))


def _round_up(n: int, k: int) -> int:
    return -(-n // k) * k


def dx_buffer(cfg: BwdConfig, M: int, N: int, dtype: torch.dtype, device) -> torch.Tensor:
    """dx [M, N], contiguous, in an allocation of whole padded tiles (`dx_row_pad`) that every launch
    of `launch` may write, the flat kernels' length rounded to 16 included."""
    length = _round16(_round_up(M, dx_row_pad(cfg)) * N)
    return torch.empty(length, dtype=dtype, device=device)[:M * N].view(M, N)


def launch(cfg: BwdConfig, dy2d: torch.Tensor, x2d: torch.Tensor, weight: torch.Tensor | None,
           rstd: torch.Tensor, offset: float, need_dx: bool, need_dw: bool, sm_count: int,
           out: tuple | None = None):
    """(dx [M, N] contiguous in x's dtype or None, dw [N] in the weight's dtype or None).

    The API layer has validated everything: x2d and dy2d [M, N] with unit column stride, M >= 1,
    rstd [M] fp32 contiguous (the forward's), weight [N] or None. `out`: (dx, dw) to write into
    (the tests poison them first); dx must have room for round16(M * N) elements.
    """
    M, N = x2d.shape
    has_w = weight is not None
    need_dw = need_dw and has_w
    device = x2d.device
    sx = x2d.stride(0) if M > 1 else N
    sdy = dy2d.stride(0) if M > 1 else N
    e = x2d.element_size()
    stream = _raw_stream(device.index)
    pad = dx_row_pad(cfg)
    if out is not None:
        dx, dw = out
        if need_dx and dx.untyped_storage().nbytes() < (dx.storage_offset() + _round_up(M, pad) * N) * dx.element_size():
            raise ValueError(f"out: dx must come from dx_buffer(cfg, {M}, {N}, ...)")
    else:
        dx = dx_buffer(cfg, M, N, x2d.dtype, device) if need_dx else None
        dw = torch.empty(N, dtype=weight.dtype, device=device) if need_dw else None
    two_d, kernel, consts, npad = _prepared(cfg, N, _align_elems(sx, e), _align_elems(sdy, e), has_w, need_dx,
                                            need_dw, sm_count)
    tickets = workspace("tickets", 16, torch.int32, device, stream, zero=True)
    w_arg = weight if has_w else rstd  # never read without HAS_W

    def one(r0: int, m: int, dw_out: torch.Tensor | None):
        R = grid_rows(cfg, m, sm_count)
        x_flat = _flat(x2d, (m - 1) * sx + N, r0 * sx)
        dy_flat = _flat(dy2d, (m - 1) * sdy + N, r0 * sdy)
        if not need_dx:
            dx_arg = x_flat  # never written without NEED_DX
        elif two_d:
            dx_arg = dx.as_strided((_round_up(m, pad), N), (N, 1), dx.storage_offset() + r0 * N)
        else:
            dx_arg = _flat(dx, _round16(m * N), r0 * N)
        rstd_flat = rstd if r0 == 0 and m == M and rstd.stride(0) == 1 else _flat(rstd, m, r0)  # as it is
        partials = (workspace("partials", R * npad, torch.float32, device, stream, zero=False)
                    if need_dw and R > 1 else rstd_flat)
        sync = (workspace(f"sync{cfg.split}", m * cfg.split, torch.int64, device, stream, zero=True)
                if cfg.split > 1 and need_dx else workspace("sync1", 16, torch.int64, device, stream, zero=True))
        nred = min(R * cfg.split, reducers(sm_count))
        ct.launch(stream, (R * cfg.split,), kernel,
                  (x_flat, dy_flat, w_arg, rstd_flat, dx_arg, dw_out if dw_out is not None else w_arg, partials,
                   tickets, sync, m, sx, sdy, offset, R, nred) + consts)

    span = max((M - 1) * sx, (M - 1) * sdy) + N
    if span <= _MAX_FLAT and _round_up(M, pad) * N <= _MAX_FLAT:
        one(0, M, dw)
        return dx, dw
    # beyond int32 indexing: row chunks below 2^31 elements, each chunk's dw summed here in fp32 in
    # chunk order (deterministic)
    rows = (_MAX_FLAT - pad * N) // max(sx, sdy, N) // pad * pad  # whole padded tiles: only the last chunk
    if rows < pad:  # writes past its own rows (into the allocation's padding)
        raise ValueError(f"a row of {N} elements (strides {sx}, {sdy}) is too long for int32 indexing; "
                         f"use mode='torch'")
    starts = list(range(0, M, rows))
    dw_chunks = torch.empty(len(starts), N, dtype=torch.float32, device=device) if need_dw else None
    for i, r0 in enumerate(starts):
        one(r0, min(rows, M - r0), dw_chunks[i] if need_dw else None)
    if need_dw:
        dw.copy_(dw_chunks.sum(dim=0))
    return dx, dw


# ================================================================================================
# The backend
# ================================================================================================
@dataclass(frozen=True)
class CuTileBackward:
    """The persistent backward, shared by every cuTile mode (the forward's mode picks the forward)."""

    def config(self, N: int, dtype: torch.dtype, dev: DeviceInfo, w_dtype: torch.dtype | None = None) -> BwdConfig:
        return default_config(N, dtype.itemsize, dev, str(dtype).removeprefix("torch."), w_dtype == torch.float32)

    def describe(self, M: int, N: int, dtype: torch.dtype, dev: DeviceInfo, w_dtype: torch.dtype | None = None) -> str:
        cfg, source = config_and_source(N, dtype.itemsize, dev, str(dtype).removeprefix("torch."),
                                        w_dtype == torch.float32)
        R = grid_rows(cfg, M, dev.sm_count)
        return (f"cuTile rms_norm_bwd_kernel (persistent), grid ({R * cfg.split},) = {R} row groups x {cfg.split} "
                f"parts, {cfg.short()}; config: {source}")

    def backward(self, dy2d, x2d, weight, rstd, offset, need_dx, need_dw, dev: DeviceInfo,
                 cfg: BwdConfig | None = None, out: tuple | None = None):
        cfg = cfg or self.config(x2d.shape[1], x2d.dtype, dev, weight.dtype if weight is not None else None)
        return launch(cfg, dy2d, x2d, weight, rstd, offset, need_dx, need_dw, dev.sm_count, out)


PERSISTENT_BACKWARD = CuTileBackward()
