"""What the probes share: the exit where there is no GPU, the output check before anything is timed,
and the JSON a probe writes with --out."""
from __future__ import annotations

import json
import statistics

import torch

from bench.rmsnorm import check_output


def no_gpu(what: str = "this probe times kernels") -> bool:
    """True (and says so) where there is no CUDA GPU: every probe and sweep times kernels."""
    if torch.cuda.is_available():
        return False
    print(f"No CUDA GPU here: {what}. Nothing was run.")
    return True


def check_outputs(fns: dict, x: torch.Tensor, w: torch.Tensor, what: str, rows: int | None = None) -> None:
    """Each fn's y against the fp32 reference of x (eps 1e-6; bench.rmsnorm.check_output), on the
    first `rows` rows or all of them. AssertionError naming `what` and the fn's key."""
    for k, fn in fns.items():
        y = fn()
        wrong = check_output(y[:rows], x[:rows], w, 1e-6) if rows else check_output(y, x, w, 1e-6)
        if wrong:
            raise AssertionError(f"{what} {k}: {wrong}")


def put_ratios(rec: dict, ratios: dict) -> None:
    """Into rec, per key of ratios (bench.timing.ratios_to_copy): `<key>_vs_copy`, the median of its
    rounds, and `<key>_vs_copy_rounds`, the rounds."""
    for k, v in ratios.items():
        rec[f"{k}_vs_copy"] = statistics.median(v)
        rec[f"{k}_vs_copy_rounds"] = [round(r, 4) for r in v]


def write_json(path: str | None, obj) -> None:
    """obj as JSON at path (the probes' --out), nothing without one."""
    if path:
        with open(path, "w") as f:
            json.dump(obj, f, indent=1)
