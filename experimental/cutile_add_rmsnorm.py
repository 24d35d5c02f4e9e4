"""Residual add fused into the RMSNorm forward for wide rows, in cuTile (experimental: compile-checked
for sm_90 and sm_100 in CI; not yet validated on hardware).

    h = x + r   (summed in fp32, rounded once to h's dtype, stored)
    y = h * rsqrt(mean(h^2) + eps) * (offset + w)   (h as stored, so y equals rms_norm(h))

Rows wider than a block's registers, split over SPLIT blocks that each keep PART columns of h on chip:
x and r are read once, h and y written once (4 M N e bytes for 16-bit x, r and h: the floor), where
the unfused path (torch.add into h, then the norm on h) moves 5 and Triton's two-pass fused form
re-reads its chunks. The blocks of a row exchange their partial sums of squares through int32 slots
in global memory, as the norm's split kernel does (cutile_norms/cutile/rmsnorm_fwd_kernel.py): a slot's
sign bit flips at every launch, so the slots need no clearing, and the wait relies on the blocks of
a row being dispatched together (adjacent block indices).

The split follows the norm's rule between measured widths (`split_between`, docs/design.md 3.3):
the fewest power-of-two parts of at most 16 KiB of h, each part one padded power-of-two piece.
Every store of a block is of columns it loaded itself (the compiler places h's stores after the
exchange, beside y's: sm_90 PTX), so in place (y into x, h into r) no block reads what another wrote.
"""
from __future__ import annotations

import functools

import cuda.tile as ct
import torch

from cutile_norms._experimental import experimental_kernel
from cutile_norms._util import pow2_ceil
from cutile_norms._workspace import current_raw_stream, workspace
from cutile_norms.cutile.common import align_elems, flat, flat_array, round16, signature
from cutile_norms.cutile.rmsnorm_fwd_config import row_pieces, split_part
from cutile_norms.cutile.tiles import gather_masked, publish_ssq, scatter_masked, slot_sign, split_block, split_rstd

ConstInt = ct.Constant[int]
ConstBool = ct.Constant[bool]

PART_BYTES = 16384  # h per block: 8192 columns of 16-bit h, 4096 of fp32 (the norm's split measured best there)
# 8 warps per block, 4 blocks per SM: the norm's split holds 16 KiB parts at 8 blocks of 4 warps, but x
# and r in flight together need twice its registers; at 4 warps and 8 blocks (64 registers) ptxas
# spilled 40-228 bytes per thread with bf16 rows (N = 20000-131072), at 8 warps and 4 blocks none
# (55-64 registers; 4-20 bytes with an fp32 weight, whose piece doubles its registers). The same
# 1024 threads per SM.
NUM_WARPS = 8
OCCUPANCY = 4
MAX_SPLIT = 64
_MAX_FLAT = (1 << 31) - 1  # int32 indexing: longer launches are cut into row chunks


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


# ================================================================================================
# Launch config and the launch wrapper
# ================================================================================================
def split_config(N: int, h_elem_bytes: int) -> tuple[int, int, int]:
    """(SPLIT, PART, PIECE_MIN) for rows of N: the fewest power-of-two parts of at most PART_BYTES of h
    (MAX_SPLIT at most), each part one power-of-two piece."""
    cols = PART_BYTES // h_elem_bytes
    split = 2
    while split < MAX_SPLIT and split_part(N, split) > cols:
        split *= 2
    part = split_part(N, split)
    return split, part, pow2_ceil(part)


@functools.lru_cache(maxsize=None)
def _kernel():
    return add_rms_norm_fwd_split_kernel.replace_hints(num_worker_warps=NUM_WARPS, occupancy=OCCUPANCY)


def constants(N: int, stride_x: int, stride_r: int, x_bytes: int, r_bytes: int, h_bytes: int, has_w: bool,
              store_rstd: bool) -> tuple:
    """The kernel's compile-time constants (SPLIT is the second): the split, and the alignments of the
    x and r rows (their strides) and of y's and h's (contiguous rows of N)."""
    split, part, piece = split_config(N, h_bytes)
    o_align = min(align_elems(N, x_bytes), align_elems(N, h_bytes))
    return (N, split, part, piece, align_elems(stride_x, x_bytes), align_elems(stride_r, r_bytes), o_align, has_w,
            store_rstd, 1)


def export_signature(N: int, x_dtype, r_dtype, h_dtype, w_dtype, has_w: bool = True, store_rstd: bool = True):
    """The kernel and the KernelSignature a launch on contiguous rows would compile (the CI compile checks)."""
    from cuda.tile.compilation import ScalarConstraint

    size = {ct.float16: 2, ct.bfloat16: 2, ct.float32: 4}
    div16 = N % 16 == 0
    params = [flat_array(x_dtype, div16), flat_array(r_dtype, div16), flat_array(w_dtype, div16),
              flat_array(x_dtype, True), flat_array(h_dtype, True), flat_array(ct.float32, True),
              flat_array(ct.int32, True)]
    params += [ScalarConstraint(ct.int32)] * 3 + [ScalarConstraint(ct.float32)] * 2
    return _kernel(), signature(params, constants(N, N, N, size[x_dtype], size[r_dtype], size[h_dtype], has_w,
                                                  store_rstd))


def _alloc(M: int, N: int, dtype: torch.dtype, device) -> torch.Tensor:
    """[M, N] in an allocation whose flat length is a multiple of 16 (the launch's "divisible by 16"
    bit then never depends on M)."""
    return torch.empty(round16(M * N), dtype=dtype, device=device)[:M * N].view(M, N)


@experimental_kernel
def add_rms_norm_fwd(x2d: torch.Tensor, r2d: torch.Tensor, weight: torch.Tensor | None, eps: float, offset: float,
                     h_dtype: torch.dtype, store_rstd: bool, out: tuple | None = None):
    """(y [M, N] in x's dtype, h [M, N] in h_dtype, rstd [M] fp32 or None) for 2-D x and r with unit
    column stride and M >= 1 (validated by the API layer), rows of at least 2 x 16 columns. `out`:
    (y, h) to write into, contiguous [M, N] (in place: x and r themselves, when contiguous)."""
    M, N = x2d.shape
    device = x2d.device
    if out is None:
        y, h = _alloc(M, N, x2d.dtype, device), _alloc(M, N, h_dtype, device)
    else:
        y, h = out
        if not (y.is_contiguous() and h.is_contiguous()):
            raise ValueError("out: y and h must be contiguous [M, N]")
    rstd = torch.empty(round16(M), dtype=torch.float32, device=device)[:M] if store_rstd else None
    if weight is not None and weight.stride(0) != 1:
        weight = weight.contiguous()
    sx, sr = (x2d.stride(0), r2d.stride(0)) if M > 1 else (N, N)
    consts = constants(N, sx, sr, x2d.element_size(), r2d.element_size(), h.element_size(), weight is not None,
                       store_rstd)
    split = consts[1]
    stream = current_raw_stream(device.index)
    unused = flat(y, 16)  # what the kernel never reads (no weight, no rstd): a short view of y
    rows = max(1, (_MAX_FLAT - N) // max(sx, sr, N) // 16 * 16) if (M - 1) * max(sx, sr, N) + N > _MAX_FLAT else M
    for r0 in range(0, M, rows):
        m = min(rows, M - r0)
        sync = workspace(f"add_fwd_sync{split}", m * split, torch.int32, device, stream, zero=True)
        args = (flat(x2d, (m - 1) * sx + N, r0 * sx), flat(r2d, (m - 1) * sr + N, r0 * sr),
                weight if weight is not None else unused, flat(y, m * N, r0 * N), flat(h, m * N, r0 * N),
                flat(rstd, m, r0) if store_rstd else unused, sync, m, sx, sr, eps, offset)
        ct.launch(stream, (m * split,), _kernel(), args + consts)
    return y, h, rstd
