"""What the current machine can run: the device (vendor, arch, SM count) and which DSLs import.

Both are plain frozen dataclasses so the dispatch table can be exercised on simulated devices
(tests build them by hand); the probes below fill them from torch and from trial imports.
"""
from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.util
import inspect
import os
from dataclasses import dataclass

import torch

from ._diskcache import fast_load, has_shared_libraries, point_cutile_cache


@dataclass(frozen=True)
class DeviceInfo:
    vendor: str  # "cpu" | "nvidia" | "amd"
    name: str
    arch: tuple[int, int] | None = None  # compute capability (NVIDIA) or gfx major/minor (AMD)
    sm_count: int = 0  # streaming multiprocessors (NVIDIA) or compute units (AMD)
    index: int | None = None

    @property
    def arch_name(self) -> str:
        if self.vendor == "nvidia" and self.arch:
            return f"sm_{self.arch[0]}{self.arch[1]}"
        return self.vendor


CPU = DeviceInfo(vendor="cpu", name="cpu")


class _Probe:
    def __repr__(self) -> str:
        return "PROBE"


PROBE = _Probe()  # a Toolchain field not given: the DSL is imported the first time a decision asks about it


@dataclass(frozen=True)
class Toolchain:
    """Import errors of the DSLs (None = importable). The process's own (`toolchain()`) leaves every
    field PROBE: each DSL is imported when a decision first needs it, so a call that runs a CuTe kernel
    does not import Triton (importing all three DSLs was 0.94 s of a fresh process's first call at
    N = 4096 on an H100, `import triton` 0.18 s of it: bench/decode.py --first-call)."""

    cutile: str | None | _Probe = PROBE
    cute: str | None | _Probe = PROBE
    triton: str | None | _Probe = PROBE

    def error(self, dsl: str) -> str | None:
        if dsl == "torch":
            return None
        value = getattr(self, dsl)
        return import_error(dsl) if value is PROBE else value


@functools.lru_cache(maxsize=None)
def _gpu_info(index: int) -> DeviceInfo:
    props = torch.cuda.get_device_properties(index)
    vendor = "amd" if getattr(torch.version, "hip", None) else "nvidia"
    return DeviceInfo(vendor=vendor, name=props.name, arch=(props.major, props.minor),
                      sm_count=props.multi_processor_count, index=index)


def device_info(device: torch.device | str | int | None = None) -> DeviceInfo:
    """The device a tensor lives on; None = the current CUDA device if there is one, else the CPU."""
    if device is None:
        if not torch.cuda.is_available():
            return CPU
        device = torch.device("cuda", torch.cuda.current_device())
    device = torch.device(device) if not isinstance(device, int) else torch.device("cuda", device)
    if device.type != "cuda":
        return DeviceInfo(vendor=device.type, name=device.type) if device.type != "cpu" else CPU
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _gpu_info(index)


DSL_MODULES = {"cutile": "cuda.tile", "cute": "cutlass.cute", "triton": "triton"}


@functools.lru_cache(maxsize=None)
def import_error(dsl: str) -> str | None:
    """Why the DSL does not import here (None: it does); found out once per process."""
    module = DSL_MODULES[dsl]
    if dsl == "cutile":
        point_cutile_cache()  # before cuda.tile is first imported
    if dsl == "cute" and fast_load() and has_shared_libraries():  # kernels load from shared libraries:
        # CuTe DSL imports at a compile (0.5-2.5 s of a fresh process's first call on the GPU hosts)
        missing = [m for m in ("cutlass", "tvm_ffi") if importlib.util.find_spec(m) is None]
        return f"`import {missing[0]}` failed: not installed" if missing else None
    try:
        importlib.import_module(module)
    except Exception as exc:  # any failure to import means the DSL cannot run here
        return f"`import {module}` failed: {type(exc).__name__}: {exc}".splitlines()[0]
    return None


@functools.lru_cache(maxsize=None)
def toolchain() -> Toolchain:
    """This process's DSLs, each imported on first need (Toolchain.error)."""
    return Toolchain()


def table_arch(dev: DeviceInfo, tables: dict) -> str | None:
    """The arch whose measured rows mode=None uses on `dev`: its own, else (NVIDIA) the nearest
    measured compute capability below it (an sm_100 or sm_120 GPU runs the sm_90 rows: the kernels
    compile for them, and a kernel beats the fp32 reference by 10-20x wherever it runs). None: no
    measured arch applies (CPU, AMD, no table, or a GPU older than every measured arch)."""
    if dev.arch_name in tables:
        return dev.arch_name
    if dev.vendor != "nvidia" or not dev.arch:
        return None
    measured = [(int(a[3:-1]), int(a[-1]), a) for a in tables if a.startswith("sm_") and a[3:].isdigit()]
    if not measured:
        return None
    below = [m for m in measured if m[:2] <= dev.arch]
    return max(below)[2] if below else None


def gpu_model(name: str) -> str:
    """The GPU model in a device name, as the measured tables name it: "NVIDIA H100 80GB HBM3" -> "H100",
    "NVIDIA H200" -> "H200" (the first word after the vendor)."""
    words = name.removeprefix("NVIDIA ").split()
    return words[0] if words else name


def table_key(dev: DeviceInfo, tables: dict) -> str | None:
    """The key of the measured table mode=None uses on `dev`: "<arch>/<model>" where this GPU model was
    measured on its own (e.g. "sm_90/H200"), else the arch's ("sm_90": the model its `source` names,
    which every unmeasured GPU of that arch, and of a newer unmeasured arch, borrows; see table_arch)."""
    arch = table_arch(dev, tables)
    if arch == dev.arch_name and f"{arch}/{gpu_model(dev.name)}" in tables:
        return f"{arch}/{gpu_model(dev.name)}"
    return arch


def table_key_for(table: dict, arch: str, gpu: str) -> str:
    """Where a measured table's rows for `gpu` go (the writers' side of table_key; `table` has a
    "source" of {key: {"gpu": name, ...}}): the arch's if it is this GPU's (or there is none yet), else
    the model's own ("sm_90/H200")."""
    src = table.get("source", {}).get(arch)
    return arch if src is None or src.get("gpu") == gpu else f"{arch}/{gpu_model(gpu)}"


def triton_interpreted() -> bool:
    """TRITON_INTERPRET=1: Triton runs its kernels on CPU tensors (the CPU CI's way to run them)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def is_fake(t) -> bool:
    """t is a FakeTensor (torch's FakeTensorMode: memory estimators, shape propagation)."""
    return type(t) is not torch.Tensor and _IS_FAKE(t)


def fake_call(*tensors) -> bool:
    """A FakeTensorMode is active, or one of `tensors` (None skipped) is fake: there is no memory for a
    kernel to read or write, only shapes (outside torch.compile, which traces the ops itself)."""
    if _FAKE_MODE() is not None:
        return True
    for t in tensors:  # (is_fake's test inline, in a loop: 0.27 us a call on the CI machine, 0.33 calling is_fake
        # and 0.8 with any(); a decode step is host bound)
        if t is not None and type(t) is not torch.Tensor and _IS_FAKE(t):
            return True
    return False


def real_tensors():
    """A context in which tensors are real, even inside a FakeTensorMode (patch()'s probe runs a forward)."""
    return _UNSET_FAKE()


def several_gpus() -> bool:
    """Whether this process sees more than one GPU (counted once: the count cannot change once CUDA starts)."""
    if not _GPU_COUNT:
        _GPU_COUNT.append(torch.cuda.device_count() if torch.cuda.is_available() else 0)
    return _GPU_COUNT[0] > 1


def run_on_gpu(index: int, fn, *args, **kwargs):
    """fn(*args, **kwargs) with GPU `index` current. The kernels launch on the current GPU (Triton's launcher reads
    it and refuses another GPU's memory; cuTile and CuTe DSL launch on streams of the current context), so a model
    spread over the GPUs of one process (transformers' device_map="auto") would launch its later layers' kernels
    from cuda:0; torch's own ops switch GPUs the same way."""
    if current_gpu() == index:
        return fn(*args, **kwargs)
    with torch.cuda.device(index):
        return fn(*args, **kwargs)


def on_its_gpu(fn):
    """fn run with its first argument's GPU current where the process sees several GPUs (run_on_gpu): the custom
    ops' implementations, which torch's dispatcher calls without the device guard of its own ops. The signature
    is fn's with its annotations evaluated in fn's module (torch.library reads it to infer an op's schema)."""
    @functools.wraps(fn)
    def run(*args, **kwargs):
        if args[0].is_cuda and several_gpus():
            return run_on_gpu(args[0].get_device(), fn, *args, **kwargs)
        return fn(*args, **kwargs)
    run.__signature__ = inspect.signature(fn, eval_str=True)
    return run


def on_gpu(fn, index: int):
    """fn run with GPU `index` current (run_on_gpu): a call plan, made and run so (its key holds its tensors' GPU)."""
    return functools.partial(run_on_gpu, index, fn)


# (torch internals, each read with a default where a torch version lacks it)
_GPU_COUNT: list = []
# the current GPU's index as torch's own launch paths read it (cheaper than torch.cuda.current_device(): a call at
# M = 1 is host bound)
current_gpu = getattr(torch._C, "_cuda_getDevice", torch.cuda.current_device)
_FAKE_TENSOR = getattr(getattr(torch, "_subclasses", None), "fake_tensor", None)
_IS_FAKE = getattr(_FAKE_TENSOR, "is_fake", lambda t: False)
_UNSET_FAKE = getattr(_FAKE_TENSOR, "unset_fake_temporarily", contextlib.nullcontext)
_FAKE_KEY = getattr(getattr(torch._C, "_TorchDispatchModeKey", None), "FAKE", None)
_FAKE_MODE = (functools.partial(torch._C._get_dispatch_mode, _FAKE_KEY)
              if _FAKE_KEY is not None and hasattr(torch._C, "_get_dispatch_mode") else (lambda: None))
