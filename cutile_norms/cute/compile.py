"""How the CuTe DSL kernels are compiled and cached (one mechanism for the forward and the backward).

`cute.compile` runs over fake tensors whose M and row strides are symbolic, so a kernel is built once
per (dtypes, N, config, flags) and reused for every M; the result is called through TVM-FFI with
torch tensors on torch's current stream. Compiled kernels persist across processes in the disk cache
(cutile_norms/_diskcache.py). `cutlass` is imported on first use only: the package imports without
CuTe DSL installed.
"""
from __future__ import annotations

import tempfile
from typing import Callable, Hashable

import torch

from .._diskcache import cute_entry, load_cute, store_cute

_CUTLASS_DTYPES: dict = {}


def cutlass_dtype(dtype: torch.dtype):
    """The cutlass numeric type of a torch dtype (fp16, bf16, fp32)."""
    if not _CUTLASS_DTYPES:
        import cutlass
        _CUTLASS_DTYPES.update({torch.float16: cutlass.Float16, torch.bfloat16: cutlass.BFloat16,
                                torch.float32: cutlass.Float32})
    return _CUTLASS_DTYPES[dtype]


def compile_options(arch: str | None, keep_ptx: bool) -> str:
    """cute.compile's options: TVM-FFI calls; `arch` ("sm_90a", "sm_100a") to compile for that target
    without a GPU (None: the current GPU's); `keep_ptx`: the PTX kept (in a temporary folder, its text
    in the result's `__ptx__`)."""
    options = "--enable-tvm-ffi" + (f" --gpu-arch {arch}" if arch else "")
    if keep_ptx:
        options += f" --keep-ptx --dump-dir {tempfile.mkdtemp(prefix='cutile_norms_ptx_')}"
    return options


def placeholder_f32(device: torch.device) -> torch.Tensor:
    """A 16-element fp32 tensor passed for a kernel's fp32 operand that the call does not use (its
    compile-time flags say so): the launch needs a tensor there, never its values. Kept per device and
    stream by _workspace.workspace, which allocates outside CUDA graph pools (a tensor kept from inside
    a cudagraph tree's warm-up stops its next recording)."""
    from .._workspace import current_raw_stream, workspace

    return workspace("placeholder_f32", 16, torch.float32, device, current_raw_stream(device.index), zero=False)


def aligned_weight(weight: torch.Tensor | None) -> torch.Tensor | None:
    """The weight as the row-tile kernels load it (16-byte vectors): unit stride, 16-byte-aligned data;
    a copy only where it is not (a strided weight made contiguous, a misaligned view cloned)."""
    if weight is not None and (weight.stride(0) != 1 or weight.data_ptr() % 16):
        return weight.contiguous() if weight.stride(0) != 1 else weight.clone()
    return weight


class CompileCache:
    """Compiled kernels by key, built on first use: from this process's dict, else from the disk
    cache (cutile_norms/_diskcache.py), else compiled (and stored there). `count`: compiles in this
    process, `loaded`: kernels read from disk (the tests check that a new M compiles nothing, and that
    a second process compiles nothing)."""

    def __init__(self) -> None:
        self._compiled: dict = {}
        self.count = 0
        self.loaded = 0

    def get(self, key: Hashable, build: Callable[[], object], arch: str | None = None, persist: bool = True):
        """`arch`: the target the key compiles for (None: cute.compile's default target); `persist`:
        whether the result may go to disk (False for builds that keep their PTX for inspection)."""
        fn = self._compiled.get(key)
        if fn is None:
            entry = cute_entry(arch, key) if persist else None
            fn = load_cute(entry) if entry is not None else None
            if fn is not None:
                self.loaded += 1
            else:
                fn = build()
                self.count += 1
                if entry is not None:
                    store_cute(entry, fn)
            self._compiled[key] = fn
        return fn
