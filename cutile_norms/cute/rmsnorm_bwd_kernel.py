"""The tma_smem_cached backward kernel (CuTe DSL): a persistent grid of clusters, each cluster walking
rows c, c + C, ... with one CTA per slice of columns. A row's slices of x and dy come into a ring of
shared-memory slots by TMA bulk copies issued `stages - 1` rows ahead; each CTA reduces its share of
sum(x * w' * dy), the cluster's CTAs exchange their shares through distributed shared memory (one
st.async per peer), and dx is computed from shared memory and stored with 128-bit stores. dw stays in
fp32 registers per CTA for the whole launch; at the end each cluster writes its partial row, and the
last `reducers` CTAs of the grid to arrive (an atomic ticket) each sum a share of the column tiles over
the partials in cluster order: dw is deterministic (no float atomics).

    x^ = x * rstd,  g = w' * dy (w' = offset + w; g = dy without a weight)
    dx = rstd * (g - x^ * mean(x^ * g)) = rstd * g - x * rstd^3 * sum(x * g) / N   [+ dh]
    dw = sum over rows of dy * x^

With `has_dh` (the residual add's backward, x being h = x + r) a third ring of the same slots brings
the row's dh, the grad h receives from later layers, which is added to dx before it is rounded: one
pass over dy, h and dh writing one grad (4 M N e bytes, where the norm's backward then an add move 6).

Names follow CuTe's convention: m* whole tensors in global memory, g* a CTA's tile of them, s* shared
memory, t?r?/t?s?/t?g? a thread's partition (in registers, shared, global).

The kernel does not validate; rmsnorm_bwd.py (`unsupported`) and the API layer do. What it assumes:
rows of x and dy whose starts are 16-byte aligned (N and both row strides multiples of 16 bytes /
element size, the bases 16-byte aligned), rstd [M] fp32 contiguous, a 16-byte-aligned weight with unit
stride, dx contiguous, the partials [clusters, N] fp32 and two zeroed int32 counters (mTicket[0],
mTicket[1]; the last reducer sets them back to 0). Its config's slices cover the row and leave no CTA
without a column of it (only the last slice may end inside the row): the constructor checks both.
"""
from __future__ import annotations

import operator

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64
from cutlass.memory.smem import SmemAllocator

from ._device import (as_rows, bulk_copy_g2s, cluster_position, column_predicate, init_mbarriers_and_sync,
                      row_tv_layout, store_f32_to_peer, store_vectors, vector_copy, whole_copies)
from .rmsnorm_bwd_config import BwdConfig, reduction_shape


def _fill_slot(mbar, mbar_addr, rings, s, row, slot_bytes, nbytes):
    """(One thread) row `row`'s slices, `nbytes` each, into slot s of each ring ((shared base, global
    base, global row stride) of x's, dy's, and dh's where it is read), completing on the slot's mbarrier."""
    cute.arch.mbarrier_arrive_and_expect_tx(mbar, len(rings) * nbytes)
    for s_base, g_base, g_stride in rings:
        bulk_copy_g2s(s_base + s * slot_bytes, g_base + row * g_stride, nbytes, mbar_addr)


class RMSNormBwdTmaSmem:
    """dx and dw of y = x * rstd * (offset + w) over rows of N. Compile-time: dtypes, N, the config,
    weight or not, dx and dw wanted or not, offset zero or not, dh added or not; runtime: M, the row
    strides of x, dy and dh, offset, the number of clusters."""

    def __init__(self, x_dtype, w_dtype, N: int, cfg: BwdConfig, has_weight: bool, need_dx: bool,
                 need_dw: bool, has_offset: bool = True, has_dh: bool = False,
                 reduction: tuple[int, int] | None = None):
        self.x_dtype, self.w_dtype, self.N, self.cfg = x_dtype, w_dtype, N, cfg
        self.has_weight, self.need_dx = has_weight, need_dx
        self.has_dh = has_dh and need_dx
        if (cfg.cluster_n - 1) * cfg.slice_cols >= N:  # only the last CTA's slice may end inside it
            raise ValueError(f"{cfg} leaves a CTA with no column of N = {N}")
        if cfg.cluster_n * cfg.slice_cols < N:
            raise ValueError(f"{cfg}'s slices do not cover the N = {N} columns of a row")
        if cfg.streams != 2 + int(self.has_dh):  # the ring's slots are sized for its streams
            raise ValueError(f"a config for {cfg.streams} streams, the kernel reads {2 + int(self.has_dh)}")
        # offset == 0 compiled without the add (one instruction per element and pass, of ~15 in all)
        self.has_offset = has_offset
        self.need_dw = need_dw and has_weight
        self.vec = 128 // x_dtype.width
        self.elem_bytes = x_dtype.width // 8
        # dw's reducers: column tiles a round, partial rows loaded at once (rmsnorm_bwd_config.RED_CLUSTERS;
        # `reduction`: that shape instead, for probes)
        self.red_rounds, self.red_rows = reduction or reduction_shape(self.has_dh)

    # ---- host side ----------------------------------------------------------------------------
    def _tv_layout(self):
        # one row a tile: consecutive threads consecutive vectors (conflict-free shared reads, coalesced stores)
        c = self.cfg
        return row_tv_layout(c.threads, 1, c.nvb, self.vec)

    @cute.jit
    def __call__(self, mX: cute.Tensor, mDY: cute.Tensor, mDH: cute.Tensor, mW, mRstd: cute.Tensor,
                 mDX: cute.Tensor, mDW, mPart: cute.Tensor, mTicket: cute.Tensor, offset: Float32, clusters: Int32,
                 reducers: Int32, stream):
        c = self.cfg
        self.kernel(mX, mDY, mDH, mW, mRstd, mDX, mDW, mPart, mTicket, offset, reducers, self._tv_layout()).launch(
            grid=[clusters * c.cluster_n, 1, 1], block=[c.threads, 1, 1],
            cluster=[c.cluster_n, 1, 1] if cutlass.const_expr(c.cluster_n > 1) else None,
            smem=c.smem_bytes(self.elem_bytes), stream=stream)

    # ---- device side --------------------------------------------------------------------------
    @cute.jit
    def weight(self, tXrW: cute.Tensor, offset: Float32):
        """w' = offset + w in fp32, widened from the weight's registers at each use."""
        w = tXrW.load().to(Float32)
        if cutlass.const_expr(self.has_offset):
            w = w + offset
        return w

    @cute.kernel
    def kernel(self, mX: cute.Tensor, mDY: cute.Tensor, mDH: cute.Tensor, mW, mRstd: cute.Tensor, mDX: cute.Tensor,
               mDW, mPart: cute.Tensor, mTicket: cute.Tensor, offset: Float32, reducers: Int32,
               tv_layout: cute.Layout):
        c = self.cfg
        N, vec, eb = self.N, self.vec, self.elem_bytes
        cn, S = c.cluster_n, c.stages
        tidx, _, _ = cute.arch.thread_idx()
        gdim, _, _ = cute.arch.grid_dim()
        warp = cute.arch.warp_idx()
        lane = cute.arch.lane_idx()
        rank, cid = cluster_position(cn)
        clusters = Int32(gdim) // cn
        M = Int32(mX.shape[0])
        width = c.slice_cols
        col0 = rank * width
        cols_valid = cutlass.min(N - col0, width) if cutlass.const_expr(cn > 1) else Int32(N)
        even = cn * width == N  # every slice full: no column predicates
        n_rows = (M - cid + clusters - 1) // clusters  # rows cid, cid + clusters, ... (grid <= M clusters)

        # ---- shared memory: the x and dy (and dh) rings, their barriers, the reduction and exchange slots ----
        smem = SmemAllocator()
        ring = cute.make_layout((S, width), stride=(width, 1))
        sX = smem.allocate_tensor(self.x_dtype, ring, byte_alignment=128)
        sDY = smem.allocate_tensor(self.x_dtype, ring, byte_alignment=128)
        sDH = smem.allocate_tensor(self.x_dtype, ring, byte_alignment=128) if cutlass.const_expr(self.has_dh) else None
        mbar_full = smem.allocate_array(Int64, num_elems=S, byte_alignment=8)
        mbar_peer = smem.allocate_array(Int64, num_elems=2, byte_alignment=8)
        sRed = smem.allocate_tensor(Float32, cute.make_layout((c.warps,)), byte_alignment=16)
        sPeer = smem.allocate_tensor(Float32, cute.make_layout((2, cn), stride=(cn, 1)), byte_alignment=16)
        sTicket = smem.allocate_tensor(Int32, cute.make_layout((1,)), byte_alignment=16)

        # ---- 128-bit copies: shared -> registers, registers -> global ----
        tiler = (1, width)
        copy_x = vector_copy(self.x_dtype, tv_layout, tiler)
        thr_x = copy_x.get_slice(tidx)
        cT = cute.make_identity_tensor(tiler)
        tXcX = thr_x.partition_S(cT)
        # dx's store flags, for the last CTA (the others' slices are full): its slice ends at a compile-time
        # column, so the vectors every thread holds inside it take the constant flag (no branch)
        tXpX = None
        if cutlass.const_expr(not even):
            last_cols = N - (cn - 1) * width
            whole_last = whole_copies(copy_x.get_slice(c.threads - 1).partition_S(cT), vec, last_cols)
            tXpX = column_predicate(tXcX, vec, Int32(last_cols), whole=whole_last)
        tXrX = cute.make_fragment_like(thr_x.partition_S(cute.local_tile(sX, tiler, (0, 0))))
        tXrDY = cute.make_fragment_like(tXrX)
        tXrX.fill(0)
        tXrDY.fill(0)
        if cutlass.const_expr(not even):
            # a part-empty slice: the columns past the row's end are zeros in every slot (the bulk copies
            # fill only the valid bytes), so the loop's shared-memory loads need no predicates. Predicated
            # loads keep the fragments' old values alive across rows: 255 registers and 504 bytes of
            # spills per thread at N = 20480 over 3 x 128 x 7 (ptxas), 0.33 x copy against 0.94 for the
            # same slices at N = 21504, where they are full.
            tXpT = column_predicate(tXcX, vec, cols_valid, below=False)
            for s in cutlass.range_constexpr(S):
                cute.copy(copy_x, tXrX, thr_x.partition_D(cute.local_tile(sX, tiler, (s, 0))), pred=tXpT)
                cute.copy(copy_x, tXrDY, thr_x.partition_D(cute.local_tile(sDY, tiler, (s, 0))), pred=tXpT)
                if cutlass.const_expr(self.has_dh):  # dh's tail too (dx's tail is never stored, but stays finite)
                    cute.copy(copy_x, tXrX, thr_x.partition_D(cute.local_tile(sDH, tiler, (s, 0))), pred=tXpT)

        init_mbarriers_and_sync(tidx, mbar_full, S, mbar_peer, 2, cn)

        # ---- the ring's producer (thread 0): row cid + i*clusters into slot i % S ----
        x_base = mX.iterator.toint() + Int64(col0) * eb
        dy_base = mDY.iterator.toint() + Int64(col0) * eb
        x_stride = Int64(mX.stride[0]) * eb
        dy_stride = Int64(mDY.stride[0]) * eb
        slot_bytes = width * eb
        sx_base = sX.iterator.toint()
        sdy_base = sDY.iterator.toint()
        rings = [(sx_base, x_base, x_stride), (sdy_base, dy_base, dy_stride)]
        if cutlass.const_expr(self.has_dh):
            rings.append((sDH.iterator.toint(), mDH.iterator.toint() + Int64(col0) * eb, Int64(mDH.stride[0]) * eb))
        full_base = mbar_full.toint()
        nbytes = cols_valid * eb  # of x, and of dy (and dh), per row and CTA
        if tidx == 0:
            for s in cutlass.range_constexpr(S):
                if s < n_rows:
                    _fill_slot(mbar_full + s, full_base + s * 8, rings, s, Int64(cid + s * clusters), slot_bytes,
                               nbytes)

        # the weight in registers for the whole launch, loaded while the first rows fly
        if cutlass.const_expr(self.has_weight):
            copy_w = vector_copy(self.w_dtype, tv_layout, tiler)
            thr_w = copy_w.get_slice(tidx)
            tWgW = thr_w.partition_S(cute.local_tile(as_rows(mW, 1), tiler, (0, rank)))
            tWrW = cute.make_fragment_like(tWgW)
            tWrW.fill(0)
            tWpW = column_predicate(thr_w.partition_S(cT), 128 // self.w_dtype.width, cols_valid)
            cute.copy(copy_w, tWgW, tWrW, pred=tWpW if cutlass.const_expr(not even) else None)
            # the weight's registers seen in x's fragment layout (the same values in the same order),
            # kept in the weight's dtype and widened at each use (16-bit: half the registers)
            tXrW = cute.make_tensor(tWrW.iterator, tXrX.layout)

        # dw's partial: fp32 registers in the order of x's fragment, written with fp32 128-bit copies
        copy_p = vector_copy(Float32, tv_layout, tiler)
        thr_p = copy_p.get_slice(tidx)
        tPpP = column_predicate(thr_p.partition_S(cT), 4, cols_valid) if cutlass.const_expr(not even) else None
        tPrDW = cute.make_fragment_like(thr_p.partition_S(cute.local_tile(mPart, tiler, (0, rank))))
        tPrDW.fill(0)
        dw_acc = cute.make_tensor(tPrDW.iterator, tXrX.layout)

        for i in cutlass.range(n_rows, unroll=1):
            s = i % S
            row = cid + i * clusters
            rstd = mRstd[row]
            cute.arch.mbarrier_wait(mbar_full + s, (i // S) % 2)
            tXsX = thr_x.partition_S(cute.local_tile(sX, tiler, (s, 0)))
            tXsDY = thr_x.partition_S(cute.local_tile(sDY, tiler, (s, 0)))
            if cutlass.const_expr(self.need_dx):
                # pass 1: this CTA's share of sum(x * g)
                cute.copy(copy_x, tXsX, tXrX)
                cute.copy(copy_x, tXsDY, tXrDY)
                g = tXrDY.load().to(Float32)
                if cutlass.const_expr(self.has_weight):
                    g = g * self.weight(tXrW, offset)
                dot = (tXrX.load().to(Float32) * g).reduce(cute.ReductionOp.ADD, Float32(0.0), reduction_profile=0)
                dot = cute.arch.warp_reduction(dot, operator.add, threads_in_group=32)
                if cutlass.const_expr(c.warps > 1):
                    if lane == 0:
                        sRed[warp] = dot
                    cute.arch.barrier()
                    dot = Float32(0.0)
                    for j in cutlass.range_constexpr(c.warps):
                        dot = dot + sRed[j]
                if cutlass.const_expr(cn > 1):  # every CTA's share to every CTA of the cluster
                    b = i % 2
                    if tidx == 0:
                        cute.arch.mbarrier_arrive_and_expect_tx(mbar_peer + b, cn * 4)
                    if warp == 0:
                        if lane < cn:
                            store_f32_to_peer(sPeer.iterator + b * cn + rank, dot, mbar_peer + b, lane)
                    cute.arch.mbarrier_wait(mbar_peer + b, (i // 2) % 2)
                    dot = Float32(0.0)
                    for j in cutlass.range_constexpr(cn):
                        dot = dot + sPeer[b, j]
                coef = rstd * rstd * rstd * dot / N
                # pass 2: dx from shared memory, 128-bit stores
                cute.copy(copy_x, tXsX, tXrX)
                cute.copy(copy_x, tXsDY, tXrDY)
                x = tXrX.load().to(Float32)
                dy = tXrDY.load().to(Float32)
                g = dy
                if cutlass.const_expr(self.has_weight):
                    g = dy * self.weight(tXrW, offset)
                dx = g * rstd - x * coef
                tXrDX = cute.make_fragment_like(tXrX)
                if cutlass.const_expr(self.has_dh):
                    # dw first, so x and dy are dead before dh comes in (after the store, as without dh,
                    # N = 20480 over 2 x 128 x 10 spilled 372 bytes per thread: ptxas); then dh into dx's
                    # registers, added in fp32, rounded once
                    if cutlass.const_expr(self.need_dw):
                        dw_acc.store(dw_acc.load() + dy * x * rstd)
                    cute.copy(copy_x, thr_x.partition_S(cute.local_tile(sDH, tiler, (s, 0))), tXrDX)
                    dx = dx + tXrDX.load().to(Float32)
                tXgDX = thr_x.partition_D(cute.local_tile(mDX, tiler, (row, rank)))
                if cutlass.const_expr(even):
                    tXrDX.store(dx.to(self.x_dtype))
                    cute.copy(copy_x, tXrDX, tXgDX)
                    if cutlass.const_expr(self.need_dw and not self.has_dh):
                        dw_acc.store(dw_acc.load() + dy * x * rstd)
                else:
                    if cutlass.const_expr(self.need_dw and not self.has_dh):  # x, dy dead through the branches
                        dw_acc.store(dw_acc.load() + dy * x * rstd)
                    # a full slice (every CTA of a cluster but the last) stores as an even row does; the
                    # last rounds and stores a vector at a time, those past the row's end under their flag
                    # (store_vectors; rounded all at once, the values crossed into the branches one register
                    # at a time: bf16 N = 19336 over 3 x 128 x 7 took 255 registers and 148 bytes of spills).
                    # Straight from the registers, not through x's slot: no shared-memory round trip and no
                    # proxy fence, 2-13 fewer registers (ptxas), +1.2 to +1.7 % x copy at bf16 16432 and
                    # 18984 on an H200 and no width slower (performance.md 2.30)
                    if cutlass.const_expr(cn > 1) and rank < cn - 1:
                        tXrDX.store(dx.to(self.x_dtype))
                        cute.copy(copy_x, tXrDX, tXgDX)
                    else:
                        tXfDX = cute.make_fragment_like(tXrX, Float32)
                        tXfDX.store(dx)
                        store_vectors(copy_x, tXfDX, tXrDX, tXgDX, tXpX)
            else:
                cute.copy(copy_x, tXsX, tXrX)
                cute.copy(copy_x, tXsDY, tXrDY)
                dw_acc.store(dw_acc.load() + tXrDY.load().to(Float32) * tXrX.load().to(Float32) * rstd)
            # the slot is read by every thread: refill it with the row S ahead
            cute.arch.barrier()
            if tidx == 0:
                if i + S < n_rows:
                    _fill_slot(mbar_full + s, full_base + s * 8, rings, s, Int64(row + S * clusters), slot_bytes,
                               nbytes)

        if cutlass.const_expr(self.need_dw):
            # ---- dw: one cluster writes it; else each cluster's partial row, and the last `reducers`
            # CTAs to arrive (a ticket) wait for the others, then sum the partials in cluster order,
            # a share of the columns each ----
            if clusters == 1:  # dw has the weight's dtype and columns: the weight's copy and predicate
                tWgDW = thr_w.partition_D(cute.local_tile(as_rows(mDW, 1), tiler, (0, rank)))
                tWrDW = cute.make_fragment_like(tWgDW)
                cute.make_tensor(tWrDW.iterator, tXrX.layout).store(dw_acc.load().to(self.w_dtype))
                cute.copy(copy_w, tWrDW, tWgDW, pred=tWpW if cutlass.const_expr(not even) else None)
            else:
                cute.copy(copy_p, tPrDW, thr_p.partition_D(cute.local_tile(mPart, tiler, (cid, rank))), pred=tPpP)
                self.reduce_dw(mPart, mDW, mTicket, sTicket, clusters, reducers, Int32(gdim), tidx)
        if cutlass.const_expr(cn > 1):  # no CTA leaves while a peer may still write to it
            cute.arch.cluster_arrive_relaxed()
            cute.arch.cluster_wait()

    @cute.jit
    def reduce_dw(self, mPart: cute.Tensor, mDW, mTicket: cute.Tensor, sTicket: cute.Tensor, clusters: Int32,
                  reducers: Int32, ctas: Int32, tidx: Int32):
        """dw = the sum of the partial rows mPart[0 .. clusters - 1] in that order (deterministic). Every
        CTA takes a ticket (mTicket[0]) after its partial is visible; the last `reducers` (at most half
        the SMs) wait until all have arrived: the grid holds only the clusters that fit at once, so the
        CTAs not yet arrived are running (beside another kernel, they start as its CTAs finish and
        ours leave), and the wait ends. Reducer j then sums column tiles j, j + reducers, ...; the last
        reducer done (mTicket[1]) sets both counters back to 0 for the next launch on the stream."""
        c = self.cfg
        N = self.N
        T = c.threads
        cute.arch.fence_acq_rel_gpu()
        cute.arch.barrier()
        first_reducer = ctas - reducers
        if tidx == 0:
            t = cute.arch.atomic_add(mTicket.iterator.llvm_ptr, Int32(1), sem="acq_rel", scope="gpu")
            sTicket[0] = t
            if t >= first_reducer:
                seen = t + 1
                while seen < ctas:
                    seen = cute.arch.atomic_add(mTicket.iterator.llvm_ptr, Int32(0), sem="acquire", scope="gpu")
        cute.arch.barrier()
        j = sTicket[0] - first_reducer
        if j >= 0:
            cute.arch.fence_acq_rel_gpu()
            R = self.red_rounds
            U = self.red_rows
            width = 4 * T  # columns of one tile: a 16-byte fp32 vector per thread
            n_groups = -(-N // (width * R))
            rtiler = (1, width)
            red_tv = cute.make_layout(((T, 1), (4, 1)), stride=((4, 1), (1, width)))
            copy_r = vector_copy(Float32, red_tv, rtiler)
            copy_o = vector_copy(self.w_dtype, red_tv, rtiler, 4 * self.w_dtype.width)
            thr_r = copy_r.get_slice(tidx)
            thr_o = copy_o.get_slice(tidx)
            tRcR = thr_r.partition_S(cute.make_identity_tensor(rtiler))
            mDW2 = as_rows(mDW, 1)
            proto = thr_r.partition_S(cute.local_tile(mPart, rtiler, (0, 0)))
            acc = [cute.make_fragment_like(proto) for _ in range(R)]
            tmp = [[cute.make_fragment_like(proto) for _ in range(R)] for _ in range(U)]
            out = cute.make_fragment_like(thr_o.partition_D(cute.local_tile(mDW2, rtiler, (0, 0))))
            last = clusters - 1
            for grp in cutlass.range(j, n_groups, reducers, unroll=1):
                preds = [column_predicate(tRcR, 4, N - (grp * R + r) * width) for r in range(R)]
                for r in cutlass.range_constexpr(R):
                    acc[r].fill(0)
                for u in cutlass.range_constexpr(U):
                    for r in cutlass.range_constexpr(R):
                        tmp[u][r].fill(0)
                # U partial rows' tiles loaded before any is added, the sum in cluster order; past the
                # last row a load repeats it (in bounds, in L2) and its add is skipped, so the chain is
                # ceil(clusters / U) round trips whatever the remainder
                for k0 in cutlass.range(0, clusters, U, unroll=1):
                    for u in cutlass.range_constexpr(U):
                        k = k0 + u
                        if cutlass.const_expr(U > 1):
                            k = cutlass.min(k, last)
                        for r in cutlass.range_constexpr(R):
                            cute.copy(copy_r, thr_r.partition_S(cute.local_tile(mPart, rtiler, (k, grp * R + r))),
                                      tmp[u][r], pred=preds[r])
                    for u in cutlass.range_constexpr(U):
                        if cutlass.const_expr(u == 0):
                            for r in cutlass.range_constexpr(R):
                                acc[r].store(acc[r].load() + tmp[u][r].load())
                        else:
                            if k0 + u <= last:
                                for r in cutlass.range_constexpr(R):
                                    acc[r].store(acc[r].load() + tmp[u][r].load())
                for r in cutlass.range_constexpr(R):
                    out.store(acc[r].load().to(self.w_dtype))
                    cute.copy(copy_o, out, thr_o.partition_D(cute.local_tile(mDW2, rtiler, (0, grp * R + r))),
                              pred=preds[r])
            if tidx == 0:
                done = cute.arch.atomic_add((mTicket.iterator + 1).llvm_ptr, Int32(1), sem="acq_rel", scope="gpu")
                if done == reducers - 1:
                    mTicket[0] = Int32(0)
                    mTicket[1] = Int32(0)
