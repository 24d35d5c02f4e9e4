"""mode=None's backward table: the bands of row bytes where another mode's backward measured ahead of
the cuTile persistent kernel, per GPU table, with the evidence, and the lookup of a call's row
(dispatch.py decides from it: choose_forward, _with_best_backward)."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class BackwardRow:
    """A band of row bytes where mode=None's backward is another mode's than the cuTile persistent
    kernel, or that kernel inside another row's band (`table`: a measured table's key, as table_key
    gives it). The first row that matches a call runs: its table, x's dtype, the row's bytes (with dh,
    up to dh_bytes_max) and, beside an fp32 weight, a row that holds there."""
    table: str
    dtypes: tuple[str, ...]
    bytes_min: int
    bytes_max: int
    mode: str
    evidence: str
    fp32_weight: bool = True  # False: not beside an fp32 weight (16-bit x); such calls take the next row
    dh_bytes_max: int | None = None  # with dh (the residual add's backward) only up to rows of these bytes (0: never)
    # only rows the CuTe DSL backward's slices tile exactly (its exact_tiling) or that it takes over its
    # EVEN_SLICES (takes_even_slices, in the table's GPU model's EVEN_BANDS)
    exact_or_even_only: bool = False


# mode=None's backward: the cuTile persistent kernel, except where another mode's backward measured
# ahead of it in the same run. The cuTile backward's configs are measured at the sweep's widths and
# scaled to the nearest (cutile/rmsnorm_bwd.py), which holds at the powers of two (0.94-0.97 x copy)
# and not between them (H100 bf16, N = 12288 / 20480 / 24576 / 28672: 0.849 / 0.561 / 0.838 / 0.865
# before the 20480 entry).
# The CuTe DSL kernel exchanges a row's sum through a cluster's shared memory and holds from 24 KiB
# rows: 0.89-0.97 at 12288-262144 where its slices tile the row exactly (the config takes such a
# tiling where one exists: cute/rmsnorm_bwd_config.py, exact_tiling), 0.82-0.94 where the last slice
# is part empty (its columns past the row are zeros in shared memory: no predicated loads), against
# the cuTile kernel's 0.56-0.86 at those widths. One mode for the whole band: its worst case is the
# better one (18112, where the cuTile kernel's scaled config happened to hold, 0.900 against 0.932:
# inside the cuTile band below since).
# Except on the H100 at 16-bit rows of 14529-20480 columns (28.4-40 KiB) and a 16-bit weight (or none):
# there the cuTile kernel's config is one shape at every width, the row split over 4 blocks of 8 warps,
# 2 blocks per SM, prefetching the next row, each block's part (a multiple of 16 columns) 3648-5120
# columns in a piece of 4096 (padded by at most 1/8: rmsnorm_fwd_config.cached_piece_min) and a tail of
# at most 1024: 16-20 values a thread, 115-128 registers and no spills (ptxas); the table's entries at
# 16384 and 20480 both scale to it. It measured 0.88-0.96 x copy there (0.88-0.91 below 16384, where a
# part's padded piece idles 1/16-1/8 of its lanes; 0.91-0.96 from 16384), random widths included, where
# the CuTe kernel's slices hold 7-10 vectors a thread or leave the last one part empty: 0.82-0.92 (at
# 19336, 255 registers), ahead only at a width it tiles exactly (15200: 0.920 against 0.892). The
# band's worst case is the better one: 0.877 (14536) against the CuTe kernel's 0.816 (18800). Below
# 14529 a part of 3632 columns or less is cut into three pieces or more (14336: 0.869 against the CuTe
# kernel's exact tiling, 0.923); past 20480 the shape changes with the width (20488 / 21520: a 4096
# piece, a 1024 one and a tail, 0.954 / 0.965; 22176: a 4096 piece and a padded 2048, 0.899; 23480: 8
# blocks a row, 0.826 against the CuTe kernel's 0.917), and the sweep's best at 21848 was 0.901.
# Inside that band the CuTe kernel runs the rows its slices tile exactly or that its EVEN_SLICES takes (an even
# count of 16-byte vectors, 16-bit weight or none, no dh: the band's first BACKWARD_TABLE row), over 2 CTAs of
# 128 threads of 8 vectors or of 256 threads of 5 (cute/rmsnorm_bwd_config.py): medians of 3 same-run rounds
# 0.946-0.981 at 12 such widths of 14592-20480 against the cuTile kernel's 0.881-0.963, level at 19968
# (0.964 against 0.963) and -0.7 % at 20480 (0.946 against 0.953, the one exact tiling of 10 vectors); the
# cuTile kernel keeps the rows of an odd vector count, where the CuTe kernel's slices cost (its numbers above).
# Beside an fp32 weight (16-bit x) the CuTe kernel runs those rows too, to 20464 columns
# (CUTE_BWD_FP32_WEIGHT_MAX_BYTES; the band's second row): since dw's reduction loads 8 partial rows at once
# beside an fp32 weight (cute/rmsnorm_bwd_config.py, RED_CLUSTERS) it runs them at a 16-bit weight's level,
# medians of 3 same-run rounds 0.956-0.986 at 14 even widths of 14592-20416 against the cuTile kernel's
# 0.863-0.957 (+0.5 % at 19968, +1.3 to +2.9 % at 19712 and 20096-20416, +3.2 to +13 % below). At 20480 the CuTe
# kernel's exact tiling, 2 x 128 x 10 vectors (255 registers, ptxas spills 128 bytes there on the H100's
# 2-slot ring), measured 0.931 against 0.945: the cuTile kernel's, as beside a 16-bit weight (0.946 against
# 0.953 above).
# At rows of an odd vector count the cuTile kernel runs beside an fp32 weight without dh (BACKWARD_TABLE's
# fourth band row; its rows in the fp32 weight's layout, cutile/rmsnorm_bwd.row_align, and the bf16 weight's
# configs): 16440 / 17816 / 19368 0.899 / 0.924 / 0.948 against the CuTe kernel's 0.861 / 0.885 / 0.910,
# 16024 level (0.883 / 0.883), behind only at 14600 (0.857 against 0.905): ahead at 3 of 5 widths by 4 %,
# the worst cases 0.4 % apart (the CuTe kernel's the higher), the same kernel as beside a 16-bit weight.
# With dh beside an fp32 weight (not measured) the CuTe kernel runs, as it did before.
# With dh (the residual add's backward) the next row's dh waits in registers too: the launch fits its
# 128 registers with at most 16 bytes of spills up to 18 values a thread (a 4096 piece and a 512 tail,
# 18432 columns: 36 KiB), and spills 28-56 bytes at 20 (18440-20480), where it measured 0.811-0.953
# against the CuTe kernel's 0.910-0.979 (18440, 18800, 19368, 20352, 20480); up to 36 KiB 0.975-0.995 against 0.83-0.97.
CUTILE_BWD_BAND = (2 * 14529, 40 * 1024)  # H100, 16-bit rows: the cuTile backward inside the CuTe band
CUTILE_BWD_DH_MAX_BYTES = 36 * 1024
CUTE_BWD_FP32_WEIGHT_MAX_BYTES = 2 * 20464  # H100: the CuTe backward's even rows beside an fp32 weight
CUTE_BWD_MIN_BYTES = 24 * 1024  # narrower 16-bit rows: the cuTile backward (see BACKWARD_TABLE's evidence)
# ... but on an H100 from 11592 columns, where the cuTile kernel's config comes from its 16384 entry (the
# nearest of 8192 and 16384 in log2 past their geometric mean, 11585): scaled to 11648-12288 it splits the
# row over 4 blocks and measured 0.792-0.842 (bf16 or fp16 x, bf16 or fp32 weight), against the CuTe DSL
# kernel's 0.922-0.965 (2 CTAs of 128 threads, 6 vectors a thread, the last slice part empty below 12288);
# at 11264 / 11520, on the 8192 entry's config (one block a row), the cuTile kernel keeps 0.974-0.993
# against 0.942-0.950. With dh not measured: the cuTile kernel.
H100_CUTE_BWD_MIN_BYTES = 2 * 11592
# On an H200, 16-bit rows of 16-24 KiB (8193-12287 columns), any weight, no dh:
# the CuTe DSL backward where its slices tile the row exactly (N a multiple of 1024 there: 9216 over 1 x
# 128 x 9 vectors, 10240 over 2 x 128 x 5), where the row is a multiple of 32 bytes (N of 16: one CTA of
# 256 threads, its EVEN_SLICES: cute/rmsnorm_bwd_config.py) and at every row from H200_CUTE_BWD_MIN_BYTES;
# the cuTile kernel at the other rows below it (an odd count of 16-byte vectors), where the CuTe kernel's
# last slice would be part empty over the 16 KiB rule's 2 CTAs. The cuTile kernel's H200 table has entries
# at 10240 and 12288, taken by the nearest in log2: rows from 11218 (the two's geometric mean) run its
# 12288 config, the row split over 4 blocks, which measured 0.815-0.846 at 11264-12160 against the CuTe
# kernel's 0.903-0.979 (part-empty slices included); rows below run one block a row (a piece of 8192 and a
# tail), 0.811-0.931 at the padded widths 8200-11136 against the CuTe kernel's 0.754-0.900 over 2 CTAs of
# 128 threads (9736 the exception: 0.821 against 0.852), and 0.878-0.945 at the exact ones against
# 0.911-0.971; over EVEN_SLICES' one CTA of 256 threads the CuTe kernel measured 0.957-0.983 at 8704 /
# 9472 / 10000 / 11008 / 11136 against the cuTile kernel's 0.890-0.923 (same run). The band starts at the
# first whole 16-byte vector past that switch (11224). Beside an fp32 weight the same rows (since dw's 8-row
# reduction there, cute/rmsnorm_bwd_config.py): the CuTe kernel 0.886-0.985 at 12 such widths against
# 0.787-0.948, the cuTile kernel ahead at the odd rows measured (8200 / 9736 / 11000: 0.869 / 0.900 / 0.876
# against 0.776 / 0.853 / 0.871).
H200_CUTE_BWD_MIN_BYTES = 2 * 11224
# On an H200, fp32 rows of 10-256 KiB (2560-65536 columns), without dh: the CuTe DSL backward. The cuTile
# kernel's fp32 configs are the H100's, measured at 2048 and 11264-32768 and scaled between (a wider split at the
# measured blocks per SM), which on the H200 held 0.85-0.99 at the model widths and fell to 0.69-0.82 between
# them (37000, 40960, 44444, 49152, 53000); the CuTe kernel's shape follows the row's bytes by one rule whatever
# the width (cute/rmsnorm_bwd_config.py: one CTA of 128 threads of 5-8 vectors to 16 KiB, then clusters of 2-8
# CTAs of 128 threads to 128 KiB, 8 CTAs of 256 threads or 16 of 128 past it), and measured 0.90-1.02 at 39 widths of 2560-65536
# (17 of them random), its worst 0.896 at 6500 (an odd vector count, its last slice part empty), against the
# cuTile kernel's 0.694-0.987. At the odd vector counts measured it leads at 5 (4092, 6500, 15004, 17452, 44444),
# is level at 1 (22716) and trails by 1-3 % at 3 (9732 0.941 / 0.951, 13004 0.942 / 0.970, 30004 0.946 / 0.961):
# one mode for the band, its worst case the better one. The band starts at 2560 columns, where 128 threads of 5
# vectors fill their last one (2560-4092: +1.5 to +6 % at 2560, 2600, 3336, 3584, 3848, 4092, -0.6 / -1.0 % at
# 3000 / 2816, level at 3072); at 2048 the CuTe rule's 64 threads measured 0.858 against 0.995, and at 2049-2559
# (128 threads, their last vectors part empty) the cuTile kernel has the better worst case (2064 / 2304 / 2400:
# 0.984 / 0.998 / 0.876 against 0.858 / 0.897 / 0.905): it keeps them.
# Rows the CuTe kernel does not take (N not a multiple of 4, a row start off 16 bytes) run the cuTile kernel
# from its backend. With dh (not measured in fp32): the cuTile kernel. The H100's fp32 rows are not
# re-measured (its cuTile configs there 0.97-0.99 at 11264-32768) and keep the cuTile kernel.
H200_FP32_CUTE_BWD_BYTES = (10 * 1024, 256 * 1024)
BACKWARD_TABLE = (
    BackwardRow("sm_90", ("bfloat16", "float16"), 1, 3 * 1024, "triton",
                "H100 80GB HBM3 2026-11-24/25, bf16, Triton's backward against the cuTile persistent kernel: "
                "N=128 0.936 / 0.957, 512 0.937 / 0.945, 896 0.933 / 0.783, 1024 0.933 / 0.955, 1536 0.912 / "
                "0.870 x copy: the better worst case (the cuTile kernel's configs hold at the powers of two "
                "they were measured at, not between); python bench/probe/model_widths.py --only bwd, "
                "python bench/rmsnorm.py --modes triton"),
    BackwardRow("sm_90", ("bfloat16", "float16"), 12289, 16383, "triton",
                "H100 80GB HBM3 2026-11-25, bf16 N=6144 / 7168: triton 0.932 / 0.952 x copy, the cuTile "
                "persistent kernel 0.911 / 0.884; python bench/probe/model_widths.py --only bwd"),
    BackwardRow("sm_90", ("bfloat16", "float16"), H100_CUTE_BWD_MIN_BYTES, CUTE_BWD_MIN_BYTES - 1, "tma_smem_cached",
                "H100 80GB HBM3 2026-11-28, the CuTe DSL backward against the cuTile persistent kernel on its "
                "16384 entry's config, medians of 3 same-run rounds: bf16 weight N=11776 0.956 / 0.842, 12040 "
                "0.922 / 0.835, 12160 0.964 / 0.840; fp32 weight 11648 0.947 / 0.812, 11776 0.952 / 0.831, 11904 "
                "0.955 / 0.816, 12000 0.946 / 0.821, 12040 0.925 / 0.823, 12104 0.928 / 0.827, 12160 0.965 / "
                "0.825, 12200 0.928 / 0.830 x copy; on the 8192 entry's config 11264 / 11520 0.974 / 0.975 "
                "against 0.945 / 0.944 (python bench/probe/model_widths.py --only bwd [--weight-dtype float32] "
                "--kernels None,cutile,cute --random 0 --rounds 3 --ns ...): see H100_CUTE_BWD_MIN_BYTES",
                dh_bytes_max=0),
    BackwardRow("sm_90", ("bfloat16", "float16"), CUTILE_BWD_BAND[0], CUTILE_BWD_BAND[1], "tma_smem_cached",
                "H100 80GB HBM3 2026-11-27, bf16, rows of an even vector count, the CuTe DSL backward (exact "
                "tilings or EVEN_SLICES) against the cuTile persistent kernel, medians of 3 same-run rounds: "
                "N=14592 0.978 / 0.881, 15104 0.980 / 0.890, 15360 0.970 / 0.893, 16000 0.981 / 0.909, 16384 "
                "0.967 / 0.948, 16768 0.978 / 0.914, 17152 0.978 / 0.924, 17920 0.973 / 0.938, 18432 0.959 / "
                "0.933, 19200 0.968 / 0.949, 19968 0.964 / 0.963, 20480 0.946 / 0.953 x copy (python "
                "bench/tune/cute_rmsnorm_bwd_ab.py --ns ... --configs cutile,rule16,even28,slice24pad): see "
                "CUTILE_BWD_BAND",
                fp32_weight=False, dh_bytes_max=0, exact_or_even_only=True),
    BackwardRow("sm_90", ("bfloat16", "float16"), CUTILE_BWD_BAND[0], CUTE_BWD_FP32_WEIGHT_MAX_BYTES,
                "tma_smem_cached",
                "H100 80GB HBM3 2026-11-28, bf16 x beside an fp32 weight, rows of an even vector count, the CuTe "
                "DSL backward (EVEN_SLICES or an exact tiling, dw's 8-row reduction) against the cuTile "
                "persistent kernel, medians of 3 same-run rounds: N=14592 0.976 / 0.863, 15104 0.986 / 0.877, "
                "16128 0.984 / 0.895, 17152 0.978 / 0.897, 17792 0.974 / 0.910, 17920 0.975 / 0.928, 18432 "
                "0.961 / 0.926, 19200 0.972 / 0.942, 19712 0.956 / 0.929, 19968 0.962 / 0.957, 20096 0.962 / "
                "0.945, 20224 0.964 / 0.952, 20352 0.962 / 0.947, 20416 0.966 / 0.944; 20480 (2 x 128 x 10) "
                "0.931 / 0.945 x copy (python bench/probe/model_widths.py --only bwd --weight-dtype float32 "
                "--kernels None,cutile,cute --random 0 --rounds 3 --ns ...): see CUTILE_BWD_BAND",
                dh_bytes_max=0, exact_or_even_only=True),
    BackwardRow("sm_90", ("bfloat16", "float16"), CUTILE_BWD_BAND[0], CUTILE_BWD_BAND[1], "multi_wave_cached",
                "H100 80GB HBM3 2026-11-26, bf16, the cuTile persistent kernel (the row over 4 blocks, 2 per SM, "
                "prefetching) against the CuTe DSL backward, medians of 3: N=14536 0.877 / 0.849, 14600 0.878 / "
                "0.853, 15200 0.892 / 0.920, 15800 0.907 / 0.831, 16024 0.912 / 0.824, 16384 0.946 / 0.920, 16440 "
                "0.915 / 0.843, 16480 0.916 / 0.861, 17720 0.929 / 0.867, 17816 0.937 / 0.873, 18432 0.931 / "
                "0.894, 18800 0.951 / 0.816, 19368 0.959 / 0.833, 20352 0.958 / 0.859, 20480 0.948 / 0.892 x copy "
                "(fp16 0.919-0.956 / 0.828-0.911); with dh 14600 / 15200 / 16024 / 16440 / 17816 / 18432 0.978 / "
                "0.983 / 0.991 / 0.990 / 0.995 / 0.989 against 0.834 / 0.890 / 0.836 / 0.927 / 0.921 / 0.968 "
                "(python bench/probe/model_widths.py --only bwd --kernels None,cutile,cute,quack --ns ...; python "
                "bench/residual.py --parts backward --modes multi_wave_cached,tma_smem_cached --ns ...): see "
                "CUTILE_BWD_BAND",
                fp32_weight=False, dh_bytes_max=CUTILE_BWD_DH_MAX_BYTES),
    BackwardRow("sm_90", ("bfloat16", "float16"), CUTILE_BWD_BAND[0], CUTILE_BWD_BAND[1], "multi_wave_cached",
                "H100 80GB HBM3 2026-11-28, bf16 x beside an fp32 weight, rows of an odd vector count (and 20480), "
                "the cuTile persistent kernel against the CuTe DSL backward with dw's 8-row reduction, medians of "
                "3: N=14600 0.857 / 0.905, 16024 0.883 / 0.883, 16440 0.899 / 0.861, 17816 0.924 / 0.885, 19368 "
                "0.948 / 0.910, 20480 0.945 / 0.931 x copy: ahead at 3 of 5 odd rows (python "
                "bench/probe/model_widths.py --only bwd --weight-dtype float32 --kernels None,cutile,cute --random "
                "0 --rounds 3 --ns ...): see CUTILE_BWD_BAND",
                dh_bytes_max=0),
    BackwardRow("sm_90", ("bfloat16", "float16"), CUTE_BWD_MIN_BYTES, 512 * 1024, "tma_smem_cached",
                "H100 80GB HBM3 2026-11-25, bf16, the CuTe DSL backward against the cuTile persistent kernel: "
                "N=12288 0.912 / 0.850, 14336 0.925 / 0.868, 16384 0.919 / 0.943, 18432 0.892 / 0.932, "
                "20480 0.890 / 0.563, 24576 0.942 / 0.838, 28672 0.940 / 0.865, 40960 0.953 / 0.514, "
                "49152 0.943 / 0.810, 65536 0.971 / 0.923, 131072 0.957 / 0.893, 262144 0.937 / 0.797 x copy; "
                "rows whose last slice is part empty: N=19336 0.824 / 0.720, 36392 0.878 / 0.653, 58680 0.914 / "
                "0.862, 135688 0.925 / 0.563, 193488 0.940 / 0.727 (18112 0.900 / 0.932): the better worst "
                "case; python bench/probe/model_widths.py --only bwd"),
    # An H200's own rows: the same bands as the H100's, each re-measured there (the cuTile kernel with
    # the H200's config table, the CuTe one with its 3-slot ring: cute/rmsnorm_bwd_config.py, DEEP_RING)
    # To 4 KiB rows (not the H100's 3 KiB): from 1537 columns Triton's 16 values per thread (its NARROW_16
    # rule) kept it ahead of the cuTile kernel's configs, which hold at 2048 (a measured width) and not
    # between 1024 and it.
    BackwardRow("sm_90/H200", ("bfloat16", "float16"), 1, 4094, "triton",
                "NVIDIA H200 2026-11-26, bf16, Triton's backward against the cuTile persistent kernel (medians "
                "of 3): N=768 0.830 / 0.727, 896 0.879 / 0.636, 1000 0.895 / 0.736, 1048 0.762 / 0.508, 1128 "
                "0.787 / 0.515, 1280 0.827 / 0.737, 1400 0.841 / 0.686, 1536 0.870 / 0.792, 1664 0.858 / 0.710, "
                "1816 0.872 / 0.837; at 2048 the cuTile kernel (0.975 / 0.912); python "
                "bench/probe/model_widths.py --only bwd --random 0 --ns 768,...,1816 --kernels "
                "None,triton,cutile,quack, python bench/tune/cutile_rmsnorm_bwd.py"),
    BackwardRow("sm_90/H200", ("bfloat16", "float16"), 12289, 16 * 1024, "triton",
                "NVIDIA H200 2026-11-26, bf16 N=7168 / 8192: triton 0.887 / 0.914 x copy, the cuTile persistent "
                "kernel 0.749 / 0.897 (its sweep's best 0.753 / 0.893), while at 6144 the cuTile kernel's H200 "
                "config measured 0.901 against 0.842; same commands; 2026-11-28, Triton's backward with the TMA "
                "rows kernel on rows of a multiple of 16 columns (rmsnorm_bwd_config, the H200's `wide` band): "
                "mode=None 6560 0.889, 6672 0.897, 6816 0.907, 7168 0.936, 7680 0.950, 7792 0.965, 8192 0.957 "
                "(python bench/rmsnorm.py --modes \"\" --anchors quack,torch_compile --no-forward --ns ...)"),
    BackwardRow("sm_90/H200", ("bfloat16", "float16"), 16 * 1024 + 1, H200_CUTE_BWD_MIN_BYTES - 1, "tma_smem_cached",
                "NVIDIA H200 2026-11-26, bf16, rows the CuTe DSL backward's slices tile exactly, against the "
                "cuTile persistent kernel (medians of 3, two runs): N=9216 0.971 / 0.945, 0.967 / 0.943; 10240 "
                "0.915 / 0.882, 0.911 / 0.878; 2026-11-27, rows of a multiple of 32 bytes over the CuTe kernel's "
                "EVEN_SLICES (one CTA of 256 threads): 8704 0.966 / 0.923, 9472 0.983 / 0.890, 10000 0.965 / "
                "0.898, 11008 0.957 / 0.891, 11136 0.970 / 0.918; the other padded rows stay with the cuTile "
                "kernel (2 CTAs of 128 threads, 2026-11-26): 8200 0.754 / 0.811 (9736 0.852 / 0.821); python "
                "bench/probe/model_widths.py --only bwd --random 0 --kernels None,cutile,cute,quack --ns ...; "
                "2026-11-28, bf16 x beside an fp32 weight (dw's 8-row reduction), the same probe with "
                "--weight-dtype float32 --rounds 3: 8704 0.955 / 0.904, 9216 0.960 / 0.948, 9472 0.985 / 0.850, "
                "10000 0.982 / 0.853, 10240 0.927 / 0.855, 11008 0.956 / 0.895, 11136 0.966 / 0.912 (8200 / "
                "9736 / 11000 0.776 / 0.853 / 0.871 against 0.869 / 0.900 / 0.876): see H200_CUTE_BWD_MIN_BYTES",
                dh_bytes_max=0, exact_or_even_only=True),
    BackwardRow("sm_90/H200", ("bfloat16", "float16"), H200_CUTE_BWD_MIN_BYTES, CUTE_BWD_MIN_BYTES - 1,
                "tma_smem_cached",
                "NVIDIA H200 2026-11-26, bf16, the CuTe DSL backward against the cuTile persistent kernel on its "
                "12288 entry's config (medians of 3): N=11264 0.969 / 0.822, 0.979 / 0.832; 11392 0.906 / 0.815, "
                "11520 0.916 / 0.835, 11648 0.918 / 0.828, 11776 0.924 / 0.846, 11904 0.928 / 0.839, 12040 0.903 "
                "/ 0.830, 12160 0.926 / 0.839; same command; 2026-11-28, bf16 x beside an fp32 weight: 11264 "
                "0.952 / 0.796, 11392 0.967 / 0.787, 11648 0.957 / 0.798, 12040 0.886 / 0.821, 12160 0.946 / "
                "0.818: see H200_CUTE_BWD_MIN_BYTES",
                dh_bytes_max=0),
    BackwardRow("sm_90/H200", ("float32",), H200_FP32_CUTE_BWD_BYTES[0], H200_FP32_CUTE_BWD_BYTES[1],
                "tma_smem_cached",
                "NVIDIA H200 2026-11-29, fp32 (fp32 weight), the CuTe DSL backward against the cuTile persistent "
                "kernel (medians of 3 same-run rounds): N=2560 0.949 / 0.934, 3072 0.976 / 0.976, 3584 1.005 / "
                "0.948, 3848 0.996 / 0.969, 4092 0.973 / 0.930, 4096 1.006 / 0.987, 5120 0.956 / 0.918, 6144 0.995 / "
                "0.888, 6500 0.896 / 0.879, 7168 1.012 / 0.932, 8192 0.979 / 0.957, 9216 0.977 / 0.944, 9732 "
                "0.941 / 0.951, 10240 0.965 / 0.915, 11264 0.974 / 0.949, 12288 1.004 / 0.968, 13004 0.942 / "
                "0.970, 14336 0.993 / 0.845, 16384 1.008 / 0.943, 17452 0.933 / 0.906, 18432 0.972 / 0.924, "
                "20480 1.005 / 0.902, 22716 0.928 / 0.927, 24576 1.001 / 0.961, 28672 0.990 / 0.967, 30004 "
                "0.946 / 0.961, 32768 1.020 / 0.981, 37000 0.994 / 0.694, 40960 0.985 / 0.755, 49152 0.971 / "
                "0.818, 53000 0.971 / 0.814, 65536 0.985 / 0.950 x copy (python bench/probe/model_widths.py "
                "--only bwd --random 0 --rounds 3 --dtype float32 --kernels None,cutile,cute,quack --ns ...): "
                "random 5000 0.921 / 0.895, 11000 0.989 / 0.926, 15004 0.909 / 0.885, 26000 0.985 / 0.971, "
                "44444 0.907 / 0.786, 58000 0.931 / 0.898, 61440 0.951 / 0.923 (mode=None 0.904-0.987 there, "
                "the CuTe kernel's); 2048 0.858 / 0.995: see H200_FP32_CUTE_BWD_BYTES",
                dh_bytes_max=0),
    BackwardRow("sm_90/H200", ("bfloat16", "float16"), CUTE_BWD_MIN_BYTES, 512 * 1024, "tma_smem_cached",
                "NVIDIA H200 2026-11-26, bf16, the CuTe DSL backward with 3 ring slots against the cuTile "
                "persistent kernel: N=12288 0.876 / 0.847 (the cuTile sweep's best), 18432 0.863 / 0.816, "
                "24576 0.924 / 0.676, 28672 0.900 / 0.706, 42528 0.846 / 0.520, 65536 0.964 / 0.782 "
                "(python bench/tune/cute_rmsnorm_bwd.py); with 2 slots, 20480-262144: 0.61-0.97 against "
                "0.44-0.83 (probe, same seed)"),
)


def backward_row(key: str | None, dtype_name: str, N: int, fp32_weight: bool = False, dh: bool = False,
                 refused: Callable[[BackwardRow], bool] = lambda row: False) -> BackwardRow | None:
    """BACKWARD_TABLE's first row for this table key (a model's, else its arch's), dtype and width,
    beside an fp32 weight or not, with dh (the residual add's backward) or not, whose mode takes the
    rows (`refused`: dispatch's answer for the CuTe DSL backward)."""
    from .cute.rmsnorm_bwd_config import even_bands, exact_tiling, takes_even_slices  # (no CuTe module at import)

    rows = [r for r in BACKWARD_TABLE if dtype_name in r.dtypes]
    table = key if any(r.table == key for r in rows) else (key or "").split("/")[0]
    model = table.split("/")[1] if "/" in table else None
    itemsize = getattr(torch, dtype_name).itemsize
    nbytes = N * itemsize

    def holds(r: BackwardRow) -> bool:
        top = min(r.bytes_max, r.dh_bytes_max) if dh and r.dh_bytes_max is not None else r.bytes_max
        return (r.table == table and r.bytes_min <= nbytes <= top and (r.fp32_weight or not fp32_weight)
                and (not r.exact_or_even_only or exact_tiling(N, itemsize) is not None
                     or takes_even_slices(N, itemsize, even_bands(model), 3 if dh else 2))
                and not refused(r))

    return next((r for r in rows if holds(r)), None)
