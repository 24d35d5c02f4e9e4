"""Probe: why rows split over Triton programs run slow in the forward (docs/history.md, "The Triton
mode, second round"). A minimal split forward, one program per (row, part), each part in registers,
with the exchange of the partial sums of squares cut down step by step:

    WAIT 0: no exchange (each part normalises by its own sum: wrong y, the same bytes moved)
    WAIT 1: publish the partial with one relaxed atomic exchange, no wait
    WAIT 2: publish, then poll the row's slots with volatile loads (the library's exchange)
    WAIT 3: publish, then poll with relaxed gpu-scope atomics (adding 0)
    and, with WAIT 3, one by one what the library's kernel has besides: the weight's part loaded before
    x (EARLY_W), the tile loop (LOOP, one trip), masked loads and stores (MASK), the rstd store

    python bench/probe/triton_split_wait.py [--ns 65536,262144] [--splits 8,16,32]
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
import triton
import triton.language as tl

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from bench.probe.common import no_gpu  # noqa: E402
from bench.timing import copy_baseline_ms, device_ms  # noqa: E402


@triton.jit
def split_fwd(X, W, Y, RSTD, SLOTS, M, N, eps, PART: tl.constexpr, SPLIT: tl.constexpr, WAIT: tl.constexpr,
              EARLY_W: tl.constexpr, LOOP: tl.constexpr, MASK: tl.constexpr, STORE_RSTD: tl.constexpr):
    pid = tl.program_id(0)
    part = pid % SPLIT
    cols = part * PART + tl.arange(0, PART)
    col_ok = cols < N
    if EARLY_W:
        if MASK:
            w = tl.load(W + cols, mask=col_ok, other=0.0).to(tl.float32)
        else:
            w = tl.load(W + cols).to(tl.float32)
    first = pid // SPLIT
    last = first + 1
    step = 1
    if LOOP:  # the library's tile loop (one trip here)
        last = M
        step = tl.num_programs(0) // SPLIT
    for row in range(first, last, step):
        if MASK:
            x = tl.load(X + tl.cast(row, tl.int64) * N + cols, mask=col_ok & (row < M), other=0.0).to(tl.float32)
        else:
            x = tl.load(X + tl.cast(row, tl.int64) * N + cols).to(tl.float32)
        own = SLOTS + tl.cast(row, tl.int64) * SPLIT + part
        prev = tl.load(own, volatile=True)
        flag = 1 - (prev >> 32)
        ss = tl.sum(x * x, axis=0)
        if WAIT >= 1:
            lo = ss.to(tl.int32, bitcast=True).to(tl.int64) & 0xFFFFFFFF
            tl.atomic_xchg(own, (flag << 32) | lo, sem="relaxed", scope="gpu")
        if WAIT >= 2:
            idx = SLOTS + tl.cast(row, tl.int64) * SPLIT + tl.arange(0, SPLIT)
            if WAIT == 2:
                s = tl.load(idx, volatile=True)
            else:
                s = tl.atomic_add(idx, tl.zeros([SPLIT], dtype=tl.int64), sem="relaxed", scope="gpu")
            done = tl.min(((s >> 32) == flag).to(tl.int32))
            while done == 0:
                if WAIT == 2:
                    s = tl.load(idx, volatile=True)
                else:
                    s = tl.atomic_add(idx, tl.zeros([SPLIT], dtype=tl.int64), sem="relaxed", scope="gpu")
                done = tl.min(((s >> 32) == flag).to(tl.int32))
            ss = tl.sum((s & 0xFFFFFFFF).to(tl.int32).to(tl.float32, bitcast=True), axis=0)
        rstd = tl.rsqrt(ss / N + eps)
        if not EARLY_W:
            w = tl.load(W + cols).to(tl.float32)
        if MASK:
            tl.store(Y + tl.cast(row, tl.int64) * N + cols, (x * rstd * w).to(Y.dtype.element_ty),
                     mask=col_ok & (row < M))
        else:
            tl.store(Y + tl.cast(row, tl.int64) * N + cols, (x * rstd * w).to(Y.dtype.element_ty))
        if STORE_RSTD:
            tl.store(RSTD + row, rstd, mask=part == 0)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ns", type=lambda s: [int(v) for v in s.split(",")], default=[65536, 262144])
    p.add_argument("--splits", type=lambda s: [int(v) for v in s.split(",")], default=[8, 16, 32])
    args = p.parse_args()
    if no_gpu():
        return 0
    for N in args.ns:
        M = (1 << 27) // N
        x = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(N, device="cuda", dtype=torch.bfloat16)
        y = torch.empty_like(x)
        rstd = torch.empty(M, device="cuda", dtype=torch.float32)
        copy = copy_baseline_ms(x, reps=20)["median_ms"]
        ref = (x.float() * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + 1e-6) * w.float())
        for split in args.splits:
            part = N // split
            for warps in (4, 8, 16):
                if part // (warps * 32) < 8 or part // (warps * 32) > 32:
                    continue
                for wait, early_w, loop, mask, store_rstd in (
                        (0, False, False, False, False), (3, False, False, False, False),
                        (3, True, False, False, False), (3, False, True, False, False),
                        (3, False, False, True, False), (3, False, False, False, True),
                        (3, True, True, True, True)):
                    slots = torch.zeros(M * split, dtype=torch.int64, device="cuda")

                    def run():
                        split_fwd[(M * split,)](x, w, y, rstd, slots, M, N, 1e-6, PART=part, SPLIT=split, WAIT=wait,
                                                EARLY_W=early_w, LOOP=loop, MASK=mask, STORE_RSTD=store_rstd,
                                                num_warps=warps, num_stages=1)
                    run()
                    ok = wait < 2 or torch.allclose(y.float(), ref, rtol=2e-2, atol=2e-2)
                    r = copy / device_ms(run, reps=20)["median_ms"]
                    print(f"N={N:>6} split {split:>2} part {part:>5} {warps:>2} warps WAIT {wait} early_w {early_w:d} "
                          f"loop {loop:d} mask {mask:d} rstd {store_rstd:d}: {r:.3f}{'' if ok else ' WRONG'}", flush=True)
        del x, y, ref
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
