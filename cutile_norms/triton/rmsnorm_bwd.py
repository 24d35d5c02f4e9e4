"""RMSNorm backward in Triton: the persistent kernel, the dw reduction, their config, launch, backend.

The math, all in fp32 (w' = offset + w, xhat = x * rstd with rstd saved by the forward):
    g = dy * w'        dx = rstd * (g - xhat * mean(g * xhat))        dw = sum over rows of dy * xhat

A persistent grid of R row groups x SPLIT parts (program p: part p % SPLIT of the row tiles
p // SPLIT, p // SPLIT + R, ...), the forward's tiling (`split_for`, rows per tile for narrow rows):
  * each program loads its part of the weight once and keeps it (+ offset, fp32) in registers with
    its dw accumulator (fp32, one per column it owns), then walks its row tiles: x, dy, rstd in, dx out;
  * split rows exchange their partial sums of g * xhat through global memory (`exchange`);
  * dw: each program stores its accumulator as one row of an R x N fp32 buffer, and a second small
    kernel sums the R rows per column in a fixed order (no float atomics: the same bits every run).
    With one row group (small M) the first kernel stores dw itself: one launch.
  * parts too long for registers (N > SPLIT_MAX x TILE_ELEMS) run in chunks: the dot in a first
    pass over x and dy (kept in L2), dx in a second; dw accumulates in the program's own row of the
    R x N buffer (read-modify-write, no other program touches it).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .._platform import DeviceInfo
from .._workspace import workspace
from ._common import (
    INTERPRET,
    TileConfig,
    exchange,
    lanes_per_warp,
    needs_int64,
    raw_stream,
    split_for,
    warps_for,
)


# ================================================================================================
# Kernels
# ================================================================================================
@triton.jit
def rms_norm_bwd_kernel(DY, X, W, RSTD, DX, DW, SLOTS, COUNT, M, stride_x, stride_dy, offset,
                        N, PART, BLOCK_N: tl.constexpr, CHUNKS: tl.constexpr,
                        ROWS: tl.constexpr, SPLIT: tl.constexpr, HAS_W: tl.constexpr, NEED_DX: tl.constexpr,
                        NEED_DW: tl.constexpr, ACC_2D: tl.constexpr, PHASE: tl.constexpr,
                        INT64: tl.constexpr):
    # DW: dw itself (one row group, parts in registers) or the R x N fp32 partials. PHASE as in the forward:
    # 0 = one launch; under the interpreter a split launch runs PHASE 1 (dot partials and dw), then 2 (dx).
    pid = tl.program_id(0)
    part = pid % SPLIT
    group = pid // SPLIT
    groups = tl.num_programs(0) // SPLIT
    lanes = tl.arange(0, BLOCK_N)
    col0 = part * PART
    dw_row = DW + group.to(tl.int64) * N
    if CHUNKS == 1:
        cols = col0 + lanes
        col_ok = (lanes < PART) & (cols < N)
        if HAS_W:
            w = tl.load(W + cols, mask=col_ok, other=0.0).to(tl.float32) + offset
        if ACC_2D:  # one accumulator per tile element: no reduction over the tile's rows per tile
            dw_acc2 = tl.zeros([ROWS, BLOCK_N], dtype=tl.float32)
        else:
            dw_acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for tile in range(group, (M + ROWS - 1) // ROWS, groups):
        rows = tile * ROWS + tl.arange(0, ROWS)
        row_ok = rows < M
        if INT64:
            rows = rows.to(tl.int64)
        rstd = tl.load(RSTD + rows, mask=row_ok, other=0.0)
        x_rows = X + rows[:, None] * stride_x
        dy_rows = DY + rows[:, None] * stride_dy
        if CHUNKS == 1:
            mask = row_ok[:, None] & col_ok[None, :]
            x = tl.load(x_rows + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            dy = tl.load(dy_rows + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            xhat = x * rstd[:, None]
            g = dy
            if HAS_W:
                g = dy * w[None, :]
            dot = tl.sum(g * xhat, axis=1)
            if NEED_DW and PHASE != 2:
                if ACC_2D:
                    dw_acc2 += dy * xhat
                else:
                    dw_acc += tl.sum(dy * xhat, axis=0)
        else:
            dot = tl.zeros([ROWS], dtype=tl.float32)
            for c in range(CHUNKS):
                lanes_c = c * BLOCK_N + lanes
                cols_c = col0 + lanes_c
                ok_c = (lanes_c < PART) & (cols_c < N)
                mask_c = row_ok[:, None] & ok_c[None, :]
                xc = tl.load(x_rows + cols_c[None, :], mask=mask_c, other=0.0,
                             eviction_policy="evict_last").to(tl.float32)
                dyc = tl.load(dy_rows + cols_c[None, :], mask=mask_c, other=0.0,
                              eviction_policy="evict_last").to(tl.float32)
                xhat_c = xc * rstd[:, None]
                gc = dyc
                if HAS_W:
                    gc = dyc * (tl.load(W + cols_c, mask=ok_c, other=0.0).to(tl.float32) + offset)[None, :]
                dot += tl.sum(gc * xhat_c, axis=1)
                if NEED_DW and PHASE != 2:
                    acc = tl.load(dw_row + cols_c, mask=ok_c, other=0.0)
                    tl.store(dw_row + cols_c, acc + tl.sum(dyc * xhat_c, axis=0), mask=ok_c)
        if SPLIT > 1 and NEED_DX:
            dot = exchange(SLOTS, COUNT, tile, rows, row_ok, dot, part, ROWS, SPLIT, PHASE)
        if NEED_DX and PHASE != 1:
            mean = dot / N
            dx_rows = DX + rows[:, None] * N
            if CHUNKS == 1:
                dx = rstd[:, None] * (g - xhat * mean[:, None])
                tl.store(dx_rows + cols[None, :], dx.to(DX.dtype.element_ty), mask=mask)
            else:
                for c in range(CHUNKS):
                    lanes_c = c * BLOCK_N + lanes
                    cols_c = col0 + lanes_c
                    ok_c = (lanes_c < PART) & (cols_c < N)
                    mask_c = row_ok[:, None] & ok_c[None, :]
                    xc = tl.load(x_rows + cols_c[None, :], mask=mask_c, other=0.0,
                                 eviction_policy="evict_first").to(tl.float32)
                    dyc = tl.load(dy_rows + cols_c[None, :], mask=mask_c, other=0.0,
                                  eviction_policy="evict_first").to(tl.float32)
                    gc = dyc
                    if HAS_W:
                        gc = dyc * (tl.load(W + cols_c, mask=ok_c, other=0.0).to(tl.float32) + offset)[None, :]
                    dxc = rstd[:, None] * (gc - xc * rstd[:, None] * mean[:, None])
                    tl.store(dx_rows + cols_c[None, :], dxc.to(DX.dtype.element_ty), mask=mask_c)
    if NEED_DW and CHUNKS == 1 and PHASE != 2:
        if ACC_2D:
            dw_acc = tl.sum(dw_acc2, axis=0)
        tl.store(dw_row + cols, dw_acc.to(DW.dtype.element_ty), mask=col_ok)


@triton.jit
def dw_reduce_kernel(P, DW, R, N, BLOCK_C: tl.constexpr):
    """dw[c] = sum over r of P[r, c], r in order (deterministic), in dw's dtype."""
    cols = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    ok = cols < N
    acc = tl.zeros([BLOCK_C], dtype=tl.float32)
    ptrs = P + cols
    for _ in range(R):
        acc += tl.load(ptrs, mask=ok, other=0.0)
        ptrs += N  # pointer arithmetic is 64-bit: R x N may pass 2^31
    tl.store(DW + cols, acc.to(DW.dtype.element_ty), mask=ok)


# ================================================================================================
# Launch config and heuristic
# ================================================================================================
@dataclass(frozen=True)
class BwdConfig(TileConfig):
    acc_2d: bool = True  # dw accumulated per tile element, summed over the rows once at the end


# Measured on an H100, bf16, 2^27 elements (bench/probe/triton_configs.py; bench/NOTES.md, Triton):
# tiles of TILE_ELEMS (several rows of narrow widths, 32 warps): 0.725 / 0.778 / 0.810 / 0.880 at
# N = 128 / 1024 / 4096 / 8192, against 0.689 / 0.671 / 0.692 / 0.726 with 8192-element tiles; whole
# rows in registers up to ROW_ELEMS (0.775 at 16384; 0.187 at 32768, spilled), split rows of 8192-column
# parts beyond (0.543 at 32768, 0.478 at 65536), half the warps when split 16 or more (0.358 at 262144
# against 0.208).
TILE_ELEMS = 32768
ROW_ELEMS = 16384
PART_ELEMS = 8192
SPLIT_MAX = 32
REDUCE_COLS = 256  # the dw reduction's columns per program


@functools.lru_cache(maxsize=4096)
def analytic_config(N: int, elem_bytes: int, vendor: str, sm_count: int, tile_elems: int = TILE_ELEMS) -> BwdConfig:
    """The measured rules above."""
    lanes = lanes_per_warp(vendor)
    row_elems = min(ROW_ELEMS, tile_elems)
    split, part, block_n, chunks = split_for(N, row_elems if N <= row_elems else min(PART_ELEMS, tile_elems),
                                             min(SPLIT_MAX, sm_count))
    rows = max(1, min(64, (tile_elems // 2) // block_n)) if split == 1 else 1
    warps = warps_for(rows * block_n, elem_bytes, lanes, vendor)
    if split >= 16:
        warps = max(1, warps // 2)
    return BwdConfig(rows=rows, split=split, part=part, block_n=block_n, chunks=chunks, num_warps=warps,
                     programs_per_sm=max(1, 2048 // (warps * lanes)))


def grid_groups(cfg: BwdConfig, M: int, sm_count: int) -> int:
    """R, the row groups of the persistent grid: at most one per row tile, about one wave in all."""
    tiles = -(-M // cfg.rows)
    return max(1, min(tiles, cfg.programs_per_sm * sm_count // cfg.split))


# ================================================================================================
# Launch
# ================================================================================================
def launch(cfg: BwdConfig, dy2d: torch.Tensor, x2d: torch.Tensor, weight: torch.Tensor | None,
           rstd: torch.Tensor, offset: float, need_dx: bool, need_dw: bool, sm_count: int,
           out: tuple | None = None):
    """(dx [M, N] contiguous in x's dtype or None, dw [N] in the weight's dtype or None).

    The API layer has validated everything: x2d and dy2d [M, N] with unit column stride (dy's row
    stride may be 0), M >= 1, rstd [M] fp32 (the forward's), weight [N] or None. `out`: (dx, dw)."""
    M, N = x2d.shape
    device = x2d.device
    need_dw = need_dw and weight is not None
    if weight is not None and weight.stride(0) != 1 and N > 1:  # the kernel reads the weight at unit stride
        weight = weight.contiguous()
    if out is not None:
        dx, dw = out
    else:
        dx = torch.empty(M, N, dtype=x2d.dtype, device=device) if need_dx else None
        dw = torch.empty(N, dtype=weight.dtype, device=device) if need_dw else None
    if not (need_dx or need_dw):
        return dx, dw
    sx = x2d.stride(0) if M > 1 else N
    sdy = dy2d.stride(0) if M > 1 else N
    R = grid_groups(cfg, M, sm_count)
    stream = raw_stream(device)
    direct = R == 1 and cfg.chunks == 1
    dw_arg = rstd  # never touched without NEED_DW
    if need_dw:
        if direct:
            dw_arg = dw
        else:  # chunked parts accumulate into their row: it starts at zero
            dw_arg = workspace("triton_bwd_dw", R * N, torch.float32, device, stream, zero=False)
            if cfg.chunks > 1:
                dw_arg[:R * N].zero_()
    slots = count = rstd  # never touched without SPLIT > 1
    if cfg.split > 1 and need_dx:
        tiles = -(-M // cfg.rows)
        slots = workspace("triton_bwd_slots", tiles * cfg.rows * cfg.split, torch.float32, device, stream, zero=False)
        count = workspace(f"triton_bwd_count{cfg.split}", tiles, torch.int64, device, stream, zero=True)
    args = (dy2d, x2d, weight if weight is not None else rstd, rstd, dx if need_dx else rstd, dw_arg, slots, count,
            M, sx, sdy, offset, N, cfg.part)
    consts = dict(BLOCK_N=cfg.block_n, CHUNKS=cfg.chunks, ROWS=cfg.rows, SPLIT=cfg.split,
                  HAS_W=weight is not None, NEED_DX=need_dx, NEED_DW=need_dw, ACC_2D=cfg.acc_2d and cfg.rows > 1,
                  INT64=needs_int64(M, max(sx, sdy, N)))
    phases = (1, 2) if cfg.split > 1 and need_dx and INTERPRET else (0,)
    for phase in phases:
        rms_norm_bwd_kernel[(R * cfg.split,)](*args, **consts, PHASE=phase, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if need_dw and not direct:
        dw_reduce_kernel[(-(-N // REDUCE_COLS),)](dw_arg, dw, R, N, BLOCK_C=REDUCE_COLS, num_warps=4)
    return dx, dw


# ================================================================================================
# The backend
# ================================================================================================
@dataclass(frozen=True)
class TritonBackward:
    def config(self, N: int, dtype: torch.dtype, dev: DeviceInfo, w_dtype: torch.dtype | None = None) -> BwdConfig:
        return analytic_config(N, dtype.itemsize, dev.vendor, max(1, dev.sm_count))

    def describe(self, M: int, N: int, dtype: torch.dtype, dev: DeviceInfo, w_dtype: torch.dtype | None = None) -> str:
        cfg = self.config(N, dtype, dev)
        R = grid_groups(cfg, M, max(1, dev.sm_count))
        return (f"Triton rms_norm_bwd_kernel (persistent), grid ({R * cfg.split},) = {R} row groups x {cfg.split} "
                f"parts, {cfg.short()}" + (", then dw_reduce_kernel over the R partial rows" if R > 1 else "")
                + f"; config: analytic (N, dtype, {dev.vendor})")

    def backward(self, dy2d, x2d, weight, rstd, offset, need_dx, need_dw, dev: DeviceInfo,
                 cfg: BwdConfig | None = None, out: tuple | None = None):
        cfg = cfg or self.config(x2d.shape[1], x2d.dtype, dev)
        return launch(cfg, dy2d, x2d, weight, rstd, offset, need_dx, need_dw, max(1, dev.sm_count), out)


TRITON_BACKWARD = TritonBackward()
