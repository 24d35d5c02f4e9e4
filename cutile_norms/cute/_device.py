"""Device helpers both tma_smem_cached kernels use: the CTA's place in its cluster, the TMA bulk copy
into shared memory (and a tile's rows by it), the residual add over a row tile in shared memory, the
push of one fp32 into a cluster peer's shared memory, the per-vector column predicate (and the vectors
every thread holds inside the row), stores of fp32 values rounded a vector at a time, vector copies
over a thread-value layout, and a vector seen as rows."""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import dsl_user_op


def cluster_position(cluster_n: int):
    """(this CTA's rank in its cluster, the cluster's index in the grid) for a 1-D grid of clusters of
    `cluster_n` CTAs (1: no clusters, every CTA its own)."""
    bidx, _, _ = cute.arch.block_idx()
    if cluster_n > 1:
        return cute.arch.block_idx_in_cluster(), bidx // cluster_n
    return Int32(0), bidx


def inline_asm(result_type, asm: str, constraints: str, operands, *, side_effects: bool = False, loc=None, ip=None):
    """Inline PTX over DSL numbers (`operands`, each with .ir_value): the result as `result_type` (a DSL
    numeric type), or None for result_type None."""
    out = llvm.inline_asm(None if result_type is None else result_type.mlir_type,
                          [v.ir_value(loc=loc, ip=ip) for v in operands], asm, constraints,
                          has_side_effects=side_effects, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT,
                          loc=loc, ip=ip)
    return None if result_type is None else result_type(out)


@dsl_user_op
def bulk_copy_g2s(smem_addr: Int32, gmem_addr: Int64, nbytes: Int32, mbar_addr: Int32, *, loc=None, ip=None):
    """One TMA bulk copy of `nbytes` (a multiple of 16) from global to this CTA's shared memory; its
    bytes complete on the mbarrier's transaction count."""
    inline_asm(None, "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [$0], [$1], $2, [$3];",
               "r,l,r,r", [Int32(smem_addr), Int64(gmem_addr), Int32(nbytes), Int32(mbar_addr)], side_effects=True,
               loc=loc, ip=ip)


@cute.jit
def load_rows(mA: cute.Tensor, sA: cute.Tensor, row0: Int32, rows_valid: Int32, col0, nbytes,
              s_row_bytes: cutlass.Constexpr[int], whole: cutlass.Constexpr[bool], lane: Int32, mbar_addr: Int32):
    """Bulk copies of a tile's rows of mA (from row row0, rows_valid of them, nbytes from column col0
    of each) into sA at s_row_bytes per row, by one warp: one copy of the whole tile (`whole`: rows
    of exactly s_row_bytes, contiguous in mA), else one per row at mA's row stride. Their bytes
    complete on the mbarrier at mbar_addr (the caller has set its transaction count)."""
    eb = mA.element_type.width // 8
    s_base = sA.iterator.toint()
    a_base = mA.iterator.toint()
    if cutlass.const_expr(whole):
        if lane == 0:
            bulk_copy_g2s(s_base, a_base + Int64(row0) * s_row_bytes, rows_valid * s_row_bytes, mbar_addr)
    else:
        stride = Int64(mA.stride[0]) * eb
        for r in cutlass.range(lane, rows_valid, 32):
            bulk_copy_g2s(s_base + r * s_row_bytes, a_base + Int64(row0 + r) * stride + Int64(col0) * eb, nbytes,
                          mbar_addr)


@cute.jit
def add_residual(copy_x, thr_x, tXsX: cute.Tensor, tRsR: cute.Tensor, gH: cute.Tensor, tXrX: cute.Tensor,
                 tRrR: cute.Tensor, tXpX: cute.Tensor, row: Int32, M: Int32, dtype: cutlass.Constexpr):
    """h = x + r for a thread's vectors of one row group (the row kernels' fused add): tXrX holds x on
    entry and h on return (summed in fp32, rounded once to `dtype`); r's vectors come from tRsR into
    tRrR, h goes over x's tile (tXsX: each thread reads back only its own vectors, so no barrier) and,
    for a row of the tensor (row < M), to h's tile gH in global memory (partitioned inside the branch:
    outside it the FP8 kernel held 113 registers against 96, sm_90a). Every copy is predicated by tXpX."""
    cute.copy(copy_x, tRsR, tRrR, pred=tXpX)
    tXrX.store((tXrX.load().to(Float32) + tRrR.load().to(Float32)).to(dtype))
    cute.copy(copy_x, tXrX, tXsX, pred=tXpX)
    if row < M:
        cute.copy(copy_x, tXrX, thr_x.partition_D(gH), pred=tXpX)


@dsl_user_op
def store_f32_to_peer(smem_ptr: cute.Pointer, val: Float32, mbar_ptr: cute.Pointer, peer: Int32, *, loc=None, ip=None):
    """st.async of one fp32 into CTA `peer`'s shared memory at this CTA's address of `smem_ptr`,
    completing 4 bytes on the peer's mbarrier (the peer's copy of `mbar_ptr`)."""
    cute.arch.store_async_dsmem(smem_ptr, _f32_bits(val, loc=loc, ip=ip), mbar_ptr, peer, loc=loc, ip=ip)


@dsl_user_op
def _f32_bits(val: Float32, *, loc=None, ip=None) -> Int32:
    return Int32(llvm.bitcast(Int32.mlir_type, Float32(val).ir_value(loc=loc, ip=ip), loc=loc, ip=ip))


@cute.jit
def init_mbarriers_and_sync(tidx: Int32, first, count: cutlass.Constexpr[int], second, count2: cutlass.Constexpr[int],
                            cluster_n: cutlass.Constexpr[int]):
    """Thread 0 initialises `count` mbarriers from `first` and `count2` from `second` (one arrival
    each), then the CTA, or the whole cluster, waits for it: no thread (nor a peer CTA's st.async)
    touches a barrier before it is initialised."""
    if tidx == 0:
        for s in cutlass.range_constexpr(count):
            cute.arch.mbarrier_init(first + s, 1)
        for s in cutlass.range_constexpr(count2):
            cute.arch.mbarrier_init(second + s, 1)
    cute.arch.mbarrier_init_fence()
    if cutlass.const_expr(cluster_n > 1):
        cute.arch.cluster_arrive_relaxed()
        cute.arch.cluster_wait()
    else:
        cute.arch.barrier()


@cute.jit
def column_predicate(tXcX: cute.Tensor, atom_vals: cutlass.Constexpr[int], limit: Int32,
                     below: cutlass.Constexpr[bool] = True, whole: cutlass.Constexpr[int] = 0) -> cute.Tensor:
    """One flag per 16-byte copy of a thread's partition (coordinates `tXcX`, (row, col)): its
    column < limit (`below`), else its column >= limit. Vectors never straddle the limit (it is a
    multiple of the vector). The first `whole` copies (`whole_copies`) are below it in every thread:
    their flags are the constant True."""
    n = cute.size(tXcX, mode=[0]) // atom_vals
    m1, m2 = cute.size(tXcX, mode=[1]), cute.size(tXcX, mode=[2])
    pred = cute.make_rmem_tensor(cute.make_layout((n, m1, m2)), cutlass.Boolean)
    for i in cutlass.range_constexpr(n):
        for j in cutlass.range_constexpr(m1):
            for k in cutlass.range_constexpr(m2):
                if cutlass.const_expr(below and i < whole):
                    pred[i, j, k] = True
                else:
                    col = tXcX[i * atom_vals, j, k][1]
                    pred[i, j, k] = col < limit if cutlass.const_expr(below) else col >= limit
    return pred


def whole_copies(tXcX_far: cute.Tensor, atom_vals: int, limit: int | None) -> int:
    """(Compile time.) How many of a thread's copies of `atom_vals` values, from its first, lie below
    the column `limit` in every thread of a row: those the row's last thread holds (`tXcX_far`, its
    partition of the coordinates, taken at that constant thread index, reaches furthest in each copy:
    `row_tv_layout`). 0 where the limit is known only at run time (None: the forward's cluster slices,
    whose end depends on the CTA's rank) or the partition repeats over its modes 1-2."""
    if limit is None or cute.size(tXcX_far, mode=[1]) * cute.size(tXcX_far, mode=[2]) != 1:
        return 0
    n = cute.size(tXcX_far, mode=[0]) // atom_vals
    k = 0
    while k < n and tXcX_far[k * atom_vals, 0, 0][1] < limit:
        k += 1
    return k


@cute.jit
def store_vectors(copy_x, tYf: cute.Tensor, tYrY: cute.Tensor, tYgY: cute.Tensor, tXpX: cute.Tensor):
    """A thread's fp32 values `tYf` (one row group, mode 0 = (vec, vectors)) rounded to tYrY's dtype and
    stored to global memory (tYgY) one 16-byte vector at a time, each under its flag (tXpX) with its
    rounding inside the branch; the flags `column_predicate` made constant (`whole`) fold away, and those
    vectors are stored unconditionally (the same PTX as without a branch). Rounded all at once, the values
    crossed into the branches one per register: ptxas made the rounding scalar (cvt.rn.bf16.f32, twice
    the instructions of cvt.rn.bf16x2.f32) and bf16 rows of 40-48 KiB over 128 threads took 255
    registers and up to 144 bytes of spills where the same rows without padding took 166 and none."""
    assert cute.size(tYf, mode=[1]) * cute.size(tYf, mode=[2]) == 1, "one row group's tile: mode 0 holds it all"
    for k in cutlass.range_constexpr(cute.size(tYf, mode=[0]) // cute.size(tYf.layout[0][0])):
        if tXpX[k, 0, 0]:
            tYrY[(None, k), None, None].store(tYf[(None, k), None, None].load().to(tYrY.element_type))
            cute.copy(copy_x, tYrY[(None, k), None, None], tYgY[(None, k), None, None])


def row_tv_layout(tpr: int, rpg: int, nvb: int, vec: int) -> cute.Layout:
    """The thread-value layout of a row tile of rpg rows: thread (t0 in a row, t1 = row of the group) ->
    row t1, column t0 * vec; value (v, k) -> column v + k * vec * tpr. Each thread owns 16-byte vectors
    (vec values), a row's threads cover it contiguously: thread t0's k-th vector is the columns
    [vec (t0 + k tpr), + vec)."""
    return cute.make_layout(((tpr, rpg), (vec, nvb)), stride=((vec * rpg, 1), (rpg, rpg * vec * tpr)))


class RowTileKernel:
    """What the kernels that hold row tiles in shared memory and give each thread 16-byte vectors of
    them share (the tma_smem_cached forward, the FP8 output): their compile-time dtypes, N, config and
    flags, the values of a vector, and the tile's thread-value layout (`row_tv_layout`)."""

    def __init__(self, x_dtype, w_dtype, N: int, cfg, has_weight: bool, store_rstd: bool, contiguous: bool):
        self.x_dtype, self.w_dtype, self.N, self.cfg = x_dtype, w_dtype, N, cfg
        self.has_weight = has_weight
        self.store_rstd, self.contiguous = store_rstd, contiguous
        self.vec = 128 // x_dtype.width
        self.elem_bytes = x_dtype.width // 8

    def _tv_layout(self):
        c = self.cfg
        return row_tv_layout(c.tpr, c.rpg, c.nvb, self.vec)


def vector_copy(dtype, tv_layout: cute.Layout, tiler, bits: int = 128):
    """A tiled copy of `bits` per instruction (128: one 16-byte vector) with `tv_layout` over `tiler`."""
    return cute.make_tiled_copy(cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), dtype, num_bits_per_copy=bits),
                                tv_layout, tiler)


def as_rows(mV: cute.Tensor, rows: int) -> cute.Tensor:
    """A 1-D tensor (the weight, dw) seen as `rows` identical rows (row stride 0), to tile like x."""
    return cute.make_tensor(mV.iterator, cute.prepend(mV.layout, cute.make_layout((rows,), stride=(0,))))
