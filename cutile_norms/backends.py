"""The typed interface every kernel backend implements (what dispatch.MODES points at and what the API
layer calls): the forward of a mode and the backward behind its autograd. Kernels do not validate; the
API layer (rmsnorm.py) does, then asks the backend only what this interface says."""
from __future__ import annotations

from typing import Callable, Optional, Protocol, runtime_checkable

import torch

from ._platform import DeviceInfo

# run(x, weight, eps, offset, out_shape) -> (y, rstd or None): a launch with everything for one call
# signature resolved (config, compiled kernel, placeholders). x: [M, N] rows with unit column stride
# (y in out_shape, or [M, N] without one), or a contiguous x of any other rank, which is then out_shape
# itself (a decode step's [batch, 1, hidden]: its rows read where they are, y made in that shape)
Runner = Callable[..., tuple]


@runtime_checkable
class ForwardBackend(Protocol):
    mode: str
    # False: some rows (strides, alignment) are refused by `unsupported`, checked once per call signature
    takes_every_row: bool

    def config(self, N: int, dtype: torch.dtype, dev: DeviceInfo):
        """The launch config for rows of N `dtype` elements on `dev` (None: no config takes them)."""

    def describe(self, M: int, N: int, dtype: torch.dtype, dev: DeviceInfo) -> str:
        """The kernel, grid and config a call would run (explain() prints it)."""

    def unsupported(self, x2d: torch.Tensor, batch_invariant: bool = False) -> Optional[str]:
        """Why these rows are refused, None when taken (always None where takes_every_row).
        batch_invariant (mode=None): judge one row as the batch it comes from is."""

    def forward(self, x2d: torch.Tensor, weight: Optional[torch.Tensor], eps: float, offset: float,
                store_rstd: bool, dev: DeviceInfo, cfg=None, out: Optional[tuple] = None, out_shape=None) -> tuple:
        """(y, rstd [M] fp32 or None) for validated [M, N] rows with unit column stride."""

    def launcher(self, M: int, N: int, stride: int, dtype: torch.dtype, w_dtype: Optional[torch.dtype],
                 store_rstd: bool, dev: DeviceInfo) -> Optional[Runner]:
        """A Runner for one call signature, or None where `forward` per call is all there is."""


@runtime_checkable
class BackwardBackend(Protocol):
    # True: a dh passed to `backward` is read with the row and added to dx inside the kernel (the
    # residual add's backward in one pass); False: added after it, by torch
    adds_dh: bool

    def config(self, N: int, dtype: torch.dtype, dev: DeviceInfo, w_dtype: Optional[torch.dtype] = None):
        """The launch config for rows of N `dtype` elements (with a `w_dtype` weight) on `dev`."""

    def describe(self, M: int, N: int, dtype: torch.dtype, dev: DeviceInfo,
                 w_dtype: Optional[torch.dtype] = None, has_dh: bool = False) -> str:
        """The kernel, grid and config a backward would run (explain() prints it); `has_dh`: the
        residual add's backward, dh read with the row (where adds_dh)."""

    def backward(self, dy2d: torch.Tensor, x2d: torch.Tensor, weight: Optional[torch.Tensor], rstd: torch.Tensor,
                 offset: float, need_dx: bool, need_dw: bool, dev: DeviceInfo, cfg=None,
                 out: Optional[tuple] = None, dh2d: Optional[torch.Tensor] = None) -> tuple:
        """(dx [M, N] in x's dtype or None, dw [N] in the weight's dtype or None). dh2d (given only where
        adds_dh, else always None): [M, N] rows in x's dtype with unit column stride, added to dx (x
        being h = x + r, dh the grad h gets from its other uses), or None."""
