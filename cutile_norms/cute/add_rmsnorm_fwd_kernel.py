"""The residual add fused into the tma_smem_cached forward (CuTe DSL): h = x + r, stored, then y =
rms_norm(h) * (offset + w), x and r read once, h and y written once. The kernel body is the forward's
(rmsnorm_fwd_kernel.py, by `has_residual`): r's row tile comes into shared memory beside x's by the
same bulk copies, the first pass forms h (summed in fp32, rounded once to x's dtype, the unfused
`torch.add`'s bits), stores it and writes it over x's tile, and the norm runs on h as stored. Its launch
is add_rmsnorm_fwd.py; its config add_rmsnorm_fwd_config.add_config (the forward's, with 256 threads for
16-bit rows held in one CTA, and none where the two tiles exceed a CTA's shared memory).

What it assumes beyond the forward's (add_rmsnorm_fwd.unsupported): r and h of x's dtype, r's rows
under the forward's 16-byte rule at their own stride, h contiguous."""
from __future__ import annotations

import cutlass.cute as cute
from cutlass import Float32

from .rmsnorm_fwd_kernel import RMSNormFwdTmaSmem


class AddRMSNormFwdTmaSmem(RMSNormFwdTmaSmem):
    """(y, h) = (rms_norm(x + r) * (offset + w), x + r) over rows of N; compile-time as the forward's,
    runtime: M, x's and r's row strides, eps, offset."""

    has_residual = True

    @cute.jit
    def __call__(self, mX: cute.Tensor, mR: cute.Tensor, mW, mY: cute.Tensor, mH: cute.Tensor, mRstd, eps: Float32,
                 offset: Float32, stream):
        self._launch(mX, mR, mW, mY, mH, mRstd, eps, offset, stream)
