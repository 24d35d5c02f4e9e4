"""Launch configs of the tma_smem_cached forward and the analytic heuristic that picks them."""
from __future__ import annotations

import functools
from dataclasses import dataclass

from .._util import pow2_ceil


@dataclass(frozen=True)
class FwdConfig:
    rows: int        # rows per CTA tile (a multiple of rpg)
    rpg: int         # rows per group: rows one pass of the CTA's threads covers
    tpr: int         # threads per row (power of two; > 32 only with rpg == 1)
    nvb: int         # 16-byte vectors per thread per row
    cluster_n: int   # CTAs per row (a cluster), 1 = none
    vec: int         # elements per 16-byte vector

    @property
    def threads(self) -> int:
        return self.tpr * self.rpg

    @property
    def warps_per_row(self) -> int:
        return max(1, self.tpr // 32)

    @property
    def tile_cols(self) -> int:
        return self.vec * self.tpr * self.nvb

    def smem_row_stride(self, N: int) -> int:
        return N if self.cluster_n == 1 else self.tile_cols

    def smem_bytes(self, elem_bytes: int, N: int, operands: int = 1) -> int:
        """A CTA's shared memory: `operands` tiles (x's; with a residual r's too), the barriers and the
        reduction slots."""
        s = self.smem_row_stride(N)
        tile = ((self.rows - 1) * s + self.tile_cols) * elem_bytes
        groups = self.rows // self.rpg
        return operands * (-(-tile // 128) * 128) + 16 + 4 * groups * self.warps_per_row + 16 + 4 * self.cluster_n + 64

    def short(self) -> str:
        return (f"rows={self.rows} threads={self.threads} (tpr={self.tpr}) vectors/thread={self.nvb} "
                f"cluster={self.cluster_n}")


# The analytic heuristic. The reasons (docs/design.md):
#   * a CTA's tile is its rows' slices, loaded by one bulk copy per row (one per tile when rows are
#     contiguous) and kept in shared memory: registers stay flat as N grows;
#   * TILE_BYTES per CTA for narrow rows (several rows per tile), so that a few CTAs per SM keep
#     enough bytes in flight while others reduce and store;
#   * rows wider than SLICE_BYTES are split over a cluster of CTAs (at most CLUSTER_MAX: 16 is past
#     Hopper's portable 8, and CuTe DSL allows the non-portable size on every kernel it loads) that
#     exchange their partial sums through distributed shared memory;
#   * VECS_PER_THREAD 16-byte vectors per thread and row (64 values of a 16-bit row), half that in
#     clusters of 2-8 CTAs (256 threads per 16 KiB slice: 1.003 / 0.993 against 0.995 / 0.987 at
#     N = 32768 / 65536, bf16, H100), not in clusters of 16 (0.972 against 0.991 at 131072).
#   * rows of 16-32 x WIDE_SLICE_BYTES (fp32 N = 131073 ... 262144, 16-bit N = 262145 ... 524288):
#     16 CTAs of 128 threads, 32 vectors per thread (fp32 N = 262144, H100: 0.982, against 0.959 for 8
#     CTAs of 256 threads, 0.929 for 8 CTAs of 512 and 0.752-0.827 for 16 CTAs of 256-1024 threads;
#     `python bench/tune/cute_rmsnorm_fwd.py --ns 262144 --dtype float32`). The fewest threads that hold
#     the slice: every thread's 32 loads are in flight at once, and three such CTAs share an SM.
#   * rows of SLICE_BYTES - ONE_CTA_BYTES (16-bit N = 8193 ... 24576) in one CTA, not a cluster: on an
#     H200, bf16 N = 10240 / 12288 / 18432 / 20480 / 24576 measured 0.978 / 0.970 / 0.970 / 0.972 /
#     0.963 x copy in one CTA against 0.671 / 0.747 / 0.681 / 0.599 / 0.672 over clusters of 2-4 (each
#     CTA of such a cluster holds one short slice of one row and leaves: its fixed costs, the cluster
#     barrier, the exchange and its own copy of the weight's slice, are not spread over enough bytes);
#     `python bench/probe/model_widths.py --only fwd`. A CTA of up to 48 KiB leaves room for four per SM.
#   * such a row's threads: 16-bit rows take ONE_CTA_THREADS_16 threads, as many vectors each as the
#     row needs (9-24). Wider CTAs with padding vectors fell off a cliff between the measured widths:
#     bf16 N = 20760 / 22760 / 23648 / 23800 as 512 threads x 6 vectors measured
#     0.639 / 0.675 / 0.717 / 0.694 x copy on an H200 and 0.836 / 0.876 / 0.911 / 0.891 on an H100,
#     against 0.970 / 0.901 / 0.879 / 0.853 and 0.994 / 0.953 / 0.918 / 0.913 with 128 threads; at
#     widths without padding (20480, 24576) 128 threads came within 1.1 % of the best thread count
#     (H200 20480: 0.965 against 0.976 over 256).
#     ptxas then: a padded 512 x 6 took 77 registers per thread against 46 unpadded (y rounded all at
#     once before the predicated stores: scalar bf16 conversions), one CTA per SM instead of two.
#     `python bench/probe/model_widths.py --only fwd --kernels "tma analytic,tma 1-CTA 256,
#     tma 1-CTA 512,..."` (docs/performance.md 2.11). Since y is rounded and stored a vector at a time
#     (_device.store_vectors), padded rows compile as unpadded ones do (128 x 21-24 vectors: 202-228
#     registers and no spills, against 255 and up to 144 bytes, 352 beside an fp32 weight) and
#     measure as they do (2.28: H200 0.964-0.985 at 22760-24520, H100 0.993-1.003); the thread counts
#     were compared before that.
#   * fp32 rows keep the power of two (128-1024) whose vectors tile the row with the fewest padding
#     vectors (at most 16 per thread), ties to the one nearest VECS_PER_THREAD per thread: they have
#     half the values per vector, and N = 8288 / 12256 as 512 x 5 / 512 x 6 (padded) measured 1.002 /
#     0.997 (H100) and 0.987 / 0.978 (H200), against 0.995 / 0.993 and 0.973 / 0.957 with 128 threads.
#   * fp32 rows of 8-16 slices (128-256 KiB, N = 32769 ... 65536): at most FP32_WIDE_CLUSTER CTAs of 128
#     threads, 16 vectors each (2 x VECS_PER_THREAD). The rule above gave clusters of 9-15 CTAs there
#     (33352: 14 x 128 x 5), which Hopper places one to a GPC (a GPC holds 16-18 SMs), so 8 GPCs run
#     72-120 of 132 SMs; 8 CTAs fit two to a GPC. H200, fp32, medians of 3 (`python
#     bench/probe/model_widths.py --only fwd --dtype float32 --kernels "None,tma analytic,tma cluster 8
#     v16,quack"`, docs/performance.md 2.46): 0.970-0.999 x copy at 33352-65536 (eight widths, two
#     random), against 0.798-0.962 for the clusters of 9-16 and 0.797-0.990 for multi_wave_cached; past
#     256 KiB the same shape fell (131072: 0.754 against 0.971 over 16 CTAs) and 16-bit rows of these
#     bytes measured 0.56-0.63 with it (68248-98304 bf16), so neither takes it. Not measured on an H100.
FP32_WIDE_CLUSTER = 8
TILE_BYTES = 16 * 1024
WIDE_SLICE_BYTES = 32 * 1024
SLICE_BYTES = 16 * 1024
ONE_CTA_BYTES = 48 * 1024
ONE_CTA_THREADS_16 = 128  # see ONE_CTA_BYTES: 16-bit rows in one CTA
CLUSTER_MAX = 16
VECS_PER_THREAD = 8
MAX_THREADS = 1024
MAX_GROUPS = 16  # row groups per tile (unrolled in the kernel)
SMEM_MAX = 227 * 1024  # a Hopper CTA's shared memory


@functools.lru_cache(maxsize=4096)
def analytic_config(N: int, elem_bytes: int, tile_bytes: int = TILE_BYTES, slice_bytes: int = SLICE_BYTES,
                    vecs_per_thread: int = VECS_PER_THREAD, min_threads: int = 128,
                    cluster_max: int = CLUSTER_MAX, one_cta_threads: int | None = None,
                    fp32_wide: bool = True) -> FwdConfig | None:
    """The config for rows of N elements of `elem_bytes`; None where no config fits (N too long for
    CLUSTER_MAX CTAs' shared memory). `one_cta_threads`: rows of SLICE_BYTES - ONE_CTA_BYTES over that
    many threads whatever the dtype (the probe's candidates that back ONE_CTA_THREADS_16). `fp32_wide`
    False: fp32 rows of 8-16 slices as the general rule cuts them (the probe's comparison)."""
    vec = 16 // elem_bytes
    row_bytes = N * elem_bytes
    if slice_bytes == SLICE_BYTES and SLICE_BYTES < row_bytes <= ONE_CTA_BYTES:
        return _one_cta_config(N, vec, one_cta_threads)
    if (fp32_wide and elem_bytes == 4 and slice_bytes == SLICE_BYTES and cluster_max == CLUSTER_MAX
            and vecs_per_thread == VECS_PER_THREAD and 8 * SLICE_BYTES < row_bytes <= 16 * SLICE_BYTES):
        cluster_max, vecs_per_thread = FP32_WIDE_CLUSTER, 2 * VECS_PER_THREAD  # see FP32_WIDE_CLUSTER
    cluster_n = min(cluster_max, pow2_ceil(-(-row_bytes // slice_bytes)))
    if vecs_per_thread == VECS_PER_THREAD and 1 < cluster_n < 16:
        vecs_per_thread //= 2
    elif vecs_per_thread == VECS_PER_THREAD and cluster_n == 16 and 16 * WIDE_SLICE_BYTES < row_bytes <= 32 * WIDE_SLICE_BYTES:
        vecs_per_thread, min_threads = 4 * VECS_PER_THREAD, 128  # see WIDE_SLICE_BYTES
    vectors = -(-(-(-N // cluster_n)) // vec)  # 16-byte vectors of one CTA's slice
    tpr = pow2_ceil(-(-vectors // vecs_per_thread))
    if tpr <= 32:  # narrow rows: a row per tpr lanes, several row groups per tile
        tpr = min(32, max(tpr, pow2_ceil(-(-vectors // 4)) if vectors > 4 else tpr))
        rpg = max(1, min_threads // tpr)
    else:
        tpr = min(MAX_THREADS, max(tpr, min_threads))
        rpg = 1
    nvb = -(-vectors // tpr)
    if cluster_n > 1:  # slices rounded up to whole vectors per thread: the last CTAs may need none
        cluster_n = -(-N // (vec * tpr * nvb))
    cfg = FwdConfig(rows=rpg, rpg=rpg, tpr=tpr, nvb=nvb, cluster_n=cluster_n, vec=vec)
    if cluster_n == 1:
        groups = max(1, min(MAX_GROUPS, tile_bytes // (rpg * row_bytes)))
        cfg = FwdConfig(rows=rpg * groups, rpg=rpg, tpr=tpr, nvb=nvb, cluster_n=1, vec=vec)
    if cfg.smem_bytes(elem_bytes, N) > SMEM_MAX:
        return None
    return cfg


def _one_cta_config(N: int, vec: int, threads: int | None = None) -> FwdConfig:
    """A row of SLICE_BYTES - ONE_CTA_BYTES in one CTA (see ONE_CTA_BYTES): 16-bit rows over
    ONE_CTA_THREADS_16 threads; fp32 rows over the thread count that pads the fewest vectors (at most
    16 per thread), ties to VECS_PER_THREAD per thread."""
    vectors = -(-N // vec)
    if threads is not None or vec == 8:
        tpr = threads or ONE_CTA_THREADS_16
        return FwdConfig(rows=1, rpg=1, tpr=tpr, nvb=-(-vectors // tpr), cluster_n=1, vec=vec)
    fits = [t for t in (128, 256, 512, 1024) if -(-vectors // t) <= 16]
    tpr = min(fits, key=lambda t: (t * -(-vectors // t) - vectors, abs(-(-vectors // t) - VECS_PER_THREAD)))
    return FwdConfig(rows=1, rpg=1, tpr=tpr, nvb=-(-vectors // tpr), cluster_n=1, vec=vec)
