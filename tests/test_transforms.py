"""rms_norm and the residual form under what else torch differentiates and batches with: forward-mode AD
(dual tensors, torch.func.jvp), torch.func's grad, vmap and per-sample grads, autograd's batched
backward (jacobian(vectorize=True), grad(is_grads_batched=True)), a tensor made under inference_mode,
meta tensors, a FakeTensorMode (memory estimators run a model under one), and the residual form with only
h used. The kernels have no forward-mode or batching
rule, so these run the reference's torch ops (rmsnorm.under_transform, batched_grad): every mode must
give torch's own rms_norm's tangents and grads, never a dropped tangent.

Tolerance: fp32 math against fp64: 1e-4 of the largest value compared.
"""
from __future__ import annotations

import pytest
import torch
import torch.autograd.forward_ad as fwAD
import torch.nn.functional as F

import cutile_norms as cn
from cutile_norms import dispatch
from tests.conftest import random_rows, random_weight

CASES = [pytest.param("cpu", m, id=f"cpu-{m}") for m in ("torch", None, "triton")] + \
        [pytest.param("cuda", m, marks=pytest.mark.gpu, id=f"cuda-{m}") for m in [None] + dispatch.modes_of()]
N, EPS, RTOL = 256, 1e-6, 1e-4


def reference(x, w, r=None):
    """torch's rms_norm in fp64 (of x + r where given)."""
    h = x.double() if r is None else x.double() + r.double()
    return F.rms_norm(h, (h.shape[-1],), w.double(), EPS)


def assert_near(got, expected, what, seed):
    assert got is not None and torch.isfinite(got).all(), f"{what}: missing or non-finite [seed {seed}]"
    err = (got.double() - expected.double()).abs().max().item()
    assert err <= RTOL * expected.double().abs().max().item(), f"{what}: max error {err:.3g} [seed {seed}]"


@pytest.fixture
def inputs(device, seed):
    x, v, r = (random_rows((6, N), torch.float32, device) for _ in range(3))
    return x, v, r, random_weight(N, torch.float32, device)


@pytest.mark.parametrize("device,mode", CASES)
def test_forward_mode_tangents(inputs, device, mode, seed):
    """The tangent of y (and of h and y in the residual form) is J v, with the weight frozen (the kernels'
    no-grad path dropped it) and trained."""
    x, v, r, w = inputs
    expected = torch.func.jvp(lambda x: reference(x, w), (x.double(),), (v.double(),))[1]
    for trained in (False, True):
        wt = w.clone().requires_grad_(trained)
        with fwAD.dual_level():
            t = fwAD.unpack_dual(cn.rms_norm(fwAD.make_dual(x, v), wt, EPS, mode=mode)).tangent
        assert_near(t, expected, f"{mode} jvp (weight trained {trained})", seed)
    y_t, h_t = torch.func.jvp(lambda x: cn.rms_norm(x, w, EPS, mode=mode, residual=r), (x,), (v,))[1]
    assert torch.equal(h_t, v), f"{mode}: h = x + r has tangent v [seed {seed}]"
    assert_near(y_t, torch.func.jvp(lambda x: reference(x, w, r), (x.double(),), (v.double(),))[1],
                f"{mode} residual jvp", seed)


@pytest.mark.parametrize("device,mode", CASES)
def test_func_grad_vmap_and_per_sample_grads(inputs, device, mode, seed):
    x, _, r, w = inputs
    assert_near(torch.func.grad(lambda x: cn.rms_norm(x, w, EPS, mode=mode).square().sum())(x),
                torch.func.grad(lambda x: reference(x, w).square().sum())(x.double()), f"{mode} func.grad", seed)
    assert_near(torch.func.vmap(lambda x: cn.rms_norm(x, w, EPS, mode=mode))(x.view(2, 3, N)).view(6, N),
                reference(x, w), f"{mode} vmap", seed)
    assert_near(torch.func.grad(lambda x: cn.rms_norm(x, w, EPS, mode=mode, residual=r)[0].square().sum())(x),
                torch.func.grad(lambda x: reference(x, w, r).square().sum())(x.double()), f"{mode} residual grad", seed)
    net = torch.nn.Sequential(torch.nn.Linear(N, N), cn.RMSNorm(N, eps=EPS, mode=mode), torch.nn.Linear(N, 2))
    ref = torch.nn.Sequential(net[0], torch.nn.RMSNorm(N, eps=EPS), net[2])
    net.to(device), ref.load_state_dict(net.state_dict())
    params = {k: p.detach() for k, p in net.named_parameters()}
    target = random_rows((6, 2), torch.float32, device)

    def per_sample(model):
        def loss(p, xb, yb):
            return (torch.func.functional_call(model, p, (xb[None],)) - yb[None]).square().sum()
        return torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0, 0))(params, x, target)

    got, expected = per_sample(net), per_sample(ref)
    for name in params:
        assert_near(got[name], expected[name], f"{mode} per-sample grad of {name}", seed)


@pytest.mark.parametrize("device,mode", CASES)
def test_batched_backward(inputs, device, mode, seed):
    """jacobian(vectorize=True) and grad(is_grads_batched=True) hand the backward a batched dy."""
    x, _, r, w = inputs
    x = x[:2]
    jac = torch.autograd.functional.jacobian
    assert_near(jac(lambda x: cn.rms_norm(x, w, EPS, mode=mode), x, vectorize=True),
                jac(lambda x: reference(x, w), x.double()), f"{mode} jacobian", seed)
    assert_near(jac(lambda x: cn.rms_norm(x, w, EPS, mode=mode, residual=r[:2])[0], x, vectorize=True),
                jac(lambda x: reference(x, w, r[:2]), x.double()), f"{mode} residual jacobian", seed)
    xg = x.clone().requires_grad_()
    eye = torch.eye(2 * N, device=device).view(2 * N, 2, N)
    rows = torch.autograd.grad(cn.rms_norm(xg, w, EPS, mode=mode), xg, eye, is_grads_batched=True)[0]
    assert_near(rows.view(2 * N, 2 * N), jac(lambda x: reference(x, w), x.double()).view(2 * N, 2 * N),
                f"{mode} is_grads_batched", seed)


@pytest.mark.parametrize("device,mode", CASES)
def test_inference_tensor_meta_tensor_and_h_alone(inputs, device, mode, seed):
    """A module that trains its weight takes x made under inference_mode (as torch's does); meta tensors
    give shapes in every mode, in place too (overlapping x and residual, told apart by storage and offset, and
    an unknown mode refused there, as on real ones); with only h used the weight gets no grad (None, not zeros: weight decay
    and momentum would still move it)."""
    x, _, r, w = inputs
    with torch.inference_mode():
        xi = x.clone()
    module = cn.RMSNorm(N, eps=EPS, mode=mode, device=device)
    with torch.no_grad():
        module.weight.copy_(w)
    module(xi).square().sum().backward()
    wd = w.double().requires_grad_()
    reference(x, wd).square().sum().backward()
    assert_near(module.weight.grad, wd.grad, f"{mode} inference-mode x: dw", seed)
    assert cn.RMSNorm(N, mode=mode, device="meta")(torch.empty(3, N, device="meta")).shape == (3, N)
    assert cn.rms_norm(torch.empty(3, N, device="meta"), torch.empty(N, device="meta"), mode=mode,
                       residual=torch.empty(3, N, device="meta"))[1].shape == (3, N)
    xm, rm = torch.empty(3, N, device="meta"), torch.empty(3, N, device="meta")
    cn.add_rms_norm_(xm, rm, torch.empty(N, device="meta"), mode=mode)  # (no addresses: none read as shared)
    cn.add_rms_norm_(xm[:1], xm[1:2])  # views of one buffer, apart
    for a, b in ((xm, xm), (xm[:2], xm[1:])):  # one tensor twice; overlapping views (told by storage and offset)
        with pytest.raises(ValueError, match="separate memory"):
            cn.add_rms_norm_(a, b)
    for form in (cn.add_rms_norm_, cn.add_rms_norm):
        with pytest.raises(ValueError, match="unknown mode"):
            form(xm, rm, mode="bogus")
    xg, rg, wg = (t.clone().requires_grad_() for t in (x, r, w))
    _, h = cn.rms_norm(xg, wg, EPS, mode=mode, residual=rg)
    dh = torch.randn_like(h)
    h.backward(dh)
    assert wg.grad is None, f"{mode}: h alone gave the weight a grad [seed {seed}]"
    assert torch.equal(xg.grad, dh) and torch.equal(rg.grad, dh), f"{mode}: dx = dr = dh [seed {seed}]"


@pytest.mark.parametrize("device,mode", CASES)
def test_fake_tensor_mode(device, mode):
    """Under a FakeTensorMode outside torch.compile (a memory estimate runs a training step so) every form
    gives its outputs' shapes and dtypes, forward and backward, without reading a fake tensor's address (torch
    warns that this will raise) or launching a kernel on one, a real x beside a fake weight included;
    add_rms_norm_ still refuses an expanded x (it skips only the address checks); an unknown mode is refused
    there and on meta tensors; patch() still probes a norm's forward (on real tensors)."""
    import warnings

    from torch._subclasses.fake_tensor import FakeTensorMode

    class LlamaRMSNorm(torch.nn.Module):  # transformers' form
        def __init__(self, n, device):
            super().__init__()
            self.weight, self.variance_epsilon = torch.nn.Parameter(torch.ones(n, device=device)), EPS

        def forward(self, x):
            h = x.float()
            return self.weight * (h * torch.rsqrt(h.square().mean(-1, keepdim=True) + self.variance_epsilon)).to(x.dtype)

    real_x = torch.randn(5, N, device=device)
    with pytest.raises(ValueError, match="unknown mode"):
        cn.rms_norm(torch.empty(3, N, device="meta"), None, mode="bogus")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with FakeTensorMode(allow_non_fake_inputs=True):
            x = torch.empty(5, N, device=device, dtype=torch.bfloat16, requires_grad=True)
            w = torch.empty(N, device=device, dtype=torch.float32, requires_grad=True)
            y = cn.rms_norm(x, w, EPS, mode=mode)
            y.sum().backward()
            assert (y.shape, y.dtype, x.grad.dtype, w.grad.shape) == ((5, N), torch.bfloat16, torch.bfloat16, (N,))
            assert cn.RMSNorm(N, mode=mode, device=device)(torch.empty(2, 3, N, device=device)).shape == (2, 3, N)
            assert cn.rms_norm(real_x, w.detach(), EPS, mode=mode).shape == (5, N)  # a real x, a fake weight
            r = torch.empty(5, N, device=device, dtype=torch.bfloat16)
            y, h = cn.rms_norm(x.detach(), w.detach(), EPS, mode=mode, residual=r)
            assert y.shape == h.shape == (5, N)
            cn.add_rms_norm_(x.detach().clone(), r, w.detach(), EPS, mode=mode)
            with pytest.raises(ValueError, match="expanded"):
                cn.add_rms_norm_(torch.empty(1, N, device=device).expand(5, N), torch.empty(5, N, device=device))
            for bogus in (lambda: cn.rms_norm(x, w, mode="bogus"), lambda: cn.add_rms_norm(x, r, mode="bogus"),
                          lambda: cn.add_rms_norm_(x.detach().clone(), r, mode="bogus")):
                with pytest.raises(ValueError, match="unknown mode"):
                    bogus()
            model = torch.nn.Sequential(LlamaRMSNorm(N, device))  # built on the device: .to() cannot swap a fake parameter
            assert len(cn.patch(model, mode=mode, strict=True)) == 1 and isinstance(model[0], cn.RMSNorm)
