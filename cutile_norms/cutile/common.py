"""Host-side helpers the cuTile launch wrappers share (pure Python and torch: no cuTile import)."""
from __future__ import annotations

import math

import torch


def align_elems(stride: int, elem_bytes: int) -> int:
    """Largest power of two dividing the row stride, capped at 16 bytes' worth of elements."""
    cap = max(16 // elem_bytes, 1)
    return math.gcd(stride, cap) if stride else cap


def round16(n: int) -> int:
    return (n + 15) & ~15


def round_up(n: int, k: int) -> int:
    return -(-n // k) * k


def flat(t: torch.Tensor, length: int, offset: int = 0) -> torch.Tensor:
    """A 1-D view of `length` elements of t's storage from t's first element + offset: the kernels
    take flat arrays (a 2-D array would specialise the launch on M's divisibility)."""
    return t.as_strided((length,), (1,), t.storage_offset() + offset)
