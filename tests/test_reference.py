"""The reference (mode="torch") against float64, forward and backward."""
import pytest
import torch

import cutile_norms as cn
from cutile_norms.reference import rms_norm_backward, rms_norm_reference
from tests.conftest import FP64_SAME_MATH, assert_close, random_rows, random_weight, reference64

DTYPES = [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.float16, torch.float16),
          (torch.bfloat16, torch.float32)]


@pytest.mark.parametrize("x_dtype,w_dtype", DTYPES)
@pytest.mark.parametrize("shape", [(7, 128), (3, 5, 1000), (1, 2880)])
@pytest.mark.parametrize("offset", [0.0, 1.0])
def test_forward_matches_float64(seed, x_dtype, w_dtype, shape, offset):
    x = random_rows(shape, x_dtype, "cpu")
    w = random_weight(shape[-1], w_dtype, "cpu")
    y = cn.rms_norm(x, w, 1e-5, mode="torch", offset=offset)
    assert y.dtype == x_dtype
    assert_close(y, reference64(x, w, 1e-5, offset)[0], x_dtype, "reference forward", seed)


def test_forward_without_weight(seed):
    x = random_rows((9, 333), torch.float32, "cpu")
    assert_close(cn.rms_norm(x, mode="torch"), reference64(x, None, 1e-6, 0.0)[0], torch.float32, "no weight", seed)


def test_rstd_matches_float64(seed):
    x = random_rows((11, 4096), torch.bfloat16, "cpu")
    _, rstd = rms_norm_reference(x, None, 1e-6)
    assert rstd.dtype == torch.float32
    assert_close(rstd, reference64(x, None, 1e-6, 0.0)[1], torch.float32, "rstd", seed)


def test_large_values_do_not_overflow_in_fp16(seed):
    # x^2 of 300 is 9e4 > fp16 max (65504): the math must be fp32
    x = (random_rows((4, 512), torch.float32, "cpu") * 300).to(torch.float16)
    assert_close(cn.rms_norm(x, mode="torch"), reference64(x, None, 1e-6, 0.0)[0], torch.float16, "fp16 large", seed)


@pytest.mark.parametrize("offset", [0.0, 1.0])
@pytest.mark.parametrize("has_weight", [True, False])
def test_closed_form_backward_matches_float64_autograd(seed, offset, has_weight):
    M, N = 6, 200
    x = random_rows((M, N), torch.float64, "cpu").requires_grad_()
    w = random_weight(N, torch.float64, "cpu").requires_grad_() if has_weight else None
    offset = offset if has_weight else 0.0
    y, rstd = rms_norm_reference(x, w, 1e-6, offset, compute_dtype=torch.float64)
    dy = torch.randn(M, N, dtype=torch.float64)
    grads = torch.autograd.grad(y, [x] + ([w] if has_weight else []), dy)
    dx, dw = rms_norm_backward(dy, x.detach(), None if w is None else w.detach(), rstd.detach(), offset,
                               compute_dtype=torch.float64)
    torch.testing.assert_close(dx, grads[0], **FP64_SAME_MATH, msg=f"dx [seed {seed}]")
    if has_weight:
        torch.testing.assert_close(dw, grads[1], **FP64_SAME_MATH, msg=f"dw [seed {seed}]")


@pytest.mark.parametrize("x_dtype,w_dtype", DTYPES)
def test_autograd_through_torch_mode(seed, x_dtype, w_dtype):
    M, N = 5, 384
    x = random_rows((M, N), x_dtype, "cpu").requires_grad_()
    w = random_weight(N, w_dtype, "cpu").requires_grad_()
    dy = torch.randn(M, N).to(x_dtype)
    dx, dw = torch.autograd.grad(cn.rms_norm(x, w, mode="torch", offset=1.0), [x, w], dy)
    x64, w64 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    ex, ew = torch.autograd.grad(reference64(x64, w64, 1e-6, 1.0)[0], [x64, w64], dy.double())
    assert dx.dtype == x_dtype and dw.dtype == w_dtype
    assert_close(dx, ex, x_dtype, "dx", seed)
    # dw sums over M rows of rounded products: allow M rounding steps of the weight dtype
    assert_close(dw, ew, w_dtype if w_dtype != torch.float32 else torch.float32, "dw", seed)
