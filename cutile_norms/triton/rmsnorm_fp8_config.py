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
    """(BLOCK_N, ROWS, num_warps, P1, P2). Measured on an H100, bf16, per-token scales, 2^27 elements,
    ratio to a copy of the bytes moved (`python bench/tune/triton_fused.py --kernel fp8`,
    2026-11-25): 32 values per thread and about 4096 elements per program were best at every power of
    two (2048: 2 rows x 4 warps 0.970; 4096: 4 warps 0.957; 8192: 8 warps 0.913; 16384: 16 warps
    0.835), 8 or 64 values per thread 0.39-0.86. A width a power-of-two block pads by more than 1/8 ran
    0.68 (5120) and 0.71 (12288) at its best padded config, and in chunks re-read from L2 per-token
    0.54-0.70 at 2560-12288 and 1 x 128 groups 0.68-0.84 (`python bench/residual.py --parts fp8`).
    Those rows stay in registers as up to three power-of-two pieces (5120 = 4096 + 1024, 12288 = 8192
    + 4096), warps sized by the first piece at 32 values per thread: predicted near the powers of two
    of the first piece (0.91-0.96), not yet measured.
    """
    block = max(pow2_ceil(N), group_size or 1)
    if 8 * N < 7 * block and N > 2048:
        p0, p1, p2 = pieces(N, group_size)
        return p0, 1, max(1, min(16, p0 // 1024)), p1, p2
    rows = max(1, min(MAX_ROWS, 4096 // block))
    return block, rows, max(1, min(16, block * rows // 1024)), 0, 0
