"""mode="tma_smem_cached": the CuTe DSL forward's compile cache, launch and backend.

The kernel is in rmsnorm_fwd_kernel.py, its configs and heuristic in rmsnorm_fwd_config.py. Kernels
are compiled with `cute.compile` over fake tensors (M and x's row stride symbolic: no recompile when
only M changes), cached in process by (dtypes, N, config, flags), and called through TVM-FFI with
torch tensors on torch's current stream.

What the mode takes (`unsupported` says why not, the API layer raises it and mode=None does not pick
the mode there): rows whose starts are 16-byte aligned, i.e. N and x's row stride multiples of
16 bytes / element size and x's data 16-byte aligned, since the TMA engine's bulk copies move 16-byte
multiples between 16-byte-aligned addresses; N up to what CLUSTER_MAX CTAs' shared memory holds; and
fewer than 2^31 rows (32-bit row indices).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .._platform import DeviceInfo
from .compile import CompileCache, aligned_weight, compile_options, cutlass_dtype, placeholder_f32
from .rmsnorm_fwd_config import CLUSTER_MAX, FwdConfig, analytic_config

# ================================================================================================
# Compile cache
# ================================================================================================
CACHE = CompileCache()


def compile_forward(x_dtype: torch.dtype, w_dtype: torch.dtype | None, N: int, cfg: FwdConfig,
                    store_rstd: bool, contiguous: bool, arch: str | None = None, keep_ptx: bool = False,
                    has_residual: bool = False):
    """The compiled forward for these compile-time parameters (cached). `arch` ("sm_90a", "sm_100a")
    compiles for that target without a GPU; None: the current GPU's. `keep_ptx`:
    the result's `__ptx__` holds the PTX (the compile tests read it). `has_residual`: the fused add
    (add_rmsnorm_fwd.py), called fn(x, r, w, y, h, rstd, eps, offset); without it fn(x, w, y, rstd,
    eps, offset)."""
    key = (x_dtype, w_dtype, N, cfg, store_rstd, contiguous, arch, keep_ptx) + (("residual",) if has_residual else ())
    return CACHE.get(key, lambda: _build_forward(x_dtype, w_dtype, N, cfg, store_rstd, contiguous, arch, keep_ptx,
                                                 has_residual), arch=arch, persist=not keep_ptx)


def _build_forward(x_dtype, w_dtype, N, cfg, store_rstd, contiguous, arch, keep_ptx, has_residual):
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_stream, make_fake_tensor

    from .add_rmsnorm_fwd_kernel import AddRMSNormFwdTmaSmem
    from .rmsnorm_fwd_kernel import RMSNormFwdTmaSmem

    dx = cutlass_dtype(x_dtype)
    dw = cutlass_dtype(w_dtype) if w_dtype is not None else dx
    vec = 16 // x_dtype.itemsize
    M = cute.sym_int64(symbol="M")
    S = cute.sym_int64(divisibility=vec, symbol="row_stride")
    R = M if store_rstd else cute.sym_int64(symbol="rstd_len")
    mX = make_fake_tensor(dx, (M, N), stride=(N if contiguous else S, 1), assumed_align=16)

    def out_rows(name):
        # y's (h's) row stride (N at run time) is a symbolic int64: with the constant N the row offset was
        # a 32-bit element index, which wraps past 2^32 elements and wrote late rows over early ones
        return make_fake_tensor(dx, (M, N), stride=(cute.sym_int64(divisibility=vec, symbol=name), 1), assumed_align=16)

    mY = out_rows("y_stride")
    mW = make_fake_tensor(dw, (N,), stride=(1,), assumed_align=16)
    mRstd = make_fake_tensor(cutlass.Float32, (R,), stride=(1,), assumed_align=4)
    # with a residual: r at its own row stride (rows contiguous only when x's and r's both are), h as y
    mR = make_fake_tensor(dx, (M, N), stride=(N if contiguous else cute.sym_int64(divisibility=vec, symbol="r_stride"), 1),
                          assumed_align=16)
    mH = out_rows("h_stride")
    kernel = (AddRMSNormFwdTmaSmem if has_residual else RMSNormFwdTmaSmem)(dx, dw, N, cfg, w_dtype is not None,
                                                                            store_rstd, contiguous)
    tensors = (mX, mR, mW, mY, mH, mRstd) if has_residual else (mX, mW, mY, mRstd)
    return cute.compile(kernel, *tensors, cutlass.Float32(1e-6), cutlass.Float32(0.0),
                        make_fake_stream(use_tvm_ffi_env_stream=True), options=compile_options(arch, keep_ptx))


# ================================================================================================
# What the mode takes
# ================================================================================================
def unsupported(N: int, dtype: torch.dtype, row_stride: int, M: int, data_ptr: int,
                batch_invariant: bool = False) -> str | None:
    """None when the mode takes rows of N `dtype` elements at `row_stride` starting at `data_ptr`,
    else why not (the bulk copies' 16-byte rule, or N too long). `batch_invariant` (mode=None): the row
    stride is judged for one row too, as the batch it comes from is."""
    eb = dtype.itemsize
    vec = 16 // eb
    if N % vec:
        return (f"tma_smem_cached moves rows with 16-byte bulk copies: N must be a multiple of {vec} for "
                f"{str(dtype).removeprefix('torch.')}, got N={N}")
    if (M > 1 or batch_invariant) and row_stride % vec:
        return (f"tma_smem_cached needs x's row stride to be a multiple of {vec} elements (16 bytes), "
                f"got {row_stride}")
    if data_ptr % 16:
        return "tma_smem_cached needs x's data 16-byte aligned (a view starting mid-row is not)"
    if M >= 2 ** 31:  # row indices are 32-bit in the kernel (rows this many are at most a few vectors long)
        return f"tma_smem_cached takes fewer than 2^31 rows, got M={M}"
    if analytic_config(N, eb) is None:
        return (f"tma_smem_cached keeps a row in the shared memory of at most {CLUSTER_MAX} CTAs: "
                f"N={N} is too long")
    return None


# ================================================================================================
# Launch
# ================================================================================================
def launch(cfg: FwdConfig, x2d: torch.Tensor, weight: torch.Tensor | None, eps: float, offset: float,
           store_rstd: bool, out: tuple | None = None, out_shape=None):
    """(y contiguous in x's dtype, [M, N] or `out_shape`; rstd [M] fp32 or None) for a 2-D x with unit
    column stride that `unsupported` accepts, M >= 1. The API layer has validated everything.
    `out`: (y, rstd) to write into."""
    M, N = x2d.shape
    run = _runner(cfg, N, M == 1 or x2d.stride(0) == N, x2d.dtype, None if weight is None else weight.dtype,
                  store_rstd, x2d.device)
    return run(x2d, weight, eps, offset, out_shape, out)


def _runner(cfg: FwdConfig, N: int, contiguous: bool, dtype: torch.dtype, w_dtype: torch.dtype | None,
            store_rstd: bool, device: torch.device):
    """run(x2d, weight, eps, offset, out_shape=None, out=None) -> (y, rstd or None) with the compiled
    kernel and the rstd placeholder resolved once (`launch` per call, the backend's `launcher` per call
    signature)."""
    fn = compile_forward(dtype, w_dtype, N, cfg, store_rstd, contiguous)
    dummy = None if store_rstd else placeholder_f32(device)

    def run(x2d, weight, eps, offset, out_shape=None, out=None):
        if x2d.dim() != 2:  # a contiguous x of out_shape (backends.Runner): TVM-FFI takes the rows as 2-D
            x2d = x2d.view(-1, N)
        M = x2d.shape[0]
        if contiguous and x2d.stride(0) != N:  # one row: its stride is any number, the kernel wants N
            x2d = x2d.as_strided((M, N), (N, 1))
        weight = aligned_weight(weight)
        if out is not None:
            y, rstd = out
            y2d = y if y.dim() == 2 else y.view(M, N)
        else:
            # rows of N at stride N: empty_like gives them contiguous, for half the host time of
            # torch.empty with keywords (0.85 against 1.7 us on the CPU host; a call at M = 1 is ~16 us)
            y2d = torch.empty_like(x2d) if contiguous else torch.empty((M, N), dtype=dtype, device=device)
            y = y2d if out_shape is None else y2d.view(out_shape)
            rstd = torch.empty(M, dtype=torch.float32, device=device) if store_rstd else None
        fn(x2d, weight if weight is not None else y2d[0], y2d, rstd if store_rstd else dummy, eps, offset)
        return y, rstd

    return run


# ================================================================================================
# The backend
# ================================================================================================
@dataclass(frozen=True)
class TmaSmemCachedForward:
    mode: str = "tma_smem_cached"
    takes_every_row = False  # rows must start 16-byte aligned (the bulk copies' rule): `unsupported`

    def config(self, N: int, dtype: torch.dtype, dev: DeviceInfo | None = None) -> FwdConfig | None:
        return analytic_config(N, dtype.itemsize)

    def unsupported(self, x2d: torch.Tensor, batch_invariant: bool = False) -> str | None:
        """Why not these rows (None: taken). `batch_invariant` (mode=None): one row is judged by its
        tensor's row stride too, as the batch it comes from is, so a row runs the same kernel (and
        gives the same bits) alone and in its batch; asked for by name, one row at any stride runs."""
        M, N = x2d.shape
        return unsupported(N, x2d.dtype, x2d.stride(0), M, x2d.data_ptr(), batch_invariant)

    def describe(self, M: int, N: int, dtype: torch.dtype, dev: DeviceInfo) -> str:
        cfg = self.config(N, dtype, dev)
        if cfg is None:
            return f"CuTe DSL RMSNormFwdTmaSmem: none (N={N} too long)"
        tiles = -(-M // cfg.rows)
        return (f"CuTe DSL RMSNormFwdTmaSmem, grid ({tiles * cfg.cluster_n},), {cfg.short()}; "
                f"config: analytic (N, dtype)")

    def forward(self, x2d, weight, eps, offset, store_rstd, dev: DeviceInfo, cfg: FwdConfig | None = None,
                out: tuple | None = None, out_shape=None):
        """x2d as `unsupported` accepts it: the API layer checked that once per call signature
        (rmsnorm.plan) and raises or routes around it there."""
        cfg = cfg or self.config(x2d.shape[1], x2d.dtype, dev)
        return launch(cfg, x2d, weight, eps, offset, store_rstd, out, out_shape)

    def launcher(self, M: int, N: int, stride: int, dtype: torch.dtype, w_dtype: torch.dtype | None,
                 store_rstd: bool, dev: DeviceInfo):
        """run(x2d, weight, eps, offset, out_shape) -> (y, rstd or None) for one call signature (M rows
        at row `stride`, as `unsupported` accepts them): the config, the compiled kernel and the rstd
        placeholder resolved once, so that a call allocates y and launches (at M <= 64 a call is host
        bound: this path is what a decode step pays per norm)."""
        return _runner(self.config(N, dtype, dev), N, M == 1 or stride == N, dtype, w_dtype, store_rstd,
                       torch.device("cuda", dev.index))


TMA_SMEM_CACHED = TmaSmemCachedForward()
