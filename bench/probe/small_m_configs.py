"""Probe: which launch config is fastest for a few rows (M below the SM count), and what the weight costs.

For N in --ns and M in --ms (bf16 by default): GPU time (L2 flushed, CUDA-event median) of torch's
copy, then the cached kernel over warps per block, piece size, packing and latency hints, with and
without a weight, and with the weight placed right after x in one allocation (same pages: does a
separate weight allocation cost a TLB walk?). Prints microseconds and the ratio to the copy.

    python bench/probe/small_m_configs.py [--dtype bfloat16] [--ns 1024,4096,16384] [--ms 1,64]
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

import cutile_norms as cn  # noqa: E402
from bench.rmsnorm import DTYPES, check_output  # noqa: E402
from bench.timing import gpu_us  # noqa: E402
from bench.probe.common import no_gpu  # noqa: E402
from cutile_norms._platform import device_info  # noqa: E402
from cutile_norms.cutile.rmsnorm_fwd import FwdConfig, cached_piece_min, launch  # noqa: E402


def configs(N: int, e: int) -> list[FwdConfig]:
    pm = cached_piece_min(N)
    out = []
    for nww in (None, 8):  # other warp counts need tileiras 13.5
        for packed in ((False, True) if e == 2 else (False,)):
            out.append(FwdConfig("cached", piece_min=pm, packed=packed, num_worker_warps=nww))
    for lat in (3, 10):
        out.append(FwdConfig("cached", piece_min=pm, latency=lat))
    if pm > 1024:
        out.append(FwdConfig("cached", piece_min=pm // 2))
    out.append(FwdConfig("reload", chunk=min(pm, 8192 // e)))
    return out


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--ns", type=lambda s: [int(v) for v in s.split(",")], default=[1024, 4096, 16384])
    p.add_argument("--ms", type=lambda s: [int(v) for v in s.split(",")], default=[1, 64])
    args = p.parse_args()
    if no_gpu():
        return 0
    dtype = DTYPES[args.dtype]
    dev = device_info("cuda")
    for N in args.ns:
        for M in args.ms:
            x = torch.randn(M, N, device="cuda", dtype=dtype)
            w = (1 + 0.1 * torch.randn(N, device="cuda")).to(dtype)
            both = torch.cat([x.view(-1), w])  # w right after x: one allocation
            xb, wb = both[:M * N].view(M, N), both[M * N:]
            copy = gpu_us(lambda: x.clone(), reps=200)
            print(f"N={N:>6} M={M:>3} {'torch clone':<72} {copy:6.2f} us", flush=True)
            rows = {}
            for cfg in configs(N, x.element_size()):
                rows[cfg.short()] = (lambda c: lambda: launch(c, x, w, 1e-6, 0.0, False, dev.sm_count)[0])(cfg)
            base = FwdConfig("cached", piece_min=cached_piece_min(N))
            rows["(base) no weight"] = lambda: launch(base, x, None, 1e-6, 0.0, False, dev.sm_count)[0]
            rows["(base) weight after x, one allocation"] = lambda: launch(base, xb, wb, 1e-6, 0.0, False,
                                                                           dev.sm_count)[0]
            rows["rms_norm(mode=None)"] = lambda: cn.rms_norm(x, w)
            for name, fn in rows.items():
                try:
                    wrong = check_output(fn(), x, w, 1e-6) if "no weight" not in name else None
                    us = gpu_us(fn, reps=200)
                    print(f"N={N:>6} M={M:>3} {name:<72} {us:6.2f} us {us / copy:5.2f}x copy"
                          + (f"  WRONG: {wrong}" if wrong else ""), flush=True)
                except Exception as exc:
                    print(f"N={N:>6} M={M:>3} {name:<72} failed: {type(exc).__name__}: {str(exc)[:100]}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
