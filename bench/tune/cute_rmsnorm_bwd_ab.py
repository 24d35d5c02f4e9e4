"""Probe: named tma_smem_cached backward configs against each other, bf16, at the bench size (2^27
elements): each a ratio to a copy of the same bytes (read x, dy + write dx = 1.5 x the copy's), medians
of --rounds interleaved rounds (the copy timed again each round), with min-max; a config whose dx or dw
misses the reference says WRONG.

    python bench/tune/cute_rmsnorm_bwd_ab.py --ns 12288,13312 --configs rule,pad,1x128x12 [--rounds 3] [--out F]
        [--weight-dtype float32]   # bf16 x beside an fp32 weight

Configs: `rule` (analytic_config on this GPU: device_config), `rule16` (the 16 KiB rule alone, without
EVEN_SLICES), `pad` (the 16 KiB rule's padded slices even where an exact tiling exists), `sliceK` /
`sliceKpad` (rule16's / pad's formula over slices of K KiB instead of SLICE_BYTES), `evenK` (the rule
with EVEN_SLICES at every row past K KiB), `CxTxV` (C CTAs of T threads of V vectors, the rule's ring
slots for its cluster size, fewer where shared memory does not hold them) or `CxTxVsS` (S slots);
`cutile` times the cuTile persistent backward (mode=None's choice inside the cuTile bands:
cutile_norms/backward_table.py) in the same rounds. Any CuTe name takes `/RxK`: dw's reducers with R
column tiles a round and K partial rows at once (`rule/1x8`; without it, reduction_shape's: 1 x 8 without dh).
A config equal to an earlier one (with the same reduction) is timed once, under the earlier name.
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
from cutile_norms._platform import device_info, gpu_model  # noqa: E402
from cutile_norms.cute import rmsnorm_bwd as B  # noqa: E402
from cutile_norms.cute.rmsnorm_bwd_config import (CLUSTER_MAX, EVEN_BANDS_OTHERS, MAX_STAGES, MIN_STAGES,  # noqa: E402
                                                  SLICE_BYTES, SMALL_CLUSTER, SMEM_MAX, BwdConfig, analytic_config,
                                                  even_bands, ring_stages)

SPEC = re.compile(r"(\d+)x(\d+)x(\d+)(?:s(\d+))?$")
SLICE = re.compile(r"slice(\d+)(pad)?$")
EVEN = re.compile(r"even(\d+)$")
RED = re.compile(r"(\d+)x(\d+)$")


def parse(name: str) -> tuple[int, int, int, int | None] | None:
    """(CTAs, threads, vectors, slots or None) of a `CxTxV[sS]` name; None for `rule`, `rule16`, `pad`,
    `sliceK[pad]`, `evenK` and `cutile`; exits with the reason for any other name or a value the kernel
    does not take."""
    name, _ = split_reduction(name)
    if name in ("rule", "rule16", "pad", "cutile") or SLICE.match(name) or EVEN.match(name):
        return None
    m = SPEC.match(name)
    if m is None:
        raise SystemExit(f"unknown config {name!r}: rule, rule16, pad, sliceK, sliceKpad, evenK, CxTxV, "
                         "CxTxVsS or cutile")
    c, t, v = (int(g) for g in m.groups()[:3])
    s = int(m.group(4)) if m.group(4) else None
    if not (1 <= c <= CLUSTER_MAX and 32 <= t <= 1024 and t % 32 == 0 and v >= 1
            and (s is None or MIN_STAGES <= s <= MAX_STAGES)):
        raise SystemExit(f"{name!r}: CTAs 1-{CLUSTER_MAX}, threads a multiple of 32 up to 1024, "
                         f"slots {MIN_STAGES}-{MAX_STAGES}")
    return c, t, v, s


def split_reduction(name: str) -> tuple[str, tuple[int, int] | None]:
    """(the config's name, (column tiles a round, partial rows at once) or None) of `name[/RxK]`; exits
    with the reason for a reduction that is not two positive integers."""
    if "/" not in name:
        return name, None
    base, red = name.split("/", 1)
    m = RED.match(red)
    if m is None or base == "cutile" or min(int(g) for g in m.groups()) < 1:
        raise SystemExit(f"{name!r}: a CuTe config's reduction is /RxK (R column tiles a round, K partial rows)")
    return base, (int(m.group(1)), int(m.group(2)))


def named_config(name: str, N: int, ring: int, even: tuple | None = EVEN_BANDS_OTHERS) -> BwdConfig | None:
    """The config `name` stands for at bf16 rows of N on a GPU of `ring` slots and EVEN_SLICES in the bands
    `even` of row bytes (module docstring); None where it does not hold the row without an empty CTA or does
    not fit shared memory (an explicit slot count is never lowered)."""
    if name in ("rule", "rule16"):
        return analytic_config(N, 2, small_ring=ring, even_slices=even if name == "rule" else None)
    if name == "pad":
        return analytic_config(N, 2, small_ring=ring, exact=False)
    if m := EVEN.match(name):
        band = (int(m.group(1)) * 1024, SMALL_CLUSTER * SLICE_BYTES)
        return analytic_config(N, 2, small_ring=ring, even_slices=(band,))
    if m := SLICE.match(name):
        kib, pad = m.groups()
        return analytic_config(N, 2, slice_bytes=int(kib) * 1024, small_ring=ring, exact=not pad)
    c, t, v, s = parse(name)
    if not c * t * v * 8 >= N > (c - 1) * t * v * 8:
        return None
    for stages in ([s] if s else range(ring if c <= SMALL_CLUSTER else MAX_STAGES, MIN_STAGES - 1, -1)):
        cfg = BwdConfig(cluster_n=c, threads=t, nvb=v, stages=stages, vec=8)
        if cfg.smem_bytes(2) <= SMEM_MAX:
            return cfg
    return None


def measure(N: int, names: list[str], ring: int, even: tuple, dev, rounds: int,
            w_dtype: torch.dtype = torch.bfloat16) -> dict:
    """{name: its config, median, min, max and whether dx and dw match the reference} at bf16 rows of N
    beside a weight of w_dtype."""
    cfgs = {}  # name -> (config, reduction or None)
    for name in names:
        if name == "cutile":
            continue
        base, red = split_reduction(name)
        cfg = named_config(base, N, ring, even)
        if cfg is not None and (cfg, red) not in cfgs.values():
            cfgs[name] = (cfg, red)
    M, x, w, dy, rstd, dx_ref, dw_ref = backward_case(N, w_dtype)
    runs = {}
    for name, (cfg, red) in cfgs.items():
        def run(cfg=cfg, red=red):
            return B.launch(cfg, dy, x, w, rstd, 0.0, True, True, dev.sm_count, reduction=red)
        runs[name] = (run, backward_close(*run(), dx_ref, dw_ref))
    if "cutile" in names:
        from cutile_norms.cutile.rmsnorm_bwd import PERSISTENT_BACKWARD

        def run():
            return PERSISTENT_BACKWARD.backward(dy, x, w, rstd, 0.0, True, True, dev)
        runs["cutile"] = (run, backward_close(*run(), dx_ref, dw_ref))
    ratios = {name: [] for name in runs}
    for _ in range(rounds):
        copy = copy_baseline_ms(x, reps=20)["median_ms"]
        for name, (run, _ok) in runs.items():
            ratios[name].append(1.5 * copy / device_ms(run, reps=20)["median_ms"])
    return {name: {"config": (cfgs[name][0].short() + (f", reduction {cfgs[name][1]}" if cfgs[name][1] else "")
                              if name in cfgs else "cuTile persistent"),
                   "median": statistics.median(r), "min": min(r), "max": max(r), "ok": runs[name][1]}
            for name, r in ratios.items()}


def main() -> int:
    p = width_parser(__doc__, [12288, 13312])
    p.add_argument("--configs", default="rule,pad")
    p.add_argument("--weight-dtype", default="bfloat16", choices=["bfloat16", "float32"])
    args = p.parse_args()
    names = args.configs.split(",")
    for name in names:
        parse(name)
    if no_gpu():
        return 0
    dev = device_info("cuda")
    ring = ring_stages(dev)
    print(f"{torch.cuda.get_device_name()}, {ring} ring slots for clusters up to {SMALL_CLUSTER}, "
          f"{args.weight_dtype} weight", flush=True)
    rows = {}
    for N in args.ns:
        rows[str(N)] = measure(N, names, ring, even_bands(gpu_model(dev.name)), dev, args.rounds,
                               getattr(torch, args.weight_dtype))
        torch.cuda.empty_cache()
        for name, r in rows[str(N)].items():
            print(f"N={N:>6} {name:<12} {r['median']:.3f} [{r['min']:.3f}-{r['max']:.3f}]"
                  f"{'' if r['ok'] else '  WRONG'}  {r['config']}", flush=True)
    write_json(args.out, {"gpu": torch.cuda.get_device_name(), "rounds": args.rounds,
                          "weight_dtype": args.weight_dtype, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
