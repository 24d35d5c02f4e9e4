"""Probe: does running some kernel leave the GPU in a state where x.clone() is slower?
Copy GB/s before/after each suspect, then after cuCtxResetPersistingL2Cache."""
import statistics, sys, os
import torch
sys.path.insert(0, os.getcwd())
import cutile_norms as cn
from cutile_norms.cutile.rmsnorm_fwd import FwdConfig, launch

buf = torch.empty(256 << 20, dtype=torch.int8, device="cuda")
def copy_gbps(N=4096, reps=20):
    x = torch.randn((1 << 27) // N, N, device="cuda").to(torch.bfloat16)
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for _ in range(3): x.clone()
    for s, e in ev:
        buf.zero_(); s.record(); x.clone(); e.record()
    torch.cuda.synchronize()
    return round(2 * x.numel() * 2 / (statistics.median(s.elapsed_time(e) for s, e in ev) * 1e-3) / 1e9)

def reset_l2():
    from cuda.bindings import driver
    print("   reset:", driver.cuCtxResetPersistingL2Cache())

def run(name, fn, N):
    x = torch.randn((1 << 27) // N, N, device="cuda").to(torch.bfloat16); w = torch.ones(N, device="cuda", dtype=torch.bfloat16)
    for _ in range(20): fn(x, w)
    torch.cuda.synchronize()
    print(f"after {name:<40} copy {copy_gbps()}", flush=True)

print("start copy", copy_gbps(), flush=True)
from tilegym.ops.cutile.rms_norm import rms_norm as tg
from quack.rmsnorm import rmsnorm as qk
suspects = [
    ("cn cached N=4096", lambda x, w: cn.rms_norm(x, w, mode="multi_wave_cached"), 4096),
    ("cn reload N=65536", lambda x, w: cn.rms_norm(x, w, mode="multi_wave_reload"), 65536),
    ("cn cluster4 N=32768", lambda x, w: launch(FwdConfig("cached", num_ctas=4, num_worker_warps=8), x, w, 1e-6, 0.0, False, 132), 32768),
    ("quack N=128", lambda x, w: qk(x, w, eps=1e-6), 128),
    ("tilegym static_persistent N=128", lambda x, w: tg(x, (x.shape[-1],), w, 1e-6, mode="static_persistent"), 128),
]
for name, fn, N in suspects:
    run(name, fn, N)
reset_l2()
print("after reset copy", copy_gbps(), flush=True)
run("tilegym static_persistent N=128 again", suspects[-1][1], 128)
reset_l2()
print("after reset copy", copy_gbps(), flush=True)
