"""Probe: the tma_smem_cached backward at rows of an odd count of 16-byte vectors, whose starts fall 16
bytes past a 32-byte boundary at every other row, against the same rows at a 128-byte-aligned row
stride (x and dy views of wider rows; dx contiguous either way) and against rows of N + 8 (an even count,
every start on a 32-byte boundary): bf16, the rule's config for each, each a ratio to a same-run copy
of x (bytes: x, dy and dx, 1.5 x the copy's), medians of --rounds interleaved rounds; every case's dx
and dw checked first. `--pass fwd`: mode=None's no-grad forward instead (x strided in the second case,
y contiguous in all three; bytes: x and y, the copy's), every case's y checked first.

    python bench/probe/row_alignment.py [--ns 12040,16024,18984,25464,36392,51160,118632] [--rounds 3]
    python bench/probe/row_alignment.py --pass fwd --ns 6984,16632,127928,162664,208760
"""
from __future__ import annotations

import os
import statistics
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from bench.probe.common import backward_case, backward_close, no_gpu, width_parser, write_json  # noqa: E402
from bench.timing import copy_baseline_ms, device_ms  # noqa: E402
from cutile_norms._platform import device_info  # noqa: E402
from cutile_norms.cute import rmsnorm_bwd as B  # noqa: E402
from cutile_norms.cute.rmsnorm_bwd_config import device_config, ring_stages  # noqa: E402

CASES = ("contiguous", "aligned stride", "N + 8")


def aligned_rows(t: torch.Tensor) -> torch.Tensor:
    """t's values in rows 128-byte aligned apart (a view of wider rows, starting 128-byte aligned)."""
    M, N = t.shape
    stride = -(-N * t.element_size() // 128) * 128 // t.element_size()
    wide = torch.empty(M * stride + 64, dtype=t.dtype, device=t.device)
    start = (-wide.data_ptr() % 128) // t.element_size()
    rows = wide[start:start + M * stride].view(M, stride)[:, :N]
    rows.copy_(t)
    return rows


def measure(N: int, dev, rounds: int) -> dict:
    """{case: median ratio to the copy} at bf16 rows of N (CASES)."""
    runs = {}
    for case in CASES:
        n = N + 8 if case == "N + 8" else N
        M, x, w, dy, rstd, dx_ref, dw_ref = backward_case(n)
        copy_src = x
        if case == "aligned stride":
            x, dy = aligned_rows(x), aligned_rows(dy)
        cfg = device_config(n, 2, dev)

        def run(cfg=cfg, x=x, w=w, dy=dy, rstd=rstd):
            return B.launch(cfg, dy, x, w, rstd, 0.0, True, True, dev.sm_count)
        if not backward_close(*run(), dx_ref, dw_ref):
            print(f"N={n} {case}: WRONG", flush=True)
        runs[case] = (run, copy_src, cfg)
    ratios = {case: [] for case in CASES}
    for _ in range(rounds):
        for case, (run, x, _cfg) in runs.items():
            copy = copy_baseline_ms(x, reps=20)["median_ms"]
            ratios[case].append(1.5 * copy / device_ms(run, reps=20)["median_ms"])
    return {case: {"config": runs[case][2].short(), "median": statistics.median(r), "min": min(r), "max": max(r)}
            for case, r in ratios.items()}


def measure_forward(N: int, rounds: int) -> dict:
    """{case: median ratio to the copy} of mode=None's no-grad forward at bf16 rows of N (CASES)."""
    import cutile_norms as cn
    from bench.tune.sweep import width_inputs
    from cutile_norms.reference import rms_norm_reference

    runs = {}
    for case in CASES:
        n = N + 8 if case == "N + 8" else N
        M, x, w = width_inputs(n, torch.bfloat16)
        y_ref = rms_norm_reference(x, w, 1e-6)[0]
        copy_src = x
        if case == "aligned stride":
            x = aligned_rows(x)

        def run(x=x, w=w):
            with torch.no_grad():
                return cn.rms_norm(x, w, eps=1e-6)
        if not torch.allclose(run().float(), y_ref.float(), rtol=2e-2, atol=2e-2):
            print(f"N={n} {case}: WRONG", flush=True)
        runs[case] = (run, copy_src, cn.explain(x, w).splitlines()[1])
    ratios = {case: [] for case in CASES}
    for _ in range(rounds):
        for case, (run, x, _how) in runs.items():
            copy = copy_baseline_ms(x, reps=20)["median_ms"]
            ratios[case].append(copy / device_ms(run, reps=20)["median_ms"])
    return {case: {"config": runs[case][2], "median": statistics.median(r), "min": min(r), "max": max(r)}
            for case, r in ratios.items()}


def main() -> int:
    p = width_parser(__doc__, [12040, 16024, 18984, 25464, 36392, 51160, 118632])
    p.add_argument("--pass", dest="pass_", choices=["bwd", "fwd"], default="bwd")
    args = p.parse_args()
    if no_gpu():
        return 0
    dev = device_info(torch.device("cuda"))
    print(f"# {torch.cuda.get_device_name()}, ring slots {ring_stages(dev)}", flush=True)
    rows = {}
    for N in args.ns:
        rows[str(N)] = measure(N, dev, args.rounds) if args.pass_ == "bwd" else measure_forward(N, args.rounds)
        torch.cuda.empty_cache()
        row = rows[str(N)]
        print(f"N={N:>6} ({N // 8} vectors) " + "  ".join(f"{case} {r['median']:.3f}" for case, r in row.items())
              + f"  {row['contiguous']['config']}", flush=True)
    write_json(args.out, {"gpu": torch.cuda.get_device_name(), "rounds": args.rounds, "pass": args.pass_,
                          "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
