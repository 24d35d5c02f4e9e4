"""RMSNorm backward in cuTile: the launch wrapper and the backend every cuTile mode runs (the kernel
in rmsnorm_bwd_kernel.py, its configs in rmsnorm_bwd_config.py)."""
from __future__ import annotations

import functools
from dataclasses import dataclass

import cuda.tile as ct
import torch

from .._platform import DeviceInfo
from .._util import pow2_ceil
from .._workspace import current_raw_stream, workspace
from .common import align_elems, flat, flat_array, padded_rows, round16, round_up, signature
from .rmsnorm_bwd_config import BwdConfig, config_and_source, default_config, dx_2d, dx_row_pad, part_of, piece_min
from .rmsnorm_bwd_kernel import rms_norm_bwd_kernel


def reducers(sm_count: int) -> int:
    """The most blocks that wait at the end to reduce dw: half the SMs, so the grid's other blocks
    always find room to finish whatever else runs on the GPU."""
    return max(1, sm_count // 2)


def red_tile(N: int, sm_count: int) -> tuple[int, int]:
    """The dw reduction's tile (partial rows, columns) per step: columns so that every reducer gets
    a slice (N / reducers, a power of two from 32 to 256), rows so that a step loads 4096 values
    (16 per thread at 8 warps)."""
    cols = min(256, max(32, pow2_ceil(-(-N // reducers(sm_count)))))
    return 4096 // cols, cols


def constants(cfg: BwdConfig, N: int, x_align: int, dy_align: int, has_w: bool, need_dx: bool, need_dw: bool,
              sm_count: int, dh_align: int = 1, has_dh: bool = False) -> tuple:
    part = part_of(cfg, N)
    return (N, cfg.tile_m, cfg.split, part, piece_min(cfg, N), x_align, dy_align, dh_align, has_w, need_dx, need_dw,
            has_dh, *red_tile(N, sm_count), cfg.latency, dx_2d(cfg, N), cfg.prefetch)


@functools.lru_cache(maxsize=None)
def kernel_for(hints: tuple) -> ct.kernel:
    return rms_norm_bwd_kernel.replace_hints(**dict(hints)) if hints else rms_norm_bwd_kernel


def export_signature(cfg: BwdConfig, N: int, x_dtype, w_dtype, has_w: bool = True, need_dx: bool = True,
                     need_dw: bool = True, sm_count: int = 132, has_dh: bool = False):
    """The KernelSignature a launch on contiguous, well-aligned tensors compiles (for the CI checks)."""
    from cuda.tile.compilation import ScalarConstraint

    elem = {ct.float16: 2, ct.bfloat16: 2, ct.float32: 4}[x_dtype]
    wd = w_dtype if has_w else x_dtype
    # dx 2-D: rows padded to 16, row stride N (as a launch specialises it)
    dx = padded_rows(x_dtype, N, elem) if dx_2d(cfg, N) else flat_array(x_dtype, True)
    div16 = N % 16 == 0
    params = [flat_array(x_dtype, div16), flat_array(x_dtype, div16), flat_array(x_dtype, div16),
              flat_array(wd, div16), flat_array(ct.float32, True), dx, flat_array(wd, div16),
              flat_array(ct.float32, True), flat_array(ct.int32, True), flat_array(ct.int64, True)]
    params += [ScalarConstraint(ct.int32)] * 4 + [ScalarConstraint(ct.float32)] + [ScalarConstraint(ct.int32)] * 2
    align = row_align(cfg, N, elem, {ct.float16: 2, ct.bfloat16: 2, ct.float32: 4}[wd])
    return (kernel_for(tuple(sorted(cfg.hints().items()))),
            signature(params, constants(cfg, N, align, align, has_w, need_dx, need_dw, sm_count,
                                        align if has_dh else 1, has_dh)))


def row_align(cfg: BwdConfig, stride: int, elem_bytes: int, w_elem_bytes: int) -> int:
    """The alignment hint, in elements, of x's, dy's and dh's rows: 16 bytes' worth where the stride
    allows; in one-row tiles no more elements than a 16-byte vector of the weight holds (4 for an fp32
    weight beside 16-bit x), so the held weight and each row's x and dy are tiles of one layout. With 8
    bf16 a vector against the weight's 4 fp32, tileiras converted between the two through shared memory
    on every row: sm_90 SASS at N = 8192, 65 shared loads and 49 barriers against 25 and 20 at 4 a vector
    (a bf16 weight: 31 and 28). H100, bf16 x, fp32 weight, 3 M N e bytes over a copy, 8 against 4 a
    vector: 4096 0.920 / 0.967, 8192 0.810 / 0.959, 16384 0.821 / 0.915, 32768 0.793 / 0.902 (a bf16
    weight 0.973 / 0.961 / 0.944 / 0.938). Multi-row tiles hold the weight as one row against a tile of
    rows, whatever the vector: 1024 measured 0.751 at 8 and 0.702 at 4 (docs/performance.md 2.23)."""
    cap = 16 // w_elem_bytes if cfg.tile_m == 1 else 16 // elem_bytes
    return min(align_elems(stride, elem_bytes), max(cap, 1))


# ================================================================================================
# The launch wrapper
# ================================================================================================
_MAX_FLAT = (1 << 31) - 1  # int32 indexing: longer inputs are launched in row chunks


@functools.lru_cache(maxsize=4096)
def prepared(cfg: BwdConfig, N: int, x_align: int, dy_align: int, has_w: bool, need_dx: bool, need_dw: bool,
             sm_count: int, dh_align: int = 1, has_dh: bool = False):
    """(2-D dx?, kernel, compile-time constants, dw partial row length) of one launch signature: worked
    out once, not per call (host time at small M)."""
    return (dx_2d(cfg, N), kernel_for(tuple(sorted(cfg.hints().items()))),
            constants(cfg, N, x_align, dy_align, has_w, need_dx, need_dw, sm_count, dh_align, has_dh),
            cfg.split * part_of(cfg, N))


def grid_rows(cfg: BwdConfig, M: int, sm_count: int) -> int:
    """R, the row groups of the persistent grid: at most one per row tile, about blocks_per_sm x SMs
    blocks in all."""
    tiles = -(-M // cfg.tile_m)
    return max(1, min(tiles, cfg.blocks_per_sm * sm_count // cfg.split))




def dx_buffer(cfg: BwdConfig, M: int, N: int, dtype: torch.dtype, device) -> torch.Tensor:
    """dx [M, N], contiguous, in an allocation of whole padded tiles (`dx_row_pad`) that every launch
    of `launch` may write, the flat kernels' length rounded to 16 included."""
    length = round16(round_up(M, dx_row_pad(cfg)) * N)
    return torch.empty(length, dtype=dtype, device=device)[:M * N].view(M, N)


def launch(cfg: BwdConfig, dy2d: torch.Tensor, x2d: torch.Tensor, weight: torch.Tensor | None,
           rstd: torch.Tensor, offset: float, need_dx: bool, need_dw: bool, sm_count: int,
           out: tuple | None = None, dh2d: torch.Tensor | None = None):
    """(dx [M, N] contiguous in x's dtype or None, dw [N] in the weight's dtype or None).

    The API layer has validated everything: x2d and dy2d [M, N] with unit column stride, M >= 1,
    rstd [M] fp32 contiguous (the forward's), weight [N] or None. `out`: (dx, dw) to write into
    (the tests poison them first); dx must have room for round16(M * N) elements. `dh2d` [M, N] in
    x's dtype with unit column stride, or None: added to dx in the kernel (the residual add's backward).
    """
    M, N = x2d.shape
    has_w = weight is not None
    need_dw = need_dw and has_w
    device = x2d.device
    has_dh = dh2d is not None and need_dx
    pad = dx_row_pad(cfg)
    if M > 1 and (_MAX_FLAT - pad * N) // max(x2d.stride(0), dy2d.stride(0), dh2d.stride(0) if has_dh else 0,
                                                  N) < pad:
        # rows so far apart that one chunk of `pad` rows spans 2^31 elements: their compact copies (M x N
        # elements each, far fewer than the spans read flat)
        x2d, dy2d = x2d.contiguous(), dy2d.contiguous()
        dh2d = dh2d.contiguous() if has_dh else dh2d
    sx = x2d.stride(0) if M > 1 else N
    sdy = dy2d.stride(0) if M > 1 else N
    sdh = (dh2d.stride(0) if M > 1 else N) if has_dh else 0
    e = x2d.element_size()
    stream = current_raw_stream(device.index)
    if out is not None:
        dx, dw = out
        if need_dx and dx.untyped_storage().nbytes() < (dx.storage_offset() + round_up(M, pad) * N) * dx.element_size():
            raise ValueError(f"out: dx must come from dx_buffer(cfg, {M}, {N}, ...)")
    else:
        dx = dx_buffer(cfg, M, N, x2d.dtype, device) if need_dx else None
        dw = torch.empty(N, dtype=weight.dtype, device=device) if need_dw else None
    we = weight.element_size() if has_w else e
    two_d, kernel, consts, npad = prepared(cfg, N, row_align(cfg, sx, e, we), row_align(cfg, sdy, e, we), has_w,
                                           need_dx, need_dw, sm_count, row_align(cfg, sdh, e, we) if has_dh else 1,
                                           has_dh)
    tickets = workspace("tickets", 16, torch.int32, device, stream, zero=True)
    w_arg = weight if has_w else rstd  # never read without HAS_W

    def one(r0: int, m: int, dw_out: torch.Tensor | None):
        R = grid_rows(cfg, m, sm_count)
        x_flat = flat(x2d, (m - 1) * sx + N, r0 * sx)
        dy_flat = flat(dy2d, (m - 1) * sdy + N, r0 * sdy)
        dh_flat = flat(dh2d, (m - 1) * sdh + N, r0 * sdh) if has_dh else dy_flat  # never read without HAS_DH
        if not need_dx:
            dx_arg = x_flat  # never written without NEED_DX
        elif two_d:
            dx_arg = dx.as_strided((round_up(m, pad), N), (N, 1), dx.storage_offset() + r0 * N)
        else:
            dx_arg = flat(dx, round16(m * N), r0 * N)
        rstd_flat = rstd if r0 == 0 and m == M else flat(rstd, m, r0)  # (unit stride: rmsnorm.backward_rows)
        partials = (workspace("partials", R * npad, torch.float32, device, stream, zero=False)
                    if need_dw and R > 1 else rstd_flat)
        sync = (workspace(f"sync{cfg.split}", m * cfg.split, torch.int64, device, stream, zero=True)
                if cfg.split > 1 and need_dx else workspace("sync1", 16, torch.int64, device, stream, zero=True))
        nred = min(R * cfg.split, reducers(sm_count))
        ct.launch(stream, (R * cfg.split,), kernel,
                  (x_flat, dy_flat, dh_flat, w_arg, rstd_flat, dx_arg, dw_out if dw_out is not None else w_arg,
                   partials, tickets, sync, m, sx, sdy, sdh, offset, R, nred) + consts)

    span = max((M - 1) * sx, (M - 1) * sdy, (M - 1) * sdh) + N
    if span <= _MAX_FLAT and round_up(M, pad) * N <= _MAX_FLAT:
        one(0, M, dw)
        return dx, dw
    # beyond int32 indexing: row chunks below 2^31 elements, each chunk's dw summed here in fp32 in
    # chunk order (deterministic)
    rows = (_MAX_FLAT - pad * N) // max(sx, sdy, sdh, N) // pad * pad  # whole padded tiles: only the last chunk
    if rows < pad:  # writes past its own rows (into the allocation's padding)
        raise ValueError(f"a row of {N} elements is too long for int32 indexing; use mode='torch'")
    starts = list(range(0, M, rows))
    dw_chunks = torch.empty(len(starts), N, dtype=torch.float32, device=device) if need_dw else None
    for i, r0 in enumerate(starts):
        one(r0, min(rows, M - r0), dw_chunks[i] if need_dw else None)
    if need_dw:
        dw.copy_(dw_chunks.sum(dim=0))
    return dx, dw


# ================================================================================================
# The backend
# ================================================================================================
@dataclass(frozen=True)
class CuTileBackward:
    """The persistent backward, shared by every cuTile mode (the forward's mode picks the forward)."""

    def config(self, N: int, dtype: torch.dtype, dev: DeviceInfo, w_dtype: torch.dtype | None = None,
               has_dh: bool = False, full: bool = True) -> BwdConfig:
        """`full`: the launch reads a weight and writes dx and dw (rmsnorm_bwd_config.SPILLING_PIECES)."""
        return default_config(N, dtype.itemsize, dev, str(dtype).removeprefix("torch."), w_dtype == torch.float32,
                              has_dh, full)

    def describe(self, M: int, N: int, dtype: torch.dtype, dev: DeviceInfo, w_dtype: torch.dtype | None = None,
                 has_dh: bool = False) -> str:
        cfg, source = config_and_source(N, dtype.itemsize, dev, str(dtype).removeprefix("torch."),
                                        w_dtype == torch.float32, has_dh)
        R = grid_rows(cfg, M, dev.sm_count)
        return (f"cuTile rms_norm_bwd_kernel (persistent), grid ({R * cfg.split},) = {R} row groups x {cfg.split} "
                f"parts, {cfg.short()}; config: {source}")

    adds_dh = True  # dh (the residual add's backward) is read with the row and added in the kernel

    def backward(self, dy2d, x2d, weight, rstd, offset, need_dx, need_dw, dev: DeviceInfo,
                 cfg: BwdConfig | None = None, out: tuple | None = None, dh2d=None):
        cfg = cfg or self.config(x2d.shape[1], x2d.dtype, dev, weight.dtype if weight is not None else None,
                                 dh2d is not None and need_dx, weight is not None and need_dx and need_dw)
        return launch(cfg, dy2d, x2d, weight, rstd, offset, need_dx, need_dw, dev.sm_count, out, dh2d)


PERSISTENT_BACKWARD = CuTileBackward()
