"""Probe: tma_smem_cached backward configs side by side at the bench size (2^27 elements), each as a
ratio to a same-run copy (bytes: read x, dy + write dx = 1.5 x the copy's), with the cuTile persistent
backward's table config timed in the same run, and each config's dw share (the same config without dw).

    python bench/tune/cute_rmsnorm_bwd.py [--ns 65536,131072,262144] [--dtype bfloat16] [--reducers 16,132] [--offset 0.5] [--out F]
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
from cutile_norms.cute import rmsnorm_bwd as B  # noqa: E402
from cutile_norms.cute.rmsnorm_bwd_config import (CLUSTER_MAX, MAX_STAGES, SLICE_BYTES,  # noqa: E402
                                                  SMALL_CLUSTER, SMEM_MAX, BwdConfig, analytic_config,
                                                  device_config, ring_stages)
from cutile_norms.reference import rms_norm_backward, rms_norm_reference  # noqa: E402

# vectors a thread the cluster variants may hold: past the rule's exact tilings (rmsnorm_bwd_config.MAX_VECS,
# 11), so that the tune still shows the cliff at 12-16 (docs/performance.md 2.33, 2.34)
PROBE_VECS = 16


def variants(N, e, dev):
    """The rule's config on this GPU (`dev`) and its variants (the 16 KiB rule's, on its ring)."""
    ring = ring_stages(dev)
    out = {"analytic": device_config(N, e, dev)}
    for name, kw in (("vecs 4", dict(vecs_per_thread=4)), ("vecs 2", dict(vecs_per_thread=2)),
                     ("slice 8K", dict(slice_bytes=8192)), ("slice 8K v4", dict(slice_bytes=8192, vecs_per_thread=4)),
                     ("slice 32K", dict(slice_bytes=32768)), ("slice 32K v16", dict(slice_bytes=32768, vecs_per_thread=16)),
                     ("stages 2", dict(stages=2)), ("stages 3", dict(stages=3)), ("stages 4", dict(stages=4))):
        kw = dict(kw, even_slices=None) if "stages" in kw else dict(kw, small_ring=ring, even_slices=None)
        cfg = analytic_config(N, e, **kw)
        if cfg is not None and cfg not in out.values():
            out[name] = cfg
    # clusters of given sizes; the first, 16 KiB slices of 128 threads at any cluster size (the rule
    # before ONE_A_GPC)
    for cluster, threads in ((min(CLUSTER_MAX, -(-N * e // SLICE_BYTES)), 128), (8, 256), (8, 128), (16, 128)):
        cfg = cluster_config(N, e, cluster, threads, ring)
        if cfg is not None and cfg not in out.values():
            out[f"{cluster} x {threads}"] = cfg
    return out


def cluster_config(N, e, cluster, threads, ring):
    """The row over `cluster` CTAs of `threads` (as many vectors a thread as the slice needs, at most
    PROBE_VECS; the cluster shrinks where fewer such slices hold the row), x's and dy's rings only (no
    dh), `ring` slots up to SMALL_CLUSTER CTAs and MAX_STAGES past it (no fit rule: a probe); None where
    the vectors exceed PROBE_VECS or the ring exceeds shared memory."""
    vec = 16 // e
    vectors = -(-N // vec)
    nvb = -(-(-(-vectors // cluster)) // threads)
    if nvb > PROBE_VECS:
        return None
    cluster_n = -(-vectors // (threads * nvb))
    stages = ring if cluster_n <= SMALL_CLUSTER else MAX_STAGES
    cfg = BwdConfig(cluster_n=cluster_n, threads=threads, nvb=nvb, stages=stages, vec=vec)
    return cfg if cfg.smem_bytes(e) <= SMEM_MAX else None


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ns", type=lambda s: [int(v) for v in s.split(",")], default=[32768, 65536, 131072, 262144])
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--reducers", type=lambda s: [int(v) for v in s.split(",") if v], default=[],
                   help="the analytic config again with this many dw reducers each (default: the heuristic's)")
    p.add_argument("--offset", type=float, default=0.0, help="w' = offset + w (0: the variant without the add)")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if no_gpu():
        return 0
    from cutile_norms.cutile.rmsnorm_bwd import PERSISTENT_BACKWARD

    dev = device_info("cuda")
    dtype = getattr(torch, args.dtype)
    results = {}
    for N in args.ns:
        M, x, w = width_inputs(N, dtype)
        dy = torch.randn(M, N, device="cuda", dtype=dtype)
        rstd = rms_norm_reference(x, w, 1e-6)[1].float().contiguous()
        dx_ref, dw_ref = rms_norm_backward(dy, x, w, rstd, args.offset)
        copy = copy_baseline_ms(x, reps=args.reps)["median_ms"]
        row = {"copy_ms": copy}

        def timed(fn):
            return 1.5 * copy / device_ms(fn, reps=args.reps)["median_ms"]

        cut = lambda: PERSISTENT_BACKWARD.backward(dy, x, w, rstd, args.offset, True, True, dev)  # noqa: E731
        row["cutile"] = timed(cut)
        print(f"N={N:>6} {'cutile table':<14} {row['cutile']:.3f}", flush=True)
        runs = [(name, cfg, None) for name, cfg in variants(N, dtype.itemsize, dev).items()]
        runs += [(f"reducers {r}", device_config(N, dtype.itemsize, dev), r) for r in args.reducers]
        for name, cfg, reducers in runs:
            try:
                def run(need_dw=True, cfg=cfg, reducers=reducers):
                    return B.launch(cfg, dy, x, w, rstd, args.offset, True, need_dw, dev.sm_count, reducers=reducers)
                dx, dw = run()
                ok = (torch.allclose(dx.float(), dx_ref.float(), rtol=2e-2, atol=2e-2)
                      and torch.allclose(dw.float(), dw_ref.float(), rtol=2e-2, atol=1e-1))
                r = timed(run)
                r_nodw = timed(lambda: run(False))
                row[name] = {"ratio": r, "no_dw": r_nodw, "dw_share": 1 - r / r_nodw, "ok": ok}
                print(f"N={N:>6} {name:<14} {r:.3f} (no dw {r_nodw:.3f}, dw {100 * (1 - r / r_nodw):.1f} %)"
                      f"{'' if ok else '  WRONG'}  {cfg.short()}", flush=True)
            except Exception as exc:  # noqa: BLE001
                print(f"N={N:>6} {name:<14} error {type(exc).__name__}: {str(exc)[:300]}", flush=True)
        results[str(N)] = row
        x = dy = dx_ref = None
        torch.cuda.empty_cache()
    write_json(args.out, {"gpu": torch.cuda.get_device_name(), "dtype": args.dtype, "rows": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
