"""Probe: how a cuTile copy's speed depends on the bytes per block and the blocks resident per SM.

bench/probe/split_ablation.py found that a cuTile kernel that only copies (one block gathers B bytes,
then scatters them) runs at 0.94-0.96 x torch's copy with 8-32 KiB per block, and at 0.99-1.0 with
4 KiB: the split kernel with its reduction and handshake is no slower than that copy skeleton. This
probe separates the two quantities a launch sets:

  * one block per B bytes (grid = all blocks; the hardware keeps as many resident as registers and
    warps allow: 27-42 registers, so 16 blocks of 4 warps or 8 of 8 per SM);
  * a persistent grid of c blocks per SM, each looping over B-byte blocks (stride: the grid), so
    exactly c x B bytes are resident per SM.

B in 2-32 KiB (--kibs), 4 or 8 warps (--warps; 16 and 32, with less than one 16-byte vector per
thread skipped, need tileiras 13.5: bench/probe/wide_ctas.sh), c in 1-16; all bf16, 2^27 elements,
ratios to torch's copy of the same bytes (median of --rounds interleaved rounds). A third part times
the split kernel's configs with 4 KiB parts at bf16 32768 and 65536 against the table's config
(library launches, checked results).

    python bench/probe/copy_residency.py [--rounds 5] [--split-ns 32768,65536] [--kibs 4,8,16,32]
        [--warps 4,8,16,32] [--no-persistent]
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import statistics
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

import cuda.tile as ct  # noqa: E402

from bench.timing import ratios_to_copy  # noqa: E402
from bench.probe.common import check_outputs, no_gpu, write_json  # noqa: E402
from cutile_norms._platform import device_info  # noqa: E402
from cutile_norms.cutile import rmsnorm_fwd as F  # noqa: E402

ConstInt = ct.Constant[int]
ELEMENTS = 1 << 27


@ct.kernel
def block_copy_kernel(mX, mY, PART: ConstInt):
    """y = x, PART elements per block."""
    base = ct.assume_divisible_by(ct.bid(0) * PART, 8)
    cols = ct.arange(PART, dtype=ct.int32)
    ct.scatter(mY, base + cols, ct.gather(mX, base + cols, check_bounds=False), check_bounds=False)


@ct.kernel
def persistent_copy_kernel(mX, mY, blocks: int, PART: ConstInt):
    """y = x, PART elements per block, a persistent grid looping over the blocks."""
    cols = ct.arange(PART, dtype=ct.int32)
    for b in range(ct.bid(0), blocks, ct.num_blocks(0)):
        base = ct.assume_divisible_by(b * PART, 8)
        ct.scatter(mY, base + cols, ct.gather(mX, base + cols, check_bounds=False), check_bounds=False)


@functools.lru_cache(maxsize=None)
def _kernel(which, hints: tuple):
    k = {"block": block_copy_kernel, "persistent": persistent_copy_kernel}[which]
    return k.replace_hints(**dict(hints)) if hints else k


def copy_fns(dev, x, y, kibs=(2, 4, 8, 16, 32), persistent=True, warps_list=(4, 8)) -> dict:
    stream = F._raw_stream(x.device.index)
    fns = {}
    for kib in kibs:
        part = kib * 1024 // 2
        blocks = ELEMENTS // part
        for warps in warps_list:
            if warps > 8 and part // (warps * 32) < 8:  # less than one 16-byte vector per thread
                continue
            hints = (("num_worker_warps", warps),) if warps != 4 else ()
            k = _kernel("block", hints)
            fns[f"{kib:>2} KiB, {warps} warps, one block each"] = (
                lambda k=k, part=part, blocks=blocks: ct.launch(stream, (blocks,), k, (x, y, part)))
            for c in (1, 2, 4, 8, 16) if persistent else ():
                if c * warps > 64:
                    continue
                k = _kernel("persistent", hints + (("occupancy", c),))
                fns[f"{kib:>2} KiB, {warps} warps, persistent {c:>2}/SM ({c * kib:>3} KiB/SM)"] = (
                    lambda k=k, part=part, blocks=blocks, c=c:
                    ct.launch(stream, (c * dev.sm_count,), k, (x, y, blocks, part)))
    return fns


def copies(dev, rounds: int, reps: int, kibs, warps_list, persistent) -> dict:
    x = torch.randn(ELEMENTS, device="cuda", dtype=torch.bfloat16)
    y = torch.empty_like(x)
    fns = copy_fns(dev, x, y, kibs, persistent, warps_list)
    for name, fn in fns.items():
        y.fill_(float("nan"))
        fn()
        if not torch.equal(y, x):
            raise AssertionError(f"copy wrong: {name}")
    ratios = ratios_to_copy(x, fns, rounds, reps)
    return {k: statistics.median(v) for k, v in ratios.items()}


def split_configs(N: int, dev, rounds: int, reps: int) -> dict:
    dtype = torch.bfloat16
    M = ELEMENTS // N
    table = F.default_config("multi_wave_cached", N, 2, dev, "bfloat16")
    cfgs = {"table: " + table.short(): table}
    split = N * 2 // 4096  # 4 KiB parts
    for nww in (None, 8):
        for occ in (None, 4, 8):
            for packed, early in ((False, True), (True, False)):
                c = F.FwdConfig("split", split=split, piece_min=F.cached_piece_min(F.split_part(N, split)),
                                packed=packed, w_early=early, num_worker_warps=nww, occupancy=occ)
                cfgs[c.short()] = c
    for occ in (4, 6):  # the table's with fewer CTAs per SM (a floor only: ptxas may fit more)
        c = dataclasses.replace(table, occupancy=occ)
        cfgs[c.short()] = c
    x = torch.randn(M, N, device="cuda", dtype=dtype)
    w = (1 + 0.1 * torch.randn(N, device="cuda")).to(dtype)
    fns = {k: (lambda c=c: F.launch(c, x, w, 1e-6, 0.0, False, dev.sm_count)[0]) for k, c in cfgs.items()}
    check_outputs(fns, x, w, f"N={N}", rows=4096)
    ratios = ratios_to_copy(x, fns, rounds, reps)
    return {k: statistics.median(v) for k, v in ratios.items()}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--split-ns", default="32768,65536")
    p.add_argument("--no-copies", action="store_true")
    p.add_argument("--kibs", default="2,4,8,16,32", help="bytes per block of the copies, KiB")
    p.add_argument("--warps", default="4,8", help="warps per block of the copies (16 and 32 need tileiras 13.5)")
    p.add_argument("--no-persistent", action="store_true")
    p.add_argument("--ncu", action="store_true",
                   help="launch each non-persistent copy and the table's split configs once, L2 flushed "
                        "before each (for ncu: `ncu --clock-control none --metrics ... python3 %(prog)s --ncu`)")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if no_gpu():
        return 0
    dev = device_info("cuda")
    if args.ncu:
        flush = torch.empty(256 << 20, dtype=torch.int8, device="cuda")
        x = torch.randn(ELEMENTS, device="cuda", dtype=torch.bfloat16)
        y = torch.empty_like(x)
        runs = dict(copy_fns(dev, x, y, persistent=False))
        runs["torch copy_"] = lambda: y.copy_(x)
        for n in filter(None, args.split_ns.split(",")):
            N = int(n)
            cfg = F.default_config("multi_wave_cached", N, 2, dev, "bfloat16")
            w = torch.ones(N, device="cuda", dtype=torch.bfloat16)
            runs[f"N={N} {cfg.short()}"] = (lambda cfg=cfg, N=N, w=w: F.launch(
                cfg, x.view(-1, N), w, 1e-6, 0.0, False, dev.sm_count, (y.view(-1, N), None)))
        for name, fn in runs.items():
            fn()  # compiled outside the profiled launch
            flush.zero_()
            torch.cuda.synchronize()
            print(f"launch: {name}", flush=True)
            fn()
            torch.cuda.synchronize()
        return 0
    out = {"gpu": dev.name}
    if not args.no_copies:
        out["copies"] = copies(dev, args.rounds, args.reps, [int(k) for k in args.kibs.split(",")],
                               [int(w) for w in args.warps.split(",")], not args.no_persistent)
        print(f"cuTile copies, bf16, 2^27 elements, x torch's copy (median of {args.rounds} rounds):")
        for k, r in out["copies"].items():
            print(f"  {k:52} {r:.3f}", flush=True)
    for n in filter(None, args.split_ns.split(",")):
        out[f"split_{n}"] = split_configs(int(n), dev, args.rounds, args.reps)
        print(f"bf16 N={n}, full size, x copy (median of {args.rounds} rounds):")
        for k, r in sorted(out[f"split_{n}"].items(), key=lambda t: -t[1]):
            print(f"  {r:.3f}  {k}", flush=True)
    write_json(args.out, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
