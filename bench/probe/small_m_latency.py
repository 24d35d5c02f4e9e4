"""Probe: where do the small-M microseconds go? (N = 4096, M in {1, 64}, GPU time, L2 flushed.)

Compares torch's copy with a cuTile kernel that only copies (gather a row, scatter it: the floor of
a cuTile launch that moves the same bytes, with no reduction and no shared memory), then the cached
kernel's configs and rms_norm. Prints microseconds and the ratio to torch's clone.

    python bench/probe/small_m_latency.py [--dtype bfloat16]
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

import cuda.tile as ct  # noqa: E402

import cutile_norms as cn  # noqa: E402
from bench.rmsnorm import DTYPES  # noqa: E402
from bench.timing import gpu_us  # noqa: E402
from cutile_norms._platform import device_info  # noqa: E402
from cutile_norms.cutile.rmsnorm_fwd import FwdConfig, launch  # noqa: E402


@ct.kernel
def copy_rows_kernel(mX, mY, N: ct.Constant[int]):
    cols = ct.arange(N, dtype=ct.int32) + ct.bid(0) * N
    ct.scatter(mY, cols, ct.gather(mX, cols, check_bounds=False, latency=1), check_bounds=False, latency=1)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--dtype", default="bfloat16")
    args = p.parse_args()
    dtype, N = DTYPES[args.dtype], 4096
    dev = device_info("cuda")
    raw = torch.cuda.current_stream().cuda_stream
    for M in (1, 64):
        x = torch.randn(M, N, device="cuda", dtype=dtype)
        w = (1 + 0.1 * torch.randn(N, device="cuda")).to(dtype)
        y = torch.empty_like(x)
        rows = {"torch clone": lambda: x.clone(), "torch copy_": lambda: y.copy_(x),
                "cuTile copy kernel": lambda: ct.launch(raw, (M,), copy_rows_kernel, (x.view(-1), y.view(-1), N))}
        for tm in (1, 2):
            for nww in (None, 8):
                cfg = FwdConfig("cached", tile_m=tm, piece_min=2048, num_worker_warps=nww)
                rows[cfg.short()] = (lambda c: lambda: launch(c, x, w, 1e-6, 0.0, False, dev.sm_count))(cfg)
        rows["cached, no weight"] = lambda: launch(FwdConfig("cached", piece_min=2048), x, None, 1e-6, 0.0, False,
                                                   dev.sm_count)
        rows["reload chunk=1024"] = lambda: launch(FwdConfig("reload", chunk=1024), x, w, 1e-6, 0.0, False,
                                                   dev.sm_count)
        rows["rms_norm(mode=None)"] = lambda: cn.rms_norm(x, w)
        rows["rms_norm(multi_wave_cached)"] = lambda: cn.rms_norm(x, w, mode="multi_wave_cached")
        base = None
        for name, fn in rows.items():
            us = gpu_us(fn, reps=200)
            base = base or us
            print(f"M={M:>3} {name:<60} {us:6.2f} us  {us / base:5.2f}x clone", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
