"""Probe (run under ncu): one launch of each config, to read DRAM bytes, L2 hit rate and occupancy.

    ncu --clock-control none --metrics <list> python3 bench/probe/dram_traffic.py
"""
import os
import sys

import torch

sys.path.insert(0, os.getcwd())
from cutile_norms.cutile.rmsnorm_fwd import FwdConfig, launch  # noqa: E402

C = FwdConfig
CASES = [
    (65536, None),
    (65536, C("reload", chunk=4096, latency=10)),
    (65536, C("reload", chunk=2048, latency=10, persistent=True, blocks_per_sm=3)),
    (65536, C("reload", chunk=2048, latency=3)),
    (16384, C("reload", chunk=2048, latency=1)),
    (16384, C("cached", piece_min=16384, num_worker_warps=8)),
    (32768, C("cached", piece_min=32768, persistent=True, blocks_per_sm=1, latency=10, num_worker_warps=8)),
]
for N, cfg in CASES:
    x = torch.randn((1 << 27) // N, N, device="cuda").to(torch.bfloat16)
    w = torch.ones(N, device="cuda", dtype=torch.bfloat16)
    torch.cuda.synchronize()
    print(f"case N={N} {cfg.short() if cfg else 'copy (x.clone)'}", flush=True)
    if cfg is None:
        x.clone()
    else:
        launch(cfg, x, w, 1e-6, 0.0, False, torch.cuda.get_device_properties(0).multi_processor_count)
    torch.cuda.synchronize()
