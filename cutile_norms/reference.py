"""The reference RMSNorm in plain torch: the oracle for every test, and `mode="torch"`.

y = x * rsqrt(mean(x^2) + eps) * (offset + w), math in `compute_dtype` (fp32 by default, fp64 in
tests), output in x's dtype. Written with differentiable torch ops, so autograd through
`rms_norm_reference` is the reference backward; `rms_norm_backward` is the same math in closed form
from a saved rstd, the oracle the tests compare every kernel's gradients with.
"""
from __future__ import annotations

import torch


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor | None = None, eps: float = 1e-6,
                       offset: float = 0.0, *, compute_dtype: torch.dtype = torch.float32):
    """Returns (y in x.dtype, rstd in compute_dtype of shape x.shape[:-1])."""
    xc = x.to(compute_dtype)
    rstd = torch.rsqrt(xc.square().mean(dim=-1) + eps)
    y = xc * rstd.unsqueeze(-1)
    if weight is not None:
        y = y * (weight.to(compute_dtype) + offset)
    return y.to(x.dtype), rstd


def rms_norm_backward(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor | None,
                      rstd: torch.Tensor, offset: float = 0.0, *, need_dx: bool = True,
                      need_dw: bool = True, compute_dtype: torch.dtype = torch.float32):
    """Closed-form backward over 2-D x [M, N] with rstd [M]: returns (dx in x.dtype, dw in weight.dtype).

    With xhat = x * rstd and g = dy * (offset + w):
        dx = rstd * (g - xhat * mean(g * xhat))      dw = sum over rows of dy * xhat
    """
    xc, dyc = x.to(compute_dtype), dy.to(compute_dtype)
    r = rstd.to(compute_dtype).unsqueeze(-1)
    xhat = xc * r
    g = dyc if weight is None else dyc * (weight.to(compute_dtype) + offset)
    dx = dw = None
    if need_dx:
        dx = (r * (g - xhat * (g * xhat).mean(dim=-1, keepdim=True))).to(x.dtype)
    if need_dw and weight is not None:
        dw = (dyc * xhat).sum(dim=0).to(weight.dtype)
    return dx, dw


def residual_sum_reference(x: torch.Tensor, residual: torch.Tensor, residual_dtype: torch.dtype | None = None, *,
                           compute_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """h = x + residual summed in compute_dtype, rounded once to residual_dtype (default x's)."""
    return (x.to(compute_dtype) + residual.to(compute_dtype)).to(residual_dtype or x.dtype)


def add_rms_norm_reference(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor | None = None,
                           eps: float = 1e-6, offset: float = 0.0, residual_dtype: torch.dtype | None = None, *,
                           compute_dtype: torch.dtype = torch.float32):
    """The fused residual add's reference: (y in x.dtype, h in residual_dtype (default x's), rstd).

    h = x + residual, summed in compute_dtype and rounded once to residual_dtype; y normalizes h as
    stored (the value the next layer reads), so the fused op equals the unfused `h = x + r` then
    `rms_norm(h)` whenever residual_dtype is x's. Differentiable: dx = dresidual = the grad into h."""
    h = residual_sum_reference(x, residual, residual_dtype, compute_dtype=compute_dtype)
    y, rstd = rms_norm_reference(h.to(compute_dtype), weight, eps, offset, compute_dtype=compute_dtype)
    return y.to(x.dtype), h, rstd  # y rounded once, to x's dtype, whatever h's


FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}
FP8_MIN_AMAX = 1e-12  # a row (or group) of zeros: its scale is this / FP8_MAX, never 0 (no 0 / 0)


def fp8_scale(amax: torch.Tensor, out_dtype: torch.dtype, scale_ub: float | None = None,
              ue8m0: bool = False) -> torch.Tensor:
    """The dynamic scale of a row or group from its amax (fp32): max(min(amax, scale_ub), 1e-12) / the
    format's largest value, IEEE division; `ue8m0`: rounded up to a power of two (the exponent-only
    scales of MX and DeepGEMM's UE8M0). NaN amax gives a NaN scale."""
    a = amax.float()
    if scale_ub is not None:
        a = torch.minimum(a, torch.tensor(scale_ub, dtype=torch.float32, device=a.device))
    # divided by a tensor on a's device: torch divides a CUDA tensor by a Python number as a multiply by
    # its reciprocal, one ulp off IEEE division for 1/448 and 1/57344 (measured on an H100)
    s = torch.clamp(a, min=FP8_MIN_AMAX) / a.new_full((), FP8_MAX[out_dtype])
    if ue8m0:  # 2^ceil(log2 s) from the bits: the exponent, plus one unless the mantissa is zero
        bits = s.view(torch.int32)
        exp = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(torch.int32)
        s = torch.where(torch.isnan(s), s, (exp << 23).view(torch.float32))
    return s


def fp8_quantize(y: torch.Tensor, scale: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """y (fp32) times 1 / scale (the reciprocal by IEEE division, once per scale), clamped to the
    format's finite range (NaN stays NaN), rounded to nearest even: the quantizer the FP8 kernels match
    bit for bit (a multiply per element, as vLLM's and FlashInfer's quantizers do: a division per
    element made the kernel instruction bound)."""
    top = FP8_MAX[out_dtype]
    inv = torch.ones_like(scale, dtype=torch.float32).div(scale)  # tensor by tensor: IEEE on every device
    return (y.float() * inv).clamp(-top, top).to(out_dtype)
