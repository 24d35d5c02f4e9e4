"""Second order (create_graph=True: gradient penalties, Hessian-vector products) through rms_norm,
against fp64 autograd of the same formula and beside torch's own rms_norm, and through the fused
residual add (x, the residual and the weight). The kernels
give first-order grads; under create_graph the backward recomputes the reference's forward in torch ops
(rmsnorm.graph_backward), so every mode must match.

Tolerance: fp32 math against fp64, relative to the largest second-order grad (the penalty sums
products of first-order grads, each within fp32 rounding): 1e-4.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import cutile_norms as cn
from cutile_norms import dispatch
from tests.conftest import random_rows, random_weight

CASES = [pytest.param("cpu", m, id=f"cpu-{m}") for m in ("torch", None, "triton")] + \
        [pytest.param("cuda", m, marks=pytest.mark.gpu, id=f"cuda-{m}") for m in [None] + dispatch.modes_of()]
RTOL = 1e-4


def second_order(loss, x, w, v):
    """grad of (|dL/dx|^2 + <dL/dw, v>) with respect to x and w, for the loss L(x, w)."""
    gx, gw = torch.autograd.grad(loss(x, w), (x, w), create_graph=True)
    return torch.autograd.grad(gx.square().sum() + (gw * v).sum(), (x, w))


def assert_matches(got, expected, what, seed):
    for a, e, name in zip(got, expected, ("x", "w")):
        assert a is not None and torch.isfinite(a).all(), f"{what} d{name}: missing or non-finite [seed {seed}]"
        err = (a.double() - e).abs().max().item()
        assert err <= RTOL * e.abs().max().item(), f"{what} d{name}: max error {err:.3g} [seed {seed}]"


@pytest.mark.parametrize("device,mode", CASES)
@pytest.mark.parametrize("shape", [(6, 256), (3, 2, 1000)])
def test_second_order_matches_fp64(seed, device, mode, shape):
    N = shape[-1]
    x = random_rows(shape, torch.float32, device).requires_grad_()
    w = random_weight(N, torch.float32, device).requires_grad_()
    dy, v = torch.randn(shape, device=device), torch.randn(N, device=device)
    ours = second_order(lambda a, b: (cn.rms_norm(a, b, 1e-6, mode=mode) * dy).sum(), x, w, v)
    x64, w64 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    ref = second_order(lambda a, b: (F.rms_norm(a, (N,), b, 1e-6) * dy.double()).sum(), x64, w64, v.double())
    assert_matches(ours, ref, f"{mode} {shape}", seed)
    theirs = second_order(lambda a, b: (F.rms_norm(a, (N,), b, 1e-6) * dy).sum(), x, w, v)  # torch's, fp32
    assert_matches(theirs, ref, f"torch's rms_norm {shape}", seed)


@pytest.mark.parametrize("device,mode", CASES)
def test_second_order_through_the_residual_add(seed, device, mode):
    """rms_norm(x, w, residual=r) -> (y, h) with both outputs in the loss: second-order grads in x, r and
    the weight against fp64 autograd of h = x + r, F.rms_norm(h)."""
    shape, N = (4, 3, 384), 384
    x = random_rows(shape, torch.float32, device).requires_grad_()
    r = random_rows(shape, torch.float32, device).requires_grad_()
    w = random_weight(N, torch.float32, device).requires_grad_()
    dy, dh, u, v = (torch.randn(shape, device=device), torch.randn(shape, device=device),
                    torch.randn(shape, device=device), torch.randn(N, device=device))

    def second(fn, x, r, w):
        y, h = fn(x, r, w)
        gx, gr, gw = torch.autograd.grad((y * dy.to(y.dtype)).sum() + (h * dh.to(h.dtype)).sum(), (x, r, w),
                                         create_graph=True)
        return torch.autograd.grad(gx.square().sum() + (gr * u.to(gr.dtype)).sum() + (gw * v.to(gw.dtype)).sum(),
                                   (x, r, w))
    ours = second(lambda a, b, c: cn.rms_norm(a, c, 1e-6, mode=mode, residual=b), x, r, w)
    x64, r64, w64 = (t.detach().double().requires_grad_() for t in (x, r, w))
    ref = second(lambda a, b, c: (F.rms_norm(a + b, (N,), c, 1e-6), a + b), x64, r64, w64)
    for a, e, name in zip(ours, ref, ("x", "r", "w")):
        assert a is not None and torch.isfinite(a).all(), f"{mode} d{name}: missing or non-finite [seed {seed}]"
        err = (a.double() - e).abs().max().item()
        assert err <= RTOL * e.abs().max().item(), f"{mode} residual d{name}: max error {err:.3g} [seed {seed}]"


@pytest.mark.parametrize("device,mode", CASES)
def test_first_order_grads_agree_with_and_without_a_graph(seed, device, mode):
    """fp32 x over a bf16 residual stream: create_graph=True gives the same first-order grads as the
    kernels (each rounded once to the grad's dtype: fp32 here, so only fp32 rounding apart)."""
    x = random_rows((6, 512), torch.float32, device).requires_grad_()
    r = random_rows((6, 512), torch.bfloat16, device).requires_grad_()
    w = random_weight(512, torch.float32, device).requires_grad_()
    dy, dh = torch.randn(6, 512, device=device), torch.randn(6, 512, device=device, dtype=torch.bfloat16)
    grads = []
    for graph in (False, True):
        y, h = cn.rms_norm(x, w, 1e-6, mode=mode, residual=r, residual_dtype=torch.bfloat16)
        grads.append(torch.autograd.grad((y, h), (x, r, w), (dy, dh), create_graph=graph))
    for a, b, name in zip(*grads, ("x", "r", "w")):
        assert a.dtype == b.dtype, f"{mode} d{name}: {a.dtype} against {b.dtype}"
        tol = dict(rtol=1e-4, atol=1e-5) if a.dtype == torch.float32 else dict(rtol=2 ** -7, atol=1e-3)
        torch.testing.assert_close(b.detach(), a, **tol, msg=lambda m, n=name: f"{mode} d{n} [seed {seed}]: {m}")
