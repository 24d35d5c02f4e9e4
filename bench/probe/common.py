"""What the probes and sweeps share: their common options, the exit where there is no GPU, a backward's
inputs and reference grads, their check before a kernel is timed, and the JSON they write with --out."""
from __future__ import annotations

import argparse
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


def ints(text: str) -> list[int]:
    """"1,2,3" -> [1, 2, 3]."""
    return [int(v) for v in text.split(",") if v]


def width_parser(doc: str, ns: list[int]) -> argparse.ArgumentParser:
    """A probe's parser with the options every width probe takes: --ns (default `ns`), --rounds (3,
    medians of that many interleaved rounds) and --out (the JSON)."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ns", type=ints, default=ns)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", default=None)
    return p


def backward_close(dx: torch.Tensor, dw: torch.Tensor, dx_ref: torch.Tensor, dw_ref: torch.Tensor) -> bool:
    """A 16-bit backward's dx and dw against the reference's (fp32 accumulations: these bounds hold for
    every kernel the CuTe backward probes time, and a wrong or unwritten row breaks them)."""
    return (torch.allclose(dx.float(), dx_ref.float(), rtol=2e-2, atol=3e-2)
            and torch.allclose(dw.float(), dw_ref.float(), rtol=2e-2, atol=1e-1))


def backward_case(N: int, w_dtype: torch.dtype = torch.bfloat16) -> tuple:
    """(M, x, w, dy, rstd, dx_ref, dw_ref): bf16 rows of N at the bench size (bench.tune.sweep.width_inputs),
    a weight of w_dtype, dy normal, the forward's fp32 rstd, and the reference's grads (offset 0, eps
    1e-6)."""
    from bench.tune.sweep import width_inputs
    from cutile_norms.reference import rms_norm_backward, rms_norm_reference

    M, x, w = width_inputs(N, torch.bfloat16)
    w = w.to(w_dtype)
    dy = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
    rstd = rms_norm_reference(x, w, 1e-6)[1].float().contiguous()
    return (M, x, w, dy, rstd, *rms_norm_backward(dy, x, w, rstd, 0.0))
