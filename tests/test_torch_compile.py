"""torch.compile and torch.library: the ops cutile_norms::rms_norm_fwd / rms_norm_bwd (opcheck), and a
small model using cn.RMSNorm compiled with fullgraph=True: forward and backward match eager, no
recompile across five values of M, CUDA graphs (mode="reduce-overhead") on the GPU."""
import pytest
import torch

import cutile_norms as cn
from tests.conftest import (INDUCTOR_FP32, TWO_ROUNDINGS_16BIT, VS_TORCH_SMALL_ROWS, assert_close, random_rows,
                            random_weight, reference64)

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def _op_args(device, dtype, w_dtype, M, N, store_rstd=True, offset=0.0):
    x = random_rows((M, N), dtype, device)
    w = random_weight(N, w_dtype, device) if w_dtype else None
    return x, w, 1e-6, offset, "", store_rstd


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype,w_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                           (torch.bfloat16, torch.float32), (torch.float16, None)])
def test_opcheck_forward_and_backward(seed, device, dtype, w_dtype):
    x, w, eps, offset, mode, store = _op_args(device, dtype, w_dtype, 37, 200, offset=1.0 if w_dtype else 0.0)
    x.requires_grad_()
    if w is not None:
        w.requires_grad_()
    torch.library.opcheck(torch.ops.cutile_norms.rms_norm_fwd.default, (x, w, eps, offset, mode, store))
    y, rstd = torch.ops.cutile_norms.rms_norm_fwd(x, w, eps, offset, mode, True)
    dy = torch.randn_like(y)
    torch.library.opcheck(torch.ops.cutile_norms.rms_norm_bwd.default,
                          (dy, x.detach(), None if w is None else w.detach(), rstd.detach(), offset, mode, True,
                           w is not None))


class _Block(torch.nn.Module):
    """Linear -> cn.RMSNorm -> Linear -> cn.RMSNorm(offset=1), a residual: the norms' grads flow to x."""

    def __init__(self, n, device, dtype, mode):
        super().__init__()
        self.a = torch.nn.Linear(n, n, device=device, dtype=dtype)
        self.norm1 = cn.RMSNorm(n, mode=mode, device=device, dtype=dtype)
        self.b = torch.nn.Linear(n, n, device=device, dtype=dtype)
        self.norm2 = cn.RMSNorm(n, mode=mode, offset=1.0, device=device, dtype=dtype)
        with torch.no_grad():
            self.norm1.weight.copy_(random_weight(n, dtype, device))
            self.norm2.weight.normal_(0.0, 0.2)

    def forward(self, x):
        h = x + self.norm1(self.a(x))
        return self.norm2(self.b(h)) + h


def _compile_and_compare(device, dtype, mode, compile_mode=None, tol=None):
    import torch._dynamo

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    model = _Block(256, device, dtype, mode)
    compiled = torch.compile(model, fullgraph=True, mode=compile_mode)
    for M in (8, 33, 100, 257, 1024):
        x = random_rows((M, 256), dtype, device).requires_grad_()
        torch._dynamo.mark_dynamic(x, 0)  # the batch dim: one graph for every M
        x_ref = x.detach().clone().requires_grad_()
        y = compiled(x)
        g = torch.randn_like(y)
        y.backward(g)
        grads = [p.grad.clone() for p in model.parameters()]
        model.zero_grad()
        y_ref = model(x_ref)
        y_ref.backward(g)
        torch.testing.assert_close(y, y_ref, **(tol or {}))
        torch.testing.assert_close(x.grad, x_ref.grad, **(tol or {}))
        # parameter grads are sums over M rows: two fp32 summation orders differ by ~sqrt(M) ulps of the
        # terms, and cancellation turns that into a relative error of the (smaller) sum (seen: 1.6e-4 at M=1024)
        grad_tol = dict(tol or {})
        if grad_tol:
            grad_tol["atol"] = grad_tol["atol"] * max(1.0, M / 64)
        for p, gc in zip(model.parameters(), grads):
            torch.testing.assert_close(gc, p.grad, **grad_tol)
        model.zero_grad()
        assert torch.isfinite(y).all()
    stats = torch._dynamo.utils.counters["stats"]
    assert stats["unique_graphs"] == 1, f"recompiled: {dict(stats)}"


def test_compile_fullgraph_cpu(seed):
    _compile_and_compare("cpu", torch.float32, None, tol=INDUCTOR_FP32)  # inductor reorders the sums


@pytest.mark.gpu
@pytest.mark.parametrize("mode", [None, "multi_wave_cached", "static_persistent"])
def test_compile_fullgraph_gpu(seed, mode):
    _compile_and_compare("cuda", torch.bfloat16, mode, tol=TWO_ROUNDINGS_16BIT)


@pytest.mark.gpu
def test_compile_reduce_overhead_gpu(seed):
    """CUDA graphs through torch.compile: the kernels' launches are captured and replayed."""
    _compile_and_compare("cuda", torch.bfloat16, "multi_wave_cached", compile_mode="reduce-overhead",
                         tol=TWO_ROUNDINGS_16BIT)


def test_eps_none_is_torchs_default(seed):
    """cn.RMSNorm() has torch.nn.RMSNorm's defaults and results: eps=None is the epsilon of torch's math
    type (fp32) for every dtype (torch's docs say x's dtype; bf16's 2^-7 would differ by 2x here)."""
    ours, theirs = cn.RMSNorm(64), torch.nn.RMSNorm(64)
    assert ours.eps is None and theirs.eps is None
    assert list(ours.state_dict()) == list(theirs.state_dict())
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        x = random_rows((5, 64), dtype, "cpu", scale=1e-4)  # small rows: eps matters
        torch.testing.assert_close(ours.to(dtype)(x), theirs.to(dtype)(x), **VS_TORCH_SMALL_ROWS)
    x = random_rows((3, 64), torch.float32, "cpu", scale=3e-4)  # mean(x^2) ~ 1e-7: eps = 1.2e-7 or 1e-6 shows
    for eps in (None, 1e-6):
        e = torch.finfo(torch.float32).eps if eps is None else eps
        assert_close(cn.rms_norm(x, None, eps), reference64(x, None, e, 0.0)[0], torch.float32, f"eps={eps}", seed)
    assert (cn.rms_norm(x, None, None) - cn.rms_norm(x, None, 1e-6)).abs().max() > 0.1
