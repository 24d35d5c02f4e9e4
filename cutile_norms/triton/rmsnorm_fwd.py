"""RMSNorm forward in Triton: the fallback for AMD GPUs and NVIDIA GPUs without cuTile / CuTe DSL.

Layout (TileGym's order): kernel -> launch config (a frozen dataclass) and its analytic heuristic ->
launch wrapper -> the backend.

One kernel, shapes of work picked by compile-time constants:
  * Narrow rows: ROWS rows per tile, so a tile moves a few KB (the QK-norm case, M ~ 10^6 rows of
    128, would otherwise run one 256-byte row per program).
  * Rows in registers (CHUNKS = 1): the whole row loaded once, reduced, scaled and stored. A width
    that is not a power of two is a power-of-two block with a masked tail: masked lanes move no bytes.
  * Rows in CHUNKS: a first pass sums the squares with x kept in L2 (evict_last), a second re-reads
    it (evict_first) and stores y. No width limit, and no padded lanes beyond the last chunk's.
  * SPLIT > 1 (rows past 32768): a row's parts on several programs that exchange their partial sums
    through global memory (`exchange`), each part in registers or, past PART_ELEMS, in chunks.

The heuristic launches one program per row tile (measured faster than a persistent grid for the
forward); a config with programs_per_sm > 0 runs a persistent grid of one wave instead, the weight
loaded once per program and, with PREFETCH, the next tile's x loaded before this one is reduced.
All math in fp32 (eps and offset are launched as Python floats: fp32 arguments); row offsets in
int64 where M x stride passes 2^31.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .._platform import DeviceInfo
from .._util import pow2_ceil
from .._workspace import workspace
from ._common import (INTERPRET, TileConfig, exchange, lanes_per_warp, needs_int64, raw_stream,
                      resident_programs, slot_count, slot_flag, split_for, warps_for)


# ================================================================================================
# Kernel
# ================================================================================================
@triton.jit
def _weight(W, cols, ok, offset, HAS_OFFSET: tl.constexpr):
    """w' = offset + w in fp32 at `cols`; offset == 0 compiled without the add (HAS_OFFSET)."""
    w = tl.load(W + cols, mask=ok, other=0.0).to(tl.float32)
    if HAS_OFFSET:
        w = w + offset
    return w


@triton.jit
def rms_norm_fwd_kernel(X, W, Y, RSTD, SLOTS, M, stride_x, eps, offset,
                        N, PART, BLOCK_N: tl.constexpr, CHUNKS: tl.constexpr,
                        ROWS: tl.constexpr, SPLIT: tl.constexpr, HAS_W: tl.constexpr, HAS_OFFSET: tl.constexpr,
                        STORE_RSTD: tl.constexpr, PREFETCH: tl.constexpr, ONE_TILE: tl.constexpr,
                        PHASE: tl.constexpr, INT64: tl.constexpr):
    # PHASE 0: one launch. Under the interpreter (programs run one after another, so none can wait
    # for another) a split launch runs twice: PHASE 1 publishes the partial sums, PHASE 2 finishes.
    # ONE_TILE (split rows, one program per part; 16-bit rows of 7168-8192 in registers, one program
    # per row: the config's one_tile): straight-line code for the program's one tile,
    # the weight loaded where it is used. With a row's parts waiting for each other, the tile loop
    # and the early weight load measured 0.75 x copy against 0.987 without them (N = 65536, 16 parts
    # of 4096, 4 warps; bench/probe/triton_split_wait.py). Else the tile loop (one trip without a
    # persistent grid) with the weight loaded first: whole rows of up to 8 warps measured the same
    # either way (16 warps at 8192 did not: 0.947 with the loop, 0.993 without), and
    # two-pass rows 1-4 % faster with the loop (5120: 0.982 against 0.947).
    pid = tl.program_id(0)
    part = pid % SPLIT
    group = pid // SPLIT
    if ONE_TILE:
        last = group + 1
        step = 1
    else:
        last = (M + ROWS - 1) // ROWS
        step = tl.num_programs(0) // SPLIT
    lanes = tl.arange(0, BLOCK_N)
    col0 = part * PART
    if CHUNKS == 1:  # the weight's part (+ offset, fp32), loaded once per program
        cols = col0 + lanes
        col_ok = (lanes < PART) & (cols < N)
        if HAS_W and not ONE_TILE:
            w = _weight(W, cols, col_ok, offset, HAS_OFFSET)
        if PREFETCH:  # the first tile's x; each tile then loads the next one's before its reduction
            rows_n = group * ROWS + tl.arange(0, ROWS)
            if INT64:
                rows_n = rows_n.to(tl.int64)
            x_n = tl.load(X + rows_n[:, None] * stride_x + cols[None, :],
                          mask=(rows_n < M)[:, None] & col_ok[None, :], other=0.0)
    for tile in range(group, last, step):
        rows = tile * ROWS + tl.arange(0, ROWS)
        row_ok = rows < M
        if INT64:
            rows = rows.to(tl.int64)
        x_rows = X + rows[:, None] * stride_x
        if CHUNKS == 1:
            mask = row_ok[:, None] & col_ok[None, :]
            if PREFETCH:
                x = x_n.to(tl.float32)
                rows_n = rows + step * ROWS
                x_n = tl.load(X + rows_n[:, None] * stride_x + cols[None, :],
                              mask=(rows_n < M)[:, None] & col_ok[None, :], other=0.0)
            else:
                x = tl.load(x_rows + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            if SPLIT > 1:
                flag = slot_flag(SLOTS, tile, rows, row_ok, part, ROWS, SPLIT, PHASE)
            sumsq = tl.sum(x * x, axis=1)
        else:
            if SPLIT > 1:
                flag = slot_flag(SLOTS, tile, rows, row_ok, part, ROWS, SPLIT, PHASE)
            sumsq = tl.zeros([ROWS], dtype=tl.float32)
            for c in range(CHUNKS):
                lanes_c = c * BLOCK_N + lanes
                cols_c = col0 + lanes_c
                mask_c = row_ok[:, None] & ((lanes_c < PART) & (cols_c < N))[None, :]
                xc = tl.load(x_rows + cols_c[None, :], mask=mask_c, other=0.0,
                             eviction_policy="evict_last").to(tl.float32)
                sumsq += tl.sum(xc * xc, axis=1)
        if SPLIT > 1:
            sumsq = exchange(SLOTS, tile, rows, row_ok, sumsq, part, flag, ROWS, SPLIT, PHASE)
        if PHASE != 1:
            rstd = tl.rsqrt(sumsq / N + eps)
            y_rows = Y + rows[:, None] * N
            if CHUNKS == 1:
                y = x * rstd[:, None]
                if HAS_W:
                    if ONE_TILE:
                        w = _weight(W, cols, col_ok, offset, HAS_OFFSET)
                    y = y * w[None, :]
                tl.store(y_rows + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)
            else:
                for c in range(CHUNKS):
                    lanes_c = c * BLOCK_N + lanes
                    cols_c = col0 + lanes_c
                    ok_c = (lanes_c < PART) & (cols_c < N)
                    mask_c = row_ok[:, None] & ok_c[None, :]
                    xc = tl.load(x_rows + cols_c[None, :], mask=mask_c, other=0.0,
                                 eviction_policy="evict_first").to(tl.float32)
                    yc = xc * rstd[:, None]
                    if HAS_W:
                        wc = _weight(W, cols_c, ok_c, offset, HAS_OFFSET)
                        yc = yc * wc[None, :]
                    tl.store(y_rows + cols_c[None, :], yc.to(Y.dtype.element_ty), mask=mask_c)
            if STORE_RSTD:
                tl.store(RSTD + rows, rstd, mask=row_ok & (part == 0))


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


# ================================================================================================
# Launch
# ================================================================================================
def launch(cfg: FwdConfig, x2d: torch.Tensor, weight: torch.Tensor | None, eps: float, offset: float,
           store_rstd: bool, sm_count: int, out: tuple | None = None, out_shape=None):
    """(y contiguous in x's dtype, [M, N] or `out_shape`; rstd [M] fp32 or None) for a 2-D x with unit
    column stride, M >= 1. The API layer has validated everything. `out`: (y, rstd) to write into."""
    M, N = x2d.shape
    device = x2d.device
    stride = x2d.stride(0) if M > 1 else N
    if weight is not None and weight.stride(0) != 1 and N > 1:  # the kernel reads the weight at unit stride
        weight = weight.contiguous()
    if out is None:
        y = torch.empty(out_shape if out_shape is not None else (M, N), dtype=x2d.dtype, device=device)
        rstd = torch.empty(M, dtype=torch.float32, device=device) if store_rstd else None
    else:
        y, rstd = out
    slots = y  # never touched without SPLIT > 1
    if cfg.split > 1:  # kept per SPLIT value: every launch flips all SPLIT slots of each row (`exchange`)
        slots = workspace(f"triton_fwd_slots{cfg.split}", slot_count(-(-M // cfg.rows) * cfg.rows, cfg.split),
                          torch.int64, device, raw_stream(device), zero=True)
    args = (x2d, weight if weight is not None else y, y, rstd if store_rstd else y, slots, M, stride,
            eps, offset, N, cfg.part)
    consts = dict(BLOCK_N=cfg.block_n, CHUNKS=cfg.chunks, ROWS=cfg.rows, SPLIT=cfg.split,
                  HAS_W=weight is not None, HAS_OFFSET=offset != 0.0, STORE_RSTD=store_rstd,
                  PREFETCH=cfg.prefetch and cfg.chunks == 1,
                  ONE_TILE=cfg.programs_per_sm == 0 and (cfg.split > 1 or cfg.one_tile),
                  INT64=needs_int64(M + (cfg.rows * cfg.programs_per_sm * sm_count if cfg.prefetch else 0),
                                    max(stride, N)))
    resident = 32
    if cfg.programs_per_sm:
        resident = resident_programs(rms_norm_fwd_kernel, args, dict(consts, PHASE=0), cfg.num_warps, cfg.num_stages,
                                     device, (tuple(consts.items()), x2d.dtype, args[1].dtype))
    programs = grid_programs(cfg, M, sm_count, resident)
    phases = (1, 2) if cfg.split > 1 and INTERPRET else (0,)
    for phase in phases:
        rms_norm_fwd_kernel[(programs,)](*args, **consts, PHASE=phase, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return y, rstd


# ================================================================================================
# The backend
# ================================================================================================
@dataclass(frozen=True)
class TritonForward:
    mode: str = "triton"
    takes_every_row = True  # any row stride and alignment (masked pointer loads)

    def unsupported(self, x2d: torch.Tensor, batch_invariant: bool = False) -> str | None:
        return None

    def launcher(self, M: int, N: int, stride: int, dtype: torch.dtype, w_dtype: torch.dtype | None,
                 store_rstd: bool, dev: DeviceInfo):
        return None  # the launch per call is all there is (Triton's own launcher caches the kernel)

    def config(self, N: int, dtype: torch.dtype, dev: DeviceInfo) -> FwdConfig:
        return analytic_config(N, dtype.itemsize, dev.vendor, max(1, dev.sm_count))

    def describe(self, M: int, N: int, dtype: torch.dtype, dev: DeviceInfo) -> str:
        cfg = self.config(N, dtype, dev)
        grid = "persistent grid" if cfg.programs_per_sm else "one program per row tile"
        return (f"Triton rms_norm_fwd_kernel, {grid} ({grid_programs(cfg, M, max(1, dev.sm_count))},), "
                f"{cfg.short()}; config: analytic (N, dtype, {dev.vendor})")

    def forward(self, x2d, weight, eps, offset, store_rstd, dev: DeviceInfo, cfg: FwdConfig | None = None,
                out: tuple | None = None, out_shape=None):
        cfg = cfg or self.config(x2d.shape[1], x2d.dtype, dev)
        return launch(cfg, x2d, weight, eps, offset, store_rstd, max(1, dev.sm_count), out, out_shape)


TRITON_FORWARD = TritonForward()
