"""Compile checks (CPU only, no GPU): every tma_smem_cached backward variant the library can launch is
built to a real sm_90a and sm_100a cubin by `cute.compile` over fake tensors (CUTE_DSL_ARCH), and the
PTX shows what the kernel is meant to do: bulk copies into the ring on mbarriers, 128-bit shared loads
and global stores, the cluster exchange through distributed shared memory, integer atomics only (the
dw tickets): no float atomics.
"""
from __future__ import annotations

import re

import pytest
import torch

from cutile_norms.cute.rmsnorm_bwd import compile_backward
from cutile_norms.cute.rmsnorm_bwd_config import analytic_config
from tests.cute.ptx_util import address_ops, check_kernel_ptx, ptxas_report

ARCHS = ["sm_90a", "sm_100a"]
DT = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
DTYPES = [("bfloat16", "bfloat16"), ("float16", "float16"), ("float32", "float32"), ("bfloat16", "float32")]
# widths dispatch runs it at (exactly tiled rows from 24 KiB, and from 16 KiB on an H200: 10240), one it
# tiles exactly only by the exact rule (20480), narrow and padded ones the tests run, and padded ones whose
# only exact tilings hold 13 vectors a thread or 13 CTAs (13312, 53248: rmsnorm_bwd_config.MAX_VECS; 53248
# over 8 CTAs of 7 vectors, SEVEN_PADDED), and rows past 15 slices over 8 CTAs of 256 threads (135688:
# WIDE_SLICES) and over 16 CTAs where the only exact tiling takes 14 (157696: FULL_GPC)
WIDTHS = [1000, 4096, 10240, 13312, 16384, 20480, 24576, 32768, 40000, 53248, 65536, 131072, 135688, 157696, 262144]


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("x_dtype,w_dtype", DTYPES)
@pytest.mark.parametrize("N", WIDTHS)
def test_compiles(N, x_dtype, w_dtype, arch):
    cfg = analytic_config(N, DT[x_dtype].itemsize)
    if cfg is None:
        assert DT[x_dtype] == torch.float32 and N * 4 > 256 * 1024  # only wide fp32 rows have no config
        pytest.skip("no config: the cuTile backward runs")
    fn = compile_backward(DT[x_dtype], DT[w_dtype], N, cfg, True, True, arch, keep_ptx=True)
    # an fp32 weight beside bf16 x doubles the weight's registers: 2 x 128 x 10 at N = 20480 (2 ring slots)
    # spills 128 bytes per thread with dw's 8-row reduction (ptxas), which measured faster than the one-row
    # reduction's 28 bytes all the same (test_reducer_rows_leave_the_row_loop_alone); fp32 rows over 16 CTAs of
    # 128 threads (65536) spill 16 bytes at 128 registers
    check_kernel_ptx(fn.__ptx__, arch, spills_at_most=128 if (x_dtype, w_dtype, N) == ("bfloat16", "float32", 20480)
                     else 32 if w_dtype == "float32" else 8)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("N", [12288, 24576, 42528, 65536])
def test_compiles_with_the_deep_ring(N, arch):
    """The configs an H200 runs (3 ring slots for clusters of up to 8 CTAs: rmsnorm_bwd_config.DEEP_RING),
    exact and padded slices: the ring lives in shared memory, so the registers must not grow."""
    cfg = analytic_config(N, 2, small_ring=3)
    assert cfg.stages == 3
    fn = compile_backward(torch.bfloat16, torch.bfloat16, N, cfg, True, True, arch, keep_ptx=True)
    check_kernel_ptx(fn.__ptx__, arch, spills_at_most=8)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("N,x_dtype,w_dtype", [(9472, "bfloat16", "bfloat16"), (22000, "bfloat16", "bfloat16"),
                                               (60000, "bfloat16", "bfloat16"), (22000, "float16", "float16"),
                                               (22000, "bfloat16", "float32")])
def test_compiles_the_h200s_even_slices(N, x_dtype, w_dtype, arch):
    """The configs of rmsnorm_bwd_config.EVEN_SLICES an H200 runs (256 threads of 5-6 vectors: one CTA at
    9472, clusters of 2 and 5 at 22000 and 60000) build without spills, beside an fp32 weight too."""
    from cutile_norms._platform import DeviceInfo
    from cutile_norms.cute.rmsnorm_bwd_config import device_config

    cfg = device_config(N, 2, DeviceInfo("nvidia", "NVIDIA H200", (9, 0), 132, 0))
    assert cfg.threads == 256 and cfg.stages == 3, cfg
    fn = compile_backward(DT[x_dtype], DT[w_dtype], N, cfg, True, True, arch, keep_ptx=True)
    check_kernel_ptx(fn.__ptx__, arch, spills_at_most=0)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("N,x_dtype,w_dtype,shape", [(15360, "bfloat16", "bfloat16", (2, 128, 8)),
                                                     (18432, "float16", "float16", (2, 256, 5)),
                                                     (19968, "bfloat16", "float32", (2, 256, 5))])
def test_compiles_the_h100s_even_slices(N, x_dtype, w_dtype, shape, arch):
    """The configs of rmsnorm_bwd_config.EVEN_SLICES an H100 runs in its 24-40 KiB band (2 CTAs of 128
    threads of 8 vectors or of 256 threads of 5, 2 ring slots) build without spills, beside an fp32 weight
    too (mode="tma_smem_cached"; beside an fp32 weight mode=None runs the cuTile kernel there)."""
    from cutile_norms._platform import DeviceInfo
    from cutile_norms.cute.rmsnorm_bwd_config import device_config

    cfg = device_config(N, 2, DeviceInfo("nvidia", "NVIDIA H100 80GB HBM3", (9, 0), 132, 0))
    assert (cfg.cluster_n, cfg.threads, cfg.nvb, cfg.stages) == (*shape, 2), cfg
    fn = compile_backward(DT[x_dtype], DT[w_dtype], N, cfg, True, True, arch, keep_ptx=True)
    check_kernel_ptx(fn.__ptx__, arch, spills_at_most=0)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("ring", [2, 3])
@pytest.mark.parametrize("N", [12288, 19336, 20480, 24576, 40960, 53248, 65536, 72928, 117144, 204800, 262144])
def test_compiles_with_dh(N, ring, arch):
    """The residual add's backward: a third ring of dh slices, added to dx (exact and part-empty
    slices, the H100's and the H200's ring; 204800 over 15 CTAs of 256 threads, padded). dw is summed
    before dh comes in, so x's and dy's fp32 values are dead by then: without that order N = 20480
    spilled 372 bytes per thread (ptxas)."""
    cfg = analytic_config(N, 2, small_ring=ring, streams=3)
    fn = compile_backward(torch.bfloat16, torch.bfloat16, N, cfg, True, True, arch, keep_ptx=True, has_dh=True)
    check_kernel_ptx(fn.__ptx__, arch, spills_at_most=8)
    # three bulk copies per slot fill (x's, dy's and dh's): the prologue's `stages` fills, the loop's refill
    assert fn.__ptx__.count("cp.async.bulk.shared::cluster.global") == 3 * (cfg.stages + 1)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("has_w,need_dx,need_dw", [(False, True, False), (True, True, False), (True, False, True)])
@pytest.mark.parametrize("N", [4096, 65536, 262144])
def test_compiles_one_grad_and_no_weight_variants(N, has_w, need_dx, need_dw, arch):
    w = torch.bfloat16 if has_w else None
    fn = compile_backward(torch.bfloat16, w, N, analytic_config(N, 2), need_dx, need_dw, arch, keep_ptx=True)
    check_kernel_ptx(fn.__ptx__, arch, spills_at_most=8)


def test_ptx_cluster_rows():
    cfg = analytic_config(262144, 2)
    assert cfg.cluster_n == 16
    ptx = compile_backward(torch.bfloat16, torch.bfloat16, 262144, cfg, True, True, "sm_90a", keep_ptx=True).__ptx__
    assert ".target sm_90a" in ptx
    assert "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes" in ptx
    assert "st.async.shared::cluster.mbarrier::complete_tx::bytes" in ptx and "mapa.shared::cluster" in ptx
    assert "ld.shared.v4" in ptx and "st.global.v4" in ptx
    atomics = re.findall(r"\batom\.[\w.]+", ptx)  # the dw tickets: take one, poll, done; no float atomics
    assert len(atomics) == 3 and all(a.endswith(".add.u32") for a in atomics), atomics


@pytest.mark.parametrize("N", [32768, 262144])
def test_ptx_dx_offsets_are_64_bit(N):
    """dx's row offset is a 64-bit product of the row and dx's row stride (a 32-bit element index wraps
    past 2^32 elements)."""
    ptx = compile_backward(torch.bfloat16, torch.bfloat16, N, analytic_config(N, 2), True, False, "sm_90a",
                           keep_ptx=True).__ptx__
    ops = address_ops(ptx, "st.global.v4")
    assert ops & {"mad.lo.s64", "mul.lo.s64"}, f"dx's address: {sorted(ops)}"


# the configs the library picks at widths whose last slice is part empty (random widths the bench drew
# and a spread of others) and at exactly tiled ones: ptxas keeps every one in registers
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("N", [6440, 10848, 18112, 19336, 36392, 58680, 85912, 135688, 193488, 239496,
                               20480, 65536, 262144, 11264, 66000, 72928, 98304, 117144, 13312, 53248,
                               159744, 230400])
def test_no_spills_with_part_empty_slices(N, dtype):
    """The loop's shared-memory loads take no predicates (the slots' columns past the row are zeros):
    predicated loads kept the fragments alive across rows and spilled up to 504 bytes per thread
    (bf16 N = 20480 over 3 x 128 x 7: 0.33 x copy on an H100, against 0.94 at N = 21504 whose slices
    are full); the last CTA rounds dx a vector at a time inside each store's branch. What is
    left: 8 bytes at bf16 N = 11264 (one CTA of 11 vectors a thread, an exact tiling: 255 registers;
    the fp32 temporaries of x, dy and g over the whole fragment are the peak)."""
    cfg = analytic_config(N, 2)
    fn = compile_backward(dtype, dtype, N, cfg, True, True, arch="sm_90a", keep_ptx=True)
    report = ptxas_report(fn.__ptx__, "sm_90a")
    assert report["spill_stores"] <= (8 if N == 11264 else 0), f"N={N} {cfg.short()}: {report}"


def test_a_config_with_an_empty_cta_is_refused():
    """Only the last CTA's slice may end inside the row (its dx flags are built for it alone): a
    config whose last CTA would hold no column, or whose slices stop short of the row, is refused
    where the kernel is built."""
    import cutlass

    from cutile_norms.cute.rmsnorm_bwd_config import BwdConfig
    from cutile_norms.cute.rmsnorm_bwd_kernel import RMSNormBwdTmaSmem

    ok = BwdConfig(cluster_n=3, threads=128, nvb=6, stages=2, vec=8, streams=2)  # slices of 6144
    for N in (12296, 18432):
        RMSNormBwdTmaSmem(cutlass.BFloat16, cutlass.BFloat16, N, ok, True, True, True)
    for N in (12288, 6144, 1000):  # the third CTA (or more) would be empty
        with pytest.raises(ValueError, match="no column"):
            RMSNormBwdTmaSmem(cutlass.BFloat16, cutlass.BFloat16, N, ok, True, True, True)
    with pytest.raises(ValueError, match="do not cover"):  # columns no CTA would read
        RMSNormBwdTmaSmem(cutlass.BFloat16, cutlass.BFloat16, 18440, ok, True, True, True)


def test_reduction_shape():
    """dw's reducers load RED_CLUSTERS partial rows at once (one column tile a round) whatever the weight;
    with dh one row at a time (4 tiles a round), the kernels whose row loop ptxas fits only that way
    (rmsnorm_bwd_config.RED_CLUSTERS)."""
    from cutile_norms.cute.rmsnorm_bwd_config import RED_CLUSTERS, RED_ROUNDS, reduction_shape

    assert RED_CLUSTERS > 1
    assert reduction_shape(False) == (RED_ROUNDS, RED_CLUSTERS)
    assert reduction_shape(True) == (4, 1)


# the widths measured with the RED_CLUSTERS-row reduction, per weight dtype beside bf16 x
REDUCER_WIDTHS = {torch.bfloat16: [9216, 10240, 11392, 12288, 14336, 18432, 19336, 20480, 25464, 28672, 38040],
                  torch.float32: [8192, 9216, 12288, 14592, 18432, 19368, 20480, 28672, 53248]}


@pytest.mark.parametrize("w_dtype,N", [(w, n) for w, ns in REDUCER_WIDTHS.items() for n in ns])
def test_reducer_rows_leave_the_row_loop_alone(w_dtype, N):
    """The RED_CLUSTERS-row reduction compiles the bf16 row loop of the widths measured with it (the
    H100's 2 and the H200's 3 ring slots) without spills, where the one-row reduction spilled 8 bytes
    at 19336 and 4 rows of 4 tiles 16. (11264, one CTA of 11 vectors a thread, sits at 255 registers
    and spills 8 bytes with any reduction: test_no_spills_with_part_empty_slices' bound.) Beside an fp32
    weight the same, but at 20480 over 2 x 128 x 10 vectors on the H100's 2-slot ring (255 registers: 128
    bytes, 28 with the one-row reduction), which measured faster than the one-row reduction all the same
    (0.928 against 0.873 x copy, docs/performance.md 2.42)."""
    for ring in (2, 3):
        cfg = analytic_config(N, 2, small_ring=ring)
        fn = compile_backward(torch.bfloat16, w_dtype, N, cfg, True, True, arch="sm_90a", keep_ptx=True)
        report = ptxas_report(fn.__ptx__, "sm_90a")
        bound = 128 if (w_dtype, N, ring) == (torch.float32, 20480, 2) else 0
        assert report["spill_stores"] <= bound, f"N={N} w {w_dtype} {cfg.short()}: {report}"


def test_a_probes_reduction_shape_is_its_own_kernel():
    """compile_backward's `reduction` (bench/probe/cute_bwd_reduction.py) is part of the compile key (so
    a probe's shape never stands in for the config's, in process or on disk), and the config's own shape
    given explicitly builds the same kernel as none."""
    from cutile_norms.cute.rmsnorm_bwd_config import RED_CLUSTERS, RED_ROUNDS

    cfg = analytic_config(12288, 2)
    args = (torch.bfloat16, torch.bfloat16, 12288, cfg, True, True, "sm_90a")
    default = compile_backward(*args, keep_ptx=True)
    same = compile_backward(*args, keep_ptx=True, reduction=(RED_ROUNDS, RED_CLUSTERS))
    other = compile_backward(*args, keep_ptx=True, reduction=(1, 16))
    assert same is not default and other is not default
    assert same.__ptx__ == default.__ptx__ != other.__ptx__
    assert ptxas_report(other.__ptx__, "sm_90a")["spill_stores"] == 0
