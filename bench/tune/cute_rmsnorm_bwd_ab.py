"""Probe: named tma_smem_cached backward configs against each other, bf16, at the bench size (2^27
elements): each a ratio to a copy of the same bytes (read x, dy + write dx = 1.5 x the copy's), medians
of --rounds interleaved rounds (the copy timed again each round), with min-max; a config whose dx or dw
misses the reference says WRONG.

    python bench/tune/cute_rmsnorm_bwd_ab.py --ns 12288,13312 --configs rule,pad,1x128x12 [--rounds 3] [--out F]

Configs: `rule` (analytic_config on this GPU), `pad` (the rule's padded slices even where an exact
tiling exists), `CxTxV` (C CTAs of T threads of V vectors, the rule's ring slots for its cluster size,
fewer where shared memory does not hold them) or `CxTxVsS` (S slots). A config equal to an earlier
one is timed once, under the earlier name.
"""
from __future__ import annotations

import os
import re
import statistics
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from bench.probe.common import backward_case, backward_close, no_gpu, width_parser, write_json  # noqa: E402
from bench.timing import copy_baseline_ms, device_ms  # noqa: E402
from cutile_norms._platform import device_info  # noqa: E402
from cutile_norms.cute import rmsnorm_bwd as B  # noqa: E402
from cutile_norms.cute.rmsnorm_bwd_config import (CLUSTER_MAX, MAX_STAGES, MIN_STAGES, SMALL_CLUSTER,  # noqa: E402
                                                  SMEM_MAX, BwdConfig, analytic_config, ring_stages)

SPEC = re.compile(r"(\d+)x(\d+)x(\d+)(?:s(\d+))?$")


def parse(name: str) -> tuple[int, int, int, int | None] | None:
    """(CTAs, threads, vectors, slots or None) of a `CxTxV[sS]` name; None for `rule` and `pad`; exits with
    the reason for any other name or a value the kernel does not take."""
    if name in ("rule", "pad"):
        return None
    m = SPEC.match(name)
    if m is None:
        raise SystemExit(f"unknown config {name!r}: rule, pad, CxTxV or CxTxVsS")
    c, t, v = (int(g) for g in m.groups()[:3])
    s = int(m.group(4)) if m.group(4) else None
    if not (1 <= c <= CLUSTER_MAX and 32 <= t <= 1024 and t % 32 == 0 and v >= 1
            and (s is None or MIN_STAGES <= s <= MAX_STAGES)):
        raise SystemExit(f"{name!r}: CTAs 1-{CLUSTER_MAX}, threads a multiple of 32 up to 1024, "
                         f"slots {MIN_STAGES}-{MAX_STAGES}")
    return c, t, v, s


def named_config(name: str, N: int, ring: int) -> BwdConfig | None:
    """The config `name` stands for at bf16 rows of N (module docstring); None where it does not hold the
    row without an empty CTA or does not fit shared memory (an explicit slot count is never lowered)."""
    if name == "rule":
        return analytic_config(N, 2, small_ring=ring)
    if name == "pad":
        return analytic_config(N, 2, small_ring=ring, exact=False)
    c, t, v, s = parse(name)
    if not c * t * v * 8 >= N > (c - 1) * t * v * 8:
        return None
    for stages in ([s] if s else range(ring if c <= SMALL_CLUSTER else MAX_STAGES, MIN_STAGES - 1, -1)):
        cfg = BwdConfig(cluster_n=c, threads=t, nvb=v, stages=stages, vec=8)
        if cfg.smem_bytes(2) <= SMEM_MAX:
            return cfg
    return None


def measure(N: int, names: list[str], ring: int, sm_count: int, rounds: int) -> dict:
    """{name: its config, median, min, max and whether dx and dw match the reference} at bf16 rows of N."""
    cfgs = {}
    for name in names:
        cfg = named_config(name, N, ring)
        if cfg is not None and cfg not in cfgs.values():
            cfgs[name] = cfg
    M, x, w, dy, rstd, dx_ref, dw_ref = backward_case(N)
    runs = {}
    for name, cfg in cfgs.items():
        def run(cfg=cfg):
            return B.launch(cfg, dy, x, w, rstd, 0.0, True, True, sm_count)
        runs[name] = (run, backward_close(*run(), dx_ref, dw_ref))
    ratios = {name: [] for name in cfgs}
    for _ in range(rounds):
        copy = copy_baseline_ms(x, reps=20)["median_ms"]
        for name, (run, _ok) in runs.items():
            ratios[name].append(1.5 * copy / device_ms(run, reps=20)["median_ms"])
    return {name: {"config": cfgs[name].short(), "median": statistics.median(r), "min": min(r), "max": max(r),
                   "ok": runs[name][1]} for name, r in ratios.items()}


def main() -> int:
    p = width_parser(__doc__, [12288, 13312])
    p.add_argument("--configs", default="rule,pad")
    args = p.parse_args()
    names = args.configs.split(",")
    for name in names:
        parse(name)
    if no_gpu():
        return 0
    dev = device_info("cuda")
    ring = ring_stages(dev)
    print(f"{torch.cuda.get_device_name()}, {ring} ring slots for clusters up to {SMALL_CLUSTER}", flush=True)
    rows = {}
    for N in args.ns:
        rows[str(N)] = measure(N, names, ring, dev.sm_count, args.rounds)
        torch.cuda.empty_cache()
        for name, r in rows[str(N)].items():
            print(f"N={N:>6} {name:<12} {r['median']:.3f} [{r['min']:.3f}-{r['max']:.3f}]"
                  f"{'' if r['ok'] else '  WRONG'}  {r['config']}", flush=True)
    write_json(args.out, {"gpu": torch.cuda.get_device_name(), "rounds": args.rounds, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
