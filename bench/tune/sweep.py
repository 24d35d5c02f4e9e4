"""What the config sweeps share: a width's inputs at the bench size, the candidates without repeats, the
best timed config of a width, a run's JSON and its summary, and the package's tuning tables read and
written whole (no GPU needed but for the inputs)."""
from __future__ import annotations

import json
import os

import torch

ELEMENTS = 1 << 27  # the bench size: M = ELEMENTS // N rows of N


def width_inputs(N: int, dtype, M: int | None = None, device="cuda"):
    """(M, x, w) for rows of N: M = ELEMENTS // N unless given, x normal, w near 1 (1 + 0.1 normal)."""
    M = ELEMENTS // N if M is None else M
    x = torch.randn(M, N, device=device, dtype=dtype)
    return M, x, (1 + 0.1 * torch.randn(N, device=device)).to(dtype)


def distinct(configs: list) -> list:
    """The configs in order, each once (frozen dataclasses)."""
    return list(dict.fromkeys(configs))


def best_timed(configs: list, keep=None) -> dict | None:
    """The config record with the highest vs_copy among those timed (and kept by `keep`), or None."""
    timed = [c for c in configs if "vs_copy" in c and (keep is None or keep(c))]
    return max(timed, key=lambda c: c["vs_copy"], default=None)


def save_sweep(results: dict, out_dir: str, name: str, note=lambda entry: "") -> str:
    """results as out_dir/name, then the best config per width (with `note(entry)` after it); the path."""
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, name)
    with open(path, "w") as f:
        json.dump(results, f, indent=1)
    print("\nsummary (best per N):")
    for entry in results["sweep"]:
        best = best_timed(entry["configs"])
        if best:
            print(f"  N={entry['N']:>6} {best['vs_copy']:.3f}x  {note(entry)}{best['config']}")
    print(f"wrote {path}")
    return path


def read_table(path: str) -> dict:
    """A tuning table, or an empty one where there is none yet."""
    if not os.path.exists(path):
        return {"source": {}, "configs": {}}
    with open(path) as f:
        return json.load(f)


def write_table(table: dict, path: str) -> str:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(table, f, indent=1)
        f.write("\n")
    return path
