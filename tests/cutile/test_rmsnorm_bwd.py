"""cuTile RMSNorm backward (cutile_norms/cutile/rmsnorm_bwd.py).

GPU tests (marked `gpu`, skipped without an sm_90+ GPU): dx and dw against the fp64 closed form over
the dtype / width / M matrix, through the backend on NaN-poisoned outputs and through autograd for
every cuTile mode; strided x, expanded and transposed dy, weight None, offset, dx or dw alone;
bit-identical dw over repeated runs; CUDA-graph capture of forward + backward; M * N >= 2^31.
CPU tests: the config rules. The compile checks for sm_90/sm_100 live in test_rmsnorm_bwd_compile.py.
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
# the H200's own fp32 rows (MODEL_ROWS_ONLY): three pieces at 4 blocks (1320), at 3 (1604), the 2048 row's 4
# blocks on a 2048 piece and a tail (2052)
WIDTHS = [1, 7, 127, 128, 129, 1000, 1024, 1320, 1604, 2052, 2312, 2880, 3112, 4095, 4096, 4097, 5120, 7168, 14344, 16383,
          19336, 32768, 65537, 262144]
EPS = 1e-6


# ------------------------------------------------------------------------------------------------
# CPU: config rules
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("N", [1, 7, 128, 1000, 2880, 4096, 4097, 8192, 65537, 262144, 1 << 20])
@pytest.mark.parametrize("e", [2, 4])
def test_analytical_config_covers_the_row(N, e):
    from cutile_norms.cutile.rmsnorm_bwd_config import MAX_SPLIT, PART_ELEMS, analytical_config, dx_2d, part_of, row_pieces

    cfg = analytical_config(N, e)
    part = part_of(cfg, N)
    assert cfg.split * part >= N and (part % 16 == 0 or cfg.split == 1)
    assert cfg.split == 1 or cfg.tile_m == 1
    assert cfg.tile_m * part <= PART_ELEMS * 5 // 4 or cfg.split == MAX_SPLIT  # registers: 4 fp32 values per element
    covered = sum(size for _, size in row_pieces(part, cfg.piece_min))
    assert covered >= part and covered - part < max(64, part // 8 + 1)  # no power-of-two padding waste
    if cfg.split == 1:
        assert dx_2d(cfg, N)


def test_config_validation():
    from cutile_norms.cutile.rmsnorm_bwd import grid_rows
    from cutile_norms.cutile.rmsnorm_bwd_config import BwdConfig

    with pytest.raises(ValueError, match="power of two"):
        BwdConfig(split=3)
    with pytest.raises(ValueError, match="tile_m=1"):
        BwdConfig(split=2, tile_m=2)
    assert grid_rows(BwdConfig(tile_m=4), 10, 132) == 3  # at most one row group per tile
    assert grid_rows(BwdConfig(split=4, blocks_per_sm=2), 10 ** 6, 132) == 66
    assert grid_rows(BwdConfig(), 1, 132) == 1


def test_a_gpu_model_measured_on_its_own_takes_its_configs():
    """An H200 runs the sm_90/H200 rows of tuning/rmsnorm_bwd_configs.json for 16-bit x (fp16 borrows
    bf16's) and the arch's for fp32, which it lacks; an H800 (not measured) runs the arch's."""
    from cutile_norms._platform import DeviceInfo
    from cutile_norms.cutile.rmsnorm_bwd_config import config_and_source

    h200 = DeviceInfo("nvidia", "NVIDIA H200", (9, 0), 132, 0)
    h800 = DeviceInfo("nvidia", "NVIDIA H800", (9, 0), 132, 0)
    for dtype, e in (("bfloat16", 2), ("float16", 2)):
        assert "on sm_90/H200 in bfloat16" in config_and_source(3584, e, h200, dtype)[1]
        assert "on sm_90 in bfloat16" in config_and_source(3584, e, h800, dtype)[1]
    assert "on sm_90 in float32" in config_and_source(3584, 4, h200, "float32")[1]


def test_the_sweep_writer_keeps_the_commands_of_earlier_sweeps(tmp_path, monkeypatch):
    """bench/tune/cutile_rmsnorm_bwd.py --write-configs[-from]: a sweep of some widths replaces those
    widths' rows, keeps the others, and appends its command to the dtype's record instead of replacing it."""
    import json

    from bench.tune import cutile_rmsnorm_bwd as tune

    path = tmp_path / "rmsnorm_bwd_configs.json"
    monkeypatch.setattr(tune, "CONFIG_TABLE", str(path))
    fields = {"tile_m": 1, "split": 4, "piece_min": 2048, "blocks_per_sm": 2, "num_worker_warps": 8, "latency": 1,
              "prefetch": False}

    def sweep(command, widths, prefetch):
        cfg = dict(fields, prefetch=prefetch)
        return {"dtype": "float32", "command": command,
                "sweep": [{"N": n, "dw_share": 0.01, "configs": [{"fields": cfg, "vs_copy": 0.9, "ms": 1.0}]}
                          for n in widths]}

    tune.write_configs(sweep("first --ns 12288,16384", [12288, 16384], False), "NVIDIA H100 80GB HBM3", "sm_90")
    tune.write_configs(sweep("second --ns 12288", [12288], True), "NVIDIA H100 80GB HBM3", "sm_90")
    table = json.loads(path.read_text())
    rows = {e["N"]: e["config"]["prefetch"] for e in table["configs"]["sm_90"]["float32"]}
    assert rows == {12288: True, 16384: False}
    command = table["source"]["sm_90"]["runs"]["float32"]["command"]
    assert command.startswith("first --ns 12288,16384 (") and command.endswith("; then second --ns 12288"), command


def test_the_sweep_writer_gives_a_band_one_config(tmp_path, monkeypatch):
    """--write-configs-from ... --bands: a band's widths all take the config with the best worst case over
    them (pieces as the cut rule cuts them), not each width's best; widths outside a band keep their best."""
    import json

    from bench.tune import cutile_rmsnorm_bwd as tune
    from cutile_norms.cutile.rmsnorm_bwd_config import BwdConfig, cut_pieces

    path = tmp_path / "rmsnorm_bwd_configs.json"
    monkeypatch.setattr(tune, "CONFIG_TABLE", str(path))

    def rec(N, blocks, ratio):
        fields = dict(vars(cut_pieces(BwdConfig(blocks_per_sm=blocks, num_worker_warps=4, prefetch=True), N)))
        return {"fields": fields, "vs_copy": ratio}
    # 3 blocks per SM wins at 1600 and 1700 but falls to 0.80 at 1800; 4 blocks holds 0.95 everywhere
    ratios = {1600: (0.99, 0.96), 1700: (0.99, 0.95), 1800: (0.80, 0.97), 2400: (0.90, 0.93)}
    results = {"dtype": "float32", "command": "sweep", "sweep": [
        {"N": n, "dw_share": 0.01, "configs": [rec(n, 3, r3), rec(n, 4, r4)]} for n, (r3, r4) in ratios.items()]}
    tune.write_configs(results, "NVIDIA H100 80GB HBM3", "sm_90", [(1537, 2047)])
    rows = {e["N"]: e for e in json.loads(path.read_text())["configs"]["sm_90"]["float32"]}
    assert {n: e["config"]["blocks_per_sm"] for n, e in rows.items()} == {1600: 4, 1700: 4, 1800: 4, 2400: 4}
    assert rows[1600]["vs_copy"] == 0.96 and "dw_share" not in rows[1600]  # timed for the sweep's best only
    assert rows[1800]["dw_share"] == 0.01  # the band's config is 1800's best too
    results["sweep"][-1]["configs"] = [rec(2400, 2, 0.90)]  # a config timed at no other width: none in common
    with pytest.raises(SystemExit, match="no config timed at every width"):
        tune.write_configs(results, "NVIDIA H100 80GB HBM3", "sm_90", [(1537, 2500)])


def test_h200_fp32_rows_hold_for_their_widths_only():
    """The H200's own fp32 rows (MODEL_ROWS_ONLY) decide its configs at 1025-2559 columns without dh, one
    config per band there (measured 0.93-1.01 x copy, where the H100's rows scaled gave 0.63-0.81);
    outside that span, and with dh, the H100's rows as before."""
    from cutile_norms._platform import DeviceInfo
    from cutile_norms.cutile import rmsnorm_bwd_config as C

    h100 = DeviceInfo("nvidia", "NVIDIA H100 80GB HBM3", (9, 0), 132, 0)
    h200 = DeviceInfo("nvidia", "NVIDIA H200", (9, 0), 132, 0)
    (key, dtype), (lo, hi) = next(iter(C.MODEL_ROWS_ONLY.items()))
    assert (key, dtype) == ("sm_90/H200", "float32")
    own = C.measured_configs()[key][dtype]
    assert lo <= own[0][0] and own[-1][0] <= hi
    for N in (128, 512, 1000, lo - 1, hi + 1, 2880, 4096, 65536):
        assert C.config_and_source(N, 4, h200, dtype) == C.config_and_source(N, 4, h100, dtype), N
    for N in (1032, 1320, 1604, 2400):
        assert C.default_config(N, 4, h200, dtype, has_dh=True) == C.default_config(N, 4, h100, dtype, has_dh=True)
        assert f"on {key} in float32" in C.config_and_source(N, 4, h200, dtype)[1]
    bands = {(1025, 1536): (4, 4), (1537, 2047): (3, 4), (2049, 2559): (3, 8)}  # blocks per SM, warps
    for (b_lo, b_hi), shape in bands.items():
        rows = [cfg for n, cfg, _ in own if b_lo <= n <= b_hi]
        assert len(rows) >= 5 and {(c.tile_m, c.blocks_per_sm, c.num_worker_warps, c.prefetch) for c in rows} == \
            {(1,) + shape + (True,)}, (b_lo, b_hi)
        for N in range(b_lo + 3 - (b_lo + 3) % 4 + 12, b_hi - 12, 44):  # between the entries, away from the edges
            c = C.default_config(N, 4, h200, dtype)
            assert (c.tile_m, c.blocks_per_sm, c.num_worker_warps, c.prefetch) == (1,) + shape + (True,), N


def test_dh_configs_prefetch_and_fit():
    """The residual add's backward (has_dh): one-row tiles always prefetch, at fewer blocks per SM where
    the next row's x, dy and dh do not fit (the H100's 6144 and 7168, whose table configs do not
    prefetch, at 1: measured 0.943 / 0.986 against 0.860 / 0.834); multi-row tiles keep to the blocks
    their registers fit; 16-bit rows of 2-4 KiB 4 blocks where they fit, else 3 (NARROW_DH_ROW); rows of
    2-16 KiB one-row tiles on both GPUs, the H200's own multi-row and split rows replaced by the arch's
    (_dh_takes_arch_row: H200 1536 0.804 -> 0.970, 7432 0.880 -> 0.988); without dh the configs are the
    table's."""
    from cutile_norms._platform import DeviceInfo
    from cutile_norms.cutile import rmsnorm_bwd_config

    h100 = DeviceInfo("nvidia", "NVIDIA H100 80GB HBM3", (9, 0), 132, 0)
    h200 = DeviceInfo("nvidia", "NVIDIA H200", (9, 0), 132, 0)
    lo, hi = rmsnorm_bwd_config.NARROW_DH_ROW[0], rmsnorm_bwd_config.ONE_DH_PIECE_MAX_N
    for dev in (h100, h200):
        for N in (1048, 1280, 1344, 1536, 1664, 2048, 3584, 5120, 6144, 7168, 7432, 8192, 12288, 20480, 65536):
            plain = rmsnorm_bwd_config.default_config(N, 2, dev, "bfloat16")
            cfg = rmsnorm_bwd_config.default_config(N, 2, dev, "bfloat16", has_dh=True)
            if lo <= N <= hi:  # one-row tiles that prefetch, on every model
                assert (cfg.tile_m, cfg.split, cfg.prefetch) == (1, 1, True), (dev.name, N, cfg.short())
            else:
                assert (cfg.tile_m, cfg.split) == (plain.tile_m, plain.split)
                assert cfg.blocks_per_sm <= plain.blocks_per_sm
                assert cfg.prefetch or cfg.tile_m > 1, (dev.name, N, cfg.short())
    for N in (6144, 7168):
        cfg = rmsnorm_bwd_config.default_config(N, 2, h100, "bfloat16", has_dh=True)
        assert cfg.prefetch and cfg.blocks_per_sm == 1, cfg.short()
    for N in (1280, 1536, 7168, 7432):  # the H200's own rows there are 2-row tiles or split rows
        own = rmsnorm_bwd_config.default_config(N, 2, h200, "bfloat16")
        assert own.tile_m > 1 or own.split > 1, (N, own.short())
        _, why = rmsnorm_bwd_config.config_and_source(N, 2, h200, "bfloat16", has_dh=True)
        assert "with dh: the arch's row" in why and "sm_90 in" in why, why
        assert "with dh" not in rmsnorm_bwd_config.config_and_source(N, 2, h100, "bfloat16", has_dh=True)[1]
    # an fp32 weight keeps the model's row and _dh_fit's fewer blocks (its registers)
    assert rmsnorm_bwd_config.default_config(1344, 2, h200, "bfloat16", fp32_weight=True, has_dh=True).blocks_per_sm < \
        rmsnorm_bwd_config.default_config(1344, 2, h200, "bfloat16", fp32_weight=True).blocks_per_sm
    for N, blocks in ((1048, 4), (1344, 4), (1816, 3), (2048, 4), (2056, 3), (2312, 3)):  # the H100's rows of 2-5 KiB
        assert rmsnorm_bwd_config.default_config(N, 2, h100, "bfloat16", has_dh=True).blocks_per_sm == blocks, N
    for N, blocks in ((1280, 4), (1536, 4), (1664, 4), (1960, 3)):  # the H200's
        assert rmsnorm_bwd_config.default_config(N, 2, h200, "bfloat16", has_dh=True).blocks_per_sm == blocks, N


def test_prefetch_is_kept_where_its_registers_fit():
    """A prefetching config used where its registers were not measured: kept at 1 block per SM (N =
    10728 from 10240's), dropped where the estimate exceeds 2 blocks' share (6264 from 6144's), 2 blocks
    per SM for 3624's extra piece; an fp32 weight changes nothing (3584 keeps its 3 blocks: the cuTile kernel
    on an H200 0.960 x copy beside an fp32 weight, 0.962 beside a bf16 one; 5120 keeps the prefetch: 0.912,
    0.577 without)."""
    from cutile_norms._platform import DeviceInfo
    from cutile_norms.cutile.rmsnorm_bwd_config import config_and_source

    h200 = DeviceInfo("nvidia", "NVIDIA H200", (9, 0), 132, 0)
    assert config_and_source(10728, 2, h200, "bfloat16")[0].prefetch
    cfg, why = config_and_source(6264, 2, h200, "bfloat16")
    assert not cfg.prefetch and "no prefetch" in why
    measured = config_and_source(3584, 2, h200, "bfloat16")[0]
    assert measured.blocks_per_sm == 3 and measured.prefetch
    for N in (3584, 5120, 6144):
        assert config_and_source(N, 2, h200, "bfloat16", fp32_weight=True)[0] == \
            config_and_source(N, 2, h200, "bfloat16")[0], N
    # a fourth piece at 3624 (3584's config has three): 3 blocks per SM spilled 76 bytes, 0.61 x copy
    cfg = config_and_source(3624, 2, h200, "bfloat16")[0]
    assert cfg.blocks_per_sm == 2 and cfg.prefetch


def test_describe_gives_the_config_with_dh():
    """explain()'s residual backward line: the cuTile backend describes the config a launch with dh runs
    (the dh rules), not the norm's own, which differs at the H200's 7168 (a split row without dh)."""
    from cutile_norms._platform import DeviceInfo
    from cutile_norms.cutile.rmsnorm_bwd import PERSISTENT_BACKWARD
    from cutile_norms.cutile.rmsnorm_bwd_config import config_and_source

    h200 = DeviceInfo("nvidia", "NVIDIA H200", (9, 0), 132, 0)
    plain = PERSISTENT_BACKWARD.describe(300, 7168, torch.bfloat16, h200)
    with_dh = PERSISTENT_BACKWARD.describe(300, 7168, torch.bfloat16, h200, has_dh=True)
    cfg, source = config_and_source(7168, 2, h200, "bfloat16", has_dh=True)
    assert cfg.short() in with_dh and source in with_dh and "dh" in source, with_dh
    assert with_dh != plain and config_and_source(7168, 2, h200, "bfloat16")[0].short() in plain


def test_three_blocks_where_three_pieces_fit():
    """rmsnorm_bwd_config.THREE_BLOCK_LANES, on every GPU model's table: 16-bit rows in one-row
    prefetching tiles of at most 3 pieces and 3584 lanes run 3 blocks per SM, where the table's config or
    the estimate left 2 (the H100's 2049-2431 from the 2048 entry and 3073-3584 from the 2880 and 4096
    entries; the H200's 2049-2289 and 3073-3212), with an fp32 weight too (its registers are the bf16
    weight's: rmsnorm_bwd.row_align); a fourth piece and one 4096 piece keep 2."""
    from cutile_norms._platform import DeviceInfo
    from cutile_norms.cutile.rmsnorm_bwd_config import THREE_BLOCK_LANES, config_and_source

    h100 = DeviceInfo("nvidia", "NVIDIA H100 80GB HBM3", (9, 0), 132, 0)
    h200 = DeviceInfo("nvidia", "NVIDIA H200", (9, 0), 132, 0)
    for N in (2056, 2312, 2424, 3080, 3112, 3240, 3456, THREE_BLOCK_LANES):
        for dtype in ("bfloat16", "float16"):
            cfg, why = config_and_source(N, 2, h100, dtype)
            assert cfg.blocks_per_sm == 3 and cfg.prefetch and cfg.split == 1, (N, cfg)
        assert "at most 3 pieces" in why, why
        assert config_and_source(N, 2, h100, "bfloat16", fp32_weight=True)[0] == cfg, N
    for N in (3592, 3648, 4000):  # a fourth piece, one 4096 piece
        assert config_and_source(N, 2, h100, "bfloat16")[0].blocks_per_sm == 2, N
    for N in (2056, 2104, 2200, 2288, 3112, 3160, 3208):  # the H200's rows left 2 here
        cfg, why = config_and_source(N, 2, h200, "bfloat16")
        assert cfg.blocks_per_sm == 3 and cfg.prefetch and cfg.split == 1, (N, cfg)
        assert "sm_90/H200" in why and "at most 3 pieces" in why, why
        # the H100's config at each (test_rmsnorm_bwd_compile.test_three_block_configs_fit: ptxas)
        assert cfg == config_and_source(N, 2, h100, "bfloat16")[0], N
        assert config_and_source(N, 2, h200, "bfloat16", fp32_weight=True)[0] == cfg, N
    for N in (3592, 3624):  # a fourth piece
        assert config_and_source(N, 2, h200, "bfloat16")[0].blocks_per_sm == 2, N


def test_one_padded_piece_where_the_pieces_spill():
    """rmsnorm_bwd_config.SPILLING_PIECES, on a GPU model's own table only (the H200's): 16-bit rows of four
    pieces, and three-piece rows whose 3-block launch with the weight, dx and dw spills 12-24 bytes (3073-3104;
    bf16 beside a bf16 weight at the multiples of 16 of 3329-3583), run one padded 4096 piece at 2 blocks per
    SM; their neighbours without spills (8 (mod 16), fp16, an fp32 weight at 3329-3583, no weight or one grad,
    3584's exact pieces, 3112, 3328) keep their pieces at 3 blocks; the H100 keeps its pieces."""
    from cutile_norms._platform import DeviceInfo
    from cutile_norms.cutile.rmsnorm_bwd_config import config_and_source

    h100 = DeviceInfo("nvidia", "NVIDIA H100 80GB HBM3", (9, 0), 132, 0)
    h200 = DeviceInfo("nvidia", "NVIDIA H200", (9, 0), 132, 0)
    one = [(3080, "bfloat16", True), (3104, "float16", True), (3344, "bfloat16", False), (3360, "bfloat16", False),
           (3568, "bfloat16", False), (3592, "bfloat16", True), (3600, "float16", True), (3624, "bfloat16", True),
           (3640, "bfloat16", True)]  # (N, dtype, beside an fp32 weight too)
    kept = [(3072, "bfloat16"), (3112, "bfloat16"), (3328, "bfloat16"), (3352, "bfloat16"), (3432, "bfloat16"),
            (3360, "float16"), (3520, "float16"), (3584, "bfloat16"), (3576, "bfloat16")]
    for N, dtype, fp32_too in one:
        for fp32_weight in (False, True):
            cfg, why = config_and_source(N, 2, h200, dtype, fp32_weight=fp32_weight)
            if fp32_weight and not fp32_too:
                assert cfg.piece_min < 4096 and "padded" not in why, (N, dtype, cfg, why)
                continue
            assert (cfg.piece_min, cfg.blocks_per_sm, cfg.prefetch) == (4096, 2, True), (N, dtype, cfg)
            assert "one padded 4096 piece" in why and "3 blocks per SM" not in why, why
        frozen = config_and_source(N, 2, h200, dtype, full=False)[0]  # no spills without the weight's grad
        assert (frozen.piece_min == 4096) == (N > 3584), (N, dtype, frozen)
        assert "padded" not in config_and_source(N, 2, h100, dtype)[1], N
        _, dh_why = config_and_source(N, 2, h200, dtype, has_dh=True)  # the dh rules decide with dh
        assert "spill at 3" not in dh_why and "four pieces" not in dh_why, dh_why
    for N, dtype in kept:
        cfg, why = config_and_source(N, 2, h200, dtype)
        assert cfg.piece_min < 4096 and cfg.blocks_per_sm == 3 and "padded" not in why, (N, dtype, cfg)



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
