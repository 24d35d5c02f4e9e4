"""What runs, and why: `explain()` (the kernel, launch config and reason `rms_norm` would take for these
tensors, from the same `plan` a call makes) and `available_modes()`."""
from __future__ import annotations

import torch

from . import dispatch
from ._platform import DeviceInfo, device_info, toolchain
from .rmsnorm import TORCH_DEFAULT_EPS, plan, validate


def available_modes(device: torch.device | str | int | None = None) -> dict[str, str | None]:
    """Every mode name -> None if it can run on `device` (default: the current GPU, else CPU),
    else the reason it cannot."""
    dev = device_info(device)
    tools = toolchain()
    return {name: dispatch.unavailable_reason(m, dev, tools) for name, m in dispatch.MODES.items()}


def explain(x: torch.Tensor, weight: torch.Tensor | None = None, *, mode: str | None = None,
            offset: float = 0.0, eps: float | None = 1e-6, residual: torch.Tensor | None = None,
            residual_dtype: torch.dtype | None = None, fp8: bool = False) -> str:
    """Which kernel and launch config `rms_norm` would run for these tensors, and why (with
    `residual`: also how the add runs; the norm's lines are then about h = x + residual; with `fp8`:
    also whether `rms_norm_fp8` runs its kernel, with which launch, or the torch ops, and why). eps=None:
    torch's default, as in rms_norm."""
    validate(x, weight, TORCH_DEFAULT_EPS if eps is None else eps, offset)
    dev, M, choice = plan(x, mode, weight)
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
        lines.append("backward: " + dispatch.backward_backend(choice.backward_mode).describe(
            M, N, x.dtype, dev, weight.dtype if weight is not None else None))
    if residual is not None:
        from .residual import describe, validate_residual
        validate_residual(x, residual, residual_dtype)
        lines.append(describe(x, residual, residual_dtype, mode, weight))
    if fp8:
        from .fp8 import describe as describe_fp8
        lines.append(describe_fp8(x, mode, weight=weight))
    return "\n".join(lines)


def _where(dev: DeviceInfo) -> str:
    return "CPU" if dev.vendor == "cpu" else f"{dev.name} ({dev.arch_name}, {dev.sm_count} SMs)"
