"""The residual add + RMSNorm (rms_norm(x, w, residual=r) -> (y, h)) against a same-run copy.

    python bench/residual.py [--ns 2048,4096,...] [--random 4] [--runs 3] [--dtype bfloat16] [--out F]

Forward bytes: read x and r, write h and y (4 M N e at one dtype: twice the copy's), so a ratio is
2 x copy time / time. Implementations: ours fused (the experimental Triton kernel, opted in), ours
unfused (torch.add into h, then mode=None's norm kernel), the unfused composite under torch.compile
(x + r, then the fp32 reference), QuACK's and Liger's residual paths where installed. Every output is
checked first: h bit for bit against the fp32 sum rounded once, y against the fp32 norm of h (last 64
rows). Then a pre-norm block forward + backward (hidden --block-n, --block-m rows): fused against
`h = x + r; rms_norm(h)`, ms per step. Medians of --runs interleaved runs.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import cutile_norms as cn  # noqa: E402
from bench.rmsnorm import DTYPES, MODEL_NS, random_widths  # noqa: E402
from bench.probe.common import write_json  # noqa: E402
from bench.timing import device_ms, ratios_to_copy  # noqa: E402
from cutile_norms.reference import add_rms_norm_reference, rms_norm_reference  # noqa: E402

ELEMENTS = 1 << 27


def ours(fused: bool):
    def run(x, r, w, eps):
        os.environ["CUTILE_NORMS_EXPERIMENTAL"] = "1" if fused else "0"
        return cn.rms_norm(x, w, eps, residual=r)
    return run


def anchors() -> dict:
    fns, missing = {}, {}
    compiled = torch.compile(lambda x, r, w, eps: add_rms_norm_reference(x, r, w, eps)[:2], dynamic=False)
    fns["torch.compile"] = compiled
    try:
        from quack.rmsnorm import rmsnorm

        fns["quack"] = lambda x, r, w, eps: rmsnorm(x, w, residual=r, eps=eps, prenorm=True)
    except Exception as exc:  # noqa: BLE001 -- report, never fake
        missing["quack"] = f"{type(exc).__name__}: {exc}"[:160]
    try:
        from liger_kernel.ops.fused_add_rms_norm import LigerFusedAddRMSNormFunction

        fns["liger"] = lambda x, r, w, eps: LigerFusedAddRMSNormFunction.apply(x, r, w, eps, 0.0, "llama", False)
    except Exception as exc:  # noqa: BLE001
        missing["liger"] = f"{type(exc).__name__}: {exc}"[:160]
    return fns, missing


def wrong(out, x, r, w, eps) -> str | None:
    """None when out is (y, h) with h the fp32 sum rounded once and y the fp32 norm of h (last 64 rows)."""
    if not isinstance(out, (tuple, list)) or len(out) < 2:
        return f"returned {type(out).__name__}, not (y, h)"
    y, h = out[0], out[1]
    if not torch.equal(h[-64:], (x[-64:].float() + r[-64:].float()).to(h.dtype)):
        return "h differs from the fp32 sum rounded once"
    ey = rms_norm_reference(h[-64:], w, eps)[0].float()
    if not torch.allclose(y[-64:].float(), ey, rtol=2e-2, atol=2e-2):
        return "y differs from the norm of h"
    return None


def forward_table(ns, dtype, runs) -> list:
    fns = {"cn fused": ours(True), "cn unfused": ours(False)}
    extra, missing = anchors()
    fns.update(extra)
    for k, why in missing.items():
        print(f"anchor {k} skipped: {why}", flush=True)
    rows = []
    for N in ns:
        M = ELEMENTS // N
        x, r = torch.randn(M, N, device="cuda", dtype=dtype), torch.randn(M, N, device="cuda", dtype=dtype)
        w = (1 + 0.1 * torch.randn(N, device="cuda")).to(dtype)
        ok = {}
        for k, fn in fns.items():
            try:
                why = wrong(fn(x, r, w, 1e-6), x, r, w, 1e-6)
            except Exception as exc:  # noqa: BLE001
                why = f"{type(exc).__name__}: {exc}"[:160]
            if why:
                print(f"N={N} {k}: not timed ({why})", flush=True)
            else:
                ok[k] = (lambda f: (lambda: f(x, r, w, 1e-6)))(fn)
        ratios = ratios_to_copy(x, ok, runs)
        rec = {"N": N, "M": M, "vs_copy": {k: 2 * statistics.median(v) for k, v in ratios.items()},
               "vs_copy_runs": {k: [round(2 * t, 4) for t in v] for k, v in ratios.items()}}
        rows.append(rec)
        print(f"N={N:>6} " + "  ".join(f"{k} {v:.3f}" for k, v in rec["vs_copy"].items()), flush=True)
        x = r = ok = None  # free the inputs before the next width
        torch.cuda.empty_cache()
    return rows


def block(M, N, dtype, runs) -> dict:
    """ms per forward + backward of a pre-norm block's add + norm: fused against unfused."""
    x = torch.randn(M, N, device="cuda", dtype=dtype, requires_grad=True)
    r = torch.randn(M, N, device="cuda", dtype=dtype, requires_grad=True)
    w = (1 + 0.1 * torch.randn(N, device="cuda")).to(dtype).requires_grad_()
    dy, dh = torch.randn(M, N, device="cuda", dtype=dtype), torch.randn(M, N, device="cuda", dtype=dtype)

    def step(fused):
        os.environ["CUTILE_NORMS_EXPERIMENTAL"] = "1" if fused else "0"
        if fused is None:  # the unfused block: the add, then the norm
            h = x + r
            y = cn.rms_norm(h, w)
        else:
            y, h = cn.rms_norm(x, w, residual=r)
        torch.autograd.backward((y, h), (dy, dh))
    t = {k: [] for k in ("fused", "ours unfused", "x + r then rms_norm")}
    for _ in range(runs):
        for k, f in zip(t, (True, False, None)):
            t[k].append(device_ms(lambda: step(f), reps=20)["median_ms"])
    return {k: statistics.median(v) for k, v in t.items()}


def main() -> int:
    ints = lambda s: [int(v) for v in s.split(",") if v]  # noqa: E731
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ns", type=ints, default=MODEL_NS)
    p.add_argument("--random", type=int, default=4)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    p.add_argument("--block-n", type=int, default=4096)
    p.add_argument("--block-m", type=int, default=16384)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("No CUDA GPU here: this bench times GPU kernels. Nothing was run.")
        return 0
    seed = args.seed if args.seed is not None else int.from_bytes(os.urandom(3), "little")
    ns = sorted(set(args.ns) | set(random_widths(args.random, seed)))
    dtype = DTYPES[args.dtype]
    print(f"# {torch.cuda.get_device_name()} {args.dtype}, M = 2^27 / N, random widths seed {seed}", flush=True)
    result = {"gpu": torch.cuda.get_device_name(), "command": "python bench/residual.py " + " ".join(sys.argv[1:]),
              "seed": seed, "forward": forward_table(ns, dtype, args.runs)}
    result["block"] = block(args.block_m, args.block_n, dtype, args.runs)
    b = result["block"]
    print(f"block M={args.block_m} N={args.block_n} fwd+bwd ms: " + "  ".join(f"{k} {v:.3f}" for k, v in b.items())
          + f"  | unfused / fused {b['x + r then rms_norm'] / b['fused']:.2f}x", flush=True)
    write_json(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
