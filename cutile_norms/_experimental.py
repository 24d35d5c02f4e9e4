"""The experimental gate: kernels not yet validated on hardware.

`@experimental_kernel` marks a kernel's launch function: it warns once per process at the first
launch, and the dispatch table never picks it for `mode=None`. The kernels themselves live in the
top-level `experimental/` folder, importable only as `cutile_norms.experimental` once the user opted
in with `CUTILE_NORMS_EXPERIMENTAL=1` or `cutile_norms.enable_experimental()`.
"""
from __future__ import annotations

import functools
import os
import warnings

ENV_VAR = "CUTILE_NORMS_EXPERIMENTAL"
_enabled_by_call = False


class ExperimentalKernelWarning(UserWarning):
    """The first launch of a kernel that has not been validated on hardware."""


def enable_experimental() -> None:
    """Opt in to experimental kernels for this process (same as CUTILE_NORMS_EXPERIMENTAL=1)."""
    global _enabled_by_call
    _enabled_by_call = True


def experimental_enabled() -> bool:
    return _enabled_by_call or os.environ.get(ENV_VAR, "").strip().lower() in ("1", "true", "yes", "on")


def require_experimental(what: str = "cutile_norms.experimental") -> None:
    if not experimental_enabled():
        raise ImportError(
            f"{what} holds kernels that have not been validated on hardware. Opt in with the "
            f"environment variable {ENV_VAR}=1 or by calling cutile_norms.enable_experimental() "
            f"before importing it.")


def experimental_kernel(launch):
    """Mark a kernel launch function as experimental: one warning per process at its first call."""
    warned = False

    @functools.wraps(launch)
    def wrapper(*args, **kwargs):
        nonlocal warned
        if not warned:
            warned = True
            warnings.warn(f"{launch.__module__}.{launch.__qualname__} is an experimental kernel: it is "
                          f"compile-checked but not validated on hardware.",
                          ExperimentalKernelWarning, stacklevel=2)
        return launch(*args, **kwargs)

    wrapper.__experimental__ = True
    return wrapper


def is_experimental(fn) -> bool:
    return bool(getattr(fn, "__experimental__", False))
