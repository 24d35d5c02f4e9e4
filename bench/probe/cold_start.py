"""Probe: what the fixed cost per launch is made of. Each call is timed three ways, L2 flushed first
every time (bench/timing.py), then before the start event:

  * cold: nothing (the bench's timing: x, the weight and the kernel's code are all in DRAM);
  * weight warm: a copy of the weight (it is then in L2; the code is not);
  * code warm: the same call on a small x (132 rows: the same compiled kernel, M is symbolic), which
    brings the kernel's code and the weight into L2 (and each SM's instruction cache), and for the
    split kernel the workspace slots of the first 132 rows (those of the timed call's first wave);
  * code warm, other slots: the same small call on a side stream (the split kernel's workspace is
    per stream): the code and the weight, not the timed call's slots;
  * slots warm: the split kernel's workspaces read (a sum over them): every slot in L2, nothing else.

The difference cold - code warm is what the first wave pays for fetching code and weight from
DRAM. A line through the times at several sizes gives each one's fixed cost per launch.

    python bench/probe/cold_start.py [--cases bfloat16:16384,...] [--sizes 0.5,1,2] [--configs table]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from bench.rmsnorm import DTYPES  # noqa: E402
from bench.timing import device_ms, fit_line  # noqa: E402
from bench.probe.config_ab import parse_config  # noqa: E402
from bench.probe.common import check_outputs, no_gpu, write_json  # noqa: E402
from cutile_norms._platform import device_info  # noqa: E402
from cutile_norms.cutile import rmsnorm_fwd as F  # noqa: E402

ELEMENTS = 1 << 27


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", default="bfloat16:8192,bfloat16:16384,bfloat16:32768,bfloat16:65536")
    p.add_argument("--sizes", default="0.5,1,2")
    p.add_argument("--configs", default="table", help="';'-separated configs (config_ab.py syntax)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if no_gpu():
        return 0
    dev = device_info("cuda")
    sizes = [float(s) for s in args.sizes.split(",")]
    recs = []
    for case in args.cases.split(","):
        dname, n = case.split(":")
        dtype, N = DTYPES[dname], int(n)
        xs = {s: torch.randn(int(s * ELEMENTS) // N, N, device="cuda", dtype=dtype) for s in sizes}
        small = torch.randn(dev.sm_count, N, device="cuda", dtype=dtype)
        w = (1 + 0.1 * torch.randn(N, device="cuda")).to(dtype)
        ys = {s: torch.empty_like(x) for s, x in xs.items()}
        y_small = torch.empty_like(small)
        impls = {"copy": (lambda s: ys[s].copy_(xs[s]), lambda: y_small.copy_(small))}
        for spec in args.configs.split(";"):
            cfg = parse_config(spec, N, dtype, dev)
            impls[cfg.short()] = (lambda s, cfg=cfg: F.launch(cfg, xs[s], w, 1e-6, 0.0, False, dev.sm_count),
                                  lambda cfg=cfg: F.launch(cfg, small, w, 1e-6, 0.0, False, dev.sm_count))
        check_outputs({k: (lambda fn=fn: fn(sizes[0])[0]) for k, (fn, _) in impls.items() if k != "copy"},
                      xs[sizes[0]], w, f"{dname} N={N}")
        w_copy = torch.empty_like(w)
        side = torch.cuda.Stream()

        def on_side(warm):
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                warm()
            torch.cuda.current_stream().wait_stream(side)

        def read_slots():
            for ws in F._WORKSPACES.values():
                ws.sum()

        ways = {"cold": lambda warm: None, "weight warm": lambda warm: w_copy.copy_(w), "code warm": lambda warm: warm(),
                "code warm, other slots": on_side, "slots warm": lambda warm: read_slots()}
        times = {(k, way, s): [] for k in impls for way in ways for s in sizes}
        for _ in range(args.rounds):
            for s in sizes:
                for k, (fn, warm) in impls.items():
                    for way, before in ways.items():
                        times[(k, way, s)].append(device_ms(lambda: fn(s), args.reps, before=lambda: before(warm))["median_ms"])
        med = {key: statistics.median(v) for key, v in times.items()}
        print(f"\n{dname} N={N}: median of {args.rounds} rounds; ratio to the cold copy per size; line: fixed us")
        rec = {"dtype": dname, "N": N, "sizes": sizes, "rows": []}
        for k in impls:
            for way in ways:
                ms = [med[(k, way, s)] for s in sizes]
                slope, icpt = fit_line(sizes, ms)
                vs = [med[("copy", "cold", s)] / t for s, t in zip(sizes, ms)]
                rec["rows"].append({"impl": k, "way": way, "ms": ms, "vs_cold_copy": vs, "intercept_us": icpt})
                print(f"  {way:12} " + " ".join(f"{s:g}x {q:.3f}" for s, q in zip(sizes, vs))
                      + f"  fixed {icpt:5.1f} us  {k}", flush=True)
        recs.append(rec)
        del xs, ys
        torch.cuda.empty_cache()
    write_json(args.out, {"gpu": dev.name, "records": recs})
    return 0


if __name__ == "__main__":
    sys.exit(main())
