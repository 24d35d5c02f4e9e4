"""A fresh process's first rms_norm call at N=4096, M=1: wall time per stage and a profile of the slowest."""
import time, sys, os, cProfile, pstats, io
t0 = time.perf_counter()
import torch
torch.cuda.init(); x = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16); w = torch.randn(4096, device="cuda", dtype=torch.bfloat16)
torch.cuda.synchronize(); t1 = time.perf_counter()
sys.path.insert(0, os.getcwd())
import cutile_norms as cn
t2 = time.perf_counter()
pr = cProfile.Profile(); pr.enable()
with torch.no_grad():
    y = cn.rms_norm(x, w)
torch.cuda.synchronize(); pr.disable(); t3 = time.perf_counter()
with torch.no_grad():
    y = cn.rms_norm(x, w)
torch.cuda.synchronize(); t4 = time.perf_counter()
print(f"torch+cuda init {t1-t0:.2f}s  import cutile_norms {t2-t1:.2f}s  first call {t3-t2:.2f}s  second {1e3*(t4-t3):.2f}ms  mode {cn.explain(x, w).splitlines()[0][:100]}")
s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats("cumulative").print_stats(25); print(s.getvalue()[:5000])
