"""Fused residual backward launch sweep (rows x warps x persistent programs), bf16, ratio to a copy of its bytes."""
import os, sys, statistics, itertools
sys.path.insert(0, os.getcwd())
os.environ["CUTILE_NORMS_EXPERIMENTAL"] = "1"
import torch, triton
import cutile_norms
from bench.timing import ratios_to_copy
import importlib
K = importlib.import_module("cutile_norms.experimental.triton_add_rmsnorm")
sm = torch.cuda.get_device_properties(0).multi_processor_count
for N in [int(v) for v in sys.argv[1].split(",")]:
    M = (1 << 27) // N
    h = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
    dy, dh = torch.randn_like(h), torch.randn_like(h)
    w = (1 + 0.1 * torch.randn(N, device="cuda")).to(torch.bfloat16)
    rstd = torch.rand(M, device="cuda") + 0.5
    g = torch.empty_like(h)
    block = triton.next_power_of_2(N)
    fns = {}
    for rows, warps, per_sm in itertools.product([1, 2, 4, 8], [2, 4, 8, 16], [2, 4, 8]):
        vals = block * rows // (warps * 32)
        if block * rows > 16384 or vals < 4 or vals > 64:
            continue
        programs = min(-(-M // rows), per_sm * sm)
        parts = torch.empty(programs, N, dtype=torch.float32, device="cuda")
        def fn(rows=rows, warps=warps, programs=programs, parts=parts):
            K.add_rms_norm_bwd_kernel[(programs,)](dy, dh, h, w, rstd, g, parts, M, N, N, N, 0.0, N, BLOCK_N=block,
                ROWS=rows, HAS_W=True, HAS_DH=True, NEED_DW=True, INT64=False, num_warps=warps)
            parts.sum(0)
        fns[f"r{rows} w{warps} p{per_sm}"] = fn
    r = ratios_to_copy(h, fns, 3)
    med = sorted(((k, 2 * statistics.median(v)) for k, v in r.items()), key=lambda kv: -kv[1])
    cur_rows = max(1, min(16, 2048 // block)); cur_w = max(1, min(16, block * cur_rows // 256))
    cur = dict(med).get(f"r{cur_rows} w{cur_w} p4")
    print(f"N={N} current {cur}  best " + "  ".join(f"{k} {v:.3f}" for k, v in med[:8]), flush=True)
