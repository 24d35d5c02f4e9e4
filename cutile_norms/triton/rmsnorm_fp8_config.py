"""The launch rule of the FP8-output RMSNorm in Triton (pure Python: imports without Triton)."""
from __future__ import annotations

from .._util import pow2_ceil

MAX_ROWS = 16


def pieces(N: int, group_size: int | None) -> tuple[int, int, int]:
    """(P0, P1, P2): the row as up to three power-of-two pieces (0: absent), each as large as fits, the
    last padded to a power of two where that pads by at most 1/8 of N; pieces of at least a group and
    of 128. Every N up to fp8.FP8_KERNEL_MAX_N has such a cover (tests/triton/test_rmsnorm_fp8.py)."""
    least = max(group_size or 1, 128)
    out, rest = [], N
    while rest > 0 and len(out) < 3:
        size = max(least, 1 << (rest.bit_length() - 1))
        if len(out) == 2 or (pow2_ceil(rest) - rest) * 8 <= N:  # the rest in one padded piece
            size = max(least, pow2_ceil(rest))
        out.append(size)
        rest -= min(size, rest)
    if rest > 0 or (sum(out) - N) * 8 > N:
        raise ValueError(f"no cover of {N} columns by three power-of-two pieces padding at most 1/8")
    return tuple(out + [0] * (3 - len(out)))


def launch_config(N: int, group_size: int | None) -> tuple[int, int, int, int, int]:
    """(BLOCK_N, ROWS, num_warps, P1, P2): bf16, per-token scales, 2^27 elements, the ratio to a copy of
    the bytes moved, medians of 3 (`python bench/tune/triton_fused.py --kernel fp8`, 2026-11-26).
      * Power-of-two blocks up to 4096: two rows (at least 4096 elements) per program, 64 values per
        thread. An H200 moves 1.43x an H100's bytes per second with the same SMs, so a thread must
        have more bytes in flight: 2048 r2 w2 0.977 (H200) / 0.985 (H100), r2 w4 (32 values) 0.961 /
        0.988; 4096 r2 w4 0.972 / 0.988, r1 w4 0.893 / 0.997; 1664 (a 2048 block) r2 w2 0.917 / 0.996,
        r2 w4 0.862 / 1.006. Narrower blocks keep the 4096-element tile at 64 values.
      * From 8192 one row per program at 32 values per thread: 8192 r1 w8 0.877 / 0.995, r1 w4 (64)
        0.864 / 0.978; 16384 r1 w16 0.770 / 0.954, r1 w8 0.762 / 0.933.
    A width a power-of-two block pads by more than 1/8 (and past 2048) is held as up to three
    power-of-two pieces (5120 = 4096 + 1024, 12288 = 8192 + 4096), warps sized by the first piece at 32
    values per thread: 0.70-0.90 on an H100 and 0.57-0.71 on an H200 at 2560-13312, and below the
    padded block at 2560, 12288 and 13312 (docs/performance.md 2.16, not met).
    """
    block = max(pow2_ceil(N), group_size or 1)
    if 8 * N < 7 * block and N > 2048:
        p0, p1, p2 = pieces(N, group_size)
        return p0, 1, max(1, min(16, p0 // 1024)), p1, p2
    if block <= 4096:
        rows = max(2, 4096 // block) if block <= 2048 else 2
        rows = min(MAX_ROWS, rows)
        return block, rows, max(1, min(16, block * rows // (32 * 64))), 0, 0
    return block, 1, max(1, min(16, block // 1024)), 0, 0
