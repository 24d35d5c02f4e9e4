"""Small integer helpers the config rules of every DSL share (pure Python: no DSL, no torch)."""
from __future__ import annotations


def pow2_ceil(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1)."""
    return 1 << (max(n, 1) - 1).bit_length()


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)
