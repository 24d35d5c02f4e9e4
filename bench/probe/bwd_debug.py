"""Diagnose the backward's cross-block communication on the GPU (dw partials + reducers, the split
rows' exchange): where wrong results come from, in one run.

    python bench/probe/bwd_debug.py
"""
from __future__ import annotations

import dataclasses
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from cutile_norms._platform import device_info  # noqa: E402
from cutile_norms.cutile import rmsnorm_bwd as B  # noqa: E402
from cutile_norms.reference import rms_norm_reference  # noqa: E402


def inputs(M, N, dtype=torch.bfloat16):
    torch.manual_seed(0)
    x = torch.randn(M, N, device="cuda", dtype=dtype)
    w = (1 + 0.1 * torch.randn(N, device="cuda")).to(dtype)
    dy = torch.randn(M, N, device="cuda", dtype=dtype)
    rstd = torch.empty(-(-M // 16) * 16, device="cuda")[:M]
    rstd.copy_(rms_norm_reference(x, w, 1e-6)[1])
    return x, w, dy, rstd


def expected(x, w, dy, rstd):
    xh = x.double() * rstd.double()[:, None]
    g = dy.double() * w.double()
    dx = rstd.double()[:, None] * (g - xh * (g * xh).mean(-1, keepdim=True))
    return dx, dy.double() * xh, (g * xh)


def run(cfg, M, N, label, reps=3):
    dev = device_info("cuda")
    x, w, dy, rstd = inputs(M, N)
    dx_e, dwrows, gx = expected(x, w, dy, rstd)
    dw_e = dwrows.sum(0)
    R = B.grid_rows(cfg, M, dev.sm_count)
    print(f"== {label}: {cfg.short()} M={M} N={N} R={R} G={R * cfg.split}", flush=True)
    for rep in range(reps):
        dx = B.dx_buffer(cfg, M, N, x.dtype, x.device)
        dx.untyped_storage().fill_(0xFF)
        dw = torch.full((N,), float("nan"), device="cuda", dtype=w.dtype)
        B.launch(cfg, dy, x, w, rstd, 0.0, True, True, dev.sm_count, out=(dx, dw))
        torch.cuda.synchronize()
        err = (dx.double() - dx_e).abs()
        bad_rows = (err > 0.02 + 0.02 * dx_e.abs()).any(1).nonzero().flatten().tolist()
        ks = sorted({r // R for r in bad_rows})
        dwerr = (dw.double() - dw_e).abs()
        bad_cols = (dwerr > 1.0 + 0.01 * dw_e.abs()).nonzero().flatten().tolist()
        line = f"  rep {rep}: dx bad rows {len(bad_rows)} (iteration k of their block: {ks[:10]}, rows {bad_rows[:8]}); " \
               f"dw bad cols {len(bad_cols)} {bad_cols[:6]}... worst {dwerr.max().item():.3g}"
        if R > 1:
            ws = B._WORKSPACES.get(("partials", x.device.index, B._raw_stream(x.device.index)))
            npad = cfg.split * B.part_of(cfg, N)
            part = ws[:R * npad].view(R, npad)[:, :N].double()
            exp_part = torch.stack([dwrows[r::R].sum(0) for r in range(R)])
            perr = (part - exp_part).abs().amax(1)
            bad_part = (perr > 0.5).nonzero().flatten().tolist()
            host_dw_err = (part.sum(0) - dw_e).abs().max().item()
            line += f"; partial rows wrong {len(bad_part)} {bad_part[:8]}; dw from partials on host err {host_dw_err:.3g}"
            tick = B._WORKSPACES.get(("tickets", x.device.index, B._raw_stream(x.device.index)))
            line += f"; tickets after {tick[:2].tolist()}"
        if cfg.split > 1:
            sync = B._WORKSPACES.get((f"sync{cfg.split}", x.device.index, B._raw_stream(x.device.index)))
            slots = sync[:M * cfg.split].view(M, cfg.split)
            flags = (slots >> 32)
            vals = (slots & 0xFFFFFFFF).to(torch.int32).view(torch.float32).double()
            part_n = B.part_of(cfg, N)
            exp_dots = torch.stack([gx[:, s * part_n:(s + 1) * part_n].sum(1) for s in range(cfg.split)], 1)
            verr = (vals - exp_dots).abs() > 1e-2 * (1 + exp_dots.abs())
            line += f"; flags {torch.unique(flags).tolist()}; slot values wrong {int(verr.sum())} rows {verr.any(1).nonzero().flatten().tolist()[:8]}"
        print(line, flush=True)


def main():
    cfgs = [
        ("dw split1 4096 full", B.analytical_config(4096, 2), 32768, 4096),
        ("dw split1 4096 M300", B.analytical_config(4096, 2), 300, 4096),
        ("split2 7168 M300", B.analytical_config(7168, 2), 300, 7168),
        ("split4 16384 M1000", B.analytical_config(16384, 2), 1000, 16384),
        ("split2 7168 M7", B.analytical_config(7168, 2), 7, 7168),
    ]
    for label, cfg, M, N in cfgs:
        run(cfg, M, N, label)
    # the same with the compiler's optimisations lowered (a miscompile shows as a difference)
    for opt in (0, 1):
        orig = B.kernel_for

        def patched(hints, opt=opt):
            k = orig(hints)
            return k.replace_hints(opt_level=opt)
        B.kernel_for = patched
        try:
            run(B.analytical_config(4096, 2), 32768, 4096, f"dw 4096 full opt_level={opt}", reps=2)
            run(B.analytical_config(7168, 2), 300, 7168, f"split2 7168 M300 opt_level={opt}", reps=2)
        except Exception as exc:
            print(f"opt_level={opt}: {type(exc).__name__}: {str(exc)[:300]}")
        B.kernel_for = orig


if __name__ == "__main__":
    main()
