"""Probe: the two-pass RMSNorm forward that torch.compile generates for this op (a sum-of-squares
loop over column chunks, then a loop that re-reads x and stores y; bench/probe/inductor_configs.py),
written here in Triton with its launch config and L2 eviction hints as parameters, to see which of
the two carries its speed: the block width (16-32 warps, which cuTile's tileiras 13.4 cannot emit)
or the hints (x's first read `evict_last`, its re-read `evict_first`; cuTile has no cache hints).

    python bench/probe/triton_two_pass.py [--rounds 5] [--out F]
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from bench.probe.common import no_gpu, write_json  # noqa: E402
from bench.timing import scaling_vs_copy  # noqa: E402
from cutile_norms.reference import rms_norm_reference  # noqa: E402

ELEMENTS = 1 << 27
# (N, columns per chunk, warps): the autotuner's picks (16 and 32 warps), then 8 warps
CASES = [(8192, 8192, 16), (8192, 8192, 8), (16384, 2048, 16), (16384, 2048, 8),
         (32768, 32768, 32), (32768, 4096, 8)]


def build():
    import triton
    import triton.language as tl

    @triton.jit
    def two_pass(X, W, Y, N: tl.constexpr, CHUNK: tl.constexpr, FIRST: tl.constexpr, AGAIN: tl.constexpr,
                 WEIGHT: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        acc = tl.zeros([CHUNK], dtype=tl.float32)
        for off in tl.range(0, N, CHUNK):
            x = tl.load(X + row * N + off + tl.arange(0, CHUNK), eviction_policy=FIRST).to(tl.float32)
            acc += x * x
        rstd = tl.rsqrt(tl.sum(acc) / N + 1e-6)
        for off in tl.range(0, N, CHUNK):
            cols = off + tl.arange(0, CHUNK)
            x = tl.load(X + row * N + cols, eviction_policy=AGAIN).to(tl.float32)
            w = tl.load(W + cols, eviction_policy=WEIGHT).to(tl.float32)
            tl.store(Y + row * N + cols, (x * rstd * w).to(Y.dtype.element_ty))

    def launch(x, w, chunk, warps, hints):
        y = torch.empty_like(x)
        first, again, weight = ("evict_last", "evict_first", "evict_last") if hints else ("", "", "")
        two_pass[(x.shape[0],)](x, w, y, x.shape[1], chunk, first, again, weight, num_warps=warps, num_stages=1)
        return y
    return launch


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if no_gpu():
        return 0
    launch = build()
    results = {}
    for n in sorted({c[0] for c in CASES}):
        xs = {s: torch.randn(int(s * ELEMENTS) // n, n, device="cuda", dtype=torch.bfloat16) for s in (1.0, 2.0)}
        w = (1 + 0.1 * torch.randn(n, device="cuda")).to(torch.bfloat16)
        ref = rms_norm_reference(xs[1.0][:64].float(), w.float(), 1e-6)[0]
        fns = {}
        for _, chunk, warps in [c for c in CASES if c[0] == n]:
            for hints in (True, False):
                y = launch(xs[1.0], w, chunk, warps, hints)[:64].float()
                assert torch.allclose(y, ref, rtol=2e-2, atol=2e-2), (n, chunk, warps, hints)
                key = f"chunk={chunk} warps={warps} hints={'on' if hints else 'off'}"
                fns[key] = lambda s, c=chunk, nw=warps, h=hints: launch(xs[s], w, c, nw, h)
        rows = scaling_vs_copy(xs, fns, args.rounds)
        print(f"bfloat16 N={n}; median of {args.rounds} rounds; ratio to the copy at 1x / 2x the bench size")
        for k, r in rows.items():
            extra = f"  fixed {r['intercept_us']:4.1f} us  slope {r['slope_vs_copy']:.3f}" if "intercept_us" in r else ""
            print(f"  1x {r['vs_copy'][0]:.3f} 2x {r['vs_copy'][1]:.3f}{extra}  {k}", flush=True)
        results[str(n)] = rows
    write_json(args.out, {"gpu": torch.cuda.get_device_name(), "rows": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
