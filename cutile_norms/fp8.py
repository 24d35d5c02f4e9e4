"""RMSNorm with an FP8 output for serving: `rms_norm_fp8`, optionally after the fused residual add.

    q, scales = cn.rms_norm_fp8(x, w, eps)                              # per-token dynamic scales
    q, scales = cn.rms_norm_fp8(x, w, eps, scale=s)                     # a given per-tensor scale
    q, scales = cn.rms_norm_fp8(x, w, eps, group_size=128)              # 1 x 128 group scales
    q, scales, h = cn.rms_norm_fp8(x, w, eps, residual=r)               # h = x + r, as rms_norm's

Contract:
  * y = h * rsqrt(mean(h^2) + eps) * (offset + w) in fp32 (h = x, or x + residual as `rms_norm`'s
    residual add defines it; at offset 0, * w: the weight as it is, so a -0.0 weight keeps y's sign as
    torch's RMSNorm does), never rounded to 16 bits; q = fp8(clamp(y * (1 / s), -max, max)), the
    reciprocal by IEEE division once per scale, round to nearest even (`reference.fp8_quantize`).
    out_dtype: torch.float8_e4m3fn (max 448) or torch.float8_e5m2 (max 57344); dequantize as
    q.float() * s.
  * Scales (fp32): `scale` given (a float or a one-element fp32 tensor on x's device): returned as given
    (the tensor itself, viewed as (1,); a float becomes one by a fill kernel: pass a tensor to keep a
    call at one launch). A tensor's value is not read on the host (that would wait for the GPU) and not
    checked: it must be finite and positive, as a float is checked to be (a zero one gives q = +-max, NaN
    where y = 0; a negative one flips q's sign). Else per
    token: [..., 1], s = max(min(amax, scale_ub), 1e-12) / max (`reference.fp8_scale`; scale_ub an
    optional upper bound on the amax, vLLM's). group_size=g (a power of two dividing N): [..., N / g],
    one scale per 1 x g columns, row-major by default (what Triton block-FP8 GEMMs such as vLLM's
    w8a8_block_fp8_matmul read), or with scale_layout="column" the same values M-major: the rows'
    dim has stride 1 (what CUTLASS's blockwise and DeepGEMM's FP8 GEMMs read; vLLM asks
    per_token_group_quant_fp8 for it with column_major_scales=True; no padding of M). scale_ue8m0=True:
    dynamic scales rounded up to a power of two (the exponent-only UE8M0 scales), still fp32.
  * A zero row (or group) gets the scale 1e-12 / max and q = 0. inf in a row: its sum of squares is
    inf, rstd 0, y NaN at the inf and 0 elsewhere; NaN in a row: y all NaN. A dynamic scale over a NaN
    is NaN and so is all of its row's (group's) q; with a given scale only the NaN elements are NaN.
    q never holds inf: |y / s| past the format's max saturates to it (e4m3fn has no inf at all).
  * Not differentiable (an output for the next GEMM). Two kernels of the same math, each bit for bit
    the reference given its own rstd (their sums of squares add in different orders, so the two can
    differ by an ulp of a scale or a step of q), rows of up to FP8_KERNEL_MAX_N: Triton's
    (triton/rmsnorm_fp8.py, mode="triton"), a power-of-two block of the row in registers, and the CuTe
    DSL one (cute/rmsnorm_fp8.py, mode="tma_smem_cached"), the row in shared memory by TMA bulk copies
    (rows of 16-byte multiples, a residual of x's dtype); mode=None picks by `cute_wins` (measured, by
    N and the GPU model: batch invariant; the CuTe DSL kernel's tiles a CTA follow M, a row's bits do
    not). Else, or with CUTILE_NORMS_FUSED=0, the same math in torch ops.
"""
from __future__ import annotations

import math
import numbers

import torch

from . import dispatch
from ._platform import device_info, gpu_model, on_its_gpu, toolchain
from .distributed import replicated_like
from .reference import FP8_MAX, fp8_quantize, fp8_scale, residual_sum_reference, rms_norm_reference
from .residual import validate_residual
from .rmsnorm import TORCH_DEFAULT_EPS, as_rows, validate

# The FP8 kernels by the mode that names them; mode=None picks by `pick_kernel`'s rule.
FP8_KERNELS = {"triton": "cutile_norms.triton.rmsnorm_fp8:rms_norm_fp8",
               "tma_smem_cached": "cutile_norms.cute.rmsnorm_fp8:rms_norm_fp8"}
FP8_KERNEL_MAX_N = 16384  # a row in registers


def kernel_outputs(M: int, N: int, out_dtype: torch.dtype, h_dtype: torch.dtype | None, scale: torch.Tensor | None,
                   group_size: int | None, device: torch.device):
    """(q [M, N] out_dtype, scales, h [M, N] h_dtype or None, rstd [M] fp32), what both FP8 kernels
    write: scales `scale` itself (per tensor), [M] (per row) or [M, N / group_size] row-major fp32."""
    q = torch.empty(M, N, dtype=out_dtype, device=device)
    h = torch.empty(M, N, dtype=h_dtype, device=device) if h_dtype is not None else None
    rstd = torch.empty(M, dtype=torch.float32, device=device)
    if scale is not None:
        scales = scale
    else:
        scales = torch.empty(M, N // group_size if group_size else 1, dtype=torch.float32, device=device)
        if not group_size:
            scales = scales.view(M)
    return q, scales, h, rstd


def _validate_fp8(x, out_dtype, scale, scale_ub, group_size, ue8m0) -> None:
    if out_dtype not in FP8_MAX:
        raise TypeError(f"out_dtype must be torch.float8_e4m3fn or torch.float8_e5m2, got {out_dtype}")
    if scale is not None:
        if isinstance(scale, torch.Tensor):
            if scale.numel() != 1 or scale.dtype != torch.float32 or scale.device != x.device:
                raise ValueError(f"scale must be one fp32 element on x's device, got {tuple(scale.shape)} "
                                 f"{scale.dtype} on {scale.device}")
        elif isinstance(scale, bool) or not isinstance(scale, numbers.Real) or not 0 < scale < math.inf:
            raise ValueError(f"scale must be a finite positive number or a tensor, got {scale!r}")
        if scale_ub is not None or group_size is not None or ue8m0:
            raise ValueError("a given scale is per tensor: scale_ub, group_size and scale_ue8m0 are for "
                             "dynamic scales")
    if scale_ub is not None and (isinstance(scale_ub, bool) or not isinstance(scale_ub, numbers.Real)
                                 or not 0 < scale_ub < math.inf):
        raise ValueError(f"scale_ub must be a finite positive number, got {scale_ub!r}")
    if group_size is not None:
        N = x.shape[-1]
        if (isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1
                or group_size & (group_size - 1) or N % group_size):
            raise ValueError(f"group_size must be a power of two dividing N={N}, got {group_size!r}")


def _reference(x, residual, weight, eps, offset, out_dtype, h_dtype, scale, scale_ub, group_size, ue8m0):
    """(q, scales, h or None) in torch ops: the fallback, and the oracle's math."""
    h = None if residual is None else residual_sum_reference(x, residual, h_dtype)
    # at offset 0 the weight multiplies as it is (no + 0, which would make a -0.0 weight +0.0)
    y = rms_norm_reference((h if h is not None else x).float(), weight if offset else None, eps, offset)[0]
    if weight is not None and not offset:
        y = y * weight.float()
    if scale is not None:
        return fp8_quantize(y, scale, out_dtype), scale, h
    if group_size:
        yg = y.unflatten(-1, (y.shape[-1] // group_size, group_size))
        s = fp8_scale(yg.abs().amax(-1), out_dtype, scale_ub, ue8m0)
        return fp8_quantize(yg, s.unsqueeze(-1), out_dtype).flatten(-2), s, h
    amax = y.abs().amax(-1, keepdim=True) if y.shape[-1] else y.new_zeros(y.shape[:-1] + (1,))  # N = 0: empty rows
    s = fp8_scale(amax, out_dtype, scale_ub, ue8m0)
    return fp8_quantize(y, s, out_dtype), s, h


# The kernel's q is rounded and saturated by one cvt.rn.satfinite to e4m3 / e5m2, an sm_89 instruction
# (Triton compiles no float8_e4m3fn before it); older GPUs, AMD's and the CPU run the torch ops.
FP8_KERNEL_MIN_ARCH = (8, 9)


def kernel_refusal(mode: str | None, N: int, dev, tools) -> str | None:
    """None where an FP8 kernel may run for rows of N elements on `dev` under `mode`, else why the torch
    ops do (what both kernels need; `pick_kernel` then chooses between them)."""
    if not dispatch.fused_enabled():
        return f"the fused kernels are switched off ({dispatch.ENV_FUSED}=0)"
    if mode is not None and mode not in FP8_KERNELS:
        return f"mode {mode!r} has no FP8 kernel (Triton's and the CuTe DSL one are: 'triton', 'tma_smem_cached')"
    if N > FP8_KERNEL_MAX_N:
        return f"the FP8 kernels hold rows of up to {FP8_KERNEL_MAX_N} elements, N={N}"
    if dev.vendor == "cpu":  # Triton's interpreter converts to fp8 unlike the GPU (NaN became 384 in e4m3)
        return "off the GPU (Triton's interpreter does not convert to fp8 as the GPU does)"
    if dev.vendor != "nvidia":  # (AMD's fp8 conversions differ: not run there)
        return f"the FP8 kernels run on NVIDIA GPUs (sm_89 and newer), not on {dev.name}"
    if dev.arch < FP8_KERNEL_MIN_ARCH:
        return f"the FP8 kernels need sm_89 or newer (their saturating fp8 conversion), this GPU is {dev.arch_name}"
    if mode is not None:
        return dispatch.unavailable_reason(dispatch.MODES[mode], dev, tools)
    return None


def cute_wins(N: int, elem_bytes: int, group_size: int | None, model: str = "") -> bool:
    """mode=None's rule between the two FP8 kernels (see the module's docstring): the CuTe DSL kernel
    past 8 KiB rows (4096 16-bit columns), past 2048 columns wherever Triton's power-of-two block
    pads the row, and past 1024 where a 16-bit row fills at most 3/4 of it; Triton's elsewhere. On a GPU
    `model` whose CuTe DSL kernel takes its tiles through a ring (rmsnorm_fp8_config.RING_BY_MODEL: the
    H200), wherever Triton's block pads a 16-bit row of more than 512 columns. The same for every scale
    kind. With the ring (H200, bf16, 2^27 elements, medians of 3, `python bench/tune/cute_fp8.py --rings
    1x1,2x2 --ns 520,640,768,896,1152,1800,1960`, docs/performance.md 2.50), Triton against CuTe per token:
    520 0.615 / 0.886, 640 0.758 / 0.985, 768 0.865 / 0.972, 896 0.928 / 0.982, 1152 0.746 / 0.939, 1800
    0.789 / 0.960, 1960 0.837 / 0.976; groups 640 0.769 / 0.933, 768 0.878 / 0.975, 1152 0.712 / 0.856,
    and level at 896 (0.936 / 0.929). Rows of 512 columns and fewer, and fp32 rows, are not measured with
    the ring. Before it (bf16, 2^27 elements, ratio to a copy of the bytes, medians of 3;
    `python bench/residual.py --parts fp8 --modes triton,tma_smem_cached` and `python
    bench/tune/cute_fp8.py`, docs/performance.md 2.17, 2.44):
      * Triton's block holds the row in registers: past 4096 columns a thread's loads no longer keep
        enough bytes in flight on an H200 (8192 per token 0.877 against 0.964, groups 0.877 against
        0.946), and a padded block's idle lanes cost their share (10240 per token 0.566 against 0.946;
        H100 0.759 against 0.988), even an eighth of them (3584: H200 0.924 against 0.974).
      * At 2048 columns and below Triton's block is small and its rows many per program (H200 2048 per
        token 0.973 against 0.922, groups 0.970 against 0.898), and unpadded up to 4096 it stays ahead
        (4096 0.971 / 0.968 against 0.960 / 0.951).
      * Between 1024 and 2048 columns a padded block's idle lanes cost Triton about their share where
        they are many, and the CuTe kernel's 0.79-0.88 does not fall with them (H200 per token, Triton
        against CuTe: 1032 0.547 / 0.792, 1160 0.583 / 0.855, 1304 0.631 / 0.815, where the row fills
        50-64 % of the 2048 block; 1544 0.847 / 0.808 and 1664 0.916 / 0.859 at 75-81 %). 1800 (88 %)
        measured 0.785 / 0.884 and keeps Triton's: no rule of the fill separates it. At exactly 3/4
        (1536, the one such 16-bit width in 1025-2048; 2049-4096 pad by the rule above) the CuTe kernel
        tiles the row exactly (192 vectors) and leads: per token 0.918 against 0.889, groups 0.916
        against 0.865 (`python bench/tune/cute_fp8.py --ns 1536,1664`, 2.45), where 1544 (75.4 %, 193
        vectors) measured 0.808 against 0.847. fp32 rows of 1025-1535 were not measured and keep Triton's.
    """
    from .cute.rmsnorm_fp8_config import ring_applies
    from .triton.rmsnorm_fp8_config import launch_config

    block = launch_config(N, group_size)[0]
    if elem_bytes == 2 and N > 512 and block > N and ring_applies(N, elem_bytes, model):
        return True
    return N * elem_bytes > 8192 or (N > 2048 and block > N) or (elem_bytes == 2 and N > 1024 and 4 * N <= 3 * block)


def pick_kernel(mode: str | None, x2d: torch.Tensor, r2d: torch.Tensor | None, h_dtype: torch.dtype | None,
                group_size: int | None) -> tuple[str | None, str]:
    """(the FP8 kernel's mode, "triton" or "tma_smem_cached", or None for the torch ops; why)."""
    dev, tools = device_info(x2d.device), toolchain()
    why = kernel_refusal(mode, x2d.shape[1], dev, tools)
    if why is not None:
        return None, why
    if mode == "triton":
        return "triton", "named"
    wins = mode is None and cute_wins(x2d.shape[1], x2d.element_size(), group_size, gpu_model(dev.name))
    reason = "mode=None: Triton's kernel at this width (fp8.cute_wins)"
    if mode == "tma_smem_cached" or wins:  # (the CuTe DSL kernel's refusal, asked only where it would run)
        from .cute.rmsnorm_fp8 import unsupported

        cute_why = (dispatch.unavailable_reason(dispatch.MODES["tma_smem_cached"], dev, tools)
                    or unsupported(x2d, r2d, h_dtype, group_size, batch_invariant=mode is None))
        if cute_why is None:
            return "tma_smem_cached", ("named" if mode else "mode=None: the CuTe DSL kernel at this width "
                                                             "(fp8.cute_wins)")
        if mode:
            return None, cute_why
        reason = f"mode=None: Triton's kernel ({cute_why})"
    triton_why = dispatch.unavailable_reason(dispatch.MODES["triton"], dev, tools)
    return ("triton", reason) if triton_why is None else (None, triton_why)


def describe(x, mode: str | None, group_size: int | None = None, weight: torch.Tensor | None = None) -> str:
    """explain()'s line for rms_norm_fp8 on x (dynamic scales, `weight` the one it would get): the kernel
    and its launch, or the torch ops and why."""
    x2d = as_rows(x)
    which, why = pick_kernel(mode, x2d, None, None, group_size)
    scales = f"1 x {group_size} group scales" if group_size else "per-token scales"
    if which is None:
        return f"fp8 output: the torch ops ({why})"
    N = x2d.shape[1]
    if which == "triton":
        from .triton.rmsnorm_fp8_config import launch_config

        block, rows, warps = launch_config(N, group_size)
        how = f"{rows} row(s) x {block} columns in registers per program, {warps} warps"
    else:
        from .cute.rmsnorm_fp8 import launch_plan
        from .cute.rmsnorm_fp8_config import fp8_config, min_ctas

        kind = "group" if group_size else "token"
        cfg = fp8_config(N, x2d.element_size(), group_size)
        stages, per_cta, looped = launch_plan(x2d, weight, kind, cfg)
        loop = " in the tile loop" if looped and stages == 1 else ""
        ctas = min_ctas(cfg, kind, False)
        bound = f", registers bounded to {ctas} CTAs an SM" if ctas else ""
        how = (f"row tiles in shared memory by TMA bulk copies, {cfg.short()}, {per_cta} tile(s) a CTA through "
               f"{stages} slot(s){loop}{bound}")
    return f"fp8 output: {FP8_KERNELS[which]} ({scales}: {how}; {why})"


def _no_scales(x: torch.Tensor) -> torch.Tensor:
    """The op's scales output at a given scale: empty (rms_norm_fp8 returns the caller's scale itself)."""
    return x.new_empty(0, dtype=torch.float32)


@torch.library.custom_op("cutile_norms::rms_norm_fp8", mutates_args=())
@on_its_gpu
def _fp8_op(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor | None, eps: float, offset: float,
            mode: str, out_dtype: torch.dtype, h_dtype: torch.dtype, scale: torch.Tensor | None,
            scale_ub: float | None, group_size: int, ue8m0: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q, scales or an empty tensor at a given scale (the caller's tensor is returned: an op's output may
    not alias its input, and a copy cost a launch, 3 % of a 2^27-element call on an H200), h or an empty
    tensor without a residual)."""
    group = group_size or None
    x2d = as_rows(x) if x.numel() else None
    r2d = None if residual is None or x2d is None else as_rows(residual)
    which = None
    if x2d is not None:
        which = pick_kernel(mode or None, x2d, r2d, h_dtype if residual is not None else None, group)[0]
    if which is not None:
        q, s, h, _ = dispatch.load(FP8_KERNELS[which])(x2d, r2d, weight, eps, offset, out_dtype, h_dtype, scale,
                                                        scale_ub, group, ue8m0)
        lead = x.shape[:-1]
        s = _no_scales(x) if scale is not None else s.view(*lead, -1)
        return q.view(x.shape), s, h.view(x.shape) if h is not None else x.new_empty(0)
    q, s, h = _reference(x, residual, weight, eps, offset, out_dtype, h_dtype, scale, scale_ub, group, ue8m0)
    return (q.contiguous(), _no_scales(x) if scale is not None else s.contiguous(),
            h.contiguous() if h is not None else x.new_empty(0))


@_fp8_op.register_fake
def _fp8_fake(x, residual, weight, eps, offset, mode, out_dtype, h_dtype, scale, scale_ub, group_size, ue8m0):
    lead = x.shape[:-1]
    s = (_no_scales(x) if scale is not None else
         x.new_empty(*lead, x.shape[-1] // group_size if group_size else 1, dtype=torch.float32))
    return (x.new_empty(x.shape, dtype=out_dtype), s,
            x.new_empty(x.shape, dtype=h_dtype) if residual is not None else x.new_empty(0))


def rms_norm_fp8(x: torch.Tensor, weight: torch.Tensor | None = None, eps: float | None = 1e-6, *,
                 out_dtype: torch.dtype = torch.float8_e4m3fn, scale=None, scale_ub: float | None = None,
                 group_size: int | None = None, scale_ue8m0: bool = False, scale_layout: str = "row",
                 residual: torch.Tensor | None = None, residual_dtype: torch.dtype | None = None,
                 offset: float = 0.0, mode: str | None = None):
    """(q, scales), or (q, scales, h) with a residual. See the module docstring."""
    if eps is None:
        eps = TORCH_DEFAULT_EPS
    validate(x, weight, eps, offset)
    _validate_fp8(x, out_dtype, scale, scale_ub, group_size, scale_ue8m0)
    if scale_layout not in ("row", "column"):
        raise ValueError(f"scale_layout must be 'row' or 'column', got {scale_layout!r}")
    if scale_layout == "column" and scale is not None:
        raise ValueError("scale_layout is for dynamic scales; a given scale is one element")
    if residual is not None or residual_dtype is not None:
        if residual is None:
            raise ValueError("residual_dtype is the dtype of h = x + residual; it needs a residual")
        validate_residual(x, residual, residual_dtype)
    dispatch.check_mode_name(mode)
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, weight, residual)):
        raise RuntimeError("rms_norm_fp8 is not differentiable (an FP8 output for the next GEMM); call it under "
                           "torch.no_grad() or on tensors that do not require grad")
    if scale is not None:  # one element, as shape (1,): broadcasts against q whatever x's dims; a number by a
        # fill kernel (torch.tensor([s], device=...) copies from pageable host memory and stalls the stream:
        # a call took 2-4x its time on an H200)
        scale = (scale.reshape(1) if isinstance(scale, torch.Tensor) else
                 torch.full((1,), float(scale), dtype=torch.float32, device=x.device))
    q, s, h = torch.ops.cutile_norms.rms_norm_fp8(x, residual, weight, float(eps), float(offset), mode or "",
                                                  out_dtype, residual_dtype or x.dtype, scale,
                                                  None if scale_ub is None else float(scale_ub), group_size or 0,
                                                  bool(scale_ue8m0))
    if scale is not None:  # the given scale itself, (1,) (replicated over x's mesh where x is a DTensor)
        s = replicated_like(scale, x)
    if scale_layout == "column":  # the same values with the rows' dim at stride 1 (a transposed copy)
        lead, cols = s.shape[:-1], s.shape[-1]
        s = s.reshape(-1, cols).t().contiguous().t().view(*lead, cols)
    return (q, s) if residual is None else (q, s, h)
