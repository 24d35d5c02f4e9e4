"""Probe: Triton's backward on narrow 16-bit rows, the pointer kernel (its register prefetch) against
rms_norm_bwd_tma_rows_kernel at each of --tiles (a tile's most elements, TmaRowsRule.tile_elems; the
GPU's own by default), --stages (the rule's tile and count marked *; 0: the rule's count) and --pieces
(the most pieces a row is cut into, 1 or 2, rmsnorm_bwd_config.row_pieces; 1: one power-of-two block;
only rows that many exact pieces tile), beside
mode=None and
QuACK; bf16, 2^27 elements, each as a ratio to a same-run copy (bytes: x, dy and dx, 1.5 x the copy's).
--dh: the residual add's backward instead (dh read and added: the TMA rows kernel's dh entry points, Triton's
fused register kernel, mode=None's residual backward and QuACK's; bytes: dy, h, dh and the grad, 2 x the copy's);
medians of --rounds interleaved rounds. Every kernel's dx and dw are checked against the reference
first. The rule: rmsnorm_bwd_config.tma_rows_take and the GPU's TmaRowsRule (docs/performance.md 2.26,
2.27, 2.48); widths the rule leaves to the pointer kernel are timed with the TMA kernel too (past
TMA_ROWS_MAX columns a row a tile).

    python bench/probe/triton_bwd_rows.py [--ns 640,768,896,...] [--tiles 8192,14336] [--stages 3,4,5]
        [--pieces 1,2] [--rounds 3]
"""
from __future__ import annotations

import os
import statistics
import sys
from dataclasses import replace

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from bench import anchors as anchor_registry  # noqa: E402
from bench.probe.common import backward_case, backward_close, ints, no_gpu, width_parser, write_json  # noqa: E402
from bench.timing import ratios_to_copy  # noqa: E402
import cutile_norms as cn  # noqa: E402
from cutile_norms._platform import device_info  # noqa: E402
from cutile_norms.triton import rmsnorm_bwd as T  # noqa: E402
from cutile_norms._util import pow2_ceil  # noqa: E402
from cutile_norms.triton._common import shared_per_block  # noqa: E402
from cutile_norms.triton.add_rmsnorm_bwd import add_rms_norm_bwd  # noqa: E402
from cutile_norms.triton.add_rmsnorm_bwd_config import tma_rows  # noqa: E402
from cutile_norms.triton.rmsnorm_bwd_config import (TMA_ROWS_MAX, row_pieces, tma_rows_config,  # noqa: E402
                                                    tma_rows_rule, tma_rows_stages, tma_rows_tile)

NS = [512, 640, 768, 896, 1040, 1152, 1280, 1480, 1536, 1800, 2040, 2048]


def main() -> int:
    p = width_parser(__doc__, NS)
    p.add_argument("--stages", type=ints, default=[3, 4, 5])
    p.add_argument("--tiles", type=ints, default=None, help="tile_elems to time (default: the GPU's rule's)")
    p.add_argument("--dh", action="store_true", help="the residual add's backward (dh added)")
    p.add_argument("--pieces", type=ints, default=None,
                   help="most pieces a row is cut into, 1 or 2 (the kernel's entry points; default: the rule's)")
    args = p.parse_args()
    if any(k not in (1, 2) for k in args.pieces or ()):
        p.error("--pieces: 1 or 2 (rmsnorm_bwd_kernel.TMA_ROWS_KERNELS)")
    if no_gpu():
        return 0
    dev = device_info(torch.device("cuda"))
    rule = tma_rows_rule(dev)
    shared = shared_per_block(torch.device("cuda", torch.cuda.current_device()))
    print(f"# {torch.cuda.get_device_name()}, {rule}", flush=True)
    quack, _ = anchor_registry.load(["quack"])
    rows = {}
    for N in args.ns:
        cfg = T.TRITON_BACKWARD.config(N, torch.bfloat16, dev)
        M, x, w, dy, rstd, dx_ref, dw_ref = backward_case(N)
        dx, dw = torch.empty_like(x), torch.empty_like(w)
        dh = torch.randn_like(x) if args.dh else None
        if args.dh:
            dx_ref = (dx_ref.float() + dh.float()).to(x.dtype)

        def run(c):
            return lambda: T.launch(c, dy, x, w, rstd, 0.0, True, True, dev.sm_count, out=(dx, dw), tma_capable=True,
                                    dh2d=dh)
        fns = {}
        mine = (cfg.tma_rows, cfg.pieces, cfg.tma_stages)  # the rule's form, marked *
        if args.dh:  # Triton's fused register kernel (no device given: never the TMA form), its own outputs
            fns["fused regs"] = lambda: add_rms_norm_bwd(dy, dh, x, w, rstd, 0.0, True, 2 * dev.sm_count, x.dtype)
            take = tma_rows(N, 2, dev)
            mine = (take["tma_rows"], take["tma_pieces"] or (pow2_ceil(N),), take["tma_stages"]) if take else None
        else:
            fns["pointer"] = run(replace(cfg, tma_rows=0, tma_stages=0))
        for tile in args.tiles or [rule.tile_elems]:  # any width and fill; * the rule's tile, pieces and stages
            rows_t = 1 if N > TMA_ROWS_MAX else tma_rows_tile(N, tile)
            for most in args.pieces or [rule.pieces]:
                pieces = row_pieces(N, most)
                if most > 1 and len(pieces) == 1:  # no exact tiling in `most` pieces: the 1-piece case
                    continue
                for s in args.stages:
                    s = s or (mine[2] if args.dh and mine else tma_rows_stages(N, rows_t, 2, rule.in_flight))
                    tma = replace(cfg, tma_rows=rows_t, tma_stages=s, tma_pieces=pieces if len(pieces) > 1 else ())
                    launched = tma_rows_config(tma, shared, dh_bytes=2 if args.dh else 0)  # what the launch runs
                    if (launched is None or launched.tma_stages != s
                            or not T.tma_rows_applies(tma, x, dy, dx, N, N, True, dh)):  # (dh: 32-byte rows past 1024)
                        continue
                    ours = mine == (rows_t, tma.pieces, s)
                    name = f"tma {rows_t}r {len(pieces)}p {s}" + ("*" if ours else "")
                    fns.setdefault(name, run(tma))
        for name, fn in list(fns.items()):
            dx.fill_(float("nan"))
            dw.fill_(float("nan"))
            out = fn() or (dx, dw)  # (the register kernel returns its own)
            if not backward_close(*out, dx_ref, dw_ref):
                print(f"N={N} {name}: WRONG", flush=True)
                del fns[name]
        if args.dh:  # the grads of (y, h) into x0, r0 and w
            x0, r0 = x.detach().clone(), torch.randn_like(x)  # (h is x0 + r0, not x: these are timed, not checked)
            xn, rn, wn = x0.requires_grad_(), r0.requires_grad_(), w.detach().requires_grad_()
            yn, hn = cn.rms_norm(xn, wn, 1e-6, residual=rn)
            fns["None"] = lambda: torch.autograd.grad((yn, hn), (xn, rn, wn), (dy, dh), retain_graph=True)
            if quack:
                from quack.rmsnorm import rmsnorm as qrms
                xq, rq, wq = (t.detach().clone().requires_grad_() for t in (x0, r0, w))
                yq, hq = qrms(xq, wq, residual=rq, eps=1e-6, prenorm=True)
                fns["quack"] = lambda: torch.autograd.grad((yq, hq), (xq, rq, wq), (dy, dh), retain_graph=True)
        else:
            xn, wn = x.detach().requires_grad_(), w.detach().requires_grad_()
            yn = cn.rms_norm(xn, wn, 1e-6)
            fns["None"] = lambda: torch.autograd.grad(yn, (xn, wn), dy, retain_graph=True)
            if quack:
                xq, wq = x.detach().requires_grad_(), w.detach().requires_grad_()
                yq = quack["quack"](xq, wq, 1e-6)
                fns["quack"] = lambda: torch.autograd.grad(yq, (xq, wq), dy, retain_graph=True)
        factor = 2.0 if args.dh else 1.5
        med = {k: factor * statistics.median(v) for k, v in ratios_to_copy(x, fns, args.rounds, alternate=True).items()}
        rows[N] = {"config": cfg.short(), "vs_copy": med}
        print(f"N={N:>5} " + "  ".join(f"{k} {v:.3f}" for k, v in med.items()), flush=True)
        del x, dy, dx_ref, dx, yn, xn
        torch.cuda.empty_cache()
    write_json(args.out, {"gpu": torch.cuda.get_device_name(), "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
