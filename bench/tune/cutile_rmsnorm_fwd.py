"""Sweep launch configs of the cuTile forward kernels (cutile_norms/cutile/rmsnorm_fwd.py).

    python bench/tune/cutile_rmsnorm_fwd.py --ns 128,4096,65536 --dtype bfloat16

For every N, M = 2^27 / N: a same-run copy, then each candidate config (checked against the
reference, then timed: CUDA-event median, L2 flushed), as a ratio to the copy. The heuristics in
rmsnorm_fwd.default_config are set from these numbers (docs/history.md records each decision).
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from bench.probe.common import no_gpu  # noqa: E402
from bench.rmsnorm import DTYPES, check_output  # noqa: E402
from bench.timing import copy_baseline_ms, device_ms, ratios_to_copy  # noqa: E402
from bench.tune.sweep import best_timed, distinct, read_table, save_sweep, width_inputs, write_table  # noqa: E402
from cutile_norms import dispatch  # noqa: E402
from cutile_norms._platform import device_info  # noqa: E402
from cutile_norms._util import pow2_ceil  # noqa: E402
from cutile_norms.cutile.rmsnorm_fwd import launch  # noqa: E402
from cutile_norms.cutile.rmsnorm_fwd_config import (FAMILIES, FwdConfig, cached_piece_min, default_config,  # noqa: E402
                                                    split_between, split_part)

DEFAULT_NS = [128, 512, 1024, 2048, 2880, 4096, 5120, 7168, 8192, 16384, 32768, 65536, 131072, 262144]


def candidates(N: int, e: int, dtype_name: str = "") -> list[FwdConfig]:
    """The configs worth timing for rows of N elements of e bytes (pruned by the earlier sweeps in
    docs/history.md), plus the current heuristic's pick for each mode."""
    rb, p2, pm = N * e, pow2_ceil(N), cached_piece_min(N)
    C = FwdConfig
    cfgs = []
    if rb <= 2048:  # narrow rows: several rows per tile
        for tm in (4, 8, 16, 32, 64):
            if 2048 <= rb * tm <= 65536:
                cfgs.append(C("cached", tile_m=tm, piece_min=pm))
                cfgs.append(C("reload", tile_m=tm, chunk=p2))
                for b in (4, 8, 16):
                    for lat in (1, 3):
                        cfgs.append(C("cached", tile_m=tm, piece_min=pm, persistent=True, blocks_per_sm=b,
                                      hoist_w=True, latency=lat))
    elif rb <= 65536:  # 1K..32K elements of 16-bit
        for tm in ((1, 2) if rb <= 8192 else (1,)):
            for nww in (None, 8):
                for early in ((False, True) if tm == 1 else (False,)):  # one-row tiles: the weight with x (item 17)
                    cfgs.append(C("cached", tile_m=tm, piece_min=pm, num_worker_warps=nww, w_early=early))
                    if pm != p2:
                        cfgs.append(C("cached", tile_m=tm, piece_min=p2, num_worker_warps=nww, w_early=early))
        if rb >= 8192 and e == 2:  # 16-bit x kept as loaded between its two uses: fewer registers, more CTAs per SM
            for nww in (None, 8):
                for occ in (None, 2, 3, 4):
                    for early in (False, True):  # the weight's loads with x's (item 16)
                        cfgs.append(C("cached", piece_min=pm, num_worker_warps=nww, packed=True, occupancy=occ,
                                      w_early=early))
        if rb >= 8192 and e == 4:
            for nww in (None, 8):
                for occ in (None, 2, 3):
                    cfgs.append(C("cached", piece_min=pm, num_worker_warps=nww, occupancy=occ, w_early=True))
        for b in (1, 2, 3, 4):
            for lat in (1, 10):
                for nww in ((None, 8) if rb > 4096 else (None,)):
                    cfgs.append(C("cached", piece_min=pm, persistent=True, blocks_per_sm=b, latency=lat,
                                  num_worker_warps=nww))
        for chunk in (1024, 2048, 4096, 8192):
            if chunk <= p2:
                for nww in (None, 8):
                    cfgs.append(C("reload", chunk=chunk, num_worker_warps=nww))
        for b in (1, 2):
            cfgs.append(C("reload", chunk=4096, latency=10, persistent=True, blocks_per_sm=b))
    else:  # wide rows
        cfgs.append(C("cached", piece_min=pm, num_worker_warps=8))
        if e == 2:
            cfgs.append(C("cached", piece_min=pm, num_worker_warps=8, packed=True))
        for nctas in (2, 4):
            cfgs.append(C("cached", piece_min=pm, num_ctas=nctas, num_worker_warps=8))
        for b in (1, 2):
            cfgs.append(C("cached", piece_min=pm, persistent=True, blocks_per_sm=b, latency=10, num_worker_warps=8))
        for chunk in (2048, 4096, 8192):
            for lat in (1, 10):
                for occ in (None, 2):
                    cfgs.append(C("reload", chunk=chunk, latency=lat, occupancy=occ))
                for nww in (None, 8):
                    cfgs.append(C("reload", chunk=chunk, latency=lat, num_worker_warps=nww))
            for b in (1, 2):
                cfgs.append(C("reload", chunk=chunk, latency=10, persistent=True, blocks_per_sm=b))
    if rb >= 16384:  # the row split over blocks that exchange partial sums (8-64 KiB per block)
        for split in (2, 4, 8, 16, 32, 64):
            part = split_part(N, split)
            if 8192 <= part * e <= 65536:
                for packed in ((False, True) if e == 2 else (False,)):
                    for early in (False, True):  # the weight's loads before the wait (item 16)
                        for tie in (False, True):  # the workspace slot's load with x's (item 19)
                            cfgs.append(C("split", split=split, piece_min=cached_piece_min(part), num_worker_warps=8,
                                          packed=packed, w_early=early, tie_slot=tie))
                            for occ in (None, 4, 5, 6, 8) if early else (None, 4, 6, 8):
                                cfgs.append(C("split", split=split, piece_min=cached_piece_min(part), occupancy=occ,
                                              packed=packed, w_early=early, tie_slot=tie))
    if rb <= 32768:  # the streaming persistent kernel (next tile loaded while this one is reduced)
        for tm in (1, 2, 4, 8, 16, 32, 64):
            if not (tm == 1 or 4096 <= rb * tm <= 32768) or (tm > 1 and rb > 4096):
                continue
            for b in ((2, 4, 6) if rb * tm <= 8192 else (2, 3, 4)):
                for nww in ((None, 8) if rb * tm >= 8192 else (None,)):
                    for hoist in ((True, False) if tm == 1 and rb > 4096 else (True,)):  # narrow: a small weight
                        cfgs.append(C("stream", tile_m=tm, piece_min=pm, packed=tm == 1 and e == 2, persistent=True,
                                      blocks_per_sm=b, hoist_w=hoist, num_worker_warps=nww))
    dev = device_info("cuda")
    for mode in dispatch.modes_of("cutile"):
        cfgs.append(default_config(mode, N, e, dev, dtype_name))
    return distinct(cfgs)



def between_candidates(N: int) -> dict:
    """--between: a 16-bit split row between measured widths (docs/performance.md 2.14): the rule
    (split_between), the nearest entry's config re-cut into pieces under a proportionally raised hint,
    and the rule's alternatives (wider parts, unpacked, other hints, a packed piece and a tail)."""
    rule = split_between(N)
    S, piece, part = rule.split, rule.piece_min, split_part(N, rule.split)
    packed = FwdConfig("split", split=S, piece_min=piece, packed=True, occupancy=8, tie_slot=True)
    out = {"rule": rule, "re-cut pieces, raised hint": dataclasses.replace(
               rule, piece_min=cached_piece_min(part), packed=False, w_early=True, occupancy=min(16, 6 * 8192 // part)),
           "unpacked, 6/SM": dataclasses.replace(packed, packed=False, w_early=True, occupancy=6),
           "packed piece and tail, 8/SM": dataclasses.replace(packed, piece_min=cached_piece_min(part)),
           **{f"packed, {occ}/SM": dataclasses.replace(packed, occupancy=occ) for occ in (8, 10, 12, 16)}}
    if S >= 4:
        out["parts twice as wide, packed, 4/SM"] = dataclasses.replace(packed, split=S // 2, piece_min=2 * piece, occupancy=4)
    return {k: v for k, v in out.items() if k == "rule" or v != rule}


def sweep_between(N: int, x, w, dev, args) -> None:
    M = x.shape[0]
    fns, cfgs = {}, between_candidates(N)
    for name, cfg in cfgs.items():
        y, _ = launch(cfg, x, w, 1e-6, 0.0, False, dev.sm_count)
        wrong = check_output(y[:4096], x[:4096], w, 1e-6)
        if wrong:
            print(f"N={N:>6} {name}: {wrong}", flush=True)
            continue
        fns[name] = lambda cfg=cfg: launch(cfg, x, w, 1e-6, 0.0, False, dev.sm_count)
    weight_bytes = (2 * M * N + N) / (2 * M * N)
    ratios = ratios_to_copy(x, fns, args.rounds, args.reps)
    for name, rs in sorted(ratios.items(), key=lambda t: -statistics.median(t[1])):
        print(f"N={N:>6} {statistics.median(rs) * weight_bytes:6.3f}x  {name:<36} {cfgs[name].short()}", flush=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    p.add_argument("--ns", type=lambda s: [int(v) for v in s.split(",")], default=DEFAULT_NS)
    p.add_argument("--reps", type=int, default=25)
    p.add_argument("--confirm", type=int, default=0, metavar="K",
                   help="time the K best configs of each mode family again, interleaved with the copy, in "
                        "--rounds rounds, and rank by the median round (the best of one noisy pass is biased up)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--family", choices=sorted(FAMILIES), default=None,
                   help="time only this mode's configs (the other modes' table entries are kept)")
    p.add_argument("--write-configs", action="store_true",
                   help="write the best config per mode and width into cutile_norms/tuning/rmsnorm_fwd_configs.json")
    p.add_argument("--between", action="store_true",
                   help="16-bit split rows between measured widths: the rule against its alternatives, "
                        "--rounds interleaved rounds (nothing written)")
    p.add_argument("--out", default=os.path.join(ROOT, "bench", "results"))
    args = p.parse_args(argv)
    if no_gpu("this sweep times kernels and needs an sm_90+ NVIDIA GPU"):
        return 0
    dtype = DTYPES[args.dtype]
    e = torch.empty((), dtype=dtype).element_size()
    dev = device_info("cuda")
    results = {"gpu": dev.name, "dtype": str(dtype).removeprefix("torch."), "sweep": []}
    for N in args.ns:
        M, x, w = width_inputs(N, dtype)
        if args.between:
            sweep_between(N, x, w, dev, args)
            continue
        copy = copy_baseline_ms(x, reps=args.reps)["median_ms"]
        entry = {"N": N, "M": M, "copy_ms": copy, "configs": []}
        for cfg in candidates(N, e, results["dtype"]):
            if args.family and not FAMILIES[args.family](cfg):
                continue
            rec = {"config": cfg.short(), "fields": dict(cfg.__dict__)}
            t0 = time.time()
            try:
                y, _ = launch(cfg, x, w, 1e-6, 0.0, False, dev.sm_count)
                rec["compile_s"] = time.time() - t0
                wrong = check_output(y, x[:4096], w, 1e-6) if M <= 4096 else check_output(y[:4096], x[:4096], w, 1e-6)
                if wrong:
                    rec["error"] = wrong
                else:
                    t = device_ms(lambda: launch(cfg, x, w, 1e-6, 0.0, False, dev.sm_count), reps=args.reps)
                    rec["ms"] = t["median_ms"]
                    rec["vs_copy"] = copy / t["median_ms"] * (2 * M * N + N) / (2 * M * N)
            except Exception as exc:
                rec["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
            entry["configs"].append(rec)
            print(f"N={N:>6} {rec.get('vs_copy', 0):6.3f}x  {rec['config']:<70} "
                  f"{rec.get('error', '')[:120]}", flush=True)
        if args.confirm:
            confirm(entry, x, w, dev, args)
        best = best_timed(entry["configs"])
        if best:
            print(f"N={N:>6} BEST {best['vs_copy']:.3f}x {best['config']}", flush=True)
        results["sweep"].append(entry)
        del x, w
        torch.cuda.empty_cache()
    save_sweep(results, args.out, f"rmsnorm_fwd_configs_{str(dtype).removeprefix('torch.')}.json")
    if args.write_configs:
        print(f"wrote {write_configs(results, e, ' '.join(sys.argv[1:]))}")
    return 0


def confirm(entry: dict, x, w, dev, args) -> None:
    """Re-time the --confirm best configs of each family in --rounds rounds (each round: a copy, then
    every one of them), and replace their vs_copy by the median of the rounds' ratios. Configs that
    were not confirmed lose their vs_copy (kept as vs_copy_first), so only confirmed ones can win."""
    M, N = x.shape
    timed = [c for c in entry["configs"] if "vs_copy" in c]
    chosen = []
    for in_family in FAMILIES.values():
        fam = sorted((c for c in timed if in_family(FwdConfig(**c["fields"]))), key=lambda c: -c["vs_copy"])
        chosen += fam[:args.confirm]
    weight_bytes = (2 * M * N + N) / (2 * M * N)  # the weight's bytes, beyond the copy's
    fns = {id(c): (lambda cfg=FwdConfig(**c["fields"]): launch(cfg, x, w, 1e-6, 0.0, False, dev.sm_count))
           for c in chosen}
    ratios = {k: [r * weight_bytes for r in rs] for k, rs in ratios_to_copy(x, fns, args.rounds, args.reps).items()}
    for c in timed:
        c["vs_copy_first"] = c.pop("vs_copy")
    for c in chosen:
        c["vs_copy_rounds"] = [round(r, 4) for r in ratios[id(c)]]
        c["vs_copy"] = statistics.median(ratios[id(c)])
        print(f"N={N:>6} confirmed {c['vs_copy']:.3f}x (first {c['vs_copy_first']:.3f}, rounds "
              f"{min(ratios[id(c)]):.3f}-{max(ratios[id(c)]):.3f})  {c['config']}", flush=True)


def write_configs(results: dict, e: int, argv: str) -> str:
    """Best measured config per (mode family, row size) into the package's tuning table (this arch)."""
    import datetime

    from cutile_norms.cutile.rmsnorm_fwd_config import CONFIG_TABLE

    dev = device_info("cuda")
    table = read_table(CONFIG_TABLE)
    arch = table["configs"].setdefault(dev.arch_name, {})
    for mode, in_family in FAMILIES.items():
        entries = {(ent["row_bytes"], ent.get("dtype", "")): ent for ent in arch.get(mode, [])}
        for sweep in results["sweep"]:
            best = best_timed(sweep["configs"], keep=lambda c: in_family(FwdConfig(**c["fields"])))
            if best:
                entries[(sweep["N"] * e, results["dtype"])] = {"row_bytes": sweep["N"] * e, "measured_n": sweep["N"], "dtype": results["dtype"],
                                           "config": best["fields"], "vs_copy": round(best["vs_copy"], 4)}
        arch[mode] = sorted(entries.values(), key=lambda ent: (ent["row_bytes"], ent.get("dtype", "")))
    # a sweep over some widths keeps the others' entries: the source lists every command that wrote
    # entries still in the table, with the widths (row bytes) it measured
    src = table["source"].get(dev.arch_name, {})
    measured = sorted({sw["N"] * e for sw in results["sweep"]})
    runs = [r for r in src.get("runs", [])  # minus the runs this one supersedes
            if r["dtype"] != results["dtype"] or not set(r["row_bytes"]) <= set(measured)]
    runs.append({"date": datetime.date.today().isoformat(), "dtype": results["dtype"],
                 "command": f"python bench/tune/cutile_rmsnorm_fwd.py {argv}", "row_bytes": measured})
    table["source"][dev.arch_name] = {"gpu": dev.name, "runs": runs}
    return write_table(table, CONFIG_TABLE)


if __name__ == "__main__":
    sys.exit(main())
