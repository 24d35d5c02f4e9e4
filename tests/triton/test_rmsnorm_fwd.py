"""Triton RMSNorm forward (cutile_norms/triton/rmsnorm_fwd.py).

CPU (Triton's interpreter, small shapes) and GPU: y and rstd against the fp64 reference on
NaN-poisoned outputs, over dtype pairs, widths (narrow rows several per tile, 2^k +- 1, odd, split
rows, chunked parts), weight None, offset, strided rows; the config rules for both vendors; through
rms_norm(mode="triton"). GPU only: full-size rows, M * N >= 2^31, CUDA graphs.
"""
from __future__ import annotations

import pytest
import torch

from tests.conftest import assert_close, check_forward, poisoned, random_rows, random_weight, reference64
from tests.triton._util import DEVICES, device_for, sync

DT = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
DTYPES = [("bfloat16", "bfloat16"), ("float16", "float32"), ("float32", "float32"), ("bfloat16", None)]
EPS = 1e-6


def _run(x, w, offset, device, cfg=None, store_rstd=True):
    from cutile_norms.triton.rmsnorm_fwd import TRITON_FORWARD

    M, N = x.shape
    y = poisoned(torch.empty(M, N, dtype=x.dtype, device=x.device))
    rstd = poisoned(torch.empty(M, dtype=torch.float32, device=x.device)) if store_rstd else None
    out = TRITON_FORWARD.forward(x, w, EPS, offset, store_rstd, device_for(device), cfg=cfg, out=(y, rstd))
    sync(device)
    return out


def _check(x, w, offset, y, rstd, what, seed):
    check_forward(x, w, EPS, offset, y, rstd, what, seed)


# ------------------------------------------------------------------------------------------------
# Config rules (CPU)
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("N", [1, 7, 128, 700, 1000, 2880, 4000, 4096, 4097, 8191, 8192, 16384, 16385, 22529,
                               30000, 40000, 262144,
                               1 << 20, 3_000_017])
@pytest.mark.parametrize("e", [2, 4])
@pytest.mark.parametrize("vendor,sms", [("nvidia", 132), ("amd", 304), ("nvidia", 20)])
def test_config_covers_the_row(N, e, vendor, sms):
    from cutile_norms.triton.rmsnorm_fwd_config import (PART_ELEMS, ROW_ELEMS, SPLIT_FROM, SPLIT_MAX, TILE_ELEMS,
                                                        analytic_config, grid_programs)

    cfg = analytic_config(N, e, vendor, sms)
    if N <= SPLIT_FROM:  # wider rows split over programs (measured, see the module)
        assert cfg.split == 1 and cfg.part == N
    else:
        assert 1 < cfg.split <= min(SPLIT_MAX, sms) and cfg.split * cfg.part >= N and cfg.part % 16 == 0
    assert cfg.block_n * cfg.chunks >= cfg.part and cfg.block_n & (cfg.block_n - 1) == 0
    assert cfg.programs_per_sm == 0  # one program per tile (per part)
    assert grid_programs(cfg, 1000, sms) == -(-1000 // cfg.rows) * cfg.split
    if vendor == "nvidia" and 1536 <= N * e <= (112 if e == 4 else 64) * 1024:  # (test_fixed_rows)
        assert cfg.fixed_n and cfg.rows == 1 and cfg.block_n * (cfg.chunks - 1) < N <= cfg.block_n * cfg.chunks
    elif N <= ROW_ELEMS // 2 or N in (ROW_ELEMS, 4000):  # the row in registers, several rows per tile when narrow
        assert cfg.chunks == 1 and cfg.rows * cfg.block_n <= TILE_ELEMS
    elif e == 2 and N in (8191, 8192):  # 16-bit rows of 7168-8192: the row in registers, straight-line code
        assert cfg.rows == 1 and cfg.chunks == 1 and cfg.block_n == 2 * ROW_ELEMS and cfg.one_tile
    elif cfg.split == 1 or cfg.part > PART_ELEMS:  # two passes over chunks of a row (part), little padding
        assert cfg.rows == 1 and cfg.chunks > 1 and cfg.block_n * (cfg.chunks - 1) < cfg.part
    else:  # a part in registers
        assert cfg.rows == 1 and cfg.chunks == 1
    lanes = 64 if vendor == "amd" else 32
    assert cfg.num_warps * lanes <= 1024 and (vendor != "amd" or cfg.num_warps <= 16)


@pytest.mark.parametrize("e", [2, 4])
def test_fixed_rows(e):
    """NVIDIA rows of 1.5-64 KiB: two passes with N compiled in, 2 / 4 / 8 / 16 / 32
    warps to 2.5 / 5 / 12 / 35 / 64 KiB rows (FIXED_WARPS' measured edges), chunks of 16 values a
    thread to 16 warps and 8192 elements at 32; AMD GPUs and the rows on either side keep the other forms."""
    from cutile_norms.triton.rmsnorm_fwd_config import analytic_config, fixed_config

    for row_bytes, warps in ((1536, 2), (2048 + 16, 2), (2560, 2), (2560 + 16, 4), (5 * 1024, 4), (5 * 1024 + 16, 8),
                             (8192, 8), (12 * 1024, 8), (12 * 1024 + 16, 16), (35 * 1024, 16),
                             (35 * 1024 + 16, 32), (64 * 1024, 32)):
        N = row_bytes // e
        cfg = analytic_config(N, e, "nvidia", 132)
        assert cfg == fixed_config(N, e) and cfg.fixed_n and cfg.num_warps == warps, (row_bytes, cfg)
        assert cfg.block_n == min(8192, 16 * 32 * warps) and cfg.chunks == -(-N // cfg.block_n)
        assert not analytic_config(N, e, "amd", 304).fixed_n
    for row_bytes in (1536 - 16, 112 * 1024 + 16) + ((64 * 1024 + 16,) if e == 2 else ()):
        assert fixed_config(row_bytes // e, e) is None and not analytic_config(row_bytes // e, e, "nvidia", 132).fixed_n


def test_fixed_fp32_rows_of_64_to_112_kib():
    """fp32 rows past 64 KiB up to 112 KiB (at most FIXED_MAX_ELEMS elements): 32 warps, chunks of 8192
    to 80 KiB and of 16384 from 88 KiB; 16-bit rows of those bytes (more elements) are not taken."""
    from cutile_norms.triton.rmsnorm_fwd_config import fixed_config

    for N, block in ((16388, 8192), (20480, 8192), (22528, 16384), (28672, 16384)):
        cfg = fixed_config(N, 4)
        assert cfg is not None and cfg.num_warps == 32 and cfg.block_n == block and cfg.chunks == -(-N // block), cfg
        assert fixed_config(2 * N, 2) is None


# ------------------------------------------------------------------------------------------------
# The kernel against the reference (interpreter on the CPU, compiled on the GPU)
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("N", [1, 7, 128, 129, 700, 1000, 1128, 2880, 4097, 7200, 9880, 20000, 22529, 30000])
@pytest.mark.parametrize("x_dtype,w_dtype", DTYPES)
@pytest.mark.parametrize("M", [1, 37])
def test_matches_reference(seed, device, N, x_dtype, w_dtype, M):
    x = random_rows((M, N), DT[x_dtype], device)
    w = random_weight(N, DT[w_dtype], device) if w_dtype else None
    offset = 0.5 if w is not None and M > 1 else 0.0  # both kernel variants: with and without the offset's add
    y, rstd = _run(x, w, offset, device)
    _check(x, w, offset, y, rstd, f"N={N} M={M} {x_dtype}/{w_dtype}", seed)


# (rows, split, part, block_n, chunks, N): shapes the heuristic picks only for far wider rows or other
# GPUs: chunked parts (two passes), several rows per split tile, a short last part
# (rows, split, part, block_n, chunks, N, prefetch, programs_per_sm): prefetching programs walk several
# tiles (13 rows over the interpreter's 4 "SMs"); programs_per_sm 0 = one program per tile (split rows:
# the forward's straight-line ONE_TILE code, parts in registers or in chunks)
CONFIG_CASES = [(1, 1, 1000, 128, 8, 1000, False, 1), (2, 2, 512, 128, 4, 1000, False, 1),
                (4, 4, 256, 256, 1, 1000, False, 1), (1, 8, 4096, 1024, 4, 30001, False, 1),
                (4, 1, 300, 512, 1, 300, False, 1), (2, 1, 300, 512, 1, 300, True, 1),
                (1, 2, 512, 512, 1, 1000, True, 2), (1, 4, 2064, 4096, 1, 8200, False, 0),
                (1, 4, 2000, 512, 4, 8000, False, 0)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("rows,split,part,block_n,chunks,N,prefetch,pps", CONFIG_CASES)
@pytest.mark.parametrize("x_dtype,w_dtype", [("bfloat16", "float32"), ("float32", "float32")])
def test_configs_match_reference(seed, device, rows, split, part, block_n, chunks, N, prefetch, pps, x_dtype,
                                  w_dtype):
    from cutile_norms.triton.rmsnorm_fwd_config import FwdConfig

    cfg = FwdConfig(rows=rows, split=split, part=part, block_n=block_n, chunks=chunks, num_warps=4,
                    programs_per_sm=pps, prefetch=prefetch)
    for M in (1, 13):
        x = random_rows((M, N), DT[x_dtype], device)
        w = random_weight(N, DT[w_dtype], device)
        y, rstd = _run(x, w, 1.0, device, cfg=cfg)
        _check(x, w, 1.0, y, rstd, f"{cfg.short()} M={M}", seed)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("N", [64, 1000, 20000])
def test_strided_rows_and_no_rstd(seed, device, N):
    """x's rows a view of a wider tensor at an odd offset; rstd not stored (inference)."""
    base = random_rows((9, N + 37), torch.bfloat16, device)
    x = base[:, 3:N + 3]
    w = random_weight(N, torch.bfloat16, device)
    y, rstd = _run(x, w, 0.0, device, store_rstd=False)
    assert rstd is None
    _check(x, w, 0.0, y, None, "strided", seed)


@pytest.mark.parametrize("device", DEVICES)
def test_through_rms_norm(seed, device):
    """rms_norm(mode="triton") on 3-D x: forward and backward through autograd against the reference."""
    import cutile_norms as cn
    from tests.conftest import assert_grad_close, reference_bwd64

    x = random_rows((2, 5, 300), torch.float32, device).requires_grad_()
    w = random_weight(300, torch.float32, device).requires_grad_()
    y = cn.rms_norm(x, w, EPS, mode="triton", offset=0.25)
    dy = torch.randn_like(y)
    y.backward(dy)
    x2, dy2 = x.detach().reshape(-1, 300), dy.reshape(-1, 300)
    assert_close(y.detach().reshape(-1, 300), reference64(x2, w.detach(), EPS, 0.25)[0], torch.float32, "y", seed)
    ex, ew, sx, sw = reference_bwd64(x2, w.detach(), dy2, EPS, 0.25)
    assert_grad_close(x.grad.reshape(-1, 300), ex, sx, torch.float32, "dx", seed)
    assert_grad_close(w.grad, ew, sw, torch.float32, "dw", seed)
    assert "Triton rms_norm_fwd_kernel" in cn.explain(x.detach(), w.detach(), mode="triton")


# ------------------------------------------------------------------------------------------------
# GPU only
# ------------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("N", [128, 2880, 4096, 8192, 16383, 32768, 65537, 262144])
@pytest.mark.parametrize("x_dtype,w_dtype", [("bfloat16", "bfloat16"), ("float16", "float16"), ("float32", "float32"),
                                             ("bfloat16", "float32")])
@pytest.mark.parametrize("M", [1, 300, 4099])
def test_gpu_widths(seed, N, x_dtype, w_dtype, M):
    M = min(M, (1 << 26) // N)  # the fp64 reference of the widest rows stays in memory
    x = random_rows((M, N), DT[x_dtype], "cuda")
    w = random_weight(N, DT[w_dtype], "cuda")
    y, rstd = _run(x, w, 0.0, "cuda")
    _check(x, w, 0.0, y, rstd, f"N={N} M={M}", seed)


@pytest.mark.gpu
@pytest.mark.parametrize("N", [1032, 4104, 8192, 11000, 17640, 24000, 32768])
@pytest.mark.parametrize("x_dtype,w_dtype", DTYPES)
def test_fixed_rows_through_the_call_plan(seed, N, x_dtype, w_dtype):
    """rms_norm(mode="triton") at rows of N compiled in: the call plan's runner (the compiled kernel's own
    launcher) on contiguous rows, rows at a stride of N + 8, misaligned rows (its fallback to the JIT
    launch), one row, 3-D, 1-D and [1, 1, N] x (read in place by pointer; misaligned 3-D x falls back),
    and autograd's forward (rstd stored), each called three times with new values, the outputs poisoned
    before each call."""
    import cutile_norms as cn

    dt = DT[x_dtype]
    w = random_weight(N, DT[w_dtype], "cuda") if w_dtype else None
    offset = 0.5 if w is not None else 0.0
    base = random_rows((37, N + 8), dt, "cuda")
    layouts = {"contiguous": lambda b: b[:, :N].contiguous(), "stride N+8": lambda b: b[:, :N],
               "misaligned": lambda b: b[:, 1:N + 1] if N % 2 == 0 else b[:, 3:N + 3],
               "one row": lambda b: b[5:6, 8:N + 8], "3-D": lambda b: b[:36, :N].reshape(4, 9, N),
               "1-D": lambda b: b[7, :N].contiguous(), "[1, 1, N]": lambda b: b[9:10, :N].reshape(1, 1, N),
               "3-D misaligned": lambda b: b.view(-1)[1:1 + 36 * N].view(4, 9, N)}
    for name, view in layouts.items():
        for call in range(3):
            base.copy_(random_rows(base.shape, dt, "cuda"))
            x = view(base)
            cn.rms_norm(x, w, EPS, offset=offset, mode="triton").fill_(float("nan"))  # a poisoned allocation
            y = cn.rms_norm(x, w, EPS, offset=offset, mode="triton")
            torch.cuda.synchronize()
            assert y.shape == x.shape and y.is_contiguous(), (name, tuple(y.shape), y.stride())
            x2, y2 = x.reshape(-1, N), y.reshape(-1, N)
            assert_close(y2, reference64(x2, w, EPS, offset)[0], dt, f"{name} call {call}", seed)
    xg = base[:, :N].detach().clone().requires_grad_()
    y = cn.rms_norm(xg, w, EPS, offset=offset, mode="triton")
    assert_close(y.detach(), reference64(xg.detach(), w, EPS, offset)[0], dt, "autograd's forward", seed)
    from cutile_norms.triton.rmsnorm_fwd_config import fixed_config

    kernel = "rms_norm_fwd_fixed_kernel" if fixed_config(N, dt.itemsize) else "rms_norm_fwd_kernel,"
    assert kernel in cn.explain(xg.detach(), w, mode="triton")


@pytest.mark.gpu
@pytest.mark.parametrize("N", [4096, 65536])
def test_cuda_graph(seed, N):
    """The forward captured and replayed with new inputs (split rows: the counters count on)."""
    import cutile_norms as cn

    x = random_rows((64, N), torch.bfloat16, "cuda")
    w = random_weight(N, torch.bfloat16, "cuda")
    cn.rms_norm(x, w, EPS, mode="triton")  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = cn.rms_norm(x, w, EPS, mode="triton")
    for _ in range(3):
        x.copy_(random_rows((64, N), torch.bfloat16, "cuda"))
        y.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        _check(x, w, 0.0, y, None, "graph replay", seed)
    y2 = cn.rms_norm(x, w, EPS, mode="triton")  # eager after the graph
    _check(x, w, 0.0, y2, None, "eager after graph", seed)


@pytest.mark.gpu
@pytest.mark.big
def test_past_int32_indexing(seed):
    """M * N > 2^31 (bf16, N = 8192): int64 row offsets; the fp64 check on rows at both ends."""
    M, N = (1 << 31) // 8192 + 64, 8192
    free, _ = torch.cuda.mem_get_info()
    if free < 3 * M * N * 2 + (4 << 30):
        pytest.skip(f"needs ~{3 * M * N * 2 >> 30} GiB of free GPU memory")
    x = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
    w = random_weight(N, torch.bfloat16, "cuda")
    y, rstd = _run(x, w, 0.0, "cuda")
    for rows in (slice(0, 64), slice(M - 64, M)):
        ey, er = reference64(x[rows], w, EPS, 0.0)
        assert_close(y[rows], ey, torch.bfloat16, f"rows {rows}", seed)
        assert_close(rstd[rows], er, torch.float32, f"rstd rows {rows}", seed)
