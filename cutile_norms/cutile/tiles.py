"""Tile-level helpers the cuTile kernels share (forward and backward): masked gathers and scatters of
a row's pieces, the weight's loads (as fp32, or as the int16 planes of an fp32 weight next to 16-bit
x), and the ties that keep the compiler from moving a load or a conversion where it costs more
(each with its measured reason). Evaluated inside `ct.kernel` functions only."""
from __future__ import annotations

import cuda.tile as ct


def gather_masked(mA, base, off, size, lim, MASKED, latency):
    """A (size,) tile of columns [off, off + size) at flat offset `base`; if MASKED, only columns
    below `lim` (a constant, or dynamic for the split kernel's last part)."""
    cols = ct.arange(size, dtype=ct.int32) + off
    if MASKED:
        return ct.gather(mA, base + cols, mask=cols < lim, check_bounds=False, latency=latency)
    return ct.gather(mA, base + cols, check_bounds=False, latency=latency)


def scatter_masked(mA, base, off, size, lim, MASKED, tile, latency):
    cols = ct.arange(size, dtype=ct.int32) + off
    if MASKED:
        ct.scatter(mA, base + cols, tile, mask=cols < lim, check_bounds=False, latency=latency)
    else:
        ct.scatter(mA, base + cols, tile, check_bounds=False, latency=latency)


def gather_cols(mA, base, off, size, N, latency):
    """A (size,) tile of columns [off, off + size) of a row of N at flat offset `base`; masked only past N."""
    return gather_masked(mA, base, off, size, N, ct.static_eval(off + size > N), latency)


def scatter_cols(mA, base, off, size, N, tile, latency):
    scatter_masked(mA, base, off, size, N, ct.static_eval(off + size > N), tile, latency)


def gather_rows(mA, xbase, row_ok, off, size, N, latency):
    """A (TILE_M, size) tile: rows at flat offsets xbase (TILE_M, 1), masked by row_ok and past N."""
    cols = ct.reshape(ct.arange(size, dtype=ct.int32) + off, (1, size))
    mask = row_ok & (cols < N) if ct.static_eval(off + size > N) else row_ok
    return ct.gather(mA, xbase + cols, mask=mask, check_bounds=False, latency=latency)


def scatter_rows(mA, ybase, row_ok, off, size, N, tile, latency):
    cols = ct.reshape(ct.arange(size, dtype=ct.int32) + off, (1, size))
    mask = row_ok & (cols < N) if ct.static_eval(off + size > N) else row_ok
    ct.scatter(mA, ybase + cols, tile, mask=mask, check_bounds=False, latency=latency)


def gather_w_bits(mW, idx, mask, LATENCY, W_PLANES):
    """The weight at flat indices `idx` as loaded (0 where `mask` is False): a 1-tuple, or with
    W_PLANES > 0 the (low, high) int16 planes of a float32 weight (`weight_planes`)."""
    if W_PLANES == 0:
        return (ct.gather(mW, idx, mask=mask, check_bounds=False, latency=LATENCY),)
    return (ct.gather(mW, idx, mask=mask, check_bounds=False, latency=LATENCY),
            ct.gather(mW, idx + W_PLANES, mask=mask, check_bounds=False, latency=LATENCY))


def w_from_bits(wbits, W_PLANES):
    """The fp32 weight from what `gather_w_bits` loaded: the planes are joined exactly by a shift and an or."""
    if W_PLANES == 0:
        return ct.astype(wbits[0], ct.float32)
    lo = ct.astype(ct.bitcast(wbits[0], ct.uint16), ct.uint32)
    hi = ct.astype(ct.bitcast(wbits[1], ct.uint16), ct.uint32)
    return ct.bitcast((hi << 16) | lo, ct.float32)


def gather_w(mW, idx, mask, LATENCY, W_PLANES):
    """The weight at flat indices `idx` in fp32 (0 where `mask` is False). W_PLANES > 0: a float32
    weight passed as two int16 planes, the low halves of its bits at [0, N) and the high halves at
    [W_PLANES, W_PLANES + N) (`weight_planes`): they load in the layout of a 16-bit x tile, where an
    fp32 gather next to 16-bit x is converted between layouts through shared memory (24 shared
    stores and ~20 barriers in the split kernel's PTX; 0.64x copy at N = 65536: docs/design.md)."""
    return w_from_bits(gather_w_bits(mW, idx, mask, LATENCY, W_PLANES), W_PLANES)


def uint_of(dtype):
    return ct.uint32 if ct.static_eval(dtype == ct.float32 or dtype == ct.int32) else ct.uint16


def tied_elementwise(a, bits, M):
    """a unchanged, computed as a | (b & 0) element by element for every tile b of `bits` (same
    shape as a, any width), with a 0 the compiler cannot fold: a value that depends on each b."""
    ua = uint_of(a.dtype)
    t = ct.astype(ct.bitcast(bits[0], uint_of(bits[0].dtype)), ua)
    if ct.static_eval(len(bits) > 1):  # the high plane of a float32 weight (`weight_planes`)
        t = t | ct.astype(ct.bitcast(bits[1], uint_of(bits[1].dtype)), ua)
    return ct.bitcast(ct.bitcast(a, ua) | (t & runtime_zero(M, ua)), a.dtype)


def w_tied_to_x(wbits, x, M):
    """The weight's bits as loaded (`gather_w_bits`), each plane tied to this tile's x
    (`tied_elementwise`): a hoisted weight's conversion then waits for x, so it is done per tile
    after x's loads went out. Converted before a persistent loop, it stalled on the weight's DRAM
    round trip ahead of the first tile's x loads: two serial round trips per block (sm_90 SASS,
    N = 1024, 4-row tiles), all of a small launch's time (docs/design.md)."""
    if ct.static_eval(len(wbits) == 1):
        return (tied_elementwise(wbits[0], (x,), M),)
    return (tied_elementwise(wbits[0], (x,), M), tied_elementwise(wbits[1], (x,), M))


def tied_to_weight(x, wbits, M, W_PLANES):
    """x unchanged, computed as x | (w & 0) on the bits, with a 0 the compiler cannot fold: a value
    that depends on the weight's loads. tileiras sinks a load to its first use whatever the source
    order, and under a tight register budget ptxas leaves the weight's loads after the reduction
    (cached) or the wait for the row's partial sums (split), interleaved with the stores (SASS).
    Tied to the sum of squares, they go out with x's. Measured on the H200: at full size a tie with
    the late loads, which the other resident blocks hide (docs/design.md); in a launch with
    fewer blocks than SMs one DRAM round trip less (N = 4096 bf16, M = 1: 5.4 -> 5.1 us).
    The bits are taken 32 at a time (pack_to_bytes / unpack_from_bytes): per 16-bit element the
    compiler split the loaded registers into halves that then stayed live across the wait (167
    registers where 32-bit words need 80, split 8 at 6 CTAs/SM)."""
    # element by element: a weight of another width than x's, or a piece whose bits are no whole
    # number of 32-bit words (the one-column last piece of N = 2^k + 1 in 16 bits)
    if ct.static_eval(W_PLANES == 0 and wbits[0].dtype.bitwidth != x.dtype.bitwidth
                      or x.shape[-1] * x.dtype.bitwidth % 32 != 0):
        return tied_elementwise(x, wbits, M)
    zero = runtime_zero(M, ct.uint32)
    t = ct.unpack_from_bytes(ct.pack_to_bytes(wbits[0]), ct.uint32)
    if W_PLANES > 0:
        t = t | ct.unpack_from_bytes(ct.pack_to_bytes(wbits[1]), ct.uint32)
    xb = ct.unpack_from_bytes(ct.pack_to_bytes(x), ct.uint32)
    return ct.unpack_from_bytes(ct.pack_to_bytes(xb | (t & zero)), x.dtype)


def zero_of(s, M):
    """+0.0 in fp32 made of the scalar s's bits (s & 0, a 0 the compiler cannot fold): the split
    kernel's `tie_slot`, added to the first piece's squares, which then need the slot's load.
    Untied, ptxas issues the load of the block's workspace slot (whose sign the exchange needs)
    after x's sum of squares in every table config but one (sm_90 SASS): a DRAM round trip in series
    (the workspace is cold after an L2 flush) between the reduction and the exchange, in every
    block's life. Tied, it goes out with x's loads. Measured on the H200 (docs/design.md): fp32
    +0.4 to +1.6 %, bf16 32768 +0.4 / +0.5 %. The first tie ORed the slot's bits into x's
    32-bit words: x and its tied copy were then both live (3-5 registers more in 16-bit, a CTA per
    SM lost at bf16 65536, 4 of 16 loads deferred at bf16 32768, -3.5 %). The squares are a
    temporary: at bf16 32768 this tie keeps 80 registers and all 16 loads first (SASS)."""
    return ct.bitcast(ct.bitcast(s, ct.uint32) & runtime_zero(M, ct.uint32), ct.float32)


def gather_w_tied(mW, x, idx, mask, M, LATENCY, W_PLANES):
    """w_early: the weight at `idx` as loaded (`gather_w_bits`) and x tied to it (`tied_to_weight`),
    for the sum of squares: (wbits, x_tied)."""
    wbits = gather_w_bits(mW, idx, mask, LATENCY, W_PLANES)
    return wbits, tied_to_weight(x, wbits, M, W_PLANES)


def weight_piece_bits(mW, off, size, N, TILE_M, LATENCY, W_PLANES, base=0):
    """The weight of the row piece [off, off + size) as loaded (`gather_w_bits`): (size,), or
    (TILE_M, size) for multi-row tiles: gathered once per row of the tile, in the x tile's own
    layout. A (1, size) gather broadcast over the rows went through shared memory (a layout change,
    a barrier) before the x loads were even issued: 0.969 against 0.992 without a weight (N=512,
    4-row tiles, H200). The repeated reads are L1 hits."""
    cols = ct.arange(size, dtype=ct.int32) + off
    if TILE_M > 1:
        cols = ct.reshape(cols, (1, size)) + ct.zeros((TILE_M, 1), dtype=ct.int32)
    mask = cols < N if ct.static_eval(off + size > N) else None
    return gather_w_bits(mW, base + cols, mask, LATENCY, W_PLANES)


def weight_piece(mW, off, size, N, offset, TILE_M, LATENCY, W_PLANES, base=0):
    """The fp32 weight (+ offset) of the row piece [off, off + size) (`weight_piece_bits`)."""
    return w_from_bits(weight_piece_bits(mW, off, size, N, TILE_M, LATENCY, W_PLANES, base), W_PLANES) + offset


def widen_again(x, zero):
    """x in fp32, by an op chain the compiler does not merge with the first ct.astype of the same
    tile: only the 16-bit tile then stays live between the two uses (half the registers).
    `zero` is a runtime 0 (uint16) the compiler cannot fold."""
    if ct.static_eval(x.dtype == ct.bfloat16):  # the top half of an fp32
        return ct.bitcast(ct.astype(ct.bitcast(x, ct.uint16), ct.uint32) << 16, ct.float32)
    if ct.static_eval(x.dtype == ct.float16):
        # the bits xor-ed with a runtime zero: a different value to the compiler, so its conversion
        # is not the first one's, and costs one integer op more (an exact conversion by integer ops,
        # exponent rebias and inf/NaN fix-up, cost ~9 instructions per element: docs/design.md)
        return ct.astype(ct.bitcast(ct.bitcast(x, ct.uint16) ^ zero, ct.float16), ct.float32)
    return x


def runtime_zero(M, dtype):
    """0 as `dtype`, computed from the row count M (>= 1 at every launch) so it is not a constant."""
    return ct.astype(ct.minimum(M, 0), dtype)


# ------------------------------------------------------------------------------------------------
# Rows split over SPLIT blocks that exchange partial sums of squares through int32 slots (the norm's
# split forward, and the fused add's): slot b belongs to block b; a launch publishes its sum with the
# sign bit opposite to what the last launch left there, so the slots are never cleared.
# ------------------------------------------------------------------------------------------------
def split_block(SPLIT, PART, N):
    """This block's (index, row, part, first column, columns it holds): part b % SPLIT of row
    b // SPLIT, PART columns, the last part short where SPLIT * PART > N."""
    bid = ct.bid(0)
    row = bid // SPLIT
    part = bid - row * SPLIT
    c0 = part * PART
    lim = ct.minimum(N - c0, PART) if ct.static_eval(SPLIT * PART != N) else PART
    return bid, row, part, c0, lim


def slot_sign(mSync, bid):
    """Block bid's slot as the last launch over its row left it, and this launch's sign bit (the
    opposite one). Each warp reads it; the barriers of the reduction that follows order every read
    before the exchange."""
    slot = ct.gather(mSync, bid, check_bounds=False, latency=10)
    return slot, ct.where(slot < 0, 0, ct.static_eval(-(1 << 31)))


def publish_ssq(mSync, bid, ssq, sign):
    """The block's partial sum of squares (never negative: the sign bit is free) into its slot with this
    launch's sign."""
    ct.atomic_xchg(mSync, bid, (ct.bitcast(ssq, ct.int32) & 0x7FFFFFFF) ^ sign, memory_order=ct.MemoryOrder.RELAXED)


def row_ssq(mSync, row, sign, SPLIT):
    """The row's sum of squares once every one of its SPLIT slots shows this launch's sign: relaxed
    gpu-scope loads (served by L2, where the atomics wrote them). Every warp polls its own copy of the
    (SPLIT,) tile and leaves the loop when it sees every slot written, which then stays so: all warps
    end with the same slots, hence the same sum. `again` (always 0) ties the load's index to the
    loop's own variable: a load with a loop-invariant index is hoisted out of the loop by cuTile's
    loop-invariant code motion (a load has no observable effect), and the loop then spins forever
    (seen in the sm_90 PTX)."""
    total = ct.min(ct.full((SPLIT,), -1.0, dtype=ct.float32))
    while total < 0.0:
        again = ct.astype(total > 1.0e30, ct.int32)  # always 0 here
        slots = ct.load(mSync, (row + again,), (SPLIT,), allow_tma=False,
                        memory_order=ct.MemoryOrder.RELAXED, memory_scope=ct.MemoryScope.DEVICE) ^ sign
        # a slot with this launch's sign has its sign bit clear after the xor and holds the plain sum
        total = ct.where(ct.min(slots) < 0, -1.0, ct.sum(ct.bitcast(slots, ct.float32)))
    return total


def split_rstd(mSync, mRstd, row, part, sign, eps, SPLIT, N, STORE_RSTD):
    """The row's rstd once all its blocks have published their sums (`row_ssq`); part 0 stores it."""
    rstd = ct.rsqrt(row_ssq(mSync, row, sign, SPLIT) * ct.static_eval(1.0 / N) + eps)
    if STORE_RSTD:
        if part == 0:
            ct.scatter(mRstd, row, rstd, check_bounds=False)
    return rstd
