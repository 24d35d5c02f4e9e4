"""Probe: Triton's backward on narrow 16-bit rows, the pointer kernel (its register prefetch) against
rms_norm_bwd_tma_rows_kernel at each of --tiles (a tile's most elements, TmaRowsRule.tile_elems; the
GPU's own by default) and --stages (the rule's tile and count marked *), beside mode=None and
QuACK; bf16, 2^27 elements, each as a ratio to a same-run copy (bytes: x, dy and dx, 1.5 x the copy's),
medians of --rounds interleaved rounds. Every kernel's dx and dw are checked against the reference
first. The rule: rmsnorm_bwd_config.tma_rows_tile / tma_rows_stages and the GPU's TmaRowsRule
(docs/performance.md 2.26, 2.27); widths the rule leaves to the pointer kernel are timed with the TMA
kernel too.

    python bench/probe/triton_bwd_rows.py [--ns 640,768,896,...] [--tiles 8192,14336] [--stages 3,4,5] [--rounds 3]
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
from cutile_norms.triton._common import shared_per_block  # noqa: E402
from cutile_norms.triton.rmsnorm_bwd_config import analytic_config, tma_rows_config, tma_rows_rule  # noqa: E402

NS = [512, 640, 768, 896, 1040, 1152, 1280, 1480, 1536, 1800, 2040, 2048]


def main() -> int:
    p = width_parser(__doc__, NS)
    p.add_argument("--stages", type=ints, default=[3, 4, 5])
    p.add_argument("--tiles", type=ints, default=None, help="tile_elems to time (default: the GPU's rule's)")
    args = p.parse_args()
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

        def run(c):
            return lambda: T.launch(c, dy, x, w, rstd, 0.0, True, True, dev.sm_count, out=(dx, dw), tma_capable=True)
        fns = {"pointer": run(replace(cfg, tma_rows=0, tma_stages=0))}
        for tile in args.tiles or [rule.tile_elems]:  # any fill; * the rule's tile and stages where it takes the kernel
            tma = analytic_config(N, 2, dev.vendor, dev.sm_count, tma_rows=replace(rule, min_fill=0.0, tile_elems=tile))
            for s in args.stages if tma.tma_rows else ():
                launched = tma_rows_config(replace(tma, tma_stages=s), shared)  # what the launch runs for s
                if launched is None or launched.tma_stages != s:
                    continue
                ours = cfg.tma_rows == tma.tma_rows and s == cfg.tma_stages
                fns[f"tma {tma.tma_rows}r {s}" + ("*" if ours else "")] = run(replace(tma, tma_stages=s))
        for name, fn in list(fns.items()):
            dx.fill_(float("nan"))
            dw.fill_(float("nan"))
            fn()
            if not backward_close(dx, dw, dx_ref, dw_ref):
                print(f"N={N} {name}: WRONG", flush=True)
                del fns[name]
        xn, wn = x.detach().requires_grad_(), w.detach().requires_grad_()
        yn = cn.rms_norm(xn, wn, 1e-6)
        fns["None"] = lambda: torch.autograd.grad(yn, (xn, wn), dy, retain_graph=True)
        if quack:
            xq, wq = x.detach().requires_grad_(), w.detach().requires_grad_()
            yq = quack["quack"](xq, wq, 1e-6)
            fns["quack"] = lambda: torch.autograd.grad(yq, (xq, wq), dy, retain_graph=True)
        med = {k: 1.5 * statistics.median(v) for k, v in ratios_to_copy(x, fns, args.rounds, alternate=True).items()}
        rows[N] = {"config": cfg.short(), "vs_copy": med}
        print(f"N={N:>5} " + "  ".join(f"{k} {v:.3f}" for k, v in med.items()), flush=True)
        del x, dy, dx_ref, dx, yn, xn
        torch.cuda.empty_cache()
    write_json(args.out, {"gpu": torch.cuda.get_device_name(), "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
