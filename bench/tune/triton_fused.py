"""Sweep: the fused Triton kernels' launch configs at the bench size (bf16, 2^27 elements), each as a
ratio to a copy of its own bytes in the same run, medians of 3 interleaved rounds. What the launch
rules in cutile_norms/triton/rmsnorm_fp8_config.py and add_rmsnorm_bwd_config.py were read from (their
docstrings give the numbers), and the check of add_rmsnorm_fwd_config.py's (docs/performance.md 2.44):
  fp8: rms_norm_fp8_kernel, per-token scales, rows x warps with the row in registers (q = y * (1/s));
  bwd: add_rms_norm_bwd_kernel (the fused residual backward, dw included), rows x warps x programs per SM;
  fwd: add_rms_norm_fwd_kernel (the fused residual forward, rstd not stored), rows x warps, the row in registers.

    python bench/tune/triton_fused.py --kernel fp8|bwd|fwd [--ns 2048,4096,5120,8192,12288,16384]
"""
from __future__ import annotations

import argparse
import importlib
import itertools
import os
import statistics
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from bench.probe.common import no_gpu  # noqa: E402
from bench.timing import ratios_to_copy  # noqa: E402
from bench.tune.sweep import width_inputs  # noqa: E402
from cutile_norms._util import pow2_ceil  # noqa: E402
from cutile_norms.reference import FP8_MIN_AMAX  # noqa: E402
from cutile_norms.triton.tiling import offset_align  # noqa: E402


def candidates(N, M, x, w, kernel, sm):
    """{name: fn} over the grid, and the bytes over the copy's (fp8: read 2, write 1 per element;
    bwd: read dy, dh, h, write the grad; fwd: read x and r, write h and y: twice the copy's)."""
    block, fns = pow2_ceil(N), {}
    if kernel == "fwd":
        K = importlib.import_module("cutile_norms.triton.add_rmsnorm_fwd_kernel").add_rms_norm_fwd_kernel
        r, y, h = torch.randn_like(x), torch.empty_like(x), torch.empty_like(x)
        for rows, warps in itertools.product([1, 2, 4], [4, 8, 16, 32]):
            if block * rows <= 32768 and 8 <= block * rows // (warps * 32) <= 64:
                fns[f"r{rows} w{warps}"] = lambda rows=rows, warps=warps: K[(-(-M // rows),)](
                    x, r, w, y, h, y, M, N, N, N, N, 1e-6, 0.0, N, BLOCK_N=block, CHUNKS=1, ROWS=rows, HAS_W=True,
                    STORE_RSTD=False, INT64=False, ALIGN=offset_align(N), num_warps=warps)
        return fns, 2.0
    if kernel == "fp8":
        K = importlib.import_module("cutile_norms.triton.rmsnorm_fp8_kernel").rms_norm_fp8_kernel
        q, s, rstd = torch.empty(M, N, dtype=torch.float8_e4m3fn, device="cuda"), torch.empty(M, device="cuda"), \
            torch.empty(M, device="cuda")
        for rows, warps in itertools.product([1, 2, 4, 8], [2, 4, 8, 16, 32]):
            if block * rows <= 16384 and 4 <= block * rows // (warps * 32) <= 64:
                fns[f"r{rows} w{warps}"] = lambda rows=rows, warps=warps: K[(-(-M // rows),)](
                    x, x, w, q, q, s, rstd, rstd, M, N, N, 1e-6, 0.0, 0.0, N, BLOCK_N=block, ROWS=rows,
                    GROUP=0, STATIC=False, HAS_R=False, HAS_W=True, HAS_UB=False, UE8M0=False, TOP=448.0,
                    MIN_AMAX=FP8_MIN_AMAX, INT64=False, ALIGN=offset_align(N), HAS_OFFSET=False, num_warps=warps)
        return fns, 0.75
    K = importlib.import_module("cutile_norms.triton.add_rmsnorm_bwd_kernel").add_rms_norm_bwd_kernel
    dy, dh, g, rstd = torch.randn_like(x), torch.randn_like(x), torch.empty_like(x), torch.rand(M, device="cuda") + 0.5
    for rows, warps, per_sm in itertools.product([1, 2, 4, 8], [2, 4, 8, 16], [2, 4, 8]):
        if block * rows <= 16384 and 4 <= block * rows // (warps * 32) <= 64:
            programs = min(-(-M // rows), per_sm * sm)
            parts = torch.empty(programs, N, device="cuda")
            fns[f"r{rows} w{warps} p{per_sm}"] = lambda rows=rows, warps=warps, programs=programs, parts=parts: (
                K[(programs,)](dy, dh, x, w, rstd, g, parts, M, N, N, N, 0.0, N, BLOCK_N=block, ROWS=rows,
                               HAS_W=True, HAS_DH=True, NEED_DW=True, INT64=False, num_warps=warps), parts.sum(0))
    return fns, 2.0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kernel", choices=["fp8", "bwd", "fwd"], required=True)
    p.add_argument("--ns", type=lambda v: [int(n) for n in v.split(",")], default=[2048, 4096, 5120, 8192, 12288, 16384])
    args = p.parse_args()
    if no_gpu("this sweep times kernels"):
        return 0
    sm = torch.cuda.get_device_properties(0).multi_processor_count
    for N in args.ns:
        M, x, w = width_inputs(N, torch.bfloat16)
        fns, scale = candidates(N, M, x, w, args.kernel, sm)
        ranked = sorted(((k, scale * statistics.median(v)) for k, v in ratios_to_copy(x, fns, 3).items()),
                        key=lambda kv: -kv[1])
        print(f"N={N} best " + "  ".join(f"{k} {v:.3f}" for k, v in ranked[:6])
              + "  | worst " + "  ".join(f"{k} {v:.3f}" for k, v in ranked[-2:]), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
