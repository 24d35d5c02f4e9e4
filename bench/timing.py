"""Timing on the GPU: CUDA-event medians with the L2 flushed before every repetition.

Two clocks:
  * `device_ms`: back-to-back calls (the CPU runs ahead), so only GPU time counts: throughput.
  * `caller_us`: the GPU idles before each call, so the host work of the call (Python, launch) is in
    the measured interval: the latency a caller sees for one eager call (the small-M sweep).
"""
from __future__ import annotations

import statistics

import torch

_flush_buffer = None


def _flush_l2() -> None:
    global _flush_buffer
    if _flush_buffer is None:
        l2 = getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 64 << 20)
        _flush_buffer = torch.empty(max(2 * l2, 256 << 20), dtype=torch.int8, device="cuda")
    _flush_buffer.zero_()


def _timed(fn, reps: int, warmup: int, idle_before: bool) -> list[float]:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for start, end in events:
        _flush_l2()
        if idle_before:
            torch.cuda.synchronize()
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return [s.elapsed_time(e) for s, e in events]


def device_ms(fn, reps: int = 40, warmup: int = 3) -> dict:
    t = _timed(fn, reps, warmup, idle_before=False)
    q = statistics.quantiles(t, n=10)
    return {"median_ms": statistics.median(t), "p10_ms": q[0], "p90_ms": q[-1]}


def caller_us(fn, reps: int = 100, warmup: int = 10) -> dict:
    t = _timed(fn, reps, warmup, idle_before=True)
    q = statistics.quantiles(t, n=10)
    return {"median_us": 1e3 * statistics.median(t), "p10_us": 1e3 * q[0], "p90_us": 1e3 * q[-1]}
