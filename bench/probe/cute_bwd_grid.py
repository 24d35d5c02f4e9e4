"""Probe: the tma_smem_cached backward's persistent grid at one CTA per SM (the launch's) against k per
SM (k x the clusters that fit one CTA an SM), with and without dh (the residual add's backward), bf16,
each as a ratio to a same-run copy (bytes: x, dy and dx, and dh: 1.5 or 2 x the copy's), medians of
--rounds interleaved rounds; every config's dx and dw checked first.

    python bench/probe/cute_bwd_grid.py [--ns 12288,16384,18432,20480,24576,32768] [--ks 1,2] [--rounds 3]
"""
from __future__ import annotations

import os
import statistics
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from bench.probe.common import backward_case, backward_close, ints, no_gpu, width_parser, write_json  # noqa: E402
from bench.timing import copy_baseline_ms, device_ms  # noqa: E402
from cutile_norms._platform import device_info  # noqa: E402
from cutile_norms.cute import rmsnorm_bwd as B  # noqa: E402
from cutile_norms.cute.rmsnorm_bwd_config import device_config, ring_stages  # noqa: E402


def main() -> int:
    p = width_parser(__doc__, [12288, 16384, 18432, 20480, 24576, 32768])
    p.add_argument("--ks", type=ints, default=[1, 2])
    args = p.parse_args()
    if no_gpu():
        return 0
    dev = device_info(torch.device("cuda"))
    one_per_sm = B.max_clusters
    print(f"# {torch.cuda.get_device_name()}, ring slots {ring_stages(dev)}", flush=True)
    rows = {}
    try:
        for N in args.ns:
            M, x, w, dy, rstd, dx_ref, dw_ref = backward_case(N)
            dh = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
            for has_dh in (False, True):
                cfg = device_config(N, 2, dev, streams=3 if has_dh else 2)
                times = {k: [] for k in args.ks}
                for rnd in range(args.rounds):
                    copy = copy_baseline_ms(x, reps=20)["median_ms"]
                    for k in args.ks:
                        B.max_clusters = lambda i, c, s, k=k: k * one_per_sm(i, c, s)
                        def run(cfg=cfg, has_dh=has_dh):
                            return B.launch(cfg, dy, x, w, rstd, 0.0, True, True, dev.sm_count,
                                            dh2d=dh if has_dh else None)
                        if rnd == 0:
                            dx, dw = run()
                            ref = dx_ref.float() + (dh.float() if has_dh else 0)
                            if not backward_close(dx, dw, ref, dw_ref):
                                print(f"N={N} dh={has_dh} k={k}: WRONG", flush=True)
                        times[k].append((2.0 if has_dh else 1.5) * copy / device_ms(run, reps=20)["median_ms"])
                    B.max_clusters = one_per_sm
                med = {k: statistics.median(v) for k, v in times.items()}
                rows[f"{N}{' dh' if has_dh else ''}"] = {"config": cfg.short(), "vs_copy": med}
                print(f"N={N:>6} {'dh' if has_dh else '  '} {cfg.short():<48} "
                      + "  ".join(f"{k}/SM {v:.3f}" for k, v in med.items()), flush=True)
            del x, dy, dh, dx_ref
            torch.cuda.empty_cache()
    finally:
        B.max_clusters = one_per_sm
    write_json(args.out, {"gpu": torch.cuda.get_device_name(), "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
