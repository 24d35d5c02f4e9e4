"""Probe: does where y is allocated change the forward's speed at full size?

The split ablation (bench/probe/split_ablation.py) timed the table's split configs writing into a y
allocated once: bf16 0.983 (N = 32768) and 0.975 (65536) x copy, where the bench, whose every call
allocates its y, measures 0.955-0.961. For each case this probe times, in interleaved rounds with
the copy baseline (bench/timing.py: the best of x.clone() and copies into two preallocated buffers):

  * launch_fresh   the table's config, y allocated by every call (as the bench and a user get it)
  * launch_prealloc_a / _b  the same writing into y buffers allocated once, before / after the others
  * api            cutile_norms.rms_norm(x, w) (mode=None)
  * clone, copy_pre_a / _b  the copy's variants one by one

    python bench/probe/output_placement.py [--cases bfloat16:32768,bfloat16:65536] [--rounds 5]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

import cutile_norms as cn  # noqa: E402
from bench.rmsnorm import DTYPES  # noqa: E402
from bench.timing import ratios_to_copy  # noqa: E402
from bench.probe.common import check_outputs, no_gpu, write_json  # noqa: E402
from cutile_norms._platform import device_info  # noqa: E402
from cutile_norms.cutile import rmsnorm_fwd as F  # noqa: E402

ELEMENTS = 1 << 27


def case(dtype, N: int, dev, rounds: int, reps: int) -> dict:
    name = str(dtype).removeprefix("torch.")
    M = ELEMENTS // N
    cfg = F.default_config("multi_wave_cached", N, dtype.itemsize, dev, name)
    y_a, _ = F.output_buffers(M, N, dtype, "cuda", False)
    x = torch.randn(M, N, device="cuda", dtype=dtype)
    w = (1 + 0.1 * torch.randn(N, device="cuda")).to(dtype)
    y_b, _ = F.output_buffers(M, N, dtype, "cuda", False)
    c_a, c_b = torch.empty_like(x), torch.empty_like(x)
    fns = {
        "launch_fresh": lambda: F.launch(cfg, x, w, 1e-6, 0.0, False, dev.sm_count)[0],
        "launch_prealloc_a": lambda: F.launch(cfg, x, w, 1e-6, 0.0, False, dev.sm_count, (y_a, None))[0],
        "launch_prealloc_b": lambda: F.launch(cfg, x, w, 1e-6, 0.0, False, dev.sm_count, (y_b, None))[0],
        "api": lambda: cn.rms_norm(x, w, 1e-6),
        "clone": lambda: x.clone(),
        "copy_pre_a": lambda: c_a.copy_(x),
        "copy_pre_b": lambda: c_b.copy_(x),
    }
    check_outputs({k: fns[k] for k in ("launch_fresh", "launch_prealloc_a", "launch_prealloc_b", "api")}, x, w,
                  f"{name} N={N}", rows=4096)
    ratios = ratios_to_copy(x, fns, rounds, reps)
    return {"dtype": name, "N": N, "config": cfg.short(),
            "vs_copy": {k: statistics.median(v) for k, v in ratios.items()},
            "rounds": {k: [round(r, 4) for r in v] for k, v in ratios.items()},
            "y_a_minus_x_bytes": y_a.data_ptr() - x.data_ptr(), "y_b_minus_x_bytes": y_b.data_ptr() - x.data_ptr()}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", default="bfloat16:32768,bfloat16:65536,float32:32768")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if no_gpu():
        return 0
    dev = device_info("cuda")
    recs = []
    for c in args.cases.split(","):
        dname, n = c.split(":")
        r = case(DTYPES[dname], int(n), dev, args.rounds, args.reps)
        recs.append(r)
        print(f"{dname} N={n} ({r['config']}), x copy, median of {args.rounds} rounds:")
        print("   " + "  ".join(f"{k} {v:.3f}" for k, v in r["vs_copy"].items()), flush=True)
        torch.cuda.empty_cache()
    write_json(args.out, {"gpu": dev.name, "records": recs})
    return 0


if __name__ == "__main__":
    sys.exit(main())
