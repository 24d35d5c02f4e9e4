"""Probe: where the split kernel's time goes at full size, by taking its parts away one at a time.

The bf16 split kernel stays at 0.95-0.96 x copy at N = 32768-65536 where the fp32 one reaches
0.975-0.98 on rows of the same bytes (bench/NOTES.md item 18). This probe times the table's split
config of each width as the library compiles it, then as an ablation kernel (the split kernel's
body with a STAGE constant) that drops, cumulatively:

  1 one_poll      the wait loop: the row's slots are read once, right after the exchange
                  (one L2 round trip, no waiting for the row's other blocks);
  2 publish_only  that read too: total = own partial x SPLIT (the exchange is still issued);
  3 no_handshake  the exchange and the sign read: a block touches no workspace;
  4 no_weight     + the weight (HAS_W False);
  5 copy_skeleton + the reduction: y = x through the same gathers and scatters.

and one full kernel with another wait (checked against the reference like the library's):

  6 counter_wait  each block stores its partial, then adds 1 to its row's count (release); the
                  wait polls that one int (acquire) until the row's SPLIT blocks have counted, then
                  reads the slots once. The library's wait polls the SPLIT slots themselves and
                  reduces them across lanes in every iteration; this one costs two more round trips
                  before the wait (the store's fence, the add's return) and no reduction while it spins.

Stages 1-5 compute wrong rows on purpose (only the full kernels are checked). Each is timed at the
bench size (M = 2^27 / N) and at twice it, in interleaved rounds with a copy of the same bytes
(`bench.timing.scaling_vs_copy`); from the two sizes, the fixed cost per launch (intercept, us) and the steady
state (the ratio of the slopes) are separated: a kernel that loses at its start or its tail
(a long block lifetime) has a larger intercept than the copy, one that loses throughout a
lower slope ratio.

    python bench/probe/split_ablation.py [--cases bfloat16:32768,float32:65536] [--rounds 5]
"""
from __future__ import annotations

import argparse
import functools
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

import cuda.tile as ct  # noqa: E402

from bench.rmsnorm import DTYPES, check_output  # noqa: E402
from bench.timing import scaling_vs_copy  # noqa: E402
from bench.probe.common import no_gpu, write_json  # noqa: E402
from cutile_norms._platform import device_info  # noqa: E402
from cutile_norms.cutile import rmsnorm_fwd as F  # noqa: E402

ConstInt = ct.Constant[int]
ConstBool = ct.Constant[bool]
ELEMENTS = 1 << 27
STAGES = {1: "one_poll", 2: "publish_only", 3: "no_handshake", 4: "no_weight", 5: "copy_skeleton"}
WAITS = {6: "counter_wait"}  # full kernels with another wait


@ct.kernel
def split_ablation_kernel(
        mX, mW, mY, mRstd, mSync, mCount,
        M: int, stride_x: int, eps: float, offset: float,
        N: ConstInt, SPLIT: ConstInt, PART: ConstInt, PIECE_MIN: ConstInt, X_ALIGN: ConstInt,
        HAS_W: ConstBool, STORE_RSTD: ConstBool, LATENCY: ConstInt, PACKED: ConstBool, W_PLANES: ConstInt,
        W_EARLY: ConstBool, TIE_SLOT: ConstBool, STAGE: ConstInt):
    """rms_norm_fwd_split_kernel's body (cutile_norms/cutile/rmsnorm_fwd_kernel.py) with parts dropped by STAGE."""
    stride = ct.assume_divisible_by(stride_x, X_ALIGN)
    bid = ct.bid(0)
    row = bid // SPLIT
    part = bid - row * SPLIT
    c0 = part * PART
    xbase = ct.assume_divisible_by(row * stride + c0, X_ALIGN)
    ybase = ct.assume_divisible_by(row * N + c0, X_ALIGN)
    MASK_N = ct.static_eval(SPLIT * PART != N)
    lim = ct.minimum(N - c0, PART) if MASK_N else PART
    USE_W = ct.static_eval(HAS_W and (STAGE < 4 or STAGE >= 6))
    if STAGE < 3:
        slot = ct.gather(mSync, bid, check_bounds=False, latency=10)
        sign = ct.where(slot < 0, 0, ct.static_eval(-(1 << 31)))
    tXrX = ()
    tWrW = ()
    ssq = 0.0
    for off, size in ct.static_iter(F.row_pieces(PART, PIECE_MIN)):
        masked = ct.static_eval(MASK_N or off + size > PART)
        x = F._gather_masked(mX, xbase, off, size, lim, masked, LATENCY)
        xs = x
        if USE_W and W_EARLY:
            cols = ct.arange(size, dtype=ct.int32) + off
            wbits, xs = F._gather_w_tied(mW, x, c0 + cols, cols < lim if masked else None, M, LATENCY, W_PLANES)
            tWrW += (wbits,)
        if STAGE != 5:
            xf = ct.astype(xs, ct.float32)
            if ct.static_eval(TIE_SLOT and STAGE < 3 and off == 0):  # as the library kernel's tie_slot
                ssq = ssq + ct.sum(xf * xf + F._zero_of(slot, M))
            else:
                ssq = ssq + ct.sum(xf * xf)
        tXrX += (x,)
    if STAGE == 6:  # the partial in its slot, then the row's count (release: the slot is seen first)
        ct.scatter(mSync, bid, ct.bitcast(ssq, ct.int32), check_bounds=False)
        before = ct.bitcast(ct.atomic_add(mCount, row, 1, check_bounds=False), ct.uint32)
        base = before & ct.static_eval((1 << 32) - SPLIT)  # this launch's first count of the row (mod 2^32)
    if STAGE < 3:
        ct.atomic_xchg(mSync, bid, (ct.bitcast(ssq, ct.int32) & 0x7FFFFFFF) ^ sign,
                       memory_order=ct.MemoryOrder.RELAXED)
    for off, size in ct.static_iter(F.row_pieces(PART, PIECE_MIN)):
        if USE_W and not W_EARLY:
            masked = ct.static_eval(MASK_N or off + size > PART)
            cols = ct.arange(size, dtype=ct.int32) + off
            tWrW += (F._gather_w_bits(mW, c0 + cols, cols < lim if masked else None, LATENCY, W_PLANES),)
    if STAGE == 6:  # one scalar polled until the row's SPLIT blocks have counted, then the slots once
        seen = ct.bitcast(ct.minimum(M, 0), ct.uint32)  # 0
        while seen < SPLIT:
            again = ct.astype(seen > SPLIT, ct.int32)  # always 0: ties the index to the loop (no hoisting)
            count = ct.load(mCount, (row + again,), (1,), allow_tma=False,
                            memory_order=ct.MemoryOrder.ACQUIRE, memory_scope=ct.MemoryScope.DEVICE)
            seen = ct.bitcast(ct.sum(count), ct.uint32) - base
        slots = ct.load(mSync, (row,), (SPLIT,), allow_tma=False,
                        memory_order=ct.MemoryOrder.RELAXED, memory_scope=ct.MemoryScope.DEVICE)
        total = ct.sum(ct.bitcast(slots, ct.float32))
    elif STAGE == 1:  # the slots read once: a round trip, no waiting for the row's other blocks
        slots = ct.load(mSync, (row,), (SPLIT,), allow_tma=False,
                        memory_order=ct.MemoryOrder.RELAXED, memory_scope=ct.MemoryScope.DEVICE) & 0x7FFFFFFF
        total = ct.sum(ct.bitcast(slots, ct.float32))
    else:
        total = ssq * ct.static_eval(float(SPLIT))
    rstd = ct.rsqrt(total * ct.static_eval(1.0 / N) + eps)
    if STORE_RSTD:
        if part == 0:
            ct.scatter(mRstd, row, rstd, check_bounds=False)
    i = 0
    for off, size in ct.static_iter(F.row_pieces(PART, PIECE_MIN)):
        masked = ct.static_eval(MASK_N or off + size > PART)
        if STAGE == 5:
            F._scatter_masked(mY, ybase, off, size, lim, masked, tXrX[i], LATENCY)
        else:
            y = (F._widen_again(tXrX[i], F._runtime_zero(M, ct.uint16)) if PACKED
                 else ct.astype(tXrX[i], ct.float32)) * rstd
            if USE_W:
                y = y * (F._w_from_bits(tWrW[i], W_PLANES) + offset)
            F._scatter_masked(mY, ybase, off, size, lim, masked, ct.astype(y, mY.dtype), LATENCY)
        i += 1


@functools.lru_cache(maxsize=None)
def _kernel_for(hints: tuple):
    """One kernel object per hint set: a new object per launch would trace the kernel again every
    call (~40 ms of host time, which the events then time: the GPU waits for the host)."""
    return split_ablation_kernel.replace_hints(**dict(hints)) if hints else split_ablation_kernel


def ablation_launch(cfg: F.FwdConfig, stage: int, x, w, y, count):
    """One launch of split_ablation_kernel with cfg's constants and hints (x contiguous, y from
    output_buffers, count: int32 zeros, one per row, kept between launches)."""
    M, N = x.shape
    kernel = _kernel_for(tuple(sorted(cfg.hints().items())))
    consts = F.constants(cfg, N, F._align_elems(N, x.element_size()), True, False, 0) + (stage,)
    stream = F._raw_stream(x.device.index)
    y_flat = F._flat(y, F._round16(M * N))
    sync = F._sync_workspace(M, cfg.split, x.device, stream)
    ct.launch(stream, (M * cfg.split,), kernel, (x.view(-1), w, y_flat, y_flat, sync, count, M, N, 1e-6, 0.0) + consts)
    return y


def case(dtype, N: int, dev, rounds: int, reps: int, sizes: list, variants: list) -> dict:
    name = str(dtype).removeprefix("torch.")
    cfg = F.default_config("multi_wave_cached", N, dtype.itemsize, dev, name)
    if cfg.kernel != "split":
        raise SystemExit(f"{name} N={N}: the table's config is {cfg.short()}, not a split kernel")
    xs = {s: torch.randn(int(s * ELEMENTS) // N, N, device="cuda", dtype=dtype) for s in sizes}
    w = (1 + 0.1 * torch.randn(N, device="cuda")).to(dtype)
    stage_of = {v: s for s, v in {**STAGES, **WAITS}.items()}
    ys = {s: F.output_buffers(x.shape[0], N, dtype, x.device, False)[0] for s, x in xs.items()}
    counts = {s: torch.zeros(F._round16(x.shape[0]), dtype=torch.int32, device=x.device) for s, x in xs.items()}
    fns = {}
    for v in variants:  # per size: its own y and count
        if v == "full":
            fns[v] = lambda s: F.launch(cfg, xs[s], w, 1e-6, 0.0, False, dev.sm_count, (ys[s], None))[0]
        else:
            fns[v] = lambda s, stage=stage_of[v]: ablation_launch(cfg, stage, xs[s], w, ys[s], counts[s])
    for v in variants:
        if v != "full" and stage_of[v] not in WAITS:
            continue
        for s, x in xs.items():
            for _ in range(2):  # twice: the second launch runs on the workspace state the first one left
                fns[v](s).view(-1)[:1].fill_(float("nan"))  # poisoned: the next launch must write it again
            wrong = check_output(fns[v](s), x, w, 1e-6)
            if wrong:
                raise AssertionError(f"{name} N={N} {v} {s}x: {wrong}")
    rec = {"dtype": name, "N": N, "config": cfg.short(), "M_1x": ELEMENTS // N, "sizes": sizes,
           "rows": scaling_vs_copy(xs, fns, rounds, reps)}
    return rec


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", default="bfloat16:32768,bfloat16:65536,bfloat16:131072,float32:32768,float32:65536")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--sizes", default="1,2", help="multiples of the bench size (2^27 elements) to time")
    p.add_argument("--variants", default=",".join(["full"] + list(STAGES.values()) + list(WAITS.values())))
    p.add_argument("--out", default=None, help="write the records as JSON here")
    args = p.parse_args()
    if no_gpu():
        return 0
    dev = device_info("cuda")
    recs = []
    sizes = [float(v) for v in args.sizes.split(",")]
    for c in filter(None, args.cases.split(",")):
        dname, n = c.split(":")
        rec = case(DTYPES[dname], int(n), dev, args.rounds, args.reps, sizes, args.variants.split(","))
        recs.append(rec)
        print(f"\n{dname} N={n} M={rec['M_1x']} at 1x ({rec['config']}); median of {args.rounds} rounds")
        fit = len(sizes) > 1  # a line through the sizes needs two of them
        print(f"  {'variant':13} " + " ".join(f"{f'{s:g}x vs copy':>11}" for s in sizes)
              + (f" {'fixed us':>9} {'slope vs copy':>13}" if fit else ""))
        for v, r in rec["rows"].items():
            print(f"  {v:13} " + " ".join(f"{q:11.3f}" for q in r["vs_copy"])
                  + (f" {r['intercept_us']:9.1f} {r['slope_vs_copy']:13.3f}" if fit else ""), flush=True)
    write_json(args.out, {"gpu": dev.name, "records": recs})
    return 0


if __name__ == "__main__":
    sys.exit(main())
