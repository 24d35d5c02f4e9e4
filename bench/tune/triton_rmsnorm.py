"""Probe: Triton forward and backward launch configs side by side at the bench size (bf16, 2^27
elements), each as a ratio to a same-run copy (the backward's bytes are 1.5x the copy's). Variants of
the analytic config: tiles of 2048-16384 elements at 8-32 values per thread, one program per tile or a
persistent grid that prefetches its next tile, two passes over chunks or the whole row in registers
(forward), rows split over programs (parts in registers or in two passes); Liger's forward beside
them. docs/history.md, "The Triton mode, second round", has the results and the choices made from them.

    python bench/tune/triton_rmsnorm.py [--ns 1024,4096,...] [--only fwd|bwd] [--match REGEX] [--out F]
        [--rounds 3] [--dtype float16|float32]   (the forward: medians of interleaved rounds; x's dtype)

Every variant is checked on every row against an fp32 reference and for identical bits on a later
launch (split rows flip their exchange flags each launch); a wrong one prints WRONG.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import re
import statistics
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from bench.probe.common import no_gpu, write_json  # noqa: E402
from bench.timing import copy_baseline_ms, device_ms, ratios_to_copy  # noqa: E402
from bench.tune.sweep import width_inputs  # noqa: E402
from cutile_norms._platform import device_info  # noqa: E402
from cutile_norms.reference import rms_norm_backward  # noqa: E402
from cutile_norms._util import pow2_ceil  # noqa: E402
from cutile_norms.triton import rmsnorm_bwd as B, rmsnorm_fwd as F  # noqa: E402
from cutile_norms.triton import rmsnorm_bwd_config as BC, rmsnorm_fwd_config as FC  # noqa: E402


def _warps(threads_needed: int) -> int:
    return max(1, min(32, pow2_ceil(max(32, threads_needed)) // 32))


def fwd_variants(N, dev, elem_bytes=2):
    base = FC.analytic_config(N, elem_bytes, dev.vendor, dev.sm_count)
    out = {"analytic": base}
    if not base.fixed_n:  # (its kernel has no tile loop or prefetch to vary)
        out["analytic 1tile"] = dataclasses.replace(base, one_tile=True)
    if N <= FC.ROW_ELEMS:
        block = pow2_ceil(N)
        if not base.fixed_n:
            out["analytic prefetch"] = dataclasses.replace(base, prefetch=True)
            out["one per tile"] = dataclasses.replace(base, programs_per_sm=0)
        for tile in (2048, 4096):  # smaller tiles, one program per tile or persistent with prefetch
            rows = max(1, tile // block)
            for vpt in (8, 16):
                cfg = FC.FwdConfig(rows=rows, split=1, part=N, block_n=block, chunks=1,
                                  num_warps=_warps(rows * block // vpt), programs_per_sm=0)
                out[f"tile {rows * block} {vpt}/thr"] = cfg
                pps = max(1, 2048 // (cfg.num_warps * 32))
                out[f"tile {rows * block} {vpt}/thr pf"] = dataclasses.replace(cfg, programs_per_sm=pps, prefetch=True)
        for block in (1024, 2048, 4096):  # two passes over chunks, one program per row (x re-read from L2)
            for warps in (4, 8, 16):
                if block < N and block // (warps * 32) >= 4:
                    out[f"2pass {block}/{warps}w"] = FC.FwdConfig(
                        rows=1, split=1, part=N, block_n=block, chunks=-(-N // block), num_warps=warps,
                        programs_per_sm=0)
    else:
        if N <= 16384:  # the whole row in registers, one program per row (Liger's shape: 16 per thread)
            block = pow2_ceil(N)
            for vpt in (8, 16, 32):
                cfg = FC.FwdConfig(rows=1, split=1, part=N, block_n=block, chunks=1, num_warps=_warps(block // vpt),
                                  programs_per_sm=0)
                out[f"row in regs {vpt}/thr"] = cfg
                out[f"row in regs {vpt}/thr 1tile"] = dataclasses.replace(cfg, one_tile=True)
        for split in (2, 4, 8, 16, 32):
            part = -(-N // split)
            if part < 2048 or part > 16384:
                continue
            part = -(-part // 16) * 16
            for vpt in (16, 32):
                out[f"split {split} {vpt}/thr"] = FC.FwdConfig(
                    rows=1, split=split, part=part, block_n=pow2_ceil(part), chunks=1,
                    num_warps=_warps(pow2_ceil(part) // vpt), programs_per_sm=0)
            for block, warps in ((2048, 4), (4096, 8)):  # each part in two passes over chunks (re-read from L2)
                if part > block:
                    out[f"split {split} 2pass {block}/{warps}w"] = FC.FwdConfig(
                        rows=1, split=split, part=part, block_n=block, chunks=-(-part // block), num_warps=warps,
                        programs_per_sm=0)
    if 256 <= N <= 65536:  # two passes with N compiled in (rms_norm_fwd_fixed_kernel), 8 or 16 values a thread
        for warps in (1, 2, 4, 8, 16, 32):
            for vpt in (8, 16):
                block = warps * 32 * vpt
                if block <= 2 * pow2_ceil(N):
                    out[f"fixed {block}/{warps}w"] = FC.FwdConfig(
                        rows=1, split=1, part=N, block_n=block, chunks=-(-N // block), num_warps=warps,
                        programs_per_sm=0, fixed_n=True)
    return out


def bwd_variants(N, dev):
    base = BC.analytic_config(N, 2, dev.vendor, dev.sm_count, tma_rows=BC.tma_rows_rule(dev))  # this GPU's rule
    out = {"analytic": base, "analytic prefetch": dataclasses.replace(base, prefetch=True)}
    if N <= 8192:
        block = pow2_ceil(N)
        for tile in (2048, 4096, 8192, 16384, 32768):
            rows = max(1, tile // block)
            if rows > 64:
                continue
            for vpt in (4, 8, 16, 32):
                warps = _warps(rows * block // vpt)
                if rows * block // (warps * 32) != vpt:  # fewer than one warp's or more than 1024 threads' worth
                    continue
                out[f"tile {rows * block} {vpt}/thr pf"] = BC.BwdConfig(
                    rows=rows, split=1, part=N, block_n=block, chunks=1, num_warps=warps,
                    programs_per_sm=max(1, 2048 // (warps * 32)), prefetch=True)
    else:
        for split in (1, 2, 4, 8, 16, 32, 64, 128):
            part = -(-N // split)
            if part < 2048 or part > 16384:
                continue
            part = -(-part // 16) * 16
            for vpt in (8, 16, 32):
                warps = _warps(pow2_ceil(part) // vpt)
                pps = max(1, 2048 // (warps * 32))
                for pf in (False, True):
                    out[f"split {split} {vpt}/thr{' pf' if pf else ''}"] = BC.BwdConfig(
                        rows=1, split=split, part=part, block_n=pow2_ceil(part), chunks=1, num_warps=warps,
                        programs_per_sm=pps, prefetch=pf)
                if part & (part - 1) == 0 and part * split == N:  # x and dy by TMA, pipelined (rms_norm_bwd_tma_kernel)
                    for stages in (2, 3, 4):
                        out[f"split {split} {vpt}/thr tma{stages}"] = BC.BwdConfig(
                            rows=1, split=split, part=part, block_n=part, chunks=1, num_warps=warps,
                            programs_per_sm=pps, prefetch=True, tma_stages=stages)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ns", type=lambda s: [int(v) for v in s.split(",")],
                   default=[128, 512, 1024, 2048, 2880, 4096, 5120, 7168, 8192, 16384, 32768, 65536, 131072,
                            262144])
    p.add_argument("--out", default=None)
    p.add_argument("--only", choices=("", "fwd", "bwd"), default="")
    p.add_argument("--match", default="", help="only the variants whose name matches this regex")
    p.add_argument("--rounds", type=int, default=1, help="the forward: medians of this many interleaved rounds")
    p.add_argument("--dtype", default="bfloat16", help="x's and the weight's dtype (the forward)")
    args = p.parse_args()
    if no_gpu():
        return 0
    dev = device_info("cuda")
    try:
        from bench.anchors import load
        liger = load(["liger"])[0].get("liger")
    except Exception:  # noqa: BLE001
        liger = None
    results = {}
    for N in args.ns:
        M, x, w = width_inputs(N, getattr(torch, args.dtype))
        dy = torch.randn(M, N, device="cuda", dtype=x.dtype)
        rstd_all = torch.rsqrt(x.float().square().mean(-1) + 1e-6)
        y_ref = (x.float() * rstd_all[:, None] * w.float()).to(x.dtype)
        dx_ref, dw_ref = rms_norm_backward(dy, x, w, rstd_all)
        copy = copy_baseline_ms(x, reps=20)["median_ms"]
        row = {"copy_ms": copy}
        if args.only in ("", "fwd") and liger is not None:  # the anchor, same run
            r = copy / device_ms(lambda: liger(x, w, 1e-6), reps=20)["median_ms"]
            row["fwd Liger"] = r
            print(f"N={N:>6} fwd {'Liger (anchor)':<28} {r:.3f}", flush=True)
        if args.only in ("", "fwd"):
            runs, cfgs = {}, {}
            for name, cfg in fwd_variants(N, dev, x.element_size()).items():
                if not re.search(args.match, name):
                    continue
                run = functools.partial(F.TRITON_FORWARD.forward, x, w, 1e-6, 0.0, True, dev, cfg=cfg)
                try:
                    y, rstd = run()
                    ok = (torch.allclose(y.float(), y_ref.float(), rtol=2e-2, atol=2e-2)
                          and torch.allclose(rstd, rstd_all, rtol=1e-4))
                    ok = ok and torch.equal(run()[0], y)  # every launch after the first (the exchange's flags flip)
                    if not ok:
                        print(f"N={N:>6} fwd {name:<28} WRONG  {cfg.short()}", flush=True)
                        continue
                    runs[name], cfgs[name] = run, cfg
                except Exception as e:  # noqa: BLE001
                    print(f"N={N:>6} fwd {name:<28} error {type(e).__name__}: {str(e)[:100]}", flush=True)
            for name, rs in ratios_to_copy(x, runs, args.rounds).items():
                row[f"fwd {name}"] = r = statistics.median(rs)
                print(f"N={N:>6} fwd {name:<28} {r:.3f}  {cfgs[name].short()}", flush=True)
        if args.only in ("", "bwd"):
            for name, cfg in bwd_variants(N, dev).items():
                if not re.search(args.match, name):
                    continue
                run = functools.partial(B.TRITON_BACKWARD.backward, dy, x, w, rstd_all, 0.0, True, True, dev, cfg=cfg)
                try:
                    dx, dw = run()
                    ok = torch.allclose(dx.float(), dx_ref.float(), rtol=2e-2, atol=2e-2) and \
                        torch.allclose(dw.float(), dw_ref.float(), rtol=3e-2, atol=3e-1)
                    r = 1.5 * copy / device_ms(run, reps=20)["median_ms"]
                    dx2, dw2 = run()
                    ok = ok and torch.equal(dx2, dx) and torch.equal(dw2, dw)
                    row[f"bwd {name}"] = r
                    print(f"N={N:>6} bwd {name:<28} {r:.3f}{'' if ok else '  WRONG'}  {cfg.short()}", flush=True)
                except Exception as e:  # noqa: BLE001
                    print(f"N={N:>6} bwd {name:<28} error {type(e).__name__}: {str(e)[:100]}", flush=True)
        results[str(N)] = row
        del x, dy, dx_ref, y_ref
        torch.cuda.empty_cache()
    write_json(args.out, {"gpu": torch.cuda.get_device_name(), "rows": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
