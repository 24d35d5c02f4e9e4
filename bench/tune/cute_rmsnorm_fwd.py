"""Probe: tma_smem_cached forward configs side by side at the bench size (2^27 elements), each as a
ratio to a same-run copy: the analytic config and variants of its budgets (tile bytes for narrow rows,
slice bytes per CTA before a row goes to a cluster, 16-byte vectors per thread, threads per CTA).

    python bench/tune/cute_rmsnorm_fwd.py [--ns 1024,4096,...] [--dtype bfloat16] [--out F]
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from bench.probe.common import no_gpu, write_json  # noqa: E402
from bench.timing import copy_baseline_ms, device_ms  # noqa: E402
from bench.tune.sweep import width_inputs  # noqa: E402
from cutile_norms._platform import device_info  # noqa: E402
from cutile_norms.cute import rmsnorm_fwd as F  # noqa: E402
from cutile_norms.cute.rmsnorm_fwd_config import (  # noqa: E402
    SMEM_MAX, WIDE_SLICE_BYTES, FwdConfig, analytic_config)
from cutile_norms.reference import rms_norm_reference  # noqa: E402

def variants(N, e):
    out = {"analytic": analytic_config(N, e)}
    for name, kw in (("tile 8K", dict(tile_bytes=8192)), ("tile 32K", dict(tile_bytes=32768)),
                     ("tile 64K", dict(tile_bytes=65536)),
                     ("slice 8K", dict(slice_bytes=8192)), ("slice 32K", dict(slice_bytes=32768)),
                     ("cluster<=8", dict(cluster_max=8)), ("c8 vecs 16", dict(cluster_max=8, vecs_per_thread=16)),
                     ("slice 32K c8", dict(slice_bytes=32768, cluster_max=8)),
                     ("vecs 4", dict(vecs_per_thread=4)), ("vecs 16", dict(vecs_per_thread=16)),
                     ("threads 256", dict(min_threads=256)), ("threads 64", dict(min_threads=64))):
        cfg = analytic_config(N, e, **kw)
        if cfg is not None and cfg not in out.values():
            out[name] = cfg
    if 16 * WIDE_SLICE_BYTES < N * e <= 32 * WIDE_SLICE_BYTES:  # rows of 512 KiB - 1 MiB
        vec = 16 // e
        for cn in (8, 16):  # clusters of 8 or 16 CTAs, 128-1024 threads per slice
            vectors = -(-N // (cn * vec))
            for tpr in (128, 256, 512, 1024):
                cfg = FwdConfig(rows=1, rpg=1, tpr=tpr, nvb=-(-vectors // tpr), cluster_n=cn, vec=vec)
                if cfg not in out.values() and cfg.smem_bytes(e, N) <= SMEM_MAX:
                    out[f"c{cn} {tpr} thr"] = cfg
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ns", type=lambda s: [int(v) for v in s.split(",")],
                   default=[128, 1024, 2880, 4096, 8192, 16384, 32768, 65536, 131072, 262144])
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if no_gpu():
        return 0
    dev = device_info("cuda")
    dtype = getattr(torch, args.dtype)
    results = {}
    for N in args.ns:
        M, x, w = width_inputs(N, dtype)
        y_ref, _ = rms_norm_reference(x[-64:], w, 1e-6)
        copy = copy_baseline_ms(x, reps=20)["median_ms"]
        row = {"copy_ms": copy}
        for name, cfg in variants(N, dtype.itemsize).items():
            try:
                y, _ = F.TMA_SMEM_CACHED.forward(x, w, 1e-6, 0.0, True, dev, cfg=cfg)
                ok = torch.allclose(y[-64:].float(), y_ref.float(), rtol=2e-2, atol=2e-2)
                r = copy / device_ms(lambda: F.TMA_SMEM_CACHED.forward(x, w, 1e-6, 0.0, True, dev, cfg=cfg),
                                     reps=20)["median_ms"]
                row[name] = r
                print(f"N={N:>6} {name:<12} {r:.3f}{'' if ok else '  WRONG'}  {cfg.short()}", flush=True)
            except Exception as exc:  # noqa: BLE001
                print(f"N={N:>6} {name:<12} error {type(exc).__name__}: {str(exc)[:200]}", flush=True)
        results[str(N)] = row
        x = None
        torch.cuda.empty_cache()
    write_json(args.out, {"gpu": torch.cuda.get_device_name(), "dtype": args.dtype, "rows": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
