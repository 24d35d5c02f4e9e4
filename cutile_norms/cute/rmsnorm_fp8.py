"""RMSNorm with an FP8 output in CuTe DSL: the compile cache and the launch (the kernel in
rmsnorm_fp8_kernel.py, its config in rmsnorm_fp8_config.py). The same call as the Triton kernel's
(triton/rmsnorm_fp8.py), for the rows `unsupported` accepts; fp8.py picks between them."""
from __future__ import annotations

import torch

from .._platform import device_info, gpu_model
from ..fp8 import kernel_outputs
from ..reference import FP8_MAX, FP8_MIN_AMAX
from .compile import CompileCache, aligned_weight, compile_options, cutlass_dtype, placeholder_f32
from .rmsnorm_fp8_config import fp8_config, min_ctas, refusal, ring
from .rmsnorm_fwd_config import FwdConfig

CACHE = CompileCache()


def compile_fp8(x_dtype: torch.dtype, w_dtype: torch.dtype | None, N: int, cfg: FwdConfig, out_dtype: torch.dtype,
                kind: str, group: int, has_ub: bool, ue8m0: bool, has_residual: bool, store_rstd: bool,
                contiguous: bool, arch: str | None = None, keep_ptx: bool = False, stages: int = 1,
                looped: bool = False, has_offset: bool = True):
    """The compiled kernel for these compile-time parameters (cached; M and the row strides symbolic).
    kind: "static", "token" or "group"; `arch` ("sm_90a", "sm_100a") compiles without a GPU;
    `has_offset`: False where the offset is 0 (the weight multiplies as it is)."""
    key = ("fp8", x_dtype, w_dtype, N, cfg, out_dtype, kind, group, has_ub, ue8m0, has_residual, store_rstd,
           contiguous, stages, looped, has_offset, arch, keep_ptx)
    return CACHE.get(key, lambda: _build(*key[1:]), arch=arch, persist=not keep_ptx)


def _build(x_dtype, w_dtype, N, cfg, out_dtype, kind, group, has_ub, ue8m0, has_residual, store_rstd, contiguous,
           stages, looped, has_offset, arch, keep_ptx):
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_stream, make_fake_tensor

    from .rmsnorm_fp8_kernel import RMSNormFp8TmaSmem

    dx = cutlass_dtype(x_dtype)
    dw = cutlass_dtype(w_dtype) if w_dtype is not None else dx
    vec = 16 // x_dtype.itemsize
    M = cute.sym_int64(symbol="M")

    def rows(name):  # x and r: rows of N, contiguous or at a symbolic stride (a multiple of 16 bytes)
        stride = N if contiguous else cute.sym_int64(divisibility=vec, symbol=name)
        return make_fake_tensor(dx, (M, N), stride=(stride, 1), assumed_align=16)

    mX, mR = rows("x_stride"), rows("r_stride")
    # h's row stride (N at run time) a symbolic int64: the row offset must not be a 32-bit index
    mH = make_fake_tensor(dx, (M, N), stride=(cute.sym_int64(divisibility=vec, symbol="h_stride"), 1),
                          assumed_align=16)
    mQ = make_fake_tensor(cutlass.Uint8, (cute.sym_int64(symbol="q_len"),), stride=(1,), assumed_align=16)
    mW = make_fake_tensor(dw, (N,), stride=(1,), assumed_align=16)
    mS = make_fake_tensor(cutlass.Float32, (cute.sym_int64(symbol="s_len"),), stride=(1,), assumed_align=4)
    mScale = make_fake_tensor(cutlass.Float32, (1,), stride=(1,), assumed_align=4)
    mRstd = make_fake_tensor(cutlass.Float32, (cute.sym_int64(symbol="rstd_len"),), stride=(1,), assumed_align=4)
    kernel = RMSNormFp8TmaSmem(dx, dw, N, cfg, kind, group, out_dtype == torch.float8_e4m3fn, FP8_MAX[out_dtype],
                               FP8_MIN_AMAX, has_ub, ue8m0, w_dtype is not None, has_residual, store_rstd, contiguous,
                               stages, looped, has_offset, min_ctas(cfg, kind, has_residual))
    return cute.compile(kernel, mX, mR, mW, mQ, mH, mS, mScale, mRstd, cutlass.Float32(1e-6), cutlass.Float32(0.0),
                        cutlass.Float32(0.0), cutlass.Int32(1), make_fake_stream(use_tvm_ffi_env_stream=True),
                        options=compile_options(arch, keep_ptx))


def launch_plan(x2d: torch.Tensor, weight: torch.Tensor | None, kind: str, cfg: FwdConfig) -> tuple[int, int, bool]:
    """(shared-memory slots, tiles a CTA, whether one slot runs through the tile loop) for these rows on x's
    GPU: rmsnorm_fp8_config.ring's, for scales of `kind` ("static", "token" or "group")."""
    M, N = x2d.shape
    dev = device_info(x2d.device)
    w_bytes = weight.element_size() if weight is not None else x2d.element_size()
    return ring(N, x2d.element_size(), w_bytes, kind, -(-M // cfg.rows), dev.sm_count, gpu_model(dev.name))


def unsupported(x2d: torch.Tensor, r2d: torch.Tensor | None, h_dtype: torch.dtype | None,
                group_size: int | None, batch_invariant: bool = False) -> str | None:
    """None where this kernel takes the call, else why not (fp8.py then runs Triton's). `batch_invariant`
    (mode=None): one row is judged by its tensors' row strides too, as its batch is."""
    M, N = x2d.shape
    strided = M > 1 or batch_invariant  # whether the row stride is judged
    if x2d.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return f"the CuTe DSL FP8 kernel reads fp16, bf16 or fp32 rows, not {x2d.dtype}"
    why = refusal(N, x2d.element_size(), group_size)
    if why:
        return why
    if M >= 2 ** 31:  # (row indices are 32-bit in the kernel; such narrow rows run Triton's kernel)
        return f"the CuTe DSL FP8 kernel takes fewer than 2^31 rows, got M={M}"
    vec = 16 // x2d.element_size()
    for name, t in (("x", x2d), ("the residual", r2d)):
        if t is None:
            continue
        if t.data_ptr() % 16 or (strided and t.stride(0) % vec):
            return f"the CuTe DSL FP8 kernel needs {name}'s rows 16-byte aligned"
    if r2d is not None and (r2d.dtype != x2d.dtype or h_dtype != x2d.dtype):
        return "the CuTe DSL FP8 kernel adds a residual of x's dtype into h of x's dtype"
    if r2d is not None and strided and (r2d.stride(0) == N) != (x2d.stride(0) == N):
        return "the CuTe DSL FP8 kernel reads x and the residual both contiguous or both strided"
    return None


def rms_norm_fp8(x2d: torch.Tensor, r2d: torch.Tensor | None, weight: torch.Tensor | None, eps: float,
                 offset: float, out_dtype: torch.dtype, h_dtype: torch.dtype | None, scale: torch.Tensor | None,
                 scale_ub: float | None, group_size: int | None, ue8m0: bool, cfg: FwdConfig | None = None,
                 stages: int | None = None, per_cta: int | None = None, looped: bool = False):
    """(q [M, N] out_dtype, scales, h [M, N] or None, rstd [M] fp32) for rows `unsupported` accepts,
    M >= 1, N a multiple of group_size (the API validates). scales: `scale` itself (per tensor), [M]
    (per row) or [M, N / group_size] row-major fp32. `cfg`: the launch (default:
    fp8_config's), `stages`, `per_cta` and `looped`: the ring of slots, the tiles a CTA takes and whether
    one slot runs through the tile loop (default, with stages None: rmsnorm_fp8_config.ring's); all four
    for the tuning sweep and the tests."""
    M, N = x2d.shape
    device = x2d.device
    cfg = cfg or fp8_config(N, x2d.element_size(), group_size)
    kind = "static" if scale is not None else "group" if group_size else "token"
    if stages is None:
        stages, per_cta, looped = launch_plan(x2d, weight, kind, cfg)
    per_cta = (per_cta or 1) if stages > 1 else 1  # one slot: one tile a CTA (none would be in flight ahead)
    contiguous = M == 1 or (x2d.stride(0) == N and (r2d is None or r2d.stride(0) == N))
    fn = compile_fp8(x2d.dtype, None if weight is None else weight.dtype, N, cfg, out_dtype, kind, group_size or 0,
                     scale_ub is not None, ue8m0, r2d is not None, True, contiguous,
                     stages=stages, looped=looped, has_offset=bool(offset != 0))
    if contiguous and x2d.stride(0) != N:  # one row: any stride, the kernel wants N
        x2d = x2d.as_strided((M, N), (N, 1))
    if r2d is not None and contiguous and r2d.stride(0) != N:
        r2d = r2d.as_strided((M, N), (N, 1))
    weight = aligned_weight(weight)
    q, scales, h, rstd = kernel_outputs(M, N, out_dtype, x2d.dtype if r2d is not None else None, scale, group_size,
                                        device)
    spare = placeholder_f32(device)  # the scales' operands a per-tensor or dynamic call does not use
    s_out, s_in = (spare, scale) if scale is not None else (scales.view(-1), spare[:1])
    fn(x2d, r2d if r2d is not None else x2d, weight if weight is not None else x2d[0], q.view(-1).view(torch.uint8),
       h if h is not None else x2d, s_out, s_in, rstd, eps, offset, float(scale_ub) if scale_ub is not None else 0.0,
       per_cta)
    return q, scales, h, rstd
