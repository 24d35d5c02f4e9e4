"""The RMSNorm bench: every available cutile_norms mode (and mode=None) against the installed anchors.

    python bench/rmsnorm.py                       # bf16, default sweep, forward + backward, all anchors
    python bench/rmsnorm.py --dtype float32 --anchors quack,torch_compile --no-backward
    python bench/rmsnorm.py --write-table         # also (re)write the mode=None table for this GPU/dtype

Method: CUDA-event medians with the L2 flushed before every repetition (bench/timing.py). A number
is only meaningful as a ratio to a copy of the same bytes measured in the same run: `x.clone()` for
the forward (read x + write y), the same copy's bandwidth for the backward. Bytes counted: forward =
read x + read w + write y; backward = read x, dy, w + write dx, dw (rstd and partials not counted).
Every implementation's output is checked against the fp32 reference before it is timed; a wrong or
failing one is reported as such, never timed. Without a GPU the bench says what it could not run.
"""
from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import math
import os
import platform
import random
import statistics
import sys
import time
import traceback

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import cutile_norms as cn  # noqa: E402
from bench import anchors as anchor_registry  # noqa: E402
from bench.timing import copy_baseline_ms, device_ms, gpu_us, per_call_us  # noqa: E402
from cutile_norms import dispatch  # noqa: E402
from cutile_norms.forward_table import write_rows  # noqa: E402
from cutile_norms.reference import rms_norm_reference  # noqa: E402

# the widths real models use (hidden sizes and head dims of Llama, Qwen, Mistral, Gemma, GPT, Grok,
# Nemotron and others) and the powers of two to 262144; each run adds random multiples of 8 (--random)
MODEL_NS = [896, 1536, 2048, 2560, 3072, 3584, 4096, 5120, 6144, 7168, 8192, 10240, 12288, 14336, 16384, 18432,
            20480, 24576, 28672, 32768, 65536, 131072, 262144]
DEFAULT_NS = sorted(set(MODEL_NS) | {128, 512, 1024, 2880})
SMALL_MS = [1, 64, 1024]
SMALL_NS = [4096]
ELEMENTS = 1 << 27
DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16,
          "float32": torch.float32, "fp32": torch.float32}
OUR_MODES = [m for m in dispatch.MODES if m != "torch"]  # every GPU mode


def random_widths(count: int, seed: int, lo: int = 1024, hi: int = 262144) -> list[int]:
    """`count` multiples of 8 drawn log-uniformly in [lo, hi] from `seed` (the bench prints the seed)."""
    rng = random.Random(seed)
    return [max(lo, min(hi, 8 * round(2 ** rng.uniform(math.log2(lo), math.log2(hi)) / 8))) for _ in range(count)]


def log(msg: str) -> None:
    print(msg, flush=True)


class Progress:
    """A progress bar on stderr (the results go to stdout): measurements done of the sweep's total, the
    elapsed time and an estimate of what is left. Redrawn in place on a terminal, one line per step
    in a log."""

    def __init__(self, total: int):
        self.total, self.count, self.t0, self.tty = max(total, 1), 0, time.time(), sys.stderr.isatty()

    def step(self, what: str) -> None:
        elapsed = time.time() - self.t0
        left = elapsed / self.count * (self.total - self.count) if self.count else 0.0
        filled = 30 * self.count // self.total
        line = (f"[{'#' * filled}{'.' * (30 - filled)}] {self.count}/{self.total} {elapsed:4.0f} s"
                f" (~{left:.0f} s left) {what}")
        sys.stderr.write(("\r" + line[:110].ljust(110)) if self.tty else line + "\n")
        sys.stderr.flush()
        self.count += 1

    def done(self) -> None:
        if self.tty:
            sys.stderr.write("\n")
        sys.stderr.write(f"{self.count} measurements in {time.time() - self.t0:.0f} s\n")


def versions() -> dict:
    out = {"python": platform.python_version(), "torch": torch.__version__}
    for pkg in ["triton", "cuda-tile", "nvidia-cuda-tileiras", "nvidia-cutlass-dsl", "quack-kernels",
                "liger-kernel", "tilegym"]:
        try:
            out[pkg] = importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            out[pkg] = None
    return out


# ------------------------------------------------------------------------------------------------
# one implementation at one shape
# ------------------------------------------------------------------------------------------------
def check_output(y, x, w, eps) -> str | None:
    """None if y matches the fp32 reference within the dtype's rounding, else what is wrong."""
    ref = rms_norm_reference(x, w, eps)[0].float()
    y = y.float()
    if not torch.isfinite(y).all():
        return "non-finite output"
    tol = {torch.bfloat16: 2 ** -6, torch.float16: 2 ** -9, torch.float32: 1e-4}[x.dtype]
    err = ((y - ref).abs() / (ref.abs() + 1e-3)).max().item()
    return None if err <= tol else f"max relative error {err:.3g} > {tol}"


def measure(name, fwd, x, w, eps, copy_gbps, fwd_bytes, bwd_bytes, backward: bool, small: bool,
            forward: bool = True) -> dict:
    rec = {"impl": name}
    try:
        with torch.no_grad():
            wrong = check_output(fwd(x, w, eps), x, w, eps)
        if wrong:
            return {**rec, "error": f"wrong result: {wrong}"}
        with torch.no_grad():
            if not forward:
                pass
            elif small:
                rec["fwd_us"] = gpu_us(lambda: fwd(x, w, eps))
                rec["fwd_call_us"] = per_call_us(lambda: fwd(x, w, eps))
            else:
                t = device_ms(lambda: fwd(x, w, eps))
                rec.update(fwd_ms=t["median_ms"], fwd_p10_ms=t["p10_ms"], fwd_p90_ms=t["p90_ms"])
                rec["fwd_gbps"] = fwd_bytes / (t["median_ms"] * 1e-3) / 1e9
                rec["fwd_vs_copy"] = rec["fwd_gbps"] / copy_gbps
        if backward:
            xg, wg = x.detach().requires_grad_(), w.detach().requires_grad_()
            y = fwd(xg, wg, eps)
            dy = torch.randn_like(y)
            grad = lambda: torch.autograd.grad(y, (xg, wg), dy, retain_graph=True)  # noqa: E731
            if small:
                rec["bwd_us"] = gpu_us(grad)
                rec["bwd_call_us"] = per_call_us(grad)
                # a training step's pair as an eager caller pays it: forward + backward through autograd
                rec["fwdbwd_call_us"] = per_call_us(lambda: torch.autograd.grad(fwd(xg, wg, eps), (xg, wg), dy))
            else:
                t = device_ms(grad)
                rec["bwd_ms"] = t["median_ms"]
                rec["bwd_gbps"] = bwd_bytes / (t["median_ms"] * 1e-3) / 1e9
                rec["bwd_vs_copy"] = rec["bwd_gbps"] / copy_gbps
            del y, xg, wg
    except Exception as exc:  # report the failure in the table, keep benchmarking the others
        rec["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}"
        if os.environ.get("BENCH_TRACEBACK"):
            traceback.print_exc()
    return rec


def implementations(args) -> tuple[dict, dict]:
    impls, skipped = {}, {}
    avail = cn.available_modes("cuda")
    for mode in args.modes:
        if avail[mode] is None:
            impls[f"cn.{mode}"] = (lambda m: (lambda x, w, eps: cn.rms_norm(x, w, eps, mode=m)))(mode)
        else:
            skipped[f"cn.{mode}"] = avail[mode]
    impls["cn.None"] = lambda x, w, eps: cn.rms_norm(x, w, eps)
    fns, missing = anchor_registry.load(args.anchors)
    impls.update(fns)
    skipped.update(missing)
    return impls, skipped


# ------------------------------------------------------------------------------------------------
# sweeps
# ------------------------------------------------------------------------------------------------
def merge_runs(recs: list[dict]) -> dict:
    """One implementation's records of several runs at one shape: the median of each number, and
    `<key>_runs` with every run's value; the first error if any run failed."""
    failed = next((r for r in recs if "error" in r), None)
    if failed is not None:
        return failed
    out = {"impl": recs[0]["impl"]}
    for key in recs[0]:
        if key != "impl":
            values = [r[key] for r in recs]
            out[key] = statistics.median(values)
            if len(values) > 1:
                out[f"{key}_runs"] = [round(v, 4) for v in values]
    return out


def run(args) -> dict:
    dtype = DTYPES[args.dtype]
    dev = torch.cuda.get_device_properties(0)
    impls, skipped = implementations(args)
    result = {"gpu": dev.name, "arch": f"sm_{dev.major}{dev.minor}", "sm_count": dev.multi_processor_count,
              "memory_gib": round(dev.total_memory / 2 ** 30), "dtype": str(dtype).removeprefix("torch."),
              "date": datetime.datetime.now().isoformat(timespec="seconds"), "runs": args.runs,
              "random_seed": args.seed, "random_ns": args.random_ns,
              "command": "python bench/rmsnorm.py " + " ".join(sys.argv[1:]), "versions": versions(),
              "skipped": skipped, "sweep": [], "small_m": []}
    log(f"# {dev.name} ({result['arch']}, {dev.multi_processor_count} SMs), {result['dtype']}, "
        f"{len(impls)} implementations, {args.runs} runs per point (medians); random widths {args.random_ns} "
        f"(seed {args.seed}); skipped: {skipped or 'none'}")
    eps = 1e-6
    e = torch.empty((), dtype=dtype).element_size()
    progress = Progress(args.runs * len(impls) * (len(args.ns) + len(args.small_n) * len(args.small_m)))
    for N in args.ns:
        M = max(1, ELEMENTS // N)
        x = torch.randn(M, N, device="cuda", dtype=dtype)
        w = (1 + 0.1 * torch.randn(N, device="cuda")).to(dtype)
        fwd_bytes, bwd_bytes = 2 * M * N * e + N * e, 3 * M * N * e + 2 * N * e
        copies, recs = [], {name: [] for name in impls}
        for _ in range(args.runs):  # interleaved: each run times the copy, then every implementation
            copy = copy_baseline_ms(x)
            copies.append(copy["median_ms"])
            copy_gbps = 2 * M * N * e / (copy["median_ms"] * 1e-3) / 1e9
            for name, fn in impls.items():
                progress.step(f"N={N} {name}")
                recs[name].append(measure(name, fn, x, w, eps, copy_gbps, fwd_bytes, bwd_bytes, args.backward,
                                          small=False, forward=args.forward))
        copy_ms = statistics.median(copies)
        row = {"N": N, "M": M, "copy_ms": copy_ms, "copy_runs_ms": copies,
               "copy_gbps": 2 * M * N * e / (copy_ms * 1e-3) / 1e9, "impls": []}
        for name in impls:
            rec = merge_runs(recs[name])
            row["impls"].append(rec)
            log(f"N={N:>6} M={M:>7} {name:<28} " + (rec.get("error") or
                (f"fwd {rec['fwd_gbps']:6.0f} GB/s {rec['fwd_vs_copy']:.3f}x" if "fwd_gbps" in rec else "") +
                (f"  bwd {rec['bwd_gbps']:6.0f} GB/s {rec['bwd_vs_copy']:.3f}x" if "bwd_gbps" in rec else "")))
        log(f"N={N:>6} copy {row['copy_gbps']:.0f} GB/s")
        result["sweep"].append(row)
        del x, w
        torch.cuda.empty_cache()
    for N, M in ((n, m) for n in args.small_n for m in args.small_m):
        x = torch.randn(M, N, device="cuda", dtype=dtype)
        w = (1 + 0.1 * torch.randn(N, device="cuda")).to(dtype)
        copies, recs = [], {name: [] for name in impls}
        for _ in range(args.runs):
            copies.append((gpu_us(lambda: x.clone()), per_call_us(lambda: x.clone())))
            for name, fn in impls.items():
                progress.step(f"small M={M} N={N} {name}")
                recs[name].append(measure(name, fn, x, w, eps, 1.0, 0, 0, args.backward, small=True,
                                          forward=args.forward))
        row = {"N": N, "M": M, "copy_us": statistics.median(c[0] for c in copies),
               "copy_call_us": statistics.median(c[1] for c in copies), "impls": []}
        for name in impls:
            rec = merge_runs(recs[name])
            row["impls"].append(rec)
            log(f"small M={M:>5} N={N:>6} {name:<28} " + (rec.get("error") or
                (f"fwd {rec['fwd_us']:6.1f} us ({rec['fwd_us'] / row['copy_us']:.2f}x copy), per call "
                 f"{rec['fwd_call_us']:6.1f} us ({rec['fwd_call_us'] / row['copy_call_us']:.2f}x copy)"
                 if "fwd_us" in rec else "") +
                (f"  bwd {rec['bwd_us']:6.1f} / {rec['bwd_call_us']:6.1f} us, fwd+bwd per call "
                 f"{rec['fwdbwd_call_us']:6.1f} us" if "bwd_us" in rec else "")))
        log(f"small M={M:>5} copy {row['copy_us']:.1f} us, per call {row['copy_call_us']:.1f} us")
        result["small_m"].append(row)
    progress.done()
    return result


# ------------------------------------------------------------------------------------------------
# reports
# ------------------------------------------------------------------------------------------------
def _cell(rec: dict, key: str, fmt: str) -> str:
    if "error" in rec:
        return "fails" if not rec["error"].startswith("wrong") else "wrong"
    return fmt.format(rec[key]) if key in rec else ""


def markdown(result: dict) -> str:
    names = [r["impl"] for r in result["sweep"][0]["impls"]] if result["sweep"] else []
    out = [f"# RMSNorm bench: {result['gpu']} ({result['arch']}), {result['dtype']}, {result['date']}", "",
           f"`{result['command']}`  ", "versions: " + ", ".join(f"{k} {v}" for k, v in result["versions"].items() if v)]
    if any("fwd_gbps" in r or "error" in r for row in result["sweep"] for r in row["impls"]):
        out += ["", "Forward, GB/s and (ratio to a same-run copy of the same bytes), M = 2^27 / N:", "",
                "| N | copy GB/s | " + " | ".join(names) + " |", "|---:|---:|" + "---:|" * len(names)]
        for row in result["sweep"]:
            cells = [_cell(r, "fwd_gbps", "{:.0f}") + (f" ({r['fwd_vs_copy']:.3f})" if "fwd_vs_copy" in r else "")
                     for r in row["impls"]]
            out.append(f"| {row['N']} | {row['copy_gbps']:.0f} | " + " | ".join(cells) + " |")
    if any("bwd_gbps" in r for row in result["sweep"] for r in row["impls"]):
        out += ["", "Backward through autograd, GB/s and (ratio to the same copy's bandwidth, "
                    "copy GB/s in the first column):", "",
                "| N | copy GB/s | " + " | ".join(names) + " |", "|---:|---:|" + "---:|" * len(names)]
        for row in result["sweep"]:
            cells = [_cell(r, "bwd_gbps", "{:.0f}") + (f" ({r['bwd_vs_copy']:.3f})" if "bwd_vs_copy" in r else "")
                     for r in row["impls"]]
            out.append(f"| {row['N']} | {row['copy_gbps']:.0f} | " + " | ".join(cells) + " |")
    if result["small_m"] and any("fwdbwd_call_us" in r for row in result["small_m"] for r in row["impls"]):
        out += ["", "Small M, forward + backward through autograd, µs per call back to back:", "",
                "| N | M | " + " | ".join(names) + " |", "|---:|---:|" + "---:|" * len(names)]
        for row in result["small_m"]:
            out.append(f"| {row['N']} | {row['M']} | " + " | ".join(_cell(r, "fwdbwd_call_us", "{:.1f}")
                                                                  for r in row["impls"]) + " |")
    if result["small_m"]:
        for key, title in (("us", "GPU µs per call (L2 flushed, events around one call)"),
                           ("call_us", "µs per call back to back (host work included when the host is slower)")):
            out += ["", f"Small M, {title}, fwd (/ bwd):", "",
                    "| N | M | copy | " + " | ".join(names) + " |", "|---:|---:|---:|" + "---:|" * len(names)]
            for row in result["small_m"]:
                cells = [_cell(r, f"fwd_{key}", "{:.1f}") + (f" / {r[f'bwd_{key}']:.1f}" if f"bwd_{key}" in r else "")
                         for r in row["impls"]]
                out.append(f"| {row['N']} | {row['M']} | {row[f'copy_{key}']:.1f} | " + " | ".join(cells) + " |")
    if result["skipped"]:
        out += ["", "Not run: " + "; ".join(f"{k}: {v}" for k, v in result["skipped"].items())]
    return "\n".join(out) + "\n"


def plot(result: dict, path: str) -> str | None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib not installed: no plot"
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
    for ax, key in zip(axes, ["fwd_vs_copy", "bwd_vs_copy"]):
        names = [r["impl"] for r in result["sweep"][0]["impls"]]
        for name in names:
            pts = [(row["N"], r[key]) for row in result["sweep"] for r in row["impls"] if r["impl"] == name and key in r]
            if pts:
                ax.plot(*zip(*pts), marker="o", label=name, lw=2 if name.startswith("cn.") else 1)
        ax.set_xscale("log", base=2)
        ax.axhline(1.0, color="k", lw=0.8, ls="--")
        ax.set_xlabel("N (M = 2^27 / N)")
        ax.set_ylabel("ratio to same-run copy")
        ax.set_title(f"{'forward' if key.startswith('fwd') else 'backward'}: {result['gpu']}, {result['dtype']}")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=80)  # ~50 KB: small enough to commit beside the README
    return None


def write_table(result: dict) -> str:
    """The mode=None table for this GPU model and dtype from the sweep's forward ratios of the stable
    modes (dispatch.FORWARD_RULE)."""
    points = {row["N"]: {r["impl"][3:]: r["fwd_vs_copy"] for r in row["impls"] if "fwd_vs_copy" in r}
              for row in result["sweep"]}
    return write_rows(points, result["dtype"], result["arch"], result["gpu"], result["command"], result["date"])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    p.add_argument("--ns", type=lambda s: [int(v) for v in s.split(",") if v], default=DEFAULT_NS)
    p.add_argument("--small-m", type=lambda s: [int(v) for v in s.split(",") if v], default=SMALL_MS)
    p.add_argument("--small-n", type=lambda s: [int(v) for v in s.split(",") if v], default=SMALL_NS,
                   help="widths of the small-M sweep")
    p.add_argument("--random", type=int, default=10, help="random multiples of 8 in 1024..262144 added to --ns")
    p.add_argument("--seed", type=int, default=None, help="the random widths' seed (default: drawn and printed)")
    p.add_argument("--runs", type=int, default=3, help="interleaved runs per point; tables show their medians")
    p.add_argument("--modes", type=lambda s: [v for v in s.split(",") if v], default=OUR_MODES)
    p.add_argument("--anchors", type=lambda s: [v for v in s.split(",") if v and v != "none"],
                   default=list(anchor_registry.ANCHORS))
    p.add_argument("--no-backward", dest="backward", action="store_false")
    p.add_argument("--no-forward", dest="forward", action="store_false",
                   help="time the backward only (each forward is still checked)")
    p.add_argument("--out", default=os.path.join(ROOT, "bench", "results"))
    p.add_argument("--write-table", action="store_true", help="write the mode=None table for this GPU/dtype")
    args = p.parse_args(argv)
    args.dtype = str(DTYPES[args.dtype]).removeprefix("torch.")
    if args.seed is None:
        args.seed = random.SystemRandom().randrange(1 << 30)
    args.random_ns = sorted(set(random_widths(args.random, args.seed)) - set(args.ns))
    args.ns = sorted(set(args.ns) | set(args.random_ns))

    if not torch.cuda.is_available():
        log("No CUDA GPU here: nothing was timed. This bench needs an NVIDIA GPU (sm_90+ for the cuTile and "
            "CuTe DSL modes). What this machine could run:")
        for mode, why in cn.available_modes().items():
            log(f"  {mode:<18} {'runs here (CPU reference)' if why is None else 'cannot run: ' + why}")
        _, missing = anchor_registry.load(args.anchors)
        for name in args.anchors:
            log(f"  anchor {name:<27} {'installed' if name not in missing else 'not available: ' + missing[name]}"
                + ("; needs a GPU to time" if name not in missing else ""))
        return 0

    result = run(args)
    os.makedirs(args.out, exist_ok=True)
    stem = os.path.join(args.out, f"rmsnorm_{result['arch']}_{result['dtype']}")
    with open(stem + ".json", "w") as f:
        json.dump(result, f, indent=1)
    md = markdown(result)
    with open(stem + ".md", "w") as f:
        f.write(md)
    note = plot(result, stem + ".png")
    log(f"\nwrote {stem}.json, {stem}.md" + (f", {stem}.png" if not note else f" ({note})"))
    if args.write_table:
        log(f"wrote {write_table(result)}")
    log("\n" + md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
