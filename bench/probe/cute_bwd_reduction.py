"""Probe: the tma_smem_cached backward's dw reduction at other shapes than the config's (column tiles a
round : partial rows loaded at once, rmsnorm_bwd_config.RED_CLUSTERS), bf16, each as a ratio to a
same-run copy (bytes: x, dy and dx, 1.5 x the copy's), medians of --rounds interleaved rounds. Every
shape's dx and dw are checked against the reference first, and dw must be bit-identical across shapes
(each sums the partial rows in cluster order).

    python bench/probe/cute_bwd_reduction.py [--ns 10240,12288,...] [--shapes 1:4,1:8,1:16] [--rounds 3]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from bench.probe.common import backward_case, backward_close, no_gpu, width_parser, write_json  # noqa: E402
from bench.timing import ratios_to_copy  # noqa: E402
from cutile_norms._platform import device_info  # noqa: E402
from cutile_norms.cute import rmsnorm_bwd as B  # noqa: E402
from cutile_norms.cute.rmsnorm_bwd_config import device_config, reduction_shape, ring_stages  # noqa: E402

NS = [10240, 12288, 14336, 18432, 18984, 20480, 25464, 28672, 38040, 65536, 118632, 262144]


def shapes_arg(text: str) -> list[tuple[int, int]]:
    """"1:4,1:8" -> [(1, 4), (1, 8)]: (column tiles a round, partial rows at once) each."""
    out = []
    for item in text.split(","):
        rounds, rows = (int(v) for v in item.split(":"))
        if rounds < 1 or rows < 1:
            raise argparse.ArgumentTypeError(f"{item!r}: both numbers must be at least 1")
        out.append((rounds, rows))
    return out


def main() -> int:
    p = width_parser(__doc__, NS)
    p.add_argument("--shapes", type=shapes_arg, default=shapes_arg("4:1,1:4,1:8,1:16"))
    args = p.parse_args()
    if no_gpu():
        return 0
    dev = device_info(torch.device("cuda"))
    print(f"# {torch.cuda.get_device_name()}, ring slots {ring_stages(dev)}, the config's shape "
          f"{reduction_shape(False)}", flush=True)
    rows = {}
    for N in args.ns:
        cfg = device_config(N, 2, dev)
        M, x, w, dy, rstd, dx_ref, dw_ref = backward_case(N)
        dx, dw = torch.empty_like(x), torch.empty_like(w)

        def run(shape):
            return B.launch(cfg, dy, x, w, rstd, 0.0, True, True, dev.sm_count, out=(dx, dw), reduction=shape)
        first = None
        for shape in args.shapes:
            dx.fill_(float("nan"))
            dw.fill_(float("nan"))
            run(shape)
            ok = backward_close(dx, dw, dx_ref, dw_ref)
            first = dw.clone() if first is None else first
            if not ok or not torch.equal(dw, first):
                print(f"N={N} shape={shape}: WRONG ({'not the reference' if not ok else 'dw differs'})", flush=True)
        fns = {shape: (lambda shape=shape: run(shape)) for shape in args.shapes}
        med = {f"{r}:{u}": 1.5 * statistics.median(v)
               for (r, u), v in ratios_to_copy(x, fns, args.rounds, alternate=True).items()}
        clusters = min(M, B.max_clusters(x.device.index, cfg.cluster_n, dev.sm_count))
        rows[N] = {"config": cfg.short(), "clusters": clusters, "vs_copy": med}
        print(f"N={N:>6} {cfg.short():<52} C={clusters:>3} " + "  ".join(f"{k} {v:.3f}" for k, v in med.items()),
              flush=True)
        del x, dy, dx_ref, dx
        torch.cuda.empty_cache()
    write_json(args.out, {"gpu": torch.cuda.get_device_name(), "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
