"""RMSNorm forward in Triton, the kernel (its configs and rule in rmsnorm_fwd_config.py, the launch and
the backend in rmsnorm_fwd.py): the fallback for AMD GPUs and NVIDIA GPUs without cuTile / CuTe DSL.

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

import triton
import triton.language as tl

from ._common import exchange, part_mask, program_part, row_offsets, slot_flag, weight_row


# ================================================================================================
# Kernel
# ================================================================================================
@triton.jit
def rms_norm_fwd_kernel(X, W, Y, RSTD, SLOTS, M, stride_x, eps, offset,
                        N, PART, BLOCK_N: tl.constexpr, CHUNKS: tl.constexpr,
                        ROWS: tl.constexpr, SPLIT: tl.constexpr, HAS_W: tl.constexpr, HAS_OFFSET: tl.constexpr,
                        STORE_RSTD: tl.constexpr, PREFETCH: tl.constexpr, ONE_TILE: tl.constexpr,
                        PHASE: tl.constexpr, INT64: tl.constexpr, ALIGN: tl.constexpr = 1):
    # PHASE 0: one launch. Under the interpreter (programs run one after another, so none can wait
    # for another) a split launch runs twice: PHASE 1 publishes the partial sums, PHASE 2 finishes.
    # ONE_TILE (split rows, one program per part; 16-bit rows of 7168-8192 in registers, one program
    # per row: the config's one_tile): straight-line code for the program's one tile,
    # the weight loaded where it is used. With a row's parts waiting for each other, the tile loop
    # and the early weight load measured 0.75 x copy against 0.987 without them (N = 65536, 16 parts
    # of 4096, 4 warps). Else the tile loop (one trip without a
    # persistent grid) with the weight loaded first: whole rows of up to 8 warps measured the same
    # either way (16 warps at 8192 did not: 0.947 with the loop, 0.993 without), and
    # two-pass rows 1-4 % faster with the loop (5120: 0.982 against 0.947).
    part, group = program_part(SPLIT)
    if ONE_TILE:
        last = group + 1
        step = 1
    else:
        last = (M + ROWS - 1) // ROWS
        step = tl.num_programs(0) // SPLIT
    lanes = tl.arange(0, BLOCK_N)
    col0 = part * PART
    if ALIGN > 1:  # (tiling.offset_align: what Triton cannot infer where N or x's row stride is not a multiple of 16)
        col0 = tl.multiple_of(col0, ALIGN)
    if CHUNKS == 1:  # the weight's part (+ offset, fp32), loaded once per program
        cols = col0 + lanes
        if SPLIT == 1:  # one part, from column 0
            cols = lanes
        col_ok = part_mask(lanes, cols, PART, N, BLOCK_N, ALIGN)
        if HAS_W and not ONE_TILE:
            w = weight_row(W, cols, col_ok, offset, HAS_OFFSET)
        if PREFETCH:  # the first tile's x; each tile then loads the next one's before its reduction
            rows_n = group * ROWS + tl.arange(0, ROWS)
            if INT64:
                rows_n = rows_n.to(tl.int64)
            x_n = tl.load(X + row_offsets(rows_n, stride_x, ALIGN) + cols[None, :],
                          mask=(rows_n < M)[:, None] & col_ok[None, :], other=0.0)
    for tile in range(group, last, step):
        rows = tile * ROWS + tl.arange(0, ROWS)
        row_ok = rows < M
        if INT64:
            rows = rows.to(tl.int64)
        x_rows = X + row_offsets(rows, stride_x, ALIGN)
        if CHUNKS == 1:
            mask = row_ok[:, None] & col_ok[None, :]
            if PREFETCH:
                x = x_n.to(tl.float32)
                rows_n = rows + step * ROWS
                x_n = tl.load(X + row_offsets(rows_n, stride_x, ALIGN) + cols[None, :],
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
                mask_c = row_ok[:, None] & part_mask(lanes_c, cols_c, PART, N, BLOCK_N, ALIGN)[None, :]
                xc = tl.load(x_rows + cols_c[None, :], mask=mask_c, other=0.0,
                             eviction_policy="evict_last").to(tl.float32)
                sumsq += tl.sum(xc * xc, axis=1)
        if SPLIT > 1:
            sumsq = exchange(SLOTS, tile, rows, row_ok, sumsq, part, flag, ROWS, SPLIT, PHASE)
        if PHASE != 1:
            rstd = tl.rsqrt(sumsq / N + eps)
            y_rows = Y + row_offsets(rows, N, ALIGN)
            if CHUNKS == 1:
                y = x * rstd[:, None]
                if HAS_W:
                    if ONE_TILE:
                        w = weight_row(W, cols, col_ok, offset, HAS_OFFSET)
                    y = y * w[None, :]
                tl.store(y_rows + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)
            else:
                for c in range(CHUNKS):
                    lanes_c = c * BLOCK_N + lanes
                    cols_c = col0 + lanes_c
                    ok_c = part_mask(lanes_c, cols_c, PART, N, BLOCK_N, ALIGN)
                    mask_c = row_ok[:, None] & ok_c[None, :]
                    xc = tl.load(x_rows + cols_c[None, :], mask=mask_c, other=0.0,
                                 eviction_policy="evict_first").to(tl.float32)
                    yc = xc * rstd[:, None]
                    if HAS_W:
                        wc = weight_row(W, cols_c, ok_c, offset, HAS_OFFSET)
                        yc = yc * wc[None, :]
                    tl.store(y_rows + cols_c[None, :], yc.to(Y.dtype.element_ty), mask=mask_c)
            if STORE_RSTD:
                tl.store(RSTD + rows, rstd, mask=row_ok & (part == 0))


@triton.jit
def rms_norm_fwd_fixed_kernel(X, W, Y, RSTD, stride_x, eps, offset, N: tl.constexpr, BLOCK_N: tl.constexpr,
                              HAS_W: tl.constexpr, HAS_OFFSET: tl.constexpr, STORE_RSTD: tl.constexpr,
                              CONTIG: tl.constexpr, INT64: tl.constexpr, ALIGN: tl.constexpr = 1):
    # One row per program in two passes over chunks of BLOCK_N, the row's length compiled in (one
    # compile per N): the loops' trip counts and every column mask are constants, and the mask's runs
    # of equal bits follow from N itself, so each chunk moves whole 16-byte vectors. The first pass
    # sums the squares into a vector of BLOCK_N lanes (one cross-warp reduction per row, not one per
    # chunk) with x kept in L2 (evict_last); the second re-reads it (evict_first) and stores y.
    # CONTIG: x's rows N apart (the row offset a constant multiple); else stride_x, said to be a
    # multiple of ALIGN (tiling.offset_align).
    row = tl.program_id(0)
    if INT64:
        row = row.to(tl.int64)
    if CONTIG:
        x_row = X + row * N
    else:
        x_off = row * stride_x
        if ALIGN > 1:
            x_off = tl.multiple_of(x_off, ALIGN)
        x_row = X + x_off
    lanes = tl.arange(0, BLOCK_N)
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for c0 in tl.range(0, N, BLOCK_N):
        cols = c0 + lanes
        x = tl.load(x_row + cols, mask=cols < N, other=0.0, eviction_policy="evict_last").to(tl.float32)
        acc += x * x
    rstd = tl.rsqrt(tl.sum(acc, axis=0) / N + eps)
    y_row = Y + row * N
    for c0 in tl.range(0, N, BLOCK_N):
        cols = c0 + lanes
        ok = cols < N
        y = tl.load(x_row + cols, mask=ok, other=0.0, eviction_policy="evict_first").to(tl.float32) * rstd
        if HAS_W:
            w = tl.load(W + cols, mask=ok, other=0.0, eviction_policy="evict_last").to(tl.float32)
            if HAS_OFFSET:
                w = w + offset
            y = y * w
        tl.store(y_row + cols, y.to(Y.dtype.element_ty), mask=ok)
    if STORE_RSTD:
        tl.store(RSTD + row, rstd)
