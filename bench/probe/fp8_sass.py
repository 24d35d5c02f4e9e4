"""SASS instructions per element per thread of the FP8 kernel as a launch on contiguous bf16 rows at offset 0 compiles
it (pointers, strides and N divisible by 16: x and w load as 16-byte vectors); no GPU needed (Triton
compiles for sm_90, nvdisasm reads the cubin). Backs the instruction counts of docs/performance.md 2.15
and 2.16 (the kernel is instruction bound at an H200's copy rate: about 24 per element allowed). With
--cute MODEL the CuTe DSL kernel instead, in the form rmsnorm_fp8_config.ring gives GPU MODEL (H200, H100)
at a large launch, for sm_90a (the ptxas on PATH, nvdisasm from Triton's bundle; static counts, and the
registers):
docs/performance.md 2.51.

    python bench/probe/fp8_sass.py [--ns 2048,4096,16384] [--group 0] [--cute H200]
"""
from __future__ import annotations

import argparse
import collections
import os
import re
import shutil
import subprocess
import sys
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from cutile_norms.triton.rmsnorm_fp8_config import launch_config  # noqa: E402
from cutile_norms.triton.rmsnorm_fp8_kernel import rms_norm_fp8_kernel as K  # noqa: E402

ALIGNED = ("X", "R", "W", "Q", "H", "S", "SCALE", "RSTD", "stride_x", "stride_r", "N")


def sass(N: int, group: int) -> tuple[list[str], int]:
    """(the SASS opcodes, elements per thread) of one launch config (per-token or 1 x group scales)."""
    block, rows, warps = launch_config(N, group or None)
    sig = {"X": "*bf16", "R": "*bf16", "W": "*bf16", "Q": "*fp8e4nv", "H": "*bf16", "S": "*fp32", "SCALE": "*fp32",
           "RSTD": "*fp32", "M": "i32", "stride_x": "i32", "stride_r": "i32", "eps": "fp32", "offset": "fp32",
           "scale_ub": "fp32", "N": "i32"}
    consts = dict(BLOCK_N=block, ROWS=rows, GROUP=group, STATIC=False, HAS_R=False, HAS_W=True,
                  HAS_UB=False, UE8M0=False, TOP=448.0, MIN_AMAX=1e-12, INT64=False, ALIGN=1,  # (N of 16: ALIGN 1)
                  HAS_OFFSET=False)  # (offset 0)
    sig.update({k: "constexpr" for k in consts})
    attrs = {(K.arg_names.index(n),): [["tt.divisibility", 16]] for n in ALIGNED}
    src = ASTSource(fn=K, signature=sig, constexprs={(K.arg_names.index(k),): v for k, v in consts.items()},
                    attrs=attrs)
    cubin = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps}).asm["cubin"]
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        nvdisasm = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "nvdisasm")
        text = subprocess.run([nvdisasm, "-c", f.name], capture_output=True, text=True, check=True).stdout
    ops = [m.group(1) for m in re.finditer(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]+)", text)]
    return ops, block * rows // (32 * warps)


def cute_sass(N: int, group: int, model: str) -> tuple[list[str], int, int]:
    """(the SASS opcodes, elements per thread, registers) of the CuTe DSL kernel's form on GPU `model`."""
    from cutile_norms.cute.rmsnorm_fp8 import compile_fp8
    from cutile_norms.cute.rmsnorm_fp8_config import fp8_config, refusal, ring

    import torch

    kind = "group" if group else "token"
    cfg = fp8_config(N, 2, group or None)
    if cfg is None:
        raise SystemExit(f"N={N}: {refusal(N, 2, group or None)}")
    stages, _, looped = ring(N, 2, 2, kind, 1 << 30, 132, model)
    ptx = compile_fp8(torch.bfloat16, torch.bfloat16, N, cfg, torch.float8_e4m3fn, kind, group, False, False, False,
                      True, True, "sm_90a", keep_ptx=True, stages=stages, looped=looped, has_offset=False).__ptx__
    tools = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    ptxas = shutil.which("ptxas")  # (Triton's own is older than the PTX CuTe DSL writes)
    if ptxas is None:
        raise SystemExit("--cute needs a ptxas of CUDA 12.9 or later on PATH (pip install nvidia-cuda-nvcc)")
    with tempfile.TemporaryDirectory() as d:
        with open(os.path.join(d, "k.ptx"), "w") as f:
            f.write(ptx)
        log = subprocess.run([ptxas, "-arch=sm_90a", "-v", os.path.join(d, "k.ptx"), "-o",
                              os.path.join(d, "k.cubin")], capture_output=True, text=True, check=True).stderr
        text = subprocess.run([os.path.join(tools, "nvdisasm"), "-c", os.path.join(d, "k.cubin")], capture_output=True,
                              text=True, check=True).stdout
    ops = [m.group(1) for m in re.finditer(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]+)", text)]
    registers = int(re.search(r"Used (\d+) registers", log).group(1))
    return ops, cfg.nvb * cfg.vec * (cfg.rows // cfg.rpg), registers


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ns", type=lambda v: [int(n) for n in v.split(",")], default=[2048, 4096, 16384])
    p.add_argument("--group", type=int, default=0, help="0: per-token scales, else 1 x group scales")
    p.add_argument("--cute", default=None, help="the CuTe DSL kernel in GPU MODEL's form (H200, H100)")
    args = p.parse_args()
    for N in args.ns:
        if args.cute:
            ops, per_thread, registers = cute_sass(N, args.group, args.cute)
            top = collections.Counter(o.split(".")[0] for o in ops).most_common(8)
            print(f"N={N} group={args.group} {args.cute}'s form: {len(ops) / per_thread:5.1f} per element per thread "
                  f"({len(ops)} for {per_thread}), {registers} registers; " + " ".join(f"{k} {v}" for k, v in top),
                  flush=True)
            continue
        ops, per_thread = sass(N, args.group)
        top = collections.Counter(o.split(".")[0] for o in ops).most_common(6)
        print(f"N={N} group={args.group} {len(ops) / per_thread:5.1f} per element per thread ({len(ops)} for "
              f"{per_thread}); " + " ".join(f"{k} {v}" for k, v in top), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
