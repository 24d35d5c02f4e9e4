"""rms_norm_fp8 (cutile_norms/fp8.py): the FP8 output's semantics against an fp64 oracle, the scales'
shapes and layouts, rows of zeros, huge values, inf and NaN, validation, torch.compile.

Oracle: y in fp64; a dynamic scale from the fp64 amax; q = fp8 of y / s rounded to nearest. The
torch-ops path and the kernel compute y in fp32, so their amax (and scale) differ from the oracle's
by fp32 rounding (relative 1e-6) and a q element may sit one fp8 step away where y / s is within that
of a rounding boundary: q is checked within one step, scales within 1e-6. (The kernel's bit-exact
agreement with the reference quantizer, given its rstd, is tests/triton/test_rmsnorm_fp8.py.)
"""
from __future__ import annotations

import pytest
import torch

import cutile_norms as cn
from cutile_norms.fp8 import pick_kernel
from cutile_norms.reference import FP8_MAX, FP8_MIN_AMAX
from tests.conftest import random_rows, random_weight

MANTISSA = {torch.float8_e4m3fn: 3, torch.float8_e5m2: 2}
SUBNORMAL_STEP = {torch.float8_e4m3fn: 2.0 ** -9, torch.float8_e5m2: 2.0 ** -16}  # the spacing below the normals
# CPU: the torch ops (no FP8 kernel runs off the GPU: fp8.kernel_refusal); the GPU: the kernels, each by name
CASES = [pytest.param("cpu", "torch", id="cpu-torch"), pytest.param("cpu", None, id="cpu-None"),
         pytest.param("cpu", "triton", id="cpu-triton"),
         pytest.param("cuda", None, marks=pytest.mark.gpu, id="cuda-None"),
         pytest.param("cuda", "triton", marks=pytest.mark.gpu, id="cuda-triton"),
         pytest.param("cuda", "tma_smem_cached", marks=pytest.mark.gpu, id="cuda-tma_smem_cached")]


def oracle(x, w, eps, offset, out_dtype, scale=None, scale_ub=None, group=None):
    """(y / s in fp64, s in fp64 with the scales' shape)."""
    xd = x.double()
    y = xd * torch.rsqrt(xd.square().mean(-1, keepdim=True) + eps)
    if w is not None:
        y = y * (w.double() + offset)
    top = FP8_MAX[out_dtype]
    if scale is not None:
        return y / scale, torch.tensor([scale], dtype=torch.float64)
    yg = y.unflatten(-1, (y.shape[-1] // group, group)) if group else y.unsqueeze(-2)
    a = yg.abs().amax(-1)
    if scale_ub is not None:
        a = a.clamp(max=scale_ub)
    s = a.clamp(min=FP8_MIN_AMAX) / top
    v = (yg / s.unsqueeze(-1)).flatten(-2)
    return v, (s if group else s)


def assert_fp8_close(q, v, out_dtype, what):
    """q within one fp8 step of v (clamped to the format's range); NaN exactly where v is NaN."""
    top = FP8_MAX[out_dtype]
    vc = v.clamp(-top, top)
    qf = q.double()
    assert torch.equal(torch.isnan(qf), torch.isnan(vc)), f"{what}: NaN in other places"
    ok = ~torch.isnan(vc)
    tiny = SUBNORMAL_STEP[out_dtype]
    step = torch.exp2(torch.floor(torch.log2(vc.abs().clamp(min=tiny))) - MANTISSA[out_dtype]).clamp(min=tiny)
    err = (qf - vc).abs()[ok] / step[ok]
    assert (err <= 1.0 + 1e-9).all(), f"{what}: {int((err > 1).sum())} elements more than one fp8 step off"


@pytest.mark.parametrize("device,mode", CASES)
@pytest.mark.parametrize("out_dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=str)
@pytest.mark.parametrize("kind", ["token", "group", "static", "token_ub"])
def test_matches_oracle(seed, device, mode, out_dtype, kind):
    x = random_rows((3, 5, 512), torch.bfloat16, device)
    w = random_weight(512, torch.bfloat16, device)
    kw = {"token": {}, "group": {"group_size": 128}, "static": {"scale": 0.01}, "token_ub": {"scale_ub": 1.5}}[kind]
    q, s = cn.rms_norm_fp8(x, w, 1e-6, out_dtype=out_dtype, mode=mode, **kw)
    v, s64 = oracle(x, w, 1e-6, 0.0, out_dtype, kw.get("scale"), kw.get("scale_ub"), kw.get("group_size"))
    assert q.dtype == out_dtype and q.shape == x.shape and s.dtype == torch.float32
    assert s.shape == s64.shape, f"scales {tuple(s.shape)}, expected {tuple(s64.shape)}"
    assert torch.allclose(s.double().cpu(), s64.cpu(), rtol=1e-6, atol=0), f"{kind} scales [seed {seed}]"
    assert_fp8_close(q.cpu(), v.cpu(), out_dtype, f"{kind} {out_dtype} [seed {seed}]")


@pytest.mark.parametrize("device,mode", CASES)
def test_layouts(device, mode):
    x = random_rows((4, 6, 256), torch.bfloat16, device)
    q, s = cn.rms_norm_fp8(x, None, mode=mode)
    assert s.shape == (4, 6, 1) and s.is_contiguous()
    q, s = cn.rms_norm_fp8(x, None, mode=mode, group_size=64)
    assert s.shape == (4, 6, 4) and s.stride() == (24, 4, 1), "1 x 64 group scales: [..., N / 64] row-major"
    q, s = cn.rms_norm_fp8(x, None, mode=mode, group_size=128, scale_ue8m0=True)
    m, e = torch.frexp(s)
    assert (m == 0.5).all(), "UE8M0 scales are powers of two"


@pytest.mark.parametrize("device,mode", CASES)
def test_zeros_huge_inf_nan(device, mode):
    x = random_rows((6, 256), torch.float32, device)
    x[0] = 0.0
    # a huge row whose fp32 sum of squares still fits (|x| ~ 1e17: 256 x 1e34); past ~1e18 it overflows
    # to inf, rstd 0 and y 0, as torch's own fp32 rms_norm gives (random_rows' row scale could get there)
    x[1] = torch.randn(256, device=device) * 1e17
    x[2, 7] = float("inf")
    x[3, 9] = float("nan")
    q, s = cn.rms_norm_fp8(x, None, mode=mode)
    assert s[0].item() == torch.tensor(FP8_MIN_AMAX / 448.0, dtype=torch.float32).item() and not q[0].float().any()
    v, s64 = oracle(x[1:2], None, 1e-6, 0.0, torch.float8_e4m3fn)
    assert_fp8_close(q[1:2].cpu(), v.cpu(), torch.float8_e4m3fn, "huge row")
    for r in (2, 3):
        assert torch.isnan(s[r]).all() and torch.isnan(q[r].float()).all(), f"row {r}: NaN scale and q"
    qs, _ = cn.rms_norm_fp8(x, None, mode=mode, scale=0.01)
    assert torch.isnan(qs[3, 9].float()) and torch.isnan(qs[2].float()).sum() >= 1
    assert torch.isfinite(qs[4:].float()).all() and qs[4:].float().abs().max() <= 448


@pytest.mark.parametrize("device,mode", CASES)
@pytest.mark.parametrize("kind", ["token", "group", "static"])
def test_a_negative_zero_weight_keeps_its_sign(device, mode, kind):
    """At offset 0 the weight multiplies as it is (torch's RMSNorm's y): where w is -0.0, y is a zero of
    the opposite sign to x's and q its fp8 zero (0x80 where x > 0); with an offset, w + offset. (1024
    columns: every kind runs the named kernel, the CuTe DSL one's groups included.)"""
    x = random_rows((4, 1024), torch.bfloat16, device)
    w = random_weight(1024, torch.bfloat16, device)
    w[::7], w[3::7] = -0.0, 0.0
    kw = {"token": {}, "group": {"group_size": 128}, "static": {"scale": 0.01}}[kind]
    if device == "cuda" and mode:
        assert pick_kernel(mode, x, None, None, kw.get("group_size"))[0] == mode
    q, _ = cn.rms_norm_fp8(x, w, mode=mode, **kw)
    bits = q.view(torch.uint8).cpu()
    neg_x = (x < 0).cpu()
    for start, sign in ((0, 1), (3, 0)):  # w -0.0 (sign 1) and +0.0
        expect = (neg_x[:, start::7] ^ bool(sign)).to(torch.uint8) * 0x80
        assert torch.equal(bits[:, start::7], expect), f"{mode} {kind}: zeros of w={'-' if sign else '+'}0.0"
    q1, _ = cn.rms_norm_fp8(x, w, offset=1.0, mode=mode, **kw)
    v, _ = oracle(x, w, 1e-6, 1.0, torch.float8_e4m3fn, kw.get("scale"), None, kw.get("group_size"))
    assert_fp8_close(q1.cpu(), v.cpu(), torch.float8_e4m3fn, f"{mode} {kind} offset 1")


def test_residual_and_offset(seed):
    x, r = random_rows((4, 256), torch.bfloat16, "cpu"), random_rows((4, 256), torch.bfloat16, "cpu")
    w = random_weight(256, torch.float32, "cpu")
    q, s, h = cn.rms_norm_fp8(x, w, residual=r, offset=1.0, group_size=128)
    assert torch.equal(h, (x.float() + r.float()).to(torch.bfloat16))
    v, s64 = oracle(h, w, 1e-6, 1.0, torch.float8_e4m3fn, group=128)
    assert_fp8_close(q, v, torch.float8_e4m3fn, "residual")
    torch.testing.assert_close(s.double(), s64, rtol=1e-5, atol=0, msg=lambda m: f"residual scales: {m}")


@pytest.mark.parametrize("kw,err,match", [
    (dict(out_dtype=torch.bfloat16), TypeError, "out_dtype"), (dict(scale=-1.0), ValueError, "scale"),
    (dict(scale=0.1, group_size=128), ValueError, "per tensor"), (dict(group_size=100), ValueError, "power of two"),
    (dict(group_size=512), ValueError, "dividing"), (dict(scale_ub=0.0), ValueError, "scale_ub"),
    (dict(mode="nope"), ValueError, "unknown mode")])
def test_validation(kw, err, match):
    with pytest.raises(err, match=match):
        cn.rms_norm_fp8(torch.randn(2, 256), **kw)
    with pytest.raises(RuntimeError, match="not differentiable"):
        cn.rms_norm_fp8(torch.randn(2, 256, requires_grad=True))


def test_torch_compile_fullgraph():
    f = torch.compile(lambda a: cn.rms_norm_fp8(a, None, group_size=128), fullgraph=True, backend="aot_eager",
                      dynamic=True)
    for M in (3, 7):
        x = torch.randn(M, 256)
        q, s = f(x)
        qe, se = cn.rms_norm_fp8(x, None, group_size=128)
        assert torch.equal(q.float(), qe.float()) and torch.equal(s, se)
    g = torch.compile(lambda a, t: cn.rms_norm_fp8(a, None, scale=t), fullgraph=True, backend="aot_eager",
                      dynamic=True)  # a given scale: returned as given, not an output of the op
    t = torch.tensor([0.02])
    q, s = g(torch.randn(5, 256), t)
    assert torch.equal(s, t) and q.shape == (5, 256)


def test_scale_shapes_and_empty_rows():
    x = torch.randn(3, 64)
    q, s = cn.rms_norm_fp8(x, None, scale=torch.tensor([[[0.02]]]))
    assert q.shape == x.shape and s.shape == (1,), "a one-element scale of any shape is the per-tensor scale"
    q1, _ = cn.rms_norm_fp8(x[0], None, scale=torch.tensor([[0.02]]))
    assert q1.shape == (64,)
    given = torch.tensor([[0.03]])
    _, s = cn.rms_norm_fp8(x, None, scale=given)
    assert s.data_ptr() == given.data_ptr() and s.shape == (1,), "the given scale itself, no copy"
    _, s = cn.rms_norm_fp8(x, None, scale=1 / 3)  # a number: fp32 rounded to nearest, as torch.tensor makes it
    assert s.dtype == torch.float32 and torch.equal(s.view(torch.int32), torch.tensor([1 / 3]).view(torch.int32))
    q, s = cn.rms_norm_fp8(torch.randn(3, 0), None)
    assert q.shape == (3, 0) and s.shape == (3, 1) and (s == torch.tensor(FP8_MIN_AMAX / 448.0)).all()
    q, s = cn.rms_norm_fp8(torch.randn(0, 64), None, group_size=32)
    assert q.shape == (0, 64) and s.shape == (0, 2)


@pytest.mark.parametrize("device,mode", CASES)
def test_column_major_scales(device, mode):
    """scale_layout="column": the rows' dim at stride 1 (CUTLASS blockwise / DeepGEMM), same values."""
    x = random_rows((6, 512), torch.bfloat16, device)
    q, s = cn.rms_norm_fp8(x, None, mode=mode, group_size=128)
    qc, sc = cn.rms_norm_fp8(x, None, mode=mode, group_size=128, scale_layout="column")
    assert sc.shape == (6, 4) and sc.stride() == (1, 6)
    assert torch.equal(qc.float(), q.float()) and torch.equal(sc, s)
    x3 = random_rows((2, 3, 256), torch.bfloat16, device)
    _, s3 = cn.rms_norm_fp8(x3, None, mode=mode, scale_layout="column", group_size=64)
    assert s3.shape == (2, 3, 4) and s3.reshape(6, 4).stride() == (1, 6), "column-major over the flattened rows"
    with pytest.raises(ValueError, match="scale_layout"):
        cn.rms_norm_fp8(x, None, scale_layout="diagonal")


def test_kernel_rule():
    """A kernel runs for mode None / "triton" / "tma_smem_cached" on NVIDIA GPUs from sm_89, rows up to
    FP8_KERNEL_MAX_N, the fused kernels on; else the torch ops, with a reason (A100: no fp8e4nv in
    Triton; the CPU: the interpreter's fp8 conversion is not the GPU's). mode=None's choice between
    the two (fp8.cute_wins): CuTe DSL past 4096 columns, past 2048 wherever Triton's block pads the
    row and past 1024 where a 16-bit row fills at most 3/4 of it, for every scale kind; on the H200 (its
    CuTe DSL kernel's ring) wherever Triton's block pads a 16-bit row past 512 columns."""
    import os

    from cutile_norms import fp8
    from cutile_norms._platform import CPU, DeviceInfo, Toolchain

    tools = Toolchain(cutile=None, cute=None, triton=None)
    h100 = DeviceInfo("nvidia", "NVIDIA H100 80GB HBM3", (9, 0), 132, 0)
    a100 = DeviceInfo("nvidia", "NVIDIA A100-SXM4-80GB", (8, 0), 108, 0)
    mi300 = DeviceInfo("amd", "AMD Instinct MI300X", (9, 4), 304, 0)
    old = os.environ.pop("CUTILE_NORMS_FUSED", None)
    try:
        assert fp8.kernel_refusal(None, 4096, h100, tools) is None
        assert fp8.kernel_refusal("triton", fp8.FP8_KERNEL_MAX_N, h100, tools) is None
        assert "up to" in fp8.kernel_refusal(None, fp8.FP8_KERNEL_MAX_N + 1, h100, tools)
        assert "no FP8 kernel" in fp8.kernel_refusal("multi_wave_cached", 4096, h100, tools)
        assert [N for N in (896, 1024, 1032, 1304, 1528, 1536, 1664, 1800, 2048, 2560, 3072, 3584, 4096, 4608, 8192,
                            16384) if fp8.cute_wins(N, 2, None)] == [1032, 1304, 1528, 1536, 2560, 3072, 3584, 4608,
                                                                     8192, 16384]
        assert not fp8.cute_wins(1032, 4, None) and fp8.cute_wins(2056, 4, None)  # fp32: the 1024-2048 rule unmeasured
        assert [N for N in (1152, 1408, 1536, 2048, 2560, 3584, 4096, 5120, 6144, 8192, 10240, 13312, 14336, 16384)
                if fp8.cute_wins(N, 2, 128)] == [1152, 1408, 1536, 2560, 3584, 5120, 6144, 8192, 10240, 13312,
                                                 14336, 16384]
        # the H200 (its CuTe DSL kernel's ring): also wherever Triton's block pads a 16-bit row past 512 columns
        widths = (512, 520, 640, 768, 896, 1024, 1152, 1800, 1960, 2048, 2056, 4096, 8192, 8200)
        assert [N for N in widths if fp8.cute_wins(N, 2, None, "H200")] == [520, 640, 768, 896, 1152, 1800, 1960,
                                                                            2056, 8192, 8200]
        assert [N for N in widths if N % 128 == 0 and fp8.cute_wins(N, 2, 128, "H200")] == [640, 768, 896, 1152, 8192]
        assert not fp8.cute_wins(1800, 2, None, "H100") and not fp8.cute_wins(1800, 4, None, "H200")  # fp32: unmeasured
        assert "sm_89" in fp8.kernel_refusal(None, 4096, a100, tools)
        assert "NVIDIA" in fp8.kernel_refusal(None, 4096, mi300, tools)
        assert "interpreter" in fp8.kernel_refusal("triton", 4096, CPU, tools)
        os.environ["CUTILE_NORMS_FUSED"] = "0"
        assert "CUTILE_NORMS_FUSED=0" in fp8.kernel_refusal(None, 4096, h100, tools)
    finally:
        os.environ.pop("CUTILE_NORMS_FUSED", None)
        if old is not None:
            os.environ["CUTILE_NORMS_FUSED"] = old


def test_explain_says_how_the_fp8_output_runs(monkeypatch):
    x = torch.randn(4, 256)
    assert "fp8 output: the torch ops (off the GPU (Triton's interpreter" in cn.explain(x, fp8=True, mode="triton")
    monkeypatch.setenv("CUTILE_NORMS_FUSED", "0")
    assert "CUTILE_NORMS_FUSED=0" in cn.explain(x, fp8=True)
    assert "fp8 output" not in cn.explain(x)


@pytest.mark.gpu
def test_explain_names_the_fp8_kernel():
    from cutile_norms.fp8 import FP8_KERNELS

    x = torch.randn(4, 5120, device="cuda", dtype=torch.bfloat16)
    if torch.cuda.get_device_capability() >= (8, 9):
        text = cn.explain(x, fp8=True, mode="triton")
        assert f"fp8 output: {FP8_KERNELS['triton']} (per-token scales: 1 row(s) x 8192 columns" in text, text
        if "tma_smem_cached" in cn.available_modes():
            text = cn.explain(x, fp8=True)  # 5120 in an 8192 block: the CuTe DSL kernel
            assert (f"fp8 output: {FP8_KERNELS['tma_smem_cached']} (per-token scales: row tiles in shared memory"
                    in text), text
            assert "1 x 128 group scales" in cn.fp8.describe(x, None, 128)
            wide = torch.randn(4, 12288, device="cuda", dtype=torch.bfloat16)  # 12 vectors a thread: the bound
            assert "registers bounded to 4 CTAs an SM" in cn.fp8.describe(wide, "tma_smem_cached", 128)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["triton", "tma_smem_cached"])
@pytest.mark.parametrize("kind", ["token", "group", "static"])
def test_cuda_graph_replay(mode, kind, seed):
    """Captured in a CUDA graph (the first call, which compiles, outside it) and replayed on new x: q and
    the scales equal an eager call's bit for bit. (A per-tensor scale is given as a tensor: a Python
    float becomes a host-to-device copy, which a capture does not allow.)"""
    if cn.available_modes().get(mode) is not None or torch.cuda.get_device_capability() < (8, 9):
        pytest.skip(f"no FP8 kernel for mode {mode!r} here")
    kw = {"token": {}, "group": {"group_size": 128},
          "static": {"scale": torch.tensor([0.02], device="cuda")}}[kind]
    x = random_rows((64, 5120), torch.bfloat16, "cuda")
    w = random_weight(5120, torch.bfloat16, "cuda")
    cn.rms_norm_fp8(x, w, mode=mode, **kw)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        q, s = cn.rms_norm_fp8(x, w, mode=mode, **kw)
    x.copy_(random_rows((64, 5120), torch.bfloat16, "cuda"))
    q.view(torch.uint8).fill_(0xFF)  # NaN in e4m3: a q the replay does not write shows
    if kind != "static":  # (at a given scale s is the caller's tensor itself)
        s.fill_(float("nan"))
    g.replay()
    torch.cuda.synchronize()
    eq, es = cn.rms_norm_fp8(x, w, mode=mode, **kw)
    assert torch.equal(q.view(torch.uint8), eq.view(torch.uint8)), f"{mode} {kind}: q after replay [seed {seed}]"
    assert torch.equal(s, es), f"{mode} {kind}: scales after replay [seed {seed}]"


@pytest.mark.gpu
@pytest.mark.parametrize("N", [1536, 1544, 2560])
@pytest.mark.parametrize("kind", ["token", "group"])
def test_mode_none_between_the_kernels(N, kind, seed):
    """At widths on both sides of fp8.cute_wins's fill rule (1536: the CuTe DSL kernel, 1544: Triton's,
    but on an H200, whose CuTe DSL kernel takes rows through a ring, the CuTe one) mode=None gives the
    picked kernel's bits, and each kernel matches the oracle. (The two kernels are
    not bit for bit one another: their sums of squares add in different orders, so rstd, and with it a
    scale or a q, can differ by an ulp or a step.)"""
    from cutile_norms import fp8
    from cutile_norms._platform import gpu_model

    modes = cn.available_modes()
    if torch.cuda.get_device_capability() < (8, 9) or modes.get("triton") or modes.get("tma_smem_cached"):
        pytest.skip("both FP8 kernels are needed")
    if kind == "group" and N % 128:
        pytest.skip("1 x 128 groups need N a multiple of 128")
    kw = {"group_size": 128} if kind == "group" else {}
    x = random_rows((37, N), torch.bfloat16, "cuda")
    w = random_weight(N, torch.bfloat16, "cuda")
    runs = {m: cn.rms_norm_fp8(x, w, 1e-6, mode=m, **kw) for m in (None, "triton", "tma_smem_cached")}
    picked = fp8.pick_kernel(None, x, None, None, kw.get("group_size"))[0]
    h200 = gpu_model(torch.cuda.get_device_name()) == "H200"
    assert picked == ("tma_smem_cached" if N in (1536, 2560) or h200 else "triton"), picked
    q, s = runs[None]
    assert torch.equal(q.view(torch.uint8), runs[picked][0].view(torch.uint8)), f"{N} {kind}: q [seed {seed}]"
    assert torch.equal(s, runs[picked][1]), f"{N} {kind}: scales [seed {seed}]"
    v, s64 = oracle(x, w, 1e-6, 0.0, torch.float8_e4m3fn, None, None, kw.get("group_size"))
    for m in ("triton", "tma_smem_cached"):
        q, s = runs[m]
        assert torch.allclose(s.double().cpu(), s64.cpu(), rtol=1e-6, atol=0), f"{N} {kind} {m} scales [seed {seed}]"
        assert_fp8_close(q.cpu(), v.cpu(), torch.float8_e4m3fn, f"{N} {kind} {m} [seed {seed}]")
