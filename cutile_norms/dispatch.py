"""The one place that decides which kernel runs.

`MODES` maps every mode name to its implementation and to what it needs (vendor, arch, DSL); a mode
that cannot run says why. `mode=None` picks the forward from the measured tables in
`tuning/rmsnorm_fwd.json` (one per GPU model that was measured on its own, e.g. "sm_90/H200", else
the arch's; written by `python bench/rmsnorm.py --write-table` by FORWARD_RULE below) and the backward
from BACKWARD_TABLE and cute_backward_refusal, never an experimental or unbuilt kernel. A GPU with no
table of its own borrows its arch's (or the nearest measured arch's) and warns once; where no table
applies, Triton runs if it can, else (CPU) the reference. `explain()` prints the decision, the table
and row used and their evidence.
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
from ._platform import DeviceInfo, Toolchain, table_key, triton_interpreted
from .backends import BackwardBackend, ForwardBackend

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
    path = MODES[mode_name].bwd_backend
    if path is None:
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
    """mode=None: the measured mode for (GPU model, dtype, N), the same for every M (a row's result
    never depends on the batch it comes in: see FORWARD_RULE); where nothing is measured or what is
    measured cannot run here (AMD, NVIDIA below sm_90, cuTile missing) the Triton kernels; the
    reference on CPU tensors or where Triton cannot run either."""
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
            return _with_best_backward(Choice(mode.name, why), dev, tools, backward_row(key, dname, N))
    return _fallback(dev, tools, f"the measured table {key} has no row for {dname}, N={N}, M={M}{borrowed}")


# FORWARD_RULE, how `python bench/rmsnorm.py --write-table` turns a sweep into rows (forward_table.py,
# band_rows): the widths are cut into bands of row bytes at FORWARD_BAND_EDGES, and each band takes
# the mode whose worst ratio to a copy over every width measured in it (the widths real models use
# and the random ones of that run) is the highest, for every M. Why bands and not the nearest
# measured width: inside a band the kernels keep their shape (tma_smem_cached holds a row in one
# CTA up to 48 KiB and in a cluster of 4 up to 64 KiB; beyond, clusters of 5-16 CTAs whose last slice
# may be part empty, which measured 0.74-0.83 x copy at N = 98368 and 36568 on an H100 where the
# powers of two gave 0.975-0.998), so a mode that holds at a band's measured widths holds between
# them; the nearest-width rule put modes measured within 0.1 % of each other in alternate ranges and
# missed the widths between the sweep's (H200, N = 10240-28672: 0.70-0.89 x copy). One mode per
# width for every M: rows are bit-identical whatever the batch (tests/test_batch_invariance.py),
# and at M <= 64, where a call is host bound, the modes' GPU times differ by tenths of a microsecond
# while tma_smem_cached's host path is the cheapest (bench/decode.py).
# The edges are where tma_smem_cached changes shape (cute/rmsnorm_fwd_config.py): a row in one CTA up
# to 48 KiB, over a cluster of 4 CTAs to 64 KiB, over clusters of 5-16 beyond. The 48 KiB edge
# matters on an H200: the cluster of 4 measured 0.77-0.93 x copy at eight bf16 widths in 48-64 KiB
# (24736 ... 32768, six of them random) where multi_wave_cached held 0.95-0.99, while one CTA held
# 0.96-1.0 below; on an H100 the cluster of 4 held 0.95-1.0 there and multi_wave_cached 0.995-1.01.
# The H100's fp32 rows were written before that edge; they run tma_smem_cached on both sides of it
# (fp32 N = 13000 / 15000 / 16384: 1.007 / 1.007 / 1.006 there, multi_wave_cached 1.003 / 1.008 / 1.007).
FORWARD_BAND_EDGES = (48 * 1024, 64 * 1024)


@dataclass(frozen=True)
class BackwardRow:
    """A band of row bytes where mode=None's backward is another mode's than the cuTile persistent
    kernel (`table`: a measured table's key, as table_key gives it)."""
    table: str
    dtypes: tuple[str, ...]
    bytes_min: int
    bytes_max: int
    mode: str
    evidence: str


# mode=None's backward: the cuTile persistent kernel, except where another mode's backward measured
# ahead of it in the same run. The cuTile backward's configs are measured at the sweep's widths and
# scaled to the nearest (cutile/rmsnorm_bwd.py), which holds at the powers of two (0.94-0.97 x copy)
# and not between them (H100 bf16, N = 12288 / 20480 / 24576 / 28672: 0.849 / 0.561 / 0.838 / 0.865).
# The CuTe DSL kernel exchanges a row's sum through a cluster's shared memory and holds from 24 KiB
# rows: 0.89-0.97 at 12288-262144 where its slices tile the row exactly (the config takes such a
# tiling where one exists: cute/rmsnorm_bwd_config.py, exact_tiling), 0.82-0.94 where the last slice
# is part empty (its columns past the row are zeros in shared memory: no predicated loads), against
# the cuTile kernel's 0.56-0.86 at those widths. One mode for the whole band: its worst case is the
# better one (18112, where the cuTile kernel's scaled config happens to hold, 0.900 against 0.932).
CUTE_BWD_MIN_BYTES = 24 * 1024  # narrower 16-bit rows: the cuTile backward (see BACKWARD_TABLE's evidence)
BACKWARD_TABLE = (
    BackwardRow("sm_90", ("bfloat16", "float16"), 1, 3 * 1024, "triton",
                "H100 80GB HBM3 2026-11-24/25, bf16, Triton's backward against the cuTile persistent kernel: "
                "N=128 0.936 / 0.957, 512 0.937 / 0.945, 896 0.933 / 0.783, 1024 0.933 / 0.955, 1536 0.912 / "
                "0.870 x copy: the better worst case (the cuTile kernel's configs hold at the powers of two "
                "they were measured at, not between); python bench/probe/model_widths.py --only bwd, "
                "python bench/rmsnorm.py --modes triton"),
    BackwardRow("sm_90", ("bfloat16", "float16"), 12289, 16383, "triton",
                "H100 80GB HBM3 2026-11-25, bf16 N=6144 / 7168: triton 0.932 / 0.952 x copy, the cuTile "
                "persistent kernel 0.911 / 0.884; python bench/probe/model_widths.py --only bwd"),
    BackwardRow("sm_90", ("bfloat16", "float16"), CUTE_BWD_MIN_BYTES, 512 * 1024, "tma_smem_cached",
                "H100 80GB HBM3 2026-11-25, bf16, the CuTe DSL backward against the cuTile persistent kernel: "
                "N=12288 0.912 / 0.850, 14336 0.925 / 0.868, 16384 0.919 / 0.943, 18432 0.892 / 0.932, "
                "20480 0.890 / 0.563, 24576 0.942 / 0.838, 28672 0.940 / 0.865, 40960 0.953 / 0.514, "
                "49152 0.943 / 0.810, 65536 0.971 / 0.923, 131072 0.957 / 0.893, 262144 0.937 / 0.797 x copy; "
                "rows whose last slice is part empty: N=19336 0.824 / 0.720, 36392 0.878 / 0.653, 58680 0.914 / "
                "0.862, 135688 0.925 / 0.563, 193488 0.940 / 0.727 (18112 0.900 / 0.932): the better worst "
                "case; python bench/probe/model_widths.py --only bwd"),
    # An H200's own rows: the same bands as the H100's, each re-measured there (the cuTile kernel with
    # the H200's config table, the CuTe one with its 3-slot ring: cute/rmsnorm_bwd_config.py, DEEP_RING)
    # To 4 KiB rows (not the H100's 3 KiB): from 1537 columns Triton's 16 values per thread (its NARROW_16
    # rule) kept it ahead of the cuTile kernel's configs, which hold at 2048 (a measured width) and not
    # between 1024 and it.
    BackwardRow("sm_90/H200", ("bfloat16", "float16"), 1, 4094, "triton",
                "NVIDIA H200 2026-11-26, bf16, Triton's backward against the cuTile persistent kernel (medians "
                "of 3): N=768 0.830 / 0.727, 896 0.879 / 0.636, 1000 0.895 / 0.736, 1048 0.762 / 0.508, 1128 "
                "0.787 / 0.515, 1280 0.827 / 0.737, 1400 0.841 / 0.686, 1536 0.870 / 0.792, 1664 0.858 / 0.710, "
                "1816 0.872 / 0.837; at 2048 the cuTile kernel (0.975 / 0.912); python "
                "bench/probe/model_widths.py --only bwd --random 0 --ns 768,...,1816 --kernels "
                "None,triton,cutile,quack, python bench/tune/cutile_rmsnorm_bwd.py"),
    BackwardRow("sm_90/H200", ("bfloat16", "float16"), 12289, 16 * 1024, "triton",
                "NVIDIA H200 2026-11-26, bf16 N=7168 / 8192: triton 0.887 / 0.914 x copy, the cuTile persistent "
                "kernel 0.749 / 0.897 (its sweep's best 0.753 / 0.893), while at 6144 the cuTile kernel's H200 "
                "config measured 0.901 against 0.842; same commands"),
    BackwardRow("sm_90/H200", ("bfloat16", "float16"), CUTE_BWD_MIN_BYTES, 512 * 1024, "tma_smem_cached",
                "NVIDIA H200 2026-11-26, bf16, the CuTe DSL backward with 3 ring slots against the cuTile "
                "persistent kernel: N=12288 0.876 / 0.847 (the cuTile sweep's best), 18432 0.863 / 0.816, "
                "24576 0.924 / 0.676, 28672 0.900 / 0.706, 42528 0.846 / 0.520, 65536 0.964 / 0.782 "
                "(python bench/tune/cute_rmsnorm_bwd.py); with 2 slots, 20480-262144: 0.61-0.97 against "
                "0.44-0.83 (probe, same seed)"),
)


def cute_backward_refusal(N: int, dtype: torch.dtype) -> str | None:
    """Why the CuTe DSL backward does not take rows of N `dtype` elements (whatever their alignment),
    or None. This is where tma_smem_cached's backward is decided, for mode=None and for the mode
    asked for by name: the cuTile persistent backward takes every other row."""
    from .cute.rmsnorm_bwd_config import analytic_config

    if dtype == torch.float32:
        return "fp32 rows: the cuTile backward measured ahead"
    if N * dtype.itemsize < CUTE_BWD_MIN_BYTES:
        return f"rows under {CUTE_BWD_MIN_BYTES // 1024} KiB: the cuTile backward measured ahead"
    cfg = analytic_config(N, dtype.itemsize)
    if N % (16 // dtype.itemsize) or cfg is None:
        return f"the CuTe DSL backward does not take N={N}"
    return None


def backward_row(key: str | None, dtype_name: str, N: int) -> BackwardRow | None:
    """BACKWARD_TABLE's row for this table key (a model's, else its arch's), dtype and width."""
    dtype = getattr(torch, dtype_name)
    rows = [r for r in BACKWARD_TABLE if dtype_name in r.dtypes]
    table = key if any(r.table == key for r in rows) else (key or "").split("/")[0]
    return next((r for r in rows if r.table == table and r.bytes_min <= N * dtype.itemsize <= r.bytes_max
                 and (r.mode != "tma_smem_cached" or cute_backward_refusal(N, dtype) is None)), None)


def _with_best_backward(choice: Choice, dev: DeviceInfo, tools: Toolchain, row: BackwardRow | None = None) -> Choice:
    """mode=None: the forward table picks the forward only. `row` (BACKWARD_TABLE's, for this table,
    dtype and N): that mode's backward runs where it can. Else, where the forward has a backward of its
    own (triton) and the cuTile persistent backward can run, that one runs behind autograd: on an H100
    it measured ahead of Triton's at every other width and dtype (bf16 0.945-0.976 x copy against
    0.888-0.954 to 16384 and 0.80-0.94 against 0.75-0.86 beyond; fp32 N=16384 0.98 against 0.82;
    docs/design.md). tma_smem_cached's own backward is
    the CuTe DSL kernel only where cute_backward_refusal says so."""
    if row is not None and unavailable_reason(MODES[row.mode], dev, tools) is None:
        if choice.backward_mode == row.mode:
            return choice
        return Choice(choice.mode, f"{choice.reason}; backward: {row.mode}'s ({row.evidence})", bwd_mode=row.mode)
    if choice.mode == "tma_smem_cached" or MODES[choice.mode].bwd_backend not in (None, _CUTILE_BWD, _CUTE_BWD):
        if unavailable_reason(MODES["multi_wave_cached"], dev, tools) is None:
            return Choice(choice.mode, choice.reason + "; backward: the cuTile persistent kernel (measured ahead "
                          f"of {choice.mode}'s at this width)", bwd_mode="multi_wave_cached")
    return choice


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
    refusal = cute_backward_refusal(N, dtype) if mode.name == "tma_smem_cached" else None
    if refusal:
        return Choice(mode.name, f"asked for explicitly; backward: the cuTile persistent kernel ({refusal})",
                      bwd_mode="multi_wave_cached")
    return Choice(mode.name, "asked for explicitly")


# The residual add (rms_norm(..., residual=r)): fused into the norm (x and r read once, h and y
# written once: 4 M N e bytes for 16-bit x, r and h) by
#   * Triton's kernel, the row in registers, for rows of up to FUSED_ADD_MAX_N elements (mode None or
#     "triton"): 0.98-1.02 x a copy of its bytes at 1664-16384 on an H200, 1.004-1.023 at 896-16384 on
#     an H100 (bf16), where its two-pass form for wider rows ran 0.60-0.85;
#   * cuTile's split kernel for wider rows (mode None or a cuTile mode), each row split over blocks that
#     keep a power-of-two part of at most 16 KiB of x, r and h each on chip, as the norm's split forward
#     does: 0.955-0.985 at 12288-131072 on an H200, 0.996-1.006 at 18432-262144 on an H100 (bf16), against
#     the unfused path's 0.81. A part is 4097-8192 columns of 16-bit operands (2049-4096 where one is
#     fp32) whatever N is, so the rule holds between the measured widths; rows past
#     add_rmsnorm_fwd_config.MAX_ROW_BYTES of their widest operand would need wider parts;
# everywhere else (CUTILE_NORMS_FUSED=0, another mode, a DSL that does not run here) the add runs as one
# torch.add into h before the norm kernel `resolve` picks for h (5 M N e bytes: 0.81-0.83). The backward:
# Triton's fused kernel where the forward's is Triton's and rows have up to FUSED_ADD_BWD_MAX_N elements,
# else the norm's backward kernel on h, then the grad flowing into h from later layers added.
# (`python bench/residual.py`, docs/performance.md 2.7 and 2.15.)
FUSED_ADD_KERNEL = "cutile_norms.triton.add_rmsnorm_fwd:add_rms_norm_fwd"
FUSED_ADD_SPLIT_KERNEL = "cutile_norms.cutile.add_rmsnorm_fwd:add_rms_norm_fwd"
FUSED_ADD_BWD_KERNEL = "cutile_norms.triton.add_rmsnorm_bwd:add_rms_norm_bwd"
# The fused backward (the norm's grad plus dh in one pass: reads dy, h, dh, writes one grad, 4 M N e
# bytes where the norm's backward then an add move 6) holds h, dy, dh and its dw accumulator in
# registers: rows of up to 8192 elements; wider rows take the norm's backward kernel and an add.
FUSED_ADD_BWD_MAX_N = 8192
FUSED_ADD_MAX_N = 16384
ENV_FUSED = "CUTILE_NORMS_FUSED"


def fused_enabled() -> bool:
    """CUTILE_NORMS_FUSED=0 switches the fused kernels off (the residual add runs unfused, the FP8 output
    in torch ops); read at every call."""
    return os.environ.get(ENV_FUSED, "1").strip().lower() not in ("0", "false", "no", "off")


def residual_add_kernel(mode_name: str | None, norm_mode: str, N: int, elem_bytes: int, dev: DeviceInfo,
                        tools: Toolchain) -> tuple[str | None, str]:
    """(the fused add + norm forward kernel, "module:function", and why it runs) for a call that asked
    for `mode_name`, whose norm `resolve` gave as `norm_mode`, with rows of N elements whose widest
    operand (x, the residual or h) has elem_bytes-byte elements; or (None, why the add runs unfused
    before that mode's norm kernel)."""
    if norm_mode == "torch":
        return None, "mode torch: the reference's ops"
    if not fused_enabled():
        return None, f"the fused kernels are switched off ({ENV_FUSED}=0)"
    if dev.vendor == "cpu":  # Triton's interpreter rounds fp32 to bf16 by truncation: h would be off by an ulp
        return None, "off the GPU the add runs unfused (Triton's interpreter does not round h as the GPU does)"
    if N <= FUSED_ADD_MAX_N:
        if mode_name not in (None, "triton"):
            return None, (f"mode {mode_name!r}: rows of up to {FUSED_ADD_MAX_N} elements fuse in Triton's kernel "
                          "(mode None or 'triton')")
        why = unavailable_reason(MODES["triton"], dev, tools)
        return (None, why) if why else (FUSED_ADD_KERNEL, f"Triton, the row in registers (N <= {FUSED_ADD_MAX_N})")
    if mode_name is not None and MODES[mode_name].dsl != "cutile":
        return None, (f"mode {mode_name!r}: rows past {FUSED_ADD_MAX_N} elements fuse in cuTile's split kernel "
                      "(mode None or a cuTile mode)")
    from .cutile.add_rmsnorm_fwd_config import MAX_ROW_BYTES  # (pure Python; imported where rows are this wide)

    if N * elem_bytes > MAX_ROW_BYTES:
        return None, (f"the split kernel holds rows of up to {MAX_ROW_BYTES} bytes of its widest operand, "
                      f"N={N} of {elem_bytes}-byte elements")
    why = unavailable_reason(MODES["multi_wave_cached"], dev, tools)
    return (None, why) if why else (FUSED_ADD_SPLIT_KERNEL, f"cuTile, the row split over blocks (N > {FUSED_ADD_MAX_N})")


def residual_backward_unfused(mode_name: str | None, norm_mode: str, N: int, dev: DeviceInfo,
                              tools: Toolchain) -> str | None:
    """None where the fused add + norm backward runs, else why the norm's backward and an add of dh do."""
    # (the operands' width matters only past FUSED_ADD_MAX_N, where the backward is unfused anyway: 4 bytes)
    kernel, why = residual_add_kernel(mode_name, norm_mode, N, 4, dev, tools)
    if kernel is None:
        return why
    if N > FUSED_ADD_BWD_MAX_N:
        return f"the fused backward holds rows of up to {FUSED_ADD_BWD_MAX_N} elements in registers, N={N}"
    return None
