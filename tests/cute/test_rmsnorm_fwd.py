"""tma_smem_cached forward (cutile_norms/cute/rmsnorm_fwd.py) on the GPU: y and rstd against the fp64
reference on NaN-poisoned outputs over dtype pairs, widths (narrow rows several per tile, 2^k +- 8,
odd multiples of the vector, rows split over clusters), weight None, offset, strided rows, M from 1 up;
M symbolic (no recompile when only M changes); the widths and alignments it refuses (a clear error,
and mode=None runs another mode); autograd through rms_norm; CUDA graphs; M * N >= 2^31.
"""
from __future__ import annotations

import pytest
import torch

import cutile_norms as cn
from tests.conftest import (assert_grad_close, check_forward, poisoned, random_rows, random_weight,
                            reference_bwd64)

pytestmark = pytest.mark.gpu

DT = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
DTYPES = [("bfloat16", "bfloat16"), ("float16", "float32"), ("float32", "float32"), ("bfloat16", None)]
EPS = 1e-6


def _dev():
    from cutile_norms._platform import device_info
    return device_info("cuda")


def _run(x, w, offset, store_rstd=True, y=None):
    """`y`: the output to write (NaN-poisoned by the caller); else a poisoned one of x's shape."""
    from cutile_norms.cute.rmsnorm_fwd import TMA_SMEM_CACHED

    M, N = x.shape
    y = poisoned(torch.empty(M, N, dtype=x.dtype, device=x.device)) if y is None else y
    rstd = poisoned(torch.empty(M, dtype=torch.float32, device=x.device)) if store_rstd else None
    out = TMA_SMEM_CACHED.forward(x, w, EPS, offset, store_rstd, _dev(), out=(y, rstd))
    torch.cuda.synchronize()
    return out


def _check(x, w, offset, y, rstd, what, seed):
    check_forward(x, w, EPS, offset, y, rstd, what, seed)


WIDTHS = [8, 64, 128, 136, 1000, 2880, 4088, 4104, 5120, 7168, 16384, 16392, 22760, 24520, 33352, 40000, 65528,
          131072, 262144]


@pytest.mark.parametrize("N", WIDTHS)
@pytest.mark.parametrize("x_dtype,w_dtype", DTYPES)
@pytest.mark.parametrize("M", [1, 37, 300])
def test_matches_reference(seed, N, x_dtype, w_dtype, M):
    if N % (16 // DT[x_dtype].itemsize):
        pytest.skip("a width the mode refuses (test_refuses_what_it_cannot_take)")
    x = random_rows((M, N), DT[x_dtype], "cuda")
    w = random_weight(N, DT[w_dtype], "cuda") if w_dtype else None
    offset = 0.5 if w is not None else 0.0
    y, rstd = _run(x, w, offset)
    _check(x, w, offset, y, rstd, f"N={N} M={M} {x_dtype}/{w_dtype}", seed)


@pytest.mark.parametrize("N", [1000, 3000, 8200, 24520, 40000])
@pytest.mark.parametrize("M", [1, 37])
def test_no_store_past_the_rows(seed, N, M):
    """y given as the first M rows of a NaN-poisoned buffer of M + 1: the row after them stays NaN. A
    vector stored past a row's end lands in the next row (raced by that row's own store), past the last
    one in that spare row. Widths whose last pass of vectors reaches past the row in some threads: narrow
    tiles (1000, 3000), one CTA (8200, 24520), a cluster's last CTA (40000), whose stores stand apart
    from the vectors every thread holds inside the row (cute/_device.store_vectors)."""
    x = random_rows((M, N), torch.bfloat16, "cuda")
    w = random_weight(N, torch.bfloat16, "cuda")
    buf = poisoned(torch.empty(M + 1, N, dtype=x.dtype, device=x.device))
    y, rstd = _run(x, w, 0.5, y=buf[:M])
    assert torch.isnan(buf[M]).all(), f"N={N} M={M}: a store past the last row's end"
    _check(x, w, 0.5, y, rstd, f"N={N} M={M} inside a larger buffer", seed)


@pytest.mark.parametrize("N", [128, 4096, 16384, 65536])
@pytest.mark.parametrize("pad", [8, 64])
def test_strided_rows(seed, N, pad):
    base = random_rows((50, N + pad), torch.bfloat16, "cuda")
    x = base[:, :N]
    w = random_weight(N, torch.bfloat16, "cuda")
    y, rstd = _run(x, w, 0.0)
    _check(x, w, 0.0, y, rstd, f"N={N} stride {N + pad}", seed)


def test_inference_writes_no_rstd(seed):
    x = random_rows((33, 4096), torch.bfloat16, "cuda")
    y, rstd = _run(x, None, 0.0, store_rstd=False)
    assert rstd is None
    _check(x, None, 0.0, y, None, "no rstd", seed)


@pytest.mark.parametrize("M", [1, 2, 1000, 1 << 20])
def test_many_rows(seed, M):
    x = random_rows((M, 256), torch.bfloat16, "cuda")
    w = random_weight(256, torch.bfloat16, "cuda")
    y, rstd = _run(x, w, 0.0)
    _check(x, w, 0.0, y, rstd, f"M={M}", seed)


def test_m_is_symbolic_no_recompile(seed):
    from cutile_norms.cute import rmsnorm_fwd

    w = random_weight(2048, torch.bfloat16, "cuda")
    _run(random_rows((3, 2048), torch.bfloat16, "cuda"), w, 0.0)
    before = rmsnorm_fwd.CACHE.count
    for M in (1, 5, 64, 1000, 4097):
        x = random_rows((M, 2048), torch.bfloat16, "cuda")
        y, rstd = _run(x, w, 0.0)
        _check(x, w, 0.0, y, rstd, f"M={M}", seed)
    assert rmsnorm_fwd.CACHE.count == before


def test_refuses_what_it_cannot_take(seed):
    x = random_rows((4, 4097), torch.bfloat16, "cuda")  # N not a multiple of 8 bf16
    with pytest.raises(ValueError, match="16-byte"):
        cn.rms_norm(x, None, mode="tma_smem_cached")
    y = cn.rms_norm(x, None)  # mode=None runs another mode
    _check(x, None, 0.0, y, None, "mode=None N=4097", seed)
    mode_line = next(line for line in cn.explain(x).splitlines() if line.startswith("mode: "))
    assert "tma_smem_cached" not in mode_line, mode_line  # (a table row's evidence may name it as runner-up)
    base = random_rows((4, 4096 + 8), torch.bfloat16, "cuda")
    xm = base[:, 1:4097]  # starts 2 bytes past a 16-byte boundary
    with pytest.raises(ValueError, match="aligned"):
        cn.rms_norm(xm, None, mode="tma_smem_cached")
    _check(xm, None, 0.0, cn.rms_norm(xm, None), None, "mode=None misaligned", seed)


@pytest.mark.parametrize("x_dtype,w_dtype", DTYPES)
@pytest.mark.parametrize("N", [128, 4096, 65536])
def test_autograd_through_rms_norm(seed, x_dtype, w_dtype, N):
    x = random_rows((64, N), DT[x_dtype], "cuda").requires_grad_()
    w = random_weight(N, DT[w_dtype], "cuda").requires_grad_() if w_dtype else None
    offset = 1.0 if w is not None else 0.0
    y = cn.rms_norm(x, w, EPS, mode="tma_smem_cached", offset=offset)
    _check(x.detach(), None if w is None else w.detach(), offset, y.detach(), None, "autograd y", seed)
    dy = random_rows((64, N), DT[x_dtype], "cuda")
    y.backward(dy)
    dx, dw, dxs, dws = reference_bwd64(x.detach(), None if w is None else w.detach(), dy, EPS, offset)
    assert_grad_close(x.grad, dx, dxs, DT[x_dtype], "dx", seed)
    if w is not None:
        assert_grad_close(w.grad, dw, dws, w.dtype, "dw", seed)


def test_cuda_graph(seed):
    x = random_rows((256, 8192), torch.bfloat16, "cuda")
    w = random_weight(8192, torch.bfloat16, "cuda")
    cn.rms_norm(x, w, mode="tma_smem_cached")  # compile outside the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = cn.rms_norm(x, w, mode="tma_smem_cached")
    x.copy_(random_rows((256, 8192), torch.bfloat16, "cuda"))
    y.fill_(float("nan"))
    g.replay()
    torch.cuda.synchronize()
    _check(x, w, 0.0, y, None, "graph replay", seed)


@pytest.mark.big
def test_past_2_31_elements(seed):
    N = 8192
    M = (1 << 31) // N + 3
    x = torch.randn(M, N, dtype=torch.bfloat16, device="cuda")
    y = cn.rms_norm(x, None, mode="tma_smem_cached")
    tail = slice(M - 5, M)
    _check(x[tail], None, 0.0, y[tail], None, "M*N >= 2^31 tail rows", seed)
    _check(x[:3], None, 0.0, y[:3], None, "M*N >= 2^31 head rows", seed)

