"""Every GPU mode (and mode=None) past 2^32 elements: the inference forward, the forward that saves rstd
for autograd, and the backward (dx and dw), on bf16 x of M * N = 2^32 + 64 * N elements.

Offsets past 2^32 elements overflow a 32-bit element index even when it is read as unsigned (an index
below 2^32 can pass unnoticed as one), so the rows checked are the first, those on either side of the
2^31 and 2^32 element boundaries, the middle and the last, each against the fp64 reference; dw sums
every row (its fp64 reference is summed in row chunks). Five widths: 8192 (one CTA or block per row
tile), 16128 beside an fp32 weight (the H100's fp32-weight row of the 28-40 KiB band: mode=None's
backward runs the CuTe DSL kernel over 2 x 128 x 8 EVEN_SLICES, its last CTA part padded), 18432 (the
H100's band, where mode=None's backward runs the CuTe DSL kernel over 2 x 256 x 5 EVEN_SLICES), 50000
(a row no kernel tiles exactly: the CuTe DSL backward's last CTA part empty, over its EVEN_SLICES on both
GPU models) and 262144 (rows split over a cluster or over blocks). Each output is
poisoned before it is freed, so a later mode that leaves rows unwritten cannot pass on an earlier mode's
values. The residual add (fused and unfused: y, h, dx = dr, dw) and the FP8 output (q and scales, bit for
bit) on the same rows.

Marked `big`: x, dy, y and dx take ~8.6 GiB each (tests/run_sharded.py runs these alone).
"""
from __future__ import annotations

import pytest
import torch

import cutile_norms as cn
from cutile_norms import dispatch
from tests.conftest import (TOLERANCES, assert_close, assert_grad_close, assert_stored_sum, poisoned, random_rows,
                            random_weight, reference64, reference_bwd64)

pytestmark = [pytest.mark.gpu, pytest.mark.big]

EPS = 1e-6
# every mode with a GPU kernel: "torch" is the fp32 oracle made of torch ops (its indexing is torch's)
MODES = [m for m in dispatch.MODES if m != "torch"] + [None]
# N -> the weight's dtype (both kinds covered)
WIDTHS = {8192: torch.bfloat16, 16128: torch.float32, 18432: torch.bfloat16, 50000: torch.bfloat16,
          262144: torch.float32}
CHUNK_ELEMS = 1 << 27  # elements per chunk of the fp64 dw reference and of the input fill


def _rows_to_check(M: int, N: int) -> torch.Tensor:
    edges = [0, 1, M // 2, M - 1]
    for boundary in (1 << 31, 1 << 32):
        r = boundary // N
        edges += [r - 1, r, r + 1]
    return torch.tensor(sorted({r for r in edges if 0 <= r < M}), device="cuda")


def _random_big(M: int, N: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    t = torch.empty((M, N), dtype=dtype, device="cuda")
    step = max(1, CHUNK_ELEMS // N)
    for r0 in range(0, M, step):
        t[r0:r0 + step] = random_rows((min(step, M - r0), N), dtype, "cuda")
    return t


def _skip_unless_free(need: int) -> None:
    free, _ = torch.cuda.mem_get_info()
    if free < need:
        pytest.skip(f"needs ~{need >> 30} GiB of free GPU memory, {free >> 30} free")


def _dw_reference(x: torch.Tensor, dy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """dw's fp64 reference (and the magnitudes its tolerance scales with), summed over every row in chunks."""
    M, N = x.shape
    ew = torch.zeros(N, dtype=torch.float64, device="cuda")
    sw = torch.zeros_like(ew)
    step = max(1, CHUNK_ELEMS // N)
    for r0 in range(0, M, step):
        xc, dyc = x[r0:r0 + step].double(), dy[r0:r0 + step].double()
        t = dyc * xc * torch.rsqrt(xc.square().mean(dim=-1, keepdim=True) + EPS)
        ew += t.sum(dim=0)
        sw += t.abs().sum(dim=0)
        del xc, dyc, t
    return ew, sw


@pytest.fixture(scope="module", params=sorted(WIDTHS))
def big_inputs(request):
    N = request.param
    M = (1 << 32) // N + 64
    _skip_unless_free(4 * M * N * 2 + (6 << 30))  # x, dy, y, dx + the references' chunks
    torch.manual_seed(N)
    x = _random_big(M, N)
    dy = _random_big(M, N)
    w = random_weight(N, WIDTHS[N], "cuda")
    ew, sw = _dw_reference(x, dy)
    yield x, dy, w, ew, sw, _rows_to_check(M, N)
    del x, dy
    torch.cuda.empty_cache()


def _check_rows(y, x, w, rows, what, seed):
    ey, _ = reference64(x[rows], w, EPS, 0.0)
    assert_close(y[rows], ey, x.dtype, f"{what} rows {rows.tolist()}", seed)


@pytest.mark.parametrize("mode", MODES, ids=lambda m: str(m))
def test_forward_and_backward_past_2_32_elements(big_inputs, mode, seed):
    x, dy, w, ew, sw, rows = big_inputs
    M, N = x.shape
    why = cn.available_modes().get(mode) if mode is not None else None
    if why:
        pytest.skip(why)
    tag = f"mode={mode} x=bf16[{M}, {N}] w={str(w.dtype).removeprefix('torch.')}"

    with torch.no_grad():  # the inference path (no rstd)
        y = cn.rms_norm(x, w, EPS, mode=mode)
    torch.cuda.synchronize()
    _check_rows(y, x, w, rows, f"{tag} inference y", seed)
    poisoned(y)
    del y

    xg = x.detach().requires_grad_()
    wg = w.detach().clone().requires_grad_()
    y = cn.rms_norm(xg, wg, EPS, mode=mode)  # the forward that saves rstd
    torch.cuda.synchronize()
    _check_rows(y.detach(), x, w, rows, f"{tag} training y", seed)
    y.backward(dy)
    torch.cuda.synchronize()
    poisoned(y.detach())
    del y
    dx, dw = xg.grad, wg.grad
    assert dx is not None and dx.dtype == x.dtype and dx.shape == x.shape, f"{tag}: dx missing or wrong"
    assert dw is not None and dw.dtype == w.dtype and dw.shape == (N,), f"{tag}: dw missing or wrong"
    ex, _, sx, _ = reference_bwd64(x[rows], w, dy[rows], EPS, 0.0)
    assert_grad_close(dx[rows], ex, sx, x.dtype, f"{tag} dx rows {rows.tolist()}", seed)
    assert_grad_close(dw, ew, sw, w.dtype, f"{tag} dw", seed)
    poisoned(dx)
    del dx, xg
    torch.cuda.empty_cache()


@pytest.mark.parametrize("fused,mode", [(True, None), (True, "tma_smem_cached"), (True, "multi_wave_cached"),
                                        (False, None)], ids=["fused", "fused-cute", "fused-cutile", "unfused"])
def test_residual_add_past_2_32_elements(big_inputs, fused, mode, seed, monkeypatch):
    """rms_norm(x, w, residual=r) -> (y, h) and its backward (dx = dr, dw), the fused kernels (Triton's,
    or cuTile's split forward for rows past dispatch.FUSED_ADD_MAX_N; the CuTe DSL one and cuTile's split
    one named by their modes) and the unfused path; r is the
    fixture's dy, the grad of y its x, the grad into h from later uses r again (the backward reads dh
    inside the norm's backward kernel: past 2^31 elements the cuTile kernel's row chunks, the CuTe
    DSL kernel's 64-bit addresses)."""
    monkeypatch.setenv("CUTILE_NORMS_FUSED", "1" if fused else "0")
    x, r, w, _, _, rows = big_inputs
    M, N = x.shape
    tag = f"residual {'fused' if fused else 'unfused'} mode={mode} x=bf16[{M}, {N}]"
    xg, rg, wg = x.detach().requires_grad_(), r.detach().requires_grad_(), w.detach().clone().requires_grad_()
    y, h = cn.rms_norm(xg, wg, EPS, residual=rg, mode=mode)
    torch.cuda.synchronize()
    assert_stored_sum(h[rows], x[rows], r[rows], f"{tag} h rows {rows.tolist()}", seed)
    _check_rows(y.detach(), h.detach(), w, rows, f"{tag} y", seed)
    dy, dh = x, r  # any random rows
    torch.autograd.backward((y, h), (dy, dh))
    torch.cuda.synchronize()
    del y
    dx, dr, dw = xg.grad, rg.grad, wg.grad
    hr = h.detach()[rows]
    ex, _, sx, _ = reference_bwd64(hr, w, dy[rows], EPS, 0.0)
    if fused:  # dh read inside the norm's backward: the grad rounded once
        ex, sx = ex + dh[rows].double(), sx + dh[rows].double().abs()
        assert_grad_close(dx[rows], ex, sx, x.dtype, f"{tag} dx rows {rows.tolist()}", seed)
        assert_grad_close(dr[rows], ex, sx, r.dtype, f"{tag} dr rows {rows.tolist()}", seed)
    else:  # the norm's grad rounded to h's dtype, then dh added and rounded again (residual.py's contract)
        terms = ex.abs() + dh[rows].double().abs()
        ex = ex + dh[rows].double()
        for t, name in ((dx, "dx"), (dr, "dr")):
            err = (t[rows].double() - ex).abs()
            over = ~(err <= 1e-5 + 2 * TOLERANCES[t.dtype]["rtol"] * terms + 2.0 ** -16 * sx)  # NaN never passes
            assert not over.any(), (f"{tag} {name}: {int(over.sum())} elements off, worst {err.max().item():.3g} "
                                    f"[seed {seed}]")
    ew, sw = torch.zeros(N, dtype=torch.float64, device="cuda"), torch.zeros(N, dtype=torch.float64, device="cuda")
    step = max(1, CHUNK_ELEMS // N)
    for r0 in range(0, M, step):  # dw's fp64 reference over h as stored
        hc, dyc = h[r0:r0 + step].detach().double(), dy[r0:r0 + step].double()
        t = dyc * hc * torch.rsqrt(hc.square().mean(dim=-1, keepdim=True) + EPS)
        ew += t.sum(dim=0)
        sw += t.abs().sum(dim=0)
        del hc, dyc, t
    assert_grad_close(dw, ew, sw, w.dtype, f"{tag} dw", seed)
    for t in (h, dx, dr):
        poisoned(t.detach())
    del h, dx, dr, xg, rg
    torch.cuda.empty_cache()


def test_fp8_past_2_32_elements(big_inputs, seed, monkeypatch):
    """rms_norm_fp8 by each FP8 kernel (Triton's and the CuTe DSL one, rows up to 16384 wide): q and
    the per-token and 1 x 128 group scales (and q at a given scale, and q, scales and h with a residual)
    of the checked rows bit for bit against the same kernel on
    those rows alone (32-bit offsets; the quantizer against the reference is
    tests/triton/test_rmsnorm_fp8.py's and tests/cute/test_rmsnorm_fp8.py's)."""
    x, dy, w, _, _, rows = big_inputs
    M, N = x.shape
    if N > 16384:
        pytest.skip("the FP8 kernels' rows are at most 16384 wide (wider rows run the torch ops)")
    monkeypatch.setenv("CUTILE_NORMS_FUSED", "1")
    for mode in ("triton", "tma_smem_cached"):
        if cn.available_modes()[mode] is not None:
            continue
        for kw in ({}, {"group_size": 128}, {"scale": 0.0625}):
            q, s = cn.rms_norm_fp8(x, w, EPS, mode=mode, **kw)
            torch.cuda.synchronize()
            eq, es = cn.rms_norm_fp8(x[rows], w, EPS, mode=mode, **kw)
            what = f"fp8 {mode} {kw} x=bf16[{M}, {N}] rows {rows.tolist()}"
            assert torch.equal(s if "scale" in kw else s[rows], es), f"{what}: scales differ [seed {seed}]"
            assert torch.equal(q[rows].view(torch.uint8), eq.view(torch.uint8)), f"{what}: q differs [seed {seed}]"
            del q, s
        # with a residual (dy as it): h = x + r stored past 2^32 elements too
        q, s, h = cn.rms_norm_fp8(x, w, EPS, mode=mode, residual=dy)
        torch.cuda.synchronize()
        eq, es, eh = cn.rms_norm_fp8(x[rows], w, EPS, mode=mode, residual=dy[rows])
        what = f"fp8 {mode} residual x=bf16[{M}, {N}] rows {rows.tolist()}"
        assert torch.equal(h[rows], eh), f"{what}: h differs [seed {seed}]"
        assert torch.equal(s[rows], es), f"{what}: scales differ [seed {seed}]"
        assert torch.equal(q[rows].view(torch.uint8), eq.view(torch.uint8)), f"{what}: q differs [seed {seed}]"
        del q, s, h
    torch.cuda.empty_cache()


@pytest.mark.parametrize("mode", [None, "tma_smem_cached"], ids=str)
def test_fp32_rows_of_128_to_256_kib_past_2_32_elements(mode, seed):
    """fp32 x of 33352 columns (the CuTe DSL forward's rows over at most FP32_WIDE_CLUSTER CTAs, which
    the H200's table runs under mode=None): the no-grad forward's rows at the start, the middle, the end
    and around 2^31 / 2^32 elements."""
    N = 33352
    M = (1 << 32) // N + 64
    _skip_unless_free(2 * M * N * 4 + (4 << 30))
    why = cn.available_modes().get(mode) if mode is not None else None
    if why:
        pytest.skip(why)
    torch.manual_seed(seed)
    x = _random_big(M, N, torch.float32)
    w = random_weight(N, torch.float32, "cuda")
    rows = _rows_to_check(M, N)
    with torch.no_grad():
        y = cn.rms_norm(x, w, EPS, mode=mode)
    torch.cuda.synchronize()
    _check_rows(y, x, w, rows, f"mode={mode} x=fp32[{M}, {N}] y", seed)
    poisoned(y)
    del x, y
    torch.cuda.empty_cache()


@pytest.mark.parametrize("mode", [None, "multi_wave_cached"], ids=str)
def test_fp32_backward_past_2_32_elements(mode, seed):
    """fp32 x of 9732 columns, an odd count of 16-byte vectors: under mode=None an H200 runs the CuTe DSL backward
    there (backward_table.H200_FP32_CUTE_BWD_BYTES), its last slice part empty over a cluster of 3; the cuTile
    kernel by name and on other GPUs. dx at the rows around 2^31 / 2^32 elements, dw over every row."""
    N = 9732
    M = (1 << 32) // N + 64
    _skip_unless_free(4 * M * N * 4 + (6 << 30))  # x, dy, y, dx + the references' chunks
    why = cn.available_modes().get(mode) if mode is not None else None
    if why:
        pytest.skip(why)
    on_cute = torch.cuda.get_device_name() == "NVIDIA H200"
    if mode is None and not on_cute:
        pytest.skip("mode=None runs the cuTile kernel here, the other case's")
    torch.manual_seed(seed)
    x, dy = _random_big(M, N, torch.float32), _random_big(M, N, torch.float32)
    w = random_weight(N, torch.float32, "cuda")
    rows = _rows_to_check(M, N)
    tag = f"mode={mode} x=fp32[{M}, {N}]"
    xg, wg = x.requires_grad_(), w.clone().requires_grad_()
    assert ("backward: tma_smem_cached's" in cn.explain(xg, wg, mode=mode)) == (mode is None), tag
    y = cn.rms_norm(xg, wg, EPS, mode=mode)
    y.backward(dy)
    torch.cuda.synchronize()
    poisoned(y.detach())
    del y
    x = xg.detach()
    ex, _, sx, _ = reference_bwd64(x[rows], w, dy[rows], EPS, 0.0)
    assert_grad_close(xg.grad[rows], ex, sx, torch.float32, f"{tag} dx rows {rows.tolist()}", seed)
    ew, sw = _dw_reference(x, dy)
    assert_grad_close(wg.grad, ew, sw, torch.float32, f"{tag} dw", seed)
    del x, xg, dy
    torch.cuda.empty_cache()


def test_residual_add_beside_an_fp32_weight_past_2_32_elements(seed, monkeypatch):
    """bf16 x and r beside an fp32 weight at 20480 columns, mode=None's fused forward (the CuTe DSL
    kernel where it takes the rows: dispatch.residual_add_kernel), no grad: h and y at the checked rows."""
    monkeypatch.setenv("CUTILE_NORMS_FUSED", "1")
    N = 20480
    M = (1 << 32) // N + 64
    _skip_unless_free(4 * M * N * 2 + (4 << 30))
    torch.manual_seed(seed)
    x, r = _random_big(M, N), _random_big(M, N)
    w = random_weight(N, torch.float32, "cuda")
    rows = _rows_to_check(M, N)
    tag = f"residual mode=None x=bf16[{M}, {N}] w=fp32"
    with torch.no_grad():
        y, h = cn.rms_norm(x, w, EPS, residual=r)
    torch.cuda.synchronize()
    assert_stored_sum(h[rows], x[rows], r[rows], f"{tag} h rows {rows.tolist()}", seed)
    _check_rows(y, h, w, rows, f"{tag} y", seed)
    poisoned(y)
    poisoned(h)
    del x, r, y, h
    torch.cuda.empty_cache()


@pytest.mark.parametrize("N", [1152, 6144])
def test_residual_backward_by_tma_with_dh_past_2_32_elements(N, seed, monkeypatch):
    """Triton's TMA rows kernel reading dh (the fused backward's form on an H200's dh rows: 1152 in 8-row
    tiles of two pieces, 6144 a row a tile in two pieces), called with the H200's rule on this GPU, on
    rows past 2^32 elements: the grad into h at the checked rows against the fp64 closed form plus dh,
    dw against its fp64 sum over every row; the launch counted."""
    from cutile_norms._platform import DeviceInfo
    from cutile_norms.triton import rmsnorm_bwd
    from cutile_norms.triton._common import shared_per_block
    from cutile_norms.triton.add_rmsnorm_bwd import add_rms_norm_bwd
    from tests.triton._util import Launches

    if torch.cuda.get_device_capability() < (9, 0) or shared_per_block(torch.device("cuda")) < 227 * 1024:
        pytest.skip("the H200's dh tiles need TMA (sm_90+) and 227 KiB of shared memory a block")
    spy = Launches(rmsnorm_bwd.rms_norm_bwd_tma_rows2_dh_kernel)  # (both widths: two exact pieces)
    monkeypatch.setattr(rmsnorm_bwd, "rms_norm_bwd_tma_rows2_dh_kernel", spy)
    M = (1 << 32) // N + 64
    _skip_unless_free(4 * M * N * 2 + (4 << 30))  # h, dy, dh, the grad
    torch.manual_seed(N)
    h, dy, dh = _random_big(M, N), _random_big(M, N), _random_big(M, N)
    w = random_weight(N, torch.bfloat16, "cuda")
    rstd = torch.empty(M, dtype=torch.float32, device="cuda")
    ew, sw = torch.zeros(N, dtype=torch.float64, device="cuda"), torch.zeros(N, dtype=torch.float64, device="cuda")
    step = max(1, CHUNK_ELEMS // N)
    for r0 in range(0, M, step):  # rstd as the forward stores it, and dw's fp64 reference
        hc = h[r0:r0 + step].double()
        rs = torch.rsqrt(hc.square().mean(dim=-1) + EPS)
        rstd[r0:r0 + step] = rs.float()
        t = dy[r0:r0 + step].double() * hc * rs[:, None]
        ew += t.sum(dim=0)
        sw += t.abs().sum(dim=0)
        del hc, rs, t
    dev = DeviceInfo("nvidia", "NVIDIA H200", (9, 0), torch.cuda.get_device_properties(0).multi_processor_count, 0)
    g, dw = add_rms_norm_bwd(dy, dh, h, w, rstd, 0.0, True, 2 * dev.sm_count, torch.bfloat16, dev)
    torch.cuda.synchronize()
    assert spy.count == 1, "the TMA rows kernel reading dh did not run"
    rows = _rows_to_check(M, N)
    eg, _, sg, _ = reference_bwd64(h[rows], w, dy[rows], EPS, 0.0)
    tag = f"TMA rows with dh, bf16[{M}, {N}]"
    assert_grad_close(g[rows], eg + dh[rows].double(), sg + dh[rows].double().abs(), torch.bfloat16,
                      f"{tag} grad rows {rows.tolist()}", seed)
    assert_grad_close(dw, ew, sw, w.dtype, f"{tag} dw", seed)
    del h, dy, dh, g
    torch.cuda.empty_cache()
