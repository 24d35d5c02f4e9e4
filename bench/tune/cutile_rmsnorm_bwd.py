"""Sweep launch configs of the cuTile backward kernel (cutile_norms/cutile/rmsnorm_bwd.py).

    python bench/tune/cutile_rmsnorm_bwd.py --ns 128,4096,65536 --dtype bfloat16 --write-configs

For every N, M = 2^27 / N: each candidate config is checked against the fp32 closed form, then timed
in --rounds interleaved rounds against a same-run copy (CUDA-event medians, L2 flushed). Bytes:
read x + read dy + write dx (3 M N elements; w, dw and rstd not counted), as a ratio to the copy's
bandwidth. --write-configs puts the best config per width into cutile_norms/tuning/rmsnorm_bwd_configs.json,
which rmsnorm_bwd.default_config reads (the nearest measured width of the dtype). Compiles run first in
--workers processes (cuTile compiles on the CPU; the disk cache then serves the timing process).
Also times the dw reduction's share: the picked config with dw and without (dx only).

    python bench/tune/cutile_rmsnorm_bwd.py --write-configs-from a.json,b.json --bands 1025-1536,1537-2047

--write-configs-from: finished sweeps into the table (no GPU); with --bands, every width of a band takes one
config, the one with the best worst case over the band's widths (band_configs).

    python bench/tune/cutile_rmsnorm_bwd.py --dh --ns 1048,1344,1816

--dh: the residual add's backward instead (the kernel also reads dh and adds it to dx: 4 M N elements,
2 x the copy's bytes), over the configs a launch with dh can take (`candidates_dh`: prefetching one-row
tiles at 1-4 blocks per SM, the row cut into its pieces or one padded piece, and multi-row tiles);
the config the library picks for it (`default_config(..., has_dh=True)`) among them. Prints and saves
the sweep; it writes no table (the library's dh configs are the norm's table rows, fitted by
rmsnorm_bwd_config's dh rules: NARROW_DH_ROW, ONE_DH_PIECE_LANES, _dh_fit).
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import multiprocessing as mp
import os
import statistics
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from bench.probe.common import no_gpu  # noqa: E402
from bench.rmsnorm import DTYPES  # noqa: E402
from bench.timing import copy_baseline_ms, device_ms  # noqa: E402
from bench.tune.sweep import (ELEMENTS, best_timed, distinct, read_table, save_sweep, width_inputs,  # noqa: E402
                              write_table)
from cutile_norms._platform import device_info, table_key_for  # noqa: E402
from cutile_norms.cutile.rmsnorm_bwd import launch  # noqa: E402
from cutile_norms.cutile.rmsnorm_bwd_config import (CONFIG_TABLE, MAX_SPLIT, BwdConfig, analytical_config,  # noqa: E402
                                                    cut_pieces, default_config)
from cutile_norms._util import pow2_ceil  # noqa: E402
from cutile_norms.reference import rms_norm_backward, rms_norm_reference  # noqa: E402

DEFAULT_NS = [128, 512, 1024, 2048, 2880, 4096, 5120, 7168, 8192, 16384, 32768, 65536, 131072, 262144]


def candidates(N: int) -> list[BwdConfig]:
    """The configs worth timing for rows of N elements, plus the analytical pick."""
    out = []

    def add(**kw):
        out.append(cut_pieces(BwdConfig(**kw), N))

    if N <= 2048:  # several rows per tile
        for tm in (1, 2, 4, 8, 16, 32, 64):
            if 512 <= tm * N <= 8192:
                for bps in (2, 3, 4):
                    for prefetch in ((False, True) if tm == 1 else (False,)):
                        add(tile_m=tm, blocks_per_sm=bps, num_worker_warps=8 if tm * N >= 2048 else 4,
                            prefetch=prefetch)
    else:
        base_split = max(1, 1 << ((N - 1) // 4096).bit_length()) if N > 5120 else 1
        for split in sorted({max(1, base_split // 2), base_split, min(MAX_SPLIT, base_split * 2)}):
            if split == 1 and N > 8192:
                continue
            for bps in (1, 2, 3):
                for prefetch in (False, True):
                    add(split=split, blocks_per_sm=bps, num_worker_warps=8, prefetch=prefetch)
                    if split == 1 and N <= 8192:  # the row as one padded piece (ONE_DH_PIECE_LANES's shape)
                        out.append(BwdConfig(piece_min=pow2_ceil(N), blocks_per_sm=bps, num_worker_warps=8,
                                             prefetch=prefetch))
    out.append(analytical_config(N, 2))
    return distinct(out)


def candidates_dh(N: int, picked: BwdConfig) -> list[BwdConfig]:
    """The configs a launch with dh can take for rows of N (one row per tile only prefetching, as
    _dh_fit makes it), plus `picked` (the library's)."""
    out = [picked]
    pieces = sorted({cut_pieces(BwdConfig(), N).piece_min, pow2_ceil(N)})
    for bps in (1, 2, 3, 4):
        for pm in pieces:
            out.append(BwdConfig(piece_min=pm, blocks_per_sm=bps, num_worker_warps=8, prefetch=True))
    for tm in (2, 4):
        if tm * N <= 8192:
            for bps in (2, 3, 4):
                out.append(cut_pieces(BwdConfig(tile_m=tm, blocks_per_sm=bps, num_worker_warps=8), N))
    return distinct(out)


def _inputs(M: int, N: int, dtype, device="cuda"):
    _, x, w = width_inputs(N, dtype, M, device)
    dy = torch.randn(M, N, device=device, dtype=dtype)
    rstd = torch.empty(-(-M // 16) * 16, dtype=torch.float32, device=device)[:M]
    rstd.copy_(rms_norm_reference(x, w, 1e-6)[1])
    return x, w, dy, rstd


def _warm(jobs) -> int:
    """Worker: compile (launch once on 64 rows) every (N, dtype, config, dh) of `jobs`; the launches
    specialise on the same alignment and divisibility as the full-size ones."""
    dev = device_info("cuda")
    done = 0
    for N, dtype_name, fields, dh in jobs:
        cfg = BwdConfig(**fields)
        x, w, dy, rstd = _inputs(64, N, DTYPES[dtype_name])
        for need_dw in (True, False):
            try:
                launch(cfg, dy, x, w, rstd, 0.0, True, need_dw, dev.sm_count, dh2d=dy if dh else None)
                done += 1
            except Exception:
                pass
    torch.cuda.synchronize()
    return done


def warm_compiles(jobs: list, workers: int) -> None:
    if workers <= 1 or not jobs:
        return
    chunks = [jobs[i::workers] for i in range(workers)]
    with mp.get_context("spawn").Pool(workers) as pool:
        n = sum(pool.map(_warm, chunks))
    print(f"warmed {n} compiles in {workers} processes", flush=True)


def check(cfg: BwdConfig, x, w, dy, rstd, sm_count: int, dh=None) -> str | None:
    """None if dx (first 256 rows; + dh) and dw match the fp32 closed form, else what is wrong."""
    dx, dw = launch(cfg, dy, x, w, rstd, 0.0, True, True, sm_count, dh2d=dh)
    rows = slice(0, 256)
    ex, _ = rms_norm_backward(dy[rows], x[rows], w, rstd[rows], 0.0, need_dw=False)
    if dh is not None:
        ex = ex.float() + dh[rows].float()
    _, ew = rms_norm_backward(dy, x, w.float(), rstd, 0.0, need_dx=False)
    for name, a, e in (("dx", dx[rows].float(), ex.float()), ("dw", dw.float(), ew.float())):
        if not torch.isfinite(a).all():
            return f"{name}: non-finite"
        scale = e.abs().mean().item() + 1e-6
        err = ((a - e).abs() / (e.abs() + scale)).max().item()
        if err > 2 ** -6:
            return f"{name}: max relative error {err:.3g}"
    return None


def sweep_width(N: int, dtype, dev, args) -> dict:
    """Every candidate at M = 2^27 / N: checked, then timed in interleaved rounds against a copy;
    then the best one's dw share (the same launch with and without dw)."""
    M = ELEMENTS // N
    x, w, dy, rstd = _inputs(M, N, dtype)
    dh = torch.randn_like(dy) if args.dh else None
    factor = 2.0 if args.dh else 1.5  # bytes over the copy's 2 M N: x, dy, dx (and dh)
    entry = {"N": N, "M": M, "configs": []}
    fns = {}
    picked = default_config(N, dtype.itemsize, dev, str(dtype).removeprefix("torch."), False, True) if args.dh else None
    for cfg in candidates_dh(N, picked) if args.dh else candidates(N):
        rec = {"config": cfg.short() + (" (picked)" if cfg == picked else ""), "fields": dataclasses.asdict(cfg)}
        try:
            wrong = check(cfg, x, w, dy, rstd, dev.sm_count, dh)
            if wrong:
                rec["error"] = wrong
            else:
                fns[len(entry["configs"])] = (lambda c=cfg: launch(c, dy, x, w, rstd, 0.0, True, True, dev.sm_count,
                                                                   dh2d=dh))
        except Exception as exc:
            rec["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
        entry["configs"].append(rec)
    ratios = {k: [] for k in fns}
    for _ in range(args.rounds):
        copy = copy_baseline_ms(x, reps=args.reps)["median_ms"]
        for k, fn in fns.items():
            ratios[k].append(factor * copy / device_ms(fn, reps=args.reps)["median_ms"])
    for k, rs in ratios.items():
        entry["configs"][k]["vs_copy"] = statistics.median(rs)
        entry["configs"][k]["vs_copy_rounds"] = [round(r, 4) for r in rs]
    for rec in entry["configs"]:
        print(f"N={N:>6} {rec.get('vs_copy', 0):6.3f}x  {rec['config']:<64} {rec.get('error', '')[:100]}", flush=True)
    best = best_timed(entry["configs"])
    if best:
        cfg = BwdConfig(**best["fields"])
        t = {True: [], False: []}  # the dw reduction's share: with dw / dx only, interleaved rounds
        for _ in range(args.rounds):
            for need_dw in t:
                t[need_dw].append(device_ms(lambda: launch(cfg, dy, x, w, rstd, 0.0, True, need_dw, dev.sm_count,
                                                           dh2d=dh), reps=args.reps)["median_ms"])
        entry["dw_share"] = 1 - statistics.median(t[False]) / statistics.median(t[True])
        print(f"N={N:>6} BEST {best['vs_copy']:.3f}x {best['config']}; dw's share of its time "
              f"{100 * entry['dw_share']:.1f} %", flush=True)
    return entry


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    p.add_argument("--ns", type=lambda s: [int(v) for v in s.split(",")], default=DEFAULT_NS)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--workers", type=int, default=min(12, os.cpu_count() or 1))
    p.add_argument("--write-configs", action="store_true")
    p.add_argument("--dh", action="store_true", help="the residual add's backward (dh read and added); no table")
    p.add_argument("--write-configs-from", default=None, metavar="JSON[,JSON...]",
                   help="write the table's rows from finished sweeps' JSONs of one GPU and dtype (no GPU needed)")
    p.add_argument("--arch", default="sm_90", help="with --write-configs-from: the GPU's arch")
    p.add_argument("--bands", default=None, metavar="LO-HI[,LO-HI...]",
                   help="with --write-configs-from: each band's widths take one config (band_configs)")
    p.add_argument("--out", default=os.path.join(ROOT, "bench", "results"))
    args = p.parse_args(argv)
    if args.write_configs_from:
        runs = [json.load(open(f)) for f in args.write_configs_from.split(",")]
        if any(r.get("dh") for r in runs):
            sys.exit("--write-configs-from: a --dh sweep measures another launch; the table holds the norm's")
        if any((r["gpu"], r["dtype"]) != (runs[0]["gpu"], runs[0]["dtype"]) for r in runs):
            sys.exit("--write-configs-from: the sweeps are of different GPUs or dtypes")
        merged = {"gpu": runs[0]["gpu"], "dtype": runs[0]["dtype"], "command": " ; ".join(r["command"] for r in runs),
                  "sweep": [e for r in runs for e in r["sweep"]]}
        try:
            bands = [tuple(int(v) for v in b.split("-", 1)) for b in args.bands.split(",")] if args.bands else []
            ordered = all(lo <= hi for lo, hi in bands)  # (a band of one number fails to unpack: ValueError)
        except ValueError:
            ordered = False
        if not ordered:
            p.error(f"--bands: LO-HI[,LO-HI...] with LO <= HI, got {args.bands!r}")
        if bands:
            merged["command"] += f" (written with --bands {args.bands})"
        print(f"wrote {write_configs(merged, runs[0]['gpu'], args.arch, bands)}")
        return 0
    if args.bands:
        p.error("--bands: with --write-configs-from (a sweep's own --write-configs writes each width's best)")
    if no_gpu("this sweep times kernels and needs an sm_90+ NVIDIA GPU"):
        return 0
    dtype = DTYPES[args.dtype]
    dname = str(dtype).removeprefix("torch.")
    dev = device_info("cuda")
    if args.dh and args.write_configs:
        sys.exit("--dh sweeps write no table")
    cands = ((lambda N: candidates_dh(N, default_config(N, dtype.itemsize, dev, dname, False, True))) if args.dh
             else candidates)
    warm_compiles([(N, dname, dataclasses.asdict(c), args.dh) for N in args.ns for c in cands(N)], args.workers)
    results = {"gpu": dev.name, "dtype": dname, "dh": args.dh, "command": "python bench/tune/cutile_rmsnorm_bwd.py "
               + " ".join(sys.argv[1:] if argv is None else argv), "sweep": []}
    for N in args.ns:
        results["sweep"].append(sweep_width(N, dtype, dev, args))
        torch.cuda.empty_cache()
    save_sweep(results, args.out, f"rmsnorm_bwd{'_dh' if args.dh else ''}_configs_{dname}.json",
               note=lambda entry: f"dw share {100 * entry.get('dw_share', 0):4.1f} %  ")
    if args.write_configs:
        print(f"wrote {write_configs(results, dev.name, dev.arch_name)}")
    return 0


def band_configs(sweeps: list, lo: int, hi: int) -> dict:
    """{N: config record} for the widths of [lo, hi] measured in `sweeps`: one config for all of them,
    the one with the best worst case over them among those timed at every one. Only one-row tiles of one
    block a row whose pieces are the cut rule's: the shape a width between the table's rows gets from
    its nearest one (rmsnorm_bwd_config._scaled re-cuts the pieces, and changes a multi-row tile's rows
    and a split row's blocks with the width); so between its measured widths a band runs the shape
    measured at them, not whichever config won at the nearest one."""
    def shape(fields: dict) -> tuple:
        return tuple(sorted((k, v) for k, v in fields.items() if k != "piece_min"))

    def kept(c: dict, N: int) -> bool:
        f = c["fields"]
        return (f["tile_m"] == 1 and f["split"] == 1
                and f["piece_min"] == cut_pieces(BwdConfig(), N).piece_min)
    ns = [s for s in sweeps if lo <= s["N"] <= hi]
    timed = [{shape(c["fields"]): c for c in s["configs"] if "vs_copy" in c and kept(c, s["N"])} for s in ns]
    common = set.intersection(*(set(t) for t in timed)) if timed else set()
    if not common:
        sys.exit(f"--bands: no one-row config timed at every width of {lo}-{hi} (widths swept there: "
                 f"{[s['N'] for s in ns] or 'none'})")
    pick = max(common, key=lambda k: min(t[k]["vs_copy"] for t in timed))
    return {s["N"]: t[pick] for s, t in zip(ns, timed)}


def write_configs(results: dict, gpu: str, arch: str, bands: list = ()) -> str:
    """The best measured config per width into the package's backward table, under the arch's key where
    that is this GPU model's table (or there is none yet), else under "<arch>/<model>" (an H200's own
    rows beside the H100's; rmsnorm_bwd_config.config_and_source reads this GPU model's first). `bands`
    ((lo, hi), ...): the widths of each take one config instead (band_configs)."""
    table = read_table(CONFIG_TABLE)
    key = table_key_for(table, arch, gpu)
    rows = {e["N"]: e for e in table["configs"].get(key, {}).get(results["dtype"], [])}
    banded = {n: c for lo, hi in bands for n, c in band_configs(results["sweep"], lo, hi).items()}
    for sweep in results["sweep"]:
        top = best_timed(sweep["configs"])
        best = banded.get(sweep["N"]) or top
        if best:
            rows[sweep["N"]] = {"N": sweep["N"], "config": best["fields"], "vs_copy": round(best["vs_copy"], 4)}
            if best is top:  # the sweep times dw's share of its best config only
                rows[sweep["N"]]["dw_share"] = round(sweep.get("dw_share", 0.0), 4)
    table["configs"].setdefault(key, {})[results["dtype"]] = [rows[n] for n in sorted(rows)]
    src = table["source"].setdefault(key, {"gpu": gpu, "runs": {}})
    src["gpu"] = gpu
    runs = src.setdefault("runs", {})
    today, command = datetime.date.today().isoformat(), results["command"]
    earlier = runs.get(results["dtype"])
    if earlier and earlier.get("command") and earlier["command"] != command:
        # a sweep of some widths keeps the other widths' rows, so the record keeps the commands that wrote them
        command = f"{earlier['command']} ({earlier.get('date', '')}); then {command}"
    runs[results["dtype"]] = {"date": today, "command": command}
    return write_table(table, CONFIG_TABLE)


if __name__ == "__main__":
    sys.exit(main())
