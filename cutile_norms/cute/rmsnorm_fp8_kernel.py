"""RMSNorm (optionally after the residual add) with an FP8 output, in CuTe DSL: row tiles brought into
shared memory by TMA bulk copies, as the tma_smem_cached forward does (rmsnorm_fwd_kernel.py), and
quantized from there. Its launch config in rmsnorm_fp8_config.py, the wrapper in rmsnorm_fp8.py.

    h = x + r (optional; rounded to x's dtype, stored)     y = h * rstd * (offset + w)   (fp32; at offset 0,
    h * rstd * w: the weight as it is, as torch's RMSNorm multiplies it (a -0.0 weight keeps its sign))
    q = fp8(y * (1 / s))      s: a given per-tensor scale, or per row, or per 1 x GROUP columns

The same contract as the Triton kernel (triton/rmsnorm_fp8_kernel.py), bit for bit given the kernel's
rstd: the dynamic scales follow `reference.fp8_scale` (max(min(amax, ub), 1e-12) / the format's
largest value by IEEE division, UE8M0 rounded up from the bits, NaN where the amax is NaN), q follows
`reference.fp8_quantize` (the reciprocal by IEEE division once per scale, one multiply per element,
cvt.rn.satfinite: round to nearest even, saturate to the format's largest value, NaN kept). These are
written as inline PTX (rmsnorm_fp8_ops.py) so that no compiler choice can change the bits.

Why a second kernel: a Triton block is a power of two, so rows it pads leave lanes idle (0.76-0.93 of
a copy on an H100 at 2560-14336), and on an H200 a thread's registers hold too few bytes in flight past
4096 columns (docs/performance.md 2.17). Here a row is any multiple of 16 bytes, held whole in shared
memory (the bulk copies keep its bytes in flight without registers), and each thread owns 16-byte
vectors of it: a row of 10240 bf16 is 128 threads x 10 vectors, no padding.

A CTA takes `per_cta` row tiles in turn (a runtime argument) through a ring of `stages` shared-memory
slots (compiled in): the next tiles' bulk copies are in flight while it works on one, and a barrier
frees a slot before warp 0 refills it (one slot: the tiles in turn through it, none in flight ahead).
Straight-line (not `looped`, one slot) a CTA takes one tile whatever `per_cta` says.
rmsnorm_fp8_config.ring says which: on an H200 2 slots and 2 tiles a CTA at 16-bit rows of up to 16 KiB
(4 KiB at a given scale) where the launch is large, else one tile a CTA; dynamic scales past them one slot
through the tile loop; straight-line elsewhere.

Passes over a tile in shared memory (each thread reads back only its own vectors, so no barrier):
  1. (with a residual) h = x + r, stored to global memory and written over x; the sum of squares;
  2. y, kept in registers to the end; per-token scales: its amax (a NaN-propagating max per vector,
     a tree over the vectors, then across the row's threads), the scale and its reciprocal;
  3. y times the reciprocal of its scale, converted and stored 8 (16-bit x) or 4 (fp32 x) bytes at a
     time. With 1 x GROUP scales a group is GROUP / vec adjacent lanes at the same vector index,
     reduced by a transposed warp-shuffle reduction that leaves each of the thread's vectors' group
     amax on one lane of the group; that lane computes the scale and its reciprocal and the others
     fetch it (`_group_reciprocals`).

The kernel does not validate; rmsnorm_fp8.py (`unsupported`) and the API layer do. What it assumes:
rows of N (a multiple of 16 bytes) whose starts are 16-byte aligned, whole row tiles per CTA (no
cluster), a weight with unit stride 16-byte aligned, q and h contiguous, GROUP / vec lanes within a
row's threads and a warp, and at most GROUP / vec vectors a thread (rmsnorm_fp8_config.refusal).
"""
from __future__ import annotations

import operator

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64
from cutlass.memory.smem import SmemAllocator

from ._device import (RowTileKernel, add_residual, as_rows, column_predicate, init_mbarriers_and_sync, load_rows,
                      vector_copy)
from .rmsnorm_fp8_ops import (asm_f32, fp8x4, max_abs_nan, max_nan, opaque_b32, rcp_rn, scale_asm, select_eq,
                              store_words, transposed_plan, transposed_reduce)
from .rmsnorm_fwd_config import FwdConfig

STATIC, TOKEN, GROUP = "static", "token", "group"


@cute.jit
def _store_scale(mS: cute.Tensor, idx: Int64, s: Float32, store: Int32, col: Int32, N: cutlass.Constexpr[int],
                 row: Int32, M: Int32):
    """mS[idx] = s by the one lane (`store` nonzero) that stores a group's scale, of a row in the tensor."""
    if store != 0 and col < N and row < M:
        mS[idx] = s


def _tree_max(parts: list):
    """max.NaN over `parts` as a tree (trace-time Python: a dependency chain log2(len) long)."""
    while len(parts) > 1:
        parts = [max_nan(parts[u], parts[u + 1]) if u + 1 < len(parts) else parts[u] for u in range(0, len(parts), 2)]
    return parts[0]


def _vectors(tA: cute.Tensor, vec: int):
    """The (i, j, k) index of each 16-byte vector of a thread's partition (vec values each)."""
    return [(i, j, k) for i in range(cute.size(tA, mode=[0]) // vec) for j in range(cute.size(tA, mode=[1]))
            for k in range(cute.size(tA, mode=[2]))]


class RMSNormFp8TmaSmem(RowTileKernel):
    """q = fp8(rms_norm(h) * (1 / s)) over rows of N, row tiles in turn per CTA. Compile-time: dtypes, N,
    the config, the scales' kind (STATIC, TOKEN, GROUP) and their options, weight, residual, rstd,
    contiguous rows, the ring's slots and the tile loop, whether there is an offset (nonzero), the CTAs
    an SM the registers must allow (rmsnorm_fp8_config.min_ctas); runtime: M, the row strides, eps, the
    offset, the amax's upper bound, the tiles a CTA (straight-line: 1, whatever is passed). (A 1 x GROUP
    group is GROUP / vec adjacent lanes at one vector index of the tile's layout, `row_tv_layout`.)"""

    def __init__(self, x_dtype, w_dtype, N: int, cfg: FwdConfig, kind: str, group: int, e4m3: bool, top: float,
                 min_amax: float, has_ub: bool, ue8m0: bool, has_weight: bool, has_residual: bool,
                 store_rstd: bool, contiguous: bool, stages: int = 1, looped: bool = False, has_offset: bool = True,
                 min_ctas: int = 0):
        super().__init__(x_dtype, w_dtype, N, cfg, has_weight, store_rstd, contiguous)
        self.kind, self.group, self.e4m3 = kind, group, e4m3
        self.scale_ptx = scale_asm(top, min_amax, has_ub, ue8m0)
        self.has_residual = has_residual
        self.stages = stages
        self.looped = looped or stages > 1  # the tile loop compiled (with one slot it runs once: per_cta is 1)
        self.has_offset = has_offset  # (without one, offset + w is w: no add)
        self.min_ctas = min_ctas  # CTAs an SM ptxas must fit in registers (0: its own choice)

    # ---- host side ----------------------------------------------------------------------------
    def smem_bytes(self) -> int:
        c = self.cfg
        slot = c.rows * self.N * self.elem_bytes
        ring = -(-((self.stages - 1) * slot + ((c.rows - 1) * self.N + c.tile_cols) * self.elem_bytes) // 128) * 128
        groups = c.rows // c.rpg
        return ring * (2 if self.has_residual else 1) + 16 * self.stages + 2 * 4 * self.stages * groups * (
            c.threads // 32) + 64

    @cute.jit
    def __call__(self, mX: cute.Tensor, mR: cute.Tensor, mW, mQ: cute.Tensor, mH: cute.Tensor, mS: cute.Tensor,
                 mScale: cute.Tensor, mRstd: cute.Tensor, eps: Float32, offset: Float32, scale_ub: Float32,
                 per_cta: Int32, stream):
        c = self.cfg
        M = mX.shape[0]
        grid = cute.ceil_div(M, c.rows)
        if cutlass.const_expr(self.looped):  # (straight-line: one tile a CTA, whatever per_cta says)
            grid = cute.ceil_div(grid, per_cta)
        # (a register bound: the DSL's minctasm; a carveout given spares it a device query at compile time)
        bound = {"min_blocks_per_mp": self.min_ctas, "preferred_smem_carveout": 100} if self.min_ctas else {}
        self.kernel(mX, mR, mW, mQ, mH, mS, mScale, mRstd, eps, offset, scale_ub, per_cta, self._tv_layout()).launch(
            grid=[grid, 1, 1], block=[c.threads, 1, 1], smem=self.smem_bytes(), stream=stream, **bound)

    # ---- device side --------------------------------------------------------------------------
    @cute.jit
    def _scale(self, amax: Float32, scale_ub: Float32) -> Float32:
        return asm_f32(self.scale_ptx, "=f,f,f", amax, scale_ub)

    @cute.jit
    def _fill(self, mX: cute.Tensor, mR: cute.Tensor, sX: cute.Tensor, sR: cute.Tensor, mbar, s: Int32, tile: Int32,
              M: Int32, lane: Int32):
        """(Warp 0) tile `tile`'s rows of x (and r) into ring slot s by bulk copies, completing on the
        slot's mbarrier."""
        c = self.cfg
        N, eb = self.N, self.elem_bytes
        row0 = tile * c.rows
        rows_valid = cutlass.min(M - row0, c.rows)
        operands = 2 if cutlass.const_expr(self.has_residual) else 1
        if lane == 0:
            cute.arch.mbarrier_arrive_and_expect_tx(mbar + s, rows_valid * (N * eb * operands))
        cute.arch.sync_warp()
        mbar_addr = (mbar + s).toint()
        slot = cute.local_tile(sX, (c.rows, c.tile_cols), (s, 0))
        load_rows(mX, slot, row0, rows_valid, 0, N * eb, N * eb, self.contiguous, lane, mbar_addr)
        if cutlass.const_expr(self.has_residual):
            load_rows(mR, cute.local_tile(sR, (c.rows, c.tile_cols), (s, 0)), row0, rows_valid, 0, N * eb, N * eb,
                      self.contiguous, lane, mbar_addr)

    @cute.kernel
    def kernel(self, mX: cute.Tensor, mR: cute.Tensor, mW, mQ: cute.Tensor, mH: cute.Tensor, mS: cute.Tensor,
               mScale: cute.Tensor, mRstd: cute.Tensor, eps: Float32, offset: Float32, scale_ub: Float32,
               per_cta: Int32, tv_layout: cute.Layout):
        c = self.cfg
        N = self.N
        S = self.stages
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        warp = cute.arch.warp_idx()
        lane = cute.arch.lane_idx()
        M = mX.shape[0]
        width = c.tile_cols
        groups = c.rows // c.rpg
        first_tile = bidx
        n_tiles = Int32(1)
        if cutlass.const_expr(self.looped):  # this CTA's tiles, in order (straight-line: one, as the grid has it)
            first_tile = bidx * per_cta
            n_tiles = cutlass.min(per_cta, cute.ceil_div(M, c.rows) - first_tile)

        # ---- shared memory: a ring of S tiles (and r's), a barrier per slot, the reduction slots ----
        smem = SmemAllocator()
        ring = cute.make_layout((S * c.rows, width), stride=(N, 1))  # slot s: rows [s * rows, (s + 1) * rows)
        sX = smem.allocate_tensor(self.x_dtype, ring, byte_alignment=128)
        sR = sX
        if cutlass.const_expr(self.has_residual):
            sR = smem.allocate_tensor(self.x_dtype, ring, byte_alignment=128)
        mbar = smem.allocate_array(Int64, num_elems=S, byte_alignment=8)
        # a slot per (ring slot, row group, warp of the row): rows of 64-128 threads come two or more to a
        # pass (rmsnorm_fp8_config's exact tilings), each over its own warps; a ring slot's reduction slots
        # are next written S tiles later, after the barrier that frees the slot
        slots = cute.make_layout((S * groups, c.threads // 32))
        sRed = smem.allocate_tensor(Float32, slots, byte_alignment=16)
        sMax = smem.allocate_tensor(Float32, slots, byte_alignment=16)
        init_mbarriers_and_sync(tidx, mbar, S, mbar, 0, 1)

        # ---- TMA bulk loads of the first S tiles (warp 0 issues them) ----
        if warp == 0:
            for s in cutlass.range_constexpr(S):
                if s < n_tiles:
                    self._fill(mX, mR, sX, sR, mbar, Int32(s), first_tile + s, M, lane)

        # ---- one 128-bit copy for shared -> registers (and h's registers -> global) ----
        tiler = (c.rpg, width)
        copy_x = vector_copy(self.x_dtype, tv_layout, tiler)
        cT = cute.make_identity_tensor((c.rpg, width))  # (row in group, column)
        tXsX0 = copy_x.get_slice(tidx).partition_S(cute.local_tile(sX, tiler, (0, 0)))  # (the fragments' shape)

        inv = Float32(0.0)
        if cutlass.const_expr(self.kind == STATIC):  # one reciprocal, IEEE division
            inv = rcp_rn(mScale[0])
        q_base = mQ.iterator.toint()
        if cutlass.const_expr(not self.looped):
            # one tile a CTA (the launch's per_cta is 1), straight-line (rmsnorm_fp8_config.ring says where)
            self._tile(Int32(0), mX, mR, mW, mQ, mH, mS, mRstd, sX, sR, mbar, sRed, sMax, eps, offset, scale_ub,
                       tv_layout, copy_x, cT, tXsX0, inv, q_base, tidx, warp, lane, M, first_tile, n_tiles)
        else:
            for i in cutlass.range(n_tiles, unroll=1):
                self._tile(i, mX, mR, mW, mQ, mH, mS, mRstd, sX, sR, mbar, sRed, sMax, eps, offset, scale_ub,
                           tv_layout, copy_x, cT, tXsX0, inv, q_base, tidx, warp, lane, M, first_tile, n_tiles)

    @cute.jit
    def _tile(self, i: Int32, mX: cute.Tensor, mR: cute.Tensor, mW, mQ: cute.Tensor, mH: cute.Tensor,
              mS: cute.Tensor, mRstd: cute.Tensor, sX: cute.Tensor, sR: cute.Tensor, mbar, sRed: cute.Tensor,
              sMax: cute.Tensor, eps: Float32, offset: Float32, scale_ub: Float32, tv_layout: cute.Layout, copy_x,
              cT: cute.Tensor, tXsX0: cute.Tensor, inv: Float32, q_base: Int64, tidx: Int32, warp: Int32,
              lane: Int32, M: Int32, first_tile: Int32, n_tiles: Int32):
        """The CTA's i-th tile, in ring slot i % stages: wait for its bulk copies, quantize its rows, and
        (a ring) refill the slot with the tile `stages` ahead."""
        c = self.cfg
        N, vec, S = self.N, self.vec, self.stages
        groups = c.rows // c.rpg
        tiler = (c.rpg, c.tile_cols)
        words = vec // 4  # 32-bit words of q per vector
        s = i % S
        tile = first_tile + i
        row0 = tile * c.rows
        # with a ring, the thread's index through an opaque move: its vectors' coordinates, predicates and
        # addresses derived at each tile, not hoisted out of the loop and held (sm_90a ptxas, 14336 per
        # token without a weight: 167 registers against 128)
        t_i = opaque_b32(tidx) if cutlass.const_expr(S > 1) else tidx
        thr_x = copy_x.get_slice(t_i)
        tXcX = thr_x.partition_S(cT)
        tXpX = column_predicate(tXcX, vec, Int32(N))
        row_in_group = tXcX[0][0]
        w_t = offset
        if cutlass.const_expr(self.has_weight):
            # loaded while the tile's bulk copies complete; with a ring at each tile (from L1: every CTA of the
            # SM reads it), not held: held across the tile loop (in its own dtype) it took 194-255 registers
            # at 14336-16384 (sm_90a ptxas) against 128-154 without a weight
            w_t = self._weight(tv_layout, tiler, cT, cute.make_fragment_like(tXsX0).layout, t_i, mW, offset)
        cute.arch.mbarrier_wait(mbar + s, (i // S) % 2)
        for g in cutlass.range_constexpr(groups):
            # the fragments made per row group: nothing is carried from one tile to the next
            tXrX = cute.make_fragment_like(tXsX0)
            tXrX.fill(0)  # the vectors past N stay 0: they add nothing to a sum or an amax
            tRrR = cute.make_fragment_like(tXrX)
            tRrR.fill(0)
            tYrY = cute.make_fragment_like(tXrX, Float32)
            tXsX = thr_x.partition_S(cute.local_tile(sX, tiler, (s * groups + g, 0)))
            row = row0 + g * c.rpg + row_in_group
            red = s * groups + g  # this group's reduction slots
            # pass 1: (h = x + r, stored and kept in shared memory over x) the sum of squares
            cute.copy(copy_x, tXsX, tXrX, pred=tXpX)
            if cutlass.const_expr(self.has_residual):
                tRsR = thr_x.partition_S(cute.local_tile(sR, tiler, (s * groups + g, 0)))
                add_residual(copy_x, thr_x, tXsX, tRsR, cute.local_tile(mH, tiler, (tile * groups + g, 0)), tXrX,
                             tRrR, tXpX, row, M, self.x_dtype)
            x = tXrX.load().to(Float32)
            ss = (x * x).reduce(cute.ReductionOp.ADD, Float32(0.0), reduction_profile=0)
            ss = self._row_reduce(ss, False, sRed, red, warp, lane)
            rstd = cute.math.rsqrt(ss / N + eps, fastmath=False)
            if cutlass.const_expr(c.warps_per_row == 1):
                # the row's reduction was a warp's shuffles alone (no CTA barrier, as wider rows have): a warp
                # barrier keeps the next pass's shared loads after it. Without it ptxas hoists them above
                # the shuffles and holds both passes' values (sm_90a: 896 in groups 149 registers against
                # 96, 3 CTAs an SM against 5; H200 0.937 -> 0.978 of a copy, docs/performance.md 2.53)
                cute.arch.sync_warp()
            if cutlass.const_expr(self.store_rstd):
                if tXcX[0][1] == 0 and row < M:
                    mRstd[row] = rstd
            if cutlass.const_expr(self.kind == TOKEN):
                # pass 2: the row's amax, its scale and the scale's reciprocal
                self._normed(tXsX, tXrX, tXpX, copy_x, tYrY, rstd, w_t)
                # a vector's amax, then a tree over the vectors: one chain over all of them made ptxas hold
                # more (sm_90, 16384: 229 registers against 158, 2 CTAs per SM against 3; H200 0.85
                # against 0.97 of a copy, docs/performance.md 2.17)
                amax = self._row_reduce(_tree_max(list(self._vector_amaxes(tYrY))), True, sMax, red, warp, lane)
                s_row = self._scale(amax, scale_ub)
                inv = rcp_rn(s_row)
                if tXcX[0][1] == 0 and row < M:
                    mS[row] = s_row
            # pass 3 (with per-token scales y is still in registers from pass 2): quantized, stored
            if cutlass.const_expr(self.kind != TOKEN):
                self._normed(tXsX, tXrX, tXpX, copy_x, tYrY, rstd, w_t)
            q_row = q_base + Int64(row) * N
            if cutlass.const_expr(self.kind == GROUP):
                inv_v = self._group_reciprocals(tYrY, tXcX, mS, scale_ub, row, lane, M)
            for v, (a, j, k) in enumerate(_vectors(tXcX, vec)):
                col = tXcX[a * vec, j, k][1]
                if cutlass.const_expr(self.kind == GROUP):
                    inv = inv_v[v]
                ws = [fp8x4(tYrY[a * vec + 4 * u, j, k] * inv, tYrY[a * vec + 4 * u + 1, j, k] * inv,
                            tYrY[a * vec + 4 * u + 2, j, k] * inv, tYrY[a * vec + 4 * u + 3, j, k] * inv,
                            self.e4m3) for u in range(words)]
                if col < N and row < M:
                    store_words(q_row + col, ws[0], ws[1] if words == 2 else None)
        # the slot is read by every thread (and h written over it): refill it with the tile S ahead
        if cutlass.const_expr(self.looped) and i + S < n_tiles:
            if cutlass.const_expr(self.has_residual):  # h's stores into the slot before the bulk copies
                cute.arch.fence_proxy("async.shared", space="cta")
            cute.arch.barrier()
            if warp == 0:
                self._fill(mX, mR, sX, sR, mbar, s, tile + S, M, lane)

    @cute.jit
    def _weight(self, tv_layout: cute.Layout, tiler: cutlass.Constexpr, cT: cute.Tensor, x_frag: cute.Layout,
                tidx: Int32, mW: cute.Tensor, offset: Float32):
        """offset + w (without an offset, w) in fp32 over the thread's vectors, in x's fragment order
        (`x_frag`: its layout)."""
        copy_w = vector_copy(self.w_dtype, tv_layout, tiler)
        thr_w = copy_w.get_slice(tidx)
        tWgW = thr_w.partition_S(cute.local_tile(as_rows(mW, tiler[0]), tiler, (0, 0)))
        tWrW = cute.make_fragment_like(tWgW)
        tWrW.fill(0)
        cute.copy(copy_w, tWgW, tWrW, pred=column_predicate(thr_w.partition_S(cT), 128 // self.w_dtype.width,
                                                             Int32(self.N)))
        w = cute.make_tensor(tWrW.iterator, x_frag).load().to(Float32)
        return w + offset if cutlass.const_expr(self.has_offset) else w

    def _vector_amaxes(self, tYrY: cute.Tensor):
        """Each of the thread's vectors' amax, max.NaN of |y| over its vec values, in `_vectors` order
        (generated)."""
        vec = self.vec
        for i, j, k in _vectors(tYrY, vec):
            a = Float32(0.0)
            for e in range(vec):
                a = max_abs_nan(a, tYrY[i * vec + e, j, k])
            yield a

    def _group_reciprocals(self, tYrY: cute.Tensor, tXcX: cute.Tensor, mS: cute.Tensor, scale_ub: Float32,
                           row: Int32, lane: Int32, M: Int32):
        """The reciprocal of the scale of each of the thread's vectors' groups (a list, one per vector);
        the scales stored. A group is L = GROUP / vec adjacent lanes at one vector index. Its amax is a
        transposed shuffle reduction over them (`transposed_plan`): at each level a lane keeps half of
        the vectors still to reduce and each shuffle carries one of the other half, so a thread of V
        vectors shuffles about V times instead of V log2(L) (12288 bf16: 12 against 48), and
        ends holding one vector's group amax (the config keeps V <= L). That lane computes the group's
        scale and reciprocal (each a multi-instruction IEEE sequence) and the first lane holding it
        stores the scale; every lane fetches its vectors' reciprocals from those lanes."""
        vec, N, G = self.vec, self.N, self.group
        L = G // vec
        vals = list(self._vector_amaxes(tYrY))
        cols = [Int32(tXcX[i * vec, j, k][1]) for i, j, k in _vectors(tXcX, vec)]
        held, source = transposed_plan(len(vals), L)
        a_p, c_p = transposed_reduce(vals, cols, L, lambda o: (lane // o) % 2,
                                     lambda c, a, b: select_eq(c, Int32(0), a, b),
                                     lambda v, o: cute.arch.shuffle_sync_bfly(v, offset=o), max_nan)
        p = lane % L
        stores = sum(1 << q for q in range(L) if source[held[q]] == q)  # the first lane holding each slot
        s = self._scale(a_p, scale_ub)
        inv_p = rcp_rn(s)
        _store_scale(mS, Int64(row) * (N // G) + c_p // G, s, (Int32(stores) >> p) & 1, c_p, N, row, M)
        first = lane - p
        return [cute.arch.shuffle_sync(inv_p, offset=first + source[v]) for v in range(len(source))]

    def _normed(self, tXsX, tXrX, tXpX, copy_x, tYrY, rstd, w):
        """y = h * rstd * (offset + w) in fp32 (w: `_weight`'s, without an offset the weight as it is), in this
        order (the reference's), into tYrY."""
        cute.copy(copy_x, tXsX, tXrX, pred=tXpX)
        y = tXrX.load().to(Float32) * rstd
        if self.has_weight:
            y = y * w
        tYrY.store(y)

    @cute.jit
    def _row_reduce(self, v: Float32, use_max: cutlass.Constexpr[bool], sSlots: cute.Tensor, g: Int32, warp: Int32,
                    lane: Int32) -> Float32:
        """v summed (or with `use_max` its NaN-propagating max) over a row's threads: warp shuffles, then
        (a row over several warps) the warps' values through shared memory (a slot per ring slot, row
        group and warp, `g` naming the first two, so no barrier before the next group writes; a row's
        warps are adjacent, the first at warp - warp % warps_per_row)."""
        c = self.cfg
        op = max_nan if cutlass.const_expr(use_max) else operator.add
        v = cute.arch.warp_reduction(v, op, threads_in_group=min(c.tpr, 32))
        if cutlass.const_expr(c.warps_per_row > 1):
            if lane == 0:
                sSlots[g, warp] = v
            cute.arch.barrier()
            first = warp - warp % c.warps_per_row
            v = sSlots[g, first]
            for i in cutlass.range_constexpr(1, c.warps_per_row):
                v = op(v, sSlots[g, first + i])
        return v
