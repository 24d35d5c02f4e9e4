"""tma_smem_cached backward (cutile_norms/cute/rmsnorm_bwd.py).

GPU tests: dx and dw against the fp64 closed form on NaN-poisoned outputs over dtype pairs, widths
(one CTA per row, rows over clusters of 2-16 CTAs, slices that do not fill the last CTA), M from 1 up
(fewer rows than clusters, many rows per cluster), weight None, offset, dx or dw alone, other configs
than the heuristic's; strided x, expanded and strided dy; bit-identical dw over runs; the rows it does
not take go to the cuTile backward; autograd through rms_norm(mode="tma_smem_cached"); CUDA graphs;
M * N >= 2^31. CPU tests: the config rules.
"""
from __future__ import annotations

import dataclasses
import functools

import pytest
import torch

import cutile_norms as cn
from tests.conftest import (assert_grad_close, check_backward, check_backward_past_2_31, check_graph_forward_backward,
                            poisoned, random_rows, random_weight, reference_bwd64)

DT = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
DTYPES = [("bfloat16", "bfloat16"), ("float16", "float16"), ("float32", "float32"), ("bfloat16", "float32")]
# 10240 and 11264: mode=None runs the kernel there on an H200 (backward_table.H200_CUTE_BWD_MIN_BYTES)
# 40000 (fp32) and 72928 (16-bit): rows over 8 CTAs of 256 threads (rmsnorm_bwd_config.ONE_A_GPC);
# 13312 and 53248 (16-bit): padded slices where the only exact tilings hold 13 vectors a thread or 13 CTAs
# (53248 over 8 CTAs of 7 vectors: SEVEN_PADDED)
# 135688 (16-bit): a row of 17 slices over 8 CTAs of 256 threads (WIDE_SLICES); 157696: over 16 CTAs, padded,
# where the only exact tiling takes 14 (FULL_GPC)
WIDTHS = [128, 1000, 4096, 10240, 11264, 13312, 16384, 16392, 40000, 53248, 65536, 72928, 131072, 135688, 157696,
          262144]
EPS = 1e-6


# ------------------------------------------------------------------------------------------------
# CPU: config rules
# ------------------------------------------------------------------------------------------------
def _shape(e, n16):
    """(CTAs, threads, vectors) of the 16 KiB rule's config (without EVEN_SLICES) for rows of e-byte elements
    as long as n16 16-bit ones."""
    from cutile_norms.cute.rmsnorm_bwd_config import analytic_config

    cfg = analytic_config(n16 * 2 // e, e, even_slices=None)
    return cfg.cluster_n, cfg.threads, cfg.nvb


@pytest.mark.parametrize("ring", [2, 3])
@pytest.mark.parametrize("N", [8, 128, 1000, 2880, 4096, 12288, 16392, 40000, 42528, 65536, 66000, 72928, 98304, 117144,
                               131072, 262144, 524288])
@pytest.mark.parametrize("e", [2, 4])
def test_config_covers_the_row(N, e, ring):
    from cutile_norms.cute.rmsnorm_bwd_config import MIN_STAGES, SMALL_CLUSTER, analytic_config
    from cutile_norms.cute.rmsnorm_fwd_config import CLUSTER_MAX, SMEM_MAX

    cfg = analytic_config(N, e, small_ring=ring)
    if cfg is None:
        assert N * e > CLUSTER_MAX * 32 * 1024  # a ring of two slices of x and dy per CTA does not fit
        assert analytic_config(N, e) is None  # whether a row is taken never depends on the GPU model
        return
    assert cfg.slice_cols * cfg.cluster_n >= N > (cfg.cluster_n - 1) * cfg.slice_cols  # no empty CTA
    assert 32 <= cfg.threads <= 1024 and cfg.threads % 32 == 0 and cfg.cluster_n <= CLUSTER_MAX
    assert MIN_STAGES <= cfg.stages and cfg.smem_bytes(e) <= SMEM_MAX
    if cfg.cluster_n <= SMALL_CLUSTER:
        assert cfg.stages <= ring
    # at one EVEN_SLICES start the ring is all that changes: the slices are the same
    assert dataclasses.replace(cfg, stages=0) == dataclasses.replace(analytic_config(N, e), stages=0)


H100 = "NVIDIA H100 80GB HBM3"
H200 = "NVIDIA H200"


@pytest.mark.parametrize("gpu", [H100, H200])
def test_even_rows_go_over_24_kib_slices(gpu):
    """rmsnorm_bwd_config.EVEN_SLICES: a 16-bit row a multiple of 32 bytes long, past the GPU model's
    EVEN_BANDS (H200: past 16 KiB; H100: past 24 KiB up to 40 KiB and past 48 KiB) and up to 8 slices of
    16 KiB, without dh, goes over the padded formula's 24 KiB slices (256 threads of at most 6 vectors from
    16 KiB a CTA), unless the 16 KiB rule tiles it exactly with slices of 16 KiB or more; every other row
    (odd vector counts, dh's ring, fp32 rows, wider rows, the H100's 40-48 KiB) keeps the 16 KiB rule's
    config."""
    from cutile_norms._platform import DeviceInfo
    from cutile_norms.cute.rmsnorm_bwd_config import (EVEN_SLICE_BYTES, SLICE_BYTES, SMALL_CLUSTER, analytic_config,
                                                      device_config, ring_stages)

    dev = DeviceInfo("nvidia", gpu, (9, 0), 132, 0)
    ring = ring_stages(dev)
    bands = [(16 << 10, 128 << 10)] if gpu == H200 else [(24 << 10, 40 << 10), (48 << 10, 128 << 10)]
    moved = 0
    for e in (2, 4):
        for N in range(8 * 1024 // e, 160 * 1024 // e + 1, 16 // e):
            for streams in (2, 3):
                cfg = device_config(N, e, dev, streams=streams)
                rule16 = analytic_config(N, e, small_ring=ring, streams=streams, even_slices=None)
                whole16 = rule16.cluster_n * rule16.slice_cols == N and rule16.slice_cols * e >= SLICE_BYTES
                inside = any(lo < N * e <= hi for lo, hi in bands) and N * e <= SMALL_CLUSTER * SLICE_BYTES
                if e == 2 and streams == 2 and N % 16 == 0 and inside and not whole16:
                    wide = analytic_config(N, e, EVEN_SLICE_BYTES, exact=False, small_ring=ring, even_slices=None)
                    assert cfg == wide and cfg.slice_cols * e <= EVEN_SLICE_BYTES and cfg.nvb <= 8, (N, cfg)
                    assert cfg.threads == 256 or cfg.slice_cols * e <= SLICE_BYTES, (N, cfg)
                    assert cfg.slice_cols * cfg.cluster_n >= N > (cfg.cluster_n - 1) * cfg.slice_cols, (N, cfg)
                    moved += cfg != rule16
                else:
                    assert cfg == rule16, (N, streams, cfg, rule16)
    assert moved > 1000
    shape = lambda N: (lambda c: (c.cluster_n, c.threads, c.nvb))(device_config(N, 2, dev))  # noqa: E731
    if gpu == H200:  # rows measured (rmsnorm_bwd_config's numbers)
        assert shape(9472) == (1, 256, 5) and shape(18432) == (2, 256, 5) and shape(22000) == (2, 256, 6)
        assert shape(12288) == (1, 256, 6) and shape(44000) == (4, 256, 6) and shape(60000) == (5, 256, 6)
    else:
        assert shape(9472) == (2, 128, 5) and shape(18432) == (2, 256, 5) and shape(22000) == (3, 128, 8)
        assert shape(15360) == (2, 128, 8) and shape(12288) == (2, 128, 6) and shape(24064) == (3, 128, 8)
        assert shape(27616) == (3, 256, 5) and shape(44000) == (4, 256, 6) and shape(53248) == (5, 256, 6)
    # kept: an odd vector count, exact tilings of 16 KiB slices or more, past 8 slices
    assert shape(19368) == (3, 128, 7) and shape(24576) == (3, 128, 8) and shape(20480) == (2, 128, 10)
    assert shape(36864) == (4, 128, 9) and shape(65536) == (8, 128, 8) and shape(70000) == (7, 256, 5)


@pytest.mark.parametrize("e", [2, 4])
def test_rows_of_9_to_15_slices_go_over_8_ctas(e):
    """rmsnorm_bwd_config.ONE_A_GPC: a row that 16 KiB slices would spread over 9-15 CTAs (one cluster a
    GPC) goes over 8 CTAs of 256 threads (7 where 7 such slices hold it), with or without dh's ring, on
    either GPU model's ring; the rows on either side keep their clusters of 8 and 16."""
    from cutile_norms.cute.rmsnorm_bwd_config import (ONE_A_GPC, SLICE_BYTES, SMALL_CLUSTER, VECS_PER_THREAD,
                                                      analytic_config)

    per = SLICE_BYTES // e  # elements of a 16 KiB slice
    widths = [8 * per + 8, 66000 * 2 // e, 72928 * 2 // e, 98304 * 2 // e, 117144 * 2 // e, 15 * per]
    for N in widths:
        assert -(-N // per) in ONE_A_GPC, N
        for ring in (2, 3):
            for streams in (2, 3):
                cfg = analytic_config(N, e, small_ring=ring, streams=streams)
                assert cfg.cluster_n in (SMALL_CLUSTER - 1, SMALL_CLUSTER) and cfg.threads == 256, (N, cfg)
                assert cfg.nvb <= VECS_PER_THREAD and cfg.stages <= ring, (N, cfg)
                assert cfg.slice_cols * cfg.cluster_n >= N > (cfg.cluster_n - 1) * cfg.slice_cols, (N, cfg)
    assert analytic_config(72928 * 2 // e, e).cluster_n == SMALL_CLUSTER
    for vecs in (4, 16):  # the probes' variants of other vectors a thread too, at their own thread counts
        cfg = analytic_config(98304 * 2 // e, e, vecs_per_thread=vecs)
        assert (cfg.cluster_n, cfg.threads) == (SMALL_CLUSTER, 2048 // vecs), (vecs, cfg)
    below, above = analytic_config(8 * per, e), analytic_config(16 * per, e)
    assert (below.cluster_n, below.threads, above.cluster_n, above.threads) == (8, 128, 16, 128)


@pytest.mark.parametrize("e", [2, 4])
def test_rows_padded_over_7_ctas_go_over_8_where_none_is_left_empty(e):
    """rmsnorm_bwd_config.SEVEN_PADDED: a row whose 16 KiB slices pad it over 7 CTAs of 128 threads goes over
    8 of 7 vectors a thread (H100 +1.5 to +2.3 %, H200 +4.8 to +7.0 %) where the 8th CTA holds part of it;
    exact tilings, rows on 6 CTAs and rows on 7 CTAs of 256 threads keep theirs."""
    from cutile_norms.cute.rmsnorm_bwd_config import SLICE_BYTES, analytic_config

    per = SLICE_BYTES // e
    for N in range(6 * per + 16 // e, 7 * per + 1, 16 // e):
        for ring in (2, 3):
            for streams in (2, 3):  # (the 16 KiB rule: EVEN_SLICES takes the even rows of 2 streams first)
                cfg = analytic_config(N, e, small_ring=ring, streams=streams, even_slices=None)
                shape = (cfg.cluster_n, cfg.threads, cfg.nvb)
                if N == 7 * per:
                    assert shape == (7, 128, 8), (N, cfg)
                elif cfg.cluster_n * cfg.slice_cols == N:  # an exact tiling (exact_tiling)
                    continue
                elif N * e > 7 * 128 * 7 * 16:
                    assert shape == (8, 128, 7) and cfg.slice_cols * 7 < N, (N, cfg)
                else:  # 8 CTAs of 6 vectors do not hold it, of 7 leave the 8th empty
                    assert shape[0] == 7, (N, cfg)
    assert _shape(e, 48000)[0] == 6 and _shape(e, 66000)[:2] == (7, 256)


@pytest.mark.parametrize("e", [2, 4])
def test_rows_of_16_to_18_slices_go_over_8_ctas_unless_15_or_16_tile_them(e):
    """rmsnorm_bwd_config.WIDE_SLICES and FULL_GPC: a row of 16-18 slices of 16 KiB goes over 8 CTAs of 256
    threads (H200 +4 to +31 %), but for an exact tiling over 15 or 16 CTAs; an exact tiling of a row past 8
    slices and up to 512 KiB takes 15 or 16 CTAs; past 18 slices the padded rule's clusters of 13-16."""
    from cutile_norms.cute.rmsnorm_bwd_config import (FULL_GPC, SLICE_BYTES, SMALL_CLUSTER, WIDE_SLICES,
                                                      WIDE_THREADS, analytic_config, exact_tiling)

    per = SLICE_BYTES // e
    for N in range(15 * per + 16 // e, WIDE_SLICES * per + 1, 16 // e):
        for ring in (2, 3):
            for streams in (2, 3):
                cfg = analytic_config(N, e, small_ring=ring, streams=streams)
                assert cfg.slice_cols * cfg.cluster_n >= N > (cfg.cluster_n - 1) * cfg.slice_cols, (N, cfg)
                if cfg.cluster_n * cfg.slice_cols == N and cfg.cluster_n in FULL_GPC:
                    continue
                assert (cfg.cluster_n, cfg.threads) == (SMALL_CLUSTER, WIDE_THREADS) and cfg.nvb <= 9, (N, cfg)
                assert cfg.stages <= ring
    shape = functools.partial(_shape, e)
    assert shape(123904) == (8, 256, 8) and shape(129024) == (8, 256, 8) and shape(143368) == (8, 256, 9)
    assert shape(131072) == (16, 128, 8) and shape(138240) == (15, 128, 9) and shape(147456) == (16, 128, 9)
    assert shape(147464) == (15, 256, 5) and shape(157696) == (16, 256, 5) and shape(159744) == (16, 256, 5)
    for N in range(8 * per + 16 // e, 512 * 1024 // e + 1, 16 // e):
        tiling = exact_tiling(N, e)
        assert tiling is None or tiling[0] in FULL_GPC, (N, tiling)
    assert exact_tiling(159744 * 2 // e, e) is None and exact_tiling(138240 * 2 // e, e) == (15, 128, 9)


@pytest.mark.parametrize("e", [2, 4])
def test_exact_tilings_stop_at_11_vectors_and_short_of_one_cluster_a_gpc(e):
    """rmsnorm_bwd_config.MAX_VECS and exact_tiling: no config the rule picks holds more than 11 vectors a
    thread (exact tilings of 12 ran 0.64-0.81 x copy on an H200, of 13 0.55-0.76, of 15 0.07), and a row
    that 8 CTAs of 16 KiB slices hold never goes over 9-15 CTAs for an exact tiling (53248: 0.62 on an
    H200 over 13 CTAs)."""
    from cutile_norms.cute.rmsnorm_bwd_config import (EVEN_BANDS, EVEN_BANDS_OTHERS, ONE_A_GPC, SLICE_BYTES,
                                                      SMALL_CLUSTER, analytic_config, exact_tiling)

    for N in range(16 // e, 512 * 1024 // e + 1, 16 // e):
        for ring, even in ((2, EVEN_BANDS_OTHERS), (3, EVEN_BANDS["H200"])):  # the H100's and the H200's configs
            cfg = analytic_config(N, e, small_ring=ring, even_slices=even)
            assert cfg.nvb <= 11, (N, cfg)
            if N * e <= SMALL_CLUSTER * SLICE_BYTES:
                assert cfg.cluster_n not in ONE_A_GPC, (N, cfg)
    shape = functools.partial(_shape, e)
    assert shape(13312) == (2, 128, 7) and shape(26624) == (4, 128, 7) and shape(53248) == (8, 128, 7)
    assert shape(230400) == (15, 256, 8) and shape(173056) == (15, 256, 6)
    assert shape(11264) == (1, 128, 11) and shape(33792) == (3, 128, 11)
    assert exact_tiling(12288 * 2 // e, e) == (2, 128, 6) and exact_tiling(13312 * 2 // e, e) is None
    # x's and dy's rows alone: an exact tiling whose slices the ring does not hold leaves the row to the
    # cuTile backward (13 x 512 x 8 here), as the rows past 458752 (16-bit) are
    assert exact_tiling(425984 * 2 // e, e) == (13, 512, 8) and analytic_config(425984 * 2 // e, e) is None


def test_ring_stages_by_gpu_model():
    """An H200 runs small clusters with 3 ring slots, an H100 (and any GPU model not measured, and the
    rule without a device) with 2: cute/rmsnorm_bwd_config.py's DEEP_RING has the measured reason."""
    from cutile_norms._platform import DeviceInfo
    from cutile_norms.cute.rmsnorm_bwd import TMA_SMEM_BACKWARD
    from cutile_norms.cute.rmsnorm_bwd_config import ring_stages

    h200 = DeviceInfo("nvidia", "NVIDIA H200", (9, 0), 132, 0)
    others = [DeviceInfo("nvidia", "NVIDIA H100 80GB HBM3", (9, 0), 132, 0),
              DeviceInfo("nvidia", "NVIDIA B200", (10, 0), 148, 0), None]
    assert ring_stages(h200) == 3 and all(ring_stages(d) == 2 for d in others)
    assert TMA_SMEM_BACKWARD.config(24576, torch.bfloat16, h200).stages == 3
    assert TMA_SMEM_BACKWARD.config(24576, torch.bfloat16, others[0]).stages == 2
    assert TMA_SMEM_BACKWARD.config(262144, torch.bfloat16, h200) == TMA_SMEM_BACKWARD.config(262144, torch.bfloat16, None)


# ------------------------------------------------------------------------------------------------
# GPU
# ------------------------------------------------------------------------------------------------
def _dev():
    from cutile_norms._platform import device_info
    return device_info("cuda")


def _rstd(x, w, offset):
    from cutile_norms import dispatch
    return dispatch.backend("multi_wave_cached").forward(x, w, EPS, offset, True, _dev())[1]


def _run(x, w, dy, offset, cfg=None, need_dx=True, need_dw=True, dh=None, dx=None):
    """rstd from the library's forward, then the CuTe backward (the heuristic's config, or `cfg`,
    at any width it takes) on poisoned dx / dw (or into `dx`); `dh` added to dx in the kernel (a
    3-stream config)."""
    from cutile_norms.cute.rmsnorm_bwd import TMA_SMEM_BACKWARD
    from cutile_norms.cute.rmsnorm_bwd_config import analytic_config

    M, N = x.shape
    cfg = cfg or analytic_config(N, x.element_size(), streams=3 if dh is not None else 2)
    rstd = _rstd(x, w, offset)
    if dx is None and need_dx:
        dx = poisoned(torch.empty(M, N, dtype=x.dtype, device=x.device))
    dw = poisoned(torch.empty(N, dtype=w.dtype, device=x.device)) if (need_dw and w is not None) else None
    out = TMA_SMEM_BACKWARD.backward(dy, x, w, rstd, offset, need_dx, need_dw, _dev(), cfg=cfg, out=(dx, dw),
                                     dh2d=dh)
    torch.cuda.synchronize()
    return out


def _check(x, w, dy, offset, dx, dw, what, seed, need_dx=True, need_dw=True, dh=None):
    check_backward(x, w, dy, offset, dx, dw, what, seed, need_dx, need_dw, eps=EPS, dh=dh)


@pytest.mark.gpu
@pytest.mark.parametrize("N", WIDTHS)
@pytest.mark.parametrize("x_dtype,w_dtype", DTYPES)
@pytest.mark.parametrize("M", [1, 7, 300])
def test_matches_reference(seed, N, x_dtype, w_dtype, M):
    from cutile_norms.cute.rmsnorm_bwd_config import analytic_config

    if analytic_config(N, DT[x_dtype].itemsize) is None:
        pytest.skip("a width the kernel does not take (the cuTile backward runs: test_other_rows_go_to_cutile)")
    x = random_rows((M, N), DT[x_dtype], "cuda")
    w = random_weight(N, DT[w_dtype], "cuda")
    dy = random_rows((M, N), DT[x_dtype], "cuda")
    dx, dw = _run(x, w, dy, 0.5)
    _check(x, w, dy, 0.5, dx, dw, f"N={N} M={M} {x_dtype}/{w_dtype}", seed)


@pytest.mark.gpu
@pytest.mark.parametrize("N", [4096, 65536, 262144])
@pytest.mark.parametrize("case", ["no_weight", "dx_only", "dw_only", "offset1_fp32_weight"])
def test_no_weight_one_grad_and_offset(seed, N, case):
    M = 64
    x = random_rows((M, N), torch.bfloat16, "cuda")
    dy = random_rows((M, N), torch.bfloat16, "cuda")
    w = None if case == "no_weight" else random_weight(N, torch.float32 if "fp32" in case else torch.bfloat16, "cuda")
    offset = 1.0 if "offset1" in case else 0.0
    need_dx, need_dw = case != "dw_only", case != "dx_only"
    dx, dw = _run(x, w, dy, offset, need_dx=need_dx, need_dw=need_dw)
    if not need_dx:
        assert dx is None
    if not need_dw or w is None:
        assert dw is None
    _check(x, w, dy, offset, dx, dw, case, seed, need_dx, need_dw)


@pytest.mark.gpu
@pytest.mark.parametrize("N", [24576, 42528, 65536, 262144])
@pytest.mark.parametrize("variant", [dict(vecs_per_thread=4), dict(vecs_per_thread=16), dict(slice_bytes=16384),
                                     dict(stages=2), dict(small_ring=2), dict(small_ring=3)])
def test_other_configs(seed, N, variant):
    from cutile_norms.cute.rmsnorm_bwd_config import analytic_config

    cfg = analytic_config(N, 2, **variant)
    if cfg is None:
        pytest.skip("no such config at this width")
    M = 2000 if N <= 65536 else 500  # many rows per cluster: the ring wraps many times
    x = random_rows((M, N), torch.bfloat16, "cuda")
    w = random_weight(N, torch.bfloat16, "cuda")
    dy = random_rows((M, N), torch.bfloat16, "cuda")
    dx, dw = _run(x, w, dy, 0.0, cfg=cfg)
    _check(x, w, dy, 0.0, dx, dw, f"N={N} {cfg.short()}", seed)


@pytest.mark.gpu
@pytest.mark.parametrize("N", [9472, 12288, 18432, 22000, 44000, 60000])
@pytest.mark.parametrize("w_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("M", [1, 133, 2000])
def test_the_h200s_even_slices(seed, N, w_dtype, M):
    """The configs of rmsnorm_bwd_config.EVEN_SLICES an H200 runs (256 threads over one CTA or clusters of
    2-5, part-empty last slices), on whichever GPU this is: fewer rows than clusters, and many rows a
    cluster so that the ring wraps."""
    from cutile_norms._platform import DeviceInfo
    from cutile_norms.cute.rmsnorm_bwd_config import device_config

    cfg = device_config(N, 2, DeviceInfo("nvidia", "NVIDIA H200", (9, 0), 132, 0))
    assert cfg.threads == 256, cfg
    x = random_rows((M, N), torch.bfloat16, "cuda")
    w = random_weight(N, w_dtype, "cuda")
    dy = random_rows((M, N), torch.bfloat16, "cuda")
    dx, dw = _run(x, w, dy, 0.0, cfg=cfg)
    _check(x, w, dy, 0.0, dx, dw, f"N={N} M={M} {cfg.short()}", seed)


@pytest.mark.gpu
@pytest.mark.parametrize("N", [2560, 3848, 4096, 6500, 9732, 37000, 65536])
def test_fp32_rows_that_mode_none_runs_here(seed, N):
    """An H200's mode=None runs this backward at fp32 rows of 10-256 KiB (backward_table.H200_FP32_CUTE_BWD_BYTES),
    part-empty last vectors or slices (3848; 6500 and 9732, odd vector counts) included: the kernel directly on
    whichever GPU this is, then through autograd under mode=None (explain() names it on an H200)."""
    x = random_rows((300, N), torch.float32, "cuda")
    w = random_weight(N, torch.float32, "cuda")
    dy = random_rows((300, N), torch.float32, "cuda")
    dx, dw = _run(x, w, dy, 0.0)
    _check(x, w, dy, 0.0, dx, dw, f"N={N} float32", seed)
    xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
    if torch.cuda.get_device_name() == "NVIDIA H200":
        assert "backward: tma_smem_cached's" in cn.explain(xg, wg), N
    cn.rms_norm(xg, wg, EPS).backward(dy)
    _check(x, w, dy, 0.0, xg.grad, wg.grad, f"N={N} float32 mode=None", seed)


@pytest.mark.gpu
@pytest.mark.parametrize("N", [4096, 65536])
def test_strided_x_and_non_contiguous_dy(seed, N):
    M = 40
    x = random_rows((M, N + 64), torch.bfloat16, "cuda")[:, :N]
    w = random_weight(N, torch.bfloat16, "cuda")
    dy_row = random_rows((1, N), torch.bfloat16, "cuda")
    for dy, what in ((dy_row.expand(M, N), "expanded dy"),
                     (random_rows((M, 2 * N), torch.bfloat16, "cuda")[:, N:], "strided dy")):
        dx, dw = _run(x, w, dy, 0.0)
        _check(x, w, dy, 0.0, dx, dw, f"N={N} {what}", seed)


@pytest.mark.gpu
@pytest.mark.parametrize("N", [65536, 262144])
def test_dw_is_bit_identical_over_runs(seed, N):
    M = 1000
    x = random_rows((M, N), torch.bfloat16, "cuda")
    w = random_weight(N, torch.float32, "cuda")
    dy = random_rows((M, N), torch.bfloat16, "cuda")
    first = _run(x, w, dy, 0.0)
    for _ in range(4):
        again = _run(x, w, dy, 0.0)
        assert torch.equal(again[0], first[0]) and torch.equal(again[1], first[1]), f"run to run [seed {seed}]"
    _check(x, w, dy, 0.0, *first, f"N={N}", seed)


@pytest.mark.gpu
@pytest.mark.parametrize("w_dtype", [torch.bfloat16, torch.float32])
def test_dw_at_every_remainder_of_the_reduction(seed, w_dtype):
    """M rows on M clusters (one row each, M under the grid's 66 clusters of 2 CTAs at N = 12288): dw's
    reducers load RED_CLUSTERS partial rows at a time, and in the last group the rows past the last
    cluster repeat it with their add skipped. Every remainder of M by RED_CLUSTERS and two full
    groups; beside a 16-bit weight and an fp32 one alike (rmsnorm_bwd_config.reduction_shape)."""
    from cutile_norms.cute.rmsnorm_bwd_config import RED_CLUSTERS

    N = 12288
    w = random_weight(N, w_dtype, "cuda")
    for M in range(2, 2 * RED_CLUSTERS + 2):
        x = random_rows((M, N), torch.bfloat16, "cuda")
        dy = random_rows((M, N), torch.bfloat16, "cuda")
        dx, dw = _run(x, w, dy, 0.0)
        _check(x, w, dy, 0.0, dx, dw, f"M={M} clusters, weight {w_dtype}", seed)


@pytest.mark.gpu
def test_cluster_count_is_the_same_from_another_thread():
    """autograd runs the backward on its own thread, where the occupancy query once failed (no current
    context) and the fallback launched more clusters than fit at once (0.68 x copy instead of 0.94)."""
    import threading

    from cutile_norms.cute.rmsnorm_bwd import max_clusters

    sms = _dev().sm_count
    found = {}
    max_clusters.cache_clear()
    worker = threading.Thread(target=lambda: found.update({cn: max_clusters(0, cn, sms) for cn in (2, 8, 16)}))
    worker.start()
    worker.join()
    max_clusters.cache_clear()
    assert found == {cn: max_clusters(0, cn, sms) for cn in (2, 8, 16)}
    assert all(1 <= found[cn] <= sms // cn for cn in found)


@pytest.mark.gpu
def test_rows_it_does_not_take_go_to_cutile(seed):
    """Rows the kernel does not take (N not a multiple of the vector, a start off 16 bytes, too long)
    run the cuTile backward from this backend, with right grads; rows dispatch sends to the cuTile
    backward (narrower than 24 KiB, fp32) get it through autograd with
    mode="tma_smem_cached", and explain() names it."""
    from cutile_norms.cute.rmsnorm_bwd import TMA_SMEM_BACKWARD, unsupported

    cases = ((65537, 65537, 0), (65536, 65536 + 8, 1), (1 << 20, 1 << 20, 0))
    for N, base_cols, start in cases:
        x = random_rows((4, base_cols + start), torch.bfloat16, "cuda")[:, start:start + N]
        assert unsupported(x, x) is not None, (N, start)
        w = random_weight(N, torch.bfloat16, "cuda")
        dy = random_rows((4, N), torch.bfloat16, "cuda")
        rstd = _rstd(x, w, 0.0)
        dx, dw = TMA_SMEM_BACKWARD.backward(dy, x, w, rstd, 0.0, True, True, _dev())
        _check(x, w, dy, 0.0, dx, dw, f"N={N} start={start}", seed)
    for dtype, N in ((torch.bfloat16, 8192), (torch.float32, 65536)):
        x = random_rows((4, N), dtype, "cuda").requires_grad_()
        w = random_weight(N, dtype, "cuda").requires_grad_()
        assert "backward: cuTile" in cn.explain(x, w, mode="tma_smem_cached"), (dtype, N)
        dy = random_rows((4, N), dtype, "cuda")
        cn.rms_norm(x, w, EPS, mode="tma_smem_cached").backward(dy)
        _check(x.detach(), w.detach(), dy, 0.0, x.grad, w.grad, f"{dtype} N={N} through autograd", seed)
    assert "CuTe DSL" in TMA_SMEM_BACKWARD.describe(4, 131072, torch.bfloat16, _dev())


@pytest.mark.gpu
@pytest.mark.parametrize("x_dtype,w_dtype", DTYPES)
@pytest.mark.parametrize("N", [4096, 131072])
def test_autograd_through_rms_norm(seed, x_dtype, w_dtype, N):
    x = random_rows((48, N), DT[x_dtype], "cuda").requires_grad_()
    w = random_weight(N, DT[w_dtype], "cuda").requires_grad_()
    y = cn.rms_norm(x, w, EPS, mode="tma_smem_cached", offset=1.0)
    dy = random_rows((48, N), DT[x_dtype], "cuda")
    y.backward(dy)
    rdx, rdw, dxs, dws = reference_bwd64(x.detach(), w.detach(), dy, EPS, 1.0)
    assert_grad_close(x.grad, rdx, dxs, DT[x_dtype], "dx", seed)
    assert_grad_close(w.grad, rdw, dws, w.dtype, "dw", seed)


@pytest.mark.gpu
@pytest.mark.parametrize("N", [6440, 12288, 19336, 20480, 24576, 53248, 65536, 135688, 204800, 262144])
@pytest.mark.parametrize("ring", [2, 3])
@pytest.mark.parametrize("M,case", [(1, "bf16"), (7, "fp16"), (600, "bf16"), (600, "no_weight"), (600, "dx_only")])
def test_dh_added_inside(seed, N, ring, M, case):
    """The residual add's backward: dh comes into a third ring and is added to dx before it is rounded
    (exact and part-empty slices, one CTA (6440) and clusters, 8 CTAs of 7 vectors (53248) and of 256
    threads (135688), both ring depths, many rows per cluster); dw unchanged by it."""
    from cutile_norms.cute.rmsnorm_bwd_config import analytic_config

    dtype = torch.float16 if case == "fp16" else torch.bfloat16
    cfg = analytic_config(N, 2, small_ring=ring, streams=3)
    assert cfg is not None and cfg.streams == 3
    x, dy, dh = (random_rows((M, N), dtype, "cuda") for _ in range(3))
    w = None if case == "no_weight" else random_weight(N, dtype, "cuda")
    need_dw = case != "dx_only"
    dx, dw = _run(x, w, dy, 0.0, cfg=cfg, need_dw=need_dw, dh=dh)
    _check(x, w, dy, 0.0, dx, dw, f"N={N} M={M} {case} {cfg.short()} + dh", seed, need_dw=need_dw, dh=dh)


@pytest.mark.gpu
def test_dh_strided_expanded_and_refused(seed):
    """dh as autograd may hand it: strided rows, expanded (row stride 0); rows the ring cannot take (a
    start off 16 bytes) go to the cuTile backward with dh, right all the same."""
    from cutile_norms.cute.rmsnorm_bwd import unsupported

    M, N = 64, 24576
    x, dy = random_rows((M, N), torch.bfloat16, "cuda"), random_rows((M, N), torch.bfloat16, "cuda")
    w = random_weight(N, torch.bfloat16, "cuda")
    dhs = {"strided": random_rows((M, N + 64), torch.bfloat16, "cuda")[:, 64:],
           "expanded": random_rows((1, N), torch.bfloat16, "cuda").expand(M, N),
           "misaligned": random_rows((M, N + 1), torch.bfloat16, "cuda")[:, 1:]}
    for name, dh in dhs.items():
        assert (unsupported(x, dy, dh) is None) == (name != "misaligned"), name
        dx, dw = _run(x, w, dy, 0.0, dh=dh)
        _check(x, w, dy, 0.0, dx, dw, f"dh {name}", seed, dh=dh)


@pytest.mark.gpu
def test_cuda_graph_forward_and_backward(seed):
    """The tickets come back to 0 after each replay; a capture gets fresh ones."""
    check_graph_forward_backward("tma_smem_cached", 96, 131072, seed, EPS)


@pytest.mark.gpu
@pytest.mark.big
def test_past_2_31_elements(seed):
    check_backward_past_2_31(lambda x, w, dy: _run(x, w, dy, 0.0), 65536, seed, EPS)


@pytest.mark.gpu
@pytest.mark.parametrize("N,exact", [(6440, True), (19336, True), (20480, False), (36392, True), (20480, True)])
@pytest.mark.parametrize("with_dh", [False, True])
def test_dx_stores_stop_at_the_row(seed, N, exact, with_dh):
    """dx written into the first M rows of a NaN-poisoned buffer of M + 1: the spare row stays NaN
    (the last CTA's vectors past the row's end are stored under their flags, those every thread holds
    inside it under constant ones: whole_copies), one CTA and clusters, part-empty and exact (20480
    over 2 x 128 x 10) slices, with and without dh; dx and dw exact."""
    from cutile_norms.cute.rmsnorm_bwd_config import analytic_config

    cfg = analytic_config(N, 2, exact=exact, streams=3 if with_dh else 2)
    M = 301
    x, dy = random_rows((M, N), torch.bfloat16, "cuda"), random_rows((M, N), torch.bfloat16, "cuda")
    dh = random_rows((M, N), torch.bfloat16, "cuda") if with_dh else None
    w = random_weight(N, torch.bfloat16, "cuda")
    buf = poisoned(torch.empty(M + 1, N, dtype=torch.bfloat16, device="cuda"))
    dx, dw = _run(x, w, dy, 0.0, cfg=cfg, dh=dh, dx=buf[:M])
    assert dx.data_ptr() == buf.data_ptr()
    assert torch.isnan(buf[M]).all(), f"N={N} {cfg.short()}: dx stored past row {M - 1}'s end"
    _check(x, w, dy, 0.0, dx, dw, f"N={N} {cfg.short()} spare row" + (" + dh" if with_dh else ""), seed, dh=dh)


@pytest.mark.gpu
@pytest.mark.parametrize("N,exact", [(20480, False), (19336, True), (36392, True), (135688, True), (6440, True)])
@pytest.mark.parametrize("case", ["bf16", "fp16_dw_only", "bf16_no_weight"])
def test_part_empty_slices(seed, N, exact, case):
    """The last CTA's slice is part empty: its slots' columns past the row are zeroed once and its dx
    goes out a vector at a time, those past the row under a flag (the other CTAs store whole slices).
    Many rows per cluster (every slot refilled many times), dx and dw exact."""
    from cutile_norms.cute.rmsnorm_bwd_config import analytic_config

    dtype = torch.float16 if case.startswith("fp16") else torch.bfloat16
    cfg = analytic_config(N, 2, exact=exact)
    assert cfg.cluster_n * cfg.threads * cfg.nvb * cfg.vec > N
    M = 1500 if N < 65536 else 300
    x = random_rows((M, N), dtype, "cuda")
    dy = random_rows((M, N), dtype, "cuda")
    w = None if "no_weight" in case else random_weight(N, dtype, "cuda")
    need_dx = "dw_only" not in case
    dx, dw = _run(x, w, dy, 0.0, cfg=cfg, need_dx=need_dx)
    _check(x, w, dy, 0.0, dx, dw, f"N={N} {cfg.short()} {case}", seed, need_dx, True)


@pytest.mark.gpu
@pytest.mark.parametrize("N", [16024, 18984, 36392, 53248])
@pytest.mark.parametrize("with_dh", [False, True])
def test_rows_at_every_16_byte_offset(seed, N, with_dh):
    """Rows whose starts are 16-byte aligned and nothing more (the bulk copies' least alignment): x, dy
    and dh start at different 16-byte offsets past a 128-byte boundary, their rows at strides of an odd
    count of 16-byte vectors (every offset mod 128 over the rows), part-empty last slices (16024, 18984,
    36392) and whole ones (53248 over 8 CTAs of 7 vectors: SEVEN_PADDED); dx and dw against the fp64
    closed form, the inputs' buffers untouched."""
    M = 257
    vec = 8

    def rows_at(k, extra):  # rows of N from 16 * k bytes past a 128-byte boundary, an odd vector count apart
        stride = ((N // vec + extra) | 1) * vec
        base = random_rows((M * stride + 128,), torch.bfloat16, "cuda")
        start = (-base.data_ptr() % 128) // 2 + k * vec
        return base, base[start:start + M * stride].view(M, stride)[:, :N]

    (bx, x), (bdy, dy) = rows_at(1, 1), rows_at(6, 3)
    bdh, dh = rows_at(3, 5) if with_dh else (None, None)
    buffers = [b for b in (bx, bdy, bdh) if b is not None]
    before = [b.clone() for b in buffers]
    w = random_weight(N, torch.bfloat16, "cuda")
    dx, dw = _run(x, w, dy, 0.0, dh=dh)
    _check(x, w, dy, 0.0, dx, dw, f"N={N} rows at 16-byte offsets" + (" + dh" if with_dh else ""), seed, dh=dh)
    assert all(torch.equal(a, b) for a, b in zip(before, buffers))
