"""The residual add fused into the tma_smem_cached forward (cutile_norms/cute/add_rmsnorm_fwd*.py).

CPU: the config (the forward's, 256 threads for rows held in one CTA) and every variant the library
launches compiled to sm_90a and sm_100a cubins (CUTE_DSL_ARCH), two bulk copies (x's and r's) in the
PTX, within the spills stated. GPU (`gpu`): called directly with y, h and rstd poisoned with NaN; h bit
for bit the fp32 sum rounded once (torch.add's bits), y and rstd against the fp64 norm of h as stored;
dtype pairs, weight None, offset, narrow rows several to a tile, rows in one CTA, rows over clusters,
tail tiles, one row, strided x or r, in place; through rms_norm(mode="tma_smem_cached") with autograd
and in a CUDA graph; what it does not take runs the add unfused (rows past 2^32 elements:
tests/test_past_2_32.py).
"""
from __future__ import annotations

import pytest
import torch

import cutile_norms as cn
from cutile_norms import dispatch
from cutile_norms.cute.add_rmsnorm_fwd_config import ONE_CTA_THREADS, add_config
from cutile_norms.cute.rmsnorm_fwd_config import ONE_CTA_BYTES, SLICE_BYTES, SMEM_MAX, analytic_config
from tests.conftest import (assert_close, assert_grad_close, assert_stored_sum, poisoned, random_rows, random_weight,
                            reference64, reference_bwd64)

DT = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
EPS = 1e-6


@pytest.mark.parametrize("elem_bytes", [2, 4])
@pytest.mark.parametrize("N", [8, 1000, 4104, 8200, 10240, 20480, 24576, 24584, 65536, 262144, 524288])
def test_config_is_the_forwards_with_more_threads_in_one_cta(N, elem_bytes):
    """The forward's config, but 16-bit rows held in one CTA over ONE_CTA_THREADS threads; none where x's
    and r's tiles would not fit."""
    cfg, fwd = add_config(N, elem_bytes), analytic_config(N, elem_bytes)
    if cfg is None:
        assert fwd is None or fwd.smem_bytes(elem_bytes, N, operands=2) > SMEM_MAX
        return
    assert cfg.smem_bytes(elem_bytes, N, operands=2) <= SMEM_MAX
    if elem_bytes == 2 and SLICE_BYTES < N * elem_bytes <= ONE_CTA_BYTES:
        assert cfg.cluster_n == 1 and cfg.threads == max(ONE_CTA_THREADS, fwd.threads)
        assert cfg.tpr * cfg.nvb * cfg.vec >= N
    else:
        assert cfg == fwd


COMPILE = [(N, x, w) for N in (64, 1000, 2880, 4096, 7168, 10240, 20480, 24568, 32768, 131072)
           for x, w in (("bfloat16", "bfloat16"), ("float16", "float32"), ("float32", "float32"))
           if N % (16 // DT[x].itemsize) == 0]


def _spills_allowed(N, x, w):
    """ptxas's spill stores (sm_90a) the variants are known to need: fp32 rows of 128-512 B and fp32
    weights under 16-bit rows of 10 KiB (a few words); none elsewhere."""
    return 8 if (x == "float32" and N * 4 <= 512) or (w == "float32" and x != "float32" and N * 2 <= 10240) else 0


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
@pytest.mark.parametrize("N,x,w", COMPILE)
def test_compiles(N, x, w, arch):
    from cutile_norms.cute.rmsnorm_fwd import compile_forward
    from tests.cute.ptx_util import check_kernel_ptx

    pytest.importorskip("cutlass")
    cfg = add_config(N, DT[x].itemsize)
    for contiguous in (True, False):
        fn = compile_forward(DT[x], DT[w], N, cfg, True, contiguous, arch, keep_ptx=True, has_residual=True)
        check_kernel_ptx(fn.__ptx__, arch, spills_at_most=_spills_allowed(N, x, w))
        assert fn.__ptx__.count("cp.async.bulk.shared::cluster.global") == 2  # x's rows, r's rows


# ---- GPU ------------------------------------------------------------------------------------------
def run_and_check(s, M, N, x_dtype, w_dtype, offset, x_pad=0, r_pad=0, in_place=False, store_rstd=True):
    from cutile_norms.cute.add_rmsnorm_fwd import add_rms_norm_fwd, unsupported

    x = random_rows((M, N + x_pad), x_dtype, "cuda")[:, :N]
    r = random_rows((M, N + r_pad), x_dtype, "cuda")[:, :N]
    w = random_weight(N, w_dtype, "cuda") if w_dtype else None
    assert unsupported(x, r, x_dtype) is None
    x0, r0 = x.clone(), r.clone()
    if in_place:
        y, h, rstd = add_rms_norm_fwd(x, r, w, EPS, offset, x_dtype, store_rstd, out=(x, r))
        assert y.data_ptr() == x.data_ptr() and h.data_ptr() == r.data_ptr()
    else:
        out = (poisoned(torch.empty(M, N, dtype=x_dtype, device="cuda")),
               poisoned(torch.empty(M, N, dtype=x_dtype, device="cuda")))
        y, h, rstd = add_rms_norm_fwd(x, r, w, EPS, offset, x_dtype, store_rstd, out=out)
        assert torch.equal(x, x0) and torch.equal(r, r0), "an input was written"
    torch.cuda.synchronize()
    what = f"M={M} N={N} x={x_dtype} w={w_dtype} offset={offset} pads={x_pad},{r_pad} in_place={in_place}"
    assert_stored_sum(h, x0, r0, what, s)
    ey, er = reference64(h, w, EPS, offset)
    assert y.dtype == x_dtype
    assert_close(y, ey, x_dtype, f"{what} y", s)
    if store_rstd:
        assert_close(rstd, er, torch.float32, f"{what} rstd", s)
    else:
        assert rstd is None


WIDTHS = [8, 64, 136, 1000, 2880, 4104, 5120, 8192, 10240, 16392, 20480, 24568, 32768, 65528, 131072, 262144]


@pytest.mark.gpu
@pytest.mark.parametrize("N", WIDTHS)
@pytest.mark.parametrize("x_dtype,w_dtype", [("bfloat16", "bfloat16"), ("float16", "float32"), ("float32", "float32"),
                                             ("bfloat16", None)])
@pytest.mark.parametrize("M", [1, 37, 300])
def test_matches_reference(seed, N, x_dtype, w_dtype, M):
    if N % (16 // DT[x_dtype].itemsize) or add_config(N, DT[x_dtype].itemsize) is None:
        pytest.skip("a width the kernel does not take (test_what_it_does_not_take_runs_unfused)")
    run_and_check(seed, M, N, DT[x_dtype], DT[w_dtype] if w_dtype else None, 0.5 if w_dtype else 0.0)


@pytest.mark.gpu
@pytest.mark.parametrize("N", [128, 4096, 20480, 65536])
@pytest.mark.parametrize("x_pad,r_pad", [(8, 0), (0, 64), (16, 8)])
def test_strided_rows(seed, N, x_pad, r_pad):
    run_and_check(seed, 50, N, torch.bfloat16, torch.bfloat16, 0.0, x_pad=x_pad, r_pad=r_pad)


@pytest.mark.gpu
@pytest.mark.parametrize("N", [512, 8192, 24576, 131072])
def test_in_place_and_inference(seed, N):
    run_and_check(seed, 33, N, torch.bfloat16, torch.bfloat16, 1.0, in_place=True)
    run_and_check(seed, 33, N, torch.float16, None, 0.0, store_rstd=False)


@pytest.mark.gpu
@pytest.mark.parametrize("N", [2048, 20480, 65536])
def test_through_rms_norm_with_autograd(seed, N, monkeypatch):
    """mode="tma_smem_cached" with a residual runs this kernel (explain says so); the backward (dx = dr,
    dw) is the mode's with dh read inside."""
    monkeypatch.setenv("CUTILE_NORMS_FUSED", "1")
    x = random_rows((64, N), torch.bfloat16, "cuda").requires_grad_()
    r = random_rows((64, N), torch.bfloat16, "cuda").requires_grad_()
    w = random_weight(N, torch.bfloat16, "cuda").requires_grad_()
    assert f"fused into the norm ({dispatch.FUSED_ADD_CUTE_KERNEL}" in cn.explain(x, residual=r, mode="tma_smem_cached")
    y, h = cn.rms_norm(x, w, EPS, residual=r, mode="tma_smem_cached")
    assert_stored_sum(h.detach(), x.detach(), r.detach(), f"N={N} h", seed)
    assert_close(y.detach(), reference64(h.detach(), w.detach(), EPS, 0.0)[0], torch.bfloat16, f"N={N} y", seed)
    dy, dh = random_rows((64, N), torch.bfloat16, "cuda"), random_rows((64, N), torch.bfloat16, "cuda")
    torch.autograd.backward((y, h), (dy, dh))
    g, gw, sg, sw = reference_bwd64(h.detach(), w.detach(), dy, EPS, 0.0)
    for t, name in ((x, "dx"), (r, "dr")):
        assert_grad_close(t.grad, g + dh.double(), sg + dh.double().abs(), torch.bfloat16, f"N={N} {name}", seed)
    assert_grad_close(w.grad, gw, sw, torch.bfloat16, f"N={N} dw", seed)


@pytest.mark.gpu
def test_what_it_does_not_take_runs_unfused(seed, monkeypatch):
    """An fp32 residual under bf16 x, a misaligned r: the add runs unfused before the mode's norm (explain
    says why), with the same results."""
    monkeypatch.setenv("CUTILE_NORMS_FUSED", "1")
    x = random_rows((8, 4096), torch.bfloat16, "cuda")
    w = random_weight(4096, torch.bfloat16, "cuda")
    r32 = random_rows((8, 4096), torch.float32, "cuda")
    rm = random_rows((8, 4096 + 8), torch.bfloat16, "cuda")[:, 1:4097]  # 2 bytes past a 16-byte boundary
    for r, h_dtype, why in ((r32, torch.float32, "residual of x's dtype"), (rm, None, "aligned")):
        text = cn.explain(x, residual=r, mode="tma_smem_cached", residual_dtype=h_dtype)
        assert "torch.add into h" in text and why in text, text
        y, h = cn.rms_norm(x, w, EPS, residual=r, residual_dtype=h_dtype, mode="tma_smem_cached")
        assert_stored_sum(h, x, r, f"unfused h {why}", seed)
        assert_close(y, reference64(h, w, EPS, 0.0)[0], torch.bfloat16, f"unfused y {why}", seed)


@pytest.mark.gpu
def test_cuda_graph_replay(seed):
    N = 8192
    x, r = random_rows((256, N), torch.bfloat16, "cuda"), random_rows((256, N), torch.bfloat16, "cuda")
    w = random_weight(N, torch.bfloat16, "cuda")
    cn.add_rms_norm_(x.clone(), r.clone(), w, mode="tma_smem_cached")  # compile outside the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        cn.add_rms_norm_(x, r, w, mode="tma_smem_cached")
    x0, r0 = random_rows((256, N), torch.bfloat16, "cuda"), random_rows((256, N), torch.bfloat16, "cuda")
    x.copy_(x0)
    r.copy_(r0)
    g.replay()
    torch.cuda.synchronize()
    assert_stored_sum(r, x0, r0, "graph replay h", seed)
    assert_close(x, reference64(r, w, EPS, 0.0)[0], torch.bfloat16, "graph replay y", seed)


def test_one_row_is_judged_as_its_batch_for_mode_none():
    """mode=None's refusal (residual._fused_forward): one row of tensors whose rows are not 16-byte
    aligned is refused as its batch is, so it runs the batch's kernel and gives its bits; by name one row
    at any stride is taken."""
    from cutile_norms.cute.add_rmsnorm_fwd import unsupported

    N = 20480
    x = torch.randn(4, N + 4, dtype=torch.bfloat16)[:, :N]  # rows 8 bytes apart from 16-byte multiples
    r = torch.randn(4, N, dtype=torch.bfloat16)
    assert unsupported(x, r, torch.bfloat16) and unsupported(x, r, torch.bfloat16, batch_invariant=True)
    assert unsupported(x[:1], r[:1], torch.bfloat16) is None
    assert "row stride" in unsupported(x[:1], r[:1], torch.bfloat16, batch_invariant=True)
    assert unsupported(r[:1], r[:1], torch.bfloat16, batch_invariant=True) is None
