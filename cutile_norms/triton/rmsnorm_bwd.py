"""RMSNorm backward in Triton: the persistent kernels, the dw reduction, their config, launch, backend.

The math, all in fp32 (w' = offset + w, xhat = x * rstd with rstd saved by the forward):
    g = dy * w'        dx = rstd * (g - xhat * mean(g * xhat))        dw = sum over rows of dy * xhat

A persistent grid of R row groups x SPLIT parts (program p: part p % SPLIT of the row tiles
p // SPLIT, p // SPLIT + R, ...), the forward's tiling (`split_for`, rows per tile for narrow rows):
  * each program loads its part of the weight once and keeps it (+ offset, fp32) in registers with
    its dw accumulator (fp32, one per column it owns), then walks its row tiles: x, dy, rstd in, dx out;
  * PREFETCH: each program loads its next tile's x, dy and rstd before it reduces this one, so one
    tile's DRAM round trip overlaps the previous tile's reductions and stores;
  * split rows exchange their partial sums of g * xhat through global memory (`exchange`), the grid
    sized to one wave of the compiled kernel (`resident_programs`: a row's programs wait for each other);
  * dw: each program stores its accumulator as one row of an R x N fp32 buffer, and a second small
    kernel sums the R rows per column in a fixed order (no float atomics: the same bits every run).
    With one row group (small M) the first kernel stores dw itself: one launch.
  * parts too long for registers (N > SPLIT_MAX x TILE_ELEMS) run in chunks: the dot in a first
    pass over x and dy (kept in L2), dx in a second; dw accumulates in the program's own row of the
    R x N buffer (read-modify-write, no other program touches it).
  * split rows on sm_90+ (parts a power of two that tile the row, TMA-addressable rows) run
    `rms_norm_bwd_tma_kernel`: x and dy by TMA, Triton's pipeliner issuing them rows ahead into
    shared memory instead of the register prefetch; same exchange and dw.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from .._platform import DeviceInfo
from .._util import pow2_ceil
from .._workspace import workspace
from ._common import (INTERPRET, TileConfig, exchange, lanes_per_warp, needs_int64, raw_stream,
                      resident_programs, slot_count, slot_flag, slot_row_stride, slot_word, split_for,
                      warps_for)


# ================================================================================================
# Kernels
# ================================================================================================
@triton.jit
def rms_norm_bwd_kernel(DY, X, W, RSTD, DX, DW, SLOTS, M, stride_x, stride_dy, offset,
                        N, PART, BLOCK_N: tl.constexpr, CHUNKS: tl.constexpr,
                        ROWS: tl.constexpr, SPLIT: tl.constexpr, HAS_W: tl.constexpr, NEED_DX: tl.constexpr,
                        NEED_DW: tl.constexpr, ACC_2D: tl.constexpr, PREFETCH: tl.constexpr,
                        PHASE: tl.constexpr, INT64: tl.constexpr):
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
        if PREFETCH:  # the first tile's x, dy, rstd; each tile then loads the next one's before its reduction
            rows_n = group * ROWS + tl.arange(0, ROWS)
            if INT64:
                rows_n = rows_n.to(tl.int64)
            ok_n = rows_n < M
            x_n = tl.load(X + rows_n[:, None] * stride_x + cols[None, :], mask=ok_n[:, None] & col_ok[None, :], other=0.0)
            dy_n = tl.load(DY + rows_n[:, None] * stride_dy + cols[None, :], mask=ok_n[:, None] & col_ok[None, :],
                           other=0.0)
            rstd_n = tl.load(RSTD + rows_n, mask=ok_n, other=0.0)
    for tile in range(group, (M + ROWS - 1) // ROWS, groups):
        rows = tile * ROWS + tl.arange(0, ROWS)
        row_ok = rows < M
        if INT64:
            rows = rows.to(tl.int64)
        x_rows = X + rows[:, None] * stride_x
        dy_rows = DY + rows[:, None] * stride_dy
        if CHUNKS == 1:
            mask = row_ok[:, None] & col_ok[None, :]
            if PREFETCH:
                x = x_n.to(tl.float32)
                dy = dy_n.to(tl.float32)
                rstd = rstd_n
                rows_n = rows + groups * ROWS
                ok_n = rows_n < M
                mask_n = ok_n[:, None] & col_ok[None, :]
                x_n = tl.load(X + rows_n[:, None] * stride_x + cols[None, :], mask=mask_n, other=0.0)
                dy_n = tl.load(DY + rows_n[:, None] * stride_dy + cols[None, :], mask=mask_n, other=0.0)
                rstd_n = tl.load(RSTD + rows_n, mask=ok_n, other=0.0)
            else:
                rstd = tl.load(RSTD + rows, mask=row_ok, other=0.0)
                x = tl.load(x_rows + cols[None, :], mask=mask, other=0.0).to(tl.float32)
                dy = tl.load(dy_rows + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            if SPLIT > 1 and NEED_DX:
                flag = slot_flag(SLOTS, tile, rows, row_ok, part, ROWS, SPLIT, PHASE)
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
            rstd = tl.load(RSTD + rows, mask=row_ok, other=0.0)
            if SPLIT > 1 and NEED_DX:
                flag = slot_flag(SLOTS, tile, rows, row_ok, part, ROWS, SPLIT, PHASE)
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
            dot = exchange(SLOTS, tile, rows, row_ok, dot, part, flag, ROWS, SPLIT, PHASE)
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
def _poll_low_words(slot_row, lanes, flag, SPLIT: tl.constexpr):
    """The low words of the int64 slots slot_row[lanes] ([SPLIT]) once the row's SPLIT slots all show
    `flag` in their high word. The program's first warp spins on the slots (lane l on slots l, l + 32,
    ...; each read whole: one relaxed gpu-scope 64-bit load), the other warps, which hold copies of
    the same slots, wait at a CTA barrier (named barrier 1: Triton's own barriers use 0); then every
    thread reads its slots once. Polling from every warp measured 0.47 x copy at N = 262144. Inline
    assembly rather than `_poll`'s Triton `while` loop (or a `tl.debug_barrier`): either stops
    Triton's pipeliner from software-pipelining the row loop's descriptor loads (checked in the
    sm_90 PTX: no bulk tensor copies issued ahead)."""
    zero = tl.full([SPLIT], 0, tl.int32)
    return tl.inline_asm_elementwise(
        """{
        .reg .pred stop;
        .reg .b32 hi, lane;
        .reg .b64 slot, addr;
        mov.u32 lane, %tid.x;
        setp.ge.u32 stop, lane, 32;
        @stop bra DONE;
        NEXT_SLOT:
        setp.ge.u32 stop, lane, $4;
        @stop bra DONE;
        mad.wide.u32 addr, lane, 8, $2;
        POLL:
        ld.relaxed.gpu.global.b64 slot, [addr];
        mov.b64 {$0, hi}, slot;
        setp.ne.b32 stop, hi, $3;
        @stop bra POLL;
        add.u32 lane, lane, 32;
        bra NEXT_SLOT;
        DONE:
        barrier.sync 1;
        ld.relaxed.gpu.global.b64 slot, [$1];
        mov.b64 {$0, hi}, slot;
        }""", "=r,l,l,r,r", [slot_row + lanes, zero.to(tl.int64) + slot_row.to(tl.int64, bitcast=True),
                            zero + flag.to(tl.int32), zero + SPLIT],
        dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def rms_norm_bwd_tma_kernel(XD, DYD, W, RSTD, DX, DW, SLOTS, M, offset, N,
                            C: tl.constexpr, INNER: tl.constexpr, SPLIT: tl.constexpr, HAS_W: tl.constexpr,
                            NEED_DW: tl.constexpr, STAGES: tl.constexpr, PHASE: tl.constexpr,
                            INT64: tl.constexpr):
    """Split rows (SPLIT programs per row, parts of C x INNER columns, a power of two) with x and dy
    read by TMA through the descriptors XD and DYD ([M, N / INNER, INNER] views of the rows):
    Triton's pipeliner (`tl.range(num_stages=STAGES)`) issues each row's bulk copies into shared
    memory STAGES - 1 rows ahead, so the DRAM reads keep going while a row waits for its partners'
    partial sums; the register prefetch of the pointer kernel held one row ahead in registers and
    left one program per SM. The exchange, the flags and dw are the pointer kernel's (`exchange`);
    the poll is `_poll_low_words`. PHASE as in rms_norm_bwd_kernel (the interpreter's two launches)."""
    pid = tl.program_id(0)
    part = pid % SPLIT
    group = pid // SPLIT
    groups = tl.num_programs(0) // SPLIT
    cols = part * (C * INNER) + tl.arange(0, C * INNER)
    if HAS_W:
        w = tl.load(W + cols).to(tl.float32) + offset
    dw_acc = tl.zeros([C * INNER], dtype=tl.float32)
    lanes = tl.arange(0, SPLIT)
    # this row's exchange flag and rstd are loaded a row ahead (scalars, loop-carried)
    flag_n = slot_flag(SLOTS, group, group, True, part, 1, SPLIT, PHASE)
    rstd_n = tl.load(RSTD + group)
    for row in tl.range(group, M, groups, num_stages=STAGES):
        flag = flag_n
        rstd = rstd_n
        row_n = tl.minimum(row + groups, M - 1)
        flag_n = slot_flag(SLOTS, row_n, row_n, True, part, 1, SPLIT, PHASE)
        rstd_n = tl.load(RSTD + row_n)
        x = tl.reshape(XD.load([row, part * C, 0]), [C * INNER]).to(tl.float32)
        dy = tl.reshape(DYD.load([row, part * C, 0]), [C * INNER]).to(tl.float32)
        xhat = x * rstd
        g = dy
        if HAS_W:
            g = dy * w
        slot_row = SLOTS + tl.cast(row, tl.int64) * slot_row_stride(SPLIT)
        if PHASE != 2:
            tl.atomic_xchg(slot_row + part, slot_word(flag, tl.sum(g * xhat, axis=0)), sem="relaxed", scope="gpu")
            if NEED_DW:
                dw_acc += dy * xhat
        if PHASE != 1:
            if PHASE == 2:  # the interpreter's second launch: every slot was written by the first
                low = (tl.load(slot_row + lanes) & 0xFFFFFFFF).to(tl.int32)
            else:
                low = _poll_low_words(slot_row, lanes, flag, SPLIT)
            mean = tl.sum(low.to(tl.float32, bitcast=True), axis=0) / N
            dx = rstd * (g - xhat * mean)
            row_off = row.to(tl.int64) * N if INT64 else row * N
            tl.store(DX + row_off + cols, dx.to(DX.dtype.element_ty))
    if NEED_DW and PHASE != 2:
        tl.store(DW + group.to(tl.int64) * N + cols, dw_acc.to(DW.dtype.element_ty))


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
        warps = warps_for(rows * block_n, elem_bytes, lanes, vendor, per_thread=16 if block_n == N else 8)
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


# ================================================================================================
# Launch
# ================================================================================================
def has_tma(dev: DeviceInfo) -> bool:
    """The device has TMA (NVIDIA sm_90+), or Triton is interpreted."""
    return INTERPRET or (dev.vendor == "nvidia" and dev.arch is not None and dev.arch >= (9, 0))


def tma_config(cfg: BwdConfig, N: int) -> bool:
    """The config asks for TMA and its parts can be read by it: split rows whose parts are one
    power-of-two box of at least 256 columns, tiling the row exactly."""
    part = cfg.part
    return (cfg.tma_stages > 0 and cfg.split > 1 and cfg.chunks == 1
            and part >= 256 and part & (part - 1) == 0 and part * cfg.split == N)


def tma_applies(cfg: BwdConfig, x2d: torch.Tensor, dy2d: torch.Tensor, sx: int, sdy: int, need_dx: bool,
                tma_capable: bool) -> bool:
    """Whether `rms_norm_bwd_tma_kernel` runs: `tma_config`, on a GPU with TMA (or the interpreter),
    for rows that TMA can address (16-byte aligned starts and row strides, no zero stride)."""
    return (tma_capable and need_dx and tma_config(cfg, x2d.shape[1])
            and all(t.data_ptr() % 16 == 0 and s > 0 and s * t.element_size() % 16 == 0
                    for t, s in ((x2d, sx), (dy2d, sdy))))


def launch(cfg: BwdConfig, dy2d: torch.Tensor, x2d: torch.Tensor, weight: torch.Tensor | None,
           rstd: torch.Tensor, offset: float, need_dx: bool, need_dw: bool, sm_count: int,
           out: tuple | None = None, tma_capable: bool = False):
    """(dx [M, N] contiguous in x's dtype or None, dw [N] in the weight's dtype or None).

    The API layer has validated everything: x2d and dy2d [M, N] with unit column stride (dy's row
    stride may be 0), M >= 1, rstd [M] fp32 (the forward's), weight [N] or None. `out`: (dx, dw).
    `tma_capable`: the device has TMA (NVIDIA sm_90+) or Triton is interpreted."""
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
    stream = raw_stream(device)
    slots = rstd  # never touched without SPLIT > 1
    if cfg.split > 1 and need_dx:  # kept per SPLIT value: every launch flips all SPLIT slots of each row (`exchange`)
        slots = workspace(f"triton_bwd_slots{cfg.split}", slot_count(-(-M // cfg.rows) * cfg.rows, cfg.split),
                          torch.int64, device, stream, zero=True)
    w_arg = weight if weight is not None else rstd
    dx_arg = dx if need_dx else rstd
    if tma_applies(cfg, x2d, dy2d, sx, sdy, need_dx, tma_capable):
        kernel = rms_norm_bwd_tma_kernel
        inner = min(256, cfg.part)  # a TMA box is at most 256 elements along each dimension
        shape, block = [M, N // inner, inner], [1, cfg.part // inner, inner]
        xd = TensorDescriptor(x2d, shape, [sx, inner, 1], block)
        dyd = TensorDescriptor(dy2d, shape, [sdy, inner, 1], block)
        consts = dict(C=cfg.part // inner, INNER=inner, SPLIT=cfg.split, HAS_W=weight is not None, NEED_DW=need_dw,
                      STAGES=cfg.tma_stages, INT64=needs_int64(M, N))

        def kernel_args(dw_arg):
            return (xd, dyd, w_arg, rstd, dx_arg, dw_arg, slots, M, offset, N)
    else:
        kernel = rms_norm_bwd_kernel
        prefetch = cfg.prefetch and cfg.chunks == 1
        consts = dict(BLOCK_N=cfg.block_n, CHUNKS=cfg.chunks, ROWS=cfg.rows, SPLIT=cfg.split,
                      HAS_W=weight is not None, NEED_DX=need_dx, NEED_DW=need_dw,
                      ACC_2D=cfg.acc_2d and cfg.rows > 1, PREFETCH=prefetch,
                      INT64=needs_int64(M + (cfg.rows * cfg.programs_per_sm * sm_count if prefetch else 0),
                                        max(sx, sdy, N)))

        def kernel_args(dw_arg):
            return (dy2d, x2d, w_arg, rstd, dx_arg, dw_arg, slots, M, sx, sdy, offset, N, cfg.part)

    R = grid_groups(cfg, M, sm_count)
    if R > 1:  # one wave of the compiled kernel (its dw argument: the fp32 partials, as in the launch below)
        resident = resident_programs(kernel, kernel_args(rstd), dict(consts, PHASE=0), cfg.num_warps,
                                     cfg.num_stages, device, (tuple(consts.items()), x2d.dtype, dy2d.dtype, w_arg.dtype))
        R = grid_groups(cfg, M, sm_count, resident)
    direct = R == 1 and cfg.chunks == 1
    dw_arg = rstd  # never touched without NEED_DW
    if need_dw:
        if direct:
            dw_arg = dw
        else:  # chunked parts accumulate into their row: it starts at zero
            dw_arg = workspace("triton_bwd_dw", R * N, torch.float32, device, stream, zero=False)
            if cfg.chunks > 1:
                dw_arg[:R * N].zero_()
    args = kernel_args(dw_arg)
    phases = (1, 2) if cfg.split > 1 and need_dx and INTERPRET else (0,)
    for phase in phases:
        kernel[(R * cfg.split,)](*args, **consts, PHASE=phase, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
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
        kernel = "rms_norm_bwd_tma_kernel" if has_tma(dev) and tma_config(cfg, N) else "rms_norm_bwd_kernel"
        return (f"Triton {kernel} (persistent), grid ({R * cfg.split},) = {R} row groups x {cfg.split} "
                f"parts, {cfg.short()}" + (", then dw_reduce_kernel over the R partial rows" if R > 1 else "")
                + f"; config: analytic (N, dtype, {dev.vendor})")

    def backward(self, dy2d, x2d, weight, rstd, offset, need_dx, need_dw, dev: DeviceInfo,
                 cfg: BwdConfig | None = None, out: tuple | None = None):
        cfg = cfg or self.config(x2d.shape[1], x2d.dtype, dev)
        return launch(cfg, dy2d, x2d, weight, rstd, offset, need_dx, need_dw, max(1, dev.sm_count), out,
                      has_tma(dev))


TRITON_BACKWARD = TritonBackward()
