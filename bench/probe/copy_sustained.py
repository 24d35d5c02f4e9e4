"""Probe: does the copy baseline drift under sustained load? Copies for ~60 s, printing GB/s of
x.clone() and of one RMSNorm kernel every few seconds, with the SM/memory clocks and power."""
import os
import statistics
import subprocess
import sys
import time

import torch
sys.path.insert(0, os.getcwd())
import cutile_norms as cn

x = torch.randn((1 << 27) // 4096, 4096, device="cuda").to(torch.bfloat16)
w = torch.ones(4096, device="cuda", dtype=torch.bfloat16)
buf = torch.empty(256 << 20, dtype=torch.int8, device="cuda")
def gbps(fn, reps=20):
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for s, e in ev:
        buf.zero_(); s.record(); fn(); e.record()
    torch.cuda.synchronize()
    return 2 * x.numel() * 2 / (statistics.median(s.elapsed_time(e) for s, e in ev) * 1e-3) / 1e9
t0 = time.time()
while time.time() - t0 < 65:
    c = gbps(lambda: x.clone()); k = gbps(lambda: cn.rms_norm(x, w, mode="multi_wave_cached"))
    for _ in range(300):  # sustained load between samples
        x.clone()
    q = subprocess.run(["nvidia-smi", "--query-gpu=clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_throttle_reasons.active",
                        "--format=csv,noheader"], capture_output=True, text=True).stdout.strip()
    print(f"t={time.time()-t0:5.1f}s clone {c:.0f} GB/s  cached {k:.0f} GB/s  [{q}]", flush=True)
