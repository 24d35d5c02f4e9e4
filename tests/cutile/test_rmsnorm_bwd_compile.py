"""Compile checks (CPU only, no GPU) of the cuTile backward kernel: every variant the library can
launch is built to a real sm_90 and sm_100 cubin (cuTile front end + tileiras), and the sm_90 builds
are re-assembled with `ptxas -v` to check that a block fits the register file without spilling.
"""
from __future__ import annotations

import dataclasses
import io

import pytest

from cuda.tile.compilation import export_kernel

from cutile_norms._platform import DeviceInfo
from cutile_norms.cutile import rmsnorm_bwd, rmsnorm_bwd_config
from tests.cutile.compile_util import CT_DTYPES, cuobjdump_path, embedded_ptx, ptxas_report, sass_opcodes
from tests.cutile.test_rmsnorm_bwd import CONFIG_CASES, case_config

WIDTHS = [1, 7, 128, 129, 512, 1000, 1024, 2048, 2880, 4095, 4096, 4097, 5120, 7168, 8192, 16384, 32768, 65536,
          65537, 131072, 262144]
DTYPES = [("bfloat16", "bfloat16"), ("float16", "float16"), ("float32", "float32"), ("bfloat16", "float32"),
          ("float16", "float32")]
ARCHS = {"sm_90": DeviceInfo("nvidia", "H100 (simulated)", (9, 0), 132),
         "sm_100": DeviceInfo("nvidia", "B200 (simulated)", (10, 0), 148)}
ELEM = {"bfloat16": 2, "float16": 2, "float32": 4}


def compile_bwd(cfg, N, x_dtype, w_dtype, arch="sm_90", **flags) -> bytes:
    kernel, sig = rmsnorm_bwd.export_signature(cfg, N, CT_DTYPES[x_dtype], CT_DTYPES[w_dtype],
                                               sm_count=ARCHS[arch].sm_count, **flags)
    buf = io.BytesIO()
    export_kernel(kernel, [sig], buf, gpu_code=arch, output_format="cubin")
    return buf.getvalue()


def _config(N, x_dtype, arch, w_dtype=None):
    return rmsnorm_bwd_config.default_config(N, ELEM[x_dtype], ARCHS[arch], x_dtype, w_dtype == "float32")


@pytest.mark.parametrize("arch", list(ARCHS))
@pytest.mark.parametrize("N", WIDTHS)
def test_compiles_bf16(N, arch):
    """The config the library picks, as a training step runs it (dx and dw)."""
    cubin = compile_bwd(_config(N, "bfloat16", arch), N, "bfloat16", "bfloat16", arch)
    assert cubin[:4] == b"\x7fELF" and len(cubin) > 1000


@pytest.mark.parametrize("arch", list(ARCHS))
@pytest.mark.parametrize("x_dtype,w_dtype", DTYPES[1:])
@pytest.mark.parametrize("N", [128, 1000, 4096, 4097, 65536])
def test_compiles_other_dtypes(N, x_dtype, w_dtype, arch):
    cubin = compile_bwd(_config(N, x_dtype, arch, w_dtype), N, x_dtype, w_dtype, arch)
    assert cubin[:4] == b"\x7fELF"


@pytest.mark.parametrize("arch", list(ARCHS))
@pytest.mark.parametrize("has_w,need_dx,need_dw", [(False, True, False), (True, True, False), (True, False, True)])
@pytest.mark.parametrize("N", [128, 2880, 65536])
def test_compiles_weight_none_and_one_grad(N, has_w, need_dx, need_dw, arch):
    cubin = compile_bwd(_config(N, "bfloat16", arch), N, "bfloat16", "bfloat16", arch, has_w=has_w,
                        need_dx=need_dx, need_dw=need_dw)
    assert cubin[:4] == b"\x7fELF"


@pytest.mark.parametrize("arch", list(ARCHS))
@pytest.mark.parametrize("tile_m,split,bps,N,prefetch", CONFIG_CASES)
def test_configs_compile(tile_m, split, bps, N, prefetch, arch):
    """The GPU suite's configs the heuristic may not pick (test_rmsnorm_bwd.CONFIG_CASES)."""
    cfg = case_config(tile_m, split, bps, N, prefetch)
    assert compile_bwd(cfg, N, "bfloat16", "bfloat16", arch)[:4] == b"\x7fELF"


@pytest.mark.parametrize("x_dtype,w_dtype", DTYPES)
@pytest.mark.parametrize("N", [128, 1000, 2880, 4096, 8192, 65536, 262144])
def test_picked_configs_fit_without_spilling(N, x_dtype, w_dtype):
    """sm_90: blocks_per_sm blocks fit the register file, and at most a few registers spill (the held
    weight, dw's accumulator, x * rstd and g for the part: about 4 fp32 values per element). The
    H100 sweep's pick at N = 4096, 3 blocks per SM at 80 registers, spills 8 bytes per thread (24
    with an fp32 weight) and measured fastest; more is a regression."""
    cfg = _config(N, x_dtype, "sm_90", w_dtype)
    report = ptxas_report(compile_bwd(cfg, N, x_dtype, w_dtype))
    assert report["registers"] * report["threads"][0] * cfg.blocks_per_sm <= 65536, report
    assert report["spill_stores"] <= 32, f"N={N} {x_dtype}/{w_dtype} {cfg.short()}: {report}"


@pytest.mark.parametrize("N", [768, 896, 1000, 1280, 1536, 1792,
                               11264, 12288, 14336, 18432, 20480, 22528, 24576, 26624, 28672])
def test_fp32_configs_measured_between_the_powers_of_two_fit_without_spilling(N):
    """fp32 widths measured on their own (768, 896, 1536; 12288, 18432, 20480, 24576, 28672: the
    configs of the powers of two scaled there measured 0.55-0.89 x copy on an H100) and between them,
    as test_picked_configs_fit_without_spilling."""
    cfg = _config(N, "float32", "sm_90", "float32")
    report = ptxas_report(compile_bwd(cfg, N, "float32", "float32"))
    assert report["registers"] * report["threads"][0] * cfg.blocks_per_sm <= 65536, report
    assert report["spill_stores"] <= 32, f"N={N} float32 {cfg.short()}: {report}"


H200 = DeviceInfo("nvidia", "NVIDIA H200", (9, 0), 132)


@pytest.mark.parametrize("N", [1024, 1026, 1028, 1320, 1462, 1536, 1544, 1548, 1796, 1844, 2044, 2051, 2052, 2056, 2308,
                               2312, 2398, 2556, 2559])
def test_h200_fp32_rows_fit_without_spilling(N):
    """The H200's own fp32 rows of 4-10 KiB (rmsnorm_bwd_config.MODEL_ROWS_ONLY) at their bands' edges and
    between their rows, ptxas: at rows of a multiple of 4 columns 104-128 registers at 4 blocks of 4 warps,
    138-167 at 3, 64 / 66-80 at 4 / 3 blocks of 8 warps, no spills; the others (their rows off 16-byte
    alignment) up to 32 bytes (2398: 0.945 x copy on an H200, performance.md 2.58)."""
    cfg = rmsnorm_bwd_config.default_config(N, 4, H200, "float32")
    report = ptxas_report(compile_bwd(cfg, N, "float32", "float32"))
    assert report["registers"] * report["threads"][0] * cfg.blocks_per_sm <= 65536, report
    assert report["spill_stores"] <= (0 if N % 4 == 0 else 32), f"N={N} float32 {cfg.short()}: {report}"


@pytest.mark.parametrize("arch", list(ARCHS))
@pytest.mark.parametrize("N", [128, 1000, 1344, 4096, 6144, 7168, 8200, 10240, 12288, 20480, 65536])
def test_compiles_with_dh(N, arch):
    """The residual add's backward (dh read with the row, added to dx) for every arch, at the configs
    picked for it (rmsnorm_bwd_config._dh_fit)."""
    cfg = rmsnorm_bwd_config.default_config(N, 2, ARCHS[arch], "bfloat16", has_dh=True)
    cubin = compile_bwd(cfg, N, "bfloat16", "bfloat16", arch, has_dh=True)
    assert cubin[:4] == b"\x7fELF"


@pytest.mark.parametrize("dev", ["H100", "H200"])
@pytest.mark.parametrize("x_dtype,w_dtype", [("bfloat16", "bfloat16"), ("float32", "float32")])
@pytest.mark.parametrize("N", [1000, 1344, 1536, 3584, 4096, 6144, 7168, 8192, 10240, 12288, 16384, 20480, 32768])
def test_dh_fits_without_spilling(N, x_dtype, w_dtype, dev):
    """With dh (rmsnorm_bwd_config._dh_fit) the next row's dh waits in registers beside its x and dy:
    the configs picked for it fit their blocks per SM, with at most a few bytes of spills (N = 12288 on
    the H200, 3 blocks per SM at 80 registers: 20 bytes). Without the fit, 3584 / 6144 on the H200
    spilled 100 / 124 bytes and 1344 304."""
    info = H200 if dev == "H200" else ARCHS["sm_90"]
    cfg = rmsnorm_bwd_config.default_config(N, ELEM[x_dtype], info, x_dtype, w_dtype == "float32", has_dh=True)
    report = ptxas_report(compile_bwd(cfg, N, x_dtype, w_dtype, has_dh=True))
    assert report["registers"] * report["threads"][0] * cfg.blocks_per_sm <= 65536, report
    assert report["spill_stores"] <= 32, f"N={N} {x_dtype}/{w_dtype} {cfg.short()} + dh: {report}"


@pytest.mark.parametrize("w_dtype", ["bfloat16", None])
@pytest.mark.parametrize("N", [1032, 1100, 1344, 1600, 1704, 1800, 1816, 1880, 2000, 2048, 2056, 2312, 2560])
def test_narrow_dh_rows_take_four_blocks_where_they_fit(N, w_dtype):
    """rmsnorm_bwd_config.NARROW_DH_ROW: with dh, 16-bit rows of 2-4 KiB (weight of x's dtype or none)
    run 4 blocks per SM where ptxas fits them in 64 registers, else 3; either way without spills (H100's
    table); rows of 2049-2560 3 blocks with their two pieces."""
    cfg = rmsnorm_bwd_config.default_config(N, 2, ARCHS["sm_90"], "bfloat16", False, has_dh=True)
    assert cfg.tile_m == 1 and cfg.prefetch and cfg.blocks_per_sm in (3, 4), cfg
    report = ptxas_report(compile_bwd(cfg, N, "bfloat16", w_dtype or "bfloat16", has_dh=True, has_w=w_dtype is not None))
    assert report["registers"] * report["threads"][0] * cfg.blocks_per_sm <= 65536, report
    assert report["spill_stores"] == 0, f"N={N} w={w_dtype} {cfg.short()} + dh: {report}"
    if cfg.blocks_per_sm == 3 and N <= 2048:  # 4 would have spilled: the rule's reason
        four = dataclasses.replace(cfg, blocks_per_sm=4)
        assert ptxas_report(compile_bwd(four, N, "bfloat16", "bfloat16", has_dh=True))["spill_stores"] > 0


@pytest.mark.parametrize("N", [3112, 3584, 4096, 5320, 6144, 6440, 7168, 8008])
def test_one_dh_piece_fits_without_spilling(N):
    """rmsnorm_bwd_config.ONE_DH_PIECE_LANES: with dh, 16-bit rows of 4-16 KiB in one padded piece where
    its lanes fit the blocks per SM (H100's table); ptxas fits them without spills."""
    cfg = rmsnorm_bwd_config.default_config(N, 2, ARCHS["sm_90"], "bfloat16", False, has_dh=True)
    assert cfg.piece_min >= N and cfg.piece_min * cfg.blocks_per_sm <= rmsnorm_bwd_config.ONE_DH_PIECE_LANES, cfg
    report = ptxas_report(compile_bwd(cfg, N, "bfloat16", "bfloat16", has_dh=True))
    assert report["registers"] * report["threads"][0] * cfg.blocks_per_sm <= 65536, report
    assert report["spill_stores"] == 0, f"N={N} {cfg.short()} + dh: {report}"


@pytest.mark.parametrize("w_dtype", ["bfloat16", None])
@pytest.mark.parametrize("N", [1280, 1536, 1664, 1960, 2056, 2288, 3336, 3640, 5320, 6144, 6584, 7168, 7432])
def test_h200_dh_rows_fit_without_spilling(N, w_dtype):
    """With dh the H200's rows of 2-16 KiB take the dh rules too (rmsnorm_bwd_config._dh_takes_arch_row:
    one-row prefetching tiles, NARROW_DH_ROW's blocks, ONE_DH_PIECE_LANES' padded piece): ptxas fits each
    in its blocks' registers without spills, as on the H100's rows."""
    cfg = rmsnorm_bwd_config.default_config(N, 2, H200, "bfloat16", False, has_dh=True)
    assert cfg.tile_m == 1 and cfg.split == 1 and cfg.prefetch, cfg
    has_w = w_dtype is not None
    report = ptxas_report(compile_bwd(cfg, N, "bfloat16", w_dtype or "bfloat16", has_dh=True, has_w=has_w))
    assert report["registers"] * report["threads"][0] * cfg.blocks_per_sm <= 65536, report
    assert report["spill_stores"] == 0, f"N={N} w={w_dtype} {cfg.short()} + dh: {report}"


@pytest.mark.parametrize("N", [3648, 3672, 3696])
def test_a_4096_piece_runs_2_blocks(N):
    """rmsnorm_bwd_config._past_three_blocks: the H200's 3584 entry (3 blocks) scales to one 4096 piece
    at 3641-3697; at 3 blocks per SM ptxas spills it (68-112 bytes), at the 2 the rule gives none."""
    cfg, why = rmsnorm_bwd_config.config_and_source(N, 2, H200, "bfloat16")
    assert cfg.blocks_per_sm == 2 and cfg.piece_min == 4096 and "14 values" in why, (cfg, why)
    assert ptxas_report(compile_bwd(cfg, N, "bfloat16", "bfloat16"))["spill_stores"] == 0
    three = ptxas_report(compile_bwd(dataclasses.replace(cfg, blocks_per_sm=3), N, "bfloat16", "bfloat16"))
    assert three["spill_stores"] > 16, three


@pytest.mark.parametrize("N,dtype,w_dtype,spills", [
    (3104, "bfloat16", "bfloat16", True), (3080, "float16", "float16", True), (3080, "bfloat16", "float32", True),
    (3360, "bfloat16", "bfloat16", True), (3568, "bfloat16", "bfloat16", True), (3432, "bfloat16", "bfloat16", False),
    (3360, "float16", "float16", False), (3360, "bfloat16", "float32", False), (3328, "bfloat16", "bfloat16", False)])
def test_the_h200s_padded_piece_where_the_pieces_spill(N, dtype, w_dtype, spills):
    """rmsnorm_bwd_config.SPILLING_PIECES rests on what ptxas does with the three pieces at 3 blocks per SM, with
    the weight, dx and dw: 12-24 bytes of spills at 3073-3104 and at bf16's multiples of 16 of 3329-3583 beside
    a bf16 weight, at most 4 at 8 (mod 16), in fp16 there, beside an fp32 weight there, or at 3328, and none
    without dw; the one padded 4096 piece the H200 runs instead spills none at 2."""
    cfg = rmsnorm_bwd_config.default_config(N, 2, H200, dtype, w_dtype == "float32")
    assert (cfg.piece_min == 4096) == spills, cfg
    pieces = dataclasses.replace(cfg, piece_min=1024, blocks_per_sm=3)
    spilled = ptxas_report(compile_bwd(pieces, N, dtype, w_dtype))["spill_stores"]
    assert (spilled >= 12) if spills else (spilled <= 4), (N, dtype, w_dtype, spilled)
    assert ptxas_report(compile_bwd(pieces, N, dtype, w_dtype, need_dw=False))["spill_stores"] == 0
    if spills:
        assert ptxas_report(compile_bwd(cfg, N, dtype, w_dtype))["spill_stores"] == 0


@pytest.mark.parametrize("x_dtype,w_dtype", [("bfloat16", "bfloat16"), ("float16", "float16"), ("bfloat16", "float32")])
@pytest.mark.parametrize("N", [896, 1536, 1816, 3584, 6144, 6264, 10240, 12288, 65536])
def test_h200_configs_fit_without_spilling(N, x_dtype, w_dtype):
    """The H200's own table (tuning/rmsnorm_bwd_configs.json, sm_90/H200) at its widths and between
    them: as test_picked_configs_fit_without_spilling, with the H200's up to 4 blocks per SM. Beside an
    fp32 weight the 6144 entry's prefetch spills 36 bytes, and the cuTile kernel measured 0.895 x copy on an
    H200 against 0.759 without it (rmsnorm_bwd_config.config_and_source): 40 there."""
    cfg = rmsnorm_bwd_config.default_config(N, ELEM[x_dtype], H200, x_dtype, w_dtype == "float32")
    assert "sm_90/H200" in rmsnorm_bwd_config.config_and_source(N, ELEM[x_dtype], H200, x_dtype)[1]
    report = ptxas_report(compile_bwd(cfg, N, x_dtype, w_dtype))
    assert report["registers"] * report["threads"][0] * cfg.blocks_per_sm <= 65536, report
    limit = 40 if w_dtype == "float32" else 32
    assert report["spill_stores"] <= limit, f"N={N} {x_dtype}/{w_dtype} {cfg.short()}: {report}"


def test_dx_stores_have_no_block_barrier_in_the_loop():
    """With dx stored by ct.store at the loop's tile index, the row loop holds the block reduction's
    barriers only: a ct.scatter had a bar.sync before and after each store (sm_90 PTX, N = 4096)."""
    cfg = _config(4096, "bfloat16", "sm_90")
    assert rmsnorm_bwd_config.dx_2d(cfg, 4096)
    ptx = embedded_ptx(compile_bwd(cfg, 4096, "bfloat16", "bfloat16"))
    flat = rmsnorm_bwd_config.BwdConfig(split=2, piece_min=1024, num_worker_warps=8)  # 2880 / 2: pieces 1024 + 512 ...
    assert not rmsnorm_bwd_config.dx_2d(flat, 2880)
    ptx_flat = embedded_ptx(compile_bwd(flat, 2880, "bfloat16", "bfloat16"))
    assert ptx.count("bar.sync") < ptx_flat.count("bar.sync")


def test_atomics_and_waits_are_what_the_protocol_needs():
    """The ticket is an acq_rel atomic add by one thread after a block barrier (release of every
    thread's partial stores); the reducers' wait polls with an acquire atomic, the exchange's with
    relaxed 64-bit atomics: an atomic is performed once and its result shared by the block, so every
    warp leaves a wait in the same iteration. No wait polls with loads, which every warp issues for
    itself (warps then left at different polls and mismatched the block barriers that follow)."""
    cfg = rmsnorm_bwd_config.BwdConfig(split=4, piece_min=4096, num_worker_warps=8)
    ptx = embedded_ptx(compile_bwd(cfg, 16384, "bfloat16", "bfloat16"))
    assert "atom.global.acq_rel.add.u32" in ptx
    assert "atom.global.acquire.add.u32" in ptx
    assert "atom.global.add.u64" in ptx and "atom.global.exch.b64" in ptx
    assert "ld.relaxed" not in ptx and "ld.acquire" not in ptx


@pytest.mark.parametrize("N", [14536, 14600, 16024, 17816, 18432, 19336, 20480])
def test_band_configs_fit_and_dh_spills_past_36_kib(N):
    """backward_table.CUTILE_BWD_BAND (H100's table, 16-bit rows of 28-40 KiB and weight): the row over 4
    blocks at 2 per SM, prefetching, in a 4096 piece and a tail of at most 1024, fits its 128 registers
    without spills; with dh it fits (at most a few bytes) to 18432 columns and spills past them, where
    mode=None's residual backward runs the CuTe DSL kernel instead (CUTILE_BWD_DH_MAX_BYTES)."""
    from cutile_norms.backward_table import CUTILE_BWD_BAND, CUTILE_BWD_DH_MAX_BYTES

    assert CUTILE_BWD_BAND[0] <= 2 * N <= CUTILE_BWD_BAND[1]
    below = _config(CUTILE_BWD_BAND[0] // 2 - 8, "bfloat16", "sm_90")  # the band's edge: a part in pieces below
    assert below.split == 4 and below.piece_min < 4096, below
    cfg = _config(N, "bfloat16", "sm_90")
    assert (cfg.split, cfg.blocks_per_sm, cfg.prefetch, cfg.piece_min) == (4, 2, True, 4096), cfg
    report = ptxas_report(compile_bwd(cfg, N, "bfloat16", "bfloat16"))
    assert report["registers"] * report["threads"][0] * cfg.blocks_per_sm <= 65536, report
    assert report["spill_stores"] == 0, f"N={N} {cfg.short()}: {report}"
    dh_cfg = rmsnorm_bwd_config.default_config(N, 2, ARCHS["sm_90"], "bfloat16", has_dh=True)
    dh = ptxas_report(compile_bwd(dh_cfg, N, "bfloat16", "bfloat16", has_dh=True))
    if 2 * N <= CUTILE_BWD_DH_MAX_BYTES:
        assert dh["spill_stores"] <= 16, f"N={N} {dh_cfg.short()} + dh: {dh}"
    else:
        assert dh_cfg == cfg and dh["spill_stores"] > 16, f"N={N} {dh_cfg.short()} + dh: {dh}"


@pytest.mark.parametrize("N", [2056, 2200, 2432, 3080, 3096, 3112, 3240, 3344, 3456, 3560, 3584])
def test_three_block_configs_fit(N):
    """rmsnorm_bwd_config.THREE_BLOCK_LANES: 16-bit rows of at most 3 pieces and 3584 lanes at 3 blocks
    per SM fit 80 registers with at most 20 bytes of spills (none at 2056-2432); a fourth piece at 3 blocks
    (3592) spills 56, which is why the rule stops there."""
    cfg = _config(N, "bfloat16", "sm_90")
    assert cfg.blocks_per_sm == 3 and cfg.prefetch, cfg
    report = ptxas_report(compile_bwd(cfg, N, "bfloat16", "bfloat16"))
    assert report["registers"] * report["threads"][0] * 3 <= 65536, report
    assert report["spill_stores"] <= (0 if N <= 2560 else 20), f"N={N} {cfg.short()}: {report}"
    if N == 3584:
        four = dataclasses.replace(_config(3592, "bfloat16", "sm_90"), blocks_per_sm=3)
        assert ptxas_report(compile_bwd(four, 3592, "bfloat16", "bfloat16"))["spill_stores"] > 20


@pytest.mark.skipif(cuobjdump_path() is None, reason="needs cuobjdump + nvdisasm (pip: nvidia-cuda-cuobjdump, "
                    "nvidia-cuda-nvdisasm)")
@pytest.mark.parametrize("N", [2048, 4096, 8192, 20480])
def test_an_fp32_weight_shares_the_rows_layout(N):
    """rmsnorm_bwd.row_align: beside an fp32 weight, 16-bit x and dy load 4 columns a vector, so the held
    weight and the rows are tiles of one layout and the loop has no more shared-memory round trips than
    with a bf16 weight (at 8 a vector: 65 shared loads at N = 8192 against 31)."""
    from collections import Counter

    cfg = _config(N, "bfloat16", "sm_90")
    lds = {w: Counter(op.split(".")[0] for op in sass_opcodes(compile_bwd(cfg, N, "bfloat16", w)))["LDS"]
           for w in ("bfloat16", "float32")}
    assert lds["float32"] <= lds["bfloat16"], lds
