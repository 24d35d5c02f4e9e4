"""FP8 kernel launch sweep: (rows, warps) and IEEE division vs reciprocal multiply, token scales, bf16."""
import os, sys, re, importlib, statistics, itertools
sys.path.insert(0, os.getcwd())
os.environ["CUTILE_NORMS_EXPERIMENTAL"] = "1"
import torch, triton
import cutile_norms
from bench.timing import ratios_to_copy
from cutile_norms.reference import FP8_MAX, FP8_MIN_AMAX
src = open("experimental/triton_rmsnorm_fp8.py").read()
src2 = src.replace("q = tl.math.div_rn(y, s)", "q = y * tl.math.div_rn(1.0, s)")
assert src2 != src
os.makedirs("scratch/gen", exist_ok=True)
open("scratch/gen/fp8_recip.py", "w").write(src2)
sys.path.insert(0, "scratch/gen")
base = importlib.import_module("cutile_norms.experimental.triton_rmsnorm_fp8")
recip = importlib.import_module("fp8_recip")
out = []
for N in [int(v) for v in sys.argv[1].split(",")]:
    M = (1 << 27) // N
    x = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
    w = (1 + 0.1 * torch.randn(N, device="cuda")).to(torch.bfloat16)
    block = triton.next_power_of_2(N)
    q = torch.empty(M, N, dtype=torch.float8_e4m3fn, device="cuda")
    rstd = torch.empty(M, dtype=torch.float32, device="cuda"); s = torch.empty(M, dtype=torch.float32, device="cuda")
    fns = {}
    for mod, tag in ((base, "div"), (recip, "rcp")):
        for rows, warps in itertools.product([1, 2, 4, 8], [2, 4, 8, 16, 32]):
            if block * rows > 16384 or warps * 32 * 4 > block * rows or block * rows // (warps * 32) > 64:
                continue
            def fn(mod=mod, rows=rows, warps=warps):
                mod.rms_norm_fp8_kernel[(-(-M // rows),)](x, x, w, q, q, s, rstd, rstd, M, N, N, 1e-6, 0.0, 0.0, N,
                    BLOCK_N=block, ROWS=rows, GROUP=0, STATIC=False, HAS_R=False, HAS_W=True, HAS_UB=False, UE8M0=False,
                    TOP=448.0, MIN_AMAX=FP8_MIN_AMAX, INT64=False, num_warps=warps)
            fns[f"{tag} r{rows} w{warps}"] = fn
    r = ratios_to_copy(x, fns, 3)
    med = {k: 0.75 * statistics.median(v) for k, v in r.items()}
    best = sorted(med.items(), key=lambda kv: -kv[1])
    print(f"N={N} " + "  ".join(f"{k} {v:.3f}" for k, v in best[:8]), flush=True)
    print(f"N={N} worst " + "  ".join(f"{k} {v:.3f}" for k, v in best[-3:]), flush=True)
