"""Probe: which launch config torch.compile's autotuner picks for the RMSNorm forward (bf16, the
bench's M = 2^27 / N), read from Inductor's .best_config files, with the generated kernel's loads.

    python bench/probe/inductor_configs.py --ns 8192,16384,32768 [--out DIR]
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from bench.probe.common import no_gpu  # noqa: E402
from cutile_norms.reference import rms_norm_reference  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ns", default="8192,16384,32768")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if no_gpu():
        return 0
    cache = os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", "/tmp/inductor_probe_cache")
    dtype = getattr(torch, args.dtype)
    found = {}
    for n in [int(v) for v in args.ns.split(",")]:
        before = set(glob.glob(os.path.join(cache, "**", "*.best_config"), recursive=True))
        fn = torch.compile(lambda x, w: rms_norm_reference(x, w, 1e-6)[0], dynamic=False)
        x = torch.randn((1 << 27) // n, n, device="cuda", dtype=dtype)
        w = torch.randn(n, device="cuda", dtype=dtype)
        fn(x, w)
        torch.cuda.synchronize()
        for f in sorted(set(glob.glob(os.path.join(cache, "**", "*.best_config"), recursive=True)) - before):
            cfg = json.load(open(f))
            src = f.removesuffix(".best_config") + ".py"
            loads = [line.strip() for line in open(src)] if os.path.exists(src) else []
            loads = [line for line in loads if "tl.load" in line or "tl.store" in line or "for r0_offset" in line]
            found[f"{n}"] = {"best_config": cfg, "loads": loads}
            print(f"N={n}: {cfg}")
            for line in loads:
                print("    ", line)
        torch._dynamo.reset()
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "inductor_configs.json"), "w") as f:
            json.dump(found, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
