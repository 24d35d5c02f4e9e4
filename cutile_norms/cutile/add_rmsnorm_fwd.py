"""The fused residual add + RMSNorm split forward in cuTile: the launch wrapper (the kernel in
add_rmsnorm_fwd_kernel.py, its launch rule in add_rmsnorm_fwd_config.py)."""
from __future__ import annotations

import functools

import cuda.tile as ct
import torch

from .._workspace import current_raw_stream, workspace
from .add_rmsnorm_fwd_config import NUM_WARPS, OCCUPANCY, constants
from .add_rmsnorm_fwd_kernel import add_rms_norm_fwd_split_kernel
from .common import flat, flat_array, round16, signature

_MAX_FLAT = (1 << 31) - 1  # int32 indexing: longer launches are cut into row chunks


@functools.lru_cache(maxsize=None)
def _kernel():
    return add_rms_norm_fwd_split_kernel.replace_hints(num_worker_warps=NUM_WARPS, occupancy=OCCUPANCY)


def export_signature(N: int, x_dtype, r_dtype, h_dtype, w_dtype, has_w: bool = True, store_rstd: bool = True):
    """The kernel and the KernelSignature a launch on contiguous rows would compile (the CI compile checks)."""
    from cuda.tile.compilation import ScalarConstraint

    size = {ct.float16: 2, ct.bfloat16: 2, ct.float32: 4}
    div16 = N % 16 == 0
    params = [flat_array(x_dtype, div16), flat_array(r_dtype, div16), flat_array(w_dtype, div16),
              flat_array(x_dtype, True), flat_array(h_dtype, True), flat_array(ct.float32, True),
              flat_array(ct.int32, True)]
    params += [ScalarConstraint(ct.int32)] * 3 + [ScalarConstraint(ct.float32)] * 2
    return _kernel(), signature(params, constants(N, N, N, size[x_dtype], size[r_dtype], size[h_dtype], has_w,
                                                  store_rstd))


def _alloc(M: int, N: int, dtype: torch.dtype, device) -> torch.Tensor:
    """[M, N] in an allocation whose flat length is a multiple of 16 (the launch's "divisible by 16"
    bit then never depends on M)."""
    return torch.empty(round16(M * N), dtype=dtype, device=device)[:M * N].view(M, N)


def add_rms_norm_fwd(x2d: torch.Tensor, r2d: torch.Tensor, weight: torch.Tensor | None, eps: float, offset: float,
                     h_dtype: torch.dtype, store_rstd: bool, out: tuple | None = None):
    """(y [M, N] in x's dtype, h [M, N] in h_dtype, rstd [M] fp32 or None) for 2-D x and r with unit
    column stride and M >= 1 (validated by the API layer), rows of at least 2 x 16 columns. `out`:
    (y, h) to write into, contiguous [M, N] (in place: x and r themselves, when contiguous)."""
    M, N = x2d.shape
    device = x2d.device
    if out is None:
        y, h = _alloc(M, N, x2d.dtype, device), _alloc(M, N, h_dtype, device)
    else:
        y, h = out
        if not (y.is_contiguous() and h.is_contiguous()):
            raise ValueError("out: y and h must be contiguous [M, N]")
    rstd = torch.empty(round16(M), dtype=torch.float32, device=device)[:M] if store_rstd else None
    if weight is not None and weight.stride(0) != 1:
        weight = weight.contiguous()
    sx, sr = (x2d.stride(0), r2d.stride(0)) if M > 1 else (N, N)
    consts = constants(N, sx, sr, x2d.element_size(), r2d.element_size(), h.element_size(), weight is not None,
                       store_rstd)
    split = consts[1]
    stream = current_raw_stream(device.index)
    unused = flat(y, 16)  # what the kernel never reads (no weight, no rstd): a short view of y
    rows = max(1, (_MAX_FLAT - N) // max(sx, sr, N) // 16 * 16) if (M - 1) * max(sx, sr, N) + N > _MAX_FLAT else M
    for r0 in range(0, M, rows):
        m = min(rows, M - r0)
        sync = workspace(f"add_fwd_sync{split}", m * split, torch.int32, device, stream, zero=True)
        args = (flat(x2d, (m - 1) * sx + N, r0 * sx), flat(r2d, (m - 1) * sr + N, r0 * sr),
                weight if weight is not None else unused, flat(y, m * N, r0 * N), flat(h, m * N, r0 * N),
                flat(rstd, m, r0) if store_rstd else unused, sync, m, sx, sr, eps, offset)
        ct.launch(stream, (m * split,), _kernel(), args + consts)
    return y, h, rstd
