"""cuTile RMSNorm backward (cutile_norms/cutile/rmsnorm_bwd.py).

GPU tests (marked `gpu`, skipped without an sm_90+ GPU): dx and dw against the fp64 closed form over
the dtype / width / M matrix, through the backend on NaN-poisoned outputs and through autograd for
every cuTile mode; strided x, expanded and transposed dy, weight None, offset, dx or dw alone;
bit-identical dw over repeated runs; CUDA-graph capture of forward + backward; M * N >= 2^31.
The config rules' CPU tests live in test_rmsnorm_bwd_config.py, the compile checks for sm_90/sm_100 in
test_rmsnorm_bwd_compile.py.
"""
from __future__ import annotations

import pytest
import torch

from cutile_norms import dispatch

from tests.conftest import (assert_grad_close, check_backward, check_graph_forward_backward, poisoned, random_rows,
                            random_weight, reference_bwd64)

MODES = dispatch.modes_of("cutile")
DT = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
DTYPES = [("bfloat16", "bfloat16"), ("float16", "float16"), ("float32", "float32"), ("bfloat16", "float32"),
          ("float16", "float32")]
# narrow (several rows per tile), 2^k - 1 / 2^k / 2^k + 1, odd, pieces (2880, 5120, 7168; 2312 / 3112 at 3
# blocks per SM: rmsnorm_bwd_config.THREE_BLOCK_LANES), split rows
# split rows of 4 parts: four pieces (14344), a 4096 piece and a tail (19336; backward_table.CUTILE_BWD_BAND);
# the H200's own fp32 rows (MODEL_ROWS_ONLY): its 4-row 1024, three pieces at 4 blocks (1320), at 3 (1604), the
# 2048 row's 4 blocks on a 2048 piece and a tail (2052), the prefetching 2048 + 512 (2312)
WIDTHS = [1, 7, 127, 128, 129, 1000, 1024, 1320, 1604, 2052, 2312, 2880, 3112, 4095, 4096, 4097, 5120, 7168, 14344,
          16383, 19336, 32768, 65537, 262144]
EPS = 1e-6


# ------------------------------------------------------------------------------------------------
# GPU helpers
# ------------------------------------------------------------------------------------------------
def _device_info():
    from cutile_norms._platform import device_info

    return device_info("cuda")


def _run_bwd(x, w, dy, offset, cfg=None, need_dx=True, need_dw=True, dh=None):
    """rstd from the library's forward, then the backward backend (its own config, or `cfg`) on
    poisoned dx / dw buffers, `dh` added to dx in the kernel. Returns (dx, dw)."""
    from cutile_norms import dispatch
    from cutile_norms.cutile.rmsnorm_bwd import PERSISTENT_BACKWARD, dx_buffer

    dev = _device_info()
    M, N = x.shape
    _, rstd = dispatch.backend("multi_wave_cached").forward(x, w, EPS, offset, True, dev)
    cfg = cfg or PERSISTENT_BACKWARD.config(N, x.dtype, dev, w.dtype if w is not None else None,
                                            has_dh=dh is not None and need_dx)  # as the backend picks it
    dx = poisoned(dx_buffer(cfg, M, N, x.dtype, x.device)) if need_dx else None
    dw = poisoned(torch.empty(N, dtype=w.dtype, device=x.device)) if (need_dw and w is not None) else None
    out = PERSISTENT_BACKWARD.backward(dy, x, w, rstd, offset, need_dx, need_dw, dev, cfg=cfg, out=(dx, dw),
                                       dh2d=dh)
    torch.cuda.synchronize()
    return out


def _check(x, w, dy, offset, dx, dw, what, seed, need_dx=True, need_dw=True, dh=None):
    check_backward(x, w, dy, offset, dx, dw, what, seed, need_dx, need_dw, eps=EPS, dh=dh)


# ------------------------------------------------------------------------------------------------
# GPU: the backend against the fp64 closed form
# ------------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("N", WIDTHS)
@pytest.mark.parametrize("x_dtype,w_dtype", DTYPES)
@pytest.mark.parametrize("M", [1, 7, 300])
def test_matches_reference(seed, N, x_dtype, w_dtype, M):
    """M = 1: one row group (dw stored directly); 7 and 300: several, dw through the partials and
    the reducers; wide rows split over blocks that exchange their sums."""
    x = random_rows((M, N), DT[x_dtype], "cuda")
    w = random_weight(N, DT[w_dtype], "cuda")
    dy = torch.randn(M, N, device="cuda").to(DT[x_dtype])
    dx, dw = _run_bwd(x, w, dy, 0.0)
    _check(x, w, dy, 0.0, dx, dw, f"N={N} M={M} {x_dtype}/{w_dtype}", seed)


@pytest.mark.gpu
@pytest.mark.parametrize("N", [128, 1000, 2880, 4097, 65536])
@pytest.mark.parametrize("case", ["offset1", "no_weight", "dx_only", "dw_only", "offset1_fp32_weight"])
def test_offset_no_weight_and_one_grad(seed, N, case):
    x = random_rows((77, N), torch.bfloat16, "cuda")
    w = None if case == "no_weight" else random_weight(N, torch.float32 if "fp32" in case else torch.bfloat16, "cuda")
    offset = 1.0 if case.startswith("offset1") else 0.0
    dy = torch.randn(77, N, device="cuda").to(torch.bfloat16)
    need_dx, need_dw = case != "dw_only", case != "dx_only"
    dx, dw = _run_bwd(x, w, dy, offset, need_dx=need_dx, need_dw=need_dw)
    assert (dx is None) == (not need_dx) and (dw is None) == (not need_dw or w is None)
    _check(x, w, dy, offset, dx, dw, case, seed, need_dx, need_dw)


@pytest.mark.gpu
@pytest.mark.big  # the fp64 reference of 2^27 elements: ~8 GiB
@pytest.mark.parametrize("N", [128, 2880, 4096, 65536])
def test_full_size_bf16(seed, N):
    """M = 2^27 / N: the bench's size (every block loops; R x N partials; the reducers)."""
    M = (1 << 27) // N
    x = random_rows((M, N), torch.bfloat16, "cuda")
    w = random_weight(N, torch.bfloat16, "cuda")
    dy = torch.randn(M, N, device="cuda").to(torch.bfloat16)
    dx, dw = _run_bwd(x, w, dy, 0.0)
    _check(x, w, dy, 0.0, dx, dw, f"full size N={N}", seed)


# (tile_m, split, blocks_per_sm, N, prefetch): configs the heuristic may not pick: one row per
# tile for narrow rows, several rows for 1000, splits that do not divide the row (a short last part;
# ct.scatter for dx because the part is not a multiple of its pieces), many reducers, one block per
# SM, the next row prefetched (narrow rows and split ones)
CONFIG_CASES = [(1, 1, 4, 128, False), (8, 1, 2, 1000, False), (1, 2, 2, 2880, False), (1, 8, 2, 40000, False),
                (1, 4, 1, 100003, False), (1, 32, 2, 262144, False), (2, 1, 3, 4097, False), (1, 1, 1, 8192, False),
                (1, 1, 3, 2880, True), (1, 1, 2, 4097, True), (1, 2, 2, 7168, True), (1, 8, 2, 40000, True),
                (1, 64, 2, 262144, True), (1, 4, 2, 16384, True), (1, 32, 2, 100003, True)]


def case_config(tile_m, split, bps, N, prefetch):
    """A CONFIG_CASES entry as the BwdConfig it stands for (also compiled by test_rmsnorm_bwd_compile)."""
    from cutile_norms.cutile.rmsnorm_bwd_config import BwdConfig, cut_pieces

    return cut_pieces(BwdConfig(tile_m=tile_m, split=split, blocks_per_sm=bps, num_worker_warps=8,
                                prefetch=prefetch), N)


@pytest.mark.gpu
@pytest.mark.parametrize("tile_m,split,bps,N,prefetch", CONFIG_CASES)
@pytest.mark.parametrize("x_dtype,w_dtype", [("bfloat16", "bfloat16"), ("float32", "float32"), ("float16", "float32")])
@pytest.mark.parametrize("M", [1, 5, "many"])
def test_configs_match_reference(seed, tile_m, split, bps, N, prefetch, x_dtype, w_dtype, M):
    """"many": every block loops (1000 rows; 120 for the widest rows, enough for 4+ rows per block)."""
    M = (1000 if N <= 8192 else 120) if M == "many" else M
    cfg = case_config(tile_m, split, bps, N, prefetch)
    x = random_rows((M, N), DT[x_dtype], "cuda")
    w = random_weight(N, DT[w_dtype], "cuda")
    dy = torch.randn(M, N, device="cuda").to(DT[x_dtype])
    dx, dw = _run_bwd(x, w, dy, 0.0, cfg=cfg)
    _check(x, w, dy, 0.0, dx, dw, f"{cfg.short()} N={N} M={M}", seed)


@pytest.mark.gpu
@pytest.mark.parametrize("N", [128, 4096, 65536])
def test_strided_x_and_non_contiguous_dy(seed, N):
    """x's rows strided (a view of a wider tensor at an odd offset); dy expanded along the rows (row
    stride 0), a strided view, and transposed (copied): what autograd hands out."""
    M = 48
    x = random_rows((M, N + 24), torch.bfloat16, "cuda")[:, 8:8 + N]
    w = random_weight(N, torch.bfloat16, "cuda")
    dys = {"expanded": torch.randn(1, N, device="cuda").to(torch.bfloat16).expand(M, N),
           "strided": torch.randn(M, N + 40, device="cuda").to(torch.bfloat16)[:, 16:16 + N],
           "transposed": torch.randn(N, M, device="cuda").to(torch.bfloat16).t()}
    from cutile_norms.rmsnorm import grad_rows

    for name, dy in dys.items():
        dx, dw = _run_bwd(x, w, grad_rows(dy, x), 0.0)
        _check(x, w, dy, 0.0, dx, dw, f"dy {name}", seed)


@pytest.mark.gpu
@pytest.mark.parametrize("N", [128, 1000, 1344, 2880, 4096, 6144, 7168, 8200, 10240, 12288, 14600, 16384, 18440,
                               20480, 65536])
@pytest.mark.parametrize("x_dtype,w_dtype", [("bfloat16", "bfloat16"), ("float32", "float32"),
                                             ("float16", "float32")])
@pytest.mark.parametrize("M", [1, 300])
def test_dh_added_inside(seed, N, x_dtype, w_dtype, M):
    """The residual add's backward: dh read with the row (multi-row tiles, one row with the next one
    prefetched, split rows; the configs `_dh_fit` picks, 1 block per SM at 6144 / 7168 on an H100) and
    added to dx before it is rounded; dw unchanged by it."""
    x, dy, dh = (random_rows((M, N), DT[x_dtype], "cuda") for _ in range(3))
    w = random_weight(N, DT[w_dtype], "cuda")
    dx, dw = _run_bwd(x, w, dy, 1.0, dh=dh)
    _check(x, w, dy, 1.0, dx, dw, f"N={N} M={M} {x_dtype}/{w_dtype} + dh", seed, dh=dh)


@pytest.mark.gpu
@pytest.mark.parametrize("N", [9472, 11776, 14600, 16024, 16128, 18432, 18440, 19336, 20480])
@pytest.mark.parametrize("w_dtype", ["bfloat16", "float32"])
def test_mode_none_runs_the_backward_its_table_names(seed, N, w_dtype):
    """mode=None's backward (backward_table.BACKWARD_TABLE) tells a 16-bit weight from an fp32 one and the
    residual add's backward from the norm's (on an H100, 28-40 KiB rows: this kernel at an odd vector count,
    beside an fp32 weight also at 20480 columns, with dh to 36 KiB beside a 16-bit weight; the CuTe DSL one
    otherwise, 16128 and 18432 beside an fp32 weight among them; 11776: the CuTe DSL one without dh on both
    GPUs): explain() names the kernel that runs, and the grads of x, the residual and the weight match the
    fp64 closed form."""
    import cutile_norms as cn
    from cutile_norms._platform import toolchain

    M = 96
    dev = _device_info()
    choice = dispatch.resolve(None, dev, toolchain(), torch.bfloat16, M, N, fp32_weight=w_dtype == "float32")
    names = {"multi_wave_cached": "cuTile", "tma_smem_cached": "CuTe DSL", "triton": "Triton"}
    x0, r0, dy = (random_rows((M, N), torch.bfloat16, "cuda") for _ in range(3))
    w0 = random_weight(N, DT[w_dtype], "cuda")
    text = cn.explain(x0, w0, residual=r0)
    assert text.split("\nbackward:")[1].lstrip().startswith(names[choice.backward_mode]), text
    how, dh_mode, _ = dispatch.residual_backward(None, choice, N, 2, dev, toolchain())
    assert dh_mode == choice.dh_backward_mode and f"the norm's backward ({dh_mode}" in text, text
    x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
    cn.rms_norm(x, w, EPS).backward(dy)
    _check(x0, w0, dy, 0.0, x.grad, w.grad, f"mode=None N={N} w {w_dtype}", seed)
    x, r, w = x0.clone().requires_grad_(), r0.clone().requires_grad_(), w0.clone().requires_grad_()
    dh = random_rows((M, N), torch.bfloat16, "cuda")
    y, h = cn.rms_norm(x, w, EPS, residual=r)
    torch.autograd.backward((y, h), (dy, dh))
    h0 = (x0.float() + r0.float()).to(torch.bfloat16)
    _check(h0, w0, dy, 0.0, x.grad, w.grad, f"mode=None N={N} w {w_dtype} + residual", seed, dh=dh)
    assert torch.equal(x.grad, r.grad)


@pytest.mark.gpu
@pytest.mark.parametrize("N", [1000, 4096, 20480])
def test_dh_strided_and_expanded(seed, N):
    """dh as autograd may hand it: rows strided at an odd offset, expanded (row stride 0); dx alone."""
    M = 48
    x, dy = random_rows((M, N), torch.bfloat16, "cuda"), random_rows((M, N), torch.bfloat16, "cuda")
    w = random_weight(N, torch.bfloat16, "cuda")
    for name, dh in (("strided", random_rows((M, N + 24), torch.bfloat16, "cuda")[:, 3:3 + N]),
                     ("expanded", random_rows((1, N), torch.bfloat16, "cuda").expand(M, N))):
        dx, _ = _run_bwd(x, w, dy, 0.0, need_dw=False, dh=dh)
        _check(x, w, dy, 0.0, dx, None, f"N={N} dh {name}", seed, need_dw=False, dh=dh)


@pytest.mark.gpu
@pytest.mark.parametrize("N,split", [(4096, 1), (1000, 1), (65536, 16), (40000, 8)])
def test_dw_is_bit_identical_over_runs(seed, N, split):
    """dw (and dx) are the same bits on every run: the partials are summed in one fixed order
    whichever blocks arrive last and reduce them."""
    from cutile_norms.cutile.rmsnorm_bwd import PERSISTENT_BACKWARD
    from cutile_norms.cutile.rmsnorm_bwd_config import BwdConfig, cached_piece_min, part_of

    M = 3000 if N <= 4096 else 300
    cfg = PERSISTENT_BACKWARD.config(N, torch.bfloat16, _device_info())
    if split > 1:
        base = BwdConfig(split=split, num_worker_warps=8)
        cfg = BwdConfig(split=split, num_worker_warps=8, piece_min=cached_piece_min(part_of(base, N)))
    x = random_rows((M, N), torch.bfloat16, "cuda")
    w = random_weight(N, torch.float32, "cuda")
    dy = torch.randn(M, N, device="cuda").to(torch.bfloat16)
    runs = [_run_bwd(x, w, dy, 0.0, cfg=cfg) for _ in range(4)]
    _check(x, w, dy, 0.0, *runs[0], "determinism", seed)
    for dx, dw in runs[1:]:
        assert torch.equal(dw.view(torch.int32), runs[0][1].view(torch.int32)), f"dw differs between runs [seed {seed}]"
        assert torch.equal(dx.view(torch.int16), runs[0][0].view(torch.int16)), f"dx differs between runs [seed {seed}]"


# ------------------------------------------------------------------------------------------------
# GPU: through autograd, every cuTile mode
# ------------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("mode", MODES + [None])
@pytest.mark.parametrize("N", [129, 2880, 16384])
@pytest.mark.parametrize("x_dtype,w_dtype", DTYPES)
def test_autograd_every_mode(seed, mode, N, x_dtype, w_dtype):
    import cutile_norms as cn

    x = random_rows((3, 11, N), DT[x_dtype], "cuda").requires_grad_()
    w = random_weight(N, DT[w_dtype], "cuda").requires_grad_()
    dy = torch.randn(3, 11, N, device="cuda").to(DT[x_dtype])
    y = cn.rms_norm(x, w, EPS, mode=mode, offset=0.5)
    y.backward(dy)
    _check(x.detach().reshape(-1, N), w.detach(), dy.reshape(-1, N), 0.5, x.grad.reshape(-1, N), w.grad,
           f"autograd {mode}", seed)


@pytest.mark.gpu
def test_autograd_leading_dims_sum_loss_and_module(seed):
    """loss = y.sum() (autograd's dy is expanded: stride 0 everywhere, copied), the module with
    several normalized dims, x not requiring grad (dw only), M = 0."""
    import cutile_norms as cn

    x = random_rows((4, 6, 512), torch.bfloat16, "cuda").requires_grad_()
    w = random_weight(512, torch.bfloat16, "cuda").requires_grad_()
    cn.rms_norm(x, w, EPS, mode="multi_wave_cached").sum().backward()
    _check(x.detach().reshape(-1, 512), w.detach(), torch.ones(24, 512, device="cuda", dtype=torch.bfloat16), 0.0,
           x.grad.reshape(-1, 512), w.grad, "sum loss", seed)
    m = cn.RMSNorm((4, 128), mode="static_persistent", device="cuda", dtype=torch.float32)
    xf = random_rows((5, 4, 128), torch.float32, "cuda")  # no grad: dw only
    dy = torch.randn(5, 4, 128, device="cuda")
    m(xf).backward(dy)
    _check(xf.reshape(-1, 512), m.weight.detach().reshape(-1), dy.reshape(-1, 512), 0.0, None, m.weight.grad.reshape(-1),
           "module dw only", seed, need_dx=False)
    xe = torch.empty(0, 512, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    we = random_weight(512, torch.bfloat16, "cuda").requires_grad_()
    cn.rms_norm(xe, we, mode="multi_wave_cached").sum().backward()
    assert xe.grad.shape == (0, 512) and torch.equal(we.grad, torch.zeros_like(we))


@pytest.mark.gpu
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("N", [4096, 65536])
def test_cuda_graph_forward_and_backward(seed, mode, N):
    """The counters and slots come back to their state after each replay; fresh ones are captured."""
    check_graph_forward_backward(mode, 64, N, seed, EPS)


@pytest.mark.gpu
def test_back_to_back_launches_and_streams(seed):
    """Launches with different M and split on one stream with no sync in between (shared counters,
    partials and slots), then two streams at once: every result against the reference."""
    from cutile_norms.cutile.rmsnorm_bwd_config import BwdConfig

    N = 40000
    cfgs = {s: BwdConfig(split=s, num_worker_warps=8, piece_min=2048) for s in (4, 8)}
    w = random_weight(N, torch.bfloat16, "cuda")
    runs = []
    for M, s in ((300, 8), (7, 8), (301, 4), (1, 4), (300, 8)):
        x = random_rows((M, N), torch.bfloat16, "cuda")
        dy = torch.randn(M, N, device="cuda").to(torch.bfloat16)
        runs.append((x, dy, _run_bwd_nosync(x, w, dy, cfgs[s]), f"M={M} split={s}"))
    torch.cuda.synchronize()
    for x, dy, (dx, dw), what in runs:
        _check(x, w, dy, 0.0, dx, dw, what, seed)
    side = torch.cuda.Stream()
    xa, xb = (random_rows((257, N), torch.bfloat16, "cuda") for _ in range(2))
    dya, dyb = (torch.randn(257, N, device="cuda").to(torch.bfloat16) for _ in range(2))
    ga = _run_bwd_nosync(xa, w, dya, cfgs[8])
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        gb = _run_bwd_nosync(xb, w, dyb, cfgs[8])
    torch.cuda.synchronize()
    _check(xa, w, dya, 0.0, *ga, "main stream", seed)
    _check(xb, w, dyb, 0.0, *gb, "side stream", seed)


def _run_bwd_nosync(x, w, dy, cfg):
    from cutile_norms import dispatch
    from cutile_norms.cutile.rmsnorm_bwd import PERSISTENT_BACKWARD

    dev = _device_info()
    _, rstd = dispatch.backend("multi_wave_cached").forward(x, w, EPS, 0.0, True, dev)
    return PERSISTENT_BACKWARD.backward(dy, x, w, rstd, 0.0, True, True, dev, cfg=cfg)


@pytest.mark.gpu
@pytest.mark.big
def test_row_chunks_beyond_int32_indexing(seed, monkeypatch):
    """The int32 limit lowered so a launch is cut into row chunks (each chunk's dw summed in fp32 in
    order), then a real M * N > 2^31 (bf16, N = 8192: 4 GiB per tensor)."""
    from cutile_norms.cutile import rmsnorm_bwd

    N = 4096
    x = random_rows((1000, N), torch.bfloat16, "cuda")
    w = random_weight(N, torch.bfloat16, "cuda")
    dy = torch.randn(1000, N, device="cuda").to(torch.bfloat16)
    monkeypatch.setattr(rmsnorm_bwd, "_MAX_FLAT", 300 * N)  # 288-row chunks
    dx, dw = _run_bwd(x, w, dy, 0.0)
    _check(x, w, dy, 0.0, dx, dw, "chunked", seed)
    monkeypatch.undo()
    free, _ = torch.cuda.mem_get_info()
    M, N = (1 << 31) // 8192 + 64, 8192
    if free < 5 * M * N * 2 + (8 << 30):
        pytest.skip(f"needs ~{5 * M * N * 2 >> 30} GiB of free GPU memory, {free >> 30} free")
    x = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
    w = random_weight(N, torch.bfloat16, "cuda")
    dy = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
    dx, dw = _run_bwd(x, w, dy, 0.0)
    for rows in (slice(0, 64), slice(M // 2 - 7, M // 2 + 9), slice(M - 64, M)):  # the fp64 check on some rows
        ex, _, sx, _ = reference_bwd64(x[rows], w, dy[rows], EPS, 0.0)
        assert_grad_close(dx[rows], ex, sx, torch.bfloat16, f"M*N > 2^31 dx rows {rows}", seed)
    ew = torch.zeros(N, dtype=torch.float64, device="cuda")
    sw = torch.zeros(N, dtype=torch.float64, device="cuda")
    for r0 in range(0, M, 16384):
        _, ewc, _, swc = reference_bwd64(x[r0:r0 + 16384], w, dy[r0:r0 + 16384], EPS, 0.0)
        ew += ewc
        sw += swc
    assert_grad_close(dw, ew, sw, torch.bfloat16, "M*N > 2^31 dw", seed)
