"""Seeded fuzz of `rms_norm`, forward and backward (through autograd), against the fp64 closed form.

Contract under test (cutile_norms/rmsnorm.py): for any valid input (x [..., N] in fp16/bf16/fp32 with any
leading dims and row stride, weight [N] in x's dtype or fp32 or None, offset only with a weight, eps > 0)
every mode returns y in x's shape and dtype, and autograd gives dx in x's dtype and shape and dw in the
weight's dtype, all finite and within tolerance of the fp64 reference. Where an explicit mode truly cannot
take a shape it raises ValueError / NotImplementedError with a message (a deliberate `raise` in
cutile_norms; recorded, printed and warned as FuzzRefusal, and mode=None must not pick that mode there);
mode=None never raises on valid input. Anything else (TypeError, a kernel's RuntimeError, a CUDA error,
OverflowError, a cuTile compile error) fails the case.

Seed: CUTILE_NORMS_FUZZ_SEED, else one drawn at import (tests/run_sharded.py exports one for all its
processes; without it each process draws its own and says so). Every case is built from (seed, index)
alone, so a failure's one-line message is its own replay command:
    CUTILE_NORMS_FUZZ_SEED=123 pytest 'tests/test_fuzz.py::test_fuzz_gpu[417]'  # mode=... x=...: error
CUTILE_NORMS_FUZZ_CASES sets how many GPU cases run (default 2000); case i is the same for any count.

Widths, the trade-off: the issue asks for every N in 1..1100, 2^k - 1 / 2^k / 2^k + 1 up to 2^18 and
random N up to 300,000, but every distinct N compiles new cuTile kernels (~0.3-1 s each, per mode, dtype,
weight and grad combination), and the GPU fuzz must finish in ~3-4 minutes on 12 processes of an H100
machine. So one run draws a pool of ~80 widths from the seed (40 from 1..1100, 25 of the 2^k +- 1 edges,
15 log-uniform in 1101..300,000) and each case draws its N from the pool: one run goes deep on 80 widths
(many shapes, dtypes and modes each), and the widths change from run to run, so seeded runs over time
cover the whole range. The CPU variant (mode "torch" and None, which picks torch on CPU) runs the same
generator on M * N <= 2^16 for CI, and checks that the GPU modes refuse CPU tensors with a ValueError.

M: mostly log-uniform in 1..4096, sometimes up to 2^20 rows, always M * N <= 2^24 (time and memory: 12
processes share one GPU), rarely 0; x sometimes 1-D, 3-D or 4-D. Layouts: contiguous, a column slice of
a wider tensor (row stride N + pad, sometimes an odd start), a transposed view (last-dim stride != 1).
Backward: loss = (y.float() * g).sum(), y.backward(dy) with dy dense / expanded (stride 0) / a column
slice / transposed, or y.sum(); grads of x and w, or of one of them. ~30% of cases are forward only
(no_grad, inference_mode, or nothing requiring grad). One case past M * N = 2^32 (bf16, N = 8192) runs
alone as test_fuzz_past_int32_gpu (marked big), checked row chunk by row chunk in fp64.

Tolerances: y per conftest.TOLERANCES (elementwise); dx and dw as tests/cutile/test_rmsnorm_bwd.py's
assert_grad_close (rtol * |ref| + atol + 2^-16 * the magnitude of the terms each element sums, so dw's
bound grows with M); and for all three an L2 bound, ||err|| <= 1.5 u ||ref|| (u: the output dtype's unit
roundoff; 1e-5 for fp32) plus the same magnitude terms, tighter than the elementwise rtol, so a kernel
that is a little wrong everywhere fails. Where the exact value is at the edge of fp16's range (dx of a
row of tiny values with a tiny eps), inf of the right sign is accepted.

The residual add (test_fuzz_residual_cpu / _gpu, 60 and 300 cases from the same seed): a mode, fused
(the fused kernels on, CUTILE_NORMS_FUSED=1) or not, x / residual / h / weight dtypes, offset, rows sliced from a
wider tensor, in place or differentiated in a random subset of x, the residual and the weight, with or
without a grad flowing into h; h checked bit for bit (one ulp for bf16 under Triton's interpreter, which
truncates), y and the grads by tests/test_residual.py's oracles.

The FP8 output (test_fuzz_fp8_cpu / _gpu, 40 and 300 cases): mode None, "triton" (the kernel on the
GPU) or another mode (the torch ops), x / weight dtypes, offset, a residual and h's dtype or none, e4m3 or
e5m2, a given scale (saturating or not) or per-token (with an upper bound or not) or 1 x g group scales
(g = 32, 64, 128; row- or column-major), UE8M0 or not, sliced rows, rows of zeros, large values, inf and
NaN; q within one fp8 step of the fp64 norm divided by the returned scales (NaN exactly where that is),
the scales against the fp64 amax, h bit for bit.
"""
from __future__ import annotations

import linecache
import math
import os
import random
import secrets
import warnings
from dataclasses import dataclass

import pytest
import torch

import cutile_norms as cn
from cutile_norms import dispatch
from cutile_norms._platform import triton_interpreted
from tests.conftest import TOLERANCES, random_rows, random_weight, reference64

SEED_VAR = "CUTILE_NORMS_FUZZ_SEED"
CASES_VAR = "CUTILE_NORMS_FUZZ_CASES"
SEED = int(os.environ.get(SEED_VAR) or secrets.randbits(31))
N_GPU_CASES = int(os.environ.get(CASES_VAR) or 2000)
N_CPU_CASES = 200

GPU_MODES = tuple(m for m in dispatch.modes_of() if m != "torch")
# the GPU modes that refuse CPU tensors: all but triton while Triton's interpreter is on (the CPU CI),
# where triton runs on the CPU and joins the CPU cases
CPU_INTERPRETED = ("triton",) if triton_interpreted() else ()
REFUSE_CPU = tuple(m for m in GPU_MODES if m not in CPU_INTERPRETED)
DTYPE_PAIRS = ((torch.bfloat16, torch.bfloat16), (torch.float16, torch.float16), (torch.float32, torch.float32),
               (torch.bfloat16, torch.float32), (torch.float16, torch.float32))
EPSILONS = (1e-6, 1e-5, 1e-12, 0.1)
GPU_MAX_ELEMS = 1 << 24
CPU_MAX_ELEMS = 1 << 16

SHORT = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
# L2 bound on the error relative to the reference's norm: 1.5 x the unit roundoff of the output dtype
# (rounding an fp32 result once is <= u per element), fp32: half the elementwise rtol
L2_RTOL = {torch.bfloat16: 1.5 * 2.0 ** -8, torch.float16: 1.5 * 2.0 ** -11, torch.float32: 1e-5}
SCALE_TOL = 2.0 ** -16  # fp32 rounding of the kernels' sums, relative to the magnitude of their terms
# Triton's interpreter (the CPU CI's triton cases) converts fp32 to 16-bit types by truncation, not
# rounding to nearest: errors up to 2u, all toward zero, so the L2 bound there is twice the GPU's
# (CUTILE_NORMS_FUZZ_SEED=712029627 test_fuzz_cpu[29], triton bf16 N = 1: 1.6u on one element)
INTERPRETER_L2_FACTOR = 2.0

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
THIS_FILE = os.path.relpath(os.path.abspath(__file__), _ROOT)
_PACKAGE_DIR = os.path.dirname(os.path.abspath(cn.__file__))


class FuzzRefusal(UserWarning):
    """An explicit mode refused a valid case with a clear error (allowed; listed in pytest's warning summary)."""


# ================================================================================================
# The cases: built from (seed, index) alone
# ================================================================================================
def width_pool(seed: int) -> list[int]:
    """The run's ~80 widths (see the module docstring for why a pool)."""
    rng = random.Random(f"{seed}/widths")
    narrow = rng.sample(range(1, 1101), 40)
    edges = rng.sample(sorted({(1 << k) + d for k in range(1, 19) for d in (-1, 0, 1)}), 25)
    wide = [_log_uniform(rng, 1101, 300_000) for _ in range(15)]
    return sorted(set(narrow + edges + wide))


def _log_uniform(rng: random.Random, lo: int, hi: int) -> int:
    return min(hi, max(lo, int(math.exp(rng.uniform(math.log(lo), math.log(hi + 1))))))


def _divisors(n: int) -> list[int]:
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


@dataclass(frozen=True)
class Case:
    test: str  # the test function that runs it (for the replay line)
    index: int
    device: str
    mode: str | None
    lead: tuple  # x's leading dims (prod = M; () for a 1-D x)
    N: int
    x_dtype: torch.dtype
    w_dtype: torch.dtype | None  # None: no weight
    offset: float
    eps: float
    layout: str  # "contiguous" | "rows" (column slice of a wider tensor) | "transposed" (last-dim stride != 1)
    pad: int  # "rows": the wider tensor has N + pad columns
    col0: int  # "rows": x starts at this column
    w_stride: int  # the weight is a view with this stride
    scale: float  # magnitude of x's values (times a random per-row scale)
    zero_rows: bool  # a few rows of x are all zero (rms = sqrt(eps))
    grads: str  # "" forward only, else which of "x", "w" require grad
    no_grad: str  # forward only: "no_grad" | "inference_mode" | "plain" (grad on, nothing requires it)
    dy: str  # "loss" | "dense" | "expanded" | "strided" | "transposed" | "sum"
    torch_seed: int

    @property
    def M(self) -> int:
        return math.prod(self.lead)

    @property
    def shape(self) -> tuple:
        return tuple(self.lead) + (self.N,)

    def describe(self) -> str:
        w = "none" if self.w_dtype is None else SHORT[self.w_dtype] + (f"[::{self.w_stride}]" if self.w_stride > 1 else "")
        layout = self.layout
        if layout == "rows":
            layout = f"rows(stride {self.N + self.pad}, col0 {self.col0})"
        run = f"fwd+bwd grads={self.grads} dy={self.dy}" if self.grads else f"fwd only ({self.no_grad})"
        return (f"mode={self.mode} x={SHORT[self.x_dtype]}{list(self.shape)} (M={self.M}, N={self.N}) w={w} "
                f"offset={self.offset} eps={self.eps} layout={layout} scale={self.scale:g}"
                f"{' zero_rows' if self.zero_rows else ''} {run}")

    def repro(self) -> str:
        return replay_line(f"{self.test}[{self.index}]")


def replay_line(test_id: str) -> str:
    env = f"{SEED_VAR}={SEED}"
    if os.environ.get(CASES_VAR):
        env += f" {CASES_VAR}={os.environ[CASES_VAR]}"
    return f"{env} pytest '{THIS_FILE}::{test_id}'"


def make_case(seed: int, test: str, index: int, device: str, pool: list[int], modes: tuple,
              max_elems: int) -> Case:
    rng = random.Random(f"{seed}/{test}/{index}")
    mode = modes[index % len(modes)]  # round robin: every mode gets the same share of the cases
    N = rng.choice(pool)
    r = rng.random()
    if r < 0.01:
        M = 0
    else:
        M = _log_uniform(rng, 1, 4096) if r < 0.86 else _log_uniform(rng, 4096, 1 << 20)
        M = min(M, max(1, max_elems // N))
    r = rng.random()
    if M == 1 and r < 0.1:
        lead = ()  # a 1-D x
    elif M == 0:
        lead = (0,) if r < 0.5 else (rng.randint(1, 5), 0)
    elif r < 0.3:
        lead, rest = [], M
        for _ in range(rng.choice((2, 3)) - 1):  # 3-D or 4-D x
            lead.append(rng.choice(_divisors(rest)))
            rest //= lead[-1]
        lead = tuple(lead) + (rest,)
    else:
        lead = (M,)
    x_dtype, w_dtype = rng.choice(DTYPE_PAIRS)
    if rng.random() < 0.15:
        w_dtype = None
    offset = 1.0 if w_dtype is not None and rng.random() < 0.3 else 0.0
    eps = rng.choice(EPSILONS)
    r = rng.random()
    layout = "transposed" if (r < 0.07 and lead) else "rows" if r < 0.25 else "contiguous"
    pad = rng.choice((1, 3, 8, 16, 64, 127, N))
    col0 = rng.randint(0, pad) if rng.random() < 0.5 else 0
    w_stride = 2 if (w_dtype is not None and rng.random() < 0.05) else 1
    r = rng.random()
    big = 30.0 if x_dtype == torch.float16 else 1e3  # fp16: stay below its max (65504) with the row scale
    scale = 1e-3 if r < 0.1 else big if r < 0.2 else 1.0
    zero_rows = M >= 2 and layout != "transposed" and rng.random() < 0.05
    grads, no_grad, dy = "", "", ""
    if rng.random() < 0.3:
        no_grad = rng.choice(("no_grad", "no_grad", "inference_mode", "plain"))
    else:
        r = rng.random()
        grads = "x" if (w_dtype is None or r < 0.1) else "w" if r < 0.2 else "xw"
        dy = rng.choices(("loss", "dense", "expanded", "strided", "transposed", "sum"), (30, 25, 15, 15, 10, 5))[0]
    return Case(test, index, device, mode, lead, N, x_dtype, w_dtype, offset, eps, layout, pad, col0, w_stride,
                scale, zero_rows, grads, no_grad, dy, rng.getrandbits(63))


WIDTHS = width_pool(SEED)
GPU_CASES = [make_case(SEED, "test_fuzz_gpu", i, "cuda", WIDTHS, GPU_MODES + (None,), GPU_MAX_ELEMS)
             for i in range(N_GPU_CASES)]
CPU_CASES = [make_case(SEED, "test_fuzz_cpu", i, "cpu", [n for n in WIDTHS if n <= CPU_MAX_ELEMS],
                       ("torch", None) + CPU_INTERPRETED,
                       CPU_MAX_ELEMS) for i in range(N_CPU_CASES)]


@pytest.fixture(scope="module", autouse=True)
def _announce_seed(request):
    """The seed at the top of the module's output (outside pytest's capture, so a passing run shows it
    too) and in the captured output."""
    line = (f"fuzz: {SEED_VAR}={SEED} ({'from the environment' if os.environ.get(SEED_VAR) else 'drawn'}), "
            f"{N_GPU_CASES} GPU cases over {len(WIDTHS)} widths: {WIDTHS}")
    print(line)
    capman = request.config.pluginmanager.getplugin("capturemanager")
    reporter = request.config.pluginmanager.getplugin("terminalreporter")
    uncaptured = getattr(capman, "global_and_fixture_disabled", None)
    if uncaptured is not None and reporter is not None:
        with uncaptured():
            reporter.write_line(line)
    yield


# ================================================================================================
# Inputs, the run, the fp64 reference, the checks
# ================================================================================================
def build_inputs(case: Case):
    """(x, w, dy_or_g) on the case's device, x / w requiring grad as the case says. dy_or_g: the
    tensor handed to autograd (g for "loss": fp32; None for "sum" and forward-only cases)."""
    torch.manual_seed(case.torch_seed)
    dev, N, dt = case.device, case.N, case.x_dtype
    if case.layout == "rows":
        base = random_rows(case.shape[:-1] + (N + case.pad,), dt, dev, case.scale)
    elif case.layout == "transposed":
        base = random_rows(case.lead[:-1] + (N, case.lead[-1]), dt, dev, case.scale)
    else:
        base = random_rows(case.shape, dt, dev, case.scale)
    if case.zero_rows:  # before requires_grad (an in-place write); a view of base's rows for both layouts
        rows = base.view(-1, base.shape[-1])
        rows[torch.randint(rows.shape[0], (max(1, rows.shape[0] // 16),), device=dev)] = 0
    if "x" in case.grads:
        base.requires_grad_()
    if case.layout == "rows":
        x = base[..., case.col0:case.col0 + N]
    elif case.layout == "transposed":
        x = base.transpose(-1, -2)
    else:
        x = base
    if "x" in case.grads:
        x.retain_grad()  # x may be a view of the leaf: its own grad is what rms_norm's backward produced
    w = None
    if case.w_dtype is not None:
        wb = random_weight(N * case.w_stride, case.w_dtype, dev)
        if "w" in case.grads:
            wb.requires_grad_()
        w = wb[::case.w_stride] if case.w_stride > 1 else wb
        if "w" in case.grads:
            w.retain_grad()
    dy = None
    lead = case.shape[:-1]
    if case.dy == "loss":
        dy = torch.randn(case.shape, device=dev)
    elif case.dy == "dense":
        dy = torch.randn(case.shape, device=dev).to(dt)
    elif case.dy == "expanded":  # what y.sum()-like losses hand out: row stride 0
        dy = torch.randn(N, device=dev).to(dt).expand(case.shape)
    elif case.dy == "strided":
        dy = torch.randn(lead + (N + 5,), device=dev).to(dt)[..., 2:2 + N]
    elif case.dy == "transposed":
        dy = torch.randn((N,) + lead, device=dev).to(dt).movedim(0, -1)
    return x, w, dy


def run_case(case: Case, x, w, dy):
    """y (and the grads in x.grad / w.grad). Raises what rms_norm raises."""
    call = {"mode": case.mode, "offset": case.offset}
    if not case.grads:
        ctx = {"no_grad": torch.no_grad, "inference_mode": torch.inference_mode,
               "plain": torch.enable_grad}[case.no_grad]
        with ctx():
            y = cn.rms_norm(x, w, case.eps, **call)
    else:
        y = cn.rms_norm(x, w, case.eps, **call)
        if case.dy == "loss":
            (y.float() * dy).sum().backward()
        elif case.dy == "sum":
            y.sum().backward()
        else:
            y.backward(dy)
    if case.device == "cuda":
        torch.cuda.synchronize()  # a kernel's asynchronous error belongs to this case
    return y


def reference_bwd64(x2d, w, dy2d, eps, offset, need_dx=True):
    """(dx, dw, dx_scale, dw_scale) in fp64 over rows [M, N]: the closed form
        dx = rstd * (w'dy - xhat * mean(xhat * w'dy)),  dw = sum over rows of dy * xhat,  w' = offset + w,
    and the magnitudes of the terms each element is made of (the kernels' fp32 rounding is relative to
    those, not to a result that cancels to near 0). dw / dw_scale are None without a weight."""
    xc, dyc = x2d.double(), dy2d.double()
    rstd = torch.rsqrt(xc.square().mean(dim=-1, keepdim=True) + eps)
    xhat = xc * rstd
    g = dyc if w is None else dyc * (w.double() + offset)
    dx = dx_scale = None
    if need_dx:
        gx = g * xhat
        dx = rstd * (g - xhat * gx.mean(dim=-1, keepdim=True))
        dx_scale = rstd * (g.abs() + xhat.abs() * gx.abs().mean(dim=-1, keepdim=True))
    dw = dw_scale = None
    if w is not None:
        t = dyc * xhat
        dw, dw_scale = t.sum(dim=0), t.abs().sum(dim=0)
    return dx, dw, dx_scale, dw_scale


def check_close(what: str, actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, scale=None,
                truncated: bool = False):
    """actual (dtype) vs the fp64 expectation: elementwise atol + rtol * |ref| (+ 2^-16 * scale for the
    grads), and the L2 bound (module docstring; `truncated`: a 16-bit result of Triton's interpreter,
    INTERPRETER_L2_FACTOR x the bound). Non-finite values fail, except where the exact value is
    within tolerance of the dtype's largest finite value: there inf or that value, of the right sign."""
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    if actual.numel() == 0:
        return
    a = actual.double()
    tol = TOLERANCES[dtype]
    limit = tol["atol"] + tol["rtol"] * expected.abs()
    if scale is not None:
        limit = limit + SCALE_TOL * scale
    top = torch.finfo(dtype).max  # past it: inf (IEEE rounding) or the largest value (saturation), right sign
    overflow = (a.abs() >= top) & (expected.abs() + limit >= top) & (a.sign() == expected.sign())
    bad = ~torch.isfinite(a) & ~overflow
    if bad.any():
        i = int(bad.reshape(-1).nonzero()[0])
        raise AssertionError(f"{what}: {int(bad.sum())}/{a.numel()} non-finite values; first at flat index {i}: "
                             f"{a.reshape(-1)[i].item()} (expected {expected.reshape(-1)[i].item():.6g})")
    err = torch.where(overflow, 0.0, (a - expected).abs())
    ratio = err / limit
    if (ratio > 1).any():
        i = int(ratio.reshape(-1).argmax())
        raise AssertionError(
            f"{what}: {int((ratio > 1).sum())}/{a.numel()} elements out of tolerance ({tol}"
            f"{' + 2^-16 x term magnitude' if scale is not None else ''}); worst at flat index {i}: got "
            f"{a.reshape(-1)[i].item():.6g}, expected {expected.reshape(-1)[i].item():.6g} (err {err.reshape(-1)[i].item():.3g},"
            f" limit {limit.reshape(-1)[i].item():.3g})")
    keep = ~overflow
    l2_err = torch.linalg.vector_norm(err)
    l2_rtol = L2_RTOL[dtype] * (INTERPRETER_L2_FACTOR if truncated and dtype != torch.float32 else 1.0)
    l2_lim = (l2_rtol * torch.linalg.vector_norm(torch.where(keep, expected, 0.0))
              + tol["atol"] * math.sqrt(a.numel()))
    if scale is not None:
        l2_lim = l2_lim + SCALE_TOL * torch.linalg.vector_norm(torch.where(keep, scale, 0.0))
    if l2_err > l2_lim:
        raise AssertionError(f"{what}: L2 error {l2_err.item():.4g} > bound {l2_lim.item():.4g} "
                             f"({l2_rtol:.3g} x ||ref|| + atol + 2^-16 x ||term magnitudes||)")


def check_case(case: Case, x, w, dy, y):
    assert y.shape == x.shape, f"y: shape {tuple(y.shape)} != x's {tuple(x.shape)}"
    assert y.dtype == x.dtype, f"y: dtype {y.dtype} != x's {x.dtype}"
    assert y.device == x.device, f"y: on {y.device}, x on {x.device}"
    if case.mode in GPU_MODES:  # the kernels' y is a fresh contiguous tensor (rms_norm's contract)
        assert y.is_contiguous(), f"y: not contiguous, strides {y.stride()}"
    xd = x.detach()
    wd = w.detach() if w is not None else None
    y64, _ = reference64(xd, wd, case.eps, case.offset)
    truncated = case.mode in CPU_INTERPRETED and x.device.type == "cpu"
    check_close("y", y.detach(), y64, case.x_dtype, truncated=truncated)
    if not case.grads:
        return
    N = case.N
    if case.dy == "loss":
        dy_eff = dy.to(case.x_dtype)  # y.float()'s backward rounds g to y's dtype
    elif case.dy == "sum":
        dy_eff = torch.ones(case.shape, dtype=case.x_dtype, device=x.device)
    else:
        dy_eff = dy
    need_dx = "x" in case.grads
    ex, ew, sx, sw = reference_bwd64(xd.reshape(-1, N), wd, dy_eff.reshape(-1, N), case.eps, case.offset, need_dx)
    if need_dx:
        assert x.grad is not None, "dx: not computed (x.grad is None)"
        assert x.grad.dtype == case.x_dtype, f"dx: dtype {x.grad.dtype} != x's {case.x_dtype}"
        assert x.grad.shape == x.shape, f"dx: shape {tuple(x.grad.shape)} != x's {tuple(x.shape)}"
        check_close("dx", x.grad.reshape(-1, N), ex, case.x_dtype, sx, truncated=truncated)
    if "w" in case.grads and w is not None:
        assert w.grad is not None, "dw: not computed (w.grad is None)"
        assert w.grad.dtype == case.w_dtype, f"dw: dtype {w.grad.dtype} != the weight's {case.w_dtype}"
        assert w.grad.shape == (N,), f"dw: shape {tuple(w.grad.shape)} != ({N},)"
        check_close("dw", w.grad, ew, case.w_dtype, sw, truncated=truncated)


def refusal_message(case_mode, err: BaseException) -> str | None:
    """The message of an allowed refusal, else None: an explicit mode, exactly ValueError or
    NotImplementedError (a DSL error or a subclass is not a refusal), a message, and raised by a `raise`
    statement in cutile_norms (not by a call, e.g. ct.launch, that failed underneath)."""
    if case_mode is None or type(err) not in (ValueError, NotImplementedError):
        return None
    msg = " ".join(str(err).split())
    tb = err.__traceback__
    if not msg or tb is None:
        return None
    while tb.tb_next is not None:
        tb = tb.tb_next
    filename = os.path.abspath(tb.tb_frame.f_code.co_filename)
    if not filename.startswith(_PACKAGE_DIR + os.sep):
        return None
    if not linecache.getline(filename, tb.tb_lineno).lstrip().startswith("raise"):
        return None
    return msg


def picked_mode(x, w, eps: float, offset: float) -> str:
    """What mode=None runs for these tensors (explain()'s "mode: ..." line)."""
    text = cn.explain(x.detach(), w.detach() if w is not None else None, mode=None, offset=offset, eps=eps)
    for line in text.splitlines():
        if line.startswith("mode: "):
            return line.split()[1]
    raise AssertionError(f"explain() printed no 'mode:' line: {text!r}")


def documented_refusals(mode: str, x) -> set[str]:
    """What `mode` may answer a valid case with: that it cannot run on this device at all
    (available_modes), or what its forward backend's `unsupported()` says about these rows (the
    16-byte rule of tma_smem_cached). Nothing else is a refusal."""
    why_not = cn.available_modes(x.device)[mode]
    if why_not:
        return {" ".join(why_not.split())}
    if mode == "torch" or not x.numel():
        return set()
    rows = x.detach().reshape(-1, x.shape[-1])
    if rows.stride(-1) != 1 and rows.shape[-1] > 1:  # the API copies such rows first (rmsnorm.as_rows)
        rows = rows.contiguous()
    why = dispatch.backend(mode).unsupported(rows)
    return {" ".join(why.split())} if why else set()


def record_refusal(where: str, mode: str, msg: str, x, w, eps, offset):
    """An explicit mode's clear refusal, allowed only where documented (`documented_refusals`): printed
    and warned; mode=None must not pick the mode there."""
    assert msg in documented_refusals(mode, x), (
        f"{mode} refused a valid case with {msg!r}, which neither available_modes() nor its "
        f"unsupported() gives for these rows")
    picked = picked_mode(x, w, eps, offset)
    assert picked != mode, f"{mode} refused this shape ({msg}) but mode=None picks it"
    line = f"allowed refusal: {where}: {mode} raised: {msg}"
    print(line)
    warnings.warn(line, FuzzRefusal, stacklevel=2)


def _one_line(err: BaseException) -> str:
    text = " ".join(str(err).split())
    return f"{type(err).__name__}: {text[:1500]}{' ...' if len(text) > 1500 else ''}"


def fuzz_one(case: Case):
    """Run and check one case; any failure becomes one line that replays it."""
    x = w = None
    try:
        x, w, dy = build_inputs(case)
        try:
            y = run_case(case, x, w, dy)
        except (ValueError, NotImplementedError) as err:
            msg = refusal_message(case.mode, err)
            if msg is None:
                raise
            record_refusal(f"{case.repro()}  # {case.describe()}", case.mode, msg, x, w, case.eps, case.offset)
            return
        check_case(case, x, w, dy, y)
        if case.device == "cpu":
            check_gpu_modes_refuse(case.index, x, w, case.eps, case.offset)
    except Exception as err:  # noqa: BLE001 -- whatever went wrong, the failure is one line that replays the case
        extra = ""
        if case.mode is None and x is not None:
            try:  # best effort: what mode=None ran helps, but must not hide the case's own error
                extra = f" (mode=None picked {picked_mode(x, w, case.eps, case.offset)})"
            except Exception:  # noqa: BLE001, S110
                pass
        pytest.fail(f"{case.repro()}  # {case.describe()}{extra}: {_one_line(err)}")


def check_gpu_modes_refuse(index: int, x, w, eps, offset):
    """A GPU mode on CPU tensors: a ValueError that names the mode and the CPU (dispatch._refusal), raised
    before anything runs."""
    mode = REFUSE_CPU[index % len(REFUSE_CPU)]
    try:
        cn.rms_norm(x.detach(), w.detach() if w is not None else None, eps, mode=mode, offset=offset)
    except ValueError as err:
        assert mode in str(err) and "cpu" in str(err).lower(), f"mode={mode} on CPU tensors: unclear error {err!r}"
        return
    except Exception as err:
        raise AssertionError(f"mode={mode} on CPU tensors raised {_one_line(err)}, not a ValueError") from err
    raise AssertionError(f"mode={mode} on CPU tensors did not raise")


# ================================================================================================
# The tests
# ================================================================================================
@pytest.mark.parametrize("i", range(N_CPU_CASES))
def test_fuzz_cpu(i):
    fuzz_one(CPU_CASES[i])


@pytest.mark.gpu
@pytest.mark.parametrize("i", range(N_GPU_CASES))
def test_fuzz_gpu(i):
    fuzz_one(GPU_CASES[i])


@pytest.mark.parametrize("mode", REFUSE_CPU)
def test_gpu_modes_refuse_cpu_tensors(mode):
    """The behaviour today (dispatch._refusal): ValueError "mode '...' runs on nvidia GPUs, not on CPU tensors"."""
    x = torch.randn(3, 8, requires_grad=True)
    for w in (None, torch.ones(8, requires_grad=True)):
        with pytest.raises(ValueError, match=rf"(?i){mode}.*cpu"):
            cn.rms_norm(x, w, mode=mode)
    with torch.no_grad(), pytest.raises(ValueError, match=rf"(?i){mode}.*cpu"):
        cn.rms_norm(x, mode=mode)


def test_cases_depend_on_the_seed_and_index_only():
    """A failing case replays from (seed, index): the same case for any case count, another seed differs."""
    again = make_case(SEED, "test_fuzz_gpu", 7, "cuda", width_pool(SEED), GPU_MODES + (None,), GPU_MAX_ELEMS)
    if N_GPU_CASES > 7:
        assert again == GPU_CASES[7]
    assert width_pool(SEED) == WIDTHS and 60 <= len(WIDTHS) <= 80
    assert all(c.M * c.N <= GPU_MAX_ELEMS for c in GPU_CASES) and all(c.M * c.N <= CPU_MAX_ELEMS for c in CPU_CASES)
    first = [make_case(SEED, "test_fuzz_gpu", i, "cuda", WIDTHS, GPU_MODES + (None,), GPU_MAX_ELEMS) for i in range(len(GPU_MODES) + 1)]
    assert {c.mode for c in first} == set(GPU_MODES) | {None}
    other = make_case(SEED + 1, "test_fuzz_gpu", 7, "cuda", width_pool(SEED + 1), GPU_MODES + (None,), GPU_MAX_ELEMS)
    assert other != again


def test_check_close_is_strict():
    """The harness itself: the L2 bound fails an error the elementwise bound lets through (1.8 u on
    every element), overflow past fp16's range passes only as inf / max of the right sign."""
    e = torch.linspace(1.0, 2.0, 1000, dtype=torch.float64)
    check_close("exact", e.to(torch.bfloat16), e, torch.bfloat16)
    with pytest.raises(AssertionError, match="L2 error"):
        check_close("1.8u", e * (1 + 1.8 * 2.0 ** -8), e, torch.bfloat16)
    big = torch.tensor([1e6, -1e6, 1.0], dtype=torch.float64)
    check_close("overflow", torch.tensor([float("inf"), -65504.0, 1.0], dtype=torch.float16), big, torch.float16)
    for wrong in ([float("-inf"), float("-inf"), 1.0], [float("nan"), float("-inf"), 1.0],
                  [float("inf"), float("-inf"), float("inf")]):
        with pytest.raises(AssertionError, match="non-finite|out of tolerance"):
            check_close("overflow", torch.tensor(wrong, dtype=torch.float16), big, torch.float16)


# ------------------------------------------------------------------------------------------------
# Past 32-bit indexing: M * N > 2^32 (bf16, 8 GiB per tensor; a 32-bit element index read as unsigned
# still holds at 2^31), checked in fp64 one row chunk at a time
# ------------------------------------------------------------------------------------------------
BIG_N = 8192
BIG_M = (1 << 32) // BIG_N + 3
BIG_CHUNK = 8192  # rows per fp64 check: 512 MiB per fp64 temporary


def _check_big_y(y, x, w, eps, offset, what):
    assert y.shape == x.shape and y.dtype == x.dtype, f"{what}: y {y.dtype}{list(y.shape)}"
    for r0 in range(0, BIG_M, BIG_CHUNK):
        rows = slice(r0, r0 + BIG_CHUNK)
        check_close(f"{what} y rows {r0}..", y[rows], reference64(x[rows], w, eps, offset)[0], x.dtype)


@pytest.mark.gpu
@pytest.mark.big
def test_fuzz_past_int32_gpu():
    """Inference forward in every mode (and mode=None), then forward + backward in one cuTile mode (the
    seed picks it: they share the backward kernel), on M * N = 2^32 + 3 * 8192 elements: the launches
    cross both 2^31 and 2^32 elements. Every row is checked against fp64, a chunk at a time; dw sums all rows."""
    repro = replay_line("test_fuzz_past_int32_gpu")
    elem = BIG_M * BIG_N * 2
    free, _ = torch.cuda.mem_get_info()
    if free < 2 * elem + (6 << 30):
        pytest.skip(f"needs ~{(2 * elem >> 30) + 6} GiB of free GPU memory, {free >> 30} free")
    torch.manual_seed(SEED)
    eps = 1e-6
    x = torch.empty((BIG_M, BIG_N), dtype=torch.bfloat16, device="cuda")
    for r0 in range(0, BIG_M, BIG_CHUNK):
        x[r0:r0 + BIG_CHUNK] = random_rows((min(BIG_CHUNK, BIG_M - r0), BIG_N), torch.bfloat16, "cuda")
    w = random_weight(BIG_N, torch.bfloat16, "cuda")
    ran = []
    for mode in GPU_MODES + (None,):
        what = f"{repro}  # inference mode={mode} x=bf16[{BIG_M}, {BIG_N}] w=bf16 eps={eps}"
        try:
            with torch.no_grad():
                y = cn.rms_norm(x, w, eps, mode=mode)
            torch.cuda.synchronize()
        except (ValueError, NotImplementedError) as err:
            msg = refusal_message(mode, err)
            if msg is None:
                pytest.fail(f"{what}: {_one_line(err)}")
            record_refusal(what, mode, msg, x, w, eps, 0.0)
            continue
        except Exception as err:  # noqa: BLE001 -- any other error fails, as one replay line
            pytest.fail(f"{what}: {_one_line(err)}")
        try:
            _check_big_y(y, x, w, eps, 0.0, "inference")
        except AssertionError as err:
            pytest.fail(f"{what}: {_one_line(err)}")
        del y
        torch.cuda.empty_cache()
        if mode is not None:
            ran.append(mode)

    free, _ = torch.cuda.mem_get_info()
    if not ran or free < 3 * elem + (8 << 30):  # + y, dy, dx; x is already there
        pytest.skip(f"backward not run: modes that ran {ran}, {free >> 30} GiB free")
    mode = ran[SEED % len(ran)]
    offset = 1.0
    what = f"{repro}  # fwd+bwd mode={mode} x=bf16[{BIG_M}, {BIG_N}] w=bf16 offset={offset} eps={eps} dy=dense"
    wg = w.clone().requires_grad_()
    x.requires_grad_()
    try:
        y = cn.rms_norm(x, wg, eps, mode=mode, offset=offset)
        dy = torch.randn_like(y)
        y.backward(dy)
        torch.cuda.synchronize()
    except (ValueError, NotImplementedError) as err:
        msg = refusal_message(mode, err)
        if msg is None:
            pytest.fail(f"{what}: {_one_line(err)}")
        record_refusal(what, mode, msg, x, wg, eps, offset)
        return
    except Exception as err:  # noqa: BLE001 -- any other error fails, as one replay line
        pytest.fail(f"{what}: {_one_line(err)}")
    try:
        xd = x.detach()
        _check_big_y(y.detach(), xd, w, eps, offset, "training")
        del y
        dx, dw = x.grad, wg.grad
        assert dx is not None and dx.dtype == torch.bfloat16 and dx.shape == x.shape, "dx: missing or wrong dtype/shape"
        assert dw is not None and dw.dtype == torch.bfloat16 and dw.shape == (BIG_N,), "dw: missing or wrong dtype/shape"
        ew = torch.zeros(BIG_N, dtype=torch.float64, device="cuda")
        sw = torch.zeros_like(ew)
        for r0 in range(0, BIG_M, BIG_CHUNK):
            rows = slice(r0, r0 + BIG_CHUNK)
            ex, ewc, sx, swc = reference_bwd64(xd[rows], w, dy[rows], eps, offset)
            check_close(f"dx rows {r0}..", dx[rows], ex, torch.bfloat16, sx)
            ew += ewc
            sw += swc
            del ex, sx
        check_close("dw", dw, ew, torch.bfloat16, sw)
    except AssertionError as err:
        pytest.fail(f"{what}: {_one_line(err)}")


# ================================================================================================
# The residual add (rms_norm(..., residual=r), add_rms_norm_): cases from (seed, index) alone
# ================================================================================================
N_RESIDUAL_GPU, N_RESIDUAL_CPU = 300, 60


def residual_case(seed: int, test: str, index: int, device: str, modes: tuple, max_elems: int) -> dict:
    """One case: mode, fused (the fused kernels on) or not, shape, dtypes of x, r, h and the
    weight, offset, layouts of x and r, in place or differentiated (which inputs, dh or not)."""
    rng = random.Random(f"{seed}/{test}/{index}")
    pool = [n for n in WIDTHS if n <= max_elems]
    N = rng.choice(pool)
    M = min(_log_uniform(rng, 1, 4096), max(1, max_elems // N))
    x_dtype = rng.choice((torch.bfloat16, torch.float16, torch.float32))
    return dict(mode=modes[index % len(modes)], fused=rng.random() < 0.5, lead=(M,) if rng.random() < 0.7 else
                (1, M), N=N, x_dtype=x_dtype, r_dtype=x_dtype if rng.random() < 0.7 else torch.float32,
                h_dtype=None if rng.random() < 0.7 else torch.float32,
                w_dtype=rng.choice((x_dtype, torch.float32, None)), offset=rng.choice((0.0, 0.0, 1.0)),
                x_layout=rng.choice(("contiguous", "contiguous", "rows")),
                r_layout=rng.choice(("contiguous", "contiguous", "rows")), in_place=rng.random() < 0.25,
                grads=rng.choice(("x", "r", "xrw", "w")), dh=rng.random() < 0.7, torch_seed=rng.getrandbits(63))


def _residual_inputs(c: dict, device: str):
    shape = c["lead"] + (c["N"],)

    def make(dtype, layout):
        if layout == "rows":  # a column slice of a wider tensor
            wide = torch.randn(shape[:-1] + (c["N"] + 24,), device=device).to(dtype)
            return wide[..., 8:8 + c["N"]]
        return torch.randn(shape, device=device).to(dtype)
    x, r = make(c["x_dtype"], c["x_layout"]), make(c["r_dtype"], c["r_layout"])
    w = None if c["w_dtype"] is None else (1 + 0.5 * torch.randn(c["N"], device=device)).to(c["w_dtype"])
    return x, r, w


def fuzz_residual(c: dict, device: str, index: int, test: str):
    from tests.test_residual import check_grads, check_h  # the residual tests' oracles
    torch.manual_seed(c["torch_seed"])
    os.environ["CUTILE_NORMS_FUSED"] = "1" if c["fused"] else "0"
    where = f"{replay_line(f'{test}[{index}]')}  # {c}"
    x = r = None
    try:
        x, r, w = _residual_inputs(c, device)
        offset = c["offset"] if w is not None else 0.0
        if c["in_place"]:  # (h takes the residual's dtype: the drawn h_dtype does not apply)
            x0, r0 = x.clone(), r.clone()
            cn.add_rms_norm_(x, r, w, 1e-6, mode=c["mode"], offset=offset)
            check_h(r, x0, r0, device, c["fused"], where, c["torch_seed"])
            ey = reference64(r, w, 1e-6, offset)[0]
            check_close("y (in place)", x, ey, c["x_dtype"], truncated=c["fused"] and device == "cpu")
            return
        for t, name in ((x, "x"), (r, "r"), (w, "w")):
            if t is not None and name in c["grads"]:
                t.requires_grad_()
        y, h = cn.rms_norm(x, w, 1e-6, mode=c["mode"], offset=offset, residual=r, residual_dtype=c["h_dtype"])
        check_h(h.detach(), x.detach(), r.detach(), device, c["fused"], where, c["torch_seed"])
        ey = reference64(h.detach(), w.detach() if w is not None else None, 1e-6, offset)[0]
        check_close("y", y.detach(), ey, c["x_dtype"], truncated=c["fused"] and device == "cpu")
        if not (x.requires_grad or r.requires_grad or (w is not None and w.requires_grad)):
            return
        dy, dh = torch.randn_like(y), (torch.randn_like(h) if c["dh"] and h.requires_grad else None)
        torch.autograd.backward((y, h) if dh is not None else (y,), (dy, dh) if dh is not None else (dy,))
        check_grads(x, r, w, h, dy, dh, offset, c["torch_seed"], where)
    except (ValueError, NotImplementedError) as err:
        msg = refusal_message(c["mode"], err)  # the norm runs on h (in place: the residual itself)
        if x is None:
            pytest.fail(f"{where}: {_one_line(err)}", pytrace=False)
        rows = r if c["in_place"] else torch.empty(x.shape, dtype=c["h_dtype"] or c["x_dtype"], device=device)
        if msg is None or msg not in documented_refusals(c["mode"], rows):
            pytest.fail(f"{where}: {_one_line(err)}", pytrace=False)
    except Exception as err:  # noqa: BLE001 -- one line that replays the case
        pytest.fail(f"{where}: {_one_line(err)}", pytrace=False)
    finally:
        os.environ.pop("CUTILE_NORMS_FUSED", None)


RESIDUAL_CPU_MODES = ("torch", None) + CPU_INTERPRETED


@pytest.mark.parametrize("i", range(N_RESIDUAL_CPU))
def test_fuzz_residual_cpu(i):
    fuzz_residual(residual_case(SEED, "test_fuzz_residual_cpu", i, "cpu", RESIDUAL_CPU_MODES, CPU_MAX_ELEMS),
                  "cpu", i, "test_fuzz_residual_cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("i", range(N_RESIDUAL_GPU))
def test_fuzz_residual_gpu(i):
    fuzz_residual(residual_case(SEED, "test_fuzz_residual_gpu", i, "cuda", GPU_MODES + (None,), GPU_MAX_ELEMS),
                  "cuda", i, "test_fuzz_residual_gpu")


# ================================================================================================
# The FP8 output (rms_norm_fp8): cases from (seed, index) alone
# ================================================================================================
N_FP8_GPU, N_FP8_CPU = 300, 40
FP8_MAX_ELEMS_GPU = 1 << 22


def fp8_case(seed: int, test: str, index: int, modes: tuple, max_elems: int) -> dict:
    """One case: mode, shape, x / weight dtypes, offset, a residual (and h's dtype) or none, the fp8
    format, the scale (given, per token with or without an upper bound, 1 x g groups of a power of two
    dividing N, UE8M0 or not, row- or column-major), x's layout, rows of zeros, huge values, inf, NaN."""
    rng = random.Random(f"{seed}/{test}/{index}")
    N = rng.choice([n for n in WIDTHS if n <= max_elems])
    M = min(_log_uniform(rng, 1, 2048), max(1, max_elems // N))
    x_dtype = rng.choice((torch.bfloat16, torch.float16, torch.float32))
    groups = [g for g in (32, 64, 128) if N % g == 0]
    kind = rng.choice(("token", "token", "token_ub", "static", "static_saturating") + (("group",) * 3 if groups else ()))
    residual = rng.random() < 0.3
    return dict(mode=modes[index % len(modes)], lead=(M,) if rng.random() < 0.7 else (1, M), N=N, x_dtype=x_dtype,
                w_dtype=rng.choice((x_dtype, torch.float32, None)), offset=rng.choice((0.0, 0.0, 1.0)),
                r_dtype=(x_dtype if rng.random() < 0.7 else torch.float32) if residual else None,
                h_dtype=(None if rng.random() < 0.7 else torch.float32) if residual else None,
                out_dtype=rng.choice((torch.float8_e4m3fn, torch.float8_e5m2)), kind=kind,
                group=rng.choice(groups) if kind == "group" else None, ue8m0=kind.startswith(("group", "token")) and
                rng.random() < 0.3, ub=rng.uniform(0.5, 3.0) if kind == "token_ub" else None,
                column=kind == "group" and rng.random() < 0.4, layout=rng.choice(("contiguous", "contiguous", "rows")),
                special=rng.random() < 0.3, torch_seed=rng.getrandbits(63))


def _fp8_inputs(c: dict, device: str):
    shape = c["lead"] + (c["N"],)

    def make(dtype, layout):
        if layout == "rows":  # a column slice of a wider tensor
            return torch.randn(shape[:-1] + (c["N"] + 24,), device=device).to(dtype)[..., 8:8 + c["N"]]
        return torch.randn(shape, device=device).to(dtype)
    x = make(c["x_dtype"], c["layout"])
    rows = x.view(-1, c["N"]) if x.is_contiguous() else None
    if c["special"] and rows is not None and rows.shape[0] >= 4:  # a zero row, a huge one, an inf, a NaN
        rows[0] = 0.0
        rows[1] *= 1e4 if c["x_dtype"] != torch.float16 else 100.0
        rows[2, c["N"] // 2] = float("inf")
        rows[3, c["N"] - 1] = float("nan")
    r = None if c["r_dtype"] is None else make(c["r_dtype"], "contiguous")
    w = None if c["w_dtype"] is None else (1 + 0.5 * torch.randn(c["N"], device=device)).to(c["w_dtype"])
    return x, r, w


def fuzz_fp8(c: dict, device: str, index: int, test: str):
    """q within one fp8 step of the fp64 norm divided by the returned scales (NaN exactly where that is
    NaN: the contract's NaN and inf rows), the dynamic scales against the fp64 amax (UE8M0: the power of
    two at or above it), h bit for bit the fp32 sum rounded once, every shape and layout as documented."""
    from tests.test_fp8 import assert_fp8_close, oracle  # the FP8 tests' oracle
    torch.manual_seed(c["torch_seed"])
    where = f"{replay_line(f'{test}[{index}]')}  # {c}"
    try:
        x, r, w = _fp8_inputs(c, device)
        offset = c["offset"] if w is not None else 0.0
        scale = {"static": 0.01, "static_saturating": 1e-5}.get(c["kind"])
        kw = dict(out_dtype=c["out_dtype"], scale=scale, scale_ub=c["ub"], group_size=c["group"],
                  scale_ue8m0=c["ue8m0"], scale_layout="column" if c["column"] else "row", offset=offset,
                  mode=c["mode"])
        if r is not None:
            q, s, h = cn.rms_norm_fp8(x, w, 1e-6, residual=r, residual_dtype=c["h_dtype"], **kw)
            eh = (x.float() + r.float()).to(h.dtype)  # the fp32 sum rounded once (inf and NaN rows too)
            assert h.dtype == (c["h_dtype"] or c["x_dtype"]) and h.shape == x.shape, where
            assert torch.equal(torch.isnan(h), torch.isnan(eh)) and torch.equal(h[~torch.isnan(h)], eh[~torch.isnan(eh)]), \
                f"{where}: h is not the fp32 sum rounded once"
            src = h
        else:
            q, s = cn.rms_norm_fp8(x, w, 1e-6, **kw)
            src = x
        N, lead = c["N"], x.shape[:-1]
        assert q.dtype == c["out_dtype"] and q.shape == x.shape and s.dtype == torch.float32, where
        groups = N // c["group"] if c["group"] else 1
        y = reference64(src, w, 1e-6, offset)[0].double().cpu()
        yg = y.unflatten(-1, (groups, N // groups))
        if scale is not None:
            assert s.shape == (1,) and s.item() == torch.tensor(scale, dtype=torch.float32).item(), where
            sg = torch.full(lead + (groups,), s.item(), dtype=torch.float64)
        else:
            assert s.shape == lead + (groups,), f"{where}: scales {tuple(s.shape)}"
            if c["column"] and s.numel() > groups:
                assert s.reshape(-1, groups).stride(0) == 1, f"{where}: column-major scales"
            sg = s.double().cpu()
            s64 = oracle(src, w, 1e-6, offset, c["out_dtype"], None, c["ub"], c["group"])[1].cpu()
            assert torch.equal(torch.isnan(sg), torch.isnan(s64)), f"{where}: NaN scales in other places"
            ok = ~torch.isnan(s64)
            if c["ue8m0"]:
                m, _ = torch.frexp(sg[ok])
                assert (m == 0.5).all(), f"{where}: UE8M0 scales are powers of two"
                assert (sg[ok] >= s64[ok] * (1 - 1e-6)).all() and (sg[ok] <= 2 * s64[ok] * (1 + 1e-6)).all(), \
                    f"{where}: UE8M0 scales are the power of two at or above amax / max"
            else:
                assert torch.allclose(sg[ok], s64[ok], rtol=1e-6, atol=0), f"{where}: scales"
        assert_fp8_close(q.cpu(), (yg / sg.unsqueeze(-1)).flatten(-2), c["out_dtype"], where)
    except AssertionError as err:
        pytest.fail(_one_line(err), pytrace=False)
    except Exception as err:  # noqa: BLE001 -- one line that replays the case
        pytest.fail(f"{where}: {_one_line(err)}", pytrace=False)


@pytest.mark.parametrize("i", range(N_FP8_CPU))
def test_fuzz_fp8_cpu(i):
    fuzz_fp8(fp8_case(SEED, "test_fuzz_fp8_cpu", i, ("torch", None) + CPU_INTERPRETED, CPU_MAX_ELEMS), "cpu", i,
             "test_fuzz_fp8_cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("i", range(N_FP8_GPU))
def test_fuzz_fp8_gpu(i):
    """mode None and "triton" run the kernel (rows up to 16384), a cuTile mode the torch ops."""
    fuzz_fp8(fp8_case(SEED, "test_fuzz_fp8_gpu", i, (None, "triton", "multi_wave_cached"), FP8_MAX_ELEMS_GPU),
             "cuda", i, "test_fuzz_fp8_gpu")
