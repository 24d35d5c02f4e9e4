"""RMSNorm forward in Triton: the launch wrapper and the backend (the kernel in rmsnorm_fwd_kernel.py,
its configs in rmsnorm_fwd_config.py)."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from triton import knobs

from .._platform import DeviceInfo, current_gpu
from .._workspace import workspace
from ._common import INTERPRET, raw_stream, resident_programs, slot_count
from .rmsnorm_fwd_config import FwdConfig, analytic_config, grid_programs
from .rmsnorm_fwd_kernel import rms_norm_fwd_fixed_kernel, rms_norm_fwd_kernel
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
    if cfg.fixed_n:
        rms_norm_fwd_fixed_kernel[(M,)](
            x2d, weight if weight is not None else y, y, rstd if store_rstd else y, stride, eps, offset,
            **_fixed_consts(cfg, M, N, stride, weight is not None, offset, store_rstd),
            num_warps=cfg.num_warps, num_stages=cfg.num_stages)
        return y, rstd
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


def _fixed_consts(cfg: FwdConfig, M: int, N: int, stride: int, has_w: bool, offset: float, store_rstd: bool) -> dict:
    """rms_norm_fwd_fixed_kernel's constants for a launch, in its signature's order (the runner passes
    them positionally to the compiled kernel's launcher)."""
    return dict(N=N, BLOCK_N=cfg.block_n, HAS_W=has_w, HAS_OFFSET=offset != 0.0, STORE_RSTD=store_rstd,
                CONTIG=stride == N, INT64=needs_int64(M, max(stride, N)), ALIGN=offset_align(stride))


def _hooked(hook) -> bool:
    """A Triton launch hook that calls something: Triton keeps an empty chain of hooks (a HookChain) where
    none is set."""
    return hook is not None and (not hasattr(hook, "calls") or bool(hook.calls))


class _FixedRunner:
    """run(x2d, weight, eps, offset, out_shape=None, out=None) -> (y, rstd or None) for one call signature
    of rms_norm_fwd_fixed_kernel: compiled once per (weight or not, offset or not) for 16-byte-aligned
    tensors, then launched through the compiled kernel's own launcher with the pointers as integers: no
    JIT binding and specialisation of the arguments, no driver query of each pointer (a call at M = 1,
    N = 4096 on an H200: 54 us through the JIT, 20.6 us through Triton's launcher with the tensors;
    bench/decode.py). A call the compiled kernel does not fit (a misaligned tensor, another row stride
    or current device, outputs given, a launch hook set by a profiler) goes through `launch`."""

    def __init__(self, cfg: FwdConfig, stride: int, store_rstd: bool, sm_count: int, device: torch.device):
        self.cfg, self.stride, self.store_rstd = cfg, stride, store_rstd
        self.sm_count, self.device = sm_count, device
        self.compiled: dict = {}  # (weight or not, offset or not, int64 offsets or not) -> the launch's fixed parts

    def _fits(self, x2d, weight, out) -> bool:
        """Whether the compiled kernel takes this call as it is (else `launch`)."""
        return (out is None and (x2d.shape[0] == 1 or x2d.stride(0) == self.stride) and not x2d.data_ptr() & 15
                and self._launch_takes(weight))

    def _fits_nd(self, x, weight, M: int, N: int) -> bool:
        """`_fits` for a contiguous x of another rank than 2 (its rows at stride N)."""
        return (M == 1 or self.stride == N) and not x.data_ptr() & 15 and self._launch_takes(weight)

    def _launch_takes(self, weight) -> bool:
        """What both `_fits` ask beside x's rows: the weight 16-byte aligned at unit stride, no launch hook,
        and this runner's device current (the module the kernel is loaded in)."""
        return ((weight is None or (not weight.data_ptr() & 15 and weight.stride(0) == 1))
                and not _hooked(knobs.runtime.launch_enter_hook) and not _hooked(knobs.runtime.launch_exit_hook)
                and current_gpu() == self.device.index)

    def __call__(self, x2d, weight, eps, offset, out_shape=None, out=None):
        if x2d.dim() != 2:  # a contiguous x of out_shape (backends.Runner): its rows by pointer, no views
            N = x2d.shape[-1]
            M = x2d.numel() // N
            fits = out is None and self._fits_nd(x2d, weight, M, N)
        else:
            M, N = x2d.shape
            fits = self._fits(x2d, weight, out)
        fast = self.compiled.get((weight is not None, offset != 0.0, needs_int64(M, max(self.stride, N))))
        if not fast or not fits:
            return self._first(x2d.view(M, N), weight, eps, offset, out_shape, out)
        launch_fn, head, consts = fast
        # rows at stride N: empty_like gives them contiguous (in x's shape), for half the host time of
        # torch.empty (one row at another stride would keep that stride)
        y = (torch.empty_like(x2d) if x2d.dim() != 2 or x2d.stride(0) == N else
             torch.empty((M, N), dtype=x2d.dtype, device=x2d.device))
        rstd = torch.empty(M, dtype=torch.float32, device=x2d.device) if self.store_rstd else None
        y_ptr = y.data_ptr()
        if y_ptr & 15 or (rstd is not None and rstd.data_ptr() & 15):  # an allocator that does not align them
            launch(self.cfg, x2d.view(M, N), weight, eps, offset, self.store_rstd, self.sm_count, (y, rstd))
        else:
            launch_fn(M, 1, 1, raw_stream(self.device), *head, x2d.data_ptr(),
                      weight.data_ptr() if weight is not None else y_ptr, y_ptr,
                      rstd.data_ptr() if rstd is not None else y_ptr, self.stride, eps, offset, *consts)
        return (y if out_shape is None or y.dim() != 2 else y.view(out_shape)), rstd

    def _first(self, x2d, weight, eps, offset, out_shape, out):
        """`launch`, and the kernel compiled for the fast path where the call fits it."""
        M, N = x2d.shape
        key = (weight is not None, offset != 0.0, needs_int64(M, max(self.stride, N)))
        y, rstd = launch(self.cfg, x2d, weight, eps, offset, self.store_rstd, self.sm_count, out, out_shape)
        if key not in self.compiled and self._fits(x2d, weight, out):
            y2d = y.view(M, N)
            args = (x2d, weight if weight is not None else y2d, y2d, rstd if self.store_rstd else y2d, self.stride,
                    eps, offset)
            consts = _fixed_consts(self.cfg, M, N, self.stride, weight is not None, offset, self.store_rstd)
            # the launcher takes every argument in the kernel's order, its constants too
            assert tuple(consts) == tuple(rms_norm_fwd_fixed_kernel.arg_names[len(args):]), "kernel signature"
            kernel = rms_norm_fwd_fixed_kernel.warmup(*args, **consts, grid=(1,), num_warps=self.cfg.num_warps,
                                                      num_stages=self.cfg.num_stages)
            if not hasattr(kernel, "_init_handles"):  # no compiled kernel to hold (a cache hook, async compiles)
                self.compiled[key] = None
                return y, rstd
            kernel._init_handles()
            launcher = kernel.run
            if (getattr(launcher, "global_scratch_size", 1) == 0 and getattr(launcher, "profile_scratch_size", 1) == 0
                    and hasattr(launcher, "launch") and hasattr(launcher, "launch_pdl")):
                # Triton's launcher less its scratch allocations, which this kernel has none of
                fast = (launcher.launch, (kernel.function, launcher.launch_cooperative_grid, launcher.launch_pdl,
                                          None, None, kernel.packed_metadata, None, None, None))
            else:
                fast = (launcher, (kernel.function, kernel.packed_metadata, None, None, None))
            self.compiled[key] = (*fast, tuple(consts.values()))
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
        """A runner for rows that run rms_norm_fwd_fixed_kernel on a GPU (`_FixedRunner`); else None: the
        launch per call is all there is (Triton's own launcher caches the kernel)."""
        cfg = self.config(N, dtype, dev)
        if not cfg.fixed_n or INTERPRET or dev.vendor != "nvidia":
            return None
        return _FixedRunner(cfg, N if M == 1 else stride, store_rstd, dev.sm_count, torch.device("cuda", dev.index))

    def config(self, N: int, dtype: torch.dtype, dev: DeviceInfo) -> FwdConfig:
        return analytic_config(N, dtype.itemsize, dev.vendor, max(1, dev.sm_count))

    def describe(self, M: int, N: int, dtype: torch.dtype, dev: DeviceInfo) -> str:
        cfg = self.config(N, dtype, dev)
        if cfg.fixed_n:
            return (f"Triton rms_norm_fwd_fixed_kernel, one program per row ({M},), two passes, {cfg.short()}; "
                    f"config: analytic (N, dtype, {dev.vendor}), compiled for this N")
        grid = "persistent grid" if cfg.programs_per_sm else "one program per row tile"
        return (f"Triton rms_norm_fwd_kernel, {grid} ({grid_programs(cfg, M, max(1, dev.sm_count))},), "
                f"{cfg.short()}; config: analytic (N, dtype, {dev.vendor})")

    def forward(self, x2d, weight, eps, offset, store_rstd, dev: DeviceInfo, cfg: FwdConfig | None = None,
                out: tuple | None = None, out_shape=None):
        cfg = cfg or self.config(x2d.shape[1], x2d.dtype, dev)
        return launch(cfg, x2d, weight, eps, offset, store_rstd, max(1, dev.sm_count), out, out_shape)


TRITON_FORWARD = TritonForward()
