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
from bench.timing import caller_us, device_ms  # noqa: E402
from cutile_norms._platform import device_info  # noqa: E402
from cutile_norms.cutile.rmsnorm_fwd import FwdConfig, cached_piece_min, default_config, launch  # noqa: E402

DEFAULT_NS = [128, 512, 1024, 2048, 2880, 4096, 5120, 7168, 8192, 16384, 32768, 65536, 131072, 262144]


def _pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


def candidates(N: int, e: int) -> list[FwdConfig]:
    """A targeted set per width class (row bytes), plus the current heuristic's pick for each mode."""
    rb = N * e
    pm = cached_piece_min(N)
    cfgs = []
    if rb <= 2048:
        for tm in (4, 8, 16, 32, 64, 128):
            if 2048 <= rb * tm <= 65536:
                cfgs.append(FwdConfig("cached", tile_m=tm, piece_min=pm))
                cfgs.append(FwdConfig("cached", tile_m=tm, piece_min=pm, persistent=True, blocks_per_sm=4))
        for tm in (8, 16, 32):
            if 4096 <= rb * tm <= 32768:
                for b in (2, 8):
                    cfgs.append(FwdConfig("cached", tile_m=tm, piece_min=pm, persistent=True, blocks_per_sm=b))
        cfgs.append(FwdConfig("reload", tile_m=max(1, 8192 // rb), chunk=_pow2(N)))
    elif rb <= 32768:
        tms = (1, 2) if rb <= 8192 else (1,)
        for tm in tms:
            for nww in (None, 8):
                cfgs.append(FwdConfig("cached", tile_m=tm, piece_min=pm, num_worker_warps=nww))
            if pm != _pow2(N):
                cfgs.append(FwdConfig("cached", tile_m=tm, piece_min=_pow2(N)))  # one padded tile
        cfgs.append(FwdConfig("cached", tile_m=1, piece_min=pm, latency=3))
        cfgs.append(FwdConfig("cached", tile_m=1, piece_min=pm, occupancy=4))
        for b in (1, 2, 4):
            cfgs.append(FwdConfig("cached", tile_m=1, piece_min=pm, persistent=True, blocks_per_sm=b,
                                  num_worker_warps=8 if rb > 16384 else None))
        for chunk in (1024, 2048, 4096):
            if chunk < N:
                cfgs.append(FwdConfig("reload", chunk=chunk))
    else:
        for nctas in (1, 2, 4, 8):
            for nww in (None, 8):
                if nctas == 1 and nww is None and rb > 65536:
                    continue  # spills (ptxas), not worth timing
                cfgs.append(FwdConfig("cached", piece_min=pm, num_ctas=nctas if nctas > 1 else None,
                                      num_worker_warps=nww))
        for chunk in (2048, 4096, 8192):
            for rev in (True, False):
                cfgs.append(FwdConfig("reload", chunk=chunk, reverse=rev))
        cfgs.append(FwdConfig("reload", chunk=4096, num_worker_warps=8))
        cfgs.append(FwdConfig("reload", chunk=4096, occupancy=2))
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
    """CPU microseconds per call (no sync in the loop): ct.launch alone, rms_norm, and x.clone()."""
    N, M = 4096, 1
    x = torch.randn(M, N, device="cuda", dtype=dtype)
    w = torch.ones(N, device="cuda", dtype=dtype)
    dev = device_info("cuda")
    cfg = default_config("multi_wave_cached", M, N, x.element_size(), dev)
    out = {}

    def per_call(fn, n=2000):
        for _ in range(50):
            fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        return (t1 - t0) / n * 1e6

    out["clone_us"] = per_call(lambda: x.clone())
    out["empty_us"] = per_call(lambda: torch.empty(N, device="cuda", dtype=dtype))
    out["launch_wrapper_us"] = per_call(lambda: launch(cfg, x, w, 1e-6, 0.0, False, dev.sm_count))
    out["rms_norm_us"] = per_call(lambda: cn.rms_norm(x, w, mode="multi_wave_cached"))
    out["rms_norm_caller_us"] = caller_us(lambda: cn.rms_norm(x, w, mode="multi_wave_cached"))["median_us"]
    out["clone_caller_us"] = caller_us(lambda: x.clone())["median_us"]
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    p.add_argument("--ns", type=lambda s: [int(v) for v in s.split(",")], default=DEFAULT_NS)
    p.add_argument("--reps", type=int, default=25)
    p.add_argument("--out", default=os.path.join(ROOT, "bench", "results"))
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("No CUDA GPU here: this sweep times kernels and needs an sm_90+ NVIDIA GPU. Nothing was run.")
        return 0
    dtype = DTYPES[args.dtype]
    e = torch.empty((), dtype=dtype).element_size()
    dev = device_info("cuda")
    results = {"gpu": dev.name, "dtype": str(dtype), "host": host_costs(dtype), "sweep": []}
    print("host costs (us):", {k: round(v, 2) for k, v in results["host"].items()}, flush=True)
    for N in args.ns:
        M = ELEMENTS // N
        x = torch.randn(M, N, device="cuda", dtype=dtype)
        w = (1 + 0.1 * torch.randn(N, device="cuda")).to(dtype)
        copy = device_ms(lambda: x.clone(), reps=args.reps)["median_ms"]
        entry = {"N": N, "M": M, "copy_ms": copy, "configs": []}
        for cfg in candidates(N, e):
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
    path = os.path.join(args.out, f"rmsnorm_fwd_configs_{str(dtype).removeprefix('torch.')}.json")
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
