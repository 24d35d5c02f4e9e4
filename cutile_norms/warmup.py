"""`warmup`: compile, ahead of traffic, every kernel `mode=None` (or a given mode) can pick for some
widths, dtypes and a row range, forward and backward, so that no call in that range compiles.

Kernels are compiled per (dtypes, N, launch config, flags) with M symbolic. In the shipped tables the
mode mode=None picks does not depend on M and the configs depend on N and the dtypes, with M = 1 apart
(its row stride is N); one call at each power of two in the range (and at its ends) also meets every
band of M a later table may add, as long as the band contains a power of two. Each call runs on real
tensors of that shape: the compile cache on disk (cutile_norms/_diskcache.py) then holds them for the
next process too.
"""
from __future__ import annotations

import sys
import time

import torch

from .rmsnorm import rms_norm

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
           backward: bool = True, mode: str | None = None, offset: float = 0.0, device=None,
           max_elements: int = MAX_ELEMENTS, verbose: bool = True) -> list[dict]:
    """Run `rms_norm` (no grad; with grad then its backward, once with the weight trained and once
    frozen, where `backward`) once per width of `widths`, dtype of `dtypes` and row count of
    `row_counts(*rows)` on `device` (default: the current GPU), for contiguous rows and the given
    `offset` and `mode`. weight_dtype: "same" (x's), a dtype, or None (no weight). Prints a line per
    width and dtype (what ran, the time, the CuTe compiles) unless verbose=False; returns those records.
    Row counts whose x would pass `max_elements` are skipped and listed (their kernels compile on first
    use), as do other row strides, offsets and modes, the residual add and the FP8 output."""
    widths = [int(n) for n in ([widths] if isinstance(widths, int) else widths)]
    if not widths or any(n < 1 for n in widths):
        raise ValueError(f"widths must be positive row widths, got {widths}")
    dtypes = (dtypes,) if isinstance(dtypes, torch.dtype) else tuple(dtypes)
    if not dtypes or not all(isinstance(d, torch.dtype) for d in dtypes):
        raise TypeError(f"dtypes must be a torch.dtype or a sequence of them, got {dtypes!r}")
    if not (weight_dtype == "same" or weight_dtype is None or isinstance(weight_dtype, torch.dtype)):
        raise TypeError(f'weight_dtype must be "same", None or a torch.dtype, got {weight_dtype!r}')
    if not (isinstance(rows, (tuple, list)) and len(rows) == 2 and all(isinstance(r, int) for r in rows)):
        raise ValueError(f"rows must be (lo, hi) row counts, got {rows!r}")
    device = torch.device(device) if device is not None else (
        torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu"))
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
                with torch.no_grad():
                    rms_norm(x, w, mode=mode, offset=offset)
                if backward:  # the weight trained, then frozen (its grad not asked for: another kernel)
                    xg = x.requires_grad_()
                    for wg in ([w.detach().requires_grad_(), w] if w is not None else [None]):
                        rms_norm(xg, wg, mode=mode, offset=offset).backward(torch.randn_like(x))
                ran.append(M)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            rec = {"N": N, "dtype": str(dtype).removeprefix("torch."), "rows": ran, "skipped_rows": skipped,
                   "seconds": time.perf_counter() - t0, "cute_compiles": _compiles() - c0}
            records.append(rec)
            if verbose:
                print(f"cutile_norms.warmup: N={N} {rec['dtype']} rows {ran[0] if ran else '-'}..{ran[-1] if ran else '-'} "
                      f"({len(ran)} row counts{', backward' if backward else ''}): {rec['seconds']:.2f} s, "
                      f"{rec['cute_compiles']} CuTe compiles"
                      + (f"; skipped rows {skipped} (x past {max_elements} elements)" if skipped else ""), flush=True)
    return records
