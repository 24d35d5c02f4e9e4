"""The fused residual add (cutile_norms/residual.py): rms_norm(x, w, residual=r) -> (y, h),
add_rms_norm_ in place, RMSNorm.forward(x, residual), the ops under torch.compile, explain().

Oracles: h = the fp32 sum rounded once to h's dtype (bit for bit, the contract); y = the fp64 norm of
h as stored; grads = the fp64 closed form of the norm's backward at h plus the grad into h from
later uses (dx = dresidual), within two roundings of h's dtype (the norm's grad is rounded to h's
dtype, then the sum). The CPU runs mode "torch", mode None, and mode "triton" under Triton's
interpreter, unfused (the fused kernels do not run off the GPU: the interpreter's bf16 h is one ulp off;
tests/triton/test_add_rmsnorm.py calls them directly); the GPU every mode, fused (CUTILE_NORMS_FUSED=1,
the default) and not.
"""
from __future__ import annotations

import os
import re

import pytest
import torch

import cutile_norms as cn
from cutile_norms import dispatch
from cutile_norms._platform import device_info, toolchain
from tests.conftest import (TOLERANCES, assert_close, assert_grad_close, assert_stored_sum, random_rows, random_weight,
                            reference64, reference_bwd64)

CPU_CASES = [pytest.param("cpu", m, False, id=f"cpu-{m}-unfused") for m in ("torch", None, "triton")]
GPU_CASES = [pytest.param("cuda", m, f, marks=pytest.mark.gpu, id=f"cuda-{m}-{'fused' if f else 'unfused'}")
             for m in [None] + dispatch.modes_of() for f in ((False, True) if m != "torch" else (False,))]
CASES = CPU_CASES + GPU_CASES


def refusal(mode, shape, h_dtype, device) -> str | None:
    """What the backend of a mode named explicitly says about rows of h's shape and dtype (None: takes them)."""
    if mode in (None, "torch"):
        return None
    backend = dispatch.backend(mode)
    if backend.takes_every_row:
        return None
    return backend.unsupported(torch.empty(shape, dtype=h_dtype, device=device).view(-1, shape[-1]))


@pytest.fixture
def fused_gate(monkeypatch):
    def set_gate(on: bool):
        monkeypatch.setenv("CUTILE_NORMS_FUSED", "1" if on else "0")
    return set_gate


def check_h(h, x, r, device, fused, what, s):
    assert_stored_sum(h, x, r, what, s, interpreted_kernel=fused and device == "cpu")


def check_grads(x, r, w, h, dy, dh, offset, s, what):
    """x.grad, r.grad and w.grad (those that require grad) against the norm's fp64 backward at h (as
    stored) plus dh."""
    g, gw, sg, sw = reference_bwd64(h.detach().reshape(-1, h.shape[-1]), w.detach() if w is not None else None,
                                    dy.reshape(-1, h.shape[-1]), 1e-6, offset)
    expected = g.reshape(h.shape) + (dh.double() if dh is not None else 0)
    terms = g.abs().reshape(h.shape) + (dh.double().abs() if dh is not None else 0)
    for t in (x, r):
        if not t.requires_grad:
            continue
        a = t.grad.double()
        assert t.grad.dtype == t.dtype and torch.isfinite(a).all(), f"{what}: grad of a {t.dtype} input [seed {s}]"
        rt = max(TOLERANCES[h.dtype]["rtol"], TOLERANCES[t.dtype]["rtol"])
        limit = 1e-5 + 2 * rt * terms + 2.0 ** -16 * sg.reshape(h.shape)
        over = (a - expected).abs() > limit
        assert not over.any(), f"{what}: {int(over.sum())} grad elements off [seed {s}]"
    if w is not None and w.requires_grad:
        a = w.grad.double()
        tol = TOLERANCES[w.dtype]
        assert w.grad.dtype == w.dtype and torch.isfinite(a).all(), f"{what}: dw non-finite [seed {s}]"
        assert not ((a - gw).abs() > 1e-5 + tol["rtol"] * gw.abs() + 2.0 ** -16 * sw).any(), f"{what}: dw [seed {s}]"


@pytest.mark.parametrize("device,mode,fused", CASES)
@pytest.mark.parametrize("shape,x_dtype,r_dtype,h_dtype,w_dtype,offset", [
    ((3, 5, 64), torch.bfloat16, torch.bfloat16, None, torch.bfloat16, 0.0),
    ((7, 1000), torch.bfloat16, torch.float32, torch.float32, torch.float32, 0.0),
    ((4, 4096), torch.float16, torch.float16, None, None, 0.0),
    ((2, 9000), torch.float32, torch.float32, None, torch.float32, 1.0),
    ((5, 2048), torch.bfloat16, torch.bfloat16, torch.float32, torch.bfloat16, 1.0),
    ((3, 300), torch.float32, torch.bfloat16, torch.bfloat16, torch.float32, 0.0),
    ((67, 24576), torch.bfloat16, torch.bfloat16, None, torch.bfloat16, 0.0),  # the CuTe backward, dh inside
    ((3, 40968), torch.bfloat16, torch.bfloat16, None, torch.bfloat16, 0.0),  # past FUSED_ADD_MAX_N (mode None: split)
    ((5, 12296), torch.bfloat16, torch.float32, torch.float32, torch.bfloat16, 1.0),
    ((3, 20488), torch.bfloat16, torch.bfloat16, None, torch.float32, 1.0)])  # fp32 weight past 16384: CuTe
def test_forward_and_backward(fused_gate, seed, device, mode, fused, shape, x_dtype, r_dtype, h_dtype, w_dtype,
                              offset):
    fused_gate(fused)
    x = random_rows(shape, x_dtype, device).requires_grad_()
    r = random_rows(shape, r_dtype, device).requires_grad_()
    w = random_weight(shape[-1], w_dtype, device).requires_grad_() if w_dtype else None
    what = f"{mode} fused={fused} {shape} x={x_dtype} r={r_dtype} h={h_dtype} w={w_dtype} offset={offset}"
    why = refusal(mode, shape, h_dtype or x_dtype, device)
    if why:  # a mode asked for by name that cannot take h's rows says so (mode=None picks another)
        with pytest.raises(ValueError, match=re.escape(why)):
            cn.rms_norm(x, w, 1e-6, mode=mode, offset=offset, residual=r, residual_dtype=h_dtype)
        return
    y, h = cn.rms_norm(x, w, 1e-6, mode=mode, offset=offset, residual=r, residual_dtype=h_dtype)
    assert y.shape == h.shape == x.shape and y.dtype == x_dtype and h.dtype == (h_dtype or x_dtype)
    check_h(h.detach(), x.detach(), r.detach(), device, fused, what, seed)
    assert_close(y.detach(), reference64(h.detach(), w.detach() if w is not None else None, 1e-6, offset)[0],
                 x_dtype, f"{what} y", seed)
    dy, dh = torch.randn_like(y), torch.randn_like(h)
    torch.autograd.backward((y, h), (dy, dh))
    check_grads(x, r, w, h, dy, dh, offset, seed, what)


@pytest.mark.parametrize("device,mode,fused", CASES)
@pytest.mark.parametrize("unused", ["h", "y"])
def test_one_output_unused(fused_gate, seed, device, mode, fused, unused):
    """Only y (the last layer's residual is dropped) or only h flows on: the other's grad is none."""
    fused_gate(fused)
    x = random_rows((6, 512), torch.bfloat16, device).requires_grad_()
    r = random_rows((6, 512), torch.bfloat16, device).requires_grad_()
    w = random_weight(512, torch.bfloat16, device).requires_grad_()
    y, h = cn.rms_norm(x, w, mode=mode, residual=r)
    dy, dh = torch.randn_like(y), torch.randn_like(h)
    if unused == "h":
        y.backward(dy)
        check_grads(x, r, w, h, dy, None, 0.0, seed, f"{mode} h unused")
    else:
        h.backward(dh)
        for t in (x, r):
            assert torch.equal(t.grad, dh), "with y unused, dx = dresidual = dh"
        assert w.grad is None or not w.grad.any()


@pytest.mark.parametrize("device,mode,fused", CASES)
@pytest.mark.parametrize("shape,dtype", [((4, 3, 768), torch.bfloat16), ((5, 12000), torch.float16),
                                         ((3, 256), torch.float32)])
def test_in_place(fused_gate, seed, device, mode, fused, shape, dtype):
    fused_gate(fused)
    x, r = random_rows(shape, dtype, device), random_rows(shape, dtype, device)
    w = random_weight(shape[-1], dtype, device)
    x0, r0 = x.clone(), r.clone()
    assert cn.add_rms_norm_(x, r, w, 1e-6, mode=mode) is None
    what = f"{mode} fused={fused} in place {shape} {dtype}"
    check_h(r, x0, r0, device, fused, what, seed)
    assert_close(x, reference64(r, w, 1e-6, 0.0)[0], dtype, f"{what} y", seed)


@pytest.mark.parametrize("device,mode,fused", CASES)
def test_in_place_strided(fused_gate, seed, device, mode, fused):
    """Views that are not contiguous (rows of a wider buffer) are written in place all the same."""
    fused_gate(fused)
    xb, rb = random_rows((8, 1040), torch.bfloat16, device), random_rows((8, 1040), torch.bfloat16, device)
    x, r = xb[:, :1024], rb[:, 8:1032]
    w = random_weight(1024, torch.bfloat16, device)
    x0, r0, xb0, rb0 = x.clone(), r.clone(), xb.clone(), rb.clone()
    cn.add_rms_norm_(x, r, w, mode=mode)
    check_h(r, x0, r0, device, fused, f"{mode} strided in place", seed)
    assert_close(x, reference64(r, w, 1e-6, 0.0)[0], torch.bfloat16, f"{mode} strided in place y", seed)
    assert torch.equal(xb[:, 1024:], xb0[:, 1024:]) and torch.equal(rb[:, :8], rb0[:, :8]), "wrote outside the views"


@pytest.mark.parametrize("device,mode,fused", CASES)
def test_in_place_halves_of_one_buffer(fused_gate, seed, device, mode, fused):
    """x and the residual as the two column halves of one buffer: no element shared, so taken."""
    fused_gate(fused)
    buf = random_rows((8, 2048), torch.bfloat16, device)
    x, r = buf[:, :1024], buf[:, 1024:]
    w = random_weight(1024, torch.bfloat16, device)
    x0, r0 = x.clone(), r.clone()
    cn.add_rms_norm_(x, r, w, mode=mode)
    check_h(r, x0, r0, device, fused, f"{mode} halves in place", seed)
    assert_close(x, reference64(r, w, 1e-6, 0.0)[0], torch.bfloat16, f"{mode} halves in place y", seed)


def test_in_place_refuses_autograd_and_shared_memory():
    """Refused before anything is written: autograd, x and residual sharing elements, the weight inside
    either, and a view whose elements share memory (expanded)."""
    x = torch.randn(4, 64, requires_grad=True)
    with pytest.raises(RuntimeError, match="no autograd"):
        cn.add_rms_norm_(x, torch.randn(4, 64))
    buf = torch.randn(4, 128)
    for a, b in ((buf[:, :64], buf[:, 63:127]), (buf[1:, :64], buf[:-1, 60:124]), (buf[:, :64], buf[:, :64])):
        before = buf.clone()
        with pytest.raises(ValueError, match="separate memory"):
            cn.add_rms_norm_(a, b)
        assert torch.equal(buf, before)
    x, r = torch.randn(4, 64), torch.randn(4, 64)
    for w in (r[1], x[2]):
        x0, r0 = x.clone(), r.clone()
        with pytest.raises(ValueError, match="weight apart"):
            cn.add_rms_norm_(x, r, w, mode="torch")
        assert torch.equal(x, x0) and torch.equal(r, r0)
    r0 = r.clone()
    with pytest.raises(ValueError, match="x in place, and its elements share memory"):
        cn.add_rms_norm_(torch.randn(1, 64).expand(4, 64), r)
    assert torch.equal(r, r0), "the residual was written before the refusal"


@pytest.mark.parametrize("bad,err,match", [
    (lambda x: torch.randn(4, 65), ValueError, "x's shape"),
    (lambda x: torch.randn(4, 64).double(), TypeError, "residual must be float16"),
    (lambda x: [1.0], TypeError, "torch.Tensor")])
def test_validation(bad, err, match):
    x = torch.randn(4, 64)
    with pytest.raises(err, match=match):
        cn.rms_norm(x, residual=bad(x))
    with pytest.raises(ValueError, match="needs a residual"):
        cn.rms_norm(x, residual_dtype=torch.float32)
    with pytest.raises(TypeError, match="residual_dtype"):
        cn.rms_norm(x, residual=torch.randn(4, 64), residual_dtype=torch.int32)


def test_module_forward_with_residual(seed):
    norm = cn.RMSNorm((4, 32), eps=1e-6, mode="torch")
    torch.nn.init.normal_(norm.weight)
    x, r = torch.randn(3, 4, 32), torch.randn(3, 4, 32)
    y, h = norm(x, r)
    assert torch.equal(h, x + r)
    assert torch.allclose(y, norm(x + r), rtol=0, atol=0)


@pytest.mark.parametrize("device,mode,fused", CPU_CASES[1:] + GPU_CASES[:2])
def test_torch_compile_fullgraph(fused_gate, seed, device, mode, fused):
    fused_gate(fused)

    def block(x, r, w):
        y, h = cn.rms_norm(x, w, mode=mode, residual=r)
        return y * 2, h

    compiled = torch.compile(block, fullgraph=True, dynamic=True, backend="aot_eager")
    w = random_weight(256, torch.bfloat16, device)
    for M in (3, 17):
        x, r = random_rows((M, 256), torch.bfloat16, device), random_rows((M, 256), torch.bfloat16, device)
        y, h = compiled(x, r, w)
        ye, he = block(x, r, w)
        assert torch.equal(h, he) and torch.equal(y, ye), f"compiled differs from eager at M={M}"


def test_explain_says_how_the_add_runs(fused_gate):
    """explain() gives the decision and its reason (the rule itself: tests/test_dispatch.py)."""
    x, r = torch.randn(4, 64), torch.randn(4, 64)
    fused_gate(False)
    assert "residual add: torch.add into h" in cn.explain(x, residual=r, mode="triton")
    assert "CUTILE_NORMS_FUSED=0" in cn.explain(x, residual=r, mode="triton")
    fused_gate(True)
    text = cn.explain(x, residual=r, mode="triton")
    assert "residual add: torch.add into h" in text and "interpreter" in text  # the CPU: unfused
    assert "mode torch" in cn.explain(x, residual=r, mode="torch")


@pytest.mark.gpu
def test_explain_names_the_fused_kernels(fused_gate):
    fused_gate(True)
    x = torch.randn(4, 4096, device="cuda", dtype=torch.bfloat16)
    text = cn.explain(x, residual=x.clone())
    assert f"fused into the norm ({dispatch.FUSED_ADD_KERNEL}" in text, text
    narrow = torch.randn(4, 1024, device="cuda", dtype=torch.bfloat16)
    text_narrow = cn.explain(narrow, residual=narrow.clone())
    assert f"residual backward: fused, dh added inside ({dispatch.FUSED_ADD_BWD_KERNEL}" in text_narrow, text_narrow
    if dispatch.unavailable_reason(dispatch.MODES["multi_wave_cached"], device_info(x.device), toolchain()) is None:
        assert "residual backward: fused, dh added inside the norm's backward (multi_wave_cached" in text, text
        # the config the backward runs with dh, which differs from the norm's own (the "backward:" line)
        with_dh = dispatch.backward_backend("multi_wave_cached").describe(4, 4096, torch.bfloat16,
                                                                          device_info(x.device), has_dh=True)
        assert with_dh in text, text
    wide = torch.randn(2, dispatch.FUSED_ADD_MAX_N + 8, device="cuda", dtype=torch.bfloat16)
    text = cn.explain(wide, residual=wide.clone())
    if dispatch.unavailable_reason(dispatch.MODES["multi_wave_cached"], device_info(wide.device), toolchain()) is None:
        assert f"fused into the norm ({dispatch.FUSED_ADD_SPLIT_KERNEL}" in text, text
        assert "residual backward: fused, dh added inside the norm's backward" in text, text


@pytest.mark.parametrize("device,mode,fused", CASES)
def test_y_rounded_once_to_x_dtype_whatever_h(fused_gate, seed, device, mode, fused):
    """An h narrower than x (fp32 x, bf16 h) or another 16-bit type (bf16 x, fp16 h): y is the norm of
    h as stored, in fp32, rounded once to x's dtype (never to h's first: no fp16 overflow, fp32 kept)."""
    fused_gate(fused)
    x, r = random_rows((4, 256), torch.float32, device), random_rows((4, 256), torch.bfloat16, device)
    w = random_weight(256, torch.float32, device)
    y, h = cn.rms_norm(x, w, mode=mode, residual=r, residual_dtype=torch.bfloat16)
    assert h.dtype == torch.bfloat16 and y.dtype == torch.float32
    assert_close(y, reference64(h, w, 1e-6, 0.0)[0], torch.float32, f"{mode} fp32 y over a bf16 h", seed)
    xb = random_rows((4, 256), torch.bfloat16, device)
    wb = torch.full((256,), 1e5, dtype=torch.bfloat16, device=device)  # y past fp16's range, inside bf16's
    y, h = cn.rms_norm(xb, wb, mode=mode, residual=xb.clone(), residual_dtype=torch.float16)
    assert torch.isfinite(y.float()).all(), "y went through fp16 (h's dtype) and overflowed"
    assert_close(y, reference64(h, wb, 1e-6, 0.0)[0], torch.bfloat16, f"{mode} bf16 y over an fp16 h", seed)
    x32, r16 = random_rows((3, 128), torch.float32, device), random_rows((3, 128), torch.bfloat16, device)
    x0, r0 = x32.clone(), r16.clone()
    cn.add_rms_norm_(x32, r16, w[:128], mode=mode)
    check_h(r16, x0, r0, device, fused, f"{mode} in place, fp32 x over a bf16 residual", seed)
    assert_close(x32, reference64(r16, w[:128], 1e-6, 0.0)[0], torch.float32, f"{mode} in place fp32 y", seed)


def test_module_residual_shape_and_in_place_memory():
    norm = cn.RMSNorm((4, 8), mode="torch")
    with pytest.raises(ValueError, match="residual must be a tensor of x's shape"):
        norm(torch.randn(2, 4, 8), torch.randn(2, 8, 4))
    buf = torch.randn(2, 64)
    cn.add_rms_norm_(buf[0], buf[1], mode="torch")  # two rows of one buffer: separate memory, accepted
    with pytest.raises(ValueError, match="separate memory"):
        cn.add_rms_norm_(buf[:, :40], buf[:, 24:], mode="torch")


def test_backward_rows_refuses_dh_for_a_backward_that_does_not_read_it():
    """dh goes into a backward kernel only where its backend reads it (adds_dh); the others' callers add
    it after (residual._bwd_op), so a dh handed to them is refused, never dropped."""
    from cutile_norms._platform import CPU
    from cutile_norms.rmsnorm import backward_rows

    x, dy, dh = (torch.randn(3, 64) for _ in range(3))
    rstd = torch.rsqrt(x.square().mean(-1) + 1e-6)
    for mode in ("torch", "triton"):
        with pytest.raises(ValueError, match="does not read dh"):
            backward_rows(dy, x, None, rstd, 0.0, mode, True, False, CPU, dh=dh)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="Triton's interpreter is off (TRITON_INTERPRET)")
def test_backward_op_on_an_h200s_dh_rows(monkeypatch, fused_gate, seed):
    """residual._bwd_op's wiring on an H200's dh rows, on Triton's interpreter (the plan patched to an H200
    running Triton; on the GPU the same launches are tests/triton/test_add_rmsnorm.py's): Triton's TMA rows
    kernel reading dh where dy, dh and h take it (counted), and, where dy is expanded (row stride 0:
    tensors_take_tma says no), not that kernel (without cuTile, as here: the register kernel); both against
    the fp64 closed form plus dh."""
    from cutile_norms import residual
    from cutile_norms._platform import DeviceInfo, Toolchain
    from cutile_norms.triton import rmsnorm_bwd
    from tests.triton._util import Launches

    device = "cpu"
    fused_gate(True)
    h200 = DeviceInfo("nvidia", "NVIDIA H200", (9, 0), 4, 0)
    monkeypatch.setattr(residual, "toolchain", lambda: Toolchain(cutile="not here", cute=None, triton=None))
    monkeypatch.setattr(residual, "plan", lambda h, mode, weight: (
        h200, h.numel() // h.shape[-1], dispatch.Choice("triton", "an H200's plan", bwd_mode="triton")))
    spy = Launches(rmsnorm_bwd.rms_norm_bwd_tma_rows2_dh_kernel)
    monkeypatch.setattr(rmsnorm_bwd, "rms_norm_bwd_tma_rows2_dh_kernel", spy)
    N = 1152  # two exact pieces, 8-row tiles
    h = random_rows((3, 7, N), torch.bfloat16, device)
    w = random_weight(N, torch.bfloat16, device)
    rstd = reference64(h.reshape(-1, N), w, 1e-6, 0.0)[1].float()
    dh = random_rows(h.shape, torch.bfloat16, device)
    for dy, launched in ((random_rows(h.shape, torch.bfloat16, device), 1),
                         (random_rows((1, 1, N), torch.bfloat16, device).expand(h.shape), 0)):
        before = spy.count
        g, dw = torch.ops.cutile_norms.add_rms_norm_bwd(dy, dh, h, w, rstd.reshape(3, 7), 0.0, "", True)
        assert spy.count == before + launched, (launched, spy.count - before)
        eg, ew, sg, sw = reference_bwd64(h.reshape(-1, N), w, dy.reshape(-1, N), 1e-6, 0.0)
        what = f"_bwd_op on an H200's dh rows, dy strides {dy.stride()}"
        assert_grad_close(g.reshape(-1, N), eg + dh.reshape(-1, N).double(), sg + dh.reshape(-1, N).double().abs(),
                          torch.bfloat16, f"{what} grad into h", seed)
        assert_grad_close(dw, ew, sw, w.dtype, f"{what} dw", seed)
