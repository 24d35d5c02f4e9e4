"""tma_smem_cached's backward: the CuTe DSL kernel's compile cache, launch and backend.

The kernel is in rmsnorm_bwd_kernel.py, its configs and heuristic in rmsnorm_bwd_config.py. Compiled
with `cute.compile` over fake tensors (M and the row strides symbolic), cached in process by (dtypes,
N, config, flags), called through TVM-FFI on torch's current stream.

Which widths and dtypes it runs is decided in dispatch.py (cute_backward_refusal). What it takes
(`unsupported` says why not; the backend then runs the cuTile persistent backward, which takes
everything): rows of x and dy whose starts are 16-byte aligned (N and both row strides multiples
of 16 bytes / element size, the data 16-byte aligned), and rows a ring of two slices per CTA of at most
CLUSTER_MAX CTAs holds (`analytic_config` is None past that: bf16 from N = 458760, fp32 from 229380,
and at the six exact widths of 648-832 KiB rows below those whose exact slices the ring does not hold).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from .._platform import DeviceInfo
from .._workspace import current_raw_stream, grad_outputs, workspace
from .rmsnorm_bwd_config import BwdConfig, analytic_config, device_config, reduction_shape
from .compile import CompileCache, compile_options, cutlass_dtype


# ================================================================================================
# Compile cache
# ================================================================================================
CACHE = CompileCache()


def compile_backward(x_dtype: torch.dtype, w_dtype: torch.dtype | None, N: int, cfg: BwdConfig, need_dx: bool,
                     need_dw: bool, arch: str | None = None, keep_ptx: bool = False, has_offset: bool = True,
                     has_dh: bool = False, reduction: tuple[int, int] | None = None):
    """The compiled backward for these compile-time parameters (cached). `arch` ("sm_90a", "sm_100a")
    compiles for that target without a GPU; `keep_ptx`: the result's `__ptx__` holds the PTX;
    `has_offset` False: a variant that takes offset as 0; `has_dh`: dh read and added to dx (a config
    of 3 streams); `reduction`: dw's reducers' (column tiles a round, partial rows at once) instead of
    rmsnorm_bwd_config.reduction_shape's (probes)."""
    key = (x_dtype, w_dtype, N, cfg, need_dx, need_dw, arch, keep_ptx, has_offset, has_dh, reduction)
    return CACHE.get(key, lambda: _build_backward(x_dtype, w_dtype, N, cfg, need_dx, need_dw, arch, keep_ptx,
                                                  has_offset, has_dh, reduction), arch=arch, persist=not keep_ptx)


def _build_backward(x_dtype, w_dtype, N, cfg, need_dx, need_dw, arch, keep_ptx, has_offset, has_dh,
                    reduction=None):
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_stream, make_fake_tensor

    from .rmsnorm_bwd_kernel import RMSNormBwdTmaSmem

    dx = cutlass_dtype(x_dtype)
    dw = cutlass_dtype(w_dtype) if w_dtype is not None else dx
    vec = 16 // x_dtype.itemsize
    M = cute.sym_int64(symbol="M")

    def rows(stride_symbol):  # [M, N] in x's dtype, 16-byte aligned rows at a symbolic row stride
        return make_fake_tensor(dx, (M, N), stride=(cute.sym_int64(divisibility=vec, symbol=stride_symbol), 1),
                                assumed_align=16)

    mX, mDY, mDH, mDX = rows("x_stride"), rows("dy_stride"), rows("dh_stride"), rows("dx_stride")
    mW = make_fake_tensor(dw, (N,), stride=(1,), assumed_align=16)
    mDW = make_fake_tensor(dw, (N,), stride=(1,), assumed_align=16)
    mR = make_fake_tensor(cutlass.Float32, (M,), stride=(1,), assumed_align=4)
    mP = make_fake_tensor(cutlass.Float32, (cute.sym_int64(symbol="clusters"), N), stride=(N, 1), assumed_align=16)
    mT = make_fake_tensor(cutlass.Int32, (16,), stride=(1,), assumed_align=16)
    kernel = RMSNormBwdTmaSmem(dx, dw, N, cfg, w_dtype is not None, need_dx, need_dw, has_offset, has_dh, reduction)
    fn = cute.compile(kernel, mX, mDY, mDH, mW, mR, mDX, mDW, mP, mT, cutlass.Float32(0.0), cutlass.Int32(1),
                      cutlass.Int32(1), make_fake_stream(use_tvm_ffi_env_stream=True),
                      options=compile_options(arch, keep_ptx))
    return fn


# ================================================================================================
# What the kernel takes
# ================================================================================================
def unsupported(x2d: torch.Tensor, dy2d: torch.Tensor, dh2d: torch.Tensor | None = None) -> str | None:
    """None when the kernel takes these rows (and dh's, the residual add's backward), else why not."""
    M, N = x2d.shape
    eb = x2d.element_size()
    vec = 16 // eb
    rows = (x2d, dy2d) if dh2d is None else (x2d, dy2d, dh2d)
    if N % vec:
        return f"N={N} is not a multiple of {vec} (16-byte bulk copies)"
    if M > 1 and any(t.stride(0) % vec for t in rows):
        return (f"row strides {', '.join(str(t.stride(0)) for t in rows)} are not all multiples of {vec} "
                f"elements (16 bytes)")
    if any(t.data_ptr() % 16 for t in rows):
        return "x, dy or dh does not start 16-byte aligned"
    if analytic_config(N, eb, streams=len(rows)) is None:
        return f"N={N} is too long for a ring of two slices per CTA of its {len(rows)} rows"
    return None


# ================================================================================================
# Launch
# ================================================================================================
@functools.lru_cache(maxsize=None)
def max_clusters(device_index: int, cluster_n: int, sm_count: int) -> int:
    """Clusters of `cluster_n` CTAs that run at once with one CTA per SM (the occupancy API: a cluster
    needs `cluster_n` free SMs of one GPC, so an H100's 132 SMs hold 15 clusters of 8 and 7 of 16, not
    16 and 8). A grid of more clusters runs the extra ones after the others: ~0.68 x copy instead of
    0.94 at N = 65536 (fp16, H100). The query runs on the device's primary context made current on
    this thread (autograd's backward thread has none: CUDA_ERROR_INVALID_CONTEXT); if it fails, one
    cluster fewer than SMs / cluster_n."""
    try:
        from cuda.bindings import driver
        from cutlass.utils import HardwareInfo

        torch.cuda.init()
        err, dev = driver.cuDeviceGet(device_index)
        if err == driver.CUresult.CUDA_SUCCESS:
            err, ctx = driver.cuDevicePrimaryCtxRetain(dev)
        if err == driver.CUresult.CUDA_SUCCESS:
            err, = driver.cuCtxSetCurrent(ctx)
        if err != driver.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"no CUDA context for device {device_index}: {err}")
        return max(1, HardwareInfo(device_index).get_max_active_clusters(cluster_n))
    except Exception:  # noqa: BLE001 - the query is an optimisation; the fallback is safe
        return max(1, sm_count // cluster_n - (1 if cluster_n > 1 else 0))


def launch(cfg: BwdConfig, dy2d: torch.Tensor, x2d: torch.Tensor, weight: torch.Tensor | None,
           rstd: torch.Tensor, offset: float, need_dx: bool, need_dw: bool, sm_count: int,
           out: tuple | None = None, reducers: int | None = None, dh2d: torch.Tensor | None = None,
           reduction: tuple[int, int] | None = None):
    """(dx [M, N] contiguous in x's dtype or None, dw [N] in the weight's dtype or None) for rows
    `unsupported` accepts, M >= 1; rstd [M] fp32 contiguous. `out`: (dx, dw) to write into.
    `reducers`: the CTAs that sum dw's partials (probes; default: the heuristic below). `dh2d`: rows
    in x's dtype added to dx (cfg of 3 streams), or None. `reduction`: compile_backward's (probes)."""
    M, N = x2d.shape
    device = x2d.device
    has_w = weight is not None
    need_dw = need_dw and has_w
    has_dh = dh2d is not None and need_dx
    if M == 1:  # one row: any stride is as good as N (the kernel reads one row)
        x2d = x2d.as_strided((1, N), (N, 1))
        dy2d = dy2d.as_strided((1, N), (N, 1))
        dh2d = dh2d.as_strided((1, N), (N, 1)) if has_dh else None
    if has_w and weight.data_ptr() % 16:
        weight = weight.clone()
    dx, dw = grad_outputs(x2d, weight, need_dx, need_dw, out)
    clusters = min(M, max_clusters(device.index, cfg.cluster_n, sm_count))
    stream = current_raw_stream(device.index)
    part = workspace("cute_bwd_partials", (clusters if need_dw else 1) * N, torch.float32, device, stream, zero=False)
    tickets = workspace("cute_bwd_tickets", 16, torch.int32, device, stream, zero=True)
    fn = compile_backward(x2d.dtype, weight.dtype if has_w else None, N, cfg, need_dx, need_dw,
                          has_offset=has_w and offset != 0.0, has_dh=has_dh, reduction=reduction)
    w_arg = weight if has_w else x2d[0]
    ctas = clusters * cfg.cluster_n
    rounds = (reduction or reduction_shape(has_dh))[0]
    reducers = min(ctas, reducers or min(max(1, sm_count // 2), -(-N // (4 * cfg.threads * rounds))))
    fn(x2d, dy2d, dh2d if has_dh else dy2d, w_arg, rstd, dx if need_dx else x2d, dw if need_dw else w_arg,
       part[:(clusters if need_dw else 1) * N].view(-1, N), tickets, offset, clusters, reducers)
    return dx, dw


# ================================================================================================
# The backend
# ================================================================================================
@dataclass(frozen=True)
class TmaSmemBackward:
    """tma_smem_cached's backward: the CuTe DSL kernel. Which rows it gets is decided in
    dispatch.cute_backward_refusal (the cuTile persistent backward runs the others); here only a call's
    tensors can send it there: rows `unsupported` refuses (alignment, strides), M = 0."""

    adds_dh = True  # dh (the residual add's backward) comes into a third ring and is added in the kernel

    def config(self, N: int, dtype: torch.dtype, dev: DeviceInfo | None = None, w_dtype=None,
               has_dh: bool = False) -> BwdConfig | None:
        return device_config(N, dtype.itemsize, dev, streams=3 if has_dh else 2)

    def describe(self, M: int, N: int, dtype: torch.dtype, dev: DeviceInfo, w_dtype: torch.dtype | None = None,
                 has_dh: bool = False) -> str:
        cfg = self.config(N, dtype, dev, has_dh=has_dh)
        if cfg is None:
            return f"CuTe DSL RMSNormBwdTmaSmem: none (N={N} too long)"
        clusters = min(M, max_clusters(dev.index, cfg.cluster_n, dev.sm_count)) if dev.index is not None else "C"
        return (f"CuTe DSL RMSNormBwdTmaSmem (persistent), grid {clusters} clusters x {cfg.cluster_n} CTAs, "
                f"{cfg.short()}; config: analytic (N, dtype; the ring's slots by GPU model)")

    def backward(self, dy2d, x2d, weight, rstd, offset, need_dx, need_dw, dev: DeviceInfo,
                 cfg: BwdConfig | None = None, out: tuple | None = None, dh2d=None):
        """`cfg`: run the CuTe kernel with it (tests, probes)."""
        M, N = x2d.shape
        dh2d = dh2d if need_dx else None
        if M == 0 or unsupported(x2d, dy2d, dh2d) is not None:
            from ..cutile.rmsnorm_bwd import PERSISTENT_BACKWARD
            return PERSISTENT_BACKWARD.backward(dy2d, x2d, weight, rstd, offset, need_dx, need_dw, dev, out=out,
                                                dh2d=dh2d)
        return launch(cfg or self.config(N, x2d.dtype, dev, has_dh=dh2d is not None), dy2d, x2d, weight, rstd,
                      offset, need_dx, need_dw, dev.sm_count, out, dh2d=dh2d)


TMA_SMEM_BACKWARD = TmaSmemBackward()
