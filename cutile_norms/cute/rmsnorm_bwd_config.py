"""Launch configs of the tma_smem_cached backward and the analytic heuristic that picks them."""
from __future__ import annotations

import functools
from dataclasses import dataclass

from .._platform import DeviceInfo, gpu_model
from .._util import pow2_ceil
from .rmsnorm_fwd_config import CLUSTER_MAX, SMEM_MAX


@dataclass(frozen=True)
class BwdConfig:
    cluster_n: int   # CTAs per row (a cluster), 1 = none
    threads: int     # threads per CTA (a multiple of 32)
    nvb: int         # 16-byte vectors of x per thread
    stages: int      # row slices of x and dy in flight in shared memory (TMA ring)
    vec: int         # elements per 16-byte vector
    streams: int = 2  # rows read into the ring: x and dy, and dh for the residual add's backward (3)

    @property
    def warps(self) -> int:
        return self.threads // 32

    @property
    def slice_cols(self) -> int:
        """Columns of one CTA's slice of a row (>= its valid columns)."""
        return self.vec * self.threads * self.nvb

    def smem_bytes(self, elem_bytes: int) -> int:
        ring = -(-self.stages * self.slice_cols * elem_bytes // 128) * 128
        return self.streams * ring + 8 * (self.stages + 2) + 4 * self.warps + 8 * self.cluster_n + 16 + 256

    def short(self) -> str:
        return (f"cluster={self.cluster_n} threads={self.threads} vectors/thread={self.nvb} "
                f"stages={self.stages}")


# The analytic heuristic. The reasons (docs/design.md):
#   * one CTA per SM, persistent: a cluster of CTAs walks rows c, c + C, ... (C clusters), each CTA
#     owning one slice of columns for the whole launch, so its dw partial stays in registers and its
#     weight is loaded once;
#   * a row's slices of x and dy come in by TMA bulk copies into a ring of STAGES slots, issued
#     STAGES - 1 rows ahead: the DRAM reads never wait for the per-row exchange, which goes through
#     distributed shared memory (one st.async per peer) instead of an L2 round trip;
#   * SLICE_BYTES of x per CTA and row (so that rows of 32-256 KiB spread over 2-16 CTAs of 128
#     threads; 8 where that would be 9-15: ONE_A_GPC), more where CLUSTER_MAX CTAs do not hold the
#     row at that size; a ring of at most MAX_STAGES rows of x and dy fills the rest of shared memory.
#     bf16, H100: 16 KiB slices of 128 threads 0.946-0.972 at N = 32768-131072, against 0.846-0.916
#     for 32 KiB slices of 256 threads; `python bench/tune/cute_rmsnorm_bwd.py`;
#   * slices that tile the row exactly where such a tiling exists (cluster_n x threads x nvb vectors =
#     the row's vectors, threads a power of two from 128, nvb <= MAX_VECS, cluster_n outside ONE_A_GPC
#     for rows that SMALL_CLUSTER slices hold; the slice nearest slice_bytes): bf16, H100, N = 20480
#     0.894 over 2 x 128 x 10 against 0.837 over the padded rule's 3 x 128 x 7, whose last CTA's slice
#     is part empty (its slots' columns past the row are zeros and its dx goes out a vector at a time:
#     rmsnorm_bwd_kernel.py). Rows with no such tiling (a vector count with fewer than 2^7 in its factors,
#     or only tilings of more vectors) keep the padded rule: 0.82-0.94 at the random widths
#     measured (`python bench/probe/model_widths.py --only bwd`, docs/design.md).
#   * clusters of up to SMALL_CLUSTER CTAs keep a short ring, ring_stages(dev) slots: a smaller ring
#     lets more CTAs share an SM (8 warps of one CTA left the issue slots idle, ncu). On an H100 2 slots:
#     bf16 N = 65536 (clusters of 8) 0.963-0.969 against 0.940-0.946 with 4 slots in three runs, and
#     0.970 / 0.971 against 0.944 / 0.937 with 3 in two more; 3 slots measured ahead at 12288, 18432,
#     28672 and 42528 (+3 to +16 %, one run) but behind at 16384, 20480, 24576 and 32768 (-1 to -4 %,
#     two or three runs each), no better worst case. On an H200, whose DRAM moves 1.43 x the H100's
#     bytes per second with the same 132 SMs, a row's reads must be issued further ahead: 3 slots measured
#     ahead of 2 at every width tried, N = 12288 / 18432 / 24576 / 28672 / 42528 / 65536: 0.876 / 0.863 /
#     0.924 / 0.900 / 0.846 / 0.964 against 0.807 / 0.787 / 0.857 / 0.832 / 0.669 / 0.892 x copy, exact
#     and padded slices of 6-8 vectors per thread alike (`python bench/tune/cute_rmsnorm_bwd.py`). A GPU
#     model not named in DEEP_RING takes the H100's 2. Clusters of 16 measured the same with 2, 3 or 4.
SLICE_BYTES = 16 * 1024
VECS_PER_THREAD = 8
MIN_STAGES = 2
DEEP_RING = {"H200": 3}  # GPU model (_platform.gpu_model) -> ring slots of clusters up to SMALL_CLUSTER
MAX_STAGES = 4
SMALL_CLUSTER = 8
MAX_THREADS = 1024
# 16-byte vectors of x per thread and row in an exact tiling (as many of dy, in registers). From 12 on
# the kernel falls off a cliff, at every cluster size, as a thread's x and dy outgrow its registers
# (ptxas, bf16, 128 threads, 3 ring slots: 255 registers and 4-16 bytes spilled at 11 vectors, 28-32 at
# 12, 432 at 13; 3952 at 15 x 128 x 15; with 2 slots 16 at 12). H200, bf16, medians of 3 same-run
# rounds, the exact tiling against the rule's config: N = 12288 / 24576 / 36864 over 1 / 2 / 3 x 128 x
# 12 0.790 / 0.813 / 0.803 against 0.931 / 0.964 / 0.977; 13312 / 26624 / 39936 over 1 / 2 / 3 x 128 x
# 13 0.747 / 0.761 / 0.723 against the padded rule's 0.921 / 0.894 / 0.891; 159744 (13 x 128 x 12)
# 0.638 / 0.949, 173056 (13 x 128 x 13) 0.548 / 0.914, 230400 (15 x 128 x 15) 0.074 / 0.939. At 10-11
# the exact tiling holds: 11264 / 22528 / 33792 / 56320 over 1 / 2 / 3 / 5 x 128 x 11 0.972 / 0.941 /
# 0.985 / 0.976 against the padded rule's 0.901 / 0.894 / 0.879 / 0.889, 20480 and 61440 (10) 0.935 /
# 0.966 against 0.887 / 0.919 (`python bench/tune/cute_rmsnorm_bwd_ab.py --ns 12288 --configs
# rule,pad,1x128x12`, docs/performance.md 2.34). H100: no config of 12-16 vectors a thread the tunes
# drew held (98304 over 8 x 128 x 12 0.933 against 0.985 over 12 x 128 x 8; 13 vectors at 53248 /
# 66000 / 106496 0.77 / 0.46 / 0.75; 16 at 98304 / 123904 0.10 / 0.13); 11 held (123904 over 11 x 128 x
# 11 0.983).
MAX_VECS = 11
# Clusters of 9-15 CTAs: a cluster runs inside one GPC (graphics processing cluster) of 16-18 SMs, so
# one of 9-15 CTAs leaves the rest of its GPC idle, 7/16 of the SMs at 9. Rows that SLICE_BYTES would
# spread over that many CTAs (16-bit N = 65537-122880, fp32 32769-61440) go over SMALL_CLUSTER CTAs of
# wider slices instead (256 threads of at most VECS_PER_THREAD vectors, padded; 7 CTAs where 7 such
# slices hold the row): two clusters a GPC. H200, bf16, 3 M N e bytes over a same-run copy, 16 KiB
# slices against these: 66000 (9 / 7 CTAs) 0.652 / 0.919, 72928 (9 / 8) 0.718 / 0.971, 75232 (10)
# 0.583 / 0.967, 80088 (10) 0.607 / 0.911, 90112 (11) 0.738 / 0.967, 98304 (12, exact) 0.801 / 0.947,
# 106496 (13) 0.838 / 0.913, 117144 (15) 0.832 / 0.898; 8 KiB slices over 13-16 CTAs 0.67-0.88, and 8
# CTAs of 128 threads with 10, 12 or 13 vectors each lost dw's reduction (dw 14-57 % of the launch;
# 11 at 90112: 0.973, level with these);
# `python bench/tune/cute_rmsnorm_bwd.py --ns 66000,72928,75232,80088,90112,98304,106496,117144`. The
# H100 (medians of 3 same-run rounds, the 16 KiB slices / these) gains where the 16 KiB slices pad the row,
# 80088 (10) 0.842 / 0.931, 94000 (12) 0.945 / 0.973, 110000 (14) 0.940 / 0.959, 117144 (15) 0.919 /
# 0.930, and where they tile it exactly it is mixed, -3.6 to +2.9 %: 73728 / 81920 / 90112 / 98304 /
# 106496 / 114688 / 122880 (9-15 x 128 x 8) 0.978 / 0.935 / 0.967 / 0.985 / 0.988 / 0.964 / 0.946
# against 0.969 / 0.962 / 0.956 / 0.957 / 0.952 / 0.947 / 0.948: one rule for both GPUs, whose worst
# case on the H100 is the better one (0.930 against 0.842;
# `python bench/tune/cute_rmsnorm_bwd_ab.py --ns 80088,98304 --configs rule,10x128x8,12x128x8`).
# A row that SMALL_CLUSTER slices hold takes no exact tiling of 9-15 CTAs either (exact_tiling): bf16
# 53248 over 13 x 128 x 4 0.849 / 0.623 (H100 / H200) against the padded rule's 7 x 128 x 8 0.908 /
# 0.846.
ONE_A_GPC = range(SMALL_CLUSTER + 1, CLUSTER_MAX)  # the 16 KiB slice counts moved to SMALL_CLUSTER CTAs
# Rows past SMALL_CLUSTER slices (up to CLUSTER_MAX CTAs of WIDE_THREADS x VECS_PER_THREAD, 512 KiB) take
# an exact tiling only over FULL_GPC CTAs (15-16: one a GPC of 16-18 SMs leaves 0-3 idle; 10-14 leave 2-8,
# and 9 fits twice only in a GPC of 18), and a row of CLUSTER_MAX to WIDE_SLICES slices that those do not
# tile goes over SMALL_CLUSTER CTAs of WIDE_THREADS threads (padded, at most 9 vectors a thread) as
# ONE_A_GPC's rows do; past WIDE_SLICES the padded rule's clusters of 13-16. bf16, medians of 3 same-run
# rounds, the exact tilings of 9-14 CTAs and the 16 KiB slices' clusters against these, H100 / H200:
# 123904 over 11 x 128 x 11 (exact) 0.982 / 0.734 against 8 x 256 x 8 0.958 / 0.962; 122888 / 124000 /
# 126976 / 128520 over 16 x 128 x 8 (padded) 0.911 / 0.999 / 0.949 / 0.921 and 0.836 / 0.876 / 0.882 /
# 0.860 against 0.923 / 0.957 / 0.950 / 0.930 and 0.890 / 0.967 / 0.925 / 0.897; 133336 / 135688 / 140000
# / 143368 / 145000 over 14-15 x 256 x 5 (padded) 0.912 / 0.912 / 0.943 / 0.912 / 0.909 and 0.829 / 0.835
# / 0.887 / 0.849 / 0.847 against 8 x 256 x 9 0.917 / 0.915 / 0.944 / 0.912 / 0.913 and 0.884 / 0.884 /
# 0.917 / 0.883 / 0.881; past WIDE_SLICES, exact tilings of 9-14 CTAs against the padded rule, 157696 /
# 159744 / 165888 / 186368 / 204800 / 221184 / 247808: H100 0.926 / 0.938 / 0.865 / 0.942 / 0.947 / 0.943
# / 0.880 against 0.942 / 0.944 / 0.929 / 0.935 / 0.928 / 0.931 / 0.931, H200 0.880 / 0.915 / 0.912 /
# 0.933 / 0.880 / 0.924 / 0.728 against 0.946 / 0.940 / 0.891 / 0.934 / 0.924 / 0.917 / 0.906. The exact
# tilings of 15-16 CTAs hold: 131072 / 138240 / 147456 over 16 x 128 x 8 / 15 x 128 x 9 / 16 x 128 x 9,
# H200 0.953 / 0.956 / 0.951 against 8 x 256 x 8-9's 0.937 / 0.902 / 0.916. One rule for both GPUs: the
# H100 loses up to 4.2 % (124000) and 2.4 % (123904) where the H200 gains 10-31 %, and the worst case of
# the 18 widths rises from 0.865 to 0.912 on the H100 and from 0.728 to 0.881 on the H200 (`python
# bench/tune/cute_rmsnorm_bwd_ab.py --ns 123904,135688 --configs rule,11x128x11,14x256x5`,
# docs/performance.md 2.35). 8 x 256 x 9 vectors (288 KiB of bf16) is as far as 8 CTAs were measured:
# WIDE_SLICES.
# SEVEN_PADDED: a row whose 16 KiB slices pad it over 7 CTAs of 128 threads (16-bit N = 49153-57343) goes
# over 8 CTAs of 7 vectors a thread where none is left empty (from 50177), padded too. bf16, medians of 3
# same-run rounds, 7 x 128 x 8 against 8 x 128 x 7 at 50200 / 51000 / 52000 / 53248 / 55000 / 56000:
# H100 0.872 / 0.876 / 0.908 / 0.914 / 0.903 / 0.943 against 0.891 / 0.896 / 0.925 / 0.929 / 0.924 /
# 0.957 (+1.5 to +2.3 %), H200 (51000-56000) 0.817 / 0.848 / 0.860 / 0.859 / 0.882 against 0.874 /
# 0.906 / 0.913 / 0.900 / 0.933 (+4.8 to +7.0 %); 57344, which 7 x 128 x 8 tiles, level (0.955 / 0.957
# on the H100). Rows on 6 CTAs do not gain from 8 (44000 / 46000 / 48000 over 6 x 128 x 8 against 8 x 128
# x 6: H100 0.888 / - / 0.922 against 0.873 / - / 0.910, H200 0.817 / 0.847 / 0.873 against 0.808 /
# 0.837 / 0.866), nor 7 CTAs of 256 threads (ONE_A_GPC's 66000 / 68000 / 70000 over 7 x 256 x 5, H200
# 0.924 / 0.946 / 0.946 against 8 x 128 x 9's 0.882 / 0.910 / 0.917); a cause for 7 alone is not
# measured (`python bench/tune/cute_rmsnorm_bwd_ab.py --ns 51000,53248 --configs rule,7x128x8`,
# docs/performance.md 2.36). Since EVEN_SLICES (below), which takes the 16-bit rows of a multiple of 32
# bytes first, this holds for the others (an odd vector count, dh's third ring, fp32 rows).
SEVEN_PADDED = SMALL_CLUSTER - 1
FULL_GPC = range(CLUSTER_MAX - 1, CLUSTER_MAX + 1)
WIDE_THREADS = 256
WIDE_SLICES = 18
# dw's reduction over the clusters' partial rows (rmsnorm_bwd_kernel.reduce_dw): a reducer sums one
# column tile of rounds x 4 x threads columns at a time over the C partial rows, loading `rows` partial
# rows' tiles before adding them. The partials were just written and sit in L2, so a reducer's time is
# its chain of dependent L2 round trips: ceil(C / rows) of them (C = 66 clusters of 2, 39 of 3, 30 of 4,
# 15 of 8, 7 of 16 on 132 SMs). In the last group the rows past C load row C - 1 again (in bounds, in
# L2) and skip their add, so the sum stays in cluster order (dw as deterministic as before) and the
# remainder costs no round trips of its own; adding one row at a time after the last multiple cost up
# to rows - 1 more (at 7 clusters all of them).
# One row at a time (4 tiles a round) dw took 4.7-10.3 % of the launch at 10240-14336, 20480 and 28672
# on an H200 (the same config with and without dw). mode=None's backward, bf16, one row at a time -> 4
# rows of one tile with the remainder one at a time (two runs): H200 12288 0.876 -> 0.920 / 0.925,
# 14336 0.894 -> 0.935 / 0.933, 20480 0.875 -> 0.929 / 0.934; H100 12288 0.910 -> 0.947, 20488 0.832
# -> 0.918. Same run, medians of 3 (docs/performance.md 2.25), 8 rows with the remainder in the group
# against 4 rows with it (a chain of ceil(C / 4), 1-2 round trips fewer than the 4-row loop before,
# floor(C / 4) + C mod 4; its numbers are 2.24's within 0.6 %, 0.9 % at 262144 on the H200): H200 +0.3
# to +1.0 % at clusters of 2-5, +2.9 / +4.3 % at 14336 / 28672, -0.5 to +0.4 % at clusters of 8-16; H100
# +0.1 to +1.1 %. Against 8 rows with the remainder one at a time: +0.1 to +0.9 % at clusters of 2-5 and
# +1.3 / +2.2 / +2.7 % at 65536 / 118632 / 262144 on the H200 (clusters of 8, 15, 16), -0.1 to +0.5 %
# and +0.9 / +1.9 / +2.0 % on the H100. 16 rows measured within 0.6 % of 8 either way. One tile a round
# keeps a thread's loads in flight at `rows` over 4 x the reducers of 4 tiles; 4 tiles and 4 rows at
# once held more registers, and ptxas spilled 16 bytes in the row loop at bf16 N = 19336 (cluster 3 x
# 128 x 7); 8 rows of one tile spill none at 11 bf16 widths of 10240-262144, both rings
# (tests/cute/test_rmsnorm_bwd_compile.py), and 8 bytes at 11264 (one CTA of 11 vectors a thread, 255
# registers), as every reduction there does.
# Beside an fp32 weight (16-bit x) too: the one-row reduction cost that kernel 1.7-21 % (its row loop
# matches a 16-bit weight's: SASS at 18432 over 2 x 256 x 5, fewer instructions and registers). bf16 x,
# the rule's config with one row against 8 rows, medians of 3 same-run rounds: H200 0.784-0.965 -> 0.874-
# 0.986 at 22 widths of 8192-90000 (12288 0.784 -> 0.952, 18432 0.904 -> 0.967, 28672 0.913 -> 0.952),
# 131072 0.942 -> 0.944; H100 0.860-0.971 -> 0.902-0.986 (9216 0.860 -> 0.985, 20480 0.873 -> 0.928),
# 131072 0.958 -> 0.957. ptxas spills nothing with 8 rows there at the measured configs but at 20480 over
# 2 x 128 x 10 on the H100's 2-slot ring (255 registers: 128 bytes, against 28 with one row), which gained
# all the same (`python bench/tune/cute_rmsnorm_bwd_ab.py --weight-dtype float32 --configs rule,rule/1x8
# --ns ...`, docs/performance.md 2.42). With dh (its third ring) the reduction keeps one row at a time:
# ptxas's allocation of the row loop moves with the reducer's code there, e.g. bf16 N = 20480 with 3 ring
# slots spilled 2596 bytes at 32 registers (8 one row at a time); not measured on a GPU.
# EVEN_SLICES: a 16-bit row a multiple of 32 bytes long (an even count of 16-byte vectors: every row starts on a 32-byte
# sector), of up to SMALL_CLUSTER 16 KiB slices and inside one of the GPU model's EVEN_BANDS, goes over slices of
# EVEN_SLICE_BYTES (the padded rule's formula: 256 threads of at most 6 vectors from 16 KiB a CTA, fewer CTAs), unless
# the rule's own config is an exact tiling of slices of SLICE_BYTES or more. bf16, medians of 3 same-run rounds, the
# rule's config against these. H200, rows past 16 KiB: padded rows 8704 / 9472 / 10496 / 10752 / 11136 0.804 / 0.849 /
# 0.877 / 0.877 / 0.899 against 0.962 / 0.984 / 0.985 / 0.974 / 0.969 (one CTA of 256 threads for a cluster of 2),
# 16400-19456 (3 x 128 x 6-7) 0.841-0.892 against 0.949-0.988 (2 x 256 x 5) at 7 widths, 20496-24064 (3 x 128 x 7-8)
# 0.889-0.937 against 0.972-0.995 (2 x 256 x 6) at 6, 27616 / 30000 / 34976 / 35648 / 39088 +1.4 to +11 %, 42000 / 44000
# / 50000 / 52000 / 54000 / 58000 / 60000 0.843 / 0.818 / 0.866 / 0.900 / 0.914 / 0.887 / 0.916 against 0.962 / 0.980 /
# 0.960 / 0.922 / 0.935 / 0.965 / 0.977; exact tilings of slices under 16 KiB 10240 / 15360 / 18432 / 28672 +3.4 / +9.0
# / +9.0 / +1.4 %, 12288 (2 x 128 x 6 against one CTA) -1.7 %; those of 16 KiB or more held (24576 / 32768 / 36864 /
# 40960 / 49152: 0.969 / 0.986 / 0.979 / 0.955 / 0.935 against 0.933 / 0.976 / 0.893 / 0.949 / 0.912). H100: from 48 KiB
# 27616 / 28672 / 30000 / 34976 / 35648 / 39088 / 42000 / 44000 / 50000 / 58000 / 60000 +2.8 / +0.3 / 0.0 / +3.4 / +1.6
# / +2.9 / +7.3 / +5.2 / +7.7 / +1.9 / -0.7 %; at 24-40 KiB the even rows the 16 KiB rule spreads over 3 CTAs of 5-7
# vectors (15360-19968: 0.881-0.943) 0.959-0.978 over 2 CTAs, against the cuTile kernel's 0.893-0.963 in the same rounds
# (the rows its table gave that kernel; below 28.4 KiB both formulas give the same 2 CTAs); at 40-48 KiB, where the 16
# KiB rule's 3 CTAs of 128 threads hold 7-8 vectors (near-full slices), the 24 KiB slices' 2 x 256 x 6 lost (21504 /
# 22000 / 23040 / 23552 / 24064: -1.4 / -1.3 to -1.8 / -1.3 / -2.5 / -2.5 %; 20992, 41 KiB, +0.3 %), and at 24 KiB 12288
# (its exact 2 x 128 x 6 against one CTA) -2.3 %. Hence the H100's two bands, past 24 KiB up to 40 KiB and past 48 KiB.
# Rows of an odd vector count keep the rule: they lost on both GPUs at most widths (H200 18104 / 19368 / 20488 / 21096 /
# 22536 / 38488 -2.6 to -9.0 %, 16440 / 17000 / 25928 +3.2 to +6.7 %; H100 17496 / 21096 / 38488 -1.1 / -7.3 / -2.5 %),
# as they run slower than aligned rows with the rule's own slices (docs/performance.md 2.37). Past SMALL_CLUSTER slices
# the rule's cluster shapes hold (H200 70000 / 80000: 0.939 / 0.992 against 0.936 / 0.946). dh's third ring and fp32
# rows are not measured: the rule there. The cause of the gain is not measured (more slots in a 16 KiB ring, 4 against
# 3, gained nothing on the H200 at 16400-24064). `python bench/tune/cute_rmsnorm_bwd_ab.py --ns 9472,18432,44000
# --configs rule16,slice24pad,cutile`, docs/performance.md 2.38 and 2.39.
EVEN_SLICE_BYTES = 24 * 1024
# GPU model -> bands of row bytes (lo, hi]: rows past lo and up to hi take EVEN_SLICES
EVEN_BANDS = {"H200": ((SLICE_BYTES, SMALL_CLUSTER * SLICE_BYTES),)}
# the H100's, and any GPU model EVEN_BANDS does not name
EVEN_BANDS_OTHERS = ((24 * 1024, 40 * 1024), (3 * SLICE_BYTES, SMALL_CLUSTER * SLICE_BYTES))
RED_ROUNDS = 1
RED_CLUSTERS = 8


def reduction_shape(has_dh: bool) -> tuple[int, int]:
    """(column tiles a round, partial rows loaded at once) of dw's reducers for a kernel with dh or
    without: see RED_CLUSTERS."""
    if has_dh:
        return 4, 1
    return RED_ROUNDS, RED_CLUSTERS


def exact_tiling(N: int, elem_bytes: int, slice_bytes: int = SLICE_BYTES) -> tuple[int, int, int] | None:
    """(cluster_n, threads, nvb) whose slices hold the row's 16-byte vectors exactly (no padding), the
    slice nearest `slice_bytes` (ties: fewer threads); None where none exists (see MAX_VECS and
    ONE_A_GPC: a row that SMALL_CLUSTER slices hold takes no cluster of 9-15 CTAs). The rule below takes
    it only where its own slices would pad the row."""
    vec = 16 // elem_bytes
    if N % vec:
        return None
    vectors = N // vec
    target = slice_bytes // 16
    clusters = range(1, CLUSTER_MAX + 1)
    if N * elem_bytes <= SMALL_CLUSTER * slice_bytes:
        clusters = [c for c in clusters if c not in ONE_A_GPC]
    elif N * elem_bytes <= CLUSTER_MAX * WIDE_THREADS * VECS_PER_THREAD * 16:
        clusters = FULL_GPC
    fits = [(c, t, vectors // (c * t)) for c in clusters for t in (128, 256, 512, 1024)
            if vectors % (c * t) == 0 and vectors // (c * t) <= MAX_VECS]
    if not fits:
        return None
    return min(fits, key=lambda f: (abs(f[1] * f[2] - target), f[1]))


def ring_stages(dev: DeviceInfo | None) -> int:
    """The ring slots of a small cluster's CTA on `dev` (None: the H100's rule); see DEEP_RING."""
    return DEEP_RING.get(gpu_model(dev.name), MIN_STAGES) if dev is not None else MIN_STAGES


def even_bands(model: str | None) -> tuple[tuple[int, int], ...]:
    """The bands of row bytes where EVEN_SLICES applies on a GPU model (_platform.gpu_model; None: the H100's)."""
    return EVEN_BANDS.get(model, EVEN_BANDS_OTHERS)


def takes_even_slices(N: int, elem_bytes: int, bands: tuple[tuple[int, int], ...] | None, streams: int = 2) -> bool:
    """Whether a row of N elements of elem_bytes is one EVEN_SLICES is for, inside one of `bands` (lo, hi]
    of row bytes (None: none is; each band ends at SMALL_CLUSTER slices at most): 16-bit, a multiple of 32
    bytes, x's and dy's rings only (analytic_config then keeps an exact tiling of its own slices of
    SLICE_BYTES or more)."""
    nbytes = N * elem_bytes
    return (bands is not None and elem_bytes == 2 and streams == 2 and nbytes % 32 == 0
            and nbytes <= SMALL_CLUSTER * SLICE_BYTES and any(lo < nbytes <= hi for lo, hi in bands))


def device_config(N: int, elem_bytes: int, dev: DeviceInfo | None, streams: int = 2) -> BwdConfig | None:
    """analytic_config for `dev` (None: the H100's rules): its ring (ring_stages) and EVEN_SLICES' bands."""
    return analytic_config(N, elem_bytes, small_ring=ring_stages(dev), streams=streams,
                           even_slices=even_bands(gpu_model(dev.name) if dev is not None else None))


@functools.lru_cache(maxsize=4096)
def analytic_config(N: int, elem_bytes: int, slice_bytes: int = SLICE_BYTES,
                    vecs_per_thread: int = VECS_PER_THREAD, stages: int | None = None,
                    exact: bool = True, small_ring: int = MIN_STAGES, streams: int = 2,
                    even_slices: tuple[tuple[int, int], ...] | None = EVEN_BANDS_OTHERS) -> BwdConfig | None:
    """The config for rows of N elements of `elem_bytes` (`stages`: that many ring slots instead of the
    rule's; `exact=False`: the padded rule even where an exact tiling exists, for probes; `small_ring`:
    the slots of clusters of up to SMALL_CLUSTER CTAs, ring_stages(dev); `streams` 3: a ring for dh too,
    the residual add's backward, whose slots are the same slices; `even_slices`: the GPU model's
    EVEN_BANDS, None for the 16 KiB rule alone); None where no config fits (a slice ring of MIN_STAGES
    rows over at most CLUSTER_MAX CTAs does not fit shared memory). device_config gives a GPU's."""
    vec = 16 // elem_bytes
    slices = -(-N * elem_bytes // slice_bytes)
    cluster_n = min(CLUSTER_MAX, slices)
    rules = slice_bytes == SLICE_BYTES and vecs_per_thread == VECS_PER_THREAD  # the rule's own slices
    tiling = exact_tiling(N, elem_bytes, slice_bytes) if exact and vecs_per_thread == VECS_PER_THREAD else None
    # WIDE_SLICES: 16-18 slices that FULL_GPC CTAs do not tile exactly
    wide = rules and CLUSTER_MAX <= slices <= WIDE_SLICES and not tiling
    # ONE_A_GPC, probes of other vectors a thread too
    wider = wide or (slice_bytes == SLICE_BYTES and cluster_n in ONE_A_GPC)
    if wider:  # SMALL_CLUSTER CTAs of wider slices, padded
        exact, cluster_n = False, SMALL_CLUSTER
    vectors = -(-(-(-N // cluster_n)) // vec)  # 16-byte vectors of one CTA's slice
    # (ONE_A_GPC's rows come to WIDE_THREADS by this formula; a row of 17-18 slices would come to 512)
    threads = WIDE_THREADS if wide else min(MAX_THREADS, max(32, pow2_ceil(-(-vectors // vecs_per_thread))))
    nvb = -(-vectors // threads)
    cluster_n = -(-N // (vec * threads * nvb))  # slices of whole vectors per thread: no empty CTA
    if rules and cluster_n == SEVEN_PADDED and cluster_n * threads * nvb * vec != N and not wider:
        nvb8 = -(-N // (vec * threads * SMALL_CLUSTER))  # SMALL_CLUSTER CTAs of fewer vectors
        if (SMALL_CLUSTER - 1) * threads * nvb8 * vec < N:  # the last one holds part of the row
            cluster_n, nvb = SMALL_CLUSTER, nvb8
    if exact and tiling and cluster_n * threads * nvb * vec != N:
        cluster_n, threads, nvb = tiling
    if rules and exact and takes_even_slices(N, elem_bytes, even_slices, streams) and not (
            cluster_n * threads * nvb * vec == N and threads * nvb * 16 >= SLICE_BYTES):  # EVEN_SLICES
        return analytic_config(N, elem_bytes, EVEN_SLICE_BYTES, stages=stages, exact=False, small_ring=small_ring,
                               streams=streams, even_slices=None)
    cfg = BwdConfig(cluster_n=cluster_n, threads=threads, nvb=nvb, stages=1, vec=vec, streams=streams)
    room = SMEM_MAX - cfg.smem_bytes(elem_bytes) + streams * -(-cfg.slice_cols * elem_bytes // 128) * 128
    fit = min(MAX_STAGES, room // (streams * cfg.slice_cols * elem_bytes))
    if stages is not None:  # asked for (probes, tests): as long as it fits
        fit = stages if stages <= fit else 0
    elif cluster_n <= SMALL_CLUSTER:
        fit = min(fit, small_ring)
    if fit < MIN_STAGES:
        return None
    return BwdConfig(cluster_n=cluster_n, threads=threads, nvb=nvb, stages=fit, vec=vec, streams=streams)
