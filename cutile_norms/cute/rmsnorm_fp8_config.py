"""The launch config of the FP8-output RMSNorm in CuTe DSL (pure Python: imports without CuTe DSL).

The tile is the tma_smem_cached forward's (rmsnorm_fwd_config.analytic_config) where that is one CTA
per row tile: the same bytes in flight per SM and the same 16-byte vectors per thread, for the same
reasons (docs/design.md); the FP8 epilogue reads the row back from shared memory and writes a byte
per element, so the tile that feeds a copy of the row feeds it too. Rows of up to SLICE_BYTES that the
forward's threads per row pad get an exact tiling over fewer threads per row (`_config`). Rows a
cluster would split (past ONE_CTA_BYTES) are not taken: the FP8 kernels stop at fp8.FP8_KERNEL_MAX_N
columns, well below.

`ring(N, elem_bytes, w_bytes, kind, tiles, sm_count, model)`: how many shared-memory slots a CTA's tiles
go through (the next tile's bulk copies in flight while the CTA works on one), how many tiles a CTA
takes in turn, and whether one slot runs through the tile loop. Measured per GPU model (RING_BY_MODEL:
the H200); one slot and one tile a CTA, straight-line, elsewhere.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

from .rmsnorm_fwd_config import ONE_CTA_BYTES, SLICE_BYTES, TILE_BYTES, FwdConfig, analytic_config

THREADS = 128  # a CTA's threads for rows of up to SLICE_BYTES (the forward's min_threads)
# 16-byte vectors a thread per row at most in the exact tilings below: the fp32 weight and y of 16
# vectors fill the registers (sm_90 ptxas: 1664 as 16 threads x 13 vectors held 217-230, 2 CTAs an SM)
MAX_VECTORS = 8


def fp8_config(N: int, elem_bytes: int, group_size: int | None) -> FwdConfig | None:
    """The config for rows of N elements of `elem_bytes` (None: the kernel does not take them; `refusal`
    says why)."""
    return None if refusal(N, elem_bytes, group_size) else _config(N, elem_bytes)


@functools.lru_cache(maxsize=4096)
def _config(N: int, elem_bytes: int) -> FwdConfig:
    """analytic_config's, except for rows of up to SLICE_BYTES that its threads per row do not tile
    exactly: there the power of two from 16 to THREADS threads per row with the fewest padding vectors
    (at most MAX_VECTORS each; ties to more threads), THREADS / that many rows a pass, as many passes
    as TILE_BYTES holds (at most 16). 2560 bf16 is 64 threads x 5 vectors (was 128 x 3, a sixth
    idle), 3584 64 x 7 (was 128 x 4): on an H200 0.951 / 0.974 of a copy per token against 0.888 /
    0.901 (`python bench/tune/cute_fp8.py`, docs/performance.md 2.17)."""
    cfg = analytic_config(N, elem_bytes)
    vec = 16 // elem_bytes
    vectors = N // vec
    if cfg.cluster_n != 1 or N * elem_bytes > SLICE_BYTES or cfg.tpr * cfg.nvb == vectors:
        return cfg
    fits = [t for t in (16, 32, 64, THREADS) if -(-vectors // t) <= MAX_VECTORS]
    tpr = min(fits, key=lambda t: (t * -(-vectors // t) - vectors, -t))
    if tpr * -(-vectors // tpr) - vectors >= cfg.tpr * cfg.nvb - vectors:
        return cfg
    rpg = THREADS // tpr
    groups = max(1, min(16, TILE_BYTES // (rpg * N * elem_bytes)))
    return FwdConfig(rows=rpg * groups, rpg=rpg, tpr=tpr, nvb=-(-vectors // tpr), cluster_n=1, vec=vec)


def refusal(N: int, elem_bytes: int, group_size: int | None) -> str | None:
    """None where the kernel takes rows of N (with 1 x group_size scales), else why not."""
    vec = 16 // elem_bytes
    if N % vec:
        return f"the CuTe DSL FP8 kernel moves rows in 16-byte bulk copies: N must be a multiple of {vec}, got {N}"
    if N * elem_bytes > ONE_CTA_BYTES:
        return f"the CuTe DSL FP8 kernel holds a row in one CTA's shared memory (up to {ONE_CTA_BYTES} bytes)"
    cfg = _config(N, elem_bytes)
    if group_size and (group_size & (group_size - 1) or N % group_size):
        return f"1 x g group scales need g a power of two dividing N, got g={group_size} at N={N}"
    if group_size and (group_size % vec or group_size // vec > min(cfg.tpr, 32) or cfg.nvb > group_size // vec):
        return (f"the CuTe DSL FP8 kernel reduces a 1 x {group_size} group over the lanes of one warp that "
                f"hold it, one group's scale per lane: groups of {vec * max(1, cfg.nvb)}-{vec * min(cfg.tpr, 32)} "
                f"columns at N={N}")
    return None


REGISTERS_PER_SM = 65536  # sm_90 and sm_100 alike
HELD_BESIDE_Y = 32  # registers a thread needs beside y's values across the amax's reduction (see min_ctas)


def min_ctas(cfg: FwdConfig, kind: str, has_residual: bool) -> int:
    """The CTAs an SM the kernel asks ptxas to fit in registers (minctasm), 0 for ptxas's own choice.

    Where a thread holds more vectors of a row than MAX_VECTORS (rows past the ring's: 16-bit rows of
    9-16 K columns) with dynamic scales and no residual, y's values (vec a vector, fp32) stay live
    across the amax's reduction, and the rest of what a thread holds there (addresses, predicates, the
    reduction's values) takes up to HELD_BESIDE_Y: the bound is the CTAs an SM at which y + 32 fit.
    Left alone, ptxas's register count moves by whole allocation steps with small code changes: 12288
    in groups without an offset took 158 registers (3 CTAs an SM, 0.934 of a copy on an H200) against
    128 (4, 0.975) with this bound, and y + 32 is at or above what ptxas takes at every such form of
    9-16 vectors (sm_90a, no spills; the CPU suite checks it). Elsewhere ptxas chooses: in the ring's forms (at most
    MAX_VECTORS) the same bound spilled (5120-7168: 22-40 bytes; two slots' and row groups' addresses
    take more than 32), with a residual the add's values come on top (spills at every such width), and
    a given scale holds no y across a reduction (56-128 registers, which the bound would raise); fp32
    rows are not measured with a bound."""
    V = cfg.nvb * (cfg.rows // cfg.rpg)
    if kind == "static" or has_residual or V <= MAX_VECTORS or cfg.vec != 8:
        return 0
    need = -(-(cfg.vec * V + HELD_BESIDE_Y) // 8) * 8  # (ptxas allocates registers in steps of 8 a thread)
    return REGISTERS_PER_SM // (cfg.threads * need)


@dataclass(frozen=True)
class Ring:
    """`stages` shared-memory slots for rows of up to `max_row_bytes` (`static_max_row_bytes` at a given
    per-tensor scale; compiled in: the same kernel at every M), and `per_cta` tiles a CTA where the
    launch has at least `min_waves` x the SMs' count of CTAs that way (fewer tiles, as at decode sizes:
    one a CTA, its slot to spare; not measured there)."""
    stages: int = 2
    per_cta: int = 2  # (the kernel refills a slot only when a CTA has more tiles than slots: none here)
    max_row_bytes: int = SLICE_BYTES
    static_max_row_bytes: int = 4096  # at a given per-tensor scale
    min_waves: int = 8


# The H200 (bf16, 2^27 elements, medians of 3 against a same-run copy, docs/performance.md 2.50; `python
# bench/tune/cute_fp8.py --rings 1x1,1x1l,2x2,2x4,3x4`): one tile a CTA leaves each CTA's load latency, its
# set-up and the weight's loads on its own path, which an H200, moving 1.43x an H100's bytes with the same
# SMs, does not hide.
#   * Two tiles a CTA through 2 slots measured 0.954-0.988 per token at the model widths of 896-8192
#     against 0.908-0.968 one a CTA, and 0.930-0.981 against 0.893-0.965 in groups at 896-4096; at random
#     widths 1304 / 2552 / 6664 per token 0.894 / 0.974 / 0.953 against 0.815 / 0.918 / 0.919.
#   * Groups take the same rule since their amax's transposed reduction (rmsnorm_fp8_kernel: 12 shuffles
#     a thread at 12288 against 48): at 4097-8192 columns 2x2 measured 0.949-0.979 at 5120 / 6144 /
#     7168 / 8192 / 7808 in two runs against 0.930-0.969 one tile a CTA, and at the padded random widths
#     4480 / 5504 0.900-0.907 / 0.944 against 0.865-0.871 / 0.842 (performance.md 2.51). Before it the
#     ring lost at 5120-7168 with the groups' longer shuffle chains and groups kept one tile a CTA there.
#   * Four tiles a CTA lost from 2048 columns (0.92-0.96 per token) and three slots more (0.87-0.94: a
#     third slot costs CTAs an SM). Past 16 KiB rows (28-32 KiB a tile) every ring lost to one tile a CTA
#     (14336 per token 0.931 / 0.912 with 2 / 4 tiles against 0.957; 16384 0.931 against 0.972; cause not
#     measured).
#   * At a given per-tensor scale the ring stops at 4 KiB rows (2048 16-bit columns): 2x2 against one
#     tile a CTA measured 0.983 / 0.949 at 896 and 0.983 / 0.972 at 1536, level at 2048 (0.965), and lost
#     at every width of 2560-8192 (0.950-0.964 against 0.969-0.980, 7 widths; performance.md 2.51): a
#     static tile is the shortest (no amax pass, one row reduction), so past the narrow rows, whose many
#     short tiles leave each CTA's set-up and load latency exposed, more CTAs an SM of one tile each hide
#     it better than a second slot. Past 16 KiB it stays straight-line too (0.968-0.974 against
#     0.960-0.970 through the tile loop at 10240-16384).
#   * Past the ring's rows, per token and in groups with a 16-bit weight, the one tile a CTA runs through
#     the same tile loop (one slot, one pass): per token 10240 / 14336 0.962-0.969 / 0.951-0.961 against
#     0.943-0.948 / 0.919-0.929 straight-line (the kernel before the ring, same runs), 12288 / 16384 level;
#     groups 0.951-0.981 at 9600-16384 (6 widths, 2 random) against 0.930-0.964 straight-line (2.51). An
#     fp32 weight stays straight-line (not measured through the loop; it held 184 registers at 16384 in
#     groups against 166, sm_90a ptxas).
#   * The H100 (0.98-1.00 one tile a CTA) is not measured with a ring and keeps the straight-line kernel.
#   * 16-bit rows: fp16 moves bf16's bytes through the same code (not measured apart); an fp32 weight
#     beside them takes the ring too (its registers do not grow: the weight is loaded at each tile; not
#     measured for speed); fp32 rows keep one slot (not measured with the ring).
# What is compiled in (the stages, the loop) depends on N, the dtypes and the kind alone, so that a kernel
# warmed up at one M serves every M; fewer tiles than 8 waves of two-tile CTAs (decode sizes, and launches up
# to about 2100 tiles) take one tile a CTA from the same kernel, its second slot unused (not measured).
RING_BY_MODEL = {"H200": Ring()}


def ring_applies(N: int, elem_bytes: int, model: str, kind: str = "token") -> bool:
    """Whether GPU `model`'s CuTe DSL FP8 kernel takes rows of N elements of `elem_bytes` with scales of
    `kind` ("token", "group" or "static") through a ring of slots (16-bit rows only: fp32 rows are not
    measured with it; fp16 moves the bytes bf16 does, through the same code)."""
    r = RING_BY_MODEL.get(model)
    if r is None or elem_bytes != 2:
        return False
    return N * elem_bytes <= (r.static_max_row_bytes if kind == "static" else r.max_row_bytes)


def ring(N: int, elem_bytes: int, w_bytes: int, kind: str, tiles: int, sm_count: int,
         model: str) -> tuple[int, int, bool]:
    """(stages, tiles a CTA, whether the tile loop is compiled with one slot) for `tiles` row tiles of N
    elements (a weight of `w_bytes` an element, scales of `kind`: "token", "group" or "static") on
    `sm_count` SMs of GPU `model` (gpu_model's name); all but the tiles a CTA depend on N, the dtypes,
    the kind and the model alone."""
    r = RING_BY_MODEL.get(model)
    if not ring_applies(N, elem_bytes, model, kind):
        # past the ring's rows one tile a CTA; on a ring's GPU dynamic scales through the tile loop (16-bit x
        # and weight)
        return 1, 1, r is not None and elem_bytes == 2 and w_bytes == 2 and kind != "static"
    return r.stages, (r.per_cta if tiles >= r.min_waves * r.per_cta * sm_count else 1), True
