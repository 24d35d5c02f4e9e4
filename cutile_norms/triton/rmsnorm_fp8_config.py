"""The launch rule of the FP8-output RMSNorm in Triton (pure Python: imports without Triton)."""
from __future__ import annotations

from .._util import pow2_ceil

MAX_ROWS = 16


def launch_config(N: int, group_size: int | None) -> tuple[int, int, int]:
    """(BLOCK_N, ROWS, num_warps): the row in registers as one power-of-two block, masked past N. bf16,
    per-token scales, 2^27 elements, the ratio to a copy of the bytes moved, medians of 3 rounds
    (`python bench/tune/triton_fused.py --kernel fp8`, 2026-11-26; H200 / H100):
      * Blocks from 256 to 4096: two rows (at least 4096 elements) per program, 64 values per thread. An
        H200 moves 1.43x an H100's bytes per second with the same SMs, so a thread must have more bytes
        in flight: 2048 r2 w2 0.977 / 0.985, r2 w4 (32 values) 0.961 / 0.988; 4096 r2 w4 0.972 / 0.988,
        r1 w4 0.893 / 0.997; padded, 1664 (a 2048 block) r2 w2 0.917 / 0.996, r2 w4 0.862 / 1.006; 2560
        (4096) r2 w4 0.756 / 0.935, r1 w4 0.663 / 0.863. Narrower blocks keep the 4096-element tile
        down to 256 (16 rows, MAX_ROWS); below that fewer values a thread, one warp.
      * Wider blocks: one row per program at 32 values per thread: 8192 r1 w8 0.877 / 0.995, r1 w4 (64)
        0.864 / 0.978; 16384 r1 w16 0.770 / 0.954; padded, 5120 / 12288 / 13312 0.638 / 0.641 / 0.684
        (H200), 0.850 / 0.842 / 0.877 (H100).
    Rows a block pads by more than 1/8 were held as up to three power-of-two pieces before (5120 = 4096
    + 1024, warps by the first piece at 32 values): 2560 / 5120 / 12288 / 13312 ran 0.708 / 0.686 / 0.574
    / 0.560 (H200) and 0.904 / 0.875 / 0.701 / 0.687 (H100), random widths 2608 / 6976 0.674 / 0.748
    (H100; `python bench/residual.py --parts fp8`): the padded block has the better worst case on both
    GPUs (0.638 against 0.560, 0.842 against 0.674), with one shape of lanes whatever the width.
    """
    block = max(pow2_ceil(N), group_size or 1)
    if block <= 4096:
        rows = min(MAX_ROWS, max(2, 4096 // block))
        return block, rows, max(1, min(16, block * rows // (32 * 64)))
    return block, 1, max(1, min(16, block // 1024))
