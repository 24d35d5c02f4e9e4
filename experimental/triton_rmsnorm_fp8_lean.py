"""RMSNorm with an FP8 output, the lean form of the Triton kernel (experimental: compile-checked for
sm_90 and sm_100, run under Triton's interpreter in CI; not yet run on a GPU).

The same q and scales as `cutile_norms/triton/rmsnorm_fp8.py` in fewer instructions
(rmsnorm_fp8_kernel's LEAN): no clamp before the conversion (`cvt.rn.satfinite` saturates to the
format's largest value and keeps NaN, as the clamp did), and each amax one NaN-propagating max
reduction (`max.NaN`) instead of a max and a count of NaN. sm_90 SASS per element per thread:
18.8-20.8 against 25.5-27.8 (docs/performance.md 2.15), where an H200 at copy speed allows about 24.
"""
from __future__ import annotations

from cutile_norms._experimental import experimental_kernel
from cutile_norms.triton.rmsnorm_fp8 import rms_norm_fp8 as stable_rms_norm_fp8


@experimental_kernel
def rms_norm_fp8(x2d, r2d, weight, eps, offset, out_dtype, h_dtype, scale, scale_ub, group_size, ue8m0):
    """`cutile_norms.triton.rmsnorm_fp8.rms_norm_fp8`'s arguments and results, the lean kernel."""
    return stable_rms_norm_fp8(x2d, r2d, weight, eps, offset, out_dtype, h_dtype, scale, scale_ub, group_size,
                               ue8m0, lean=True)
