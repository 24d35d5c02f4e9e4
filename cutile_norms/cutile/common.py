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


# ------------------------------------------------------------------------------------------------
# Compile-time signatures (the CI compile checks build each launch ahead of time)
# ------------------------------------------------------------------------------------------------

def flat_array(dtype, div16: bool):
    """The ArrayConstraint a launch specialises a flat 1-D array on: unit stride, 16-byte-aligned base,
    its length divisible by 16 or not."""
    import cuda.tile as ct
    from cuda.tile.compilation import ArrayConstraint

    return ArrayConstraint(dtype, 1, index_dtype=ct.int32, stride_lower_bound_incl=0, alias_groups=(),
                           may_alias_internally=False, stride_constant=(1,),
                           shape_divisible_by=16 if div16 else 1, base_addr_divisible_by=16)


def padded_rows(dtype, N: int, elem_bytes: int):
    """The ArrayConstraint of a 2-D output whose rows are padded to a multiple of 16 at row stride N
    (as a launch specialises it)."""
    import cuda.tile as ct
    from cuda.tile.compilation import ArrayConstraint

    vec = 16 // elem_bytes
    return ArrayConstraint(dtype, 2, index_dtype=ct.int32, stride_lower_bound_incl=0, alias_groups=(),
                           may_alias_internally=False, stride_constant=(1 if N == 1 else None, 1),
                           shape_constant=(None, 1 if N == 1 else None),
                           stride_divisible_by=(vec if N % vec == 0 else 1, 1),
                           shape_divisible_by=(16, 16 if N % 16 == 0 else 1), base_addr_divisible_by=16)


def signature(params: list, constants: tuple):
    """A KernelSignature of these array/scalar constraints followed by the compile-time constants."""
    from cuda.tile.compilation import CallingConvention, ConstantConstraint, KernelSignature

    return KernelSignature(list(params) + [ConstantConstraint(c) for c in constants],
                           CallingConvention.cutile_python_v2())
