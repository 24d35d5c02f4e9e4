"""Probe: what a per-launch workspace fill would cost the split kernel (N = 65536 and 262144, M = 2^27 / N).

The kernel keeps its slots between launches (a sign bit flips per launch). Before that, a torch fill
kernel cleared them before every launch. Timed (GPU time, L2 flushed, CUDA-event medians): the
launch as shipped, and the same launch preceded by a fill of the same size inside the timed region
(the old scheme's cost); ratios to a same-run copy.

    python bench/probe/split_fill_cost.py [--dtype bfloat16]
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from bench.rmsnorm import DTYPES  # noqa: E402
from bench.timing import copy_baseline_ms, device_ms  # noqa: E402
from cutile_norms._platform import device_info  # noqa: E402
from cutile_norms.cutile import rmsnorm_fwd as F  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--dtype", default="bfloat16")
    args = p.parse_args()
    dtype = DTYPES[args.dtype]
    dev = device_info("cuda")
    for N, split in ((65536, 8), (262144, 16)):
        M = (1 << 27) // N
        x = torch.randn(M, N, device="cuda", dtype=dtype)
        w = torch.randn(N, device="cuda", dtype=dtype)
        e = x.element_size()
        cfg = F.FwdConfig("split", split=split, piece_min=F.cached_piece_min(F.split_part(N, split)), packed=e == 2,
                          occupancy=8 if e == 2 else 4)
        copy = copy_baseline_ms(x)["median_ms"]
        y, _ = F.output_buffers(M, N, dtype, x.device, False)
        shipped = device_ms(lambda: F.launch(cfg, x, w, 1e-6, 0.0, False, dev.sm_count, out=(y, None)))["median_ms"]
        old = device_ms(lambda: (torch.full((M * split,), -1.0, device="cuda"),
                                 F.launch(cfg, x, w, 1e-6, 0.0, False, dev.sm_count, out=(y, None))))["median_ms"]
        print(f"N={N} {args.dtype} {cfg.short()}: copy {copy * 1e3:.1f} us; shipped {shipped * 1e3:.1f} us "
              f"({copy / shipped:.3f}x copy); with a fill per launch {old * 1e3:.1f} us ({copy / old:.3f}x)",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
