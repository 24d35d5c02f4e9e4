"""RMSNorm backward in Triton: the launch wrapper and the backend (the kernels in rmsnorm_bwd_kernel.py,
their configs in rmsnorm_bwd_config.py)."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from triton.tools.tensor_descriptor import TensorDescriptor

from .._platform import DeviceInfo
from .._workspace import grad_outputs, workspace
from ._common import INTERPRET, raw_stream, resident_programs, shared_per_block, slot_count
from .rmsnorm_bwd_config import (REDUCE_COLS, BwdConfig, analytic_config, grid_groups, tma_config, tma_rows_align,
                                 tma_rows_config, tma_rows_rule)
from .rmsnorm_bwd_kernel import (TMA_ROWS_KERNELS, dw_reduce_kernel, rms_norm_bwd_kernel,
                                 rms_norm_bwd_tma_kernel, rms_norm_bwd_tma_rows2_dh_kernel,
                                 rms_norm_bwd_tma_rows2_kernel, rms_norm_bwd_tma_rows_dh_kernel,
                                 rms_norm_bwd_tma_rows_kernel)
from .tiling import needs_int64, offset_align, tma_addressable


# ================================================================================================
# Launch
# ================================================================================================
def has_tma(dev: DeviceInfo) -> bool:
    """The device has TMA (NVIDIA sm_90+), or Triton is interpreted."""
    return INTERPRET or (dev.vendor == "nvidia" and dev.arch is not None and dev.arch >= (9, 0))


def tma_applies(cfg: BwdConfig, x2d: torch.Tensor, dy2d: torch.Tensor, sx: int, sdy: int, need_dx: bool,
                tma_capable: bool) -> bool:
    """Whether `rms_norm_bwd_tma_kernel` runs: `tma_config`, on a GPU with TMA (or the interpreter),
    for rows that TMA can address (16-byte aligned starts and row strides, no zero stride)."""
    return tma_capable and need_dx and tma_config(cfg, x2d.shape[1]) and tma_addressable((x2d, sx), (dy2d, sdy))


def tma_rows_applies(cfg: BwdConfig, x2d: torch.Tensor, dy2d: torch.Tensor, dx: torch.Tensor | None, sx: int,
                     sdy: int, tma_capable: bool, dh2d: torch.Tensor | None = None) -> bool:
    """Whether `rms_norm_bwd_tma_rows_kernel` may run: the config has its tile (`tma_rows`), dx is wanted
    (`dx` None otherwise), the device has TMA (or Triton is interpreted), and x, dy and dx are
    TMA-addressable (16-byte aligned starts and row strides, no zero stride). Rows past TMA_ROWS_MAX
    columns (an H200's `wide` band; with dh past DH_ONE_BLOCK) need 32-byte aligned starts and strides:
    each row's copy 16 bytes off a 32-byte boundary ran 4-19 % behind the other kernel there
    (rmsnorm_bwd_config.tma_rows_align). Its stages must also fit the device's shared memory (`launch`:
    tma_rows_config). `dh2d`: the residual add's dh, read by TMA too (its rows as addressable)."""
    align = tma_rows_align(x2d.shape[1], dh2d is not None)
    dh = () if dh2d is None else ((dh2d, dh2d.stride(0) if dh2d.shape[0] > 1 else x2d.shape[1]),)
    return (tma_capable and cfg.tma_rows > 0 and cfg.split == 1 and dx is not None
            and tma_addressable((x2d, sx), (dy2d, sdy), (dx, x2d.shape[1]), *dh, align=align))


def launch(cfg: BwdConfig, dy2d: torch.Tensor, x2d: torch.Tensor, weight: torch.Tensor | None,
           rstd: torch.Tensor, offset: float, need_dx: bool, need_dw: bool, sm_count: int,
           out: tuple | None = None, tma_capable: bool = False, dh2d: torch.Tensor | None = None):
    """(dx [M, N] contiguous in x's dtype or None, dw [N] in the weight's dtype or None).

    The API layer has validated everything: x2d and dy2d [M, N] with unit column stride (dy's row
    stride may be 0), M >= 1, rstd [M] fp32 (the forward's), weight [N] or None. `out`: (dx, dw).
    `tma_capable`: the device has TMA (NVIDIA sm_90+) or Triton is interpreted. `dh2d` ([M, N], unit
    column stride): added to dx by the TMA rows kernel; only where tma_rows_applies with it (the caller,
    triton/add_rmsnorm_bwd.py, asks first)."""
    M, N = x2d.shape
    device = x2d.device
    need_dw = need_dw and weight is not None
    if weight is not None and weight.stride(0) != 1 and N > 1:  # the kernel reads the weight at unit stride
        weight = weight.contiguous()
    dx, dw = grad_outputs(x2d, weight, need_dx, need_dw, out)
    if not (need_dx or need_dw):
        return dx, dw
    sx = x2d.stride(0) if M > 1 else N
    sdy = dy2d.stride(0) if M > 1 else N
    stream = raw_stream(device)
    slots = rstd  # never touched without SPLIT > 1
    if cfg.split > 1 and need_dx:  # kept per SPLIT value: every launch flips all SPLIT slots of each row (`exchange`)
        slots = workspace(f"triton_bwd_slots{cfg.split}", slot_count(-(-M // cfg.rows) * cfg.rows, cfg.split),
                          torch.int64, device, stream, zero=True)
    w_arg = weight if weight is not None else rstd
    dx_arg = dx if need_dx else rstd
    rows_cfg = None
    if tma_rows_applies(cfg, x2d, dy2d, dx if need_dx else None, sx, sdy, tma_capable, dh2d):
        rows_cfg = tma_rows_config(cfg, shared_per_block(device), x2d.element_size(), dy2d.element_size(),
                                   dh2d.element_size() if dh2d is not None else 0, dx.element_size())
    if dh2d is not None and rows_cfg is None:
        raise ValueError("dh is read by the TMA rows kernel only (tma_rows_applies)")
    if rows_cfg is not None:
        cfg = rows_cfg
        # one entry point per count of pieces (by their module names here: the tests count their launches)
        kernel = ((rms_norm_bwd_tma_rows_kernel, rms_norm_bwd_tma_rows2_kernel) if dh2d is None else
                  (rms_norm_bwd_tma_rows_dh_kernel, rms_norm_bwd_tma_rows2_dh_kernel))[len(cfg.pieces) - 1]
        tensors = [(x2d, sx), (dy2d, sdy), (dx, N)]
        if dh2d is not None:
            tensors.append((dh2d, dh2d.stride(0) if M > 1 else N))
        descs = [[TensorDescriptor(t, [M, N], [s, 1], [cfg.rows, p]) for p in cfg.pieces] for t, s in tensors]
        consts = dict(ROWS=cfg.rows, PIECES=cfg.pieces, STARTS=cfg.piece_starts, HAS_W=weight is not None,
                      NEED_DW=need_dw, STAGES=cfg.tma_stages)

        def kernel_args(dw_arg):
            return (*(d for ds in descs for d in ds), w_arg, rstd, dw_arg, M, offset, N)
    elif tma_applies(cfg, x2d, dy2d, sx, sdy, need_dx, tma_capable):
        kernel = rms_norm_bwd_tma_kernel
        inner = min(256, cfg.part)  # a TMA box is at most 256 elements along each dimension
        shape, block = [M, N // inner, inner], [1, cfg.part // inner, inner]
        xd = TensorDescriptor(x2d, shape, [sx, inner, 1], block)
        dyd = TensorDescriptor(dy2d, shape, [sdy, inner, 1], block)
        consts = dict(C=cfg.part // inner, INNER=inner, SPLIT=cfg.split, HAS_W=weight is not None, NEED_DW=need_dw,
                      STAGES=cfg.tma_stages, INT64=needs_int64(M, N))

        def kernel_args(dw_arg):
            return (xd, dyd, w_arg, rstd, dx_arg, dw_arg, slots, M, offset, N)
    else:
        kernel = rms_norm_bwd_kernel
        prefetch = cfg.prefetch and cfg.chunks == 1
        consts = dict(BLOCK_N=cfg.block_n, CHUNKS=cfg.chunks, ROWS=cfg.rows, SPLIT=cfg.split,
                      HAS_W=weight is not None, NEED_DX=need_dx, NEED_DW=need_dw,
                      ACC_2D=cfg.acc_2d and cfg.rows > 1, PREFETCH=prefetch, ALIGN=offset_align(sx, sdy, N, cfg.part),
                      INT64=needs_int64(M + (cfg.rows * cfg.programs_per_sm * sm_count if prefetch else 0),
                                        max(sx, sdy, N)))

        def kernel_args(dw_arg):
            return (dy2d, x2d, w_arg, rstd, dx_arg, dw_arg, slots, M, sx, sdy, offset, N, cfg.part)

    # the launches' PHASE: split rows under the interpreter run two (`exchange`); the rows kernel has none
    phases = ([{}] if rows_cfg is not None
              else [dict(PHASE=1), dict(PHASE=2)] if cfg.split > 1 and need_dx and INTERPRET else [dict(PHASE=0)])
    R = grid_groups(cfg, M, sm_count)
    if R > 1:  # one wave of the compiled kernel (its dw argument: the fp32 partials, as in the launch below)
        resident = resident_programs(kernel, kernel_args(rstd), dict(consts, **phases[-1]), cfg.num_warps,
                                     cfg.num_stages, device, (tuple(consts.items()), x2d.dtype, dy2d.dtype, w_arg.dtype))
        R = grid_groups(cfg, M, sm_count, resident)
    direct = R == 1 and cfg.chunks == 1
    dw_arg = rstd  # never touched without NEED_DW
    if need_dw:
        if direct:
            dw_arg = dw
        else:  # chunked parts accumulate into their row: it starts at zero
            dw_arg = workspace("triton_bwd_dw", R * N, torch.float32, device, stream, zero=False)
            if cfg.chunks > 1:
                dw_arg[:R * N].zero_()
    args = kernel_args(dw_arg)
    for phase in phases:
        kernel[(R * cfg.split,)](*args, **consts, **phase, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if need_dw and not direct:
        dw_reduce_kernel[(-(-N // REDUCE_COLS),)](dw_arg, dw, R, N, BLOCK_C=REDUCE_COLS, num_warps=4)
    return dx, dw


# ================================================================================================
# The backend
# ================================================================================================
@dataclass(frozen=True)
class TritonBackward:
    def config(self, N: int, dtype: torch.dtype, dev: DeviceInfo, w_dtype: torch.dtype | None = None) -> BwdConfig:
        return analytic_config(N, dtype.itemsize, dev.vendor, max(1, dev.sm_count), tma_rows=tma_rows_rule(dev))

    def describe(self, M: int, N: int, dtype: torch.dtype, dev: DeviceInfo, w_dtype: torch.dtype | None = None,
                 has_dh: bool = False) -> str:
        cfg = grid_cfg = self.config(N, dtype, dev)
        kernel = "rms_norm_bwd_kernel"
        if has_tma(dev) and cfg.tma_rows:
            kernel, grid_cfg = TMA_ROWS_KERNELS[len(cfg.pieces) - 1].__name__, tma_rows_config(cfg)
        elif has_tma(dev) and tma_config(cfg, N):
            kernel = "rms_norm_bwd_tma_kernel"
        R = grid_groups(grid_cfg, M, max(1, dev.sm_count))
        return (f"Triton {kernel} (persistent), grid ({R * cfg.split},) = {R} row groups x {cfg.split} "
                f"parts, {cfg.short()}" + (", then dw_reduce_kernel over the R partial rows" if R > 1 else "")
                + f"; config: analytic (N, dtype, {dev.vendor})")

    # dh (the residual add's backward) is not read through this backend: the caller adds it after
    # (residual._bwd_op). Triton's fused form is add_rmsnorm_bwd.py's (dispatch.residual_backward): its
    # register kernel, or on a GPU model's dh rows this module's TMA rows kernel with dh (`launch`'s dh2d)
    adds_dh = False

    def backward(self, dy2d, x2d, weight, rstd, offset, need_dx, need_dw, dev: DeviceInfo,
                 cfg: BwdConfig | None = None, out: tuple | None = None, dh2d=None):
        """(dh2d: the interface's; always None here, rmsnorm.backward_rows gives dh only where adds_dh)"""
        cfg = cfg or self.config(x2d.shape[1], x2d.dtype, dev)
        return launch(cfg, dy2d, x2d, weight, rstd, offset, need_dx, need_dw, max(1, dev.sm_count), out,
                      has_tma(dev))


TRITON_BACKWARD = TritonBackward()
