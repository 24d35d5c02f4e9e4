"""The residual add fused into the RMSNorm forward for wide rows, in cuTile: the kernel (its launch
rule in add_rmsnorm_fwd_config.py, the wrapper in add_rmsnorm_fwd.py).

    h = x + r   (summed in fp32, rounded once to h's dtype, stored)
    y = h * rsqrt(mean(h^2) + eps) * (offset + w)   (h as stored, so y equals rms_norm(h))

Rows wider than a block's registers, split over SPLIT blocks that each keep PART columns of h on chip:
x and r are read once, h and y written once (4 M N e bytes for 16-bit x, r and h: the floor), where
the unfused path (torch.add into h, then the norm on h) moves 5 and Triton's two-pass fused form
re-reads its chunks. The blocks of a row exchange their partial sums of squares through int32 slots
in global memory, as the norm's split kernel does (rmsnorm_fwd_kernel.py): a slot's
sign bit flips at every launch, so the slots need no clearing, and the wait relies on the blocks of
a row being dispatched together (adjacent block indices).

The split follows the norm's rule between measured widths (`split_between`, docs/design.md 3.3):
the fewest power-of-two parts of at most 16 KiB of h, each part one padded power-of-two piece.
Every store of a block is of columns it loaded itself (the compiler places h's stores after the
exchange, beside y's: sm_90 PTX), so in place (y into x, h into r) no block reads what another wrote.
"""
from __future__ import annotations

import cuda.tile as ct

from .rmsnorm_fwd_config import row_pieces
from .tiles import gather_masked, publish_ssq, scatter_masked, slot_sign, split_block, split_rstd

ConstInt = ct.Constant[int]
ConstBool = ct.Constant[bool]


@ct.kernel
def add_rms_norm_fwd_split_kernel(
        mX, mR, mW, mY, mH, mRstd, mSync,
        M: int, stride_x: int, stride_r: int, eps: float, offset: float,
        N: ConstInt, SPLIT: ConstInt, PART: ConstInt, PIECE_MIN: ConstInt, X_ALIGN: ConstInt, R_ALIGN: ConstInt,
        O_ALIGN: ConstInt, HAS_W: ConstBool, STORE_RSTD: ConstBool, LATENCY: ConstInt):
    """Block b adds and normalises part b % SPLIT of row b // SPLIT; slot b of mSync holds its
    partial sum of squares of h (fp32 bits, the sign bit flipped by every launch). y and h are
    contiguous rows of N; x and r rows start stride_x / stride_r elements apart."""
    sx = ct.assume_divisible_by(stride_x, X_ALIGN)
    sr = ct.assume_divisible_by(stride_r, R_ALIGN)
    bid, row, part, c0, lim = split_block(SPLIT, PART, N)
    xbase = ct.assume_divisible_by(row * sx + c0, X_ALIGN)
    rbase = ct.assume_divisible_by(row * sr + c0, R_ALIGN)
    obase = ct.assume_divisible_by(row * N + c0, O_ALIGN)
    MASK_N = ct.static_eval(SPLIT * PART != N)
    _, sign = slot_sign(mSync, bid)
    tHrH = ()
    ssq = 0.0
    for off, size in ct.static_iter(row_pieces(PART, PIECE_MIN)):
        masked = ct.static_eval(MASK_N or off + size > PART)
        x = gather_masked(mX, xbase, off, size, lim, masked, LATENCY)
        r = gather_masked(mR, rbase, off, size, lim, masked, LATENCY)
        h = ct.astype(ct.astype(x, ct.float32) + ct.astype(r, ct.float32), mH.dtype)
        scatter_masked(mH, obase, off, size, lim, masked, h, LATENCY)
        hf = ct.astype(h, ct.float32)  # h as stored: y is rms_norm(h) bit for bit in its formula
        ssq = ssq + ct.sum(hf * hf)
        tHrH += (h,)
    publish_ssq(mSync, bid, ssq, sign)
    rstd = split_rstd(mSync, mRstd, row, part, sign, eps, SPLIT, N, STORE_RSTD)  # waits for the row's other blocks
    i = 0
    for off, size in ct.static_iter(row_pieces(PART, PIECE_MIN)):
        masked = ct.static_eval(MASK_N or off + size > PART)
        y = ct.astype(tHrH[i], ct.float32) * rstd
        if HAS_W:  # loaded after the wait: the weight holds no registers while x and r are in flight
            w = gather_masked(mW, c0, off, size, lim, masked, LATENCY)
            y = y * (ct.astype(w, ct.float32) + offset)
        scatter_masked(mY, obase, off, size, lim, masked, ct.astype(y, mY.dtype), LATENCY)
        i += 1
