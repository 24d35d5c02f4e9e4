"""Probe: time against M at a fixed N, to split a forward's time into a fixed cost per launch and a
steady state (the slope), next to the copy's, for this library and the anchors.

The split kernel's steady state was measured at 0.983-0.989 x the copy's with a fixed cost 3-4 us
larger (bench/probe/split_ablation.py --sizes 0.5,1,2,4): at the bench's 2^27 elements (~130 us)
that fixed cost alone is ~3 %. This probe asks the same of `mode=None` at other widths and of QuACK.

    python bench/probe/size_scaling.py [--impls cn.None,quack] [--cases bfloat16:16384,bfloat16:65536]
        [--sizes 0.5,1,2,4] [--rounds 5]
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

import cutile_norms as cn  # noqa: E402
from bench import anchors as anchor_registry  # noqa: E402
from bench.rmsnorm import DTYPES  # noqa: E402
from bench.timing import scaling_vs_copy  # noqa: E402
from bench.probe.common import check_outputs, no_gpu, write_json  # noqa: E402

ELEMENTS = 1 << 27


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--impls", default="cn.None,quack")
    p.add_argument("--cases", default="bfloat16:16384,bfloat16:32768,bfloat16:65536")
    p.add_argument("--sizes", default="0.5,1,2,4", help="multiples of the bench size (2^27 elements)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if no_gpu():
        return 0
    names = args.impls.split(",")
    impls = {"cn.None": lambda x, w, eps: cn.rms_norm(x, w, eps)} if "cn.None" in names else {}
    fns, missing = anchor_registry.load([n for n in names if n != "cn.None"])
    impls.update(fns)
    for name, why in missing.items():
        print(f"skipped {name}: {why}")
    sizes = [float(s) for s in args.sizes.split(",")]
    recs = []
    for c in args.cases.split(","):
        dname, n = c.split(":")
        dtype, N = DTYPES[dname], int(n)
        xs = {s: torch.randn(int(s * ELEMENTS) // N, N, device="cuda", dtype=dtype) for s in sizes}
        w = (1 + 0.1 * torch.randn(N, device="cuda")).to(dtype)
        x0 = xs[sizes[0]]
        check_outputs({name: (lambda f=f: f(x0, w, 1e-6)) for name, f in impls.items()}, x0, w, f"{dname} N={N}")
        rows = scaling_vs_copy(xs, {name: (lambda s, f=f, xs=xs: f(xs[s], w, 1e-6)) for name, f in impls.items()},
                               args.rounds, args.reps)
        rec = {"dtype": dname, "N": N, "sizes": sizes, "rows": rows}
        print(f"\n{dname} N={N} (1x: M={ELEMENTS // N}); median of {args.rounds} rounds")
        print(f"  {'impl':10} " + " ".join(f"{f'{s:g}x vs copy':>11}" for s in sizes) + f" {'fixed us':>9} "
              f"{'slope vs copy':>13}")
        for k, r in rows.items():
            print(f"  {k:10} " + " ".join(f"{q:11.3f}" for q in r["vs_copy"]) + f" {r['intercept_us']:9.1f} "
                  f"{r['slope_vs_copy']:13.3f}", flush=True)
        recs.append(rec)
        del xs
        torch.cuda.empty_cache()
    write_json(args.out, {"gpu": torch.cuda.get_device_name(), "records": recs})
    return 0


if __name__ == "__main__":
    sys.exit(main())
