"""Probe: Triton forward and backward launch configs side by side at the bench size (bf16, 2^27
elements), each as a ratio to a same-run copy (the backward's bytes are 1.5x the copy's). Variants of
the analytic config: the tile budget (elements per program), the persistence (programs per SM, 0 = one
program per tile), warps, and Triton's software pipelining of the tile loop.

    python bench/probe/triton_configs.py [--ns 1024,4096,...] [--out F]
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from bench.probe.common import no_gpu, write_json  # noqa: E402
from bench.timing import copy_baseline_ms, device_ms  # noqa: E402
from cutile_norms._platform import device_info  # noqa: E402
from cutile_norms.reference import rms_norm_backward, rms_norm_reference  # noqa: E402
from cutile_norms.triton import rmsnorm_bwd as B, rmsnorm_fwd as F  # noqa: E402

ELEMENTS = 1 << 27


def variants(mod, N, dev):
    base = mod.analytic_config(N, 2, dev.vendor, dev.sm_count)
    out = {"analytic": base}
    for tile in (4096, 16384, 32768):
        if tile != mod.TILE_ELEMS:
            out[f"tile {tile}"] = mod.analytic_config(N, 2, dev.vendor, dev.sm_count, tile_elems=tile)
    out["stages 2"] = dataclasses.replace(base, num_stages=2)
    out["warps/2"] = dataclasses.replace(base, num_warps=max(1, base.num_warps // 2),
                                         programs_per_sm=base.programs_per_sm * 2)
    out["pps x2"] = dataclasses.replace(base, programs_per_sm=base.programs_per_sm * 2)
    if mod is F:
        out["one per tile"] = dataclasses.replace(base, programs_per_sm=0)
        if N > 8192:  # one program per row, two passes over chunks (x kept in L2 between them)
            for block, warps, pps in ((4096, 8, 0), (8192, 16, 0), (8192, 16, 2), (16384, 32, 0), (2048, 16, 0)):
                if block < N:
                    out[f"2pass {block}/{warps}w/pps{pps}"] = F.FwdConfig(
                        rows=1, split=1, part=N, block_n=block, chunks=-(-N // block), num_warps=warps,
                        programs_per_sm=pps)
    else:
        out["sum per tile"] = dataclasses.replace(base, acc_2d=False)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ns", type=lambda s: [int(v) for v in s.split(",")],
                   default=[128, 1024, 4096, 16384, 32768, 65536, 262144])
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if no_gpu():
        return 0
    dev = device_info("cuda")
    results = {}
    for N in args.ns:
        M = ELEMENTS // N
        x = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
        w = (1 + 0.1 * torch.randn(N, device="cuda")).to(torch.bfloat16)
        dy = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
        y_ref, rstd = rms_norm_reference(x[:64], w, 1e-6)
        rstd_all = torch.rsqrt(x.float().square().mean(-1) + 1e-6)
        dx_ref, dw_ref = rms_norm_backward(dy, x, w, rstd_all)
        copy = copy_baseline_ms(x, reps=20)["median_ms"]
        row = {"copy_ms": copy}
        for name, cfg in variants(F, N, dev).items():
            try:
                y, _ = F.TRITON_FORWARD.forward(x, w, 1e-6, 0.0, True, dev, cfg=cfg)
                ok = torch.allclose(y[:64].float(), y_ref.float(), rtol=2e-2, atol=2e-2)
                r = copy / device_ms(lambda: F.TRITON_FORWARD.forward(x, w, 1e-6, 0.0, True, dev, cfg=cfg), reps=20)["median_ms"]
                row[f"fwd {name}"] = r
                print(f"N={N:>6} fwd {name:<24} {r:.3f}{'' if ok else '  WRONG'}  {cfg.short()}", flush=True)
            except Exception as e:  # noqa: BLE001
                print(f"N={N:>6} fwd {name:<24} error {type(e).__name__}: {str(e)[:100]}", flush=True)
        for name, cfg in variants(B, N, dev).items():
            try:
                dx, dw = B.TRITON_BACKWARD.backward(dy, x, w, rstd_all, 0.0, True, True, dev, cfg=cfg)
                ok = torch.allclose(dx[:64].float(), dx_ref[:64].float(), rtol=2e-2, atol=2e-2) and \
                    torch.allclose(dw.float(), dw_ref.float(), rtol=3e-2, atol=3e-1)
                r = 1.5 * copy / device_ms(lambda: B.TRITON_BACKWARD.backward(dy, x, w, rstd_all, 0.0, True, True, dev,
                                                                               cfg=cfg), reps=20)["median_ms"]
                row[f"bwd {name}"] = r
                print(f"N={N:>6} bwd {name:<24} {r:.3f}{'' if ok else '  WRONG'}  {cfg.short()}", flush=True)
            except Exception as e:  # noqa: BLE001
                print(f"N={N:>6} bwd {name:<24} error {type(e).__name__}: {str(e)[:100]}", flush=True)
        results[str(N)] = row
        del x, dy, dx_ref
        torch.cuda.empty_cache()
    write_json(args.out, {"gpu": torch.cuda.get_device_name(), "rows": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
