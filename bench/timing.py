"""Timing on the GPU: CUDA-event medians, L2 flushed before every repetition.

  * `device_ms`: one call per repetition, L2 flushed first, then a GPU spin (`torch.cuda._sleep`,
    ~0.2 ms) before the start event, so the host has always queued the call before the GPU reaches
    that event and the interval is the call's GPU time only. Without the spin a slow host phase
    (seen on an H200 machine: 55-67 µs of host work per call where 25 was usual) let the GPU finish
    the flush first, and the events then timed host work too: 25-38 µs for a 4.5 µs call at M = 1,
    on some calls of some implementations only.
  * `per_call_us`: K calls back to back with no flush and events around the whole run, divided by K:
    the steady-state cost of one eager call as a caller sees it, host work (Python, launch) included
    whenever the host is slower than the GPU. The small-M sweep reports both.
  * `copy_baseline_ms`: the same bytes moved by a plain copy, the best of x.clone() and copies into
    two other preallocated buffers (the copy's speed was seen to depend on where the allocator put
    its output: 4160 vs 3750 GB/s in one process on an H200; the best is the conservative ceiling).
"""
from __future__ import annotations

import statistics
import time

import torch

_flush_buffer = None


def _flush_l2() -> None:
    global _flush_buffer
    if _flush_buffer is None:
        l2 = getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 64 << 20)
        _flush_buffer = torch.empty(max(2 * l2, 256 << 20), dtype=torch.int8, device="cuda")
    _flush_buffer.zero_()


SPIN_CYCLES = 400_000  # ~0.2 ms at the H100/H200 clocks (1.7-2.0 GHz): at least this
SPIN_MAX_CYCLES = 40_000_000  # ~20 ms: a spin never dominates a run (warm-up host time can include a sync)
SPIN_HZ = 2.0e9  # cycles per second assumed when the spin is sized from host time (the boost clock)


def device_ms(fn, reps: int = 40, warmup: int = 3, before=None) -> dict:
    """`before`: run after each flush, outside the timed interval (bench/probe/cold_start.py warms
    the code, the weight or the workspace with it). The spin lasts 3x the host time of one call
    (measured in the warm-up) and at least SPIN_CYCLES: an autograd backward took 175-280 us of
    host time per call on an H100 machine, longer than a 0.2 ms spin, and its small-M GPU times
    then counted host time (torch.compile's backward read 62 us at M = 64). The host time is the
    fastest warm-up call: with the slowest, torch.compile's compiling first call (~30 s) made each
    repetition spin 90 s and a backward bench stalled for hours."""
    host = float("inf")
    for _ in range(warmup):
        t0 = time.perf_counter()
        fn()
        host = min(host, time.perf_counter() - t0)  # min: the first call may compile (torch.compile: 30+ s)
    torch.cuda.synchronize()
    spin = min(max(SPIN_CYCLES, int(3 * host * SPIN_HZ)), SPIN_MAX_CYCLES)
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for start, end in events:
        _flush_l2()
        if before is not None:
            before()
        torch.cuda._sleep(spin)  # the GPU stays behind the host: the call is queued before `start` fires
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    t = [s.elapsed_time(e) for s, e in events]
    q = statistics.quantiles(t, n=10)
    return {"median_ms": statistics.median(t), "p10_ms": q[0], "p90_ms": q[-1]}


def per_call_us(fn, calls: int = 200, reps: int = 7) -> float:
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    runs = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        torch.cuda.synchronize()
        runs.append(start.elapsed_time(end) * 1e3 / calls)
    return statistics.median(runs)


def gpu_us(fn, reps: int = 100) -> float:
    return device_ms(fn, reps=reps, warmup=10)["median_ms"] * 1e3


def ratios_to_copy(x: torch.Tensor, fns: dict, rounds: int, reps: int = 20, alternate: bool = False) -> dict:
    """Interleaved rounds, each timing a copy of x (`copy_baseline_ms`) and then every fn: {key: [copy
    time / fn time, one per round]}. A fn's ratios spread over 0.5-1 % between rounds; ranking by
    their median is what the sweep's --confirm and the probes do. `alternate`: every other round times
    the fns in reverse order (no fn always runs first after the copy)."""
    ratios = {k: [] for k in fns}
    for rnd in range(rounds):
        copy = copy_baseline_ms(x, reps=reps)["median_ms"]
        keys = list(fns)
        for k in (keys[::-1] if alternate and rnd % 2 else keys):
            ratios[k].append(copy / device_ms(fns[k], reps=reps)["median_ms"])
    return ratios


def copy_baseline_ms(x: torch.Tensor, reps: int = 40) -> dict:
    dsts = [torch.empty_like(x) for _ in range(2)]
    variants = {"clone": device_ms(lambda: x.clone(), reps)["median_ms"]}
    for i, d in enumerate(dsts):
        variants[f"copy_{i}"] = device_ms(lambda: d.copy_(x), reps)["median_ms"]
    return {"median_ms": min(variants.values()), "variants_ms": variants}

