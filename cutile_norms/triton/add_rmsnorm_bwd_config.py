"""The launch rule of the fused residual add + RMSNorm backward in Triton (pure Python: imports without
Triton)."""
from __future__ import annotations

from .._platform import DeviceInfo
from .._util import pow2_ceil
from .add_rmsnorm_fwd_config import MAX_ROWS
from .rmsnorm_bwd_config import tma_rows_align, tma_rows_rule, tma_rows_take
from .tiling import tma_addressable


def config(N: int) -> tuple[int, int, int]:
    """(BLOCK_N, ROWS, num_warps) of the backward. Measured on an H100, bf16, 2^27 elements, a
    persistent grid of 2 programs per SM (`python bench/tune/triton_fused.py --kernel bwd --ns
    1536,2048,2560,4096,5120,8192`, 2026-11-25; ratio to a copy of its bytes): 8192-element tiles
    up to 2048-wide blocks and 16384 above, 64 values a thread (2048: 0.977, 4096: 0.961, 8192:
    0.936, where 2048 elements and 8 values a thread gave 0.921 / 0.886 / 0.784); a width its
    power-of-two block pads by more than 1/8 did best at 16384-element tiles, with 16 warps from
    4096-wide blocks (2560: 0.896, 5120: 0.868; 1536: 8 warps, 0.907). Two programs per SM led four
    and eight at every width."""
    block = pow2_ceil(N)
    padded = 8 * N < 7 * block
    tile = 16384 if padded or block > 2048 else 8192
    rows = max(1, min(MAX_ROWS, tile // block))
    warps = 16 if padded and block >= 4096 else tile // 2048
    return block, rows, max(1, min(16, block * rows // 1024, warps))


def tma_rows(N: int, elem_bytes: int, dev: DeviceInfo | None) -> dict:
    """The fields of rmsnorm_bwd_config.BwdConfig with which rows of N elements of elem_bytes and a dh run
    Triton's TMA rows kernel reading dh on `dev` (NVIDIA sm_90+, 16-bit rows of a multiple of 8 columns,
    the GPU model's TmaRowsRule's dh bands), or {} where they run the kernel above (add_rmsnorm_bwd.py)."""
    if (dev is None or dev.vendor != "nvidia" or dev.arch is None or dev.arch < (9, 0) or elem_bytes != 2
            or N % 8):
        return {}
    return tma_rows_take(N, elem_bytes, tma_rows_rule(dev), dh=True)


def tensors_take_tma(dy2d, dh2d, h2d, g_dtype) -> bool:
    """Whether a call's [M, N] rows (dy, dh or None, h; the grad into h in g_dtype) are ones the TMA rows
    kernel reading dh takes where `tma_rows` gives their width: dh given, dy, dh, h and the grad of one
    16-bit dtype, rows TMA can address (tiling.tma_addressable; rmsnorm_bwd_config.tma_rows_align: 32-byte
    aligned past DH_ONE_BLOCK columns). dispatch.residual_backward asks it before choosing that form, and the
    wrapper (add_rmsnorm_bwd.py) runs it on the same answer."""
    if dh2d is None or not (dy2d.dtype == dh2d.dtype == h2d.dtype == g_dtype) or h2d.element_size() != 2:
        return False
    M, N = h2d.shape
    rows = [(t, t.stride(0) if M > 1 else N) for t in (dy2d, dh2d, h2d)]
    return tma_addressable(*rows, align=tma_rows_align(N, dh=True))
