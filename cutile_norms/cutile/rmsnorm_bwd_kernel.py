"""RMSNorm backward in cuTile: the persistent kernel (launch configs and their rule in
rmsnorm_bwd_config.py, the launch wrapper and the backend in rmsnorm_bwd.py).

The math, all in fp32 (w' = offset + w, xhat = x * rstd with rstd saved by the forward):
    g = dy * w'        dx = rstd * (g - xhat * mean(g * xhat)) [+ dh]        dw = sum over rows of dy * xhat

With HAS_DH (the residual add's backward: h = x + r feeds both this norm and later layers) the grad
h receives from those layers, dh, is read with the row and added to dx before it is rounded: the
grad into h in one pass (dy, x = h and dh read once, one grad written), where the norm's backward
then an add of dh move 6 M N e bytes instead of 4.

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
    262144 0.60 -> 0.80; docs/design.md).
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

import cuda.tile as ct

from .rmsnorm_fwd_config import row_pieces
from .tiles import gather_masked, scatter_masked

ConstInt = ct.Constant[int]
ConstBool = ct.Constant[bool]


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


def _load_part(mX, mDY, mDH, t, sx, sdy, sdh, c0, lim, X_ALIGN, DY_ALIGN, DH_ALIGN, MASK_N, PART, PIECE_MIN,
               LATENCY, HAS_DH):
    """Row t's x, dy (and dh with HAS_DH) over this block's part (columns c0 + [0, lim)), as tuples of
    its pieces."""
    xbase = ct.assume_divisible_by(t * sx + c0, X_ALIGN)
    dybase = ct.assume_divisible_by(t * sdy + c0, DY_ALIGN)
    dhbase = ct.assume_divisible_by(t * sdh + c0, DH_ALIGN)
    tX = ()
    tDY = ()
    tDH = ()
    for off, size in ct.static_iter(row_pieces(PART, PIECE_MIN)):
        masked = ct.static_eval(MASK_N or off + size > PART)
        tX += (gather_masked(mX, xbase, off, size, lim, masked, LATENCY),)
        tDY += (gather_masked(mDY, dybase, off, size, lim, masked, LATENCY),)
        if HAS_DH:
            tDH += (gather_masked(mDH, dhbase, off, size, lim, masked, LATENCY),)
    return tX, tDY, tDH


@ct.kernel
def rms_norm_bwd_kernel(
        mX, mDY, mDH, mW, mRstd, mDX, mDW, mDWp, mTicket, mSync,
        M: int, stride_x: int, stride_dy: int, stride_dh: int, offset: float, R: int, NRED: int,
        N: ConstInt, TILE_M: ConstInt, SPLIT: ConstInt, PART: ConstInt, PIECE_MIN: ConstInt,
        X_ALIGN: ConstInt, DY_ALIGN: ConstInt, DH_ALIGN: ConstInt, HAS_W: ConstBool, NEED_DX: ConstBool,
        NEED_DW: ConstBool, HAS_DH: ConstBool, RED_ROWS: ConstInt, RED_COLS: ConstInt, LATENCY: ConstInt,
        DX_2D: ConstBool, PREFETCH: ConstBool):
    """Block b owns column part s = b % SPLIT (PART columns from s * PART) of the row tiles
    r = b // SPLIT, r + R, ... (TILE_M rows each; SPLIT > 1 only with TILE_M == 1). The part is held
    in power-of-two pieces (`row_pieces`: 2880 = 2048 + 1024 with the last piece masked) so no
    column is padded to the next power of two. mDX is dx, rows of N, contiguous: flat, or with DX_2D
    2-D with its rows padded to a multiple of max(16, TILE_M), stored with ct.store at the loop's tile
    index (every piece's offset, s * PART included, a multiple of its size): cuTile then knows no two
    iterations write the same elements, where a ct.scatter in the loop had a block barrier before and
    after every store (sm_90 PTX, N = 4096). mDH (HAS_DH, NEED_DX): the grad from h's other uses,
    rows at stride_dh in x's dtype, read with x and dy and added to dx. mDW is dw [N]
    in the weight's dtype (fp32 for a launch over a row chunk, summed by the caller); mDWp holds the
    R fp32 partial rows of NPAD = SPLIT * PART columns; mTicket the two counters (0 between launches); mSync the int64 slots of the exchange (SPLIT > 1)."""
    sx = ct.assume_divisible_by(stride_x, X_ALIGN)
    sdy = ct.assume_divisible_by(stride_dy, DY_ALIGN)
    sdh = ct.assume_divisible_by(stride_dh, DH_ALIGN)
    ADD_DH = ct.static_eval(HAS_DH and NEED_DX)
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
        tPX, tPDY, tPDH = _load_part(mX, mDY, mDH, r, sx, sdy, sdh, c0, lim, X_ALIGN, DY_ALIGN, DH_ALIGN, MASK_N,
                                     PART, PIECE_MIN, LATENCY, ADD_DH)
        tPR = ct.gather(mRstd, r, check_bounds=False)
        tPS = ct.gather(mSync, r * SPLIT + s, check_bounds=False) if SPLIT > 1 else 0  # the row's slot
    else:
        tPX, tPDY, tPDH, tPR, tPS = (), (), (), 0.0, 0
    for t in range(r, ntiles, R):
        if TILE_M == 1:
            dxbase = t * N + c0
            if PREFETCH:
                # the next row's loads go out before this row's reduction, exchange and stores, so they
                # are in flight through all three (a block's last iteration re-reads the last row: an L2
                # hit, not a branch around the loads)
                tn = ct.minimum(t + R, ntiles - 1)
                tNX, tNDY, tNDH = _load_part(mX, mDY, mDH, tn, sx, sdy, sdh, c0, lim, X_ALIGN, DY_ALIGN, DH_ALIGN,
                                             MASK_N, PART, PIECE_MIN, LATENCY, ADD_DH)
                tNR = ct.gather(mRstd, tn, check_bounds=False)
                # the exchange slot's last value too, off the exchange's path (a load's round trip)
                tNS = ct.gather(mSync, tn * SPLIT + s, check_bounds=False) if SPLIT > 1 else 0
                tRX, tRDY, tRDH, rstd, slot = tPX, tPDY, tPDH, tPR, tPS
                tPX, tPDY, tPDH, tPR, tPS = tNX, tNDY, tNDH, tNR, tNS
            else:
                tRX, tRDY, tRDH = _load_part(mX, mDY, mDH, t, sx, sdy, sdh, c0, lim, X_ALIGN, DY_ALIGN, DH_ALIGN,
                                             MASK_N, PART, PIECE_MIN, LATENCY, ADD_DH)
                rstd = ct.gather(mRstd, t, check_bounds=False)
        else:
            rows = t * TILE_M + ct.arange(TILE_M, dtype=ct.int32)
            row_ok = ct.reshape(rows < M, (TILE_M, 1))
            xbase = ct.reshape(rows * sx, (TILE_M, 1))
            dybase = ct.reshape(rows * sdy, (TILE_M, 1))
            dhbase = ct.reshape(rows * sdh, (TILE_M, 1))
            dxbase = ct.reshape(rows * N, (TILE_M, 1))
            rstd = ct.reshape(ct.gather(mRstd, rows, mask=rows < M, check_bounds=False), (TILE_M, 1))
        tXh = ()
        tG = ()
        tDWn = ()
        tMDH = ()  # multi-row tiles: dh, loaded with x and dy
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
                if ADD_DH:
                    tMDH += (ct.gather(mDH, dhbase + rcols, mask=mask, check_bounds=False, latency=LATENCY),)
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
                gx = (tG[i] - tXh[i] * c) * rstd
                if ADD_DH:  # in fp32, rounded once with dx
                    if TILE_M == 1:
                        gx = gx + ct.astype(tRDH[i], ct.float32)
                    else:
                        gx = gx + ct.astype(tMDH[i], ct.float32)
                dx = ct.astype(gx, mDX.dtype)
                if DX_2D:  # at the loop's own tile index: no block barrier per store (see the docstring)
                    ct.store(mDX, (t, s * ct.static_eval(PART // size) + ct.static_eval(off // size)),
                             ct.reshape(dx, (TILE_M, size)), check_bounds=ct.static_eval(MASK_N or off + size > N),
                             allow_tma=False, latency=LATENCY)
                elif TILE_M == 1:
                    scatter_masked(mDX, dxbase, off, size, lim, ct.static_eval(MASK_N or off + size > PART), dx,
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
                scatter_masked(mDW, c0, off, size, lim, ct.static_eval(MASK_N or off + size > PART),
                                ct.astype(dw, mDW.dtype), 1)
                i += 1
        else:
            i = 0
            for off, size in ct.static_iter(row_pieces(PART, PIECE_MIN)):
                dw = tDW[i] if TILE_M == 1 else ct.sum(tDW[i], axis=0)
                scatter_masked(mDWp, r * NPAD + c0, off, size, PART, ct.static_eval(off + size > PART), dw, 1)
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
