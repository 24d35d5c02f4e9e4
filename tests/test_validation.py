"""The API layer rejects every bad input with a clear error (one test per bad input)."""
import math

import pytest
import torch

import cutile_norms as cn
from cutile_norms import dispatch
from tests.conftest import assert_close, reference64

N = 64


@pytest.fixture
def x():
    return torch.randn(4, N)


@pytest.fixture
def w():
    return torch.randn(N)


def test_x_not_a_tensor(w):
    with pytest.raises(TypeError, match="x must be a torch.Tensor"):
        cn.rms_norm([[1.0] * N], w)


@pytest.mark.parametrize("dtype", [torch.float64, torch.int32, torch.float8_e4m3fn, torch.complex64])
def test_x_dtype(dtype):
    with pytest.raises(TypeError, match="float16, bfloat16 or float32"):
        cn.rms_norm(torch.zeros(4, N).to(dtype))


def test_x_zero_dim():
    with pytest.raises(ValueError, match="at least one dimension"):
        cn.rms_norm(torch.tensor(1.0))


@pytest.mark.parametrize("shape", [(N + 1,), (N - 1,), (1, N), (N, 1), ()])
def test_weight_shape(x, shape):
    with pytest.raises(ValueError, match=rf"weight must have shape \({N},\)"):
        cn.rms_norm(x, torch.ones(shape))


def test_weight_not_a_tensor(x):
    with pytest.raises(TypeError, match="weight must be a torch.Tensor or None"):
        cn.rms_norm(x, [1.0] * N)


@pytest.mark.parametrize("x_dtype,w_dtype", [(torch.bfloat16, torch.float16), (torch.float32, torch.bfloat16),
                                             (torch.float16, torch.float64), (torch.bfloat16, torch.int64)])
def test_weight_dtype(x_dtype, w_dtype):
    with pytest.raises(TypeError, match="weight must be x's dtype"):
        cn.rms_norm(torch.randn(4, N).to(x_dtype), torch.ones(N).to(w_dtype))


def test_weight_other_device(x):
    with pytest.raises(ValueError, match="same device"):
        cn.rms_norm(x, torch.ones(N, device="meta"))


@pytest.mark.parametrize("eps", [0.0, -1e-6, math.nan, math.inf, -math.inf])
def test_eps_not_finite_positive(x, w, eps):
    with pytest.raises(ValueError, match="eps must be a finite positive number"):
        cn.rms_norm(x, w, eps)


@pytest.mark.parametrize("eps", ["1e-6", True, torch.tensor(1e-6), [1e-6], {"eps": 1e-6}])
def test_eps_not_a_number(x, w, eps):
    """Also after a call with an int eps (True == 1 as a key), and unhashable ones (no key to make)."""
    cn.rms_norm(x, w, 1)
    with pytest.raises(TypeError, match="eps must be a real number"):
        cn.rms_norm(x, w, eps)
    with pytest.raises(TypeError, match="offset must be a real number"):
        cn.rms_norm(x, w, 1e-6, offset=[0.0])


def test_eps_none_is_torchs_epsilon(x, w):
    """eps=None: torch's rms_norm convention (the fp32 epsilon, whatever x's dtype), on rows small enough
    (rms ~ 1e-5) that eps = 1.2e-7 differs from 1e-6 by far more than the tolerance."""
    small = x * 1e-5
    assert_close(cn.rms_norm(small, w, None), reference64(small, w, torch.finfo(torch.float32).eps, 0.0)[0],
                 small.dtype, "eps=None", 0)


@pytest.mark.parametrize("offset", [math.nan, math.inf])
def test_offset_not_finite(x, w, offset):
    with pytest.raises(ValueError, match="offset must be finite"):
        cn.rms_norm(x, w, offset=offset)


def test_offset_not_a_number(x, w):
    with pytest.raises(TypeError, match="offset must be a real number"):
        cn.rms_norm(x, w, offset="1")


def test_offset_without_weight(x):
    with pytest.raises(ValueError, match="weight is None"):
        cn.rms_norm(x, None, offset=1.0)


@pytest.mark.parametrize("mode", ["fast", "MULTI_WAVE_CACHED", "", 3])
def test_unknown_mode(x, w, mode):
    with pytest.raises(ValueError, match="unknown mode"):
        cn.rms_norm(x, w, mode=mode)


@pytest.mark.parametrize("mode", dispatch.modes_of("cutile") + dispatch.modes_of("cute"))
def test_gpu_mode_with_cpu_tensors(x, w, mode):
    with pytest.raises(ValueError, match="not on CPU tensors"):
        cn.rms_norm(x, w, mode=mode)


@pytest.mark.parametrize("shape", [(0, N), (2, 0, N), (0,), (3, 0)])
def test_empty_input_gives_empty_result(shape):
    x = torch.randn(shape)
    w = torch.randn(shape[-1])
    y = cn.rms_norm(x, w)
    assert y.shape == x.shape and y.dtype == x.dtype and y.numel() == 0


def test_module_rejects_wrong_trailing_dims():
    m = cn.RMSNorm(N)
    with pytest.raises(ValueError, match="trailing dims"):
        m(torch.randn(4, N + 1))


def test_module_rejects_offset_without_affine():
    with pytest.raises(ValueError, match="elementwise_affine"):
        cn.RMSNorm(N, elementwise_affine=False, offset=1.0)


@pytest.mark.parametrize("shape", [(16.5,), ("16",), (True, 4)])
def test_module_rejects_dims_that_are_not_ints(shape):
    with pytest.raises(TypeError, match="normalized_shape must be ints"):
        cn.RMSNorm(shape)


def test_explain_takes_eps_none(x, w):
    assert "mode:" in cn.explain(x, w, eps=None)


def test_module_rejects_unknown_mode():
    with pytest.raises(ValueError, match="unknown mode"):
        cn.RMSNorm(N, mode="fastest")


def test_explain_validates_too(x):
    with pytest.raises(ValueError, match="weight must have shape"):
        cn.explain(x, torch.ones(N + 1))
