"""Probe (run under ncu): one launch of each config, to read DRAM bytes, L2 hit rate and occupancy.

    ncu --clock-control none --metrics <list> python3 bench/probe/dram_traffic.py
    ncu --clock-control none --section SpeedOfLight --section Occupancy --section WarpStateStats \\
        --section SchedulerStats python3 bench/probe/dram_traffic.py --table bfloat16:32768,float32:65536

Without --table: the cases of the 2026-11-21 wide-row study (item 7 of bench/NOTES.md). With --table DTYPE:N,...: a
copy (x.clone) and the config mode=None runs at full size (M = 2^27 / N) for each.
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.getcwd())
from cutile_norms.cutile.rmsnorm_fwd import FwdConfig, default_config, launch  # noqa: E402

C = FwdConfig
CASES = [
    ("bfloat16", 65536, None),
    ("bfloat16", 65536, C("reload", chunk=4096, latency=10)),
    ("bfloat16", 65536, C("reload", chunk=2048, latency=10, persistent=True, blocks_per_sm=3)),
    ("bfloat16", 65536, C("reload", chunk=2048, latency=3)),
    ("bfloat16", 16384, C("reload", chunk=2048, latency=1)),
    ("bfloat16", 16384, C("cached", piece_min=16384, num_worker_warps=8)),
    ("bfloat16", 32768, C("cached", piece_min=32768, persistent=True, blocks_per_sm=1, latency=10, num_worker_warps=8)),
]


def table_cases(spec: str) -> list:
    from cutile_norms._platform import device_info, toolchain
    from cutile_norms.dispatch import choose_forward

    dev, out = device_info("cuda"), []
    for item in spec.split(","):
        dname, n = item.split(":")
        dtype, N = getattr(torch, dname), int(n)
        mode = choose_forward(dev, toolchain(), dtype, (1 << 27) // N, N).mode
        out += [(dname, N, None), (dname, N, default_config(mode, N, dtype.itemsize, dev, dname))]
    return out


p = argparse.ArgumentParser()
p.add_argument("--table", default=None)
args = p.parse_args()
for dname, N, cfg in (table_cases(args.table) if args.table else CASES):
    dtype = getattr(torch, dname)
    x = torch.randn((1 << 27) // N, N, device="cuda").to(dtype)
    w = torch.ones(N, device="cuda", dtype=dtype)
    torch.cuda.synchronize()
    print(f"case {dname} N={N} {cfg.short() if cfg else 'copy (x.clone)'}", flush=True)
    if cfg is None:
        x.clone()
    else:
        launch(cfg, x, w, 1e-6, 0.0, False, torch.cuda.get_device_properties(0).multi_processor_count)
    torch.cuda.synchronize()
