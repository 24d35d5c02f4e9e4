"""Probe: a few forward configs of one width timed side by side, at the bench size and multiples of it.

Each config is given as space-separated FwdConfig fields (`kernel=cached piece_min=32768
num_worker_warps=8`), or `table` for the config mode=None's multi_wave_cached entry picks, optionally
followed by fields that replace the table's (`table stagger=4 stagger_w=792`). For every
size, interleaved rounds time a copy of the same bytes and then each config (results checked
first); the table gives each config's ratio to the copy per size and, from a line through the
sizes, its fixed cost per launch and its steady state (bench/probe/size_scaling.py).

    python bench/probe/config_ab.py --case bfloat16:32768 --sizes 1,2 \\
        table "kernel=cached piece_min=32768 num_worker_warps=8"
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from bench.rmsnorm import DTYPES  # noqa: E402
from bench.timing import scaling_vs_copy  # noqa: E402
from bench.probe.common import check_outputs, no_gpu, write_json  # noqa: E402
from cutile_norms._platform import device_info  # noqa: E402
from cutile_norms.cutile import rmsnorm_fwd as F  # noqa: E402
from cutile_norms.cutile import rmsnorm_fwd_config as FC  # noqa: E402

ELEMENTS = 1 << 27


def parse_config(spec: str, N: int, dtype, dev) -> FC.FwdConfig:
    """`kernel=... field=value ...`, or `table` optionally followed by fields that replace the table's."""
    items = spec.split()
    fields = {}
    for item in items[1:] if items[0] == "table" else items:
        k, v = item.split("=")
        fields[k] = v if k == "kernel" else (v == "True" if v in ("True", "False") else int(v))
    if items[0] == "table":
        table = FC.default_config("multi_wave_cached", N, dtype.itemsize, dev, str(dtype).removeprefix("torch."))
        return dataclasses.replace(table, **fields)
    return FC.FwdConfig(**fields)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--case", required=True, help="DTYPE:N")
    p.add_argument("--sizes", default="1,2")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--out", default=None)
    p.add_argument("configs", nargs="+")
    args = p.parse_args()
    if no_gpu():
        return 0
    dev = device_info("cuda")
    dname, n = args.case.split(":")
    dtype, N = DTYPES[dname], int(n)
    cfgs = {spec: parse_config(spec, N, dtype, dev) for spec in args.configs}
    sizes = [float(s) for s in args.sizes.split(",")]
    xs = {s: torch.randn(int(s * ELEMENTS) // N, N, device="cuda", dtype=dtype) for s in sizes}
    w = (1 + 0.1 * torch.randn(N, device="cuda")).to(dtype)
    check_outputs({cfg.short(): (lambda c=cfg: F.launch(c, xs[sizes[0]], w, 1e-6, 0.0, False, dev.sm_count)[0])
                   for cfg in cfgs.values()}, xs[sizes[0]], w, f"{dname} N={N}")
    rows = scaling_vs_copy(xs, {spec: (lambda s, cfg=cfg: F.launch(cfg, xs[s], w, 1e-6, 0.0, False, dev.sm_count))
                                for spec, cfg in cfgs.items()}, args.rounds, args.reps)
    print(f"{dname} N={N}; median of {args.rounds} rounds; ratio to the copy at each size")
    for k, r in rows.items():
        r["config"] = cfgs[k].short() if k in cfgs else "copy"
        line = " ".join(f"{s:g}x {q:.3f}" for s, q in zip(sizes, r["vs_copy"]))
        if "intercept_us" in r:
            line += f"  fixed {r['intercept_us']:4.1f} us  slope {r['slope_vs_copy']:.3f}"
        print(f"  {line}  {r['config']}", flush=True)
    write_json(args.out, {"gpu": dev.name, "case": args.case, "sizes": sizes, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
