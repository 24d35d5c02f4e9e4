"""Sweep launch configs of the cuTile forward kernels (cutile_norms/cutile/rmsnorm_fwd.py).

    python bench/cutile/rmsnorm_fwd_configs.py --ns 128,4096,65536 --dtype bfloat16

For every N, M = 2^27 / N: a same-run copy, then each candidate config (checked against the
reference, then timed: CUDA-event median, L2 flushed), as a ratio to the copy. The heuristics in
rmsnorm_fwd.default_config are set from these numbers (bench/NOTES.md records each decision).
Also reports the host cost per call of ct.launch and of cutile_norms.rms_norm (small-M latency).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

import cutile_norms as cn  # noqa: E402
from bench.rmsnorm import DTYPES, check_output  # noqa: E402
from bench.timing import copy_baseline_ms, device_ms, per_call_us  # noqa: E402
from cutile_norms._platform import device_info  # noqa: E402
from cutile_norms.cutile.rmsnorm_fwd import FwdConfig, cached_piece_min, default_config, launch  # noqa: E402

DEFAULT_NS = [128, 512, 1024, 2048, 2880, 4096, 5120, 7168, 8192, 16384, 32768, 65536, 131072, 262144]


def _pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


def wide_candidates(N: int, e: int) -> list[FwdConfig]:
    """Rows of 32 KiB and more: more bytes in flight per SM (smaller chunks, deeper pipelines, 2-4 CTAs
    per SM) while the rows in flight still fit in L2; clusters with pipelining."""
    pm = cached_piece_min(N)
    C = FwdConfig
    cfgs = []
    for chunk in (1024, 2048, 4096):
        for lat in (1, 3, 10):
            cfgs.append(C("reload", chunk=chunk, latency=lat))
            for occ in (2, 4):
                cfgs.append(C("reload", chunk=chunk, latency=lat, occupancy=occ))
            for b in (2, 3):
                cfgs.append(C("reload", chunk=chunk, latency=lat, persistent=True, blocks_per_sm=b))
    for nctas in (2, 4):
        for lat in (1, 10):
            cfgs.append(C("cached", piece_min=pm, num_ctas=nctas, latency=lat, num_worker_warps=8))
            cfgs.append(C("cached", piece_min=pm, num_ctas=nctas, latency=lat, num_worker_warps=8, persistent=True,
                          blocks_per_sm=1))
    for b in (1, 2):
        cfgs.append(C("cached", piece_min=pm, persistent=True, blocks_per_sm=b, latency=10, num_worker_warps=8))
    return cfgs


def candidates(N: int, e: int, wide: bool = False) -> list[FwdConfig]:
    """A targeted set per width class (row bytes), plus the current heuristic's pick for each mode."""
    rb = N * e
    pm = cached_piece_min(N)
    C = FwdConfig
    cfgs = []
    if wide:
        cfgs = wide_candidates(N, e)
    elif rb <= 2048:  # narrow rows: several rows per tile
        for tm in (8, 16, 32, 64):
            if 2048 <= rb * tm <= 65536:
                cfgs.append(C("cached", tile_m=tm, piece_min=pm))
                for lat in (3, 10):
                    cfgs.append(C("cached", tile_m=tm, piece_min=pm, latency=lat))
                for b in (4, 8):
                    for lat in (1, 3, 10):
                        cfgs.append(C("cached", tile_m=tm, piece_min=pm, persistent=True, blocks_per_sm=b, latency=lat))
        for tm in (4, 8, 16):
            if 2048 <= rb * tm <= 32768:
                for lat in (1, 3):
                    cfgs.append(C("reload", tile_m=tm, chunk=_pow2(N), latency=lat))
    elif rb <= 32768:  # 1K..16K elements of 16-bit
        for tm in ((1, 2) if rb <= 8192 else (1,)):
            for nww in (None, 8):
                cfgs.append(C("cached", tile_m=tm, piece_min=pm, num_worker_warps=nww))
            if pm != _pow2(N):
                cfgs.append(C("cached", tile_m=tm, piece_min=_pow2(N)))
        for b in (1, 2, 3, 4):
            for lat in (3, 10):
                cfgs.append(C("cached", piece_min=pm, persistent=True, blocks_per_sm=b, latency=lat,
                              num_worker_warps=8 if rb > 16384 else None))
        for chunk in (1024, 2048, 4096, 8192):
            if chunk <= _pow2(N):
                for lat in (1, 3, 10):
                    cfgs.append(C("reload", chunk=chunk, latency=lat))
                for b in (2, 4):
                    cfgs.append(C("reload", chunk=chunk, latency=10, persistent=True, blocks_per_sm=b))
    else:  # wide rows: the two-pass kernel, rows in flight capped so the re-read stays in L2
        cfgs.append(C("cached", piece_min=pm, num_worker_warps=8))
        for b in (1, 2):
            for lat in (3, 10):
                cfgs.append(C("cached", piece_min=pm, persistent=True, blocks_per_sm=b, latency=lat, num_worker_warps=8))
        for chunk in (2048, 4096, 8192):
            for lat in (3, 10):
                cfgs.append(C("reload", chunk=chunk, latency=lat))
                for b in (1, 2, 4):
                    for nww in (None, 8):
                        cfgs.append(C("reload", chunk=chunk, latency=lat, persistent=True, blocks_per_sm=b,
                                      num_worker_warps=nww))
    dev = device_info("cuda")
    for mode in ("multi_wave_cached", "static_persistent", "multi_wave_reload"):
        cfgs.append(default_config(mode, ELEMENTS // N, N, e, dev))
    seen, out = set(), []
    for c in cfgs:
        if c not in seen:
            seen.add(c)
            out.append(c)
    return out


ELEMENTS = 1 << 27


def host_costs(dtype) -> dict:
    """Microseconds per call back to back (host-bound here): the pieces of one small rms_norm call."""
    import cuda.tile as ct

    from cutile_norms.cutile.rmsnorm_fwd import _flat, _prepared

    N, M = 4096, 1
    x = torch.randn(M, N, device="cuda", dtype=dtype)
    w = torch.ones(N, device="cuda", dtype=dtype)
    y = torch.empty_like(x)
    dev = device_info("cuda")
    cfg = default_config("multi_wave_cached", M, N, x.element_size(), dev)
    kernel, consts = _prepared(cfg, N, 8, True, False)
    args = (x.view(-1), w, y.view(-1), y.view(-1), M, N, 1e-6, 0.0) + consts
    stream = torch.cuda.current_stream()
    out = {"clone": per_call_us(lambda: x.clone()),
           "torch.empty": per_call_us(lambda: torch.empty(N, device="cuda", dtype=dtype)),
           "current_stream": per_call_us(lambda: torch.cuda.current_stream()),
           "ct.launch (prebuilt args)": per_call_us(lambda: ct.launch(stream, (1,), kernel, args)),
           "launch() wrapper": per_call_us(lambda: launch(cfg, x, w, 1e-6, 0.0, False, dev.sm_count)),
           "rms_norm(mode=cached)": per_call_us(lambda: cn.rms_norm(x, w, mode="multi_wave_cached")),
           "rms_norm(mode=None)": per_call_us(lambda: cn.rms_norm(x, w)),
           "F.rms_norm": per_call_us(lambda: torch.nn.functional.rms_norm(x, (N,), w, 1e-6))}
    try:
        raw = torch.cuda.current_stream().cuda_stream
        out["ct.launch (int stream)"] = per_call_us(lambda: ct.launch(raw, (1,), kernel, args))
    except Exception as exc:
        out["ct.launch (int stream)"] = f"{type(exc).__name__}: {exc}"[:120]
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    p.add_argument("--ns", type=lambda s: [int(v) for v in s.split(",")], default=DEFAULT_NS)
    p.add_argument("--reps", type=int, default=25)
    p.add_argument("--wide", action="store_true", help="the wide-row candidate set (rows >= 32 KiB)")
    p.add_argument("--out", default=os.path.join(ROOT, "bench", "results"))
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("No CUDA GPU here: this sweep times kernels and needs an sm_90+ NVIDIA GPU. Nothing was run.")
        return 0
    dtype = DTYPES[args.dtype]
    e = torch.empty((), dtype=dtype).element_size()
    dev = device_info("cuda")
    results = {"gpu": dev.name, "dtype": str(dtype), "host": host_costs(dtype), "sweep": []}
    print("host costs (us per call):", {k: (round(v, 2) if isinstance(v, float) else v) for k, v in results["host"].items()},
          flush=True)
    for N in args.ns:
        M = ELEMENTS // N
        x = torch.randn(M, N, device="cuda", dtype=dtype)
        w = (1 + 0.1 * torch.randn(N, device="cuda")).to(dtype)
        copy = copy_baseline_ms(x, reps=args.reps)["median_ms"]
        entry = {"N": N, "M": M, "copy_ms": copy, "configs": []}
        for cfg in candidates(N, e, args.wide):
            rec = {"config": cfg.short(), "fields": cfg.__dict__}
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
        best = max((c for c in entry["configs"] if "vs_copy" in c), key=lambda c: c["vs_copy"], default=None)
        if best:
            print(f"N={N:>6} BEST {best['vs_copy']:.3f}x {best['config']}", flush=True)
        results["sweep"].append(entry)
        del x, w
        torch.cuda.empty_cache()
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"rmsnorm_fwd_configs_{str(dtype).removeprefix('torch.')}{'_wide' if args.wide else ''}.json")
    with open(path, "w") as f:
        json.dump(results, f, indent=1)
    print("\nsummary (best per N):")
    for entry in results["sweep"]:
        ok = [c for c in entry["configs"] if "vs_copy" in c]
        if ok:
            b = max(ok, key=lambda c: c["vs_copy"])
            print(f"  N={entry['N']:>6} {b['vs_copy']:.3f}x  {b['config']}")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
