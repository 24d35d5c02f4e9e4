"""Probe: what the split kernel's per-launch workspace fill costs (N = 65536 and 262144, M = 2^27 / N).

The workspace of partial sums is filled with -1 by a torch fill kernel before every launch. Timed
(GPU time, L2 flushed, CUDA-event medians): the whole launch (fill + kernel), the kernel alone on a
workspace filled before the start event, and the fill alone; ratios to a same-run copy.

    python bench/probe/split_fill_cost.py [--dtype bfloat16]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

import cuda.tile as ct  # noqa: E402

from bench.rmsnorm import DTYPES  # noqa: E402
from bench.timing import _flush_l2, copy_baseline_ms  # noqa: E402
from cutile_norms._platform import device_info  # noqa: E402
from cutile_norms.cutile import rmsnorm_fwd as F  # noqa: E402


def timed(fn, before=None, reps=40) -> float:
    for _ in range(3):
        (before or (lambda: None))()
        fn()
    torch.cuda.synchronize()
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for s, e in ev:
        _flush_l2()
        if before:
            before()
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in ev)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--dtype", default="bfloat16")
    args = p.parse_args()
    dtype = DTYPES[args.dtype]
    dev = device_info("cuda")
    stream = torch.cuda.current_stream().cuda_stream
    for N, split in ((65536, 8), (262144, 16)):
        M = (1 << 27) // N
        x = torch.randn(M, N, device="cuda", dtype=dtype)
        w = torch.randn(N, device="cuda", dtype=dtype)
        e = x.element_size()
        cfg = F.FwdConfig("split", split=split, piece_min=F.cached_piece_min(F.split_part(N, split)), packed=e == 2,
                          occupancy=8 if e == 2 else 4)
        copy = copy_baseline_ms(x)["median_ms"]
        y, _ = F.output_buffers(M, N, dtype, x.device, False)
        kernel, consts = F._prepared(cfg, N, 16 // e, True, False)
        sync = F._sync_workspace(M, split, x.device)
        args_ = (x.view(-1), w, y.view(-1), y.view(-1), sync, M, N, 1e-6, 0.0) + consts
        whole = timed(lambda: F.launch(cfg, x, w, 1e-6, 0.0, False, dev.sm_count, out=(y, None)))
        alone = timed(lambda: ct.launch(stream, (M * split,), kernel, args_), before=lambda: sync.fill_(-1.0))
        fill = timed(lambda: sync.fill_(-1.0))
        print(f"N={N} {args.dtype} {cfg.short()}: copy {copy * 1e3:.1f} us; fill+kernel {whole * 1e3:.1f} us "
              f"({copy / whole:.3f}x copy); kernel alone {alone * 1e3:.1f} us ({copy / alone:.3f}x); "
              f"fill alone {fill * 1e3:.1f} us", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
