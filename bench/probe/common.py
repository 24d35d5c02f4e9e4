"""What the probes and sweeps share: the exit where there is no GPU, and the JSON they write with --out."""
from __future__ import annotations

import json

import torch


def no_gpu(what: str = "this probe times kernels") -> bool:
    """True (and says so) where there is no CUDA GPU: every probe and sweep times kernels."""
    if torch.cuda.is_available():
        return False
    print(f"No CUDA GPU here: {what}. Nothing was run.")
    return True


def write_json(path: str | None, obj) -> None:
    """obj as JSON at path (the probes' --out), nothing without one."""
    if path:
        with open(path, "w") as f:
            json.dump(obj, f, indent=1)
