"""RMSNorm forward in cuTile: the kernels, their launch configs and heuristics, and the launch wrappers.

Layout (TileGym's order): kernels -> launch configs (frozen dataclasses) -> heuristics -> compile-time
signatures (for the CI compile checks) -> launch wrappers -> the three mode backends.

Conventions shared by both kernels (names follow CuTe's: `mX` a global array, `tXrX` a tile):
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

import functools
import json
import math
import os
from dataclasses import dataclass

import cuda.tile as ct
import torch

from .._platform import DeviceInfo, table_arch
from .._workspace import workspace

ConstInt = ct.Constant[int]
ConstBool = ct.Constant[bool]


# ================================================================================================
# Compile-time helpers (evaluated by ct.static_iter inside the kernels)
# ================================================================================================
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


def _chunks(n: int, chunk: int) -> int:
    return -(-n // chunk)


# ================================================================================================
# Kernels
# ================================================================================================
def _gather_masked(mA, base, off, size, lim, MASKED, latency):
    """A (size,) tile of columns [off, off + size) at flat offset `base`; if MASKED, only columns
    below `lim` (a constant, or dynamic for the split kernel's last part)."""
    cols = ct.arange(size, dtype=ct.int32) + off
    if MASKED:
        return ct.gather(mA, base + cols, mask=cols < lim, check_bounds=False, latency=latency)
    return ct.gather(mA, base + cols, check_bounds=False, latency=latency)


def _scatter_masked(mA, base, off, size, lim, MASKED, tile, latency):
    cols = ct.arange(size, dtype=ct.int32) + off
    if MASKED:
        ct.scatter(mA, base + cols, tile, mask=cols < lim, check_bounds=False, latency=latency)
    else:
        ct.scatter(mA, base + cols, tile, check_bounds=False, latency=latency)


def _gather_cols(mA, base, off, size, N, latency):
    """A (size,) tile of columns [off, off + size) of a row of N at flat offset `base`; masked only past N."""
    return _gather_masked(mA, base, off, size, N, ct.static_eval(off + size > N), latency)


def _scatter_cols(mA, base, off, size, N, tile, latency):
    _scatter_masked(mA, base, off, size, N, ct.static_eval(off + size > N), tile, latency)


def _gather_rows(mA, xbase, row_ok, off, size, N, latency):
    """A (TILE_M, size) tile: rows at flat offsets xbase (TILE_M, 1), masked by row_ok and past N."""
    cols = ct.reshape(ct.arange(size, dtype=ct.int32) + off, (1, size))
    mask = row_ok & (cols < N) if ct.static_eval(off + size > N) else row_ok
    return ct.gather(mA, xbase + cols, mask=mask, check_bounds=False, latency=latency)


def _scatter_rows(mA, ybase, row_ok, off, size, N, tile, latency):
    cols = ct.reshape(ct.arange(size, dtype=ct.int32) + off, (1, size))
    mask = row_ok & (cols < N) if ct.static_eval(off + size > N) else row_ok
    ct.scatter(mA, ybase + cols, tile, mask=mask, check_bounds=False, latency=latency)


def _gather_w_bits(mW, idx, mask, LATENCY, W_PLANES):
    """The weight at flat indices `idx` as loaded (0 where `mask` is False): a 1-tuple, or with
    W_PLANES > 0 the (low, high) int16 planes of a float32 weight (`weight_planes`)."""
    if W_PLANES == 0:
        return (ct.gather(mW, idx, mask=mask, check_bounds=False, latency=LATENCY),)
    return (ct.gather(mW, idx, mask=mask, check_bounds=False, latency=LATENCY),
            ct.gather(mW, idx + W_PLANES, mask=mask, check_bounds=False, latency=LATENCY))


def _w_from_bits(wbits, W_PLANES):
    """The fp32 weight from what `_gather_w_bits` loaded: the planes are joined exactly by a shift and an or."""
    if W_PLANES == 0:
        return ct.astype(wbits[0], ct.float32)
    lo = ct.astype(ct.bitcast(wbits[0], ct.uint16), ct.uint32)
    hi = ct.astype(ct.bitcast(wbits[1], ct.uint16), ct.uint32)
    return ct.bitcast((hi << 16) | lo, ct.float32)


def _gather_w(mW, idx, mask, LATENCY, W_PLANES):
    """The weight at flat indices `idx` in fp32 (0 where `mask` is False). W_PLANES > 0: a float32
    weight passed as two int16 planes, the low halves of its bits at [0, N) and the high halves at
    [W_PLANES, W_PLANES + N) (`weight_planes`): they load in the layout of a 16-bit x tile, where an
    fp32 gather next to 16-bit x is converted between layouts through shared memory (24 shared
    stores and ~20 barriers in the split kernel's PTX; 0.64x copy at N = 65536: bench/NOTES.md item 15)."""
    return _w_from_bits(_gather_w_bits(mW, idx, mask, LATENCY, W_PLANES), W_PLANES)


def _uint_of(dtype):
    return ct.uint32 if ct.static_eval(dtype == ct.float32 or dtype == ct.int32) else ct.uint16


def _tied_elementwise(a, bits, M):
    """a unchanged, computed as a | (b & 0) element by element for every tile b of `bits` (same
    shape as a, any width), with a 0 the compiler cannot fold: a value that depends on each b."""
    ua = _uint_of(a.dtype)
    t = ct.astype(ct.bitcast(bits[0], _uint_of(bits[0].dtype)), ua)
    if ct.static_eval(len(bits) > 1):  # the high plane of a float32 weight (`weight_planes`)
        t = t | ct.astype(ct.bitcast(bits[1], _uint_of(bits[1].dtype)), ua)
    return ct.bitcast(ct.bitcast(a, ua) | (t & _runtime_zero(M, ua)), a.dtype)


def _w_tied_to_x(wbits, x, M):
    """The weight's bits as loaded (`_gather_w_bits`), each plane tied to this tile's x
    (`_tied_elementwise`): a hoisted weight's conversion then waits for x, so it is done per tile
    after x's loads went out. Converted before a persistent loop, it stalled on the weight's DRAM
    round trip ahead of the first tile's x loads: two serial round trips per block (sm_90 SASS,
    N = 1024, 4-row tiles), all of a small launch's time (bench/NOTES.md item 17)."""
    if ct.static_eval(len(wbits) == 1):
        return (_tied_elementwise(wbits[0], (x,), M),)
    return (_tied_elementwise(wbits[0], (x,), M), _tied_elementwise(wbits[1], (x,), M))


def _tied_to_weight(x, wbits, M, W_PLANES):
    """x unchanged, computed as x | (w & 0) on the bits, with a 0 the compiler cannot fold: a value
    that depends on the weight's loads. tileiras sinks a load to its first use whatever the source
    order, and under a tight register budget ptxas leaves the weight's loads after the reduction
    (cached) or the wait for the row's partial sums (split), interleaved with the stores (SASS).
    Tied to the sum of squares, they go out with x's. Measured on the H200: at full size a tie with
    the late loads, which the other resident blocks hide (bench/NOTES.md item 16); in a launch with
    fewer blocks than SMs one DRAM round trip less (N = 4096 bf16, M = 1: 5.4 -> 5.1 us; item 17).
    The bits are taken 32 at a time (pack_to_bytes / unpack_from_bytes): per 16-bit element the
    compiler split the loaded registers into halves that then stayed live across the wait (167
    registers where 32-bit words need 80, split 8 at 6 CTAs/SM)."""
    # element by element: a weight of another width than x's, or a piece whose bits are no whole
    # number of 32-bit words (the one-column last piece of N = 2^k + 1 in 16 bits)
    if ct.static_eval(W_PLANES == 0 and wbits[0].dtype.bitwidth != x.dtype.bitwidth
                      or x.shape[-1] * x.dtype.bitwidth % 32 != 0):
        return _tied_elementwise(x, wbits, M)
    zero = _runtime_zero(M, ct.uint32)
    t = ct.unpack_from_bytes(ct.pack_to_bytes(wbits[0]), ct.uint32)
    if W_PLANES > 0:
        t = t | ct.unpack_from_bytes(ct.pack_to_bytes(wbits[1]), ct.uint32)
    xb = ct.unpack_from_bytes(ct.pack_to_bytes(x), ct.uint32)
    return ct.unpack_from_bytes(ct.pack_to_bytes(xb | (t & zero)), x.dtype)


def _zero_of(s, M):
    """+0.0 in fp32 made of the scalar s's bits (s & 0, a 0 the compiler cannot fold): the split
    kernel's `tie_slot`, added to the first piece's squares, which then need the slot's load.
    Untied, ptxas issues the load of the block's workspace slot (whose sign the exchange needs)
    after x's sum of squares in every table config but one (sm_90 SASS): a DRAM round trip in series
    (the workspace is cold after an L2 flush) between the reduction and the exchange, in every
    block's life. Tied, it goes out with x's loads. Measured on the H200 (bench/NOTES.md items 19,
    20): fp32 +0.4 to +1.6 %, bf16 32768 +0.4 / +0.5 %. The first tie ORed the slot's bits into x's
    32-bit words: x and its tied copy were then both live (3-5 registers more in 16-bit, a CTA per
    SM lost at bf16 65536, 4 of 16 loads deferred at bf16 32768, -3.5 %). The squares are a
    temporary: at bf16 32768 this tie keeps 80 registers and all 16 loads first (SASS)."""
    return ct.bitcast(ct.bitcast(s, ct.uint32) & _runtime_zero(M, ct.uint32), ct.float32)


def _gather_w_tied(mW, x, idx, mask, M, LATENCY, W_PLANES):
    """w_early: the weight at `idx` as loaded (`_gather_w_bits`) and x tied to it (`_tied_to_weight`),
    for the sum of squares: (wbits, x_tied)."""
    wbits = _gather_w_bits(mW, idx, mask, LATENCY, W_PLANES)
    return wbits, _tied_to_weight(x, wbits, M, W_PLANES)


def _weight_piece_bits(mW, off, size, N, TILE_M, LATENCY, W_PLANES, base=0):
    """The weight of the row piece [off, off + size) as loaded (`_gather_w_bits`): (size,), or
    (TILE_M, size) for multi-row tiles: gathered once per row of the tile, in the x tile's own
    layout. A (1, size) gather broadcast over the rows went through shared memory (a layout change,
    a barrier) before the x loads were even issued: 0.969 against 0.992 without a weight (N=512,
    4-row tiles, H200, bench/probe/weight_cost.py). The repeated reads are L1 hits."""
    cols = ct.arange(size, dtype=ct.int32) + off
    if TILE_M > 1:
        cols = ct.reshape(cols, (1, size)) + ct.zeros((TILE_M, 1), dtype=ct.int32)
    mask = cols < N if ct.static_eval(off + size > N) else None
    return _gather_w_bits(mW, base + cols, mask, LATENCY, W_PLANES)


def _weight_piece(mW, off, size, N, offset, TILE_M, LATENCY, W_PLANES, base=0):
    """The fp32 weight (+ offset) of the row piece [off, off + size) (`_weight_piece_bits`)."""
    return _w_from_bits(_weight_piece_bits(mW, off, size, N, TILE_M, LATENCY, W_PLANES, base), W_PLANES) + offset


def _widen_again(x, zero):
    """x in fp32, by an op chain the compiler does not merge with the first ct.astype of the same
    tile: only the 16-bit tile then stays live between the two uses (half the registers).
    `zero` is a runtime 0 (uint16) the compiler cannot fold."""
    if ct.static_eval(x.dtype == ct.bfloat16):  # the top half of an fp32
        return ct.bitcast(ct.astype(ct.bitcast(x, ct.uint16), ct.uint32) << 16, ct.float32)
    if ct.static_eval(x.dtype == ct.float16):
        # the bits xor-ed with a runtime zero: a different value to the compiler, so its conversion
        # is not the first one's, and costs one integer op more (an exact conversion by integer ops,
        # exponent rebias and inf/NaN fix-up, cost ~9 instructions per element: bench/NOTES.md item 14)
        return ct.astype(ct.bitcast(ct.bitcast(x, ct.uint16) ^ zero, ct.float16), ct.float32)
    return x


def _runtime_zero(M, dtype):
    """0 as `dtype`, computed from the row count M (>= 1 at every launch) so it is not a constant."""
    return ct.astype(ct.minimum(M, 0), dtype)


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
            x = _gather_cols(mX, xbase, off, size, N, LATENCY)
            xs = x
            if HAS_W and W_EARLY and not HOIST_W:  # the weight's loads go out with x's (its bits feed the sum)
                cols = ct.arange(size, dtype=ct.int32) + off
                wbits, xs = _gather_w_tied(mW, x, cols, cols < N if ct.static_eval(off + size > N) else None, M,
                                           LATENCY, W_PLANES)
                tWbits += (wbits,)
            xf = ct.astype(xs, ct.float32)
            if HAS_W and W_EARLY and HOIST_W:  # the held bits, tied to this tile's x
                tWbits += (_w_tied_to_x(tWrW[len(tWbits)], xf, M),)
            ssq = ssq + ct.sum(xf * xf)
            tXrX += (x if PACKED else xf,)
        rstd = ct.rsqrt(ssq * ct.static_eval(1.0 / N) + eps)
        if STORE_RSTD:
            ct.scatter(mRstd, tile, rstd, check_bounds=False)
        i = 0
        for off, size in ct.static_iter(row_pieces(N, PIECE_MIN)):
            y = (_widen_again(tXrX[i], _runtime_zero(M, ct.uint16)) if PACKED else tXrX[i]) * rstd
            if HAS_W:
                if W_EARLY:
                    y = y * (_w_from_bits(tWbits[i], W_PLANES) + offset)
                else:
                    y = y * (tWrW[i] if HOIST_W else _weight_piece(mW, off, size, N, offset, TILE_M, LATENCY,
                                                                   W_PLANES))
            _scatter_cols(mY, ybase, off, size, N, ct.astype(y, mY.dtype), LATENCY)
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
            x = ct.astype(_gather_rows(mX, xbase, row_ok, off, size, N, LATENCY), ct.float32)
            if HAS_W and W_EARLY:
                if HOIST_W:  # the held bits, tied to this tile's x
                    tWbits += (_w_tied_to_x(tWrW[len(tWbits)], x, M),)
                else:  # the weight's loads go out with x's (its bits feed the sum)
                    wbits = _weight_piece_bits(mW, off, size, N, TILE_M, LATENCY, W_PLANES)
                    x = _tied_elementwise(x, wbits, M)
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
                if W_EARLY:
                    y = y * (_w_from_bits(tWbits[i], W_PLANES) + offset)
                else:
                    y = y * (tWrW[i] if HOIST_W else _weight_piece(mW, off, size, N, offset, TILE_M, LATENCY,
                                                                   W_PLANES))
            _scatter_rows(mY, ybase, row_ok, off, size, N, ct.astype(y, mY.dtype), LATENCY)
            i += 1


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

    tWrW = ()  # hoisted weight: one fp32 tile (+ offset) per piece, or tied (W_TIED) its bits as loaded
    for off, size in ct.static_iter(row_pieces(N, PIECE_MIN)):
        if HAS_W and HOIST_W:
            if W_TIED:
                tWrW += (_weight_piece_bits(mW, off, size, N, TILE_M, LATENCY, W_PLANES),)
            else:
                tWrW += (_weight_piece(mW, off, size, N, offset, TILE_M, LATENCY, W_PLANES),)

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
        y = y * (_gather_w(mW, cols, ok, LATENCY, W_PLANES) + offset)
    ct.scatter(mY, ybase + cols, ct.astype(y, mY.dtype), mask=ok, check_bounds=False, latency=LATENCY)


def _reload_tile(mX, mW, mY, mRstd, tile, M, stride, eps, offset,
                 N, TILE_M, CHUNK, HAS_W, STORE_RSTD, REVERSE, LATENCY, X_ALIGN, W_PLANES):
    """One row tile of the two-pass kernel (inlined; called once or from the persistent loop)."""
    num_chunks = ct.static_eval(_chunks(N, CHUNK))
    if TILE_M == 1:
        # the full chunks unmasked in a loop, the partial last one (N % CHUNK columns) masked outside
        # it: with the mask inside the loop the compiler ran for minutes at N = 262145 and 131073
        # with 2048-column chunks (bench/NOTES.md, "The reload kernel's tail")
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
                y = y * (_gather_w(mW, cols, None, LATENCY, W_PLANES) + offset)
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
            if HAS_W:  # gathered in the x tile's layout (see _weight_piece)
                wcols = cols + ct.zeros((TILE_M, 1), dtype=ct.int32)
                y = y * (_gather_w(mW, wcols, wcols < N, LATENCY, W_PLANES) + offset)
            ct.scatter(mY, ybase + cols, ct.astype(y, mY.dtype), mask=mask, check_bounds=False,
                       latency=LATENCY)


@ct.kernel
def rms_norm_fwd_reload_kernel(
        mX, mW, mY, mRstd,
        M: int, stride_x: int, eps: float, offset: float,
        N: ConstInt, TILE_M: ConstInt, CHUNK: ConstInt, X_ALIGN: ConstInt,
        HAS_W: ConstBool, STORE_RSTD: ConstBool, REVERSE: ConstBool, PERSISTENT: ConstBool, LATENCY: ConstInt,
        W_PLANES: ConstInt):
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
    clearing between launches (a fill kernel per launch cost ~1.5 %: bench/NOTES.md item 14), and the
    state lives on the device, so a replayed CUDA graph flips it like an eager launch does.

    The wait relies on the blocks of a row running at the same time: the hardware dispatches blocks
    in index order (as CUB's decoupled look-back scan also assumes), so a row's blocks are
    dispatched together, and at most one row's blocks wait on blocks not yet dispatched, which start
    as soon as any other block ends (the GPU holds far more than SPLIT blocks). A bounded wait with
    a fallback that reads the row again was tried: the fallback decision must be the same in every
    warp, which took a block-wide poll and cost 2-3 % (bench/NOTES.md item 14).
    """
    stride = ct.assume_divisible_by(stride_x, X_ALIGN)
    bid = ct.bid(0)
    row = bid // SPLIT
    part = bid - row * SPLIT
    c0 = part * PART
    xbase = ct.assume_divisible_by(row * stride + c0, X_ALIGN)
    ybase = ct.assume_divisible_by(row * N + c0, X_ALIGN)
    MASK_N = ct.static_eval(SPLIT * PART != N)
    lim = ct.minimum(N - c0, PART) if MASK_N else PART

    # this launch's sign bit: the opposite of what the last launch over this row left in our slot
    # (each warp reads it; the barriers of the reduction below order every read before the exchange)
    slot = ct.gather(mSync, bid, check_bounds=False, latency=10)
    sign = ct.where(slot < 0, 0, ct.static_eval(-(1 << 31)))
    tXrX = ()
    tWrW = ()
    ssq = 0.0
    for off, size in ct.static_iter(row_pieces(PART, PIECE_MIN)):
        masked = ct.static_eval(MASK_N or off + size > PART)
        x = _gather_masked(mX, xbase, off, size, lim, masked, LATENCY)
        xs = x
        if HAS_W and W_EARLY:  # the weight's loads go out with x's (its bits feed the sum: always + 0)
            cols = ct.arange(size, dtype=ct.int32) + off
            wbits, xs = _gather_w_tied(mW, x, c0 + cols, cols < lim if masked else None, M, LATENCY, W_PLANES)
            tWrW += (wbits,)
        xf = ct.astype(xs, ct.float32)
        if ct.static_eval(TIE_SLOT and off == 0):  # the slot's load goes out with x's (its bits feed the sum)
            ssq = ssq + ct.sum(xf * xf + _zero_of(slot, M))
        else:
            ssq = ssq + ct.sum(xf * xf)
        tXrX += (x,)
    ct.atomic_xchg(mSync, bid, (ct.bitcast(ssq, ct.int32) & 0x7FFFFFFF) ^ sign, memory_order=ct.MemoryOrder.RELAXED)

    for off, size in ct.static_iter(row_pieces(PART, PIECE_MIN)):
        if HAS_W and not W_EARLY:  # issued here, the compiler sinks them to their use after the wait
            masked = ct.static_eval(MASK_N or off + size > PART)
            cols = ct.arange(size, dtype=ct.int32) + off
            tWrW += (_gather_w_bits(mW, c0 + cols, cols < lim if masked else None, LATENCY, W_PLANES),)

    # the wait: relaxed gpu-scope loads of the row's slots (served by L2, where the atomics wrote
    # them). Every warp polls its own copy of the (SPLIT,) tile and leaves the loop when it sees every
    # slot written, which then stays so: all warps end with the same slots, hence the same sum.
    # `again` (always 0) ties the load's index to the loop's own variable: a load with a loop-
    # invariant index is hoisted out of the loop by cuTile's loop-invariant code motion (a load has
    # no observable effect), and the loop then spins forever (seen in the sm_90 PTX).
    total = ct.min(ct.full((SPLIT,), -1.0, dtype=ct.float32))
    while total < 0.0:
        again = ct.astype(total > 1.0e30, ct.int32)  # always 0 here
        slots = ct.load(mSync, (row + again,), (SPLIT,), allow_tma=False,
                        memory_order=ct.MemoryOrder.RELAXED, memory_scope=ct.MemoryScope.DEVICE) ^ sign
        # a slot with this launch's sign has its sign bit clear after the xor and holds the plain sum
        total = ct.where(ct.min(slots) < 0, -1.0, ct.sum(ct.bitcast(slots, ct.float32)))
    rstd = ct.rsqrt(total * ct.static_eval(1.0 / N) + eps)
    if STORE_RSTD:
        if part == 0:
            ct.scatter(mRstd, row, rstd, check_bounds=False)
    i = 0
    for off, size in ct.static_iter(row_pieces(PART, PIECE_MIN)):
        y = (_widen_again(tXrX[i], _runtime_zero(M, ct.uint16)) if PACKED else ct.astype(tXrX[i], ct.float32)) * rstd
        if HAS_W:
            y = y * (_w_from_bits(tWrW[i], W_PLANES) + offset)
        masked = ct.static_eval(MASK_N or off + size > PART)
        _scatter_masked(mY, ybase, off, size, lim, masked, ct.astype(y, mY.dtype), LATENCY)
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
        y = (_widen_again(tXrX[i], _runtime_zero(M, ct.uint16)) if PACKED else ct.astype(tXrX[i], ct.float32)) * rstd
        if HAS_W:
            if HOIST_W:
                y = y * tWrW[i]
            else:  # read again per tile (an L2 hit): min(tile, M) - tile is 0, but not to the compiler, whose
                # loop-invariant code motion would otherwise hoist the load and hold the weight in fp32
                wbase = ct.assume_divisible_by(ct.minimum(tile, M) - tile, 16)
                w = _weight_piece(mW, off, size, N, offset, TILE_M, LATENCY, W_PLANES, wbase)
                y = y * (ct.reshape(w, (1, size)) if TILE_M == 1 else w)
        ct.store(mY, (tile, ct.static_eval(off // size)), ct.astype(y, mY.dtype),
                 check_bounds=ct.static_eval(off + size > N), allow_tma=False, latency=LATENCY)
        i += 1


@ct.kernel
def rms_norm_fwd_stream_kernel(
        mX, mW, mY, mRstd,
        M: int, stride_x: int, eps: float, offset: float,
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
    for off, size in ct.static_iter(row_pieces(N, PIECE_MIN)):
        if HAS_W and HOIST_W:
            tWrW += (ct.reshape(_weight_piece(mW, off, size, N, offset, 1, LATENCY, W_PLANES), (1, size)),)
    tXrX = _stream_load(mX, bid, M, stride, N, TILE_M, PIECE_MIN, X_ALIGN, LATENCY)
    for tile in range(bid, tiles - step, step):  # every tile of this block but its last: the next one exists
        tXrX_next = _stream_load(mX, tile + step, M, stride, N, TILE_M, PIECE_MIN, X_ALIGN, LATENCY)
        _stream_finish(mW, mY, mRstd, tile, M, tXrX, tWrW, eps, offset, N, TILE_M, PIECE_MIN, HAS_W, STORE_RSTD,
                       HOIST_W, LATENCY, PACKED, W_PLANES)
        tXrX = tXrX_next
    last = bid + (tiles - 1 - bid) // step * step
    _stream_finish(mW, mY, mRstd, last, M, tXrX, tWrW, eps, offset, N, TILE_M, PIECE_MIN, HAS_W, STORE_RSTD,
                   HOIST_W, LATENCY, PACKED, W_PLANES)


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
    w_early: bool = False  # split, cached: the weight never delays x's loads (NOTES items 16, 17)
    tie_slot: bool = False  # split: the workspace slot's load goes out with x's (_zero_of, NOTES items 19, 20)
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


def _pow2_ceil(n: int) -> int:
    return 1 << (max(n, 1) - 1).bit_length()


def _pieces_waste(n: int, piece_min: int) -> float:
    return sum(s for _, s in row_pieces(n, piece_min)) / n - 1.0


def split_part(n: int, split: int) -> int:
    """Columns per block of a row split over `split` blocks: a multiple of 16 elements, so every
    block's columns start 16-byte aligned; the last block's part is short when split does not divide n."""
    return -(-n // (16 * split)) * 16


def cached_piece_min(n: int) -> int:
    """One padded tile when it wastes <= 1/8 of the lanes, else the fewest pieces that do."""
    pm = _pow2_ceil(n)
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
    with the table's configs, off / on (bench/probe/w_early_both_ends.py, bench/NOTES.md item 17):
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
    bench/cutile/rmsnorm_fwd_configs.py --dtype D --write-configs), else the analytical rule below."""
    tables = measured_configs()
    entries = tables.get(table_arch(dev, tables) or "", {}).get(mode)  # an unmeasured arch: the nearest
    if entries:
        same = [e for e in entries if e[3] == dtype] or entries
        rb = N * elem_bytes
        return min(same, key=lambda e: abs(math.log2(e[0]) - math.log2(rb)))[1]
    return analytical_config(mode, N, elem_bytes)


SPLIT_ROW_BYTES = 65536  # above this a row is split over blocks (bench/NOTES.md items 7 and 12)


def analytical_config(mode: str, N: int, elem_bytes: int) -> FwdConfig:
    """Rules for an arch without measurements (from the sm_90 sweeps, bench/NOTES.md)."""
    row_bytes = N * elem_bytes
    # rows per tile so one tile moves >= ~8 KiB (narrow rows: one row per block is too little work)
    tile_m = 1 if row_bytes >= 4096 else min(64, _pow2_ceil(8192 // row_bytes))
    nww = 8 if row_bytes >= 8192 else None  # 8 warps: half the registers per thread for long rows
    if mode == "multi_wave_cached":
        if row_bytes > SPLIT_ROW_BYTES:
            # the H200 sweeps' optimum: 16 KiB of 16-bit x per block kept packed with 8 blocks per SM,
            # 32 KiB of fp32 with 4 (bench/NOTES.md item 12)
            part_bytes, occupancy = (16384, 8) if elem_bytes == 2 else (32768, 4)
            split = min(64, _pow2_ceil(-(-row_bytes // part_bytes)))
            return FwdConfig("split", split=split, piece_min=cached_piece_min(split_part(N, split)),
                             packed=elem_bytes == 2, occupancy=occupancy)
        return FwdConfig("cached", tile_m=tile_m, piece_min=cached_piece_min(N), num_worker_warps=nww,
                         w_early=tile_m == 1)  # the weight's loads with x's (_table_config)
    if mode == "static_persistent":
        return FwdConfig("cached", tile_m=tile_m, piece_min=cached_piece_min(N), persistent=True,
                         blocks_per_sm=8 if row_bytes * tile_m <= 16384 else 2, hoist_w=row_bytes <= 4096,
                         latency=1 if row_bytes <= 4096 else 10, num_worker_warps=nww)
    if mode == "multi_wave_reload":
        chunk = min(_pow2_ceil(N), 8192 // elem_bytes)
        return FwdConfig("reload", tile_m=tile_m, chunk=chunk, latency=1 if row_bytes <= 65536 else 10)
    raise ValueError(mode)


# ================================================================================================
# Compiled-kernel objects (hints -> kernel), signatures for ahead-of-time compile checks
# ================================================================================================
_KERNELS = {"cached": rms_norm_fwd_cached_kernel, "reload": rms_norm_fwd_reload_kernel,
            "split": rms_norm_fwd_split_kernel, "stream": rms_norm_fwd_stream_kernel}


@functools.lru_cache(maxsize=None)
def kernel_for(cfg_kernel: str, hints: tuple) -> ct.kernel:
    k = _KERNELS[cfg_kernel]
    return k.replace_hints(**dict(hints)) if hints else k


def _align_elems(stride: int, elem_bytes: int) -> int:
    """Largest power of two dividing the row stride, capped at 16 bytes' worth of elements."""
    cap = max(16 // elem_bytes, 1)
    return math.gcd(stride, cap) if stride else cap


def constants(cfg: FwdConfig, N: int, x_align: int, has_w: bool, store_rstd: bool, w_planes: int = 0) -> tuple:
    if cfg.kernel == "cached":
        return (N, cfg.tile_m, cfg.piece_min, x_align, has_w, store_rstd, cfg.persistent,
                cfg.persistent and cfg.hoist_w, cfg.latency, cfg.packed and cfg.tile_m == 1, w_planes,
                cfg.w_early)
    if cfg.kernel == "split":
        return (N, cfg.split, split_part(N, cfg.split), cfg.piece_min, x_align, has_w, store_rstd, cfg.latency,
                cfg.packed, w_planes, cfg.w_early, cfg.tie_slot)
    if cfg.kernel == "stream":
        return (N, cfg.tile_m, cfg.piece_min, x_align, has_w, store_rstd, cfg.hoist_w, cfg.latency, cfg.packed,
                w_planes)
    return (N, cfg.tile_m, cfg.chunk, x_align, has_w, store_rstd, cfg.reverse, cfg.persistent, cfg.latency,
            w_planes)


def export_signature(cfg: FwdConfig, N: int, x_dtype, w_dtype, has_w: bool = True, store_rstd: bool = True):
    """The KernelSignature a launch on well-aligned contiguous tensors would compile (for CI checks)."""
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
    if cfg.kernel == "stream":  # y is 2-D (rows padded to 16, N), row stride N (as a launch specialises it)
        vec = 16 // elem
        y = ArrayConstraint(x_dtype, 2, index_dtype=ct.int32, stride_lower_bound_incl=0, alias_groups=(),
                            may_alias_internally=False, stride_constant=(1 if N == 1 else None, 1),
                            shape_constant=(None, 1 if N == 1 else None),
                            stride_divisible_by=(vec if N % vec == 0 else 1, 1),
                            shape_divisible_by=(16, 16 if N % 16 == 0 else 1), base_addr_divisible_by=16)
    else:
        y = arr(x_dtype, True)
    torch_dtype = {ct.float16: torch.float16, ct.bfloat16: torch.bfloat16, ct.float32: torch.float32}
    w_planes = weight_planes_offset(torch_dtype[x_dtype], torch_dtype[w_dtype] if has_w else None, N)
    w = arr(ct.int16, True) if w_planes else arr(w_dtype, N % 16 == 0)
    params = [arr(x_dtype, N % 16 == 0), w, y, arr(ct.float32, True)]
    if cfg.kernel == "split":
        params.append(arr(ct.int32, True))  # the split kernel's slots, a multiple of 16 long
    params += [ScalarConstraint(ct.int32), ScalarConstraint(ct.int32), ScalarConstraint(ct.float32),
               ScalarConstraint(ct.float32)]
    params += [ConstantConstraint(c) for c in constants(cfg, N, _align_elems(N, elem), has_w, store_rstd, w_planes)]
    return kernel_for(cfg.kernel, tuple(sorted(cfg.hints().items()))), \
        KernelSignature(params, CallingConvention.cutile_python_v2())


# ================================================================================================
# Launch wrappers
# ================================================================================================
_MAX_FLAT = (1 << 31) - 1  # int32 indexing: longer inputs are launched in row chunks




def _sync_workspace(M: int, split: int, device, stream: int) -> torch.Tensor:
    """The split kernel's int32 slots for M rows, kept between launches (the kernel flips a sign bit
    instead of needing them cleared; see _workspace.py for streams and CUDA graphs). Lengths are
    multiples of 16, so the array's "divisible by 16" bit (which a launch specialises on) never changes."""
    return workspace(f"fwd_sync{split}", M * split, torch.int32, device, stream, zero=True)


def _round16(n: int) -> int:
    return (n + 15) & ~15


PLANES_MIN_N = 2048  # from this width an fp32 weight with 16-bit x goes to the kernels as int16 planes


def weight_planes_offset(x_dtype: torch.dtype, w_dtype: torch.dtype | None, N: int) -> int:
    """The kernels' W_PLANES constant: where the high halves start in `weight_planes(weight)`, or 0
    when the weight is passed as it is (16-bit, None, with fp32 x, or rows narrower than PLANES_MIN_N,
    where the fp32 weight's layout change costs nothing measurable: bench/NOTES.md item 15)."""
    if w_dtype != torch.float32 or x_dtype.itemsize != 2 or N < PLANES_MIN_N:
        return 0
    return _round16(N)


def weight_planes(weight: torch.Tensor) -> torch.Tensor:
    """An fp32 weight [N] as int16 [2 * round16(N)]: the low 16 bits of each element, then, from
    round16(N), the high 16 bits (exact: the kernel joins them again). One small copy per call; it
    is not cached, so an update of the weight by any path (even through .data) is always seen."""
    N, npad = weight.numel(), _round16(weight.numel())
    planes = torch.empty(2 * npad, dtype=torch.int16, device=weight.device)
    planes.view(2, npad)[:, :N].copy_(weight.contiguous().view(torch.int16).view(N, 2).t())
    return planes


@functools.lru_cache(maxsize=4096)
def _prepared(cfg: FwdConfig, N: int, x_align: int, has_w: bool, store_rstd: bool, w_planes: int = 0):
    """(kernel object, compile-time constants) of one launch shape: everything but the tensors."""
    return (kernel_for(cfg.kernel, tuple(sorted(cfg.hints().items()))),
            constants(cfg, N, x_align, has_w, store_rstd, w_planes))


def row_pad(cfg: FwdConfig) -> int:
    """The stream kernel stores whole row tiles into a 2-D y whose rows are padded to a multiple of
    this (and of 16, so the row count's "divisible by 16" bit never changes); 1 for the others."""
    return max(16, cfg.tile_m) if cfg.kernel == "stream" else 1


def _round_up(n: int, k: int) -> int:
    return -(-n // k) * k


def output_buffers(M: int, N: int, dtype: torch.dtype, device, store_rstd: bool, shape=None, pad_rows: int = 1):
    """y (in `shape`, default [M, N]) and rstd [M] (or None), in allocations padded so that every
    launch of `launch` may write its padded arrays: y's flat length to a multiple of 16 (and its rows
    to a multiple of `pad_rows`, see `row_pad`), rstd's rows to a multiple of 16 and of `pad_rows`.
    The padding keeps the arrays' "divisible by 16" bits independent of M (no recompilation)."""
    shape = shape if shape is not None else (M, N)
    length = _round16(_round_up(M, pad_rows) * N)
    if length == M * N:
        y = torch.empty(shape, dtype=dtype, device=device)
    else:
        y = torch.empty(length, dtype=dtype, device=device)[:M * N].view(shape)
    rstd = torch.empty(_round_up(M, max(16, pad_rows)), dtype=torch.float32, device=device)[:M] if store_rstd else None
    return y, rstd


def _flat(t: torch.Tensor, length: int, offset: int = 0) -> torch.Tensor:
    return t.as_strided((length,), (1,), t.storage_offset() + offset)


# the raw CUstream handle of the current stream: ct.launch takes it, and building a torch.cuda.Stream
# object per call cost 2.9 us of a 23 us call on an H200 host (bench/NOTES.md)
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def grid_size(cfg: FwdConfig, M: int, sm_count: int) -> int:
    """Tile blocks of a launch over M rows: one per row tile, or at most blocks_per_sm x SMs
    (persistent), or `split` per row."""
    if cfg.kernel == "split":
        return M * cfg.split
    tiles = -(-M // cfg.tile_m)
    return min(tiles, cfg.blocks_per_sm * sm_count) if cfg.persistent else tiles


def launch(cfg: FwdConfig, x2d: torch.Tensor, weight: torch.Tensor | None, eps: float, offset: float,
           store_rstd: bool, sm_count: int, out: tuple | None = None, out_shape=None):
    """y (contiguous, [M, N] or `out_shape`) and rstd [M] fp32 (or None) for a 2-D x, unit column stride.

    The API layer has validated everything: dtypes, shapes, devices, x2d.stride(1) == 1, M >= 1.
    `out`: (y, rstd) from `output_buffers` to write into (the tests poison them first).
    """
    M, N = x2d.shape
    stride = x2d.stride(0) if M > 1 else N
    pad = row_pad(cfg)
    if out is None:
        y, rstd = output_buffers(M, N, x2d.dtype, x2d.device, store_rstd, out_shape, pad)
    else:
        y, rstd = out
        if y.untyped_storage().nbytes() < (y.storage_offset() + _round16(_round_up(M, pad) * N)) * y.element_size():
            raise ValueError(f"out: y must come from output_buffers(..., pad_rows={pad}) for {cfg.short()}")
    w_planes = weight_planes_offset(x2d.dtype, weight.dtype if weight is not None else None, N)
    kernel, consts = _prepared(cfg, N, _align_elems(stride, x2d.element_size()), weight is not None, store_rstd,
                               w_planes)
    # what the kernel never touches (the weight without HAS_W, rstd without STORE_RSTD) gets a short
    # view of y: y's whole flat view is over 2^31 elements when the launch is cut into row chunks
    # (ct.launch raised OverflowError on it)
    unused = _flat(y, 16)
    w = weight_planes(weight) if w_planes else weight if weight is not None else unused
    stream = _raw_stream(x2d.device.index)
    split = cfg.kernel == "split"

    def y_arg(r0: int, m: int) -> torch.Tensor:  # the kernel's y for rows [r0, r0 + m)
        if pad > 1:
            return y.as_strided((_round_up(m, pad), N), (N, 1), y.storage_offset() + r0 * N)
        return _flat(y, _round16(m * N), r0 * N)

    def rstd_arg(r0: int, m: int) -> torch.Tensor:  # never written when STORE_RSTD is False
        return _flat(rstd, _round_up(m, max(16, pad)), r0) if store_rstd else unused

    span = (M - 1) * stride + N
    if span <= _MAX_FLAT and _round_up(M, pad) * N <= _MAX_FLAT:  # one launch (the usual case)
        x_flat = x2d.view(-1) if stride == N else _flat(x2d, span)
        sync = (_sync_workspace(M, cfg.split, x2d.device, stream),) if split else ()
        ct.launch(stream, (grid_size(cfg, M, sm_count),), kernel,
                  (x_flat, w, y_arg(0, M), rstd_arg(0, M)) + sync + (M, stride, eps, offset) + consts)
        return y, rstd
    # beyond int32 indexing: row chunks that stay below 2^31 elements, a multiple of 16 rows each (the
    # stream kernel: of its padded tile rows, so only the last chunk writes past its own rows)
    unit = max(16, pad)
    rows = (_MAX_FLAT - unit * N) // max(stride, N) // unit * unit
    if rows < unit:
        raise ValueError(f"rows of {N} elements (stride {stride}) are too long for {cfg.short()}: {unit} rows "
                         f"would pass int32 indexing; use mode='torch'")
    for r0 in range(0, M, rows):
        m = min(rows, M - r0)
        sync = (_sync_workspace(m, cfg.split, x2d.device, stream),) if split else ()
        args = (_flat(x2d, (m - 1) * stride + N, r0 * stride), w, y_arg(r0, m), rstd_arg(r0, m)) + sync + \
            (m, stride, eps, offset)
        ct.launch(stream, (grid_size(cfg, m, sm_count),), kernel, args + consts)
    return y, rstd


@functools.lru_cache(maxsize=4096)
def launcher(cfg: FwdConfig, N: int, stride: int, dtype: torch.dtype, w_dtype: torch.dtype | None,
             store_rstd: bool, sm_count: int):
    """`launch` for one call signature (M free) with everything but the tensors worked out once: the
    host path at batch 1, where a call is host bound (bench/probe/host_path.py). Returns
    run(x2d, weight, eps, offset, out_shape) -> (y, rstd), or None where the signature needs the
    general path (2-D padded y, the split kernel's slots, the fp32 weight's planes)."""
    if row_pad(cfg) > 1 or cfg.kernel == "split" or weight_planes_offset(dtype, w_dtype, N):
        return None
    kernel, consts = _prepared(cfg, N, _align_elems(stride, dtype.itemsize), w_dtype is not None, store_rstd, 0)
    has_w = w_dtype is not None

    def run(x2d, weight, eps, offset, out_shape):
        M = x2d.shape[0]
        span = (M - 1) * stride + N
        if M * N % 16 or span > _MAX_FLAT:  # y's padded allocation, or row chunks: the general path
            return launch(cfg, x2d, weight, eps, offset, store_rstd, sm_count, out_shape=out_shape)
        y = torch.empty(out_shape if out_shape is not None else (M, N), dtype=dtype, device=x2d.device)
        y_flat = y.view(-1)
        unused = _flat(y, 16)
        rstd = torch.empty(_round16(M), dtype=torch.float32, device=x2d.device)[:M] if store_rstd else None
        x_flat = x2d.view(-1) if stride == N or M == 1 else _flat(x2d, span)
        ct.launch(_raw_stream(x2d.device.index), (grid_size(cfg, M, sm_count),), kernel,
                  (x_flat, weight if has_w else unused, y_flat, rstd if store_rstd else unused,
                   M, stride if M > 1 else N, eps, offset) + consts)
        return y, rstd

    return run


# ================================================================================================
# The three mode backends (what the dispatch table points at)
# ================================================================================================
@dataclass(frozen=True)
class CuTileForward:
    mode: str
    idea: str

    def config(self, N: int, dtype: torch.dtype, dev: DeviceInfo) -> FwdConfig:
        return default_config(self.mode, N, dtype.itemsize, dev, str(dtype).removeprefix("torch."))

    def describe(self, M: int, N: int, dtype: torch.dtype, dev: DeviceInfo) -> str:
        cfg = self.config(N, dtype, dev)
        return f"cuTile rms_norm_fwd_{cfg.kernel}_kernel, grid ({grid_size(cfg, M, dev.sm_count)},), {cfg.short()}"

    def forward(self, x2d, weight, eps, offset, store_rstd, dev: DeviceInfo, cfg: FwdConfig | None = None,
                out: tuple | None = None, out_shape=None):
        cfg = cfg or self.config(x2d.shape[1], x2d.dtype, dev)
        return launch(cfg, x2d, weight, eps, offset, store_rstd, dev.sm_count, out, out_shape)

    def launcher(self, M: int, N: int, stride: int, dtype: torch.dtype, w_dtype: torch.dtype | None,
                 store_rstd: bool, dev: DeviceInfo):
        """run(x2d, weight, eps, offset, out_shape) for this call signature (see `launcher`)."""
        cfg = self.config(N, dtype, dev)
        run = launcher(cfg, N, stride if M > 1 else N, dtype, w_dtype, store_rstd, dev.sm_count)
        if run is None:
            return lambda x2d, w, eps, offset, out_shape: launch(cfg, x2d, w, eps, offset, store_rstd, dev.sm_count,
                                                                 out_shape=out_shape)
        return run


MULTI_WAVE_CACHED = CuTileForward("multi_wave_cached", "whole row loaded once, kept on chip")
MULTI_WAVE_RELOAD = CuTileForward("multi_wave_reload", "two passes over chunks")
STATIC_PERSISTENT = CuTileForward("static_persistent", "persistent grid over row tiles")
