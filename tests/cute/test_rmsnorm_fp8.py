"""The CuTe DSL FP8-output RMSNorm (cutile_norms/cute/rmsnorm_fp8*.py).

CPU: every variant compiles to sm_90a and sm_100a cubins over fake tensors, and its PTX does what the
contract needs: one cvt.rn.satfinite per two elements (round to nearest even, saturate, NaN kept), the
amax by max.NaN, the reciprocal of a scale correctly rounded (rcp.rn) once per row or per vector, never
an approximate division; ptxas fits it in registers. The config's refusals and the y-kept rule.
GPU: called directly against the reference quantizer (reference.fp8_scale, reference.fp8_quantize)
applied to y computed from the kernel's own rstd in the kernel's op order: scales and q bit for bit,
h bit for bit the fp32 sum rounded once, rstd against fp64; the allocator's blocks that the outputs
take filled with NaN bytes first (a store the kernel skips shows as NaN); rows of zeros,
inf and NaN; both formats, every scale kind, fp16 / bf16 / fp32 x, strided rows, tail tiles.
"""
from __future__ import annotations

import re

import pytest
import torch

from cutile_norms.cute.rmsnorm_fp8 import compile_fp8, unsupported
from cutile_norms.cute.rmsnorm_fp8_config import RING_BY_MODEL, fp8_config, min_ctas, refusal, ring
from cutile_norms.cute.rmsnorm_fp8_ops import transposed_plan, transposed_reduce
from tests.conftest import fp8_reference, poison_next_allocations, random_rows, random_weight, same_bits_or_both_nan
from tests.cute.ptx_util import ptxas_report

ARCHS = ["sm_90a", "sm_100a"]
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def _compile(N, kind, out_dtype=E4M3, x_dtype=torch.bfloat16, residual=False, contiguous=True, arch="sm_90a",
             w_dtype=None, stages=1, looped=False, has_offset=False):
    group = 128 if kind == "group" else 0
    cfg = fp8_config(N, x_dtype.itemsize, group or None)
    assert cfg is not None, (N, kind)
    fn = compile_fp8(x_dtype, w_dtype or x_dtype, N, cfg, out_dtype, kind, group, kind != "static", kind == "group",
                     residual, True, contiguous, arch, keep_ptx=True, stages=stages,
                     looped=looped, has_offset=has_offset)
    return fn.__ptx__, cfg


@pytest.mark.parametrize("model", ["H100", "H200"])  # straight-line one tile a CTA; the H200's ring and loop
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("kind", ["token", "group", "static"])
@pytest.mark.parametrize("N", [256, 1024, 1664, 2560, 3584, 5120, 8192, 10240, 13312, 16384])
def test_compiles(N, kind, arch, model):
    if kind == "group" and N < 512:  # 16 lanes per group, 8 threads per row
        assert "lanes of one warp" in refusal(N, 2, 128)
        return
    stages, _, looped = ring(N, 2, 2, kind, 1 << 30, 132, model)  # what that GPU compiles (rmsnorm_fp8_config)
    ptx, cfg = _compile(N, kind, arch=arch, stages=stages, looped=looped)
    assert f".target {arch}" in ptx
    assert "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes" in ptx
    assert re.search(r"ld\.shared(\.\w+)*\.v4\.(b|u)32", ptx), "16-byte shared loads"
    values = cfg.nvb * cfg.vec * (cfg.rows // cfg.rpg)  # a thread's values over its row groups
    assert ptx.count("cvt.rn.satfinite.e4m3x2.f32") == values // 2, "one conversion per two elements"
    assert "approx" not in re.sub(r"rsqrt\.approx|ex2\.approx|lg2\.approx", "", ptx), "an approximate operation"
    rcp = ptx.count("rcp.rn.f32")
    # once per row group: a group's scale is computed by one of its lanes (the lanes share the work)
    per_scale = {"static": 1, "token": cfg.rows // cfg.rpg, "group": cfg.rows // cfg.rpg}[kind]
    assert rcp == per_scale, f"{rcp} rcp.rn for {per_scale} scales"
    assert ptx.count("mbarrier.try_wait") + ptx.count("mbarrier.test_wait") >= 1
    if kind != "static":
        assert "max.NaN.f32" in ptx
    if arch == "sm_90a":
        report = ptxas_report(ptx, arch)
        assert report["spill_stores"] == 0, report
        # 128 threads a CTA: at most 168 registers keeps 3 CTAs an SM at the widest rows (the amax as a
        # tree over vectors held 158 at 16384 per token; one chain over all values held 229)
        assert cfg.threads != 128 or report["registers"] <= 168, report


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("N,kind,out_dtype,x_dtype,residual,contiguous", [
    (2560, "token", E5M2, torch.bfloat16, True, True),
    (13312, "token", E4M3, torch.bfloat16, True, False),
    (4096, "group", E5M2, torch.float16, True, False),
    (4096, "token", E4M3, torch.float32, False, False),
    (8192, "group", E4M3, torch.float32, False, True),
    (2048, "token", E4M3, torch.bfloat16, False, False)])
def test_compiles_residual_strided_and_dtype_variants(N, kind, out_dtype, x_dtype, residual, contiguous, arch):
    ptx, _ = _compile(N, kind, out_dtype, x_dtype, residual, contiguous, arch)
    fmt = "e4m3x2" if out_dtype == E4M3 else "e5m2x2"
    assert f".target {arch}" in ptx and f"cvt.rn.satfinite.{fmt}.f32" in ptx
    if residual:  # h stored in 16-byte vectors
        assert re.search(r"st\.global(\.\w+)*\.v4\.(b|u)32", ptx)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("kind", ["token", "group", "static"])
@pytest.mark.parametrize("N", [4096, 16384])
def test_fp32_weight_with_16_bit_x_compiles(N, kind, arch):
    """An fp32 weight doubles the weight's registers: still no spills, and at most 168 registers, one tile
    a CTA and as the H200 runs it (the ring at 4096, one slot at 16384)."""
    for model in ("H100", "H200"):
        stages, _, looped = ring(N, 2, 4, kind, 1 << 30, 132, model)
        ptx, cfg = _compile(N, kind, arch=arch, w_dtype=torch.float32, stages=stages, looped=looped)
        assert f".target {arch}" in ptx
        if arch == "sm_90a":
            report = ptxas_report(ptx, arch)
            assert report["spill_stores"] == 0 and report["registers"] <= 168, (model, report)


@pytest.mark.parametrize("has_offset", [False, True], ids=["offset0", "offset"])
@pytest.mark.parametrize("kind", ["token", "group", "static"])
@pytest.mark.parametrize("N", [640, 896, 1152, 2048])
def test_rows_reduced_in_one_warp_keep_the_next_pass_after_the_reduction(N, kind, has_offset):
    """Rows whose sum of squares a warp's shuffles reduce (no CTA barrier) hold a warp barrier after it:
    without it ptxas hoisted the next pass's shared loads above the shuffles and held both passes'
    values (sm_90a: 149 registers at 896 in groups, 168 at 2048 per token; 3 CTAs an SM, not 5). With
    it: at most 96 at offset 0, 122 with the offset's add (2048 in groups)."""
    stages, _, looped = ring(N, 2, 2, kind, 1 << 30, 132, "H200")
    ptx, cfg = _compile(N, kind, stages=stages, looped=looped, has_offset=has_offset)
    assert cfg.warps_per_row == 1
    report = ptxas_report(ptx, "sm_90a")
    assert report["spill_stores"] == 0 and report["registers"] <= (128 if has_offset else 104), report


def test_register_bound_rule():
    """rmsnorm_fp8_config.min_ctas: CTAs an SM where y (8 V fp32) + 32 fit, for 16-bit rows past 8 vectors a
    thread with dynamic scales and no residual; ptxas's own choice elsewhere."""
    assert min_ctas(fp8_config(12288, 2, 128), "group", False) == 4  # 12 vectors: 128 registers
    assert min_ctas(fp8_config(9216, 2, None), "token", False) == 4  # 9: 104
    assert min_ctas(fp8_config(16384, 2, None), "token", False) == 3  # 16: 160
    for N in (896, 2560, 4096, 8192):  # the ring's forms
        assert min_ctas(fp8_config(N, 2, None), "token", False) == 0
    cfg = fp8_config(12288, 2, None)
    assert min_ctas(cfg, "static", False) == 0 and min_ctas(cfg, "token", True) == 0
    assert min_ctas(fp8_config(8704, 4, None), "token", False) == 0  # fp32 rows (9 vectors): not measured with one


@pytest.mark.parametrize("has_offset,w_dtype", [(False, torch.bfloat16), (True, torch.bfloat16),
                                                (False, torch.float32)], ids=["bf16", "bf16-offset", "fp32-w"])
@pytest.mark.parametrize("kind", ["token", "group"])
@pytest.mark.parametrize("N", [8704, 9600, 12288, 13184, 16384])
def test_register_bound_fits_without_spills(N, kind, has_offset, w_dtype):
    """Where the rule bounds the registers, ptxas fits the kernel in them without spilling (sm_90a), with
    and without an offset's add and beside an fp32 weight (the rule depends on neither)."""
    stages, _, looped = ring(N, 2, w_dtype.itemsize, kind, 1 << 30, 132, "H200")
    ptx, cfg = _compile(N, kind, stages=stages, looped=looped, has_offset=has_offset, w_dtype=w_dtype)
    k = min_ctas(cfg, kind, False)
    assert k and f".minnctapersm {k}" in ptx
    report = ptxas_report(ptx, "sm_90a")
    assert report["spill_stores"] == 0 and report["registers"] <= 65536 // (cfg.threads * k), report


def test_config_rules():
    assert "multiple of 8" in refusal(1004, 2, None)
    assert "one CTA" in refusal(32768, 2, None)
    assert refusal(16384, 2, 128) is None and refusal(16384, 2, 256) is None
    assert "lanes of one warp" in refusal(16384, 2, 512)
    assert "lanes of one warp" in refusal(4096, 2, 4)
    assert "power of two dividing N" in refusal(3072, 2, 24) and "power of two dividing N" in refusal(3072, 2, 2048)
    for N in range(8, 16385, 8):
        cfg = fp8_config(N, 2, None)
        assert cfg.cluster_n == 1 and cfg.tile_cols >= N and cfg.threads <= 1024 and cfg.nvb <= 24, N
        assert cfg.rows % cfg.rpg == 0 and cfg.rows // cfg.rpg <= 16, N
    # rows the forward's tile pads: exact over fewer threads per row
    assert [(fp8_config(N, 2, None).tpr, fp8_config(N, 2, None).nvb) for N in (1664, 2560, 3584)] == [
        (32, 7), (64, 5), (64, 7)]


@pytest.mark.parametrize("L", [2, 4, 8, 16, 32])
def test_transposed_group_reduction(L):
    """The group amax's transposed shuffle reduction, its lanes simulated (a value per lane, the lanes of
    a warp's groups side by side; a shuffle reads lane ^ o): at every V <= L each lane ends with the
    NaN-propagating max over its group of the vector `transposed_plan` says it holds, with that vector's
    column, and every vector is held by its `source` lane. The kernel runs the same function."""
    gen = torch.Generator().manual_seed(L)
    lane = torch.arange(32)
    for V in range(1, L + 1):
        vals = [torch.rand(32, generator=gen, dtype=torch.float64) * 100 for _ in range(V)]
        vals[V // 2][3] = float("nan")  # one NaN: its group's max is NaN at that vector only
        cols = [lane * 1000 + v for v in range(V)]  # a tag per lane and vector
        shuffles = []

        def shuffle(v, o):
            shuffles.append(o)
            return v[lane ^ o]

        a, c = transposed_reduce(list(vals), list(cols), L, lambda o: (lane // o) % 2,
                                 lambda h, x, y: torch.where(h == 0, x, y), shuffle,
                                 lambda x, y: torch.where(x.isnan() | y.isnan(), float("nan"), torch.maximum(x, y)))
        held, source = transposed_plan(V, L)
        assert sorted(set(held)) == list(range(V)) and all(held[source[v]] == v for v in range(V))
        for t in range(32):
            v, group = held[t % L], slice(t - t % L, t - t % L + L)
            expect = vals[v][group]
            assert c[t] == t * 1000 + v, (L, V, t)
            if expect.isnan().any():
                assert a[t].isnan(), (L, V, t)
            else:
                assert a[t] == expect.max(), (L, V, t)
        # one shuffle per slot kept at each level: at most V + log2(L) - 1, against V log2(L) a vector at a time
        assert len(shuffles) <= V + L.bit_length() - 2 and (V < 3 or len(shuffles) < V * (L.bit_length() - 1))


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("N,kind,residual,contiguous", [(896, "group", True, False), (2560, "token", True, True),
                                                        (8192, "static", False, False)])
def test_ring_with_residual_and_strided_rows_compiles(N, kind, residual, contiguous, arch):
    """The ring's variants beside the residual (h written over a slot, fenced before its refill) and at
    a row stride; no spills."""
    ptx, _ = _compile(N, kind, residual=residual, contiguous=contiguous, arch=arch, stages=2)
    assert f".target {arch}" in ptx
    if residual:
        assert "fence.proxy.async.shared::cta" in ptx
    if arch == "sm_90a":
        assert ptxas_report(ptx, arch)["spill_stores"] == 0


def test_ring_rule():
    """Two slots, two tiles a CTA on the H200 up to 16 KiB rows (4 KiB at a given scale) where there are
    tiles for 8 waves of CTAs; one tile a CTA at fewer tiles (the same compiled kernel); past them
    one slot and one tile, with dynamic scales through the tile loop where the weight is 16-bit;
    straight-line one tile a CTA on other GPUs."""
    r = RING_BY_MODEL["H200"]
    assert (r.stages, r.per_cta) == (2, 2)
    many = 16 * 132 * r.per_cta * r.min_waves
    for kind in ("token", "group", "static"):
        for N in (896, 2048) + ((4096, 4104, 8192) if kind != "static" else ()):
            assert ring(N, 2, 2, kind, many, 132, "H200") == (2, 2, True)
        if kind == "static":  # at a given scale the ring stops at 4 KiB rows
            assert ring(2056, 2, 2, kind, many, 132, "H200") == ring(8192, 2, 2, kind, many, 132, "H200") == (
                1, 1, False)
        assert ring(896, 2, 4, kind, many, 132, "H200") == (2, 2, True)  # an fp32 weight beside 16-bit rows
        assert ring(2048, 2, 2, kind, 8, 132, "H200") == (2, 1, True)  # decode sizes: one tile a CTA
        assert ring(4104, 4, 4, kind, many, 132, "H200") == (1, 1, False)  # fp32 rows: not measured with either
        assert ring(2048, 4, 2, kind, many, 132, "H200") == (1, 1, False)
        assert ring(8200, 2, 4, kind, many, 132, "H200") == (1, 1, False)
        assert ring(4096, 2, 2, kind, many, 132, "H100") == (1, 1, False)
        assert ring(4096, 2, 2, kind, many, 170, "B200") == (1, 1, False)
        # past 16 KiB rows the dynamic scales run the tile loop, the per-tensor scale straight-line
        assert ring(8200, 2, 2, kind, many, 132, "H200") == (1, 1, kind != "static")


def test_unsupported_names_why():
    x = torch.randn(4, 1024, dtype=torch.bfloat16)
    assert "2^31 rows" in unsupported(torch.empty(2 ** 31, 8, dtype=torch.bfloat16, device="meta"), None, None, None)
    assert unsupported(x, None, None, None) is None
    assert unsupported(x, x.clone(), torch.bfloat16, 128) is None
    assert "16-byte aligned" in unsupported(torch.randn(4, 1032, dtype=torch.bfloat16)[:, 4:1028], None, None, None)
    assert "residual of x's dtype" in unsupported(x, x.float(), torch.float32, None)
    assert "both contiguous" in unsupported(x, torch.randn(4, 2048, dtype=torch.bfloat16)[:, :1024],
                                            torch.bfloat16, None)
    assert "fp16, bf16 or fp32" in unsupported(x.double(), None, None, None)


GPU_KINDS = ["token", "group", "group_ue8m0", "static", "static_saturating", "token_ub", "residual",
             "residual_group"]


@pytest.mark.gpu
@pytest.mark.parametrize("out_dtype", [E4M3, E5M2], ids=str)
@pytest.mark.parametrize("kind", GPU_KINDS)
@pytest.mark.parametrize("N", [256, 1024, 1664, 2560, 3584, 5120, 8192, 13312, 16384])
def test_matches_the_reference_quantizer(seed, out_dtype, kind, N):
    _check(N, kind, out_dtype, torch.bfloat16, M=37)


@pytest.mark.gpu
@pytest.mark.parametrize("x_dtype", [torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("kind", ["token", "group", "residual"])
@pytest.mark.parametrize("N", [128, 2048, 6144])
def test_other_dtypes(seed, x_dtype, kind, N):
    _check(N, kind, E4M3, x_dtype, M=21)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["token", "group", "residual"])
@pytest.mark.parametrize("N", [2048, 10240, 16384])
def test_fp32_weight_and_offset(seed, kind, N):
    _check(N, kind, E4M3, torch.bfloat16, M=19, w_dtype=torch.float32, offset=1.0)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["token", "group", "residual", "static"])
@pytest.mark.parametrize("N", [512, 3072, 10240])
def test_strided_rows_and_one_row(seed, kind, N):
    _check(N, kind, E4M3, torch.bfloat16, M=29, pad=24)
    _check(N, kind, E4M3, torch.bfloat16, M=1, pad=40)


@pytest.mark.gpu
@pytest.mark.parametrize("launch", [(1, 1, False), (1, 1, True), (2, 3, True), (3, 8, True)],
                         ids=lambda r: f"s{r[0]}t{r[1]}{'loop' if r[2] else ''}")
@pytest.mark.parametrize("kind", ["token", "group", "static", "residual", "residual_group"])
@pytest.mark.parametrize("N", [896, 1536, 2560, 5120, 14336])
def test_tile_ring(seed, kind, N, launch):
    """Several tiles per CTA through a ring of slots: the last CTA with fewer tiles, a part-full last
    tile, contiguous and strided rows; and one tile a CTA, straight-line (what GPUs without a ring run)
    and through the tile loop (the H200's per-token rows past 16 KiB), on whatever GPU runs the tests."""
    stages, per_cta, looped = launch
    _check(N, kind, E4M3, torch.bfloat16, M=103, stages=stages, per_cta=per_cta, looped=looped)
    _check(N, kind, E4M3, torch.bfloat16, M=45, pad=16, stages=stages, per_cta=per_cta, looped=looped)


def _check(N, kind, out_dtype, x_dtype, M, pad=0, w_dtype=None, offset=0.0, stages=None, per_cta=None, looped=False):
    from cutile_norms.cute.rmsnorm_fp8 import rms_norm_fp8

    def rows():
        return random_rows((M, N + pad), x_dtype, "cuda")[:, :N]
    x = rows()
    if M > 3:
        x[1] = 0.0
        x[2, 5] = float("inf")
        x[3, 6] = float("nan")
    w = random_weight(N, w_dtype or x_dtype, "cuda")
    r = rows() if kind.startswith("residual") else None
    scale = (torch.tensor([{"static": 0.01, "static_saturating": 1e-5}[kind]], device="cuda")
             if kind.startswith("static") else None)
    ub = 2.0 if kind == "token_ub" else None
    group = 128 if "group" in kind else None
    ue8m0 = kind == "group_ue8m0"
    why = unsupported(x, r, x_dtype if r is not None else None, group)
    if group and N * x_dtype.itemsize < 1024:  # a row over fewer threads than a group's lanes (Triton runs it)
        assert "lanes of one warp" in why
        return
    assert why is None, why
    poison_next_allocations([M * N, M * N * x_dtype.itemsize, 4 * M, 4 * M * (N // (group or N))], "cuda")
    q, s, h, rstd = rms_norm_fp8(x, r, w, 1e-6, offset, out_dtype, x_dtype if r is not None else None, scale, ub,
                                 group, ue8m0, stages=stages, per_cta=per_cta, looped=looped)
    what = f"{kind} {out_dtype} {x_dtype} N={N} M={M} pad={pad} ring={stages}x{per_cta}{' looped' if looped else ''}"
    src = x
    if r is not None:
        assert same_bits_or_both_nan(h.float(), (x.float() + r.float()).to(x_dtype).float()), f"{what}: h"
        src = h
    ssq = src.double().square().mean(-1)
    finite = torch.isfinite(ssq)
    assert torch.allclose(rstd.double()[finite], torch.rsqrt(ssq[finite] + 1e-6), rtol=1e-5), f"{what}: rstd"
    # a row holding inf: rstd 0 (written: the poison is NaN); one holding NaN: NaN (as the poison, unverified)
    assert (rstd[torch.isposinf(ssq)] == 0).all() and torch.isnan(rstd[torch.isnan(ssq)]).all(), f"{what}: rstd"
    y = (src.float() * rstd[:, None]) * (w.float() + offset if offset else w.float())  # the kernel's op order
    s_ref, q_ref = fp8_reference(y, out_dtype, scale, group, ub, ue8m0)
    assert s.shape == s_ref.shape and same_bits_or_both_nan(s, s_ref), f"{what}: scales"
    assert same_bits_or_both_nan(q.float(), q_ref.float()), f"{what}: q differs from the reference quantizer"
    if scale is None and M > 3 and r is None:
        assert torch.isnan(s[3]).all() and torch.isnan(s[2]).any(), f"{what}: NaN scales where y has NaN"


def test_one_row_is_judged_as_its_batch_for_mode_none():
    """mode=None's refusal (fp8.pick_kernel): one row of a tensor whose rows are not 16-byte aligned is
    refused as its batch is, so it runs the batch's kernel (Triton's) and gives its bits; by name one row
    at any stride is taken."""
    from cutile_norms.cute.rmsnorm_fp8 import unsupported

    N = 4104
    x = torch.randn(4, N + 4, dtype=torch.bfloat16)[:, :N]  # rows 8 bytes apart from 16-byte multiples
    assert unsupported(x, None, None, None) and unsupported(x, None, None, None, batch_invariant=True)
    assert unsupported(x[:1], None, None, None) is None
    assert "aligned" in unsupported(x[:1], None, None, None, batch_invariant=True)
    assert unsupported(torch.randn(1, N, dtype=torch.bfloat16), None, None, None, batch_invariant=True) is None
