"""The residual add fused into the tma_smem_cached forward (CuTe DSL): the launch wrapper and what it
takes (the kernel in add_rmsnorm_fwd_kernel.py; compiled and cached with the forward's own, by
rmsnorm_fwd.compile_forward; its config add_rmsnorm_fwd_config.add_config). The same call as
Triton's and cuTile's fused forwards (triton/add_rmsnorm_fwd.py, cutile/add_rmsnorm_fwd.py);
dispatch.residual_add_kernel picks it."""
from __future__ import annotations

import torch

from .compile import aligned_weight, placeholder_f32
from .rmsnorm_fwd import compile_forward, unsupported as forward_unsupported
from .add_rmsnorm_fwd_config import add_config


def unsupported(x2d: torch.Tensor, r2d: torch.Tensor, h_dtype: torch.dtype,
                batch_invariant: bool = False) -> str | None:
    """None where this kernel takes the call (x, the residual and h of one dtype, both operands' rows
    under the forward's 16-byte rule), else why not (the add then runs unfused before the mode's norm).
    `batch_invariant` (mode=None): one row is judged by its tensors' row strides too, as its batch is."""
    if r2d.dtype != x2d.dtype or h_dtype != x2d.dtype:
        return "the CuTe DSL fused add reads a residual of x's dtype into h of x's dtype"
    M, N = x2d.shape
    for t, name in ((x2d, "x's"), (r2d, "the residual's")):
        why = forward_unsupported(N, t.dtype, t.stride(0), M, t.data_ptr(), batch_invariant)
        if why:
            return why.replace("x's", name)
    if add_config(N, x2d.element_size()) is None:
        return f"the CuTe DSL fused add keeps x's and r's rows in shared memory: N={N} is too long"
    return None


def add_rms_norm_fwd(x2d: torch.Tensor, r2d: torch.Tensor, weight: torch.Tensor | None, eps: float, offset: float,
                     h_dtype: torch.dtype, store_rstd: bool, out: tuple | None = None):
    """(y [M, N] in x's dtype, h [M, N] in h_dtype (x's), rstd [M] fp32 or None) for rows `unsupported`
    accepts, M >= 1 (validated by the API layer). `out`: (y, h) to write into, contiguous [M, N] (in
    place: x and r themselves)."""
    M, N = x2d.shape
    device = x2d.device
    contiguous = M == 1 or (x2d.stride(0) == N and r2d.stride(0) == N)
    fn = compile_forward(x2d.dtype, None if weight is None else weight.dtype, N, add_config(N, x2d.element_size()),
                         store_rstd, contiguous, has_residual=True)
    if contiguous and M == 1:  # one row: any stride, the kernel wants N
        x2d, r2d = x2d.as_strided((M, N), (N, 1)), r2d.as_strided((M, N), (N, 1))
    weight = aligned_weight(weight)
    if out is None:
        y, h = torch.empty_like(x2d, memory_format=torch.contiguous_format), torch.empty((M, N), dtype=h_dtype,
                                                                                         device=device)
    else:
        y, h = out
    rstd = torch.empty(M, dtype=torch.float32, device=device) if store_rstd else placeholder_f32(device)
    fn(x2d, r2d, weight if weight is not None else y[0], y, h, rstd, eps, offset)
    return y, h, rstd if store_rstd else None
