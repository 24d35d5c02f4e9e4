"""The one place that decides which kernel runs.

`MODES` maps every mode name to its implementation and to what it needs (vendor, arch, DSL); a mode that cannot run
says why. `mode=None` picks the forward from the measured tables in `tuning/rmsnorm_fwd.json` (one per GPU model
that was measured on its own, e.g. "sm_90/H200", else the arch's; written by `python bench/rmsnorm.py --write-table`
by FORWARD_RULE below) and the backward from BACKWARD_TABLE (backward_table.py) and cute_backward_refusal, never an
experimental or unbuilt kernel. A GPU with no table of its own borrows its arch's (or the nearest measured arch's)
and warns once; where no table applies, Triton runs if it can, else (CPU) the reference. `explain()` prints the
decision, the table and row used and their evidence.
"""
from __future__ import annotations

import dataclasses
import functools
import importlib
import json
import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ._experimental import ENV_VAR, experimental_enabled, is_experimental
from ._platform import DeviceInfo, Toolchain, table_key, triton_interpreted
from .backends import BackwardBackend, ForwardBackend
from .backward_table import CUTE_BWD_MIN_BYTES, BackwardRow, backward_row
from .triton.add_rmsnorm_bwd_config import tma_rows as fused_bwd_tma_rows

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
         "Triton, one program per row tile forward (several rows per tile for narrow rows, split rows "
         "exchanging partial sums for wide ones), a persistent grid backward: AMD GPUs, NVIDIA GPUs "
         "older than sm_90 or without cuTile",
         bwd_backend="cutile_norms.triton.rmsnorm_bwd:TRITON_BACKWARD"),
    Mode("torch", "torch", "cutile_norms.reference:rms_norm_reference", STABLE, ("cpu", "nvidia", "amd"), None,
         "the fp32 torch reference (the oracle of every test), forward and backward"),
)}


def modes_of(dsl: str | None = None) -> list[str]:
    """The modes (all, or those written in `dsl`: "cutile", "cute", "triton", "torch") in MODES' order:
    what the tests and the bench iterate over, so a mode added here is tested and benched."""
    return [name for name, m in MODES.items() if dsl is None or m.dsl == dsl]


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
    if err := tools.error(mode.dsl):
        return RuntimeError, f"mode {mode.name!r} needs {mode.dsl}, which does not import here: {err}"
    if mode.bwd_backend in (_CUTILE_BWD, _CUTE_BWD) and mode.dsl != "cutile" and tools.error("cutile"):
        return RuntimeError, (f"mode {mode.name!r} runs its backward with the cuTile persistent kernel, and "
                              f"cutile does not import here: {tools.error('cutile')}")
    return None


def unavailable_reason(mode: Mode, dev: DeviceInfo, tools: Toolchain) -> str | None:
    """None when `mode` can run on `dev` with `tools`, else the reason it cannot."""
    return refusal[1] if (refusal := _refusal(mode, dev, tools)) else None


def load(path: str):
    """The object a "module:name" path names (a backend, an experimental kernel's launch), imported on use."""
    module, _, attr = path.partition(":")
    return getattr(importlib.import_module(module), attr)


@functools.lru_cache(maxsize=None)
def backend(mode_name: str) -> ForwardBackend:
    """The forward backend object of a mode (imported on first use); "torch" has none (the reference)."""
    return load(MODES[mode_name].backend)


@functools.lru_cache(maxsize=None)
def backward_backend(mode_name: str) -> BackwardBackend:
    """The backward backend behind autograd for a mode's forward (backends.BackwardBackend)."""
    if (path := MODES[mode_name].bwd_backend) is None:
        raise ValueError(f"mode {mode_name!r} has no backward kernel: autograd runs through its forward's ops")
    return load(path)


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
    dh_bwd_mode: str = ""  # the same for the residual add's backward (with dh); "" = backward_mode

    @property
    def backward_mode(self) -> str:
        return self.bwd_mode or self.mode

    @property
    def dh_backward_mode(self) -> str:
        return self.dh_bwd_mode or self.backward_mode


MEASURE_COMMAND = "python bench/rmsnorm.py --write-table"
_warned_arches: set = set()


def _fallback(dev: DeviceInfo, tools: Toolchain, why: str) -> Choice:
    """Where no measured row applies: the Triton kernels if they can run here, else the reference."""
    if (why_not := unavailable_reason(MODES["triton"], dev, tools)) is None:
        return _with_best_backward(Choice("triton", f"{why}: the Triton kernels run"), dev, tools)
    return Choice("torch", f"{why}, and {why_not}: the reference runs")


def instead_of(dev: DeviceInfo, tools: Toolchain, mode: str, why: str) -> Choice:
    """mode=None where the measured row's mode cannot take these rows (`why`: e.g. tma_smem_cached and rows that do
    not start 16-byte aligned): multi_wave_cached (it takes every shape), else the fallback."""
    if mode != "multi_wave_cached" and unavailable_reason(MODES["multi_wave_cached"], dev, tools) is None:
        return Choice("multi_wave_cached", f"{why}: multi_wave_cached runs instead")
    return _fallback(dev, tools, why)


def choose_forward(dev: DeviceInfo, tools: Toolchain, dtype: torch.dtype, M: int, N: int,
                   fp32_weight: bool = False) -> Choice:
    """mode=None: the measured mode for (GPU model, dtype, N), the same for every M (a row's result
    never depends on the batch it comes in: see FORWARD_RULE); where nothing is measured or what is
    measured cannot run here (AMD, NVIDIA below sm_90, cuTile missing) the Triton kernels; the
    reference on CPU tensors or where Triton cannot run either. The backward behind it from
    BACKWARD_TABLE (`fp32_weight`: an fp32 weight beside 16-bit x, which some of its rows exclude)."""
    if dev.vendor == "cpu":
        return Choice("torch", "CPU tensors: the reference runs")
    if dev.vendor == "amd":
        return _fallback(dev, tools, f"AMD GPU {dev.name} (cuTile and CuTe DSL are NVIDIA-only)")
    table = measured_table()
    tables = table.get("tables", {})
    key = table_key(dev, tables)
    if key is None:
        return _fallback(dev, tools, f"no measurements for {dev.arch_name} ({dev.name}) in "
                                     f"{os.path.basename(TABLE_PATH)}")
    dname = str(dtype).removeprefix("torch.")
    if dname not in tables[key] and "/" in key:  # this model measured, not in this dtype: its arch's rows
        key = key.split("/")[0]
    borrowed = ""
    src = table.get("source", {}).get(key, {})
    if src.get("gpu") != dev.name:
        borrowed = (f"; {dev.name} not measured in {dname}, the {key} table ({src.get('gpu', '?')}) stands in "
                    f"(measure it: {MEASURE_COMMAND})")
        if (dev.name, dname) not in _warned_arches:
            _warned_arches.add((dev.name, dname))
            warnings.warn(f"cutile_norms: {dev.name} ({dev.arch_name}) has no measured {dname} table; mode=None "
                          f"uses the {key} table, measured on {src.get('gpu', '?')}. Measure this GPU and write "
                          f"its rows with: {MEASURE_COMMAND}", UnmeasuredDeviceWarning, stacklevel=4)
    for row in tables[key].get(dname, []):
        if row["n_min"] <= N <= row["n_max"] and row["m_min"] <= M <= row["m_max"]:
            mode = MODES[row["mode"]]
            why_not = unavailable_reason(mode, dev, tools)
            if mode.status != STABLE or why_not:
                return _fallback(dev, tools, f"the measured table {key}/{row['mode']} row cannot run here "
                                             f"({why_not or mode.status}){borrowed}")
            command = src.get("commands", {}).get(dname, {}).get("command", "?")
            why = (f"measured table {key}/{dname}: N in [{row['n_min']}, {row['n_max']}] -> {row['mode']} "
                   f"({row['evidence']}; {src.get('gpu', '?')}, {command}){borrowed}")
            def refused(r: BackwardRow) -> bool:  # a row's own band decides its widths
                return r.mode == "tma_smem_cached" and cute_backward_refusal(N, dtype, r) is not None
            norm, dh = (_with_best_backward(Choice(mode.name, why), dev, tools,
                                            backward_row(key, dname, N, fp32_weight, with_dh, refused))
                        for with_dh in (False, True))
            if dh.backward_mode == norm.backward_mode:
                return norm
            dh_why = dh.reason[len(why):].removeprefix("; backward: ") or f"{dh.backward_mode}'s own"
            return dataclasses.replace(norm, dh_bwd_mode=dh.backward_mode,
                                       reason=f"{norm.reason}; with dh (the residual add's backward): {dh_why}")
    return _fallback(dev, tools, f"the measured table {key} has no row for {dname}, N={N}, M={M}{borrowed}")


# FORWARD_RULE, how `python bench/rmsnorm.py --write-table` turns a sweep into rows (forward_table.py, band_rows): the
# widths are cut into bands of row bytes at FORWARD_BAND_EDGES, and each band takes the mode whose worst ratio to a copy
# over every width measured in it (the widths real models use and the random ones of that run) is the highest, for every
# M. Why bands and not the nearest measured width: inside a band the kernels keep their shape (below), so a mode that
# holds at a band's measured widths holds between them; the nearest-width rule put modes measured within 0.1 % of each
# other in alternate ranges and missed the widths between the sweep's (H200, N = 10240-28672: 0.70-0.89 x copy). One
# mode per width for every M: rows are bit-identical whatever the batch (tests/test_batch_invariance.py), and at M <=
# 64, where a call is host bound, GPU times differ by tenths of a microsecond, host paths by a few (bench/decode.py,
# H200, M = 1, N = 4096: tma_smem_cached 11.0-17.7 us, Triton 16.6-19.4).
# The 48 and 64 KiB edges are where tma_smem_cached changes shape (cute/rmsnorm_fwd_config.py): a row in one CTA up to
# 48 KiB, over a cluster of 4 CTAs to 64 KiB, over clusters of 5-16 beyond, whose last slice may be part empty
# (0.74-0.83 x copy at N = 98368 / 36568 on an H100). The 48 KiB edge matters on an H200: the cluster of 4 measured
# 0.77-0.93 x copy at eight bf16 widths in 48-64 KiB (24736 ... 32768, six of them random) where multi_wave_cached held
# 0.95-0.99, while one CTA held 0.96-1.0 below; on an H100 the cluster of 4 held 0.95-1.0 there and multi_wave_cached
# 0.995-1.01. The H100's fp32 rows were written before that edge; they run tma_smem_cached on both sides of it (fp32 N =
# 13000 / 15000 / 16384: 1.007 / 1.007 / 1.006 there, multi_wave_cached 1.003 / 1.008 / 1.007).
# 1.5 KiB (1535) / 112 KiB: Triton's forward runs one row a program in two passes with N compiled in from 1.5 KiB to 64
# KiB and fp32 rows to 112 KiB (triton/rmsnorm_fwd_config.fixed_config; H200 0.953-1.029 x copy), narrow rows several a
# program. 8 KiB (8191): tma_smem_cached's tile goes from two rows to one past it; 128 / 256 KiB: fp32 over 8 CTAs.
FORWARD_BAND_EDGES = (1536 - 1, 8 * 1024 - 1, 48 * 1024, 64 * 1024, 112 * 1024, 128 * 1024, 256 * 1024)


def cute_backward_refusal(N: int, dtype: torch.dtype, row: BackwardRow | None = None) -> str | None:
    """Why the CuTe DSL backward does not take rows of N `dtype` elements (whatever their alignment), or None: for
    mode=None its BACKWARD_TABLE `row`'s band (fp32 rows only in an fp32 row), by name CUTE_BWD_MIN_BYTES and no fp32
    rows; the cuTile persistent backward takes every other row."""
    from .cute.rmsnorm_bwd_config import analytic_config

    min_bytes, fp32 = (row.bytes_min, "float32" in row.dtypes) if row else (CUTE_BWD_MIN_BYTES, False)
    if dtype == torch.float32 and not fp32:
        return "fp32 rows: the cuTile backward measured ahead"
    if N * dtype.itemsize < min_bytes:
        return f"rows under {min_bytes / 1024:g} KiB: the cuTile backward measured ahead"
    cfg = analytic_config(N, dtype.itemsize)
    if N % (16 // dtype.itemsize) or cfg is None:
        return f"the CuTe DSL backward does not take N={N}"
    return None


def _with_best_backward(choice: Choice, dev: DeviceInfo, tools: Toolchain, row: BackwardRow | None = None) -> Choice:
    """mode=None: the forward table picks the forward only. `row` (BACKWARD_TABLE's, for this table,
    dtype and N): that mode's backward runs where it can. Else, where the forward has a backward of its
    own (triton) and the cuTile persistent backward can run, that one runs behind autograd: on an H100
    it measured ahead of Triton's at every other width and dtype (bf16 0.945-0.976 x copy against
    0.888-0.954 to 16384 and 0.80-0.94 against 0.75-0.86 beyond; fp32 N=16384 0.98 against 0.82;
    docs/design.md). tma_smem_cached's own backward is the CuTe DSL kernel only where cute_backward_refusal says so."""
    if row is not None and unavailable_reason(MODES[row.mode], dev, tools) is None:
        # (named even where it is the forward's own mode: explain() shows the backward's row too)
        return Choice(choice.mode, f"{choice.reason}; backward: {row.mode}'s ({row.evidence})", bwd_mode=row.mode)
    if choice.mode == "tma_smem_cached" or MODES[choice.mode].bwd_backend not in (None, _CUTILE_BWD, _CUTE_BWD):
        if unavailable_reason(MODES["multi_wave_cached"], dev, tools) is None:
            return Choice(choice.mode, choice.reason + "; backward: the cuTile persistent kernel (measured ahead "
                          f"of {choice.mode}'s at this width)", bwd_mode="multi_wave_cached")
    return choice


def check_mode_name(mode_name: str | None) -> Mode | None:
    """The mode of that name (None for None), else ValueError listing the modes."""
    if mode_name is None or (isinstance(mode_name, str) and mode_name in MODES):
        return MODES.get(mode_name)
    raise ValueError(f"unknown mode {mode_name!r}; modes: None (measured heuristic), " + ", ".join(map(repr, MODES)))


def resolve(mode_name: str | None, dev: DeviceInfo, tools: Toolchain, dtype: torch.dtype, M: int, N: int,
            fp32_weight: bool = False) -> Choice:
    """The mode that will run, or ValueError/RuntimeError saying why the asked one cannot (`fp32_weight`: an fp32
    weight beside 16-bit x; mode=None's backward table tells them apart; rms_norm caches it: rmsnorm._route)."""
    if mode_name is None:
        return choose_forward(dev, tools, dtype, M, N, fp32_weight)
    mode = check_mode_name(mode_name)
    if refusal := _refusal(mode, dev, tools):
        raise refusal[0](refusal[1])
    if mode.backend and mode.status == STABLE and mode.dsl != "torch" and is_experimental(backend(mode.name)):
        raise RuntimeError(f"mode {mode.name!r} is registered stable but its backend is experimental")
    refusal = cute_backward_refusal(N, dtype) if mode.name == "tma_smem_cached" else None
    if refusal:
        return Choice(mode.name, f"asked for explicitly; backward: the cuTile persistent kernel ({refusal})",
                      bwd_mode="multi_wave_cached")
    return Choice(mode.name, "asked for explicitly")


# The residual add (rms_norm(..., residual=r)): fused into the norm (x and r read once, h and y
# written once: 4 M N e bytes for 16-bit x, r and h) by
#   * Triton's kernel, the row in registers, for rows of up to FUSED_ADD_MAX_N elements (mode None or
#     "triton"): 0.98-1.02 x a copy of its bytes at 896-16384 and 0.953-1.001 at 16392-32768 on an H200
#     (the split kernel there 0.912-0.989; fp32 h 0.88-0.94 against 0.73-0.87), 1.004-1.023 to 16384 on an
#     H100 (bf16; past it Liger's kernel of its shape within 0.4 % of the split one); 1024 threads of 32
#     values past 16384, where an fp32 weight spills (36-76 bytes; H200 0.66-0.80): there mode None runs
#     the CuTe DSL kernel where it takes the rows (0.87-0.98 at 16392-32768, the split kernel 0.72-0.84),
#     else the split kernel where cuTile runs (FUSED_ADD_FP32_WEIGHT_MAX_N); a two-pass form: 0.60-0.85;
#   * cuTile's split kernel for wider rows (mode None or a cuTile mode), each row split over blocks that
#     keep a power-of-two part of at most 16 KiB of x, r and h each on chip, as the norm's split forward
#     does: 0.955-0.985 to 131072 on an H200, 0.996-1.006 to 262144 on an H100 (bf16; unfused: 0.81): a part
#     is 4097-8192 columns of 16-bit operands (2049-4096 where one is fp32) whatever N is (up to MAX_ROW_BYTES);
#   * a mode named: its own DSL's fused kernel (below, FUSED_ADD_CUTE_KERNEL and FUSED_ADD_SPLIT_MIN_BYTES);
# everywhere else (CUTILE_NORMS_FUSED=0, another mode, a DSL that does not run here) the add runs as one
# torch.add into h before the norm kernel `resolve` picks for h (5 M N e bytes: 0.81-0.83). The backward:
# `residual_backward`. (`python bench/residual.py`, docs/performance.md 2.7, 2.15 and 2.16.)
FUSED_ADD_KERNEL = "cutile_norms.triton.add_rmsnorm_fwd:add_rms_norm_fwd"
FUSED_ADD_SPLIT_KERNEL = "cutile_norms.cutile.add_rmsnorm_fwd:add_rms_norm_fwd"
FUSED_ADD_CUTE_KERNEL = "cutile_norms.cute.add_rmsnorm_fwd:add_rms_norm_fwd"
# A mode named runs its own DSL's fused kernel: mode "tma_smem_cached" the CuTe DSL one (x's and r's row
# tiles in shared memory by bulk copies, the forward's kernel with the add in its first pass): 0.984-1.009
# x a copy at 896-262144 on an H100 (bf16); a cuTile mode the split kernel from rows of FUSED_ADD_SPLIT_MIN_BYTES
# of the widest operand: a row's two halves go to two blocks that meet through global memory, which narrow
# rows do not pay for (H100, bf16: 0.607 at 896, unfused 0.821; 0.862 / 0.824 at 1536, 0.91-1.00 from 2048).
FUSED_ADD_SPLIT_MIN_BYTES = 3 * 1024
FUSED_ADD_BWD_KERNEL = "cutile_norms.triton.add_rmsnorm_bwd:add_rms_norm_bwd"
FUSED_ADD_BWD_MAX_N = 8192  # Triton's fused backward holds h, dy, dh and its dw accumulator in registers
FUSED_ADD_MAX_N, FUSED_ADD_FP32_WEIGHT_MAX_N = 32768, 16384
ENV_FUSED = "CUTILE_NORMS_FUSED"


def fused_enabled() -> bool:
    """CUTILE_NORMS_FUSED=0 switches the fused kernels off (the add unfused, FP8 in torch ops); read at every call."""
    return os.environ.get(ENV_FUSED, "1").strip().lower() not in ("0", "false", "no", "off")


def _fused_off(norm_mode: str, dev: DeviceInfo) -> str | None:
    """Why no fused residual kernel runs at any width: mode torch, the switch, or the CPU (Triton's
    interpreter rounds fp32 to bf16 by truncation: h would be off by an ulp)."""
    return ("mode torch: the reference's ops" if norm_mode == "torch" else
            f"the fused kernels are switched off ({ENV_FUSED}=0)" if not fused_enabled() else
            "off the GPU the add runs unfused (Triton's interpreter does not round h as the GPU does)"
            if dev.vendor == "cpu" else None)


def residual_add_kernel(mode_name: str | None, norm_mode: str, N: int, elem_bytes: int, dev: DeviceInfo,
                        tools: Toolchain, cute_refusal: Callable[[], str | None] = lambda: "tensors not checked",
                        fp32_weight: bool = False) -> tuple[str | None, str]:
    """(the fused add + norm forward kernel, "module:function", and why it runs) for a call that asked
    for `mode_name`, whose norm `resolve` gave as `norm_mode`, with rows of N elements whose widest
    operand (x, the residual or h) has elem_bytes-byte elements; or (None, why the add runs unfused).
    `cute_refusal()`: why the CuTe DSL fused forward does not take these tensors (its `unsupported`), asked
    only where that kernel would run (a caller that passes none never gets it); `fp32_weight`: an fp32 weight."""
    if off := _fused_off(norm_mode, dev):
        return None, off
    cute_too = not mode_name and fp32_weight and elem_bytes == 2 and FUSED_ADD_FP32_WEIGHT_MAX_N < N <= FUSED_ADD_MAX_N
    if mode_name == "tma_smem_cached" or cute_too:
        why = unavailable_reason(MODES["tma_smem_cached"], dev, tools) or cute_refusal()
        if not why or not cute_too:  # (named: its refusal is the answer; mode=None: refused, the split kernel)
            return (None, why) if why else (FUSED_ADD_CUTE_KERNEL, "CuTe DSL, x's and r's row tiles in shared memory "
                                            + (f"(N > {FUSED_ADD_FP32_WEIGHT_MAX_N}, fp32 weight)" if cute_too
                                               else "(mode 'tma_smem_cached')"))
    cutile_named = mode_name is not None and MODES[mode_name].dsl == "cutile"
    split_first = fp32_weight and mode_name is None and not unavailable_reason(MODES["multi_wave_cached"], dev, tools)
    limit = FUSED_ADD_FP32_WEIGHT_MAX_N if split_first else FUSED_ADD_MAX_N
    if N <= limit and not cutile_named:
        if mode_name not in (None, "triton"):
            return None, f"mode {mode_name!r}: no fused kernel of its own"
        why = unavailable_reason(MODES["triton"], dev, tools)
        return (None, why) if why else (FUSED_ADD_KERNEL, f"Triton, the row in registers (N <= {limit})")
    if mode_name is not None and not cutile_named:
        return None, (f"mode {mode_name!r}: rows past {limit} elements fuse in cuTile's split kernel "
                      "(mode None or a cuTile mode)")
    from .cutile.add_rmsnorm_fwd_config import MAX_ROW_BYTES  # (pure Python)
    # (FUSED_ADD_SPLIT_MIN_BYTES is above the split kernel's own floor, add_rmsnorm_fwd_config.MIN_N)
    if cutile_named and N * elem_bytes < FUSED_ADD_SPLIT_MIN_BYTES:
        return None, (f"mode {mode_name!r}: rows under {FUSED_ADD_SPLIT_MIN_BYTES} bytes run the add unfused (cuTile's "
                      "split kernel measured behind there)")
    if N * elem_bytes > MAX_ROW_BYTES:
        return None, (f"the split kernel holds rows of up to {MAX_ROW_BYTES} bytes of its widest operand, "
                      f"N={N} of {elem_bytes}-byte elements")
    why = unavailable_reason(MODES["multi_wave_cached"], dev, tools)
    return (None, why) if why else (FUSED_ADD_SPLIT_KERNEL, "cuTile, the row split over blocks " + (
        f"(mode {mode_name!r})" if cutile_named else f"(N > {limit}" + (", an fp32 weight)" if fp32_weight else ")")))


BWD_FUSED, BWD_DH_INSIDE, BWD_DH_AFTER = "fused", "inside", "after"  # residual_backward's answers


# mode=None's residual backward by rows of h: Triton's fused kernel up to FUSED_ADD_BWD_TRITON_BYTES, the
# norm's backward reading dh above (the cuTile persistent kernel where the norm's table runs Triton's, which
# adds dh after). bf16, 4 M N e bytes over a same-run copy, medians of 3 (python bench/residual.py --parts
# backward --modes multi_wave_cached, 2026-11-26), Triton's fused / the cuTile kernel with dh:
#   H100: 896 0.947 / 0.824, 1024 0.957 / 0.866; 1152 0.822 / 0.828, 1536 0.898 / 0.997, 2560 0.887 / 0.992,
#         3584 0.858 / 1.001, 5120 0.862 / 0.953, 6144 0.901 / 0.843, 7168 0.851 / 0.821, 8192 0.936 / 0.988;
#   H200: 896 0.863 / 0.717, 1024 0.890 / 0.774; 1536 0.796 / 0.873, 2024 0.566 / 0.860, 2560 0.760 / 0.995,
#         3584 0.745 / 0.699, 5120 0.734 / 0.919, 6144 0.785 / 0.763, 7168 0.749 / 0.873, 8192 0.858 / 0.955.
# Narrow rows hold too few bytes per cuTile tile; from 2 KiB the cuTile kernel's worst case is the better
# one on both GPUs (0.821 against 0.822 on the H100, 0.699 against 0.566 on the H200), as for the norm's
# own backward its configs hold at the measured widths and less between them (3584, 6144-7168).
# Rows a GPU model's rule gives Triton's TMA rows kernel with dh (the H200: 520-1456 columns, 6144-8192; evidence in
# triton/rmsnorm_bwd_config.py: 896 0.955, 6144 0.951, 7168 0.969) run Triton's fused form, dh read by TMA.
FUSED_ADD_BWD_TRITON_BYTES = 2 * 1024


def residual_backward(mode_name: str | None, choice: Choice, N: int, elem_bytes: int, dev: DeviceInfo,
                      tools: Toolchain, has_dh: bool = True, by_tma: bool = True) -> tuple[str, str, str]:
    """(how, the backward's mode, why) the residual add's backward runs for a call that asked for `mode_name`, whose
    norm `resolve` gave as `choice`, rows of N elements of h of elem_bytes. The grad into h is the norm's backward on
    h plus dh (its later uses' grad): dy, h and dh read once and one grad written move 4 M N e bytes, the norm's
    backward then an add 6. BWD_FUSED: Triton's kernel (FUSED_ADD_BWD_KERNEL); BWD_DH_INSIDE: the mode's backward
    kernel reads dh with the row (BackwardBackend.adds_dh); BWD_DH_AFTER: an add after it (has_dh False: none).
    by_tma False: the call's tensors are not ones Triton's TMA rows form takes (its tensors_take_tma)."""
    bwd_mode = "torch" if choice.mode == "torch" else choice.dh_backward_mode
    off = _fused_off(choice.mode, dev)
    if off or bwd_mode == "torch":  # no dh read: the norm's own backward (without dh)
        norm_mode = "torch" if choice.mode == "torch" else choice.backward_mode
        return BWD_DH_AFTER, norm_mode, off or "the reference's backward"
    triton_fits = (mode_name in (None, "triton") and N <= FUSED_ADD_BWD_MAX_N
                   and not unavailable_reason(MODES["triton"], dev, tools))
    why_triton = f"Triton, the row in registers (N <= {FUSED_ADD_BWD_MAX_N})"
    if triton_fits and has_dh and by_tma and fused_bwd_tma_rows(N, elem_bytes, dev):
        return BWD_FUSED, bwd_mode, f"Triton's TMA rows kernel reading dh ({dev.name}'s rule, N={N})"
    if triton_fits and (mode_name == "triton" or N * elem_bytes <= FUSED_ADD_BWD_TRITON_BYTES):
        return BWD_FUSED, bwd_mode, why_triton + f", to {FUSED_ADD_BWD_TRITON_BYTES} bytes a row" * (mode_name is None)
    if (mode_name is None and not backward_backend(bwd_mode).adds_dh
            and not unavailable_reason(MODES["multi_wave_cached"], dev, tools)):
        bwd_mode = "multi_wave_cached"  # the cuTile persistent backward, which reads dh (measured above)
    if backward_backend(bwd_mode).adds_dh:  # (no dh to read: the norm's own backward, chosen without dh)
        return ((BWD_DH_INSIDE, bwd_mode, f"{bwd_mode}'s backward kernel reads dh with the row") if has_dh else
                (BWD_DH_AFTER, choice.backward_mode, "no dh: h has no later use"))
    if triton_fits:
        return BWD_FUSED, bwd_mode, why_triton
    return BWD_DH_AFTER, bwd_mode, f"{bwd_mode}'s backward kernel does not read dh"
