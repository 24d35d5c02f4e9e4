"""The public RMSNorm: validation, the autograd Function, `rms_norm`, `RMSNorm`, `explain`.

Kernels assume valid input; every check lives here. Contract:
  * x [..., N] in fp16/bf16/fp32 (any leading dims, M = prod of them, M = 0 gives an empty result);
    weight [N] in x's dtype or fp32, or None; eps a finite positive number; offset finite (Gemma: 1.0).
  * y = x * rsqrt(mean(x^2) + eps) * (offset + weight), math in fp32, y in x's dtype, contiguous.
  * Rows may be strided (x[:, :N] of a wider tensor is read in place); a last dim with stride != 1
    (e.g. a transposed view) is copied to contiguous first.
  * Autograd: differentiable in x and weight. The GPU kernels save rstd (fp32) for the backward,
    which runs the mode's backward kernel (`dispatch.backward_backend`; the persistent cuTile kernel
    for every cuTile mode); mode="torch" differentiates the reference's ops.
"""
from __future__ import annotations

import functools
import math
import numbers

import torch

from . import dispatch
from ._experimental import experimental_enabled
from ._platform import DeviceInfo, device_info, toolchain
from .reference import rms_norm_reference

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


# ================================================================================================
# Validation
# ================================================================================================
def _validate(x, weight, eps, offset) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in _DTYPES:
        raise TypeError(f"x must be float16, bfloat16 or float32, got {x.dtype}")
    if x.dim() < 1:
        raise ValueError("x must have at least one dimension (the normalized one), got a 0-d tensor")
    if weight is not None:
        if not isinstance(weight, torch.Tensor):
            raise TypeError(f"weight must be a torch.Tensor or None, got {type(weight).__name__}")
        if weight.shape != (x.shape[-1],):
            raise ValueError(f"weight must have shape ({x.shape[-1]},) to match x's last dim, "
                             f"got {tuple(weight.shape)}")
        if weight.dtype != x.dtype and weight.dtype != torch.float32:
            raise TypeError(f"weight must be x's dtype ({x.dtype}) or float32, got {weight.dtype}")
        if weight.device != x.device:
            raise ValueError(f"x and weight must be on the same device, got {x.device} and {weight.device}")
    if type(eps) is not float and (isinstance(eps, bool) or not isinstance(eps, numbers.Real)):
        raise TypeError(f"eps must be a real number, got {type(eps).__name__}")
    if not (0 < eps < math.inf):  # also false for NaN
        raise ValueError(f"eps must be a finite positive number, got {eps}")
    if type(offset) is not float and (isinstance(offset, bool) or not isinstance(offset, numbers.Real)):
        raise TypeError(f"offset must be a real number, got {type(offset).__name__}")
    if not (-math.inf < offset < math.inf):
        raise ValueError(f"offset must be finite, got {offset}")
    if weight is None and offset != 0:
        raise ValueError(f"offset={offset} scales the weight (offset + w), but weight is None; "
                         f"pass a weight or offset=0")


def _as_rows(x: torch.Tensor) -> torch.Tensor:
    """x as [M, N] with unit column stride, a view whenever torch can make one."""
    x2d = x.reshape(-1, x.shape[-1])
    if x2d.stride(-1) != 1 and x2d.shape[-1] > 1:
        x2d = x2d.contiguous()
    return x2d


# ================================================================================================
# Autograd
# ================================================================================================
class _RMSNormFunction(torch.autograd.Function):
    """The kernel forward (saving x's rows, the weight and rstd in fp32) and the mode's backward kernel."""

    @staticmethod
    def forward(ctx, x2d, weight, eps, offset, mode, dev):
        y, rstd = dispatch.backend(mode).forward(x2d, weight, eps, offset, True, dev)
        ctx.save_for_backward(x2d, weight, rstd)
        ctx.offset, ctx.mode, ctx.dev = offset, mode, dev
        return y

    @staticmethod
    def backward(ctx, dy):
        x2d, weight, rstd = ctx.saved_tensors
        need_dx = ctx.needs_input_grad[0]
        need_dw = weight is not None and ctx.needs_input_grad[1]
        dx, dw = dispatch.backward_backend(ctx.mode).backward(
            _grad_rows(dy, x2d), x2d, _unit_stride(weight), rstd, ctx.offset, need_dx, need_dw, ctx.dev)
        return dx, dw, None, None, None, None


def _grad_rows(dy: torch.Tensor, x2d: torch.Tensor) -> torch.Tensor:
    """dy as [M, N] rows with unit column stride in x's dtype. Autograd hands out expanded grads (a
    row stride of 0 is read in place) and, rarely, transposed or other-dtype ones (copied)."""
    dy = dy.reshape(x2d.shape)
    if dy.dtype != x2d.dtype:
        dy = dy.to(x2d.dtype)
    if dy.stride(-1) != 1 and dy.shape[-1] > 1:
        dy = dy.contiguous()
    return dy


def _unit_stride(weight):
    return weight if weight is None or weight.stride(0) == 1 or weight.numel() <= 1 else weight.contiguous()


# ================================================================================================
# Public entry points
# ================================================================================================
def _plan(x, mode):
    N = x.shape[-1]
    M = x.numel() // N if N else 0
    dev, choice = _route(mode, x.device, x.dtype, M, N, experimental_enabled())
    return dev, M, choice


@functools.lru_cache(maxsize=8192)
def _route(mode, device, dtype, M, N, _experimental_on):
    """(device info, the dispatch choice) for one call signature; cached so a call hashes plain
    values only (an uncached route cost ~10 us of Python per call on an H200 host)."""
    dev = device_info(device)
    return dev, dispatch.resolve(mode, dev, toolchain(), dtype, M, N)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None = None, eps: float = 1e-6, *,
             mode: str | None = None, offset: float = 0.0) -> torch.Tensor:
    """RMSNorm over the last dim: x * rsqrt(mean(x^2) + eps) * (offset + weight).

    mode: None (the measured heuristic; `explain()` says what it picks), "multi_wave_reload",
    "multi_wave_cached", "static_persistent" (cuTile), "tma_smem_cached" (CuTe DSL), "triton", or
    "torch" (the fp32 reference). A mode that cannot run here raises and says why.
    """
    _validate(x, weight, eps, offset)
    dev, M, choice = _plan(x, mode)
    if choice.mode == "torch" or x.numel() == 0:  # empty: the reference's ops give empty dx and zero dw
        return rms_norm_reference(x, weight, eps, offset)[0]
    x2d = _as_rows(x)
    if torch.is_grad_enabled() and (x.requires_grad or (weight is not None and weight.requires_grad)):
        return _RMSNormFunction.apply(x2d, weight, float(eps), float(offset), choice.mode, dev).view(x.shape)
    # inference: no autograd node, no rstd, y allocated in x's shape
    return dispatch.backend(choice.mode).forward(x2d, weight, float(eps), float(offset), False, dev,
                                                 out_shape=x.shape)[0]


def available_modes(device: torch.device | str | int | None = None) -> dict[str, str | None]:
    """Every mode name -> None if it can run on `device` (default: the current GPU, else CPU),
    else the reason it cannot."""
    dev = device_info(device)
    tools = toolchain()
    return {name: dispatch.unavailable_reason(m, dev, tools) for name, m in dispatch.MODES.items()}


def explain(x: torch.Tensor, weight: torch.Tensor | None = None, *, mode: str | None = None,
            offset: float = 0.0, eps: float = 1e-6) -> str:
    """Which kernel and launch config `rms_norm` would run for these tensors, and why."""
    _validate(x, weight, eps, offset)
    dev, M, choice = _plan(x, mode)
    N = x.shape[-1]
    wdesc = "none" if weight is None else str(weight.dtype).removeprefix("torch.")
    lines = [f"rms_norm on {_where(dev)}: x {str(x.dtype).removeprefix('torch.')} {list(x.shape)} "
             f"(M={M}, N={N}), weight {wdesc}, offset {offset}",
             f"mode: {choice.mode}" + (" (picked by mode=None)" if mode is None else ""),
             f"why: {choice.reason}"]
    if choice.mode == "torch":
        lines.append("kernel: torch reference (fp32 math, several torch ops)")
        lines.append("backward: autograd through the reference's ops")
    else:
        lines.append("kernel: " + dispatch.backend(choice.mode).describe(M, N, x.dtype, dev))
        lines.append("backward: " + dispatch.backward_backend(choice.mode).describe(
            M, N, x.dtype, dev, weight.dtype if weight is not None else None))
    return "\n".join(lines)


def _where(dev: DeviceInfo) -> str:
    return "CPU" if dev.vendor == "cpu" else f"{dev.name} ({dev.arch_name}, {dev.sm_count} SMs)"


class RMSNorm(torch.nn.Module):
    """Drop-in for torch.nn.RMSNorm (same `weight` parameter and state_dict), backed by rms_norm.

    normalized_shape may name several trailing dims; they are normalized together. With offset != 0
    (Gemma's 1 + w), the weight initialises to 1 - offset so the initial scale is 1.
    """

    def __init__(self, normalized_shape, eps: float = 1e-6, elementwise_affine: bool = True, *,
                 mode: str | None = None, offset: float = 0.0, device=None, dtype=None):
        super().__init__()
        if isinstance(normalized_shape, numbers.Integral):
            normalized_shape = (normalized_shape,)
        self.normalized_shape = tuple(int(d) for d in normalized_shape)
        if not self.normalized_shape or any(d < 1 for d in self.normalized_shape):
            raise ValueError(f"normalized_shape must be positive dims, got {normalized_shape}")
        if mode is not None and mode not in dispatch.MODES:
            raise ValueError(f"unknown mode {mode!r}; modes: None, " + ", ".join(map(repr, dispatch.MODES)))
        if not elementwise_affine and offset != 0:
            raise ValueError("offset scales the weight; it needs elementwise_affine=True")
        self.eps, self.elementwise_affine, self.mode, self.offset = eps, elementwise_affine, mode, float(offset)
        if elementwise_affine:
            self.weight = torch.nn.Parameter(torch.empty(self.normalized_shape, device=device, dtype=dtype))
        else:
            self.register_parameter("weight", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        if self.weight is not None:
            torch.nn.init.constant_(self.weight, 1.0 - self.offset)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        k = len(self.normalized_shape)
        if tuple(x.shape[-k:]) != self.normalized_shape:
            raise ValueError(f"expected x's trailing dims {self.normalized_shape}, got {tuple(x.shape)}")
        if k == 1:
            return rms_norm(x, self.weight, self.eps, mode=self.mode, offset=self.offset)
        flat = x.reshape(*x.shape[:-k], -1)
        w = None if self.weight is None else self.weight.reshape(-1)
        return rms_norm(flat, w, self.eps, mode=self.mode, offset=self.offset).view(x.shape)

    def extra_repr(self) -> str:
        return (f"{self.normalized_shape}, eps={self.eps}, elementwise_affine={self.elementwise_affine}, "
                f"mode={self.mode!r}, offset={self.offset}")
