"""The residual add + RMSNorm (rms_norm(x, w, residual=r) -> (y, h)) against a same-run copy.

    python bench/residual.py [--ns 2048,4096,...] [--random 4] [--runs 3] [--dtype bfloat16]
        [--weight-dtype float32] [--parts forward,backward,fp8] [--modes multi_wave_cached,...] [--out F]

Three tables, each a ratio to a same-run copy of x (bytes over the copy's x copy time / time), medians
of --runs interleaved runs, every output checked (last 64 rows) before it is timed:
  forward: read x and r, write h and y (twice the copy's bytes); h bit for bit the fp32 sum rounded
    once, y the fp32 norm of h;
  backward: read dy, dh and h, write dx = dr once (twice the copy's); dx and dr against the fp32
    composite's autograd;
  fp8 (N <= --fp8-max-n): read x, write q (one byte) and the fp32 scales, per token, in 1 x 128 groups and
    at a given per-tensor scale; with the fused add ("+r") also read r and write h; q dequantizes to the
    norm (of h), h bit for bit.
Implementations: ours fused (mode=None with the fused kernels: forward Triton's up to 32768 columns,
cuTile's split form past that; backward dispatch.residual_backward's: Triton's fused kernel for rows of
up to 2 KiB, the norm's backward reading dh above), ours unfused (CUTILE_NORMS_FUSED=0: torch.add into h,
then mode=None's norm kernels, dh added after), `cn <mode>` for each --modes (that mode named, fused
kernels on), the composite under torch.compile, QuACK's and Liger's residual paths where installed. Then a pre-norm block forward + backward (hidden --block-n, --block-m rows): fused
against `h = x + r; rms_norm(h)`, ms per step.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import cutile_norms as cn  # noqa: E402
from bench.rmsnorm import DTYPES, MODEL_NS, random_widths  # noqa: E402
from bench.probe.common import no_gpu, write_json  # noqa: E402
from bench.timing import device_ms, ratios_to_copy  # noqa: E402
from cutile_norms.reference import add_rms_norm_reference, fp8_quantize, fp8_scale, rms_norm_reference  # noqa: E402

ELEMENTS = 1 << 27


def gate(fused: bool) -> None:
    """The fused kernels on or off (CUTILE_NORMS_FUSED): read at every call, forward and backward."""
    os.environ["CUTILE_NORMS_FUSED"] = "1" if fused else "0"


def ours(fused: bool, mode: str | None = None):
    def run(x, r, w, eps):
        gate(fused)
        return cn.rms_norm(x, w, eps, residual=r, mode=mode)
    run.fused = fused
    return run


def anchors() -> dict:
    fns, missing = {}, {}
    import torch._functorch.config

    torch._functorch.config.donated_buffer = False  # its backward is timed again and again (retain_graph)
    fns["torch.compile"] = torch.compile(lambda x, r, w, eps: add_rms_norm_reference(x, r, w, eps)[:2])
    try:
        from quack.rmsnorm import rmsnorm

        fns["quack"] = lambda x, r, w, eps: rmsnorm(x, w, residual=r, eps=eps, prenorm=True)
    except Exception as exc:  # noqa: BLE001 -- report, never fake
        missing["quack"] = f"{type(exc).__name__}: {exc}"[:160]
    try:
        from liger_kernel.ops.fused_add_rms_norm import LigerFusedAddRMSNormFunction

        fns["liger"] = lambda x, r, w, eps: LigerFusedAddRMSNormFunction.apply(x, r, w, eps, 0.0, "llama", False)
    except Exception as exc:  # noqa: BLE001
        missing["liger"] = f"{type(exc).__name__}: {exc}"[:160]
    for k, why in missing.items():
        print(f"anchor {k} skipped: {why}", flush=True)
    return fns


def wrong(out, x, r, w, eps) -> str | None:
    """None when out is (y, h) with h the fp32 sum rounded once and y the fp32 norm of h (last 64 rows)."""
    if not isinstance(out, (tuple, list)) or len(out) < 2:
        return f"returned {type(out).__name__}, not (y, h)"
    y, h = out[0], out[1]
    if not torch.equal(h[-64:], (x[-64:].float() + r[-64:].float()).to(h.dtype)):
        return "h differs from the fp32 sum rounded once"
    ey = rms_norm_reference(h[-64:], w, eps)[0].float()
    if not torch.allclose(y[-64:].float(), ey, rtol=2e-2, atol=2e-2):
        return "y differs from the norm of h"
    return None


def wrong_grad(grads, x, r, w, dy, dh, eps) -> str | None:
    """None when dx = dr = the fp32 composite's grad into h on the last 64 rows (dw: every row's sum)."""
    xs, rs = x[-64:].detach().float().requires_grad_(), r[-64:].detach().float().requires_grad_()
    y, h = add_rms_norm_reference(xs, rs, w.detach().float(), eps, compute_dtype=torch.float64)[:2]
    torch.autograd.backward((y, h), (dy[-64:].float(), dh[-64:].float()))
    for name, g, ref in (("dx", grads[0], xs.grad), ("dr", grads[1], rs.grad)):
        if not torch.allclose(g[-64:].float(), ref, rtol=3e-2, atol=3e-2 * float(ref.abs().max())):
            return f"{name} differs from the fp32 composite's"
    return None


STATIC_SCALE = 16 / 448  # the per-tensor scale timed: e4m3's range covers |y| to 16 (randn rows, w near 1)


def fp8_fns(modes=(), device="cuda") -> dict:
    """name: fn(x, r, w, eps) -> (q, scales[, h]): ours (mode=None's FP8 kernel per token, in 1 x 128
    groups, at a given per-tensor scale (a tensor on `device`, as serving engines pass it: a number
    costs a fill kernel a call), and the first two after the fused add of r; each of `modes` named) and
    the composite compiled."""
    def ours_fp8(mode=None, add=False, **kw):
        def run(x, r, w, eps):
            gate(True)
            return cn.rms_norm_fp8(x, w, eps, mode=mode, residual=r if add else None, **kw)
        return run

    def composite(x, w, eps, group):
        y = rms_norm_reference(x.float(), w, eps)[0]
        yg = y.unflatten(-1, (-1, group))
        s = fp8_scale(yg.abs().amax(-1, keepdim=True), torch.float8_e4m3fn)
        return fp8_quantize(yg, s, torch.float8_e4m3fn).flatten(-2), s.squeeze(-1)
    compiled = torch.compile(composite)
    named = {f"cn {m} {tag}": ours_fp8(m, **kw) for m in modes for tag, kw in (("token", {}),
                                                                               ("group128", {"group_size": 128}))}
    return {"cn token": ours_fp8(), "cn group128": ours_fp8(group_size=128),
            "cn static": ours_fp8(scale=torch.full((1,), STATIC_SCALE, device=device)),
            "cn token +r": ours_fp8(add=True),
            "cn group128 +r": ours_fp8(add=True, group_size=128), **named,
            "torch.compile token": lambda x, r, w, eps: compiled(x, w, eps, x.shape[-1]),
            "torch.compile group128": lambda x, r, w, eps: compiled(x, w, eps, 128)}


def timed_table(ns, dtype, runs, setup, w_dtype=None) -> list:
    """Per width: setup(x, r, w) -> {name: (fn or the reason it is not timed, bytes over the copy's)};
    each fn timed against a same-run copy of x: the ratio is bytes x copy time / time."""
    rows = []
    for N in ns:
        M = ELEMENTS // N
        x, r = torch.randn(M, N, device="cuda", dtype=dtype), torch.randn(M, N, device="cuda", dtype=dtype)
        w = (1 + 0.1 * torch.randn(N, device="cuda")).to(w_dtype or dtype)
        fns, scale = {}, {}
        for k, (fn, factor) in setup(x, r, w).items():
            if isinstance(fn, str):
                print(f"N={N} {k}: not timed ({fn})", flush=True)
            else:
                fns[k], scale[k] = fn, factor
        ratios = ratios_to_copy(x, fns, runs)
        rec = {"N": N, "M": M, "vs_copy": {k: scale[k] * statistics.median(v) for k, v in ratios.items()},
               "vs_copy_runs": {k: [round(scale[k] * t, 4) for t in v] for k, v in ratios.items()}}
        rows.append(rec)
        print(f"N={N:>6} " + "  ".join(f"{k} {v:.3f}" for k, v in rec["vs_copy"].items()), flush=True)
        x = r = fns = None  # free the inputs before the next width
        torch.cuda.empty_cache()
    return rows


def checked(fn, check, *args):
    try:
        return check(fn(), *args) or fn
    except Exception as exc:  # noqa: BLE001
        return f"{type(exc).__name__}: {exc}"[:160]


def forward_setup(impls):
    """Bytes: read x and r, write h and y: twice the copy's."""
    return lambda x, r, w: {k: (checked(lambda f=f: f(x, r, w, 1e-6), wrong, x, r, w, 1e-6), 2.0)
                            for k, f in impls.items()}


def backward_setup(impls):
    """Bytes: read dy, dh and h (or x and r), write dx = dr once (one tensor where the dtypes agree):
    twice the copy's. dw's partial sums (N per block) are noise at M = 2^27 / N."""
    def setup(x, r, w):
        out = {}
        dy, dh = torch.randn_like(x), torch.randn_like(x)
        for k, f in impls.items():
            xg, rg, wg = x.clone().requires_grad_(), r.clone().requires_grad_(), w.clone().requires_grad_()
            try:
                y, h = f(xg, rg, wg, 1e-6)[:2]
            except Exception as exc:  # noqa: BLE001
                out[k] = (f"{type(exc).__name__}: {exc}"[:160], 2.0)
                continue
            fused = getattr(f, "fused", None)  # ours: the backward runs under the gate its forward saw

            def fn(y=y, h=h, xg=xg, rg=rg, wg=wg, fused=fused):
                if fused is not None:
                    gate(fused)
                return torch.autograd.grad((y, h), (xg, rg, wg), (dy, dh), retain_graph=True)
            out[k] = (checked(fn, wrong_grad, x, r, w, dy, dh, 1e-6), 2.0)
        return out
    return setup


def fp8_setup(modes):
    """Bytes, over the copy's 2 e per element: read x, write q (one byte an element) and the fp32 scales
    (none timed at a given scale); with the fused add ("+r") also read r and write h."""
    def setup(x, r, w):
        e, (M, N) = x.element_size(), x.shape
        out = {}
        for k, f in fp8_fns(modes, x.device).items():
            groups = N // 128 if "group" in k else 0 if "static" in k else 1
            factor = (M * N * (e + 1 + (2 * e if "+r" in k else 0)) + 4 * M * groups) / (2 * e * M * N)
            out[k] = (checked(lambda f=f: f(x, r, w, 1e-6), wrong_fp8, x, r, w), factor)
        return out
    return setup


def wrong_fp8(out, x, r, w) -> str | None:
    """None when q dequantizes to the fp32 norm (of h = x + r where h came back: h bit for bit the fp32
    sum rounded once) within e4m3's step (last 64 rows)."""
    q, s = out[:2]
    h = x[-64:].float()
    if len(out) == 3:
        h = (h + r[-64:].float()).to(x.dtype)
        if not torch.equal(out[2][-64:], h):
            return "h is not the fp32 sum rounded once"
    ey = rms_norm_reference(h.float(), w, 1e-6)[0]
    deq = (q[-64:].float().unflatten(-1, (s.shape[-1], -1)) * s[-64:].unsqueeze(-1)).flatten(-2)
    return None if torch.allclose(deq, ey, rtol=2 ** -3, atol=1e-2) else "q does not dequantize to the norm"


def block(M, N, dtype, runs) -> dict:
    """ms per forward + backward of a pre-norm block's add + norm: fused against unfused."""
    x = torch.randn(M, N, device="cuda", dtype=dtype, requires_grad=True)
    r = torch.randn(M, N, device="cuda", dtype=dtype, requires_grad=True)
    w = (1 + 0.1 * torch.randn(N, device="cuda")).to(dtype).requires_grad_()
    dy, dh = torch.randn(M, N, device="cuda", dtype=dtype), torch.randn(M, N, device="cuda", dtype=dtype)

    def step(fused):
        gate(bool(fused))
        if fused is None:  # the unfused block: the add, then the norm
            h = x + r
            y = cn.rms_norm(h, w)
        else:
            y, h = cn.rms_norm(x, w, residual=r)
        torch.autograd.backward((y, h), (dy, dh))
    t = {k: [] for k in ("fused", "ours unfused", "x + r then rms_norm")}
    for _ in range(runs):
        for k, f in zip(t, (True, False, None)):
            t[k].append(device_ms(lambda: step(f), reps=20)["median_ms"])
    return {k: statistics.median(v) for k, v in t.items()}


def main() -> int:
    ints = lambda s: [int(v) for v in s.split(",") if v]  # noqa: E731
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ns", type=ints, default=MODEL_NS)
    p.add_argument("--random", type=int, default=4)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    p.add_argument("--weight-dtype", default=None, choices=sorted(DTYPES), help="the weight's (default: x's)")
    p.add_argument("--block-n", type=int, default=4096)
    p.add_argument("--block-m", type=int, default=16384)
    p.add_argument("--parts", type=lambda v: v.split(","), default=["forward", "backward", "fp8"])
    p.add_argument("--modes", type=lambda v: [m for m in v.split(",") if m], default=[],
                   help="also time ours with these modes named (fused kernels on): 'cn <mode>' (fp8: 'triton', "
                        "'tma_smem_cached', each FP8 kernel)")
    p.add_argument("--fp8-max-n", type=int, default=16384, help="the FP8 kernel's widest row")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if no_gpu("this bench times GPU kernels"):
        return 0
    seed = args.seed if args.seed is not None else int.from_bytes(os.urandom(3), "little")
    ns = sorted(set(args.ns) | set(random_widths(args.random, seed)))
    dtype = DTYPES[args.dtype]
    print(f"# {torch.cuda.get_device_name()} {args.dtype}, M = 2^27 / N, random widths seed {seed}", flush=True)
    result = {"gpu": torch.cuda.get_device_name(), "command": "python bench/residual.py " + " ".join(sys.argv[1:]),
              "seed": seed}
    impls = {"cn fused": ours(True), "cn unfused": ours(False), **{f"cn {m}": ours(True, m) for m in args.modes},
             **anchors()}
    for part in args.parts:
        print(f"## {part}", flush=True)
        setup = {"forward": forward_setup(impls), "backward": backward_setup(impls),
                 "fp8": fp8_setup(args.modes)}[part]
        result[part] = timed_table([n for n in ns if part != "fp8" or n <= args.fp8_max_n], dtype, args.runs, setup,
                                   DTYPES[args.weight_dtype] if args.weight_dtype else None)
    result["block"] = block(args.block_m, args.block_n, dtype, args.runs)
    b = result["block"]
    print(f"block M={args.block_m} N={args.block_n} fwd+bwd ms: " + "  ".join(f"{k} {v:.3f}" for k, v in b.items())
          + f"  | unfused / fused {b['x + r then rms_norm'] / b['fused']:.2f}x", flush=True)
    write_json(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
