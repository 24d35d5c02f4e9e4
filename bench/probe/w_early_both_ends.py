"""Probe: the table's config with and without w_early, at both ends of M (docs/history.md).

w_early makes sure the weight never delays x's loads. Small M (fewer blocks than SMs, each alone on
its SM) is where a late weight load is a second DRAM round trip in series with x's, which nothing
hides; full size (M = 2^27 / N) is where the other resident blocks hide it and the tie's registers
and instructions could cost instead. For each dtype, N and mode, the table's config (tuning/
rmsnorm_fwd_configs.json) is timed as it is with w_early off and on:

  * small M: GPU µs per call at M = 1 and 64 (L2 flushed, CUDA-event median), and a same-run copy;
  * full size: the ratio to a same-run copy, in --rounds interleaved rounds (copy, off, on), median.

Both outputs are checked against the reference first.

    python bench/probe/w_early_both_ends.py [--dtypes bfloat16,float16,float32] [--ns 1024,4096]
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
from bench.timing import gpu_us, ratios_to_copy  # noqa: E402
from bench.probe.common import check_outputs, no_gpu, put_ratios, write_json  # noqa: E402
from cutile_norms._platform import device_info  # noqa: E402
from cutile_norms.cutile.rmsnorm_fwd import launch  # noqa: E402
from cutile_norms.cutile.rmsnorm_fwd_config import default_config  # noqa: E402

ELEMENTS = 1 << 27
MODES = ("multi_wave_cached", "static_persistent")


def _run(cfg, x, w, dev):
    return launch(cfg, x, w, 1e-6, 0.0, False, dev.sm_count)[0]


def probe(dtype, N: int, mode: str, dev, rounds: int) -> dict | None:
    name = str(dtype).removeprefix("torch.")
    table = default_config(mode, N, dtype.itemsize, dev, name)
    if table.kernel not in ("cached", "split"):
        return None
    cfgs = {"off": dataclasses.replace(table, w_early=False), "on": dataclasses.replace(table, w_early=True)}
    rec = {"dtype": name, "N": N, "mode": mode, "config": cfgs["off"].short(), "table_w_early": table.w_early}
    for M in (1, 64):
        x = torch.randn(M, N, device="cuda", dtype=dtype)
        w = (1 + 0.1 * torch.randn(N, device="cuda")).to(dtype)
        check_outputs({cfg.short(): (lambda c=cfg: _run(c, x, w, dev)) for cfg in cfgs.values()}, x, w,
                      f"{name} N={N} M={M}")
        rec[f"copy_us_M{M}"] = gpu_us(lambda: x.clone(), reps=200)
        for k, cfg in cfgs.items():
            rec[f"{k}_us_M{M}"] = gpu_us(lambda: _run(cfg, x, w, dev), reps=200)
    M = ELEMENTS // N
    x = torch.randn(M, N, device="cuda", dtype=dtype)
    w = (1 + 0.1 * torch.randn(N, device="cuda")).to(dtype)
    check_outputs({cfg.short(): (lambda c=cfg: _run(c, x, w, dev)) for cfg in cfgs.values()}, x, w,
                  f"{name} N={N} M={M}", rows=4096)
    ratios = ratios_to_copy(x, {k: (lambda c=cfg: _run(c, x, w, dev)) for k, cfg in cfgs.items()}, rounds)
    put_ratios(rec, ratios)
    return rec


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtypes", default="bfloat16,float16,float32")
    p.add_argument("--ns", type=lambda s: [int(v) for v in s.split(",")],
                   default=[128, 512, 1024, 2048, 2880, 4096, 5120, 7168, 8192, 16384])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--out", default=None, help="write the records as JSON here")
    args = p.parse_args()
    if no_gpu():
        return 0
    dev = device_info("cuda")
    recs = []
    print(f"{'dtype':9} {'N':>6} {'mode':17} | M=1 copy / off / on us | M=64 copy / off / on us | full size off / on"
          " | config")
    for dname in args.dtypes.split(","):
        for N in args.ns:
            for mode in MODES:
                r = probe(DTYPES[dname], N, mode, dev, args.rounds)
                if r is None:
                    continue
                recs.append(r)
                print(f"{dname:9} {N:>6} {mode:17} | {r['copy_us_M1']:4.1f} / {r['off_us_M1']:4.1f} / "
                      f"{r['on_us_M1']:4.1f} | {r['copy_us_M64']:4.1f} / {r['off_us_M64']:4.1f} / "
                      f"{r['on_us_M64']:4.1f} | {r['off_vs_copy']:.3f} / {r['on_vs_copy']:.3f} | {r['config']}"
                      + (" (table: on)" if r["table_w_early"] else ""), flush=True)
    write_json(args.out, {"gpu": dev.name, "records": recs})
    return 0


if __name__ == "__main__":
    sys.exit(main())
