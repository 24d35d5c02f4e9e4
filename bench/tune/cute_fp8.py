"""Sweep: the CuTe DSL FP8-output kernel's launch variants against Triton's kernel, at the bench size
(bf16, 2^27 elements), each as a ratio to a copy of its own bytes in the same run (read x, write q and
the fp32 scales), medians of 3 interleaved rounds. What cutile_norms/cute/rmsnorm_fp8_config.py
and fp8.cute_wins were read from:
  per-token and group scales, the forward's tile where fp8_config's differs, CTAs of 128 / 256 / 512
  threads for
  rows past 16 KiB; 1 x 128 group scales; Triton's kernel (its own launch rule) beside them; with
  --rings, the kernel's ring of slots and tiles a CTA (SxT: S slots, T tiles a CTA; 1x1 one tile a CTA
  straight-line, 1x1l through the tile loop) in place of those variants, both scale kinds (the ring's
  rule: rmsnorm_fp8_config.ring).

    python bench/tune/cute_fp8.py [--ns 2560,5120,8192,10240,16384] [--rings 1x1,1x1l,2x2,2x4,3x4]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from bench.probe.common import no_gpu  # noqa: E402
from bench.timing import ratios_to_copy  # noqa: E402
from cutile_norms.cute.rmsnorm_fp8_config import fp8_config  # noqa: E402
from cutile_norms.cute.rmsnorm_fwd_config import FwdConfig, analytic_config  # noqa: E402

E4M3 = torch.float8_e4m3fn


def variants(x, w, rings=None):
    """{name: (fn, group size or None)}: Triton's kernel and the CuTe DSL kernel, both kinds; with `rings`
    ((S, T, looped) each) the CuTe DSL kernel at each, else at its own launch and the tile variants."""
    from cutile_norms.cute.rmsnorm_fp8 import rms_norm_fp8 as cute
    from cutile_norms.triton.rmsnorm_fp8 import rms_norm_fp8 as tri

    N = x.shape[1]
    out = {}
    for g, tag in ((None, "token"), (128, "group128")):
        out[f"triton {tag}"] = (lambda g=g: tri(x, None, w, 1e-6, 0.0, E4M3, None, None, None, g, False), g)
        if fp8_config(N, x.element_size(), g) is None:  # (the kernel's refusal: groups that do not tile N)
            continue
        if not rings:
            out[f"cute {tag}"] = (lambda g=g: cute(x, None, w, 1e-6, 0.0, E4M3, None, None, None, g, False), g)
        for S, T, loop in rings or ():
            out[f"cute {tag} {S}x{T}{'l' if loop else ''}"] = (
                lambda g=g, S=S, T=T, loop=loop: cute(x, None, w, 1e-6, 0.0, E4M3, None, None, None, g, False,
                                                      stages=S, per_cta=T, looped=loop), g)
    if rings:
        return out
    fwd_tile = analytic_config(N, x.element_size())
    if fwd_tile != fp8_config(N, x.element_size(), None):  # the forward's tile where the FP8 config differs
        out["cute token, forward's tile"] = (lambda: cute(x, None, w, 1e-6, 0.0, E4M3, None, None, None, None, False,
                                                          cfg=fwd_tile), None)
    if N * x.element_size() > 16384:  # the one-CTA rows: other thread counts
        for t in (256, 512):
            cfg = FwdConfig(rows=1, rpg=1, tpr=t, nvb=-(-N // (8 * t)), cluster_n=1, vec=8)
            out[f"cute token t{t}"] = (lambda cfg=cfg: cute(x, None, w, 1e-6, 0.0, E4M3, None, None, None, None, False,
                                                            cfg=cfg), None)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ns", type=lambda v: [int(n) for n in v.split(",")],
                   default=[1024, 1664, 2048, 2560, 4096, 5120, 6144, 8192, 10240, 12288, 13312, 14336, 16384])
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--rings", type=lambda v: [(int(r.split("x")[0]), int(r.split("x")[1].rstrip("l")), r.endswith("l"))
                                              for r in v.split(",")], default=None,
                   help="SxT[l]: S slots, T tiles a CTA, l: one slot through the tile loop (1x1: straight-line)")
    args = p.parse_args()
    if no_gpu("this sweep times GPU kernels"):
        return 0
    print(f"# {torch.cuda.get_device_name()} bf16, M = 2^27 / N, ratio to a copy of each variant's bytes", flush=True)
    for N in args.ns:
        M = (1 << 27) // N
        x = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
        w = (1 + 0.1 * torch.randn(N, device="cuda")).to(torch.bfloat16)
        vs = variants(x, w, args.rings)
        ratios = ratios_to_copy(x, {k: f for k, (f, _) in vs.items()}, args.runs)
        bytes_over_copy = {k: (3 * M * N + 4 * M * (N // g if g else 1)) / (4 * M * N) for k, (_, g) in vs.items()}
        print(f"N={N:>6} " + "  ".join(f"{k} {bytes_over_copy[k] * statistics.median(v):.3f}" for k, v in ratios.items()),
              flush=True)
        del x
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
