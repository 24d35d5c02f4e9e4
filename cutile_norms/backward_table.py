"""mode=None's backward table: the bands of row bytes where another mode's backward measured ahead of
the cuTile persistent kernel, per GPU table, with the evidence (dispatch.py decides from it:
backward_row, _with_best_backward)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class BackwardRow:
    """A band of row bytes where mode=None's backward is another mode's than the cuTile persistent
    kernel (`table`: a measured table's key, as table_key gives it)."""
    table: str
    dtypes: tuple[str, ...]
    bytes_min: int
    bytes_max: int
    mode: str
    evidence: str


# mode=None's backward: the cuTile persistent kernel, except where another mode's backward measured
# ahead of it in the same run. The cuTile backward's configs are measured at the sweep's widths and
# scaled to the nearest (cutile/rmsnorm_bwd.py), which holds at the powers of two (0.94-0.97 x copy)
# and not between them (H100 bf16, N = 12288 / 20480 / 24576 / 28672: 0.849 / 0.561 / 0.838 / 0.865).
# The CuTe DSL kernel exchanges a row's sum through a cluster's shared memory and holds from 24 KiB
# rows: 0.89-0.97 at 12288-262144 where its slices tile the row exactly (the config takes such a
# tiling where one exists: cute/rmsnorm_bwd_config.py, exact_tiling), 0.82-0.94 where the last slice
# is part empty (its columns past the row are zeros in shared memory: no predicated loads), against
# the cuTile kernel's 0.56-0.86 at those widths. One mode for the whole band: its worst case is the
# better one (18112, where the cuTile kernel's scaled config happens to hold, 0.900 against 0.932).
CUTE_BWD_MIN_BYTES = 24 * 1024  # narrower 16-bit rows: the cuTile backward (see BACKWARD_TABLE's evidence)
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
                "config measured 0.901 against 0.842; same commands"),
    BackwardRow("sm_90/H200", ("bfloat16", "float16"), CUTE_BWD_MIN_BYTES, 512 * 1024, "tma_smem_cached",
                "NVIDIA H200 2026-11-26, bf16, the CuTe DSL backward with 3 ring slots against the cuTile "
                "persistent kernel: N=12288 0.876 / 0.847 (the cuTile sweep's best), 18432 0.863 / 0.816, "
                "24576 0.924 / 0.676, 28672 0.900 / 0.706, 42528 0.846 / 0.520, 65536 0.964 / 0.782 "
                "(python bench/tune/cute_rmsnorm_bwd.py); with 2 slots, 20480-262144: 0.61-0.97 against "
                "0.44-0.83 (probe, same seed)"),
)
