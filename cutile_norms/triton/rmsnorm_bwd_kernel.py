"""RMSNorm backward in Triton, the kernels (configs and rule in rmsnorm_bwd_config.py, the launch and the
backend in rmsnorm_bwd.py).

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
  * narrow 16-bit rows on sm_90+ (TMA-addressable) run `rms_norm_bwd_tma_rows_kernel`: tiles of
    several rows by TMA, pipelined tiles ahead, dx written by TMA; same dw. Rows that two powers of
    two tile exactly may run in those two pieces (`rms_norm_bwd_tma_rows2_kernel`), and a GPU model's
    `wide` band of rows up to 8192 columns a row a tile (rmsnorm_bwd_config.tma_rows_take).
"""
from __future__ import annotations

import triton
import triton.language as tl

from ._common import exchange, part_mask, program_part, row_offsets, slot_flag, slot_row_stride, slot_word


# ================================================================================================
# Kernels
# ================================================================================================
@triton.jit
def _chunk(x_rows, dy_rows, row_ok, lanes, col0, c, PART, N, BLOCK_N: tl.constexpr, EVICT: tl.constexpr,
           ALIGN: tl.constexpr):
    """Chunk c of a part too long for registers: (its columns, their in-row mask, the tile mask, x and
    dy in fp32)."""
    lanes_c = c * BLOCK_N + lanes
    cols_c = col0 + lanes_c
    ok_c = part_mask(lanes_c, cols_c, PART, N, BLOCK_N, ALIGN)
    mask_c = row_ok[:, None] & ok_c[None, :]
    xc = tl.load(x_rows + cols_c[None, :], mask=mask_c, other=0.0, eviction_policy=EVICT).to(tl.float32)
    dyc = tl.load(dy_rows + cols_c[None, :], mask=mask_c, other=0.0, eviction_policy=EVICT).to(tl.float32)
    return cols_c, ok_c, mask_c, xc, dyc


@triton.jit
def rms_norm_bwd_kernel(DY, X, W, RSTD, DX, DW, SLOTS, M, stride_x, stride_dy, offset,
                        N, PART, BLOCK_N: tl.constexpr, CHUNKS: tl.constexpr,
                        ROWS: tl.constexpr, SPLIT: tl.constexpr, HAS_W: tl.constexpr, NEED_DX: tl.constexpr,
                        NEED_DW: tl.constexpr, ACC_2D: tl.constexpr, PREFETCH: tl.constexpr,
                        PHASE: tl.constexpr, INT64: tl.constexpr, ALIGN: tl.constexpr = 1):
    # DW: dw itself (one row group, parts in registers) or the R x N fp32 partials. PHASE as in the forward:
    # 0 = one launch; under the interpreter a split launch runs PHASE 1 (dot partials and dw), then 2 (dx).
    part, group = program_part(SPLIT)
    groups = tl.num_programs(0) // SPLIT
    lanes = tl.arange(0, BLOCK_N)
    col0 = part * PART
    dw_off = group.to(tl.int64) * N
    if ALIGN > 1:
        col0 = tl.multiple_of(col0, ALIGN)
        dw_off = tl.multiple_of(dw_off, ALIGN)
    dw_row = DW + dw_off
    if CHUNKS == 1:
        cols = col0 + lanes
        if SPLIT == 1:  # one part, from column 0
            cols = lanes
        col_ok = part_mask(lanes, cols, PART, N, BLOCK_N, ALIGN)
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
            x_n = tl.load(X + row_offsets(rows_n, stride_x, ALIGN) + cols[None, :],
                          mask=ok_n[:, None] & col_ok[None, :], other=0.0)
            dy_n = tl.load(DY + row_offsets(rows_n, stride_dy, ALIGN) + cols[None, :],
                           mask=ok_n[:, None] & col_ok[None, :], other=0.0)
            rstd_n = tl.load(RSTD + rows_n, mask=ok_n, other=0.0)
    for tile in range(group, (M + ROWS - 1) // ROWS, groups):
        rows = tile * ROWS + tl.arange(0, ROWS)
        row_ok = rows < M
        if INT64:
            rows = rows.to(tl.int64)
        x_rows = X + row_offsets(rows, stride_x, ALIGN)
        dy_rows = DY + row_offsets(rows, stride_dy, ALIGN)
        if CHUNKS == 1:
            mask = row_ok[:, None] & col_ok[None, :]
            if PREFETCH:
                x = x_n.to(tl.float32)
                dy = dy_n.to(tl.float32)
                rstd = rstd_n
                rows_n = rows + groups * ROWS
                ok_n = rows_n < M
                mask_n = ok_n[:, None] & col_ok[None, :]
                x_n = tl.load(X + row_offsets(rows_n, stride_x, ALIGN) + cols[None, :], mask=mask_n, other=0.0)
                dy_n = tl.load(DY + row_offsets(rows_n, stride_dy, ALIGN) + cols[None, :], mask=mask_n, other=0.0)
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
            for c in range(CHUNKS):  # first pass: the dot (x and dy kept in L2 for the second)
                cols_c, ok_c, mask_c, xc, dyc = _chunk(x_rows, dy_rows, row_ok, lanes, col0, c, PART, N, BLOCK_N,
                                                       "evict_last", ALIGN)
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
            dx_rows = DX + row_offsets(rows, N, ALIGN)
            if CHUNKS == 1:
                dx = rstd[:, None] * (g - xhat * mean[:, None])
                tl.store(dx_rows + cols[None, :], dx.to(DX.dtype.element_ty), mask=mask)
            else:
                for c in range(CHUNKS):  # second pass: dx (x and dy read for the last time)
                    cols_c, ok_c, mask_c, xc, dyc = _chunk(x_rows, dy_rows, row_ok, lanes, col0, c, PART, N,
                                                           BLOCK_N, "evict_first", ALIGN)
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
    part, group = program_part(SPLIT)
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
def _piece_cols(START: tl.constexpr, WIDTH: tl.constexpr):
    """The columns of a piece: START + 0 ... WIDTH - 1."""
    return START + tl.arange(0, tl.constexpr(WIDTH))


@triton.jit
def _tma_rows(XD, DYD, DXD, DHD, W, RSTD, DW, M, offset, N, ROWS: tl.constexpr, PIECES: tl.constexpr,
              STARTS: tl.constexpr, HAS_W: tl.constexpr, NEED_DW: tl.constexpr, STAGES: tl.constexpr,
              HAS_DH: tl.constexpr):
    """Whole rows in tiles of ROWS rows, each row cut into pieces of PIECES columns (powers of two) at
    columns STARTS, read through the descriptors XD and DYD and written through DXD (tuples, one per
    piece, of descriptors of the [M, N] rows with boxes [ROWS, piece]): the columns past N and the rows
    past M read as zeros and are not written. One piece of pow2_ceil(N) columns, or powers of two that
    tile the row exactly (rmsnorm_bwd_config.row_pieces). Triton's pipeliner
    (`tl.range(num_stages=STAGES)`) issues each tile's bulk copies STAGES - 1 tiles ahead into shared
    memory. dw as in rms_norm_bwd_kernel (this program's row of the R x N partials, or dw itself with
    one program). HAS_DH: the residual add's backward, dh read through DHD (a tuple as XD) and added to
    dx (the grad into h), issued ahead by the pipeliner with x and dy."""
    group = tl.program_id(0)
    groups = tl.num_programs(0)
    K: tl.constexpr = len(PIECES)
    ws = ()
    accs = ()
    for i in tl.static_range(K):
        cols = _piece_cols(STARTS[i], PIECES[i])
        w = tl.zeros([tl.constexpr(PIECES[i])], dtype=tl.float32)
        if HAS_W:
            w = tl.load(W + cols, mask=cols < N, other=0.0).to(tl.float32) + offset
        ws = ws + (w,)
        accs = accs + (tl.zeros([ROWS, tl.constexpr(PIECES[i])], dtype=tl.float32),)
    for tile in tl.range(group, tl.cdiv(M, ROWS), groups, num_stages=STAGES):
        row0 = tile * ROWS
        rows = row0 + tl.arange(0, ROWS)
        rstd = tl.load(RSTD + rows, mask=rows < M, other=0.0)
        dot = tl.zeros([ROWS], dtype=tl.float32)
        xhats = ()
        dys = ()
        for i in tl.static_range(K):
            xhat = XD[i].load([row0, STARTS[i]]).to(tl.float32) * rstd[:, None]
            dy = DYD[i].load([row0, STARTS[i]]).to(tl.float32)
            g = dy
            if HAS_W:
                g = dy * ws[i][None, :]
            dot += tl.sum(g * xhat, axis=1)
            xhats = xhats + (xhat,)
            dys = dys + (dy,)
        mean = dot / N
        if NEED_DW:
            new = ()
            for i in tl.static_range(K):
                new = new + (accs[i] + dys[i] * xhats[i],)
            accs = new
        for i in tl.static_range(K):
            g = dys[i]
            if HAS_W:
                g = dys[i] * ws[i][None, :]
            dx = rstd[:, None] * (g - xhats[i] * mean[:, None])
            if HAS_DH:
                dx += DHD[i].load([row0, STARTS[i]]).to(tl.float32)
            DXD[i].store([row0, STARTS[i]], dx.to(DXD[i].dtype))
    if NEED_DW:
        for i in tl.static_range(K):
            cols = _piece_cols(STARTS[i], PIECES[i])
            tl.store(DW + group.to(tl.int64) * N + cols, tl.sum(accs[i], axis=0).to(DW.dtype.element_ty),
                     mask=cols < N)


# One entry point per count of pieces: Triton's launcher takes no tuple of descriptors, and four of each
# passed, the unused ones repeated, cost 25-36 % at 768-1536 columns on an H200 (the same PTX but for the
# parameters; cause not known). No three-piece entry: three pieces lost 7-40 % wherever measured
# (docs/performance.md 2.48).
@triton.jit
def rms_norm_bwd_tma_rows_kernel(XD, DYD, DXD, W, RSTD, DW, M, offset, N, ROWS: tl.constexpr, PIECES: tl.constexpr,
                                 STARTS: tl.constexpr, HAS_W: tl.constexpr, NEED_DW: tl.constexpr,
                                 STAGES: tl.constexpr):
    """`_tma_rows` over one piece."""
    _tma_rows((XD,), (DYD,), (DXD,), (), W, RSTD, DW, M, offset, N, ROWS, PIECES, STARTS, HAS_W, NEED_DW, STAGES,
              False)


@triton.jit
def rms_norm_bwd_tma_rows2_kernel(XD0, XD1, DYD0, DYD1, DXD0, DXD1, W, RSTD, DW, M, offset, N, ROWS: tl.constexpr,
                                  PIECES: tl.constexpr, STARTS: tl.constexpr, HAS_W: tl.constexpr,
                                  NEED_DW: tl.constexpr, STAGES: tl.constexpr):
    """`_tma_rows` over two pieces."""
    _tma_rows((XD0, XD1), (DYD0, DYD1), (DXD0, DXD1), (), W, RSTD, DW, M, offset, N, ROWS, PIECES, STARTS, HAS_W,
              NEED_DW, STAGES, False)


# The residual add's backward (dh read and added to dx) has entry points of its own: the norm's keep
# their parameter lists (an unused descriptor is not passed).
@triton.jit
def rms_norm_bwd_tma_rows_dh_kernel(XD, DYD, DXD, DHD, W, RSTD, DW, M, offset, N, ROWS: tl.constexpr,
                                    PIECES: tl.constexpr, STARTS: tl.constexpr, HAS_W: tl.constexpr,
                                    NEED_DW: tl.constexpr, STAGES: tl.constexpr):
    """`_tma_rows` over one piece, dh added."""
    _tma_rows((XD,), (DYD,), (DXD,), (DHD,), W, RSTD, DW, M, offset, N, ROWS, PIECES, STARTS, HAS_W, NEED_DW,
              STAGES, True)


@triton.jit
def rms_norm_bwd_tma_rows2_dh_kernel(XD0, XD1, DYD0, DYD1, DXD0, DXD1, DHD0, DHD1, W, RSTD, DW, M, offset, N,
                                     ROWS: tl.constexpr, PIECES: tl.constexpr, STARTS: tl.constexpr,
                                     HAS_W: tl.constexpr, NEED_DW: tl.constexpr, STAGES: tl.constexpr):
    """`_tma_rows` over two pieces, dh added."""
    _tma_rows((XD0, XD1), (DYD0, DYD1), (DXD0, DXD1), (DHD0, DHD1), W, RSTD, DW, M, offset, N, ROWS, PIECES,
              STARTS, HAS_W, NEED_DW, STAGES, True)


# by count of pieces: the norm's, then with dh
TMA_ROWS_KERNELS = (rms_norm_bwd_tma_rows_kernel, rms_norm_bwd_tma_rows2_kernel)
TMA_ROWS_DH_KERNELS = (rms_norm_bwd_tma_rows_dh_kernel, rms_norm_bwd_tma_rows2_dh_kernel)


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
