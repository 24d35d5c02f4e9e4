"""The cuTile backward's launch configs (cutile_norms/cutile/rmsnorm_bwd_config.py), CPU only: the analytical
rule, the measured tables and the rules that adjust their rows on each GPU model, and the sweep's table writer
(bench/tune/cutile_rmsnorm_bwd.py). The kernel's GPU tests live in test_rmsnorm_bwd.py.
"""
from __future__ import annotations

import pytest
import torch


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
    bf16's) and the arch's for fp32 outside its own fp32 rows' widths (MODEL_ROWS_ONLY); an H800 (not
    measured) runs the arch's."""
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
    """--write-configs-from ... --bands: a band's widths all take the one config with the best worst case over
    them, among one-row tiles of one block a row whose pieces are the cut rule's (the shape a width between
    the table's rows keeps); widths outside a band keep their best."""
    import json

    from bench.tune import cutile_rmsnorm_bwd as tune
    from cutile_norms.cutile.rmsnorm_bwd_config import BwdConfig, cut_pieces

    path = tmp_path / "rmsnorm_bwd_configs.json"
    monkeypatch.setattr(tune, "CONFIG_TABLE", str(path))

    def rec(N, blocks, ratio, warps=4, **fields):
        cfg = cut_pieces(BwdConfig(blocks_per_sm=blocks, num_worker_warps=warps), N)
        return {"fields": dict(vars(cfg), **fields), "vs_copy": ratio}
    # 3 blocks win at 1600 / 1700 but fall to 0.80 at 1800; 4 blocks hold 0.95; a 2-row tile and one padded
    # piece hold more (0.99) but change shape between the table's rows, so the band may not take them
    sweep = [{"N": n, "dw_share": 0.01, "configs": [rec(n, 3, r3), rec(n, 4, r4), rec(n, 2, 0.99, tile_m=2),
                                                    rec(n, 2, 0.99, piece_min=4096)]}
             for n, (r3, r4) in {1600: (0.99, 0.96), 1700: (0.99, 0.95), 1800: (0.80, 0.97)}.items()]
    sweep.append({"N": 2400, "dw_share": 0.02, "configs": [rec(2400, 3, 0.93, 8), rec(2400, 4, 0.90, 8)]})
    results = {"dtype": "float32", "command": "sweep", "sweep": sweep}
    tune.write_configs(results, "NVIDIA H100 80GB HBM3", "sm_90", [(1537, 2047)])
    rows = {e["N"]: e for e in json.loads(path.read_text())["configs"]["sm_90"]["float32"]}
    assert {n: (e["config"]["tile_m"], e["config"]["blocks_per_sm"]) for n, e in rows.items()} == \
        {1600: (1, 4), 1700: (1, 4), 1800: (1, 4), 2400: (1, 3)}  # 2400, outside the band: its best
    assert all(rows[n]["config"]["piece_min"] == cut_pieces(BwdConfig(), n).piece_min < 4096 for n in (1600, 1800))
    assert rows[1600]["vs_copy"] == 0.96 and "dw_share" not in rows[1600]  # timed for the sweep's best only
    assert rows[2400]["dw_share"] == 0.02
    for band in ((1537, 2500), (3000, 4000)):  # 2400 timed at 8 warps only: nothing in common; no width at all
        with pytest.raises(SystemExit, match="no one-row config timed at every width"):
            tune.write_configs(results, "NVIDIA H100 80GB HBM3", "sm_90", [band])


def test_h200_fp32_rows_hold_for_their_widths_only():
    """The H200's own fp32 rows (MODEL_ROWS_ONLY: 4-byte rows of 1024-2559 columns) decide its configs there
    without dh: 1024 / 2048 their own, one config per band between (measured 0.93-1.01 x copy, where the
    H100's rows scaled read 0.63-0.99); outside that span, and with dh, the H100's rows as before, whatever
    the dtype's name says."""
    from cutile_norms._platform import DeviceInfo
    from cutile_norms.cutile import rmsnorm_bwd_config as C

    h100 = DeviceInfo("nvidia", "NVIDIA H100 80GB HBM3", (9, 0), 132, 0)
    h200 = DeviceInfo("nvidia", "NVIDIA H200", (9, 0), 132, 0)
    assert list(C.MODEL_ROWS_ONLY.items()) == [(("sm_90/H200", 4), (1024, 2559))]
    own = C.measured_configs()["sm_90/H200"]["float32"]
    assert own[0][0] == 1024 and own[-1][0] <= 2559
    for dtype in ("float32", ""):
        for N in (128, 512, 1000, 1023, 2560, 2880, 4096, 65536):
            assert C.config_and_source(N, 4, h200, dtype) == C.config_and_source(N, 4, h100, dtype), (dtype, N)
        for N in (1024, 1320, 1604, 2400, 2556):
            assert C.default_config(N, 4, h200, dtype, has_dh=True) == C.default_config(N, 4, h100, dtype, has_dh=True)
            assert "on sm_90/H200 in float32" in C.config_and_source(N, 4, h200, dtype)[1], (dtype, N)
    assert C.default_config(1024, 4, h200, "float32").tile_m == 4 and C.default_config(2048, 4, h200, "float32") \
        == C.BwdConfig(piece_min=2048, blocks_per_sm=4, num_worker_warps=8)
    bands = {(1025, 1536): (4, 4, True), (1537, 2047): (3, 4, True), (2049, 2304): (3, 8, False),
             (2305, 2559): (3, 8, True)}  # blocks per SM, warps, prefetch
    for (lo, hi), shape in bands.items():
        rows = [cfg for n, cfg, _ in own if lo <= n <= hi]
        assert len(rows) >= 5 and {(c.tile_m, c.split, c.blocks_per_sm, c.num_worker_warps, c.prefetch)
                                   for c in rows} == {(1, 1) + shape}, (lo, hi)
        for N in range(lo + 3 - (lo + 3) % 4 + 12, hi - 12, 44):  # between the rows, away from the bands' edges
            for fp32_weight in (False, True):
                c = C.default_config(N, 4, h200, "float32", fp32_weight)
                assert (c.tile_m, c.split, c.blocks_per_sm, c.num_worker_warps, c.prefetch) == (1, 1) + shape, N


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
