"""The tma_smem_cached forward kernel (CuTe DSL): row tiles brought into shared memory by the TMA
engine's bulk copy (`cp.async.bulk`, completed on an mbarrier), reduced with warp shuffles (+ shared
memory across warps, + distributed shared memory across the CTAs of a cluster for long rows), and
normalised from shared memory with 128-bit stores. With a residual (`has_residual`: the fused add,
rms_norm(x, w, residual=r)) r's tile comes in beside x's, and the first pass forms h = x + r (summed in
fp32, rounded once to x's dtype), stores it to global memory and writes it over x's tile: the norm
then runs on h as stored, as the unfused `rms_norm(x + r)` does.

Names follow CuTe's convention: m* whole tensors in global memory, g* a CTA's tile of them, s* shared
memory, t?r?/t?s?/t?g? a thread's partition (in registers, shared, global).

The kernel does not validate; rmsnorm_fwd.py (`unsupported`) and the API layer do. What it assumes: rows of N elements
whose starts are 16-byte aligned (N and x's row stride multiples of 16 bytes / element size, x's base
16-byte aligned), a 16-byte-aligned weight with unit stride, y contiguous; with a residual, r of x's
dtype under the same rule (its own row stride; rows contiguous only if x's are too) and h contiguous
in x's dtype.
"""
from __future__ import annotations

import operator

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64
from cutlass.memory.smem import SmemAllocator

from ._device import (RowTileKernel, add_residual, as_rows, cluster_position, column_predicate,
                      init_mbarriers_and_sync, load_rows, store_f32_to_peer, store_vectors, vector_copy, whole_copies)


class RMSNormFwdTmaSmem(RowTileKernel):
    """y = h * rsqrt(mean(h^2) + eps) * (offset + w) over rows of N, h = x (or x + r, stored), one row
    tile per CTA (a cluster of CTAs per row when cfg.cluster_n > 1). Compile-time (RowTileKernel's):
    dtypes, N, the config (a FwdConfig), weight or not, rstd or not, contiguous rows or not; runtime: M,
    x's row stride, eps, offset. The fused add (h = x + r) is the subclass in add_rmsnorm_fwd_kernel.py:
    the kernel below holds both, by `has_residual`."""

    has_residual = False

    @property
    def operands(self) -> int:
        """Tiles in shared memory: x's (h's after the first pass), and with a residual r's."""
        return 2 if self.has_residual else 1

    # ---- host side ----------------------------------------------------------------------------
    @cute.jit
    def __call__(self, mX: cute.Tensor, mW, mY: cute.Tensor, mRstd, eps: Float32, offset: Float32, stream):
        self._launch(mX, mX, mW, mY, mY, mRstd, eps, offset, stream)  # (r and h: not read without a residual)

    @cute.jit
    def _launch(self, mX: cute.Tensor, mR: cute.Tensor, mW, mY: cute.Tensor, mH: cute.Tensor, mRstd, eps: Float32,
                offset: Float32, stream):
        c = self.cfg
        M = mX.shape[0]
        tiles = cute.ceil_div(M, c.rows)
        self.kernel(mX, mR, mW, mY, mH, mRstd, eps, offset, self._tv_layout()).launch(
            grid=[tiles * c.cluster_n, 1, 1], block=[c.threads, 1, 1],
            cluster=[c.cluster_n, 1, 1] if cutlass.const_expr(c.cluster_n > 1) else None,
            smem=c.smem_bytes(self.elem_bytes, self.N, self.operands), stream=stream)

    # ---- device side --------------------------------------------------------------------------
    @cute.kernel
    def kernel(self, mX: cute.Tensor, mR: cute.Tensor, mW, mY: cute.Tensor, mH: cute.Tensor, mRstd, eps: Float32,
               offset: Float32, tv_layout: cute.Layout):
        c = self.cfg
        N, vec, eb = self.N, self.vec, self.elem_bytes
        cn = c.cluster_n
        tidx, _, _ = cute.arch.thread_idx()
        warp = cute.arch.warp_idx()
        lane = cute.arch.lane_idx()
        rank, tile = cluster_position(cn)
        M = mX.shape[0]
        width = c.tile_cols  # columns of one CTA's tile (>= its valid columns)
        row_stride_s = c.smem_row_stride(N)

        # ---- shared memory: the tile (and r's), the load barrier, the reduction slots ----
        smem = SmemAllocator()
        sX = smem.allocate_tensor(self.x_dtype, cute.make_layout((c.rows, width), stride=(row_stride_s, 1)),
                                  byte_alignment=128)
        sR = sX
        if cutlass.const_expr(self.has_residual):
            sR = smem.allocate_tensor(self.x_dtype, cute.make_layout((c.rows, width), stride=(row_stride_s, 1)),
                                      byte_alignment=128)
        mbar = smem.allocate_array(Int64, num_elems=2, byte_alignment=8)
        groups = c.rows // c.rpg
        sRed = smem.allocate_tensor(Float32, cute.make_layout((groups, c.warps_per_row)), byte_alignment=16)
        sPeer = smem.allocate_tensor(Float32, cute.make_layout((cn,)), byte_alignment=16)

        init_mbarriers_and_sync(tidx, mbar, 2, mbar, 0, cn)

        # ---- TMA bulk loads of the tile (warp 0 issues them) ----
        row0 = tile * c.rows
        rows_valid = cutlass.min(M - row0, c.rows)
        col0 = rank * width
        cols_valid = cutlass.max(cutlass.min(N - col0, width), 0) if cutlass.const_expr(cn > 1) else Int32(N)
        if warp == 0:
            if lane == 0:
                cute.arch.mbarrier_arrive_and_expect_tx(mbar, rows_valid * cols_valid * (eb * self.operands))
            cute.arch.sync_warp()
            mbar_addr = mbar.toint()
            whole = self.contiguous and cn == 1
            load_rows(mX, sX, row0, rows_valid, col0, cols_valid * eb, row_stride_s * eb, whole, lane, mbar_addr)
            if cutlass.const_expr(self.has_residual):
                load_rows(mR, sR, row0, rows_valid, col0, cols_valid * eb, row_stride_s * eb, whole, lane, mbar_addr)

        # ---- one 128-bit copy for shared -> registers and registers -> global ----
        tiler = (c.rpg, width)
        copy_x = vector_copy(self.x_dtype, tv_layout, tiler)
        thr_x = copy_x.get_slice(tidx)

        cT = cute.make_identity_tensor((c.rpg, width))  # (row in group, column in the CTA's tile)
        tXcX = thr_x.partition_S(cT)
        # the vectors every thread holds inside the row; a cluster's CTA knows where its slice ends only
        # at run time (by its rank), so there every vector keeps its predicate
        static_end = N if cutlass.const_expr(cn == 1) else None
        in_row = whole_copies(copy_x.get_slice(c.tpr - 1).partition_S(cT), vec, static_end)
        tXpX = column_predicate(tXcX, vec, cols_valid, whole=in_row)
        row_in_group = tXcX[0][0]
        # the thread's values of one row group, in registers (every group has the same layout)
        tXrX = cute.make_fragment_like(thr_x.partition_S(cute.local_tile(sX, tiler, (0, 0))))
        tRrR = None
        if cutlass.const_expr(self.has_residual):
            tRrR = cute.make_fragment_like(tXrX)
            tRrR.fill(0)  # the vectors past the row stay 0 (the copies below are predicated off there)

        # the weight (+ offset), loaded while the bulk copies fly
        if cutlass.const_expr(self.has_weight):
            mW2 = as_rows(mW, c.rpg)
            gW = cute.local_tile(mW2, tiler, (0, rank))
            copy_w = vector_copy(self.w_dtype, tv_layout, tiler)
            tWgW = copy_w.get_slice(tidx).partition_S(gW)
            tWrW = cute.make_fragment_like(tWgW)
            tWrW.fill(0)
            tWcW = copy_w.get_slice(tidx).partition_S(cT)
            w_vals = 128 // self.w_dtype.width
            w_in_row = whole_copies(copy_w.get_slice(c.tpr - 1).partition_S(cT), w_vals, static_end)
            cute.copy(copy_w, tWgW, tWrW, pred=column_predicate(tWcW, w_vals, cols_valid, whole=w_in_row))
            # the weight's registers seen in x's fragment layout (the same values in the same order:
            # a 16-bit x with an fp32 weight splits each 16-byte vector of x into two of the weight)
            w = cute.make_tensor(tWrW.iterator, tXrX.layout).load().to(Float32) + offset

        cute.arch.mbarrier_wait(mbar, 0)

        for g in cutlass.range_constexpr(groups):
            sXg = cute.local_tile(sX, tiler, (g, 0))
            tXsX = thr_x.partition_S(sXg)
            row = row0 + g * c.rpg + row_in_group
            # pass 1: (h = x + r, stored, and written over x's tile) the sum of squares of the thread's values
            tXrX.fill(0)
            cute.copy(copy_x, tXsX, tXrX, pred=tXpX)
            if cutlass.const_expr(self.has_residual):
                add_residual(copy_x, thr_x, tXsX, thr_x.partition_S(cute.local_tile(sR, tiler, (g, 0))),
                             cute.local_tile(mH, tiler, (tile * groups + g, rank)), tXrX, tRrR, tXpX, row, M,
                             self.x_dtype)
            x = tXrX.load().to(Float32)
            ss = (x * x).reduce(cute.ReductionOp.ADD, Float32(0.0), reduction_profile=0)
            ss = cute.arch.warp_reduction(ss, operator.add, threads_in_group=min(c.tpr, 32))
            if cutlass.const_expr(c.warps_per_row > 1):  # one row per CTA: across its warps
                if lane == 0:
                    sRed[g, warp] = ss  # a slot per group: no barrier needed before the next group writes
                cute.arch.barrier()
                ss = Float32(0.0)
                for i in cutlass.range_constexpr(c.warps_per_row):
                    ss = ss + sRed[g, i]
            if cutlass.const_expr(cn > 1):  # across the cluster: every CTA's sum to every CTA
                if tidx == 0:
                    cute.arch.mbarrier_arrive_and_expect_tx(mbar + 1, cn * 4)
                if warp == 0:
                    if lane < cn:
                        store_f32_to_peer(sPeer.iterator + rank, ss, mbar + 1, lane)
                cute.arch.mbarrier_wait(mbar + 1, 0)
                ss = Float32(0.0)
                for i in cutlass.range_constexpr(cn):
                    ss = ss + sPeer[i]
            rstd = cute.math.rsqrt(ss / N + eps, fastmath=False)
            if cutlass.const_expr(self.store_rstd):
                if tXcX[0][1] == 0 and rank == 0 and row < M:
                    mRstd[row] = rstd
            # pass 2: normalise from shared memory, 128-bit stores of y
            cute.copy(copy_x, tXsX, tXrX, pred=tXpX)
            y = tXrX.load().to(Float32) * rstd
            if cutlass.const_expr(self.has_weight):
                y = y * w
            tYf = cute.make_fragment_like(tXrX, Float32)
            tYf.store(y)
            tYgY = thr_x.partition_D(cute.local_tile(mY, tiler, (tile * groups + g, rank)))
            if row < M:
                store_vectors(copy_x, tYf, cute.make_fragment_like(tXrX, self.x_dtype), tYgY, tXpX)
