"""cutile_norms: RMSNorm GPU kernels in NVIDIA's Python tile DSLs (cuTile, CuTe DSL), Triton fallback.

    y = cutile_norms.rms_norm(x, w, mode="multi_wave_cached")
    norm = cutile_norms.RMSNorm(4096)              # drop-in for torch.nn.RMSNorm
    print(cutile_norms.explain(x, w))              # which kernel runs, and why
    cutile_norms.available_modes()                 # mode -> None (runs here) or the reason it cannot
    cutile_norms.warmup([4096], rows=(1, 32768))   # compile ahead of traffic (kept on disk for later processes)
"""
from __future__ import annotations

import importlib.abc
import importlib.util
import os
import sys

from ._experimental import ExperimentalKernelWarning, enable_experimental, experimental_kernel
from .dispatch import MODES
from .patch import patch
from . import distributed as _distributed
from .fp8 import rms_norm_fp8
from .residual import add_rms_norm, add_rms_norm_
from .explain import available_modes, explain
from .rmsnorm import RMSNorm, rms_norm
from .warmup import warmup

__version__ = "0.1.0"
__all__ = ["rms_norm", "add_rms_norm", "add_rms_norm_", "rms_norm_fp8", "RMSNorm", "available_modes", "explain", "enable_experimental",
           "experimental_kernel", "ExperimentalKernelWarning", "MODES", "patch", "warmup"]


class _SourceTreeExperimental(importlib.abc.MetaPathFinder):
    """From a source checkout (no install), `cutile_norms.experimental` is the top-level
    experimental/ folder; an install maps it there through pyproject's package-dir."""

    def __init__(self, folder: str):
        self.folder = folder

    def find_spec(self, fullname, path=None, target=None):
        if fullname != f"{__name__}.experimental":
            return None
        return importlib.util.spec_from_file_location(
            fullname, os.path.join(self.folder, "__init__.py"), submodule_search_locations=[self.folder])


_src_experimental = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "experimental")
if (not os.path.isdir(os.path.join(os.path.dirname(__file__), "experimental"))
        and os.path.isfile(os.path.join(_src_experimental, "__init__.py"))):
    sys.meta_path.append(_SourceTreeExperimental(_src_experimental))

_distributed.install()  # the DTensor sharding rules, once torch.distributed.tensor is imported
