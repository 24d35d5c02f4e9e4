"""The one place that decides which kernel runs.

`MODES` maps every mode name to its implementation and to what it needs (vendor, arch, DSL); a mode
that cannot run says why. `mode=None` picks from the measured table in `tuning/rmsnorm_fwd.json`
(written by `python bench/rmsnorm.py --write-table`), never an experimental or unbuilt kernel; an
NVIDIA arch with no rows of its own borrows the nearest measured arch's (warning once), and only
where nothing applies (CPU, no table) does the reference run. `explain()` prints the decision and its evidence.
"""
from __future__ import annotations

import functools
import importlib
import json
import os
import warnings
from dataclasses import dataclass

import torch

from ._experimental import ENV_VAR, experimental_enabled, is_experimental
from ._platform import DeviceInfo, Toolchain, table_arch, triton_interpreted

STABLE, EXPERIMENTAL, PLANNED = "stable", "experimental", "planned"


class UnmeasuredDeviceWarning(UserWarning):
    """mode=None runs on a GPU whose arch has no measured table (it borrows the nearest one)."""


@dataclass(frozen=True)
class Mode:
    name: str
    dsl: str  # the DSL that must import: "cutile" | "cute" | "triton" | "torch"
    backend: str | None  # "module:object" with the forward backend; None while planned
    status: str  # STABLE | EXPERIMENTAL | PLANNED
    vendors: tuple[str, ...]
    min_arch: tuple[int, int] | None  # NVIDIA compute capability floor
    idea: str
    planned_in: str = ""
    # "module:object" with the backward backend behind autograd; None: autograd through the reference
    bwd_backend: str | None = None


_CUTILE_FWD = "cutile_norms.cutile.rmsnorm_fwd"
_CUTILE_BWD = "cutile_norms.cutile.rmsnorm_bwd:PERSISTENT_BACKWARD"  # every cuTile mode's backward
# tma_smem_cached's: the CuTe DSL kernel for wide rows, the cuTile one for the others
_CUTE_BWD = "cutile_norms.cute.rmsnorm_bwd:TMA_SMEM_BACKWARD"
MODES: dict[str, Mode] = {m.name: m for m in (
    Mode("multi_wave_reload", "cutile", f"{_CUTILE_FWD}:MULTI_WAVE_RELOAD", STABLE, ("nvidia",), (9, 0),
         "cuTile, one block per row, two passes over chunks (sum of squares, then re-read and "
         "normalise): for rows too long to keep on chip", bwd_backend=_CUTILE_BWD),
    Mode("multi_wave_cached", "cutile", f"{_CUTILE_FWD}:MULTI_WAVE_CACHED", STABLE, ("nvidia",), (9, 0),
         "cuTile, one block per row (or a few rows), the whole row loaded once and kept on chip",
         bwd_backend=_CUTILE_BWD),
    Mode("static_persistent", "cutile", f"{_CUTILE_FWD}:STATIC_PERSISTENT", STABLE, ("nvidia",), (9, 0),
         "cuTile, a persistent grid of about one wave looping over row tiles, weight loaded once "
         "per block, several rows per tile for narrow rows", bwd_backend=_CUTILE_BWD),
    Mode("tma_smem_cached", "cute", "cutile_norms.cute.rmsnorm_fwd:TMA_SMEM_CACHED", STABLE, ("nvidia",), (9, 0),
         "CuTe DSL, row tiles brought into shared memory by TMA bulk copies and normalised from there, "
         "clusters of CTAs exchanging partial sums through distributed shared memory for long rows "
         "(rows must start 16-byte aligned)", bwd_backend=_CUTE_BWD),
    Mode("triton", "triton", "cutile_norms.triton.rmsnorm_fwd:TRITON_FORWARD", STABLE, ("nvidia", "amd"), None,
         "Triton, a persistent grid over row tiles (several rows per tile for narrow rows, split rows "
         "exchanging partial sums for wide ones): AMD GPUs, NVIDIA GPUs older than sm_90 or without cuTile",
         bwd_backend="cutile_norms.triton.rmsnorm_bwd:TRITON_BACKWARD"),
    Mode("torch", "torch", "cutile_norms.reference:rms_norm_reference", STABLE, ("cpu", "nvidia", "amd"), None,
         "the fp32 torch reference (the oracle of every test), forward and backward"),
)}


def _refusal(mode: Mode, dev: DeviceInfo, tools: Toolchain) -> tuple[type[Exception], str] | None:
    """Why `mode` cannot run on `dev` with `tools`, with the error to raise (ValueError when the
    caller's tensors are on the wrong kind of device, RuntimeError when the machine lacks something)."""
    if mode.status == PLANNED:
        return RuntimeError, f"mode {mode.name!r} is not built yet (it comes with {mode.planned_in})"
    if mode.status == EXPERIMENTAL and not experimental_enabled():
        return RuntimeError, (f"mode {mode.name!r} is experimental (not validated on hardware): opt in with "
                              f"{ENV_VAR}=1 or cutile_norms.enable_experimental()")
    if dev.vendor not in mode.vendors and not (mode.dsl == "triton" and dev.vendor == "cpu" and triton_interpreted()):
        where = "CPU tensors" if dev.vendor == "cpu" else f"{dev.vendor} device {dev.name}"
        return ValueError, f"mode {mode.name!r} runs on {' / '.join(mode.vendors)} GPUs, not on {where}"
    if mode.min_arch and dev.vendor == "nvidia" and dev.arch < mode.min_arch:
        need = f"sm_{mode.min_arch[0]}{mode.min_arch[1]}"
        return RuntimeError, f"mode {mode.name!r} needs compute capability >= {need}; {dev.name} is {dev.arch_name}"
    err = tools.error(mode.dsl)
    if err:
        return RuntimeError, f"mode {mode.name!r} needs {mode.dsl}, which does not import here: {err}"
    if mode.bwd_backend in (_CUTILE_BWD, _CUTE_BWD) and mode.dsl != "cutile" and tools.error("cutile"):
        return RuntimeError, (f"mode {mode.name!r} runs its backward with the cuTile persistent kernel, and "
                              f"cutile does not import here: {tools.error('cutile')}")
    return None


def unavailable_reason(mode: Mode, dev: DeviceInfo, tools: Toolchain) -> str | None:
    """None when `mode` can run on `dev` with `tools`, else the reason it cannot."""
    refusal = _refusal(mode, dev, tools)
    return refusal[1] if refusal else None


def _import(path: str):
    module, _, attr = path.partition(":")
    return getattr(importlib.import_module(module), attr)


@functools.lru_cache(maxsize=None)
def backend(mode_name: str):
    """The forward backend object of a mode (imported on first use)."""
    return _import(MODES[mode_name].backend)


@functools.lru_cache(maxsize=None)
def backward_backend(mode_name: str):
    """The backward backend behind autograd for a mode's forward: an object with
    `backward(dy2d, x2d, weight, rstd, offset, need_dx, need_dw, dev)` and `describe(M, N, dtype, dev)`."""
    path = MODES[mode_name].bwd_backend
    if path is None:
        raise ValueError(f"mode {mode_name!r} has no backward kernel: autograd runs through its forward's ops")
    return _import(path)


# ----------------------------------------------------------------------------------------------
# mode=None: the measured table
# ----------------------------------------------------------------------------------------------
TABLE_PATH = os.path.join(os.path.dirname(__file__), "tuning", "rmsnorm_fwd.json")


@functools.lru_cache(maxsize=None)
def measured_table() -> dict:
    try:
        with open(TABLE_PATH) as f:
            return json.load(f)
    except FileNotFoundError:
        return {"tables": {}}


@dataclass(frozen=True)
class Choice:
    mode: str
    reason: str
    bwd_mode: str = ""  # the mode whose backward kernel runs behind autograd; "" = the forward's mode

    @property
    def backward_mode(self) -> str:
        return self.bwd_mode or self.mode


MEASURE_COMMAND = "python bench/rmsnorm.py --write-table"
_warned_arches: set = set()


def _fallback(dev: DeviceInfo, tools: Toolchain, why: str) -> Choice:
    """Where no measured row applies: the Triton kernels if they can run here, else the reference."""
    why_not = unavailable_reason(MODES["triton"], dev, tools)
    if why_not is None:
        return _with_best_backward(Choice("triton", f"{why}: the Triton kernels run"), dev, tools)
    return Choice("torch", f"{why}, and {why_not}: the reference runs")


def instead_of(dev: DeviceInfo, tools: Toolchain, mode: str, why: str) -> Choice:
    """mode=None where the measured row's mode cannot take these rows (`why`: e.g. tma_smem_cached and
    rows that do not start 16-byte aligned): multi_wave_cached (it takes every shape), else the fallback."""
    if mode != "multi_wave_cached" and unavailable_reason(MODES["multi_wave_cached"], dev, tools) is None:
        return Choice("multi_wave_cached", f"{why}: multi_wave_cached runs instead")
    return _fallback(dev, tools, why)


def choose_forward(dev: DeviceInfo, tools: Toolchain, dtype: torch.dtype, M: int, N: int) -> Choice:
    """mode=None: the measured best mode for (arch, dtype, N, M); where nothing is measured or what is
    measured cannot run here (AMD, NVIDIA below sm_90, cuTile missing) the Triton kernels; the
    reference on CPU tensors or where Triton cannot run either."""
    if dev.vendor == "cpu":
        return Choice("torch", "CPU tensors: the reference runs")
    if dev.vendor == "amd":
        return _fallback(dev, tools, f"AMD GPU {dev.name} (cuTile and CuTe DSL are NVIDIA-only)")
    table = measured_table()
    tables = table.get("tables", {})
    arch = table_arch(dev, tables)
    if arch is None:
        return _fallback(dev, tools, f"no measurements for {dev.arch_name} ({dev.name}) in "
                                     f"{os.path.basename(TABLE_PATH)}")
    borrowed = ""
    if arch != dev.arch_name:
        borrowed = f"; {dev.arch_name} not measured, the {arch} table stands in (measure it: {MEASURE_COMMAND})"
        if dev.arch_name not in _warned_arches:
            _warned_arches.add(dev.arch_name)
            warnings.warn(f"cutile_norms: {dev.name} ({dev.arch_name}) has no measured table; mode=None uses the "
                          f"nearest measured arch's ({arch}). Measure this GPU and write its rows with: "
                          f"{MEASURE_COMMAND}", UnmeasuredDeviceWarning, stacklevel=4)
    dname = str(dtype).removeprefix("torch.")
    for row in tables[arch].get(dname, []):
        if row["n_min"] <= N <= row["n_max"] and row["m_min"] <= M <= row["m_max"]:
            mode = MODES[row["mode"]]
            why_not = unavailable_reason(mode, dev, tools)
            if mode.status != STABLE or why_not:
                return _fallback(dev, tools, f"the measured table {arch}/{row['mode']} row cannot run here "
                                             f"({why_not or mode.status}){borrowed}")
            src = table.get("source", {}).get(arch, {})
            command = src.get("commands", {}).get(dname, {}).get("command", "?")
            why = (f"measured table {arch}/{dname}: N in [{row['n_min']}, {row['n_max']}], "
                   f"M in [{row['m_min']}, {row['m_max']}] -> {row['mode']} ({row['evidence']}; "
                   f"{src.get('gpu', '?')}, {command}){borrowed}")
            return _with_best_backward(Choice(mode.name, why), dev, tools, backward_row(arch, dname, N))
    return _fallback(dev, tools, f"the measured table for {arch} has no row for {dname}, N={N}, M={M}{borrowed}")


@dataclass(frozen=True)
class BackwardRow:
    """A width range where mode=None's backward is another mode's than the cuTile persistent kernel."""
    arch: str
    dtypes: tuple[str, ...]
    n_min: int
    n_max: int
    mode: str
    evidence: str


# mode=None's backward: the cuTile persistent kernel, except where another mode's backward measured
# ahead of it in the same run (bench/NOTES.md, "The Triton mode, second round" and "The backward in
# CuTe DSL"). The cuTile backward's best config at 7168 measured 0.885 (its sweep); its rows split
# over blocks exchange their sums through L2, the CuTe DSL kernel's through a cluster's shared memory.
BACKWARD_TABLE = (
    BackwardRow("sm_90", ("bfloat16", "float16"), 6145, 8191, "triton",
                "H100 80GB HBM3 2026-11-24, N=7168 bf16: triton 0.947 x copy, the cuTile persistent kernel "
                "0.883; python bench/rmsnorm.py --modes triton --anchors liger"),
    BackwardRow("sm_90", ("bfloat16", "float16"), 32768, 262144, "tma_smem_cached",
                "H100 80GB HBM3 2026-11-25, bf16: the CuTe DSL backward 0.948 / 0.967 / 0.957 / 0.937 x copy "
                "at N=32768 / 65536 / 131072 / 262144, the cuTile persistent kernel 0.935 / 0.918 / 0.894 / "
                "0.798; python bench/probe/cute_bwd_configs.py"),
)


def backward_row(arch: str | None, dtype_name: str, N: int) -> BackwardRow | None:
    return next((r for r in BACKWARD_TABLE if r.arch == arch and dtype_name in r.dtypes and r.n_min <= N <= r.n_max),
                None)


def _with_best_backward(choice: Choice, dev: DeviceInfo, tools: Toolchain, row: BackwardRow | None = None) -> Choice:
    """mode=None: the forward table picks the forward only. `row` (BACKWARD_TABLE's, for this arch,
    dtype and N): that mode's backward runs where it can. Else, where the forward has a backward of its
    own (triton) and the cuTile persistent backward can run, that one runs behind autograd: on an H100
    it measured ahead of Triton's at every other width and dtype (bf16 0.945-0.976 x copy against
    0.888-0.954 to 16384 and 0.80-0.94 against 0.75-0.86 beyond; fp32 N=16384 0.98 against 0.82;
    bench/NOTES.md, The backward and The Triton mode, second round)."""
    if row is not None and unavailable_reason(MODES[row.mode], dev, tools) is None:
        if choice.backward_mode == row.mode:
            return choice
        return Choice(choice.mode, f"{choice.reason}; backward: {row.mode}'s ({row.evidence})", bwd_mode=row.mode)
    if MODES[choice.mode].bwd_backend in (None, _CUTILE_BWD, _CUTE_BWD):
        return choice
    if unavailable_reason(MODES["multi_wave_cached"], dev, tools) is not None:
        return choice
    return Choice(choice.mode, choice.reason + "; backward: the cuTile persistent kernel (measured ahead of "
                  f"{choice.mode}'s at every width)", bwd_mode="multi_wave_cached")


def resolve(mode_name: str | None, dev: DeviceInfo, tools: Toolchain, dtype: torch.dtype, M: int, N: int) -> Choice:
    """The mode that will run, or ValueError/RuntimeError saying why the asked one cannot.
    (rms_norm caches the decision per call signature: rmsnorm._route.)"""
    if mode_name is None:
        return choose_forward(dev, tools, dtype, M, N)
    mode = MODES.get(mode_name) if isinstance(mode_name, str) else None
    if mode is None:
        raise ValueError(f"unknown mode {mode_name!r}; modes: None (measured heuristic), "
                         + ", ".join(repr(m) for m in MODES))
    refusal = _refusal(mode, dev, tools)
    if refusal:
        raise refusal[0](refusal[1])
    if mode.backend and mode.status == STABLE and mode.dsl != "torch" and is_experimental(backend(mode.name)):
        raise RuntimeError(f"mode {mode.name!r} is registered stable but its backend is experimental")
    return Choice(mode.name, "asked for explicitly")
