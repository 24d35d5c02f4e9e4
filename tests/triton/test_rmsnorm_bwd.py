"""Triton RMSNorm backward (cutile_norms/triton/rmsnorm_bwd.py).

CPU (Triton's interpreter, small shapes) and GPU: dx and dw against the fp64 closed form on
NaN-poisoned outputs, over dtype pairs, widths (narrow rows several per tile, 2^k +- 1, odd, split
rows, chunked parts), weight None, offset, dx or dw alone, strided x, expanded dy; dw bit-identical
over repeated runs; split rows by TMA (rms_norm_bwd_tma_kernel), narrow rows by TMA
(rms_norm_bwd_tma_rows_kernel; rms_norm_bwd_tma_rows2_kernel for rows in two pieces, and the H200's
wide rows a row a tile) and the rows they decline. GPU only:
full-size rows, CUDA graphs, M * N >= 2^31 (both kernels).
"""
from __future__ import annotations

import pytest
import torch

from tests.conftest import (check_backward, check_backward_past_2_31, check_graph_forward_backward, poisoned,
                            random_rows, random_weight)
from tests.triton._util import DEVICES, Launches, device_for, sync

DT = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
DTYPES = [("bfloat16", "bfloat16"), ("float16", "float32"), ("float32", "float32")]
EPS = 1e-6


def _rstd(x):
    return torch.rsqrt(x.float().square().mean(dim=-1) + EPS)


def _run(x, w, dy, offset, device, cfg=None, need_dx=True, need_dw=True):
    from cutile_norms.triton.rmsnorm_bwd import TRITON_BACKWARD

    M, N = x.shape
    dx = poisoned(torch.empty(M, N, dtype=x.dtype, device=x.device)) if need_dx else None
    dw = poisoned(torch.empty(N, dtype=w.dtype, device=x.device)) if need_dw and w is not None else None
    out = TRITON_BACKWARD.backward(dy, x, w, _rstd(x), offset, need_dx, need_dw, device_for(device), cfg=cfg,
                                   out=(dx, dw))
    sync(device)
    return out


def _check(x, w, dy, offset, dx, dw, what, seed, need_dx=True, need_dw=True):
    check_backward(x, w, dy, offset, dx, dw, what, seed, need_dx, need_dw, eps=EPS)


@pytest.mark.parametrize("N", [1, 7, 128, 1000, 2880, 4097, 8192, 8193, 40000, 262144, 1 << 20, 3_000_017])
@pytest.mark.parametrize("e", [2, 4])
@pytest.mark.parametrize("vendor,sms", [("nvidia", 132), ("amd", 304), ("nvidia", 20)])
def test_config_covers_the_row(N, e, vendor, sms):
    from cutile_norms.triton.rmsnorm_bwd_config import SPLIT_MAX, TILE_ELEMS, analytic_config, grid_groups

    cfg = analytic_config(N, e, vendor, sms)
    assert cfg.split * cfg.part >= N and cfg.split <= min(SPLIT_MAX, sms)
    assert cfg.split == 1 or (cfg.part % 16 == 0 and cfg.rows == 1)
    assert cfg.block_n * cfg.chunks >= cfg.part and cfg.rows * cfg.block_n <= TILE_ELEMS
    assert cfg.num_warps * (64 if vendor == "amd" else 32) <= 1024 and (vendor != "amd" or cfg.num_warps <= 16)
    assert cfg.prefetch == (N <= TILE_ELEMS or cfg.split > 1)  # measured: docs/design.md, the Triton backward
    for M in (1, 5, 10 ** 6):  # a row group's programs and the grid fit about one wave
        R = grid_groups(cfg, M, sms)
        assert 1 <= R <= max(1, -(-M // cfg.rows)) and R * cfg.split <= cfg.programs_per_sm * sms


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("N", [1, 7, 128, 129, 1000, 1128, 2880, 3624, 4097, 20000])
@pytest.mark.parametrize("x_dtype,w_dtype", DTYPES)
@pytest.mark.parametrize("M", [1, 37])
def test_matches_reference(seed, device, N, x_dtype, w_dtype, M):
    """M = 1: one row group (dw stored by the kernel); 37: several, dw through the reduction kernel."""
    x = random_rows((M, N), DT[x_dtype], device)
    w = random_weight(N, DT[w_dtype], device)
    dy = torch.randn(M, N, device=device).to(DT[x_dtype])
    dx, dw = _run(x, w, dy, 0.5, device)
    _check(x, w, dy, 0.5, dx, dw, f"N={N} M={M} {x_dtype}/{w_dtype}", seed)


# (rows, split, part, block_n, chunks, N, prefetch, programs_per_sm): prefetching programs walk several
# tiles (13 rows over the interpreter's 4 "SMs"); programs_per_sm 0 = one program per tile
CONFIG_CASES = [(1, 1, 1000, 128, 8, 1000, False, 1), (2, 2, 512, 128, 4, 1000, False, 1),
                (4, 4, 256, 256, 1, 1000, False, 1), (1, 8, 4096, 1024, 4, 30001, False, 1),
                (4, 1, 300, 512, 1, 300, False, 1), (2, 1, 300, 512, 1, 300, True, 1),
                (1, 2, 512, 512, 1, 1000, True, 2), (1, 4, 2064, 4096, 1, 8200, False, 0)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("rows,split,part,block_n,chunks,N,prefetch,pps", CONFIG_CASES)
@pytest.mark.parametrize("x_dtype,w_dtype", [("bfloat16", "float32"), ("float32", "float32")])
def test_configs_match_reference(seed, device, rows, split, part, block_n, chunks, N, prefetch, pps, x_dtype,
                                  w_dtype):
    """Chunked parts (dw read-modify-written in the program's own row), several rows per split tile,
    a short last part."""
    from cutile_norms.triton.rmsnorm_bwd_config import BwdConfig

    cfg = BwdConfig(rows=rows, split=split, part=part, block_n=block_n, chunks=chunks, num_warps=4,
                    programs_per_sm=pps, prefetch=prefetch)
    for M in (1, 13):
        x = random_rows((M, N), DT[x_dtype], device)
        w = random_weight(N, DT[w_dtype], device)
        dy = torch.randn(M, N, device=device).to(DT[x_dtype])
        dx, dw = _run(x, w, dy, 0.0, device, cfg=cfg)
        _check(x, w, dy, 0.0, dx, dw, f"{cfg.short()} M={M}", seed)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("N", [128, 1000, 20000])
@pytest.mark.parametrize("case", ["offset1", "no_weight", "dx_only", "dw_only"])
def test_offset_no_weight_and_one_grad(seed, device, N, case):
    M = 21
    x = random_rows((M, N), torch.bfloat16, device)
    w = None if case == "no_weight" else random_weight(N, torch.bfloat16, device)
    offset = 1.0 if case == "offset1" else 0.0
    dy = torch.randn(M, N, device=device).to(torch.bfloat16)
    need_dx, need_dw = case != "dw_only", case != "dx_only"
    dx, dw = _run(x, w, dy, offset, device, need_dx=need_dx, need_dw=need_dw)
    assert (dx is None) == (not need_dx) and (dw is None) == (not need_dw or w is None)
    _check(x, w, dy, offset, dx, dw, case, seed, need_dx, need_dw)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("N", [128, 20000])
def test_strided_x_expanded_dy_and_determinism(seed, device, N):
    """x's rows strided (a view of a wider tensor at an odd offset), dy expanded along the rows (row
    stride 0, as autograd hands out for a sum); dw and dx bit-identical over repeated runs."""
    M = 33
    x = random_rows((M, N + 9), torch.bfloat16, device)[:, 5:N + 5]
    w = random_weight(N, torch.float32, device)
    dy = torch.randn(1, N, device=device).to(torch.bfloat16).expand(M, N)
    runs = [_run(x, w, dy, 0.0, device) for _ in range(3)]
    _check(x, w, dy.contiguous(), 0.0, *runs[0], "strided / expanded", seed)
    for dx, dw in runs[1:]:
        assert torch.equal(dw.view(torch.int32), runs[0][1].view(torch.int32)), f"dw differs between runs [seed {seed}]"
        assert torch.equal(dx.view(torch.int16), runs[0][0].view(torch.int16)), f"dx differs between runs [seed {seed}]"


# (split, part, N, num_warps): parts of one TMA box (256 columns) or several (C = part / 256 boxes)
TMA_CASES = [(4, 256, 1024, 4), (2, 2048, 4096, 4), (8, 512, 4096, 2)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("split,part,N,warps", TMA_CASES)
@pytest.mark.parametrize("x_dtype,w_dtype,offset", [("bfloat16", "bfloat16", 0.0), ("bfloat16", "float32", 1.0),
                                                    ("float32", "float32", 0.0), ("float16", None, 0.0)])
def test_tma_split_rows(seed, device, split, part, N, warps, x_dtype, w_dtype, offset):
    """rms_norm_bwd_tma_kernel: x's rows strided (16-byte aligned, so TMA takes them), one row and
    13 rows over the grid's row groups, weight None, offset, dx alone; dx and dw bit-identical on a
    later launch (the exchange's flags flip each launch)."""
    from cutile_norms.triton.rmsnorm_bwd import tma_applies
    from cutile_norms.triton.rmsnorm_bwd_config import BwdConfig

    cfg = BwdConfig(rows=1, split=split, part=part, block_n=part, chunks=1, num_warps=warps, programs_per_sm=1,
                    prefetch=True, tma_stages=3)
    for M in (1, 13):
        x = random_rows((M, N + 8), DT[x_dtype], device)[:, :N]
        w = random_weight(N, DT[w_dtype], device) if w_dtype else None
        dy = torch.randn(M, N, device=device).to(DT[x_dtype])
        assert M == 1 or tma_applies(cfg, x, dy, x.stride(0), dy.stride(0), True, True)
        first = _run(x, w, dy, offset, device, cfg=cfg)
        _check(x, w, dy, offset, *first, f"TMA {cfg.short()} M={M} {x_dtype}/{w_dtype}", seed)
        again = _run(x, w, dy, offset, device, cfg=cfg)
        for a, b, what in zip(first, again, ("dx", "dw")):
            assert b is None or torch.equal(a, b), f"{what} differs between launches [seed {seed}]"
        dx, _ = _run(x, w, dy, offset, device, cfg=cfg, need_dw=False)
        _check(x, w, dy, offset, dx, None, f"TMA dx alone M={M}", seed, need_dw=False)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", ["misaligned_x", "expanded_dy", "odd_stride", "uneven_parts"])
def test_tma_declined_rows_take_the_pointer_kernel(seed, device, case):
    """Rows TMA cannot address (a start or row stride that is not 16-byte aligned, dy's row stride 0)
    and parts that do not tile the row go to rms_norm_bwd_kernel with the same config: still right."""
    from cutile_norms.triton.rmsnorm_bwd import tma_applies
    from cutile_norms.triton.rmsnorm_bwd_config import BwdConfig

    M, N = 9, 4096
    cfg = BwdConfig(rows=1, split=4, part=1024, block_n=1024, chunks=1, num_warps=4, programs_per_sm=1,
                    prefetch=True, tma_stages=3)
    x = random_rows((M, N + 8), torch.bfloat16, device)
    x = {"misaligned_x": x[:, 3:N + 3], "odd_stride": random_rows((M, N + 3), torch.bfloat16, device)[:, :N]}.get(case, x[:, :N])
    dy = torch.randn(1 if case == "expanded_dy" else M, N, device=device).to(torch.bfloat16).expand(M, N)
    if case == "uneven_parts":
        cfg = BwdConfig(rows=1, split=4, part=1040, block_n=2048, chunks=1, num_warps=4, programs_per_sm=1,
                        prefetch=True, tma_stages=3)
    assert not tma_applies(cfg, x, dy, x.stride(0), dy.stride(0), True, True), case
    w = random_weight(N, torch.bfloat16, device)
    dx, dw = _run(x, w, dy, 0.0, device, cfg=cfg)
    _check(x, w, dy.contiguous(), 0.0, dx, dw, case, seed)


@pytest.mark.parametrize("N", [1, 512, 520, 640, 760, 768, 1000, 1004, 1040, 1088, 1152, 1280, 1528, 1536, 2048, 2056,
                               6144, 6152, 6160, 7168, 8008, 8192])
@pytest.mark.parametrize("e", [2, 4])
@pytest.mark.parametrize("vendor", ["nvidia", "amd"])
@pytest.mark.parametrize("model", ["H100", "H200"])
def test_narrow_rows_by_tma_where_the_rule_says(N, e, vendor, model):
    """rms_norm_bwd_tma_rows_kernel's tile: NVIDIA, 16-bit rows of 520-2048 columns that are 16-byte
    vectors (rmsnorm_bwd_config.TMA_ROWS_MIN / MAX); on an H200 rows filling 3/4 of their block, or that
    two powers of two of 128 columns or more tile exactly (then in those pieces), and its `wide` band,
    rows of 6145-8192 columns that are a multiple of 16, one a tile; a tile the most rows (a power of two)
    within the model's tile_elems (an H100: TILE_ELEMS, its block's rows; an H200: 14336, up to twice
    those); its stages keep the GPU's bytes in flight (one stage fewer covers less), within
    TMA_ROWS_STAGES, and an H200 keeps at least as many bytes in flight as an H100."""
    from cutile_norms._platform import DeviceInfo
    from cutile_norms._util import pow2_ceil
    from cutile_norms.triton.rmsnorm_bwd_config import TILE_ELEMS, TMA_ROWS_STAGES, analytic_config, tma_rows_rule

    rule = tma_rows_rule(DeviceInfo(vendor, f"NVIDIA {model}", (9, 0), 132))
    cfg = analytic_config(N, e, vendor, 132, tma_rows=rule)
    h200 = model == "H200"
    two = h200 and bin(N).count("1") == 2 and N & -N >= 128
    narrow = 520 <= N <= 2048 and (N >= (0.75 if h200 else 0.0) * pow2_ceil(N) or two)
    wide = h200 and 6145 <= N <= 8192 and N % 16 == 0
    takes = vendor == "nvidia" and e == 2 and N % 8 == 0 and (narrow or wide)
    assert bool(cfg.tma_rows) == takes, cfg
    if not takes:
        return
    in_pieces = narrow and two and N < 0.75 * pow2_ceil(N)
    assert cfg.pieces == ((1 << (N.bit_length() - 1), N & -N) if in_pieces else (pow2_ceil(N),)), cfg
    rows = cfg.tma_rows
    if wide:
        assert rows == 1 and cfg.split == 1, cfg
    else:
        assert rows & (rows - 1) == 0 and rows * N <= rule.tile_elems < 2 * rows * N and cfg.split == 1, cfg
    assert rule.tile_elems == (14336 if h200 else TILE_ELEMS)
    if not wide:
        assert rows * cfg.block_n == TILE_ELEMS if model == "H100" else \
            TILE_ELEMS <= rows * cfg.block_n <= 2 * TILE_ELEMS
    per_stage = cfg.tma_rows * N * 2 * e
    lo, hi = TMA_ROWS_STAGES
    assert lo <= cfg.tma_stages <= hi
    assert cfg.tma_stages == lo or (cfg.tma_stages - 2) * per_stage < rule.in_flight
    assert cfg.tma_stages == hi or (cfg.tma_stages - 1) * per_stage >= rule.in_flight
    h100 = analytic_config(N, e, vendor, 132)
    if h100.tma_rows:
        assert (cfg.tma_stages - 1) * per_stage >= (h100.tma_stages - 1) * h100.tma_rows * N * 2 * e
        assert cfg.tma_rows >= h100.tma_rows


def test_h100_tiles_are_its_blocks_rows():
    """tma_rows_tile at TILE_ELEMS (the H100's rule, and any GPU model without one) takes the rows
    of its power-of-two block, TILE_ELEMS // pow2_ceil(N), at every width to TILE_ELEMS; twice that
    budget doubles them."""
    from cutile_norms._util import pow2_ceil
    from cutile_norms.triton.rmsnorm_bwd_config import TILE_ELEMS, tma_rows_tile

    for N in range(1, TILE_ELEMS + 1):
        assert tma_rows_tile(N, TILE_ELEMS) == TILE_ELEMS // pow2_ceil(N), N
        assert tma_rows_tile(N, 2 * TILE_ELEMS) == 2 * TILE_ELEMS // pow2_ceil(N), N


def test_narrow_rows_tma_stages_fit_the_shared_memory():
    """tma_rows_config caps the stages to what a block may take (sm_120: 99 KiB), and declines (None) where
    not even 3 fit; an H100's or an H200's 227 KiB takes the rule's stages (the H200's larger tiles too)."""
    from cutile_norms._platform import DeviceInfo
    from cutile_norms.triton.rmsnorm_bwd_config import (analytic_config, tma_rows_config, tma_rows_rule,
                                                        tma_rows_shared_bytes)

    h200 = tma_rows_rule(DeviceInfo("nvidia", "NVIDIA H200", (9, 0), 132))
    h100_cfgs = [analytic_config(N, 2, "nvidia", 132) for N in (520, 768, 1536, 2048)]
    h200_cfgs = [analytic_config(N, 2, "nvidia", 132, tma_rows=h200)
                 for N in (640, 768, 896, 1024, 1152, 1280, 1536, 1792, 1800, 2048, 6160, 7168, 8192)]
    for cfg in h100_cfgs + h200_cfgs:
        assert tma_rows_config(cfg, 227 * 1024).tma_stages == cfg.tma_stages, cfg
        assert tma_rows_shared_bytes(cfg, cfg.tma_stages, 2, 2) <= 227 * 1024
    for cfg in h100_cfgs:
        small = tma_rows_config(cfg, 99 * 1024)
        assert small.tma_stages == min(3, cfg.tma_stages) and tma_rows_shared_bytes(cfg, 3, 2, 2) <= 99 * 1024
        assert tma_rows_config(cfg, 99 * 1024, 2, 4) is None  # an fp32 dy: 3 stages take 113 KiB


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("N", [768, 896, 1536, 2040])
@pytest.mark.parametrize("x_dtype,w_dtype", [("bfloat16", "bfloat16"), ("float16", "float32"), ("bfloat16", None)])
def test_narrow_rows_by_tma(seed, device, N, x_dtype, w_dtype, monkeypatch):
    """rms_norm_bwd_tma_rows_kernel (its launches counted): one row (one program, dw stored by it), rows
    that leave the last tile part empty (M = 37, 4 "SMs": several tiles a program, dw through the
    reduction), x's rows strided (16-byte aligned), offset 1, dx alone; the rows TMA cannot address (a
    start or row stride not 16-byte aligned, dy's row stride 0) and dw alone go to the pointer kernel with
    the same config, a dx passed in then left as it was."""
    from cutile_norms.triton import rmsnorm_bwd
    from cutile_norms.triton.rmsnorm_bwd import TRITON_BACKWARD

    spy = Launches(rmsnorm_bwd.rms_norm_bwd_tma_rows_kernel)
    monkeypatch.setattr(rmsnorm_bwd, "rms_norm_bwd_tma_rows_kernel", spy)
    dev = device_for(device)
    cfg = TRITON_BACKWARD.config(N, DT[x_dtype], dev)
    assert cfg.tma_rows > 0, cfg
    for M in (1, 37):
        x = random_rows((M, N + 8), DT[x_dtype], device)[:, :N]
        w = random_weight(N, DT[w_dtype], device) if w_dtype else None
        dy = torch.randn(M, N, device=device).to(DT[x_dtype])
        before = spy.count
        dx, dw = _run(x, w, dy, 1.0, device)
        assert spy.count == before + 1, "the TMA rows kernel did not run"
        _check(x, w, dy, 1.0, dx, dw, f"TMA rows N={N} M={M} {x_dtype}/{w_dtype}", seed)
        dx, _ = _run(x, w, dy, 1.0, device, need_dw=False)
        assert spy.count == before + 2, "the TMA rows kernel did not run (dx alone)"
        _check(x, w, dy, 1.0, dx, None, f"TMA rows, dx alone, N={N} M={M}", seed, need_dw=False)
    M = 37
    base = random_rows((M, N + 9), DT[x_dtype], device)
    w = random_weight(N, DT[w_dtype], device) if w_dtype else None
    for what, x, dy in (("misaligned x", base[:, 1:N + 1], torch.randn(M, N, device=device).to(DT[x_dtype])),
                        ("odd row stride", base[:, :N], torch.randn(M, N, device=device).to(DT[x_dtype])),
                        ("expanded dy", base[:, :N].contiguous(),
                         torch.randn(1, N, device=device).to(DT[x_dtype]).expand(M, N))):
        before = spy.count
        dx, dw = _run(x, w, dy, 0.0, device)
        assert spy.count == before, f"{what}: the TMA rows kernel ran on rows TMA cannot address"
        _check(x, w, dy.contiguous(), 0.0, dx, dw, f"TMA rows declined ({what}) N={N}", seed)
    if w is not None:  # dw alone, a dx passed in: not written
        x = base[:, :N].contiguous()
        dy = torch.randn(M, N, device=device).to(DT[x_dtype])
        dx_in = poisoned(torch.empty(M, N, dtype=x.dtype, device=x.device))
        dw = poisoned(torch.empty(N, dtype=w.dtype, device=x.device))
        before = spy.count
        TRITON_BACKWARD.backward(dy, x, w, _rstd(x), 0.0, False, True, dev, out=(dx_in, dw))
        sync(device)
        assert spy.count == before and torch.isnan(dx_in).all(), "dx written where it was not asked for"
        _check(x, w, dy, 0.0, None, dw, f"TMA rows config, dw alone N={N}", seed, need_dx=False)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("N,most", [(640, 2), (1152, 2), (1280, 2), (2304, 2), (6160, 1), (7168, 1), (8192, 1)])
@pytest.mark.parametrize("x_dtype,w_dtype", [("bfloat16", "bfloat16"), ("float16", "float32"), ("bfloat16", None)])
def test_rows_in_pieces_and_wide_rows_by_tma(seed, device, N, most, x_dtype, w_dtype, monkeypatch):
    """The TMA rows kernel's H200 forms on any GPU with TMA (and the interpreter): rows in two pieces
    (rms_norm_bwd_tma_rows2_kernel; row_pieces, the powers of two that tile the row exactly, TILE_ELEMS
    tiles) and the `wide` band's rows of 6145-8192 columns, one a tile; the launches counted: one row and
    rows leaving the last tile part empty (M = 37 over 4 "SMs": dw through the reduction), x's rows
    strided, offset 1, dx alone; rows past TMA_ROWS_MAX at a stride 16 bytes off 32 go to the pointer
    kernel."""
    from dataclasses import replace

    from cutile_norms.triton import rmsnorm_bwd
    from cutile_norms.triton.rmsnorm_bwd_config import (TILE_ELEMS, TMA_ROWS_MAX, analytic_config, row_pieces,
                                                        tma_rows_tile)

    name = "rms_norm_bwd_tma_rows2_kernel" if most == 2 else "rms_norm_bwd_tma_rows_kernel"
    spy = Launches(getattr(rmsnorm_bwd, name))
    monkeypatch.setattr(rmsnorm_bwd, name, spy)
    pieces = row_pieces(N, most)
    assert len(pieces) == most and (sum(pieces) == N or most == 1), pieces
    cfg = replace(analytic_config(N, 2, "nvidia", 4), tma_rows=tma_rows_tile(N, TILE_ELEMS) if most == 2 else 1,
                  tma_stages=3, tma_pieces=pieces if most == 2 else ())
    wide = N > TMA_ROWS_MAX  # rows past it take the kernel at 32-byte aligned strides only
    pad = 16 if wide else 8
    for M in (1, 37):
        x = random_rows((M, N + pad), DT[x_dtype], device)[:, :N]
        w = random_weight(N, DT[w_dtype], device) if w_dtype else None
        dy = torch.randn(M, N, device=device).to(DT[x_dtype])
        before = spy.count
        dx, dw = _run(x, w, dy, 1.0, device, cfg=cfg)
        assert spy.count == before + 1, "the TMA rows kernel did not run"
        _check(x, w, dy, 1.0, dx, dw, f"TMA rows {cfg.pieces} x {cfg.tma_rows} N={N} M={M} {x_dtype}/{w_dtype}", seed)
        if wide and M > 1:  # x's rows 16 bytes off 32, by their stride or their start: the pointer kernel, right
            strided = random_rows((M, N + 8), DT[x_dtype], device)[:, :N]
            shifted = random_rows((M, N + 16), DT[x_dtype], device)[:, 8:N + 8]
            for what, x_off in (("a stride of N + 8", strided), ("a start 16 bytes in", shifted)):
                dx, dw = _run(x_off, w, dy, 1.0, device, cfg=cfg)
                assert spy.count == before + 1, f"the TMA rows kernel ran on wide rows at {what}"
                _check(x_off, w, dy, 1.0, dx, dw, f"wide rows at {what}, N={N}", seed)
        dx, _ = _run(x, w, dy, 1.0, device, cfg=cfg, need_dw=False)
        assert spy.count == before + 2, "the TMA rows kernel did not run (dx alone)"
        _check(x, w, dy, 1.0, dx, None, f"TMA rows {cfg.pieces}, dx alone, N={N} M={M}", seed, need_dw=False)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("N", [640, 1152, 6160, 8192])
def test_h200_rule_configs_by_tma(seed, device, N, monkeypatch):
    """The configs the H200's rule gives (its tiles and stages: 640 in 16-row tiles of two pieces, 1152 in
    8-row ones, the `wide` rows one a tile at 5 / 4 stages) through their entry point on this device,
    with dy's rows strided and an fp32 weight; M = 37 over 4 "SMs"."""
    from cutile_norms.triton import rmsnorm_bwd
    from cutile_norms.triton.rmsnorm_bwd_config import TMA_ROWS_BY_MODEL, analytic_config

    cfg = analytic_config(N, 2, "nvidia", 4, tma_rows=TMA_ROWS_BY_MODEL["H200"])
    assert cfg.tma_rows > 0, cfg
    name = "rms_norm_bwd_tma_rows2_kernel" if len(cfg.pieces) == 2 else "rms_norm_bwd_tma_rows_kernel"
    spy = Launches(getattr(rmsnorm_bwd, name))
    monkeypatch.setattr(rmsnorm_bwd, name, spy)
    M = 37
    x = random_rows((M, N), torch.bfloat16, device)
    w = random_weight(N, torch.float32, device)
    dy = torch.randn(M, N + 16, device=device).to(torch.bfloat16)[:, :N]
    dx, dw = _run(x, w, dy, 0.0, device, cfg=cfg)
    assert spy.count == 1, f"{name} did not run"
    _check(x, w, dy, 0.0, dx, dw, f"the H200 rule's config {cfg.short()} N={N}", seed)


def test_row_pieces():
    """row_pieces: the row's binary digits (powers of two of at least `least` columns, largest first)
    where at most `most` tile it exactly, else one power-of-two block."""
    from cutile_norms._util import pow2_ceil
    from cutile_norms.triton.rmsnorm_bwd_config import row_pieces

    assert row_pieces(7168, 3) == (4096, 2048, 1024) and row_pieces(7168, 2) == (8192,)
    assert row_pieces(1152, 2) == (1024, 128) and row_pieces(1040, 2) == (2048,)
    assert row_pieces(1040, 2, 16) == (1024, 16)
    assert row_pieces(2048, 3) == (2048,) and row_pieces(1800, 3) == (2048,)
    for N in range(8, 8200, 8):
        for most in (1, 2, 3):
            p = row_pieces(N, most)
            exact = sum(p) == N and len(p) <= most and all(q >= 128 for q in p)
            assert all(q & (q - 1) == 0 for q in p) and list(p) == sorted(set(p), reverse=True), (N, most, p)
            assert exact or p == (pow2_ceil(N),), (N, most, p)
            assert exact == (bin(N).count("1") <= most and N & -N >= 128), (N, most, p)


def test_dh_rows_rule():
    """tma_rows_take with dh (the residual add's backward) at every multiple of 8 to 8192: on an H200 rows
    of 520-1024 columns (one block), of 1025-1456 at a multiple of 16 filling 53 % of their 2048 block or
    that two powers of two tile exactly, and of 6144-8192 at a multiple of 16 (6144 in two pieces), 3
    stages, pieces only where they tile the row exactly; on an H100 none. A rule whose dh bands leave their
    ranges is refused."""
    from cutile_norms._platform import DeviceInfo
    from cutile_norms._util import pow2_ceil
    from cutile_norms.triton.rmsnorm_bwd_config import TmaRowsRule, tma_rows_align, tma_rows_rule, tma_rows_take

    h200, h100 = (tma_rows_rule(DeviceInfo("nvidia", f"NVIDIA {m}", (9, 0), 132)) for m in ("H200", "H100"))
    for N in range(8, 8200, 8):
        take = tma_rows_take(N, 2, h200, dh=True)
        two = bin(N).count("1") == 2 and N & -N >= 128
        narrow = 520 <= N <= 1024 or (1024 < N <= 1456 and N % 16 == 0 and (N >= 0.53 * 2048 or two))
        wide = 6144 <= N <= 8192 and N % 16 == 0
        assert bool(take) == (narrow or wide), (N, take)
        assert not tma_rows_take(N, 2, h100, dh=True), N
        if take:
            pieces = take["tma_pieces"] or (pow2_ceil(N),)
            assert take["tma_stages"] == 3 and (sum(pieces) == N or len(pieces) == 1), (N, take)
            assert take["tma_rows"] == 1 if wide else take["tma_rows"] * N <= h200.tile_elems, (N, take)
            assert tma_rows_align(N, dh=True) == (32 if N > 1024 else 16)
    assert tma_rows_take(6144, 2, h200, dh=True)["tma_pieces"] == (4096, 2048)
    for bad in (dict(dh_max=4096), dict(dh_max=100), dict(dh_wide=(1024, 8192)), dict(dh_wide=(6144, 9000))):
        with pytest.raises(ValueError, match="dh_"):
            TmaRowsRule(in_flight=1, **bad)


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
    dy = torch.randn(M, N, device="cuda").to(DT[x_dtype])
    dx, dw = _run(x, w, dy, 0.0, "cuda")
    _check(x, w, dy, 0.0, dx, dw, f"N={N} M={M}", seed)


@pytest.mark.gpu
@pytest.mark.parametrize("N", [896, 4096, 65536])
def test_cuda_graph_forward_and_backward(seed, N):
    """The exchange's flags flip on every replay as on an eager launch (65536: the split rows' TMA
    kernel); 896: the narrow rows' TMA kernel, its descriptors built at capture."""
    check_graph_forward_backward("triton", 64, N, seed, EPS)


@pytest.mark.gpu
@pytest.mark.parametrize("x_dtype", ["bfloat16", "float16"])
def test_behind_the_mode_none_forward(seed, x_dtype):
    """mode=None at N = 7168 (dispatch.BACKWARD_TABLE): Triton's backward behind the table's forward,
    with the forward's saved rstd; x strided, dy expanded."""
    import cutile_norms as cn
    from cutile_norms import dispatch
    from cutile_norms._platform import device_info, toolchain

    N, M = 7168, 300
    dev = device_info("cuda")
    choice = dispatch.resolve(None, dev, toolchain(), DT[x_dtype], M, N)
    if choice.backward_mode != "triton":
        pytest.skip(f"mode=None's backward here is {choice.backward_mode!r} ({dev.name}): {choice.reason}")
    base = random_rows((M, N + 16), DT[x_dtype], "cuda")
    x = base[:, :N].detach().requires_grad_()
    w = random_weight(N, DT[x_dtype], "cuda").requires_grad_()
    dy = torch.randn(1, N, device="cuda").to(DT[x_dtype]).expand(M, N)
    cn.rms_norm(x, w, EPS).backward(dy)
    assert cn.explain(x, w).split("backward:")[-1].lstrip().startswith("Triton"), cn.explain(x, w)
    _check(x.detach(), w.detach(), dy, 0.0, x.grad, w.grad, f"mode=None {choice.mode} + triton backward", seed)


@pytest.mark.gpu
@pytest.mark.big
def test_full_size_bf16(seed):
    for N in (128, 4096, 262144):
        M = (1 << 27) // N
        x = random_rows((M, N), torch.bfloat16, "cuda")
        w = random_weight(N, torch.bfloat16, "cuda")
        dy = torch.randn(M, N, device="cuda").to(torch.bfloat16)
        dx, dw = _run(x, w, dy, 0.0, "cuda")
        _check(x, w, dy, 0.0, dx, dw, f"full size N={N}", seed)
        del x, dy, dx, dw
        torch.cuda.empty_cache()


@pytest.mark.gpu
@pytest.mark.big
@pytest.mark.parametrize("N", [1280, 1536, 8192, 8200, 65536])
def test_past_2_31_elements(seed, N):
    """int64 row offsets: rms_norm_bwd_tma_rows_kernel (1536; 8192 on an H200, its `wide` band; 1280 on an
    H100), rms_norm_bwd_tma_rows2_kernel (1280 on an H200, two pieces), rms_norm_bwd_kernel (8192 on an
    H100; 8200 on both) and rms_norm_bwd_tma_kernel (65536)."""
    check_backward_past_2_31(lambda x, w, dy: _run(x, w, dy, 0.0, "cuda"), N, seed, EPS)
