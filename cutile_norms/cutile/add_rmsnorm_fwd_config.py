"""The launch rule of the fused residual add + RMSNorm split forward in cuTile (pure Python: imports
without cuTile)."""
from __future__ import annotations

from .._util import pow2_ceil
from .common import align_elems
from .rmsnorm_fwd_config import split_part

# A part per block of at most PART_BYTES of its widest operand (x, r or h): 8192 columns where all three are
# 16-bit, 4096 where one is fp32 (the norm's split measured best at 16 KiB parts). Sized by h alone, an fp32
# residual under bf16 x and h spilled 188 bytes per thread at 8192-column parts (sm_90 ptxas, N = 131072).
PART_BYTES = 16384
# 8 warps per block, 4 blocks per SM: the norm's split holds 16 KiB parts at 8 blocks of 4 warps, but x
# and r in flight together need twice its registers; at 4 warps and 8 blocks (64 registers) ptxas
# spilled 40-228 bytes per thread with bf16 rows (N = 20000-131072), at 8 warps and 4 blocks none
# (55-64 registers; 4-20 bytes with an fp32 weight, whose piece doubles its registers). The same
# 1024 threads per SM.
NUM_WARPS = 8
OCCUPANCY = 4
MAX_SPLIT = 64
MAX_ROW_BYTES = MAX_SPLIT * PART_BYTES  # of the widest operand per row: wider rows would need larger parts
MIN_N = 32  # two parts of at least 16 columns each (a part's columns start 16-byte aligned: split_part)


def split_config(N: int, elem_bytes: int) -> tuple[int, int, int]:
    """(SPLIT, PART, PIECE_MIN) for rows of N whose widest operand has elem_bytes-byte elements: the
    fewest power-of-two parts of at most PART_BYTES of it (MAX_SPLIT at most), each part one
    power-of-two piece."""
    cols = PART_BYTES // elem_bytes
    split = 2
    while split < MAX_SPLIT and split_part(N, split) > cols:
        split *= 2
    part = split_part(N, split)
    return split, part, pow2_ceil(part)


def constants(N: int, stride_x: int, stride_r: int, x_bytes: int, r_bytes: int, h_bytes: int, has_w: bool,
              store_rstd: bool) -> tuple:
    """The kernel's compile-time constants (SPLIT is the second): the split, and the alignments of the
    x and r rows (their strides) and of y's and h's (contiguous rows of N)."""
    split, part, piece = split_config(N, max(x_bytes, r_bytes, h_bytes))
    o_align = min(align_elems(N, x_bytes), align_elems(N, h_bytes))
    return (N, split, part, piece, align_elems(stride_x, x_bytes), align_elems(stride_r, r_bytes), o_align, has_w,
            store_rstd, 1)
