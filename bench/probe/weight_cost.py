"""Probe: what the weight costs at full size (M = 2^27 / N), per kernel config.

For each N in --ns: a same-run copy, then configs of the cached, reload and split kernels with the
weight, without it (HAS_W False: x * rstd only), and with the weight in fp32, as ratios to the copy
(read x + write y; the weight's own bytes are negligible at this M). A large with/without gap says
the weight's handling (its layout conversion for multi-row tiles, its loads after the reduction),
not the bytes, costs the time. One-row configs are also timed with w_early (the weight's loads tied
to x's: docs/history.md).

    python bench/probe/weight_cost.py [--dtype bfloat16] [--ns 512,8192,65536]
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
from bench.timing import copy_baseline_ms, device_ms  # noqa: E402
from bench.probe.common import no_gpu  # noqa: E402
from cutile_norms._platform import device_info  # noqa: E402
from cutile_norms.cutile.rmsnorm_fwd import launch  # noqa: E402
from cutile_norms.cutile.rmsnorm_fwd_config import FwdConfig, default_config  # noqa: E402

ELEMENTS = 1 << 27


def configs(N: int, e: int, dtype_name: str, dev) -> dict[str, FwdConfig]:
    out = {f"{mode} (table)": default_config(mode, N, e, dev, dtype_name)
           for mode in ("multi_wave_cached", "multi_wave_reload")}
    if N * e <= 2048:
        for tm in (4, 8, 16, 32):
            out[f"cached tile_m={tm}"] = FwdConfig("cached", tile_m=tm, piece_min=N)
    cached = out["multi_wave_cached (table)"]
    if cached.tile_m == 1 and not cached.w_early:  # the same config with the weight's loads tied to x's
        out["multi_wave_cached (table) + w_early"] = dataclasses.replace(cached, w_early=True)
        if cached.kernel == "split":  # x and the weight both held: ~80 registers at 16 KiB per block (ptxas)
            out["+ w_early, occupancy 6"] = dataclasses.replace(cached, w_early=True, occupancy=6)
    return out


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--ns", type=lambda s: [int(v) for v in s.split(",")], default=[512, 8192, 65536])
    args = p.parse_args()
    if no_gpu():
        return 0
    dtype = DTYPES[args.dtype]
    dev = device_info("cuda")
    dname = str(dtype).removeprefix("torch.")
    for N in args.ns:
        M = ELEMENTS // N
        x = torch.randn(M, N, device="cuda", dtype=dtype)
        w = (1 + 0.1 * torch.randn(N, device="cuda")).to(dtype)
        w32 = w.float()
        copy = copy_baseline_ms(x)["median_ms"]
        for name, cfg in configs(N, x.element_size(), dname, dev).items():
            row = []
            for label, weight in (("w", w), ("no w", None), ("fp32 w", w32)):
                t = device_ms(lambda: launch(cfg, x, weight, 1e-6, 0.0, False, dev.sm_count))["median_ms"]
                row.append(f"{label} {copy / t:.3f}")
            print(f"N={N:>6} {name:<36} {cfg.short():<72} " + "  ".join(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
