"""`warmup`: compile, ahead of traffic, every kernel `mode=None` (or a given mode) can pick for some
widths, dtypes and a row range, forward and backward, so that no call in that range compiles; with
`residual`, the residual add's kernels too, and with `fp8`, the FP8 output's common forms.

Kernels are compiled per (dtypes, N, launch config, flags) with M symbolic. In the shipped tables the
mode mode=None picks does not depend on M and the configs depend on N and the dtypes, with M = 1 apart
(its row stride is N); one call at each power of two in the range (and at its ends) also meets every
band of M a later table may add, as long as the band contains a power of two. Each call runs on real
tensors of that shape: the compile cache on disk (cutile_norms/_diskcache.py) then holds them for the
next process too.
"""
from __future__ import annotations

import numbers
import sys
import time
import warnings

import torch

from ._util import ints
from .fp8 import rms_norm_fp8
from .rmsnorm import DTYPES, rms_norm

MAX_ELEMENTS = 1 << 28  # a warm-up call's x at most this big (512 MiB of bf16): the rest is reported


def _compiles() -> int:
    """CuTe DSL compiles in this process so far (cuTile and Triton keep their own counts)."""
    count = 0
    for name in ("cutile_norms.cute.rmsnorm_fwd", "cutile_norms.cute.rmsnorm_bwd"):
        module = sys.modules.get(name)
        if module is not None:
            count += module.CACHE.count
    return count


def row_counts(lo: int, hi: int) -> list[int]:
    """lo, every power of two strictly between, and hi."""
    if not 1 <= lo <= hi:
        raise ValueError(f"rows must be (lo, hi) with 1 <= lo <= hi, got ({lo}, {hi})")
    ms, p = {lo, hi}, 1
    while p < hi:
        if p > lo:
            ms.add(p)
        p *= 2
    return sorted(ms)


def warmup(widths, dtypes=(torch.bfloat16,), rows=(1, 32768), *, weight_dtype: torch.dtype | str | None = "same",
           backward: bool = True, mode: str | None = None, offset: float = 0.0, residual: bool | torch.dtype = False,
           fp8: bool = False, device=None, max_elements: int = MAX_ELEMENTS, verbose: bool = True) -> list[dict]:
    """Run `rms_norm` (no grad; with grad then its backward, with the weight trained, frozen, and trained
    beside an x that is not, where `backward`) once per width of `widths`, dtype of `dtypes` and row count of
    `row_counts(*rows)` on `device` (default: the current GPU; elsewhere a warning: nothing compiles for a
    GPU), for contiguous rows and the given
    `offset` and `mode`. weight_dtype: "same" (x's), a dtype, or None (no weight). residual: True (a
    residual and h of x's dtype) or a dtype (the residual and h in it: an fp32 residual stream) also
    runs `rms_norm(x, w, residual=r, residual_dtype=...)` the same ways (`add_rms_norm_` in place runs
    the same forward kernel). fp8: also `rms_norm_fp8` to e4m3 with per-token scales and, where 128
    divides N, 1 x 128 group scales. Prints a line per width and dtype (what ran, the time, the CuTe
    compiles) unless verbose=False; returns those records. Row counts whose x would pass
    `max_elements` are skipped and listed (their kernels compile on first use), as do other row
    strides, offsets and modes, and the FP8 output's other forms (e5m2, a given scale, an upper bound,
    UE8M0, other group sizes, with the residual add)."""
    widths = ints("widths", [widths] if isinstance(widths, numbers.Integral) else widths)
    if not widths or any(n < 1 for n in widths):
        raise ValueError(f"widths must be positive row widths, got {widths}")
    dtypes = (dtypes,) if isinstance(dtypes, torch.dtype) else tuple(dtypes)
    if not dtypes or not all(d in DTYPES for d in dtypes):
        raise TypeError(f"dtypes must be float16, bfloat16 or float32 (one, or a sequence), got {dtypes!r}")
    if not (weight_dtype == "same" or weight_dtype is None or weight_dtype in DTYPES):
        raise TypeError(f'weight_dtype must be "same", None, float16, bfloat16 or float32, got {weight_dtype!r}')
    if weight_dtype in DTYPES and any(weight_dtype not in (d, torch.float32) for d in dtypes):
        raise TypeError(f"weight_dtype {weight_dtype} must be each x dtype's own or float32 (dtypes {dtypes})")
    if not (isinstance(rows, (tuple, list)) and len(rows) == 2):
        raise ValueError(f"rows must be (lo, hi) row counts, got {rows!r}")
    rows = ints("rows", rows)
    if not (residual is True or residual is False or residual in DTYPES):
        raise TypeError(f"residual must be a bool, float16, bfloat16 or float32, got {residual!r}")
    for name, flag in (("backward", backward), ("fp8", fp8), ("verbose", verbose)):
        if not isinstance(flag, bool):
            raise TypeError(f"{name} must be a bool, got {flag!r}")
    device = torch.device(device) if device is not None else (
        torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu"))
    if device.type != "cuda":
        warnings.warn(f"cutile_norms.warmup on {device}: no GPU kernel is compiled there (the calls run, "
                      f"compiling nothing for a GPU)", stacklevel=2)
    ms = row_counts(*rows)
    records = []
    for dtype in dtypes:
        for N in widths:
            w_dtype = dtype if weight_dtype == "same" else weight_dtype
            w = None if w_dtype is None else (1 + 0.1 * torch.randn(N, device=device)).to(w_dtype)
            t0, c0 = time.perf_counter(), _compiles()
            ran, skipped = [], []
            for M in ms:
                if M * N > max_elements:
                    skipped.append(M)
                    continue
                x = torch.randn(M, N, device=device, dtype=dtype)
                _run(x, w, mode, offset, backward, None)
                if residual is not False:
                    _run(x, w, mode, offset, backward, dtype if residual is True else residual)
                if fp8:
                    with torch.no_grad():
                        rms_norm_fp8(x, w, offset=offset, mode=mode)
                        if N % 128 == 0:
                            rms_norm_fp8(x, w, offset=offset, mode=mode, group_size=128)
                ran.append(M)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            rec = {"N": N, "dtype": str(dtype).removeprefix("torch."), "rows": ran, "skipped_rows": skipped,
                   "residual": residual is not False, "fp8": fp8, "seconds": time.perf_counter() - t0,
                   "cute_compiles": _compiles() - c0}
            records.append(rec)
            if verbose:
                print(f"cutile_norms.warmup: N={N} {rec['dtype']} rows {ran[0] if ran else '-'}..{ran[-1] if ran else '-'} "
                      f"({len(ran)} row counts{', backward' if backward else ''}"
                      f"{', residual add' if rec['residual'] else ''}{', fp8' if fp8 else ''}): {rec['seconds']:.2f} s, "
                      f"{rec['cute_compiles']} CuTe compiles"
                      + (f"; skipped rows {skipped} (x past {max_elements} elements)" if skipped else ""), flush=True)
    return records


def _run(x, w, mode, offset, backward, residual_dtype) -> None:
    """One forward without grad and, where `backward`, forward + backward with the weight trained, then
    frozen (its grad not asked for: another kernel), then trained beside an x that is not (dw alone);
    with a residual of `residual_dtype` when given,
    whose h takes a grad from later layers too (as in a decoder; its kernels differ from y's alone)."""
    r = None if residual_dtype is None else torch.randn(x.shape, device=x.device, dtype=residual_dtype)

    def call(xx, ww):
        if r is None:
            return (rms_norm(xx, ww, mode=mode, offset=offset),)
        return rms_norm(xx, ww, mode=mode, offset=offset, residual=r, residual_dtype=residual_dtype)

    with torch.no_grad():
        call(x, w)
    if backward:
        xg = x.detach().requires_grad_()
        pairs = [(xg, w.detach().requires_grad_()), (xg, w), (x, w.detach().requires_grad_())] if w is not None \
            else [(xg, None)]  # (the last: dw alone, x not trained)
        for xx, ww in pairs:
            outs = call(xx, ww)
            torch.autograd.backward(outs, [torch.randn_like(t) for t in outs])
