"""Probe: every forward and backward kernel (and the tma_smem_cached launch-config candidates) at the
widths real models use and at random multiples of 8, as ratios to a same-run copy, medians of
interleaved rounds. It backs the rules that pick a kernel between measured widths (dispatch.py) and
the CuTe DSL forward's config rule (cute/rmsnorm_fwd_config.py).

    python bench/probe/model_widths.py [--only fwd|bwd] [--ns ...] [--random 6] [--rounds 3] [--out F]
        [--kernels k1,k2,...]   (default: every kernel; names as printed, "None" = rms_norm with mode=None)
    python bench/probe/model_widths.py --write-table RUN.json[,RUN2.json...] [--command "..."]
        (mode=None's rows for those runs' GPU and dtype from their forward ratios, a width measured in
        several runs at its lowest: cutile_norms/forward_table.py)

Bytes: forward = the copy's (read x, write y); backward = 1.5 x the copy's (read x, dy; write dx).
Every output is checked against the fp32 reference (the last 64 rows) before it is timed.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import statistics
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from bench import anchors as anchor_registry  # noqa: E402
from bench.probe.common import no_gpu, write_json  # noqa: E402
from bench.rmsnorm import MODEL_NS, check_output, random_widths  # noqa: E402
from bench.timing import ratios_to_copy  # noqa: E402
import cutile_norms as cn  # noqa: E402
from cutile_norms import dispatch  # noqa: E402
from cutile_norms._platform import device_info  # noqa: E402
from cutile_norms.cute import rmsnorm_bwd as cute_bwd  # noqa: E402
from cutile_norms.cute import rmsnorm_fwd as cute_fwd  # noqa: E402
from cutile_norms.cute.rmsnorm_bwd_config import analytic_config as bwd_config, ring_stages  # noqa: E402
from cutile_norms.cute.rmsnorm_fwd_config import analytic_config as fwd_config  # noqa: E402
from cutile_norms.forward_table import merge_points, write_rows  # noqa: E402
from cutile_norms.reference import rms_norm_backward, rms_norm_reference  # noqa: E402

ELEMENTS = 1 << 27
FWD_CANDIDATES = {  # name -> analytic_config keyword arguments
    "tma slice 32K": dict(slice_bytes=32 * 1024),
    "tma slice 64K": dict(slice_bytes=64 * 1024),
    "tma slice 64K v16": dict(slice_bytes=64 * 1024, vecs_per_thread=16),
    "tma slice 128K": dict(slice_bytes=128 * 1024),
    "tma 1-CTA 128": dict(one_cta_threads=128),
    "tma 1-CTA 256": dict(one_cta_threads=256),
    "tma 1-CTA 512": dict(one_cta_threads=512),
    "tma cluster 8": dict(cluster_max=8),  # rows past 8 slices in at most 8 CTAs (no clusters of 9-15)
    "tma cluster 8 v16": dict(cluster_max=8, vecs_per_thread=16),
    # rows past 8 slices in at most 8 CTAs of at least 256 / 512 threads. 16-bit rows of 128-256 KiB: t256 gives
    # 256 threads x 5-8 vectors ("tma cluster 8 v16": 128 x 9-16) and t512 the shape of "tma cluster 8" (512 x
    # 3-4); 256-512 KiB: t256 is "tma cluster 8 v16"'s shape (256 x 9-16) and t512 gives 512 x 5-8
    "tma cluster 8 t256": dict(cluster_max=8, vecs_per_thread=16, min_threads=256),
    "tma cluster 8 t512": dict(cluster_max=8, vecs_per_thread=16, min_threads=512),
    "tma fp32 clusters to 16": dict(fp32_wide=False),  # fp32 rows of 8-16 slices as the general rule cuts them
}


def forward_fns(x, w, dev, kernels: set | None = None, anchors=("quack",)):
    fns = {"None": lambda: cn.rms_norm(x, w, 1e-6)}
    for mode in dispatch.modes_of("cutile") + dispatch.modes_of("triton"):
        backend = dispatch.backend(mode)
        fns[mode] = (lambda b: (lambda: b.forward(x, w, 1e-6, 0.0, False, dev)[0]))(backend)
    N, e = x.shape[1], x.element_size()
    seen = set()
    if cute_fwd.TMA_SMEM_CACHED.unsupported(x) is None:
        for name, kw in {"tma analytic": {}, **FWD_CANDIDATES}.items():
            if kernels is not None and name not in kernels:
                continue  # before the dedup: a chosen candidate is never dropped for an unchosen twin
            cfg = fwd_config(N, e, **kw)
            if cfg is not None and cfg not in seen:
                seen.add(cfg)
                fns[name] = (lambda c: (lambda: cute_fwd.launch(c, x, w, 1e-6, 0.0, False)[0]))(cfg)
    loaded, _ = anchor_registry.load(anchors)
    for name, fn in loaded.items():
        fns[name] = (lambda f: (lambda: f(x, w, 1e-6)))(fn)
    return fns


def backward_fns(x, w, dy, rstd, dev):
    from cutile_norms.cutile.rmsnorm_bwd import PERSISTENT_BACKWARD
    from cutile_norms.triton.rmsnorm_bwd import TRITON_BACKWARD

    fns = {"cutile": lambda: PERSISTENT_BACKWARD.backward(dy, x, w, rstd, 0.0, True, True, dev),
           "triton": lambda: TRITON_BACKWARD.backward(dy, x, w, rstd, 0.0, True, True, dev)}
    xn, wn = x.detach().requires_grad_(), w.detach().requires_grad_()
    yn = cn.rms_norm(xn, wn, 1e-6)  # mode=None's backward, through autograd as a training step runs it
    fns["None"] = lambda: torch.autograd.grad(yn, (xn, wn), dy, retain_graph=True)
    cfg = cute_bwd.TMA_SMEM_BACKWARD.config(x.shape[1], x.dtype, dev)  # this GPU's rule
    padded = bwd_config(x.shape[1], x.element_size(), exact=False,  # the rule without its exact tiling
                        small_ring=ring_stages(dev))
    if cfg is not None and cute_bwd.unsupported(x, dy) is None:
        fns["cute"] = lambda: cute_bwd.launch(cfg, dy, x, w, rstd, 0.0, True, True, dev.sm_count)
        if padded != cfg:
            fns["cute padded"] = lambda: cute_bwd.launch(padded, dy, x, w, rstd, 0.0, True, True, dev.sm_count)
    quack, _ = anchor_registry.load(["quack"])
    if quack:
        xg, wg = x.detach().requires_grad_(), w.detach().requires_grad_()
        y = quack["quack"](xg, wg, 1e-6)
        fns["quack"] = lambda: torch.autograd.grad(y, (xg, wg), dy, retain_graph=True)
    return fns


def first_call(fns: dict, k: str, N: int, part: str):
    """fns[k]()'s output, or None (k dropped, the reason printed) where the kernel refuses the width
    (QuACK's backward raises past 128k fp32 columns)."""
    try:
        return fns[k]()
    except Exception as exc:  # noqa: BLE001
        print(f"N={N:>6} {part} {k}: refused ({type(exc).__name__}: {str(exc)[:120]})", flush=True)
        del fns[k]
        return None


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ns", type=lambda s: [int(v) for v in s.split(",")], default=MODEL_NS)
    p.add_argument("--random", type=int, default=6, help="random multiples of 8 in 1024..262144 added")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--only", choices=["fwd", "bwd"], default=None)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--weight-dtype", default=None, help="the weight's dtype (default: x's; float32 for a "
                   "16-bit x beside an fp32 weight, as mixed-precision training holds it)")
    p.add_argument("--out", default=None)
    p.add_argument("--write-table", default=None, metavar="JSON[,JSON...]",
                   help="write mode=None's rows from finished runs' --out JSONs of one GPU and dtype (no GPU needed)")
    p.add_argument("--command", default="python bench/probe/model_widths.py --only fwd",
                   help="with --write-table: the command that measured it (recorded beside the rows)")
    p.add_argument("--anchors", type=lambda s: [v for v in s.split(",") if v], default=["quack"],
                   help="the forward's anchors (bench/anchors.py names; default quack)")
    p.add_argument("--kernels", type=lambda s: set(v for v in s.split(",") if v), default=None,
                   help="only these kernels (and their anchors), by the names the table prints")
    args = p.parse_args()
    if args.write_table:
        runs = [json.load(open(f)) for f in args.write_table.split(",")]
        run = runs[0]
        if any((r["gpu"], r["dtype"]) != (run["gpu"], run["dtype"]) for r in runs):
            sys.exit("--write-table: the runs are of different GPUs or dtypes")
        if any(r.get("weight_dtype", r["dtype"]) != r["dtype"] for r in runs):
            sys.exit("--write-table: a run with --weight-dtype times another weight than the table's rows assume")
        names = {"tma analytic": "tma_smem_cached"}  # the probe's name of the mode's own config
        points = merge_points([{n: {names.get(k, k): v for k, v in row.get("fwd", {}).items()}
                                for n, row in r["rows"].items()} for r in runs])
        print(write_rows(points, run["dtype"], run.get("arch", "sm_90"), run["gpu"], args.command,
                         run.get("date", "?")))
        return 0
    if no_gpu():
        return 0
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(1 << 30)
    ns = sorted(set(args.ns) | set(random_widths(args.random, seed)))
    dev = device_info("cuda")
    dtype = getattr(torch, args.dtype)
    print(f"# {torch.cuda.get_device_name()} {args.dtype} (weight {args.weight_dtype or args.dtype}), seed {seed}, widths {ns}", flush=True)
    results = {}
    for N in ns:
        M = ELEMENTS // N
        x = torch.randn(M, N, device="cuda", dtype=dtype)
        w = (1 + 0.1 * torch.randn(N, device="cuda")).to(getattr(torch, args.weight_dtype or args.dtype))
        row = {}
        if args.only in (None, "fwd"):
            fns = pick(forward_fns(x, w, dev, args.kernels, args.anchors), args.kernels)
            for k in list(fns):
                out = first_call(fns, k, N, "fwd")
                if out is None:
                    continue
                wrong = check_output(out[-64:], x[-64:], w, 1e-6)
                if wrong:
                    print(f"N={N:>6} fwd {k}: {wrong}", flush=True)
                    del fns[k]
            ratios = ratios_to_copy(x, fns, args.rounds)
            row["fwd"] = {k: statistics.median(v) for k, v in ratios.items()}
            row["fwd_rounds"] = {k: [round(r, 4) for r in v] for k, v in ratios.items()}
        if args.only in (None, "bwd"):
            dy = torch.randn_like(x)
            rstd = rms_norm_reference(x, w, 1e-6)[1].float().contiguous()
            dx_ref, _ = rms_norm_backward(dy[-64:], x[-64:], w, rstd[-64:])
            fns = pick(backward_fns(x, w, dy, rstd, dev), args.kernels)
            for k in list(fns):
                out = first_call(fns, k, N, "bwd")
                if out is None:
                    continue
                dx = out[0]
                if not torch.allclose(dx[-64:].float(), dx_ref.float(), rtol=2e-2, atol=2e-2):
                    print(f"N={N:>6} bwd {k}: wrong dx", flush=True)
                    del fns[k]
            ratios = ratios_to_copy(x, fns, args.rounds)
            row["bwd"] = {k: 1.5 * statistics.median(v) for k, v in ratios.items()}
            del dy, rstd
        results[str(N)] = row
        for part in ("fwd", "bwd"):
            if part in row:
                best = max(row[part], key=row[part].get)
                print(f"N={N:>6} {part} " + "  ".join(f"{k} {v:.3f}" for k, v in row[part].items())
                      + f"  | best {best}", flush=True)
        del x, w
        torch.cuda.empty_cache()
        # after every width: a run stopped at its time limit keeps what it measured
        write_json(args.out, {"gpu": torch.cuda.get_device_name(), "dtype": args.dtype, "weight_dtype": args.weight_dtype or args.dtype, "seed": seed,
                              "arch": dev.arch_name, "date": datetime.date.today().isoformat(), "rows": results})
    return 0


def pick(fns: dict, kernels: set | None) -> dict:
    return fns if kernels is None else {k: f for k, f in fns.items() if k in kernels}


if __name__ == "__main__":
    sys.exit(main())
