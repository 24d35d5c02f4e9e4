"""RMSNorm forward in cuTile: compiled-kernel objects, the launch wrappers and the three mode backends.

Layout (TileGym's order, one file per seam): kernels (rmsnorm_fwd_kernel.py) -> launch configs and
heuristics (rmsnorm_fwd_config.py) -> compile-time signatures (for the CI compile checks) -> launch
wrappers -> the mode backends (here).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import cuda.tile as ct
import torch

from .._platform import DeviceInfo
from .._workspace import current_raw_stream
from .._workspace import workspace
from .common import align_elems, flat, flat_array, padded_rows, round16, round_up, signature
from .rmsnorm_fwd_config import FwdConfig, default_config, split_part
from .rmsnorm_fwd_kernel import (rms_norm_fwd_cached_kernel, rms_norm_fwd_reload_kernel, rms_norm_fwd_split_kernel,
                                 rms_norm_fwd_stream_kernel)

# ================================================================================================
# Compiled-kernel objects (hints -> kernel), signatures for ahead-of-time compile checks
# ================================================================================================
_KERNELS = {"cached": rms_norm_fwd_cached_kernel, "reload": rms_norm_fwd_reload_kernel,
            "split": rms_norm_fwd_split_kernel, "stream": rms_norm_fwd_stream_kernel}


@functools.lru_cache(maxsize=None)
def kernel_for(cfg_kernel: str, hints: tuple) -> ct.kernel:
    k = _KERNELS[cfg_kernel]
    return k.replace_hints(**dict(hints)) if hints else k




def constants(cfg: FwdConfig, N: int, x_align: int, has_w: bool, store_rstd: bool, w_planes: int = 0) -> tuple:
    if cfg.kernel == "cached":
        return (N, cfg.tile_m, cfg.piece_min, x_align, has_w, store_rstd, cfg.persistent,
                cfg.persistent and cfg.hoist_w, cfg.latency, cfg.packed and cfg.tile_m == 1, w_planes,
                cfg.w_early)
    if cfg.kernel == "split":
        return (N, cfg.split, split_part(N, cfg.split), cfg.piece_min, x_align, has_w, store_rstd, cfg.latency,
                cfg.packed, w_planes, cfg.w_early, cfg.tie_slot)
    if cfg.kernel == "stream":
        return (N, cfg.tile_m, cfg.piece_min, x_align, has_w, store_rstd, cfg.hoist_w, cfg.latency, cfg.packed,
                w_planes)
    return (N, cfg.tile_m, cfg.chunk, cfg.reverse, x_align, has_w, store_rstd, cfg.persistent, cfg.latency,
            w_planes)


def export_signature(cfg: FwdConfig, N: int, x_dtype, w_dtype, has_w: bool = True, store_rstd: bool = True):
    """The KernelSignature a launch on well-aligned contiguous tensors would compile (for CI checks)."""
    from cuda.tile.compilation import ScalarConstraint

    elem = {ct.float16: 2, ct.bfloat16: 2, ct.float32: 4}[x_dtype]
    # the stream kernel's y is 2-D (rows padded to 16, N), row stride N (as a launch specialises it)
    y = padded_rows(x_dtype, N, elem) if cfg.kernel == "stream" else flat_array(x_dtype, True)
    torch_dtype = {ct.float16: torch.float16, ct.bfloat16: torch.bfloat16, ct.float32: torch.float32}
    w_planes = weight_planes_offset(torch_dtype[x_dtype], torch_dtype[w_dtype] if has_w else None, N)
    w = flat_array(ct.int16, True) if w_planes else flat_array(w_dtype, N % 16 == 0)
    params = [flat_array(x_dtype, N % 16 == 0), w, y, flat_array(ct.float32, True)]
    if cfg.kernel == "split":
        params.append(flat_array(ct.int32, True))  # the split kernel's slots, a multiple of 16 long
    params += [ScalarConstraint(ct.int32), ScalarConstraint(ct.int32), ScalarConstraint(ct.float32),
               ScalarConstraint(ct.float32)]
    return (kernel_for(cfg.kernel, tuple(sorted(cfg.hints().items()))),
            signature(params, constants(cfg, N, align_elems(N, elem), has_w, store_rstd, w_planes)))


# ================================================================================================
# Launch wrappers
# ================================================================================================
_MAX_FLAT = (1 << 31) - 1  # int32 indexing: longer inputs are launched in row chunks




def _sync_workspace(M: int, split: int, device, stream: int) -> torch.Tensor:
    """The split kernel's int32 slots for M rows, kept between launches (the kernel flips a sign bit
    instead of needing them cleared; see _workspace.py for streams and CUDA graphs). Lengths are
    multiples of 16, so the array's "divisible by 16" bit (which a launch specialises on) never changes."""
    return workspace(f"fwd_sync{split}", M * split, torch.int32, device, stream, zero=True)




PLANES_MIN_N = 2048  # from this width an fp32 weight with 16-bit x goes to the kernels as int16 planes


def weight_planes_offset(x_dtype: torch.dtype, w_dtype: torch.dtype | None, N: int) -> int:
    """The kernels' W_PLANES constant: where the high halves start in `weight_planes(weight)`, or 0
    when the weight is passed as it is (16-bit, None, with fp32 x, or rows narrower than PLANES_MIN_N,
    where the fp32 weight's layout change costs nothing measurable: docs/design.md)."""
    if w_dtype != torch.float32 or x_dtype.itemsize != 2 or N < PLANES_MIN_N:
        return 0
    return round16(N)


def weight_planes(weight: torch.Tensor) -> torch.Tensor:
    """An fp32 weight [N] as int16 [2 * round16(N)]: the low 16 bits of each element, then, from
    round16(N), the high 16 bits (exact: the kernel joins them again). One small copy per call; it
    is not cached, so an update of the weight by any path (even through .data) is always seen."""
    N, npad = weight.numel(), round16(weight.numel())
    planes = torch.empty(2 * npad, dtype=torch.int16, device=weight.device)
    planes.view(2, npad)[:, :N].copy_(weight.contiguous().view(torch.int16).view(N, 2).t())
    return planes


@functools.lru_cache(maxsize=4096)
def prepared(cfg: FwdConfig, N: int, x_align: int, has_w: bool, store_rstd: bool, w_planes: int = 0):
    """(kernel object, compile-time constants) of one launch shape: everything but the tensors."""
    return (kernel_for(cfg.kernel, tuple(sorted(cfg.hints().items()))),
            constants(cfg, N, x_align, has_w, store_rstd, w_planes))


def row_pad(cfg: FwdConfig) -> int:
    """The stream kernel stores whole row tiles into a 2-D y whose rows are padded to a multiple of
    this (and of 16, so the row count's "divisible by 16" bit never changes); 1 for the others."""
    return max(16, cfg.tile_m) if cfg.kernel == "stream" else 1




def output_buffers(M: int, N: int, dtype: torch.dtype, device, store_rstd: bool, shape=None, pad_rows: int = 1):
    """y (in `shape`, default [M, N]) and rstd [M] (or None), in allocations padded so that every
    launch of `launch` may write its padded arrays: y's flat length to a multiple of 16 (and its rows
    to a multiple of `pad_rows`, see `row_pad`), rstd's rows to a multiple of 16 and of `pad_rows`.
    The padding keeps the arrays' "divisible by 16" bits independent of M (no recompilation)."""
    shape = shape if shape is not None else (M, N)
    length = round16(round_up(M, pad_rows) * N)
    if length == M * N:
        y = torch.empty(shape, dtype=dtype, device=device)
    else:
        y = torch.empty(length, dtype=dtype, device=device)[:M * N].view(shape)
    rstd = torch.empty(round_up(M, max(16, pad_rows)), dtype=torch.float32, device=device)[:M] if store_rstd else None
    return y, rstd




def grid_size(cfg: FwdConfig, M: int, sm_count: int) -> int:
    """Tile blocks of a launch over M rows: one per row tile, or at most blocks_per_sm x SMs
    (persistent), or `split` per row."""
    if cfg.kernel == "split":
        return M * cfg.split
    tiles = -(-M // cfg.tile_m)
    return min(tiles, cfg.blocks_per_sm * sm_count) if cfg.persistent else tiles


def launch(cfg: FwdConfig, x2d: torch.Tensor, weight: torch.Tensor | None, eps: float, offset: float,
           store_rstd: bool, sm_count: int, out: tuple | None = None, out_shape=None):
    """y (contiguous, [M, N] or `out_shape`) and rstd [M] fp32 (or None) for a 2-D x, unit column stride.

    The API layer has validated everything: dtypes, shapes, devices, x2d.stride(1) == 1, M >= 1.
    `out`: (y, rstd) from `output_buffers` to write into (the tests poison them first).
    """
    M, N = x2d.shape
    stride = x2d.stride(0) if M > 1 else N
    pad = row_pad(cfg)
    unit = max(16, pad)  # the rows of a chunk (below) come in whole padded tiles
    if stride > N and (_MAX_FLAT - unit * N) // stride < unit:
        # rows so far apart that one chunk of `unit` rows spans 2^31 elements: their compact copy, M x N
        # elements, far fewer than the span read flat
        x2d, stride = x2d.contiguous(), N
    if out is None:
        y, rstd = output_buffers(M, N, x2d.dtype, x2d.device, store_rstd, out_shape, pad)
    else:
        y, rstd = out
        if y.untyped_storage().nbytes() < (y.storage_offset() + round16(round_up(M, pad) * N)) * y.element_size():
            raise ValueError(f"out: y must come from output_buffers(..., pad_rows={pad}) for {cfg.short()}")
    w_planes = weight_planes_offset(x2d.dtype, weight.dtype if weight is not None else None, N)
    kernel, consts = prepared(cfg, N, align_elems(stride, x2d.element_size()), weight is not None, store_rstd,
                               w_planes)
    # what the kernel never touches (the weight without HAS_W, rstd without STORE_RSTD) gets a short
    # view of y: y's whole flat view is over 2^31 elements when the launch is cut into row chunks
    # (ct.launch raised OverflowError on it)
    unused = flat(y, 16)
    w = weight_planes(weight) if w_planes else weight if weight is not None else unused
    stream = current_raw_stream(x2d.device.index)
    split = cfg.kernel == "split"

    def y_arg(r0: int, m: int) -> torch.Tensor:  # the kernel's y for rows [r0, r0 + m)
        if pad > 1:
            return y.as_strided((round_up(m, pad), N), (N, 1), y.storage_offset() + r0 * N)
        return flat(y, round16(m * N), r0 * N)

    def rstd_arg(r0: int, m: int) -> torch.Tensor:  # never written when STORE_RSTD is False
        return flat(rstd, round_up(m, max(16, pad)), r0) if store_rstd else unused

    span = (M - 1) * stride + N
    if span <= _MAX_FLAT and round_up(M, pad) * N <= _MAX_FLAT:  # one launch (the usual case)
        x_flat = x2d.view(-1) if stride == N else flat(x2d, span)
        sync = (_sync_workspace(M, cfg.split, x2d.device, stream),) if split else ()
        ct.launch(stream, (grid_size(cfg, M, sm_count),), kernel,
                  (x_flat, w, y_arg(0, M), rstd_arg(0, M)) + sync + (M, stride, eps, offset) + consts)
        return y, rstd
    # beyond int32 indexing: row chunks that stay below 2^31 elements, a multiple of 16 rows each (the
    # stream kernel: of its padded tile rows, so only the last chunk writes past its own rows)
    rows = (_MAX_FLAT - unit * N) // max(stride, N) // unit * unit
    if rows < unit:
        raise ValueError(f"rows of {N} elements are too long for {cfg.short()}: {unit} rows would pass int32 "
                         f"indexing; use mode='torch'")
    for r0 in range(0, M, rows):
        m = min(rows, M - r0)
        sync = (_sync_workspace(m, cfg.split, x2d.device, stream),) if split else ()
        args = (flat(x2d, (m - 1) * stride + N, r0 * stride), w, y_arg(r0, m), rstd_arg(r0, m)) + sync + \
            (m, stride, eps, offset)
        ct.launch(stream, (grid_size(cfg, m, sm_count),), kernel, args + consts)
    return y, rstd


@functools.lru_cache(maxsize=4096)
def launcher(cfg: FwdConfig, N: int, stride: int, dtype: torch.dtype, w_dtype: torch.dtype | None,
             store_rstd: bool, sm_count: int):
    """`launch` for one call signature (M free) with everything but the tensors worked out once: the
    host path at batch 1, where a call is host bound (bench/decode.py times it). Returns
    run(x2d, weight, eps, offset, out_shape) -> (y, rstd), or None where the signature needs the
    general path (2-D padded y, the split kernel's slots, the fp32 weight's planes)."""
    if row_pad(cfg) > 1 or cfg.kernel == "split" or weight_planes_offset(dtype, w_dtype, N):
        return None
    kernel, consts = prepared(cfg, N, align_elems(stride, dtype.itemsize), w_dtype is not None, store_rstd, 0)
    has_w = w_dtype is not None

    def run(x2d, weight, eps, offset, out_shape):
        # a contiguous x of out_shape (backends.Runner) is read flat like rows at stride N
        M = x2d.shape[0] if x2d.dim() == 2 else x2d.numel() // N
        span = (M - 1) * stride + N
        if M * N % 16 or span > _MAX_FLAT or M * N > _MAX_FLAT:  # y padded, or row chunks: the general path
            return launch(cfg, x2d.view(M, N), weight, eps, offset, store_rstd, sm_count, out_shape=out_shape)
        y = torch.empty(out_shape if out_shape is not None else (M, N), dtype=dtype, device=x2d.device)
        y_flat = y.view(-1)
        unused = y_flat  # what the kernel never touches (no weight, no rstd): y itself, no view to make
        rstd = torch.empty(round16(M), dtype=torch.float32, device=x2d.device)[:M] if store_rstd else None
        x_flat = x2d.view(-1) if stride == N or M == 1 else flat(x2d, span)
        ct.launch(current_raw_stream(x2d.device.index), (grid_size(cfg, M, sm_count),), kernel,
                  (x_flat, weight if has_w else unused, y_flat, rstd if store_rstd else unused,
                   M, stride if M > 1 else N, eps, offset) + consts)
        return y, rstd

    return run


# ================================================================================================
# The three mode backends (what the dispatch table points at)
# ================================================================================================
@dataclass(frozen=True)
class CuTileForward:
    mode: str
    idea: str
    takes_every_row = True  # any row stride and alignment (flat gathers)

    def unsupported(self, x2d: torch.Tensor, batch_invariant: bool = False) -> str | None:
        return None

    def config(self, N: int, dtype: torch.dtype, dev: DeviceInfo) -> FwdConfig:
        return default_config(self.mode, N, dtype.itemsize, dev, str(dtype).removeprefix("torch."))

    def describe(self, M: int, N: int, dtype: torch.dtype, dev: DeviceInfo) -> str:
        cfg = self.config(N, dtype, dev)
        return f"cuTile rms_norm_fwd_{cfg.kernel}_kernel, grid ({grid_size(cfg, M, dev.sm_count)},), {cfg.short()}"

    def forward(self, x2d, weight, eps, offset, store_rstd, dev: DeviceInfo, cfg: FwdConfig | None = None,
                out: tuple | None = None, out_shape=None):
        cfg = cfg or self.config(x2d.shape[1], x2d.dtype, dev)
        return launch(cfg, x2d, weight, eps, offset, store_rstd, dev.sm_count, out, out_shape)

    def launcher(self, M: int, N: int, stride: int, dtype: torch.dtype, w_dtype: torch.dtype | None,
                 store_rstd: bool, dev: DeviceInfo):
        """run(x2d, weight, eps, offset, out_shape) for this call signature (see `launcher`)."""
        cfg = self.config(N, dtype, dev)
        run = launcher(cfg, N, stride if M > 1 else N, dtype, w_dtype, store_rstd, dev.sm_count)
        if run is None:  # (a contiguous x of out_shape as rows: backends.Runner)
            return lambda x, w, eps, offset, out_shape: launch(cfg, x if x.dim() == 2 else x.view(-1, N), w, eps,
                                                               offset, store_rstd, dev.sm_count, out_shape=out_shape)
        return run


MULTI_WAVE_CACHED = CuTileForward("multi_wave_cached", "whole row loaded once, kept on chip")
MULTI_WAVE_RELOAD = CuTileForward("multi_wave_reload", "two passes over chunks")
STATIC_PERSISTENT = CuTileForward("static_persistent", "persistent grid over row tiles")
