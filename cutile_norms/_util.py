"""Small integer helpers the config rules of every DSL and the API's argument checks share (pure Python: no
DSL, no torch)."""
from __future__ import annotations

import numbers


def pow2_ceil(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1)."""
    return 1 << (max(n, 1) - 1).bit_length()


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def ints(name: str, values) -> list[int]:
    """values as ints: each an integer (Python's or numpy's), never a bool or a float that would round;
    a TypeError naming `name` otherwise."""
    try:
        values = list(values)
    except TypeError:
        raise TypeError(f"{name} must be an int or a sequence of ints, got {values!r}") from None
    if not all(isinstance(v, numbers.Integral) and not isinstance(v, bool) for v in values):
        raise TypeError(f"{name} must be ints, got {values!r}")
    return [int(v) for v in values]
