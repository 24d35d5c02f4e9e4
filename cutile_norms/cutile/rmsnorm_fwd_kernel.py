"""RMSNorm forward in cuTile: the kernels and their compile-time helpers (launch configs in
rmsnorm_fwd_config.py, launch wrappers and the mode backends in rmsnorm_fwd.py).

Conventions shared by the kernels (names follow CuTe's: `mX` a global array, `tXrX` a tile):
  * x, y and rstd reach the kernel as flat 1-D arrays. A cuTile launch specialises every array dim on
    "divisible by 16" and "== 1", so a 2-D (M, N) x would compile again when M changes parity class;
    the flat length (M-1)*stride + N is divisible by 16 for every M when N and the stride are (y is
    allocated with its length rounded up to 16, rstd with its rows rounded up to 16).
  * N is a compile-time constant; M, the row stride, eps and offset are runtime scalars. The compiled
    kernel cache is keyed by (dtypes, N, config) with M symbolic.
  * Rows are read with `ct.gather` over `arange` column indices: it lowers to 16-byte `ld.global.v4`
    per thread. A tiled `ct.load` from a per-row `Array.slice` lowers to TMA with a tensor map rebuilt
    in every block (seen in the sm_90 PTX), which is why the whole-row `ct.load` measured 0.53x copy.
  * A row is split in power-of-two pieces (`row_pieces`): a row of 2880 is 2048 + 1024 (the last
    piece masked past N) instead of one 4096 tile that leaves 30 % of the threads idle.
"""
from __future__ import annotations

import cuda.tile as ct

from .rmsnorm_fwd_config import row_pieces
from .tiles import (gather_masked, scatter_masked, gather_cols, scatter_cols, gather_rows, scatter_rows,
                    gather_w_bits, w_from_bits, gather_w, tied_elementwise, w_tied_to_x, zero_of,
                    gather_w_tied, weight_piece_bits, weight_piece, widen_again, runtime_zero, split_block,
                    slot_sign, publish_ssq, split_rstd)

ConstInt = ct.Constant[int]
ConstBool = ct.Constant[bool]

# ================================================================================================
# Compile-time helpers (evaluated by ct.static_iter inside the kernels)
# ================================================================================================
def _chunks(n: int, chunk: int) -> int:
    return -(-n // chunk)


# ================================================================================================
# Kernels
# ================================================================================================
def _cached_tile(mX, mW, mY, mRstd, tile, M, stride, eps, offset, tWrW,
                 N, TILE_M, PIECE_MIN, X_ALIGN, HAS_W, STORE_RSTD, HOIST_W, LATENCY, PACKED, W_PLANES, W_EARLY):
    """One row tile of the cached kernel (inlined; called once or from the persistent loop).
    W_EARLY here is the tie as applied (W_TIED of the kernel)."""
    if TILE_M == 1:
        xbase = ct.assume_divisible_by(tile * stride, X_ALIGN)
        ybase = tile * N
        tXrX = ()
        tWbits = ()
        ssq = 0.0
        for off, size in ct.static_iter(row_pieces(N, PIECE_MIN)):
            x = gather_cols(mX, xbase, off, size, N, LATENCY)
            xs = x
            if HAS_W and W_EARLY and not HOIST_W:  # the weight's loads go out with x's (its bits feed the sum)
                cols = ct.arange(size, dtype=ct.int32) + off
                wbits, xs = gather_w_tied(mW, x, cols, cols < N if ct.static_eval(off + size > N) else None, M,
                                           LATENCY, W_PLANES)
                tWbits += (wbits,)
            xf = ct.astype(xs, ct.float32)
            if HAS_W and W_EARLY and HOIST_W:  # the held bits, tied to this tile's x
                tWbits += (w_tied_to_x(tWrW[len(tWbits)], xf, M),)
            ssq = ssq + ct.sum(xf * xf)
            tXrX += (x if PACKED else xf,)
        rstd = ct.rsqrt(ssq * ct.static_eval(1.0 / N) + eps)
        if STORE_RSTD:
            ct.scatter(mRstd, tile, rstd, check_bounds=False)
        i = 0
        for off, size in ct.static_iter(row_pieces(N, PIECE_MIN)):
            y = (widen_again(tXrX[i], runtime_zero(M, ct.uint16)) if PACKED else tXrX[i]) * rstd
            if HAS_W:
                y = _times_weight(y, mW, i, off, size, offset, tWrW, tWbits, N, TILE_M, HOIST_W, LATENCY, W_PLANES,
                                 W_EARLY)
            scatter_cols(mY, ybase, off, size, N, ct.astype(y, mY.dtype), LATENCY)
            i += 1
    else:
        rows = tile * TILE_M + ct.arange(TILE_M, dtype=ct.int32)
        row_ok = ct.reshape(rows < M, (TILE_M, 1))
        xbase = ct.reshape(rows * stride, (TILE_M, 1))
        ybase = ct.reshape(rows * N, (TILE_M, 1))
        tXrX = ()
        tWbits = ()
        ssq = ct.zeros((TILE_M, 1), dtype=ct.float32)
        for off, size in ct.static_iter(row_pieces(N, PIECE_MIN)):
            # ties on x in fp32: with an fp32 weight and 16-bit x, a tie on the loaded 16-bit x
            # converted between the two load layouts through shared memory in every tile (SASS)
            x = ct.astype(gather_rows(mX, xbase, row_ok, off, size, N, LATENCY), ct.float32)
            if HAS_W and W_EARLY:
                if HOIST_W:  # the held bits, tied to this tile's x
                    tWbits += (w_tied_to_x(tWrW[len(tWbits)], x, M),)
                else:  # the weight's loads go out with x's (its bits feed the sum)
                    wbits = weight_piece_bits(mW, off, size, N, TILE_M, LATENCY, W_PLANES)
                    x = tied_elementwise(x, wbits, M)
                    tWbits += (wbits,)
            ssq = ssq + ct.sum(x * x, axis=1, keepdims=True)
            tXrX += (x,)
        rstd = ct.rsqrt(ssq * ct.static_eval(1.0 / N) + eps)
        if STORE_RSTD:
            ct.scatter(mRstd, rows, ct.reshape(rstd, (TILE_M,)), mask=rows < M, check_bounds=False)
        i = 0
        for off, size in ct.static_iter(row_pieces(N, PIECE_MIN)):
            y = tXrX[i] * rstd
            if HAS_W:
                y = _times_weight(y, mW, i, off, size, offset, tWrW, tWbits, N, TILE_M, HOIST_W, LATENCY, W_PLANES,
                                 W_EARLY)
            scatter_rows(mY, ybase, row_ok, off, size, N, ct.astype(y, mY.dtype), LATENCY)
            i += 1


def _times_weight(y, mW, i, off, size, offset, tWrW, tWbits, N, TILE_M, HOIST_W, LATENCY, W_PLANES, W_EARLY):
    """y times piece i of the weight (+ offset), for the cached kernel's stores: from its bits loaded
    with x (W_EARLY), held across the persistent loop (HOIST_W), or loaded now (inlined)."""
    if W_EARLY:
        w = w_from_bits(tWbits[i], W_PLANES) + offset
    else:
        w = tWrW[i] if HOIST_W else weight_piece(mW, off, size, N, offset, TILE_M, LATENCY, W_PLANES)
    return y * w


def _hoisted_weight(mW, offset, N, PIECE_MIN, TILE_M, LATENCY, W_PLANES, TIED, ROW_TILES):
    """The weight held across a persistent loop (HOIST_W), one entry per piece of the row: an fp32
    tile (+ offset), or (TIED) its bits as loaded, which the tile multiplies in with w_from_bits;
    ROW_TILES: each a (1, size) tile, as the stream kernel's rows are (inlined)."""
    tWrW = ()
    for off, size in ct.static_iter(row_pieces(N, PIECE_MIN)):
        if TIED:
            tWrW += (weight_piece_bits(mW, off, size, N, TILE_M, LATENCY, W_PLANES),)
        elif ROW_TILES:
            tWrW += (ct.reshape(weight_piece(mW, off, size, N, offset, TILE_M, LATENCY, W_PLANES), (1, size)),)
        else:
            tWrW += (weight_piece(mW, off, size, N, offset, TILE_M, LATENCY, W_PLANES),)
    return tWrW


@ct.kernel
def rms_norm_fwd_cached_kernel(
        mX, mW, mY, mRstd,
        M: int, stride_x: int, eps: float, offset: float,
        N: ConstInt, TILE_M: ConstInt, PIECE_MIN: ConstInt, X_ALIGN: ConstInt,
        HAS_W: ConstBool, STORE_RSTD: ConstBool, PERSISTENT: ConstBool, HOIST_W: ConstBool, LATENCY: ConstInt,
        PACKED: ConstBool, W_PLANES: ConstInt, W_EARLY: ConstBool):
    """Each tile block owns TILE_M rows, loads them once (the pieces stay on chip), reduces in fp32
    and stores y (and rstd). PERSISTENT: a grid of about one wave loops over the row tiles; HOIST_W
    keeps the weight in registers across that loop (narrow rows only). TILE_M == 1 takes 1-D tiles
    with no row mask (a row index below the tile count is always valid): the (1, size) tiles with a
    per-element row mask held 168 registers at N=16384 (8 warps) where 1-D tiles need ~90 (ptxas).
    The multi-wave path runs its tile once, outside any loop: a dynamic loop around the same body
    raised it from 88 to 168 registers (ptxas, N=16384, 8 warps)."""
    stride = ct.assume_divisible_by(stride_x, X_ALIGN)
    # W_EARLY as applied. Multi-row tiles and a weight held across the loop tie element by element,
    # not worth it for a weight of another width than x's passed as is (no planes): the tie joins
    # tiles of two load layouts, converted through shared memory in every tile (an fp32 weight with
    # 16-bit x, N = 1024: 100 shared-memory accesses where 36 without it, 256 threads, 114 registers;
    # SASS), so such a weight keeps its late loads. Inline: a helper's returned static_eval is a
    # runtime value to cuTile, and its `if`s then compiled both ways (one bar.sync more in the PTX).
    W_TIED = ct.static_eval(W_EARLY and (TILE_M == 1 and not HOIST_W or W_PLANES > 0
                                         or mW.dtype.bitwidth == mX.dtype.bitwidth))

    tWrW = ()
    if HAS_W and HOIST_W:
        tWrW = _hoisted_weight(mW, offset, N, PIECE_MIN, TILE_M, LATENCY, W_PLANES, W_TIED, False)

    if PERSISTENT:
        for tile in range(ct.bid(0), ct.cdiv(M, TILE_M), ct.num_blocks(0)):
            _cached_tile(mX, mW, mY, mRstd, tile, M, stride, eps, offset, tWrW,
                         N, TILE_M, PIECE_MIN, X_ALIGN, HAS_W, STORE_RSTD, HOIST_W, LATENCY, PACKED, W_PLANES, W_TIED)
    else:
        _cached_tile(mX, mW, mY, mRstd, ct.bid(0), M, stride, eps, offset, tWrW,
                     N, TILE_M, PIECE_MIN, X_ALIGN, HAS_W, STORE_RSTD, HOIST_W, LATENCY, PACKED, W_PLANES, W_TIED)


def _reload_store_tail(mX, mW, mY, xbase, ybase, cols, rstd, offset, N, HAS_W, LATENCY, W_PLANES):
    """The reload kernel's second pass over its partial last chunk (columns `cols`, masked at N)."""
    ok = cols < N
    y = ct.astype(ct.gather(mX, xbase + cols, mask=ok, check_bounds=False, latency=LATENCY), ct.float32) * rstd
    if HAS_W:
        y = y * (gather_w(mW, cols, ok, LATENCY, W_PLANES) + offset)
    ct.scatter(mY, ybase + cols, ct.astype(y, mY.dtype), mask=ok, check_bounds=False, latency=LATENCY)


def _reload_tile(mX, mW, mY, mRstd, tile, M, stride, eps, offset,
                 N, TILE_M, CHUNK, HAS_W, STORE_RSTD, REVERSE, LATENCY, X_ALIGN, W_PLANES):
    """One row tile of the two-pass kernel (inlined; called once or from the persistent loop)."""
    num_chunks = ct.static_eval(_chunks(N, CHUNK))
    if TILE_M == 1:
        # the full chunks unmasked in a loop, the partial last one (N % CHUNK columns) masked outside
        # it: with the mask inside the loop the compiler ran for minutes at N = 262145 and 131073
        # with 2048-column chunks (docs/design.md)
        full = ct.static_eval(N // CHUNK)
        TAIL = ct.static_eval(N % CHUNK != 0)
        xbase = ct.assume_divisible_by(tile * stride, X_ALIGN)
        ybase = tile * N
        cols0 = ct.arange(CHUNK, dtype=ct.int32)
        tcols = cols0 + full * CHUNK
        acc = ct.zeros((CHUNK,), dtype=ct.float32)
        for c in range(full):
            cols = cols0 + c * CHUNK
            x = ct.astype(ct.gather(mX, xbase + cols, check_bounds=False, latency=LATENCY), ct.float32)
            acc = acc + x * x
        if TAIL:
            xt = ct.astype(ct.gather(mX, xbase + tcols, mask=tcols < N, check_bounds=False, latency=LATENCY),
                           ct.float32)
            acc = acc + xt * xt
        rstd = ct.rsqrt(ct.sum(acc) * ct.static_eval(1.0 / N) + eps)
        if STORE_RSTD:
            ct.scatter(mRstd, tile, rstd, check_bounds=False)
        if TAIL and REVERSE:  # the most recently read chunk first
            _reload_store_tail(mX, mW, mY, xbase, ybase, tcols, rstd, offset, N, HAS_W, LATENCY, W_PLANES)
        for i in range(full):
            c = full - 1 - i if REVERSE else i
            cols = cols0 + c * CHUNK
            y = ct.astype(ct.gather(mX, xbase + cols, check_bounds=False, latency=LATENCY), ct.float32) * rstd
            if HAS_W:
                y = y * (gather_w(mW, cols, None, LATENCY, W_PLANES) + offset)
            ct.scatter(mY, ybase + cols, ct.astype(y, mY.dtype), check_bounds=False, latency=LATENCY)
        if TAIL and not REVERSE:
            _reload_store_tail(mX, mW, mY, xbase, ybase, tcols, rstd, offset, N, HAS_W, LATENCY, W_PLANES)
    else:
        rows = tile * TILE_M + ct.arange(TILE_M, dtype=ct.int32)
        row_ok = ct.reshape(rows < M, (TILE_M, 1))
        xbase = ct.reshape(rows * stride, (TILE_M, 1))
        ybase = ct.reshape(rows * N, (TILE_M, 1))
        cols0 = ct.reshape(ct.arange(CHUNK, dtype=ct.int32), (1, CHUNK))
        acc = ct.zeros((TILE_M, CHUNK), dtype=ct.float32)
        for c in range(num_chunks):
            cols = cols0 + c * CHUNK
            x = ct.astype(ct.gather(mX, xbase + cols, mask=row_ok & (cols < N), check_bounds=False,
                                    latency=LATENCY), ct.float32)
            acc = acc + x * x
        rstd = ct.rsqrt(ct.sum(acc, axis=1, keepdims=True) * ct.static_eval(1.0 / N) + eps)
        if STORE_RSTD:
            ct.scatter(mRstd, rows, ct.reshape(rstd, (TILE_M,)), mask=rows < M, check_bounds=False)
        for i in range(num_chunks):
            c = num_chunks - 1 - i if REVERSE else i
            cols = cols0 + c * CHUNK
            mask = row_ok & (cols < N)
            y = ct.astype(ct.gather(mX, xbase + cols, mask=mask, check_bounds=False, latency=LATENCY),
                          ct.float32) * rstd
            if HAS_W:  # gathered in the x tile's layout (see weight_piece)
                wcols = cols + ct.zeros((TILE_M, 1), dtype=ct.int32)
                y = y * (gather_w(mW, wcols, wcols < N, LATENCY, W_PLANES) + offset)
            ct.scatter(mY, ybase + cols, ct.astype(y, mY.dtype), mask=mask, check_bounds=False,
                       latency=LATENCY)


@ct.kernel
def rms_norm_fwd_reload_kernel(
        mX, mW, mY, mRstd,
        M: int, stride_x: int, eps: float, offset: float,
        N: ConstInt, TILE_M: ConstInt, CHUNK: ConstInt, REVERSE: ConstBool, X_ALIGN: ConstInt,
        HAS_W: ConstBool, STORE_RSTD: ConstBool, PERSISTENT: ConstBool, LATENCY: ConstInt, W_PLANES: ConstInt):
    """Two passes over CHUNK-wide column chunks of TILE_M rows: the sum of squares, then a re-read
    that normalises and stores. Only one chunk is held on chip, so any N fits; the re-read of a row
    that was just streamed hits L2 as long as the rows in flight fit in it (ncu at N=65536: 1.02x the
    ideal DRAM reads with one CTA per SM, 1.7-1.8x with three to five). REVERSE walks the second pass
    backwards, most recently read chunks first. LATENCY >= 3 makes the compiler pipeline the chunk
    loops through shared memory (cp.async). TILE_M == 1 takes 1-D tiles with no row mask."""
    stride = ct.assume_divisible_by(stride_x, X_ALIGN)
    if PERSISTENT:
        for tile in range(ct.bid(0), ct.cdiv(M, TILE_M), ct.num_blocks(0)):
            _reload_tile(mX, mW, mY, mRstd, tile, M, stride, eps, offset,
                         N, TILE_M, CHUNK, HAS_W, STORE_RSTD, REVERSE, LATENCY, X_ALIGN, W_PLANES)
    else:
        _reload_tile(mX, mW, mY, mRstd, ct.bid(0), M, stride, eps, offset,
                     N, TILE_M, CHUNK, HAS_W, STORE_RSTD, REVERSE, LATENCY, X_ALIGN, W_PLANES)


@ct.kernel
def rms_norm_fwd_split_kernel(
        mX, mW, mY, mRstd, mSync,
        M: int, stride_x: int, eps: float, offset: float,
        N: ConstInt, SPLIT: ConstInt, PART: ConstInt, PIECE_MIN: ConstInt, X_ALIGN: ConstInt,
        HAS_W: ConstBool, STORE_RSTD: ConstBool, LATENCY: ConstInt, PACKED: ConstBool, W_PLANES: ConstInt,
        W_EARLY: ConstBool, TIE_SLOT: ConstBool):
    """A row too long for one block's registers, split over SPLIT blocks that each keep PART columns
    on chip: the row is read once, like the cached kernel, and the blocks of a row exchange their
    partial sums of squares through global memory (a software cluster).

    Block b owns part b % SPLIT of row b // SPLIT and slot b of mSync (int32, kept between launches
    on the same stream, all 0 when allocated). A slot holds the fp32 bits of a partial sum of squares
    (never negative: the sign bit is free) with the sign bit set by every other launch: a block reads
    its own slot's sign first (what the last launch over this row wrote), publishes its sum with the
    other sign, and waits until every slot of its row shows that sign. The workspace thus needs no
    clearing between launches (a fill kernel per launch cost ~1.5 %: docs/design.md), and the
    state lives on the device, so a replayed CUDA graph flips it like an eager launch does.

    The wait relies on the blocks of a row running at the same time: the hardware dispatches blocks
    in index order (as CUB's decoupled look-back scan also assumes), so a row's blocks are
    dispatched together, and at most one row's blocks wait on blocks not yet dispatched, which start
    as soon as any other block ends (the GPU holds far more than SPLIT blocks). A bounded wait with
    a fallback that reads the row again was tried: the fallback decision must be the same in every
    warp, which took a block-wide poll and cost 2-3 % (docs/design.md).
    """
    stride = ct.assume_divisible_by(stride_x, X_ALIGN)
    bid, row, part, c0, lim = split_block(SPLIT, PART, N)
    xbase = ct.assume_divisible_by(row * stride + c0, X_ALIGN)
    ybase = ct.assume_divisible_by(row * N + c0, X_ALIGN)
    MASK_N = ct.static_eval(SPLIT * PART != N)
    slot, sign = slot_sign(mSync, bid)
    tXrX = ()
    tWrW = ()
    ssq = 0.0
    for off, size in ct.static_iter(row_pieces(PART, PIECE_MIN)):
        masked = ct.static_eval(MASK_N or off + size > PART)
        x = gather_masked(mX, xbase, off, size, lim, masked, LATENCY)
        xs = x
        if HAS_W and W_EARLY:  # the weight's loads go out with x's (its bits feed the sum: always + 0)
            cols = ct.arange(size, dtype=ct.int32) + off
            wbits, xs = gather_w_tied(mW, x, c0 + cols, cols < lim if masked else None, M, LATENCY, W_PLANES)
            tWrW += (wbits,)
        xf = ct.astype(xs, ct.float32)
        if ct.static_eval(TIE_SLOT and off == 0):  # the slot's load goes out with x's (its bits feed the sum)
            ssq = ssq + ct.sum(xf * xf + zero_of(slot, M))
        else:
            ssq = ssq + ct.sum(xf * xf)
        tXrX += (x,)
    publish_ssq(mSync, bid, ssq, sign)

    for off, size in ct.static_iter(row_pieces(PART, PIECE_MIN)):
        if HAS_W and not W_EARLY:  # issued here, the compiler sinks them to their use after the wait
            masked = ct.static_eval(MASK_N or off + size > PART)
            cols = ct.arange(size, dtype=ct.int32) + off
            tWrW += (gather_w_bits(mW, c0 + cols, cols < lim if masked else None, LATENCY, W_PLANES),)

    rstd = split_rstd(mSync, mRstd, row, part, sign, eps, SPLIT, N, STORE_RSTD)  # waits for the row's other blocks
    i = 0
    for off, size in ct.static_iter(row_pieces(PART, PIECE_MIN)):
        y = (widen_again(tXrX[i], runtime_zero(M, ct.uint16)) if PACKED else ct.astype(tXrX[i], ct.float32)) * rstd
        if HAS_W:
            y = y * (w_from_bits(tWrW[i], W_PLANES) + offset)
        masked = ct.static_eval(MASK_N or off + size > PART)
        scatter_masked(mY, ybase, off, size, lim, masked, ct.astype(y, mY.dtype), LATENCY)
        i += 1


def _stream_load(mX, tile, M, stride, N, TILE_M, PIECE_MIN, X_ALIGN, LATENCY):
    """The x pieces of row tile `tile` as (TILE_M, size) tiles in x's dtype (rows past M masked)."""
    if TILE_M == 1:  # a tile index below the tile count is a valid row: no row mask
        xbase = ct.assume_divisible_by(tile * stride, X_ALIGN)
        row_ok = None
    else:
        rows = tile * TILE_M + ct.arange(TILE_M, dtype=ct.int32)
        xbase = ct.reshape(rows * stride, (TILE_M, 1))
        row_ok = ct.reshape(rows < M, (TILE_M, 1))
    tXrX = ()
    for off, size in ct.static_iter(row_pieces(N, PIECE_MIN)):
        cols = ct.reshape(ct.arange(size, dtype=ct.int32) + off, (1, size))
        if ct.static_eval(TILE_M == 1 and off + size <= N):
            tXrX += (ct.gather(mX, xbase + cols, check_bounds=False, latency=LATENCY),)
        else:
            if ct.static_eval(TILE_M == 1):
                mask = cols < N
            else:
                mask = row_ok & (cols < N) if ct.static_eval(off + size > N) else row_ok
            tXrX += (ct.gather(mX, xbase + cols, mask=mask, check_bounds=False, latency=LATENCY),)
    return tXrX


def _stream_finish(mW, mY, mRstd, tile, M, tXrX, tWrW, eps, offset, N, TILE_M, PIECE_MIN, HAS_W, STORE_RSTD,
                   HOIST_W, LATENCY, PACKED, W_PLANES):
    """Reduce, normalise and store one row tile of the stream kernel. y and rstd are stored with
    ct.store at the loop's own index: cuTile then knows two iterations never write the same
    elements and needs no block barrier between them (a ct.scatter in a loop gets a bar.sync after
    each store: sm_90 PTX)."""
    ssq = ct.zeros((TILE_M, 1), dtype=ct.float32)
    i = 0
    for off, size in ct.static_iter(row_pieces(N, PIECE_MIN)):
        xf = ct.astype(tXrX[i], ct.float32)
        ssq = ssq + ct.sum(xf * xf, axis=1, keepdims=True)
        i += 1
    rstd = ct.rsqrt(ssq * ct.static_eval(1.0 / N) + eps)
    if STORE_RSTD:
        ct.store(mRstd, (tile,), ct.reshape(rstd, (TILE_M,)), check_bounds=False, allow_tma=False)
    i = 0
    for off, size in ct.static_iter(row_pieces(N, PIECE_MIN)):
        y = (widen_again(tXrX[i], runtime_zero(M, ct.uint16)) if PACKED else ct.astype(tXrX[i], ct.float32)) * rstd
        if HAS_W:
            if HOIST_W:
                y = y * tWrW[i]
            else:  # read again per tile (an L2 hit): min(tile, M) - tile is 0, but not to the compiler, whose
                # loop-invariant code motion would otherwise hoist the load and hold the weight in fp32
                wbase = ct.assume_divisible_by(ct.minimum(tile, M) - tile, 16)
                w = weight_piece(mW, off, size, N, offset, TILE_M, LATENCY, W_PLANES, wbase)
                y = y * (ct.reshape(w, (1, size)) if TILE_M == 1 else w)
        ct.store(mY, (tile, ct.static_eval(off // size)), ct.astype(y, mY.dtype),
                 check_bounds=ct.static_eval(off + size > N), allow_tma=False, latency=LATENCY)
        i += 1


@ct.kernel
def rms_norm_fwd_stream_kernel(
        mX, mW, mY, mRstd, M: int, stride_x: int, eps: float, offset: float,
        N: ConstInt, TILE_M: ConstInt, PIECE_MIN: ConstInt, X_ALIGN: ConstInt,
        HAS_W: ConstBool, STORE_RSTD: ConstBool, HOIST_W: ConstBool, LATENCY: ConstInt, PACKED: ConstBool,
        W_PLANES: ConstInt):
    """A persistent grid that streams: each block loads the next row tile it owns before it reduces
    and stores the current one, so its loads stay in flight while it computes (the software
    pipeline the cached kernel's loop leaves to other blocks). HOIST_W: the weight (+ offset) is loaded
    once per block and held in fp32; else it is read again for every tile (from L2), which holds
    fewer registers for wide rows.

    mY is 2-D (rows padded to a multiple of max(16, TILE_M), N) and mRstd 1-D (rows padded the same
    way): a tile's stores never need a bounds check on rows, and padded rows take the zeros of the
    masked loads. Needs a grid no larger than the tile count (every block owns at least one tile)."""
    stride = ct.assume_divisible_by(stride_x, X_ALIGN)
    bid = ct.bid(0)
    step = ct.num_blocks(0)
    tiles = ct.cdiv(M, TILE_M)
    tWrW = ()
    if HAS_W and HOIST_W:
        tWrW = _hoisted_weight(mW, offset, N, PIECE_MIN, 1, LATENCY, W_PLANES, False, True)
    tXrX = _stream_load(mX, bid, M, stride, N, TILE_M, PIECE_MIN, X_ALIGN, LATENCY)
    for tile in range(bid, tiles - step, step):  # every tile of this block but its last: the next one exists
        tXrX_next = _stream_load(mX, tile + step, M, stride, N, TILE_M, PIECE_MIN, X_ALIGN, LATENCY)
        _stream_finish(mW, mY, mRstd, tile, M, tXrX, tWrW, eps, offset, N, TILE_M, PIECE_MIN, HAS_W, STORE_RSTD,
                       HOIST_W, LATENCY, PACKED, W_PLANES)
        tXrX = tXrX_next
    last = bid + (tiles - 1 - bid) // step * step
    _stream_finish(mW, mY, mRstd, last, M, tXrX, tWrW, eps, offset, N, TILE_M, PIECE_MIN, HAS_W, STORE_RSTD,
                   HOIST_W, LATENCY, PACKED, W_PLANES)
