"""Probe: this tree's forward kernels against an earlier rmsnorm_fwd.py, same configs, same run.

A kernel change that keeps the configs (fewer instructions, a different op chain) is measured by
timing both versions of the kernel on the same inputs, in interleaved rounds with a copy: for each
dtype and N, the config `mode=None` runs at full size (M = 2^27 / N) is timed

  * as the baseline file compiles it (offset 0.0),
  * as this tree compiles it, offset 0.0 and offset 1.0 (Gemma's 1 + w: the add kept),

and each round's ratio to that round's copy is recorded; the median of --rounds rounds is reported.
Every output is checked against the reference first.

The baseline is any earlier version of cutile_norms/cutile/rmsnorm_fwd.py, loaded as a module of
the package (its relative imports resolve); fields of this tree's FwdConfig that the baseline's
lacks are dropped (the baseline runs the config without them). The kernels lived in rmsnorm_fwd.py
up to commit 47a75a1; from 49481ad they are in rmsnorm_fwd_kernel.py, which a later baseline
rmsnorm_fwd.py imports relatively, i.e. this tree's kernels: A/B a kernel change made since then by
checking the old tree out (git worktree) instead.

    git show 7c89589:cutile_norms/cutile/rmsnorm_fwd.py > bench/probe/baseline_fwd.py
    python bench/probe/baseline_ab.py --baseline bench/probe/baseline_fwd.py [--dtypes bfloat16] [--ns 4096,32768]
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from bench.rmsnorm import DTYPES  # noqa: E402
from bench.timing import ratios_to_copy  # noqa: E402
from bench.probe.common import check_outputs, no_gpu, put_ratios, write_json  # noqa: E402
from cutile_norms._platform import device_info, toolchain  # noqa: E402
from cutile_norms.cutile import rmsnorm_fwd  # noqa: E402
from cutile_norms.dispatch import choose_forward  # noqa: E402

ELEMENTS = 1 << 27
DEFAULT_NS = [1024, 2048, 2880, 4096, 5120, 7168, 8192, 16384, 32768, 65536, 131072, 262144]


def load_baseline(path: str):
    spec = importlib.util.spec_from_file_location("cutile_norms.cutile._baseline_fwd", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def probe(dtype, N: int, dev, base, rounds: int) -> dict | None:
    name = str(dtype).removeprefix("torch.")
    M = ELEMENTS // N
    mode = choose_forward(dev, toolchain(), dtype, M, N).mode
    if mode not in rmsnorm_fwd.FAMILIES:
        return None
    cfg = rmsnorm_fwd.default_config(mode, N, dtype.itemsize, dev, name)
    known = {f.name for f in dataclasses.fields(base.FwdConfig)}  # fields newer than the baseline are dropped
    base_cfg = base.FwdConfig(**{k: v for k, v in dataclasses.asdict(cfg).items() if k in known})
    x = torch.randn(M, N, device="cuda", dtype=dtype)
    w = (1 + 0.1 * torch.randn(N, device="cuda")).to(dtype)
    w_minus_1 = w - 1  # exact in 16-bit near 1: (w - 1) + 1.0 is w again
    runs = {
        "baseline": lambda: base.launch(base_cfg, x, w, 1e-6, 0.0, False, dev.sm_count)[0],
        "this": lambda: rmsnorm_fwd.launch(cfg, x, w, 1e-6, 0.0, False, dev.sm_count)[0],
        "this_offset1": lambda: rmsnorm_fwd.launch(cfg, x, w_minus_1, 1e-6, 1.0, False, dev.sm_count)[0],
    }
    check_outputs(runs, x, w, f"{name} N={N} {cfg.short()}", rows=4096)
    ratios = ratios_to_copy(x, runs, rounds)
    rec = {"dtype": name, "N": N, "M": M, "mode": mode, "config": cfg.short()}
    put_ratios(rec, ratios)
    return rec


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--baseline", required=True, help="an earlier cutile_norms/cutile/rmsnorm_fwd.py")
    p.add_argument("--dtypes", default="bfloat16")
    p.add_argument("--ns", type=lambda s: [int(v) for v in s.split(",")], default=DEFAULT_NS)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--out", default=None, help="write the records as JSON here")
    args = p.parse_args()
    if no_gpu():
        return 0
    dev = device_info("cuda")
    base = load_baseline(args.baseline)
    recs = []
    print(f"{'dtype':9} {'N':>6} {'mode':17} | baseline / this / this, offset 1 (x copy, median of {args.rounds})"
          " | config")
    for dname in args.dtypes.split(","):
        for N in args.ns:
            r = probe(DTYPES[dname], N, dev, base, args.rounds)
            if r is None:
                continue
            recs.append(r)
            print(f"{dname:9} {N:>6} {r['mode']:17} | {r['baseline_vs_copy']:.3f} / {r['this_vs_copy']:.3f} / "
                  f"{r['this_offset1_vs_copy']:.3f} | {r['config']}", flush=True)
    write_json(args.out, {"gpu": dev.name, "records": recs})
    return 0


if __name__ == "__main__":
    sys.exit(main())
