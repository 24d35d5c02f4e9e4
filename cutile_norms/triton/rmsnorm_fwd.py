"""RMSNorm forward in Triton: the launch wrapper and the backend (the kernel in rmsnorm_fwd_kernel.py,
its configs in rmsnorm_fwd_config.py)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .._platform import DeviceInfo
from .._workspace import workspace
from ._common import INTERPRET, raw_stream, resident_programs, slot_count
from .rmsnorm_fwd_config import FwdConfig, analytic_config, grid_programs
from .rmsnorm_fwd_kernel import rms_norm_fwd_kernel
from .tiling import needs_int64, offset_align


# ================================================================================================
# Launch
# ================================================================================================
def launch(cfg: FwdConfig, x2d: torch.Tensor, weight: torch.Tensor | None, eps: float, offset: float,
           store_rstd: bool, sm_count: int, out: tuple | None = None, out_shape=None):
    """(y contiguous in x's dtype, [M, N] or `out_shape`; rstd [M] fp32 or None) for a 2-D x with unit
    column stride, M >= 1. The API layer has validated everything. `out`: (y, rstd) to write into."""
    M, N = x2d.shape
    device = x2d.device
    stride = x2d.stride(0) if M > 1 else N
    if weight is not None and weight.stride(0) != 1 and N > 1:  # the kernel reads the weight at unit stride
        weight = weight.contiguous()
    if out is None:
        y = torch.empty(out_shape if out_shape is not None else (M, N), dtype=x2d.dtype, device=device)
        rstd = torch.empty(M, dtype=torch.float32, device=device) if store_rstd else None
    else:
        y, rstd = out
    slots = y  # never touched without SPLIT > 1
    if cfg.split > 1:  # kept per SPLIT value: every launch flips all SPLIT slots of each row (`exchange`)
        slots = workspace(f"triton_fwd_slots{cfg.split}", slot_count(-(-M // cfg.rows) * cfg.rows, cfg.split),
                          torch.int64, device, raw_stream(device), zero=True)
    args = (x2d, weight if weight is not None else y, y, rstd if store_rstd else y, slots, M, stride,
            eps, offset, N, cfg.part)
    consts = dict(BLOCK_N=cfg.block_n, CHUNKS=cfg.chunks, ROWS=cfg.rows, SPLIT=cfg.split,
                  HAS_W=weight is not None, HAS_OFFSET=offset != 0.0, STORE_RSTD=store_rstd,
                  PREFETCH=cfg.prefetch and cfg.chunks == 1, ALIGN=offset_align(stride, N, cfg.part),
                  ONE_TILE=cfg.programs_per_sm == 0 and (cfg.split > 1 or cfg.one_tile),
                  INT64=needs_int64(M + (cfg.rows * cfg.programs_per_sm * sm_count if cfg.prefetch else 0),
                                    max(stride, N)))
    resident = 32
    if cfg.programs_per_sm:
        resident = resident_programs(rms_norm_fwd_kernel, args, dict(consts, PHASE=0), cfg.num_warps, cfg.num_stages,
                                     device, (tuple(consts.items()), x2d.dtype, args[1].dtype))
    programs = grid_programs(cfg, M, sm_count, resident)
    phases = (1, 2) if cfg.split > 1 and INTERPRET else (0,)
    for phase in phases:
        rms_norm_fwd_kernel[(programs,)](*args, **consts, PHASE=phase, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return y, rstd


# ================================================================================================
# The backend
# ================================================================================================
@dataclass(frozen=True)
class TritonForward:
    mode: str = "triton"
    takes_every_row = True  # any row stride and alignment (masked pointer loads)

    def unsupported(self, x2d: torch.Tensor, batch_invariant: bool = False) -> str | None:
        return None

    def launcher(self, M: int, N: int, stride: int, dtype: torch.dtype, w_dtype: torch.dtype | None,
                 store_rstd: bool, dev: DeviceInfo):
        return None  # the launch per call is all there is (Triton's own launcher caches the kernel)

    def config(self, N: int, dtype: torch.dtype, dev: DeviceInfo) -> FwdConfig:
        return analytic_config(N, dtype.itemsize, dev.vendor, max(1, dev.sm_count))

    def describe(self, M: int, N: int, dtype: torch.dtype, dev: DeviceInfo) -> str:
        cfg = self.config(N, dtype, dev)
        grid = "persistent grid" if cfg.programs_per_sm else "one program per row tile"
        return (f"Triton rms_norm_fwd_kernel, {grid} ({grid_programs(cfg, M, max(1, dev.sm_count))},), "
                f"{cfg.short()}; config: analytic (N, dtype, {dev.vendor})")

    def forward(self, x2d, weight, eps, offset, store_rstd, dev: DeviceInfo, cfg: FwdConfig | None = None,
                out: tuple | None = None, out_shape=None):
        cfg = cfg or self.config(x2d.shape[1], x2d.dtype, dev)
        return launch(cfg, x2d, weight, eps, offset, store_rstd, max(1, dev.sm_count), out, out_shape)


TRITON_FORWARD = TritonForward()
