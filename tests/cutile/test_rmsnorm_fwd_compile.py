"""Compile checks (CPU only, no GPU): every cuTile forward kernel variant the library can launch is
built to a real sm_90 and sm_100 cubin with cuda.tile.compilation.export_kernel (cuTile front end +
tileiras), and the sm_90 builds are re-assembled with `ptxas -v` to check registers and spills.
"""
from __future__ import annotations

import pytest
import torch

import dataclasses

from cutile_norms import dispatch
from cutile_norms._platform import DeviceInfo
from cutile_norms.cutile import rmsnorm_fwd, rmsnorm_fwd_config

from tests.cutile.compile_util import compile_cubin, cuobjdump_path, embedded_ptx, ptxas_report, sass_opcodes

MODES = dispatch.modes_of("cutile")
WIDTHS = [128, 512, 1000, 1024, 2048, 2880, 4096, 5120, 7168, 8192, 16384, 32768, 65536, 131072, 262144]
DTYPES = [("bfloat16", "bfloat16"), ("float16", "float16"), ("float32", "float32"), ("bfloat16", "float32")]
ARCHS = {"sm_90": DeviceInfo("nvidia", "H100 (simulated)", (9, 0), 132),
         "sm_100": DeviceInfo("nvidia", "B200 (simulated)", (10, 0), 148)}
ELEM = {"bfloat16": 2, "float16": 2, "float32": 4}


def _config(mode, N, x_dtype, arch):
    return rmsnorm_fwd_config.default_config(mode, N, ELEM[x_dtype], ARCHS[arch], x_dtype)


@pytest.mark.parametrize("arch", list(ARCHS))
@pytest.mark.parametrize("x_dtype,w_dtype", DTYPES)
@pytest.mark.parametrize("N", WIDTHS)
@pytest.mark.parametrize("mode", MODES)
def test_compiles(mode, N, x_dtype, w_dtype, arch):
    """The config the library picks for this (mode, N, dtype, arch), as a training forward (weight, rstd)."""
    cubin = compile_cubin(_config(mode, N, x_dtype, arch), N, x_dtype, w_dtype, has_w=True, store_rstd=True,
                          arch=arch)
    assert cubin[:4] == b"\x7fELF" and len(cubin) > 1000


@pytest.mark.parametrize("N", [4097, 131073, 262145])
@pytest.mark.parametrize("mode", MODES)
def test_compiles_wide_widths_past_a_power_of_two(mode, N):
    """2^k + 1: the picked config's last chunk or piece holds one column. static_persistent's reload
    kernel (2048-column chunks) once masked every chunk at these widths and its compile ran for
    minutes (a hang in the GPU fuzz); the tail is now a chunk of its own."""
    cubin = compile_cubin(_config(mode, N, "bfloat16", "sm_90"), N, "bfloat16", "bfloat16", has_w=True,
                          store_rstd=True, arch="sm_90")
    assert cubin[:4] == b"\x7fELF"


@pytest.mark.parametrize("arch", list(ARCHS))
@pytest.mark.parametrize("has_w,store_rstd", [(False, False), (True, False), (False, True)])
@pytest.mark.parametrize("N", [128, 2880, 4096, 65536])
@pytest.mark.parametrize("mode", MODES)
def test_compiles_inference_and_no_weight_variants(mode, N, has_w, store_rstd, arch):
    cubin = compile_cubin(_config(mode, N, "bfloat16", arch), N, "bfloat16", "bfloat16", has_w=has_w,
                          store_rstd=store_rstd, arch=arch)
    assert cubin[:4] == b"\x7fELF"


@pytest.mark.parametrize("N", WIDTHS)
@pytest.mark.parametrize("mode", MODES)
def test_picked_configs_spill_at_most_what_was_measured(mode, N):
    """sm_90, bf16: the picked config's CTA fits the register file; rows up to 16 KiB keep everything
    in registers (no spill stores in ptxas -v). Wider rows: the configs measured fastest spill a
    little (up to 152 B per thread on the 2026-11-21 H200 sweep); more is a regression."""
    report = ptxas_report(compile_cubin(_config(mode, N, "bfloat16", "sm_90"), N, "bfloat16", "bfloat16",
                                        has_w=True, store_rstd=False))
    assert report["registers"] * report["threads"][0] <= 65536, report
    assert report["spill_stores"] <= (0 if N * 2 <= 16384 else 256), f"{mode} N={N}: {report}"


def test_every_measured_config_is_a_valid_config():
    """The tuning table only holds configs of each mode's own family (cached/reload, persistent or not)."""
    table = rmsnorm_fwd_config.measured_configs()
    for arch, modes in table.items():
        for mode, entries in modes.items():
            assert mode in rmsnorm_fwd_config.FAMILIES
            for row_bytes, cfg, ratio, dtype in entries:
                assert rmsnorm_fwd_config.FAMILIES[mode](cfg), f"{arch}/{mode}: {cfg} is not a {mode} config"
                assert row_bytes > 0 and 0 < ratio < 1.5 and dtype in ELEM, (arch, mode, dtype)


# the split kernel (a long row over several blocks), also where the tuning table does not pick it
SPLIT_CONFIGS = [(32768, 2, 1 << 30), (65536, 4, 1 << 30), (40000, 8, 2048), (100003, 8, 2048), (262144, 16, 1 << 30)]


@pytest.mark.parametrize("arch", list(ARCHS))
@pytest.mark.parametrize("x_dtype,w_dtype", DTYPES)
@pytest.mark.parametrize("N,split,piece_min", SPLIT_CONFIGS)
def test_split_kernel_compiles(N, split, piece_min, x_dtype, w_dtype, arch):
    cfg = rmsnorm_fwd_config.FwdConfig("split", split=split, piece_min=piece_min, num_worker_warps=8)
    assert compile_cubin(cfg, N, x_dtype, w_dtype, arch=arch)[:4] == b"\x7fELF"


@pytest.mark.parametrize("has_w,store_rstd", [(False, False), (True, False), (False, True)])
def test_split_kernel_inference_and_no_weight_variants(has_w, store_rstd):
    cfg = rmsnorm_fwd_config.FwdConfig("split", split=8, piece_min=2048, num_worker_warps=8)
    assert compile_cubin(cfg, 40000, "bfloat16", "bfloat16", has_w=has_w, store_rstd=store_rstd)[:4] == b"\x7fELF"


def test_split_kernel_polls_inside_its_wait_loop():
    """The wait loop must re-read the partial sums from L2 every iteration. A ct.load there whose
    index does not change is hoisted out of the loop by cuTile (loads have no observable effect):
    an endless spin. The kernel makes the index depend on the loop's own variable; the sm_90 PTX
    must show the relaxed gpu-scope load after the exchange that publishes the block's partial sum,
    followed by a backward branch."""
    import re

    from tests.cutile.compile_util import embedded_ptx

    cfg = rmsnorm_fwd_config.FwdConfig("split", split=4, num_worker_warps=8)
    ptx = embedded_ptx(compile_cubin(cfg, 65536, "bfloat16", "bfloat16"))
    assert "atom.global.add" not in ptx  # blocks own (row, part) by their index: no ticket
    # the block's own slot (whose sign bit says which sign this launch publishes) is read before x,
    # not after the reduction, where the compiler sank it at first (an extra round trip per block)
    first = ptx.index("ld.global")
    assert ptx[first:].startswith("ld.global.b32") and ptx.index("ld.global.v4") > first
    after = ptx.split("atom.global.exch.b32", 1)[1]  # the partial sum, published
    load = after.index("ld.relaxed.gpu.global")
    loop_labels = re.findall(r"^(\$L__BB\d+_\d+):", after[:load], re.M)
    assert loop_labels, "no loop header before the poll"
    assert f"bra \t{loop_labels[-1]};" in after[load:] or f"bra {loop_labels[-1]};" in after[load:], \
        "the poll is not inside a loop"


# tie_slot: the split kernel's workspace slot loaded with x's first piece:
# (x dtype, N, split, other fields), the shapes of the sm_90 table's entries that take it
TIE_SLOT_CONFIGS = [("float32", 32768, 8, dict(w_early=True, occupancy=5)),
                    ("bfloat16", 32768, 4, dict(w_early=True, occupancy=6)),
                    ("bfloat16", 131072, 8, dict(packed=True, num_worker_warps=8)),
                    ("float16", 131072, 16, dict(packed=True, occupancy=4))]


def _tie_slot(x_dtype, N, split, fields, tie_slot=True):
    return rmsnorm_fwd_config.FwdConfig("split", split=split, piece_min=rmsnorm_fwd_config.cached_piece_min(
        rmsnorm_fwd_config.split_part(N, split)), tie_slot=tie_slot, **fields)


@pytest.mark.parametrize("arch", list(ARCHS))
@pytest.mark.parametrize("x_dtype,N,split,fields", TIE_SLOT_CONFIGS)
def test_tie_slot_compiles(x_dtype, N, split, fields, arch):
    for has_w in (True, False):
        cfg = _tie_slot(x_dtype, N, split, fields)
        assert compile_cubin(cfg, N, x_dtype, x_dtype, has_w=has_w, arch=arch)[:4] == b"\x7fELF"


@pytest.mark.skipif(cuobjdump_path() is None, reason="needs cuobjdump + nvdisasm (pip: nvidia-cuda-cuobjdump, "
                                                     "nvidia-cuda-nvdisasm; the test extra installs them)")
@pytest.mark.parametrize("x_dtype,N,split,fields", TIE_SLOT_CONFIGS)
def test_tie_slot_loads_the_slot_before_any_float_math(x_dtype, N, split, fields):
    """The block's slot in the workspace (whose sign the exchange needs; cold in DRAM after an L2
    flush) is the kernel's first load in the PTX, but ptxas issues it after x's sum of squares
    (SASS): a DRAM round trip between the reduction and the exchange. With tie_slot its bits feed
    the first piece's sum of squares and ptxas issues it before any float math."""
    def slot_before_math(cfg):
        ops = sass_opcodes(compile_cubin(cfg, N, x_dtype, x_dtype, store_rstd=False))
        first = next(i for i, op in enumerate(ops) if op.split(".")[0] in ("FADD", "FMUL", "FFMA", "HADD2")
                     and ".RZ" not in op and i > 0)
        slot = next(i for i, op in enumerate(ops) if op.startswith("LDG") and ".128" not in op)
        return slot < first

    assert slot_before_math(_tie_slot(x_dtype, N, split, fields))
    assert not slot_before_math(_tie_slot(x_dtype, N, split, fields, tie_slot=False))


@pytest.mark.skipif(cuobjdump_path() is None, reason="needs cuobjdump + nvdisasm (pip: nvidia-cuda-cuobjdump, "
                                                     "nvidia-cuda-nvdisasm; the test extra installs them)")
def test_tie_slot_defers_none_of_the_row_loads():
    """The tie goes through the first piece's squares (+0.0 made of the slot's bits), a temporary:
    at bf16 N = 32768 (the sm_90 table's split config) every load of the block's x and weight, and
    the slot's, is issued before any float math, with the registers of the untied kernel. The first
    tie (the slot's bits ORed into x's words) kept x and its tied copy both live: 4 of the 16 loads
    went out after the first math there, -3.5 %."""
    cfg = _tie_slot("bfloat16", 32768, 4, dict(w_early=True, occupancy=6))
    before, loads = _loads_before_float_math(cfg, 32768, "bfloat16", "bfloat16")
    # 16 of x and the weight, the slot's; the wait loop's poll (after the reduction) is the 18th
    assert (before, loads) == (17, 18), f"{before} of {loads} loads before the first float math"
    tied = ptxas_report(compile_cubin(cfg, 32768, "bfloat16", "bfloat16", store_rstd=False))["registers"]
    plain = ptxas_report(compile_cubin(_tie_slot("bfloat16", 32768, 4, dict(w_early=True, occupancy=6), tie_slot=False),
                                       32768, "bfloat16", "bfloat16", store_rstd=False))["registers"]
    assert tied <= plain, f"the tie costs registers: {plain} -> {tied}"


# the stream kernel (static_persistent), also where the tuning table does not pick it: (N, tile_m)
STREAM_CONFIGS = [(128, 32), (512, 16), (1000, 4), (2880, 1), (8192, 1)]


# w_early: the weight never delays x's loads: (kernel, N, split). One-row cached tiles and split rows
# (the weight's loads tied to the sum of squares), multi-row tiles (x tied to the weight element by
# element), a persistent grid holding the weight's bits (their conversion tied to each tile's x)
W_EARLY_CONFIGS = [("cached", 16384, 1), ("cached", 5000, 1), ("split", 65536, 8), ("split", 40000, 8),
                   ("rows", 1000, 1), ("rows_hoisted", 1024, 1), ("row_hoisted", 2880, 1)]


def _w_early(kernel, N, split, x_dtype, w_early=True):
    part = rmsnorm_fwd_config.split_part(N, split)
    C, pm = rmsnorm_fwd_config.FwdConfig, rmsnorm_fwd_config.cached_piece_min
    if kernel == "split":
        return C("split", split=split, piece_min=pm(part), packed=x_dtype != "float32", occupancy=6, w_early=w_early)
    if kernel == "rows":
        return C("cached", tile_m=4, piece_min=pm(N), w_early=w_early)
    if kernel in ("rows_hoisted", "row_hoisted"):  # as the table's static_persistent picks at small M
        return C("cached", tile_m=4 if kernel == "rows_hoisted" else 1, piece_min=pm(N), persistent=True,
                 blocks_per_sm=8, hoist_w=True, w_early=w_early)
    return C("cached", piece_min=pm(N), packed=x_dtype != "float32", num_worker_warps=8, occupancy=3, w_early=w_early)


@pytest.mark.parametrize("arch", list(ARCHS))
@pytest.mark.parametrize("x_dtype,w_dtype", DTYPES + [("float32", "bfloat16"), ("float16", "float32")])
@pytest.mark.parametrize("kernel,N,split", W_EARLY_CONFIGS)
def test_w_early_compiles(kernel, N, split, x_dtype, w_dtype, arch):
    for has_w in (True, False):
        cfg = _w_early(kernel, N, split, x_dtype)
        assert compile_cubin(cfg, N, x_dtype, w_dtype, has_w=has_w, arch=arch)[:4] == b"\x7fELF"


@pytest.mark.parametrize("x_dtype,w_dtype", [("bfloat16", "bfloat16"), ("float16", "float32"), ("float32", "float32")])
@pytest.mark.parametrize("kernel,N,split", W_EARLY_CONFIGS[:4:2])
def test_w_early_issues_the_weight_loads_with_x(kernel, N, split, x_dtype, w_dtype):
    """Without w_early tileiras sinks the weight's loads to their use: after the block's reduction
    (cached) or after the wait for the row's partial sums (split), where ptxas then interleaves them
    with the stores (SASS at N=16384, 3 CTAs/SM: about four L2 round trips at the end of every block).
    With it, every 16-byte load is issued before the first barrier of the reduction, and the block
    loads twice as many 16-byte vectors there (x's and the weight's, same element width: planes for
    an fp32 weight with 16-bit x). In bf16 the weight fits these occupancy hints without spilling
    (fp32 rows and the planes hold twice the registers and do spill at these hints: the sweep
    weighs that against the latency)."""
    def loads_before_reduction(cfg):
        ptx = embedded_ptx(compile_cubin(cfg, N, x_dtype, w_dtype, store_rstd=False))
        head, tail = ptx.split("bar.sync", 1)
        return head.count("ld.global.v4"), tail.count("ld.global.v4")

    early, late = loads_before_reduction(_w_early(kernel, N, split, x_dtype))
    plain, plain_late = loads_before_reduction(_w_early(kernel, N, split, x_dtype, w_early=False))
    assert late == 0 and plain_late > 0, (early, late, plain, plain_late)
    planes = 2 if (x_dtype, w_dtype) == ("float16", "float32") else 1
    assert early == plain * (1 + planes), (early, plain)
    if x_dtype == w_dtype == "bfloat16":
        assert ptxas_report(compile_cubin(_w_early(kernel, N, split, x_dtype), N, x_dtype, w_dtype))["spill_stores"] == 0


def _loads_before_float_math(cfg, N, x_dtype, w_dtype, has_w=True):
    """(global loads before the first float instruction, global loads in all) in the sm_90 SASS.
    FMUL.RZ and the like are the integer divisions of the grid's index math, not data."""
    ops = sass_opcodes(compile_cubin(cfg, N, x_dtype, w_dtype, has_w=has_w, store_rstd=False))
    first = next(i for i, op in enumerate(ops) if op.split(".")[0] in ("FADD", "FMUL", "FFMA") and ".RZ" not in op)
    loads = [i for i, op in enumerate(ops) if op.startswith("LDG")]
    return sum(i < first for i in loads), len(loads)


@pytest.mark.skipif(cuobjdump_path() is None, reason="needs cuobjdump + nvdisasm (pip: nvidia-cuda-cuobjdump, "
                                                     "nvidia-cuda-nvdisasm; the test extra installs them)")
@pytest.mark.parametrize("x_dtype,w_dtype", [("bfloat16", "bfloat16"), ("float16", "float32"), ("float32", "float32")])
@pytest.mark.parametrize("kernel,N", [("cached", 4096), ("rows", 1024), ("rows_hoisted", 1024), ("row_hoisted", 2048)])
def test_w_early_first_tile_loads_before_any_float_math(kernel, N, x_dtype, w_dtype):
    """What a launch with fewer blocks than SMs (small M) waits for: ptxas's schedule (SASS; the PTX
    order is tileiras's and says little here). Without w_early the first float instruction on loaded
    data comes before some of the first tile's loads: the weight's, after x's sum of squares (one-row
    and multi-row tiles; the table's config at N = 4096 bf16 among them), or x's, after the
    conversion of a weight held across a persistent loop. Either is a second DRAM round trip in
    series with the first, which nothing hides in a small launch. With it,
    every load of the first tile (x's and the weight's) is issued before any float math."""
    cfg = _w_early(kernel, N, 1, x_dtype)
    if kernel == "cached":  # the N = 4096 16-bit shape of the sm_90 table: 4 warps, 2 CTAs per SM
        cfg = dataclasses.replace(cfg, num_worker_warps=None, occupancy=2)
    early, loads = _loads_before_float_math(cfg, N, x_dtype, w_dtype)
    plain, _ = _loads_before_float_math(dataclasses.replace(cfg, w_early=False), N, x_dtype, w_dtype)
    if cfg.persistent:  # the loop's x loads come twice (rotated): the first tile's are those issued
        # before any float math without a weight, and the weight's (loaded once) are the difference
        x_first, x_all = _loads_before_float_math(cfg, N, x_dtype, w_dtype, has_w=False)
        loads = x_first + loads - x_all
    if x_dtype != w_dtype and not rmsnorm_fwd.weight_planes_offset(getattr(torch, x_dtype), getattr(torch, w_dtype), N) \
            and (cfg.tile_m > 1 or cfg.persistent):  # declined: the tie would convert layouts per tile
        assert early == plain, (early, plain)
    else:
        assert early >= loads > plain, (early, loads, plain)


def _stream(N, tile_m, x_dtype, hoist_w=True):
    return rmsnorm_fwd_config.FwdConfig("stream", tile_m=tile_m, piece_min=rmsnorm_fwd_config.cached_piece_min(N),
                                 packed=tile_m == 1 and x_dtype != "float32", persistent=True, blocks_per_sm=2,
                                 hoist_w=hoist_w, num_worker_warps=8 if N >= 4096 else None)


@pytest.mark.parametrize("arch", list(ARCHS))
@pytest.mark.parametrize("x_dtype,w_dtype", DTYPES)
@pytest.mark.parametrize("N,tile_m", STREAM_CONFIGS)
def test_stream_kernel_compiles(N, tile_m, x_dtype, w_dtype, arch):
    for hoist_w in (True, False):
        assert compile_cubin(_stream(N, tile_m, x_dtype, hoist_w), N, x_dtype, w_dtype, arch=arch)[:4] == b"\x7fELF"


@pytest.mark.parametrize("x_dtype", ["bfloat16", "float32"])
def test_stream_kernel_stores_are_vectorised_and_not_fenced(x_dtype):
    """ct.store at the loop's own index: 16-byte stores of y and no block barrier per store (a
    ct.scatter in the loop had one after each store). Barriers left: the block reductions, a few per
    copy of the tile body (the loop's, the last tile's), however many stores a thread makes."""
    N = 16384
    ptx = embedded_ptx(compile_cubin(_stream(N, 1, x_dtype), N, x_dtype, x_dtype, store_rstd=False))
    per_tile = N // {"bfloat16": 8, "float32": 4}[x_dtype] // 256  # 16-byte stores per thread (8 warps)
    stores, bodies = ptx.count("st.global.v4"), ptx.count("st.global.v4") // per_tile
    assert stores % per_tile == 0 and bodies >= 2 and ptx.count("st.global") == stores, ptx.count("st.global")
    assert ptx.count("bar.sync") <= 3 * bodies < stores, (ptx.count("bar.sync"), stores)


@pytest.mark.parametrize("x_dtype,w_dtype", DTYPES + [("float16", "float32"), ("float32", "bfloat16")])
@pytest.mark.parametrize("N", [3, 17, 1025, 4097, 65537])
def test_widths_just_above_a_power_of_two_compile(N, x_dtype, w_dtype):
    """A one-column last piece: the w_early tie (32-bit words of x and w) goes element by element
    there; it raised "Cannot unpack tile Tile[uint8,(2)] to uint32" for 16-bit x at 4097."""
    for mode in MODES:
        cfg = _config(mode, N, x_dtype, "sm_90")
        assert compile_cubin(cfg, N, x_dtype, w_dtype)[:4] == b"\x7fELF", (mode, cfg.short())
    for cfg in (rmsnorm_fwd_config.FwdConfig("cached", piece_min=rmsnorm_fwd_config.cached_piece_min(N), packed=True, w_early=True),
                rmsnorm_fwd_config.FwdConfig("split", split=4, piece_min=rmsnorm_fwd_config.cached_piece_min(rmsnorm_fwd_config.split_part(N, 4)),
                                      packed=True, w_early=True, tie_slot=True)):
        assert compile_cubin(cfg, N, x_dtype, w_dtype)[:4] == b"\x7fELF", cfg.short()


@pytest.mark.parametrize("N", [36384, 40960, 45000, 14336, 98368])
def test_widths_between_entries_fit_the_register_file(N):
    """multi_wave_cached between the table's widths: the nearest entry's config, split further where a
    split row's parts come out wider than measured (fit_to_width). The 65536-byte entry's 4 parts
    with 6 blocks per SM at bf16 N = 36384-45000 spilled 80-416 bytes per thread."""
    cfg = _config("multi_wave_cached", N, "bfloat16", "sm_90")
    report = ptxas_report(compile_cubin(cfg, N, "bfloat16", "bfloat16", has_w=True, store_rstd=False))
    assert report["spill_stores"] == 0, f"N={N} {cfg.short()}: {report}"


def test_fit_to_width_splits_wider_fp32_rows_and_keeps_the_others():
    from cutile_norms.cutile.rmsnorm_fwd_config import FwdConfig, fit_to_width, split_part

    cfg = FwdConfig("split", split=4, piece_min=4096, occupancy=6, w_early=True, tie_slot=True)
    assert fit_to_width(cfg, 16384, 16384, 4) == cfg
    assert fit_to_width(cfg, 16384, 15000, 4) == cfg  # narrower parts: as measured
    wide = fit_to_width(cfg, 16384, 18192, 4)
    assert wide == FwdConfig("split", split=8, piece_min=2048, occupancy=10, w_early=True, tie_slot=True)
    assert split_part(18192, 8) <= split_part(16384, 4)
    assert wide.occupancy * split_part(18192, 8) <= cfg.occupancy * split_part(16384, 4)
    no_hint = FwdConfig("split", split=8, piece_min=8192, num_worker_warps=8, tie_slot=True)
    assert fit_to_width(no_hint, 65536, 60000, 4) == no_hint
    assert fit_to_width(no_hint, 65536, 75000, 4) == no_hint  # no hint caps its registers


@pytest.mark.parametrize("N", [9000, 20000, 33416, 36384, 65528, 83352, 131080, 149992, 262136, 524296, 1000000])
def test_16_bit_split_rows_between_measured_widths_take_the_rule(N):
    """Between measured widths a 16-bit split row is cut into the fewest power-of-two parts of at most
    8192 columns (up to 64 parts), each part one padded power-of-two piece, packed from 8 parts on;
    the measured entries keep their configs at their own widths."""
    from cutile_norms.cutile.rmsnorm_fwd_config import (FwdConfig, SPLIT_PART_COLS_16, fit_to_width, row_pieces,
                                                        split_between, split_part)

    measured = FwdConfig("split", split=8, piece_min=8192, occupancy=6, tie_slot=True)
    assert fit_to_width(measured, 65536, 65536, 2) == measured
    cfg = fit_to_width(measured, 65536, N, 2)
    assert cfg == split_between(N) and cfg.kernel == "split"
    assert cfg.packed == (cfg.split > 4) and cfg.w_early == (cfg.split <= 4)
    part = split_part(N, cfg.split)
    assert (cfg.split - 1) * part < N <= cfg.split * part  # every block holds columns
    assert part <= SPLIT_PART_COLS_16 or cfg.split == 64
    assert cfg.split == 2 or split_part(N, cfg.split // 2) > SPLIT_PART_COLS_16  # the fewest parts
    assert len(row_pieces(part, cfg.piece_min)) == 1 and cfg.piece_min >= part
    assert cfg.occupancy * cfg.piece_min <= 8 * SPLIT_PART_COLS_16


@pytest.mark.parametrize("N,w_dtype", [(12000, "bfloat16"), (20000, "bfloat16"), (31080, "bfloat16"),
                                       (33416, "bfloat16"), (83352, "bfloat16"), (149992, "bfloat16"),
                                       (1000000, "bfloat16"), (40960, "float32"), (83352, "float32")])
def test_16_bit_split_rule_fits_the_register_file(N, w_dtype):
    """The rule's configs reach their occupancy hint (registers x threads x blocks within 64 K) without
    spilling; from 8 parts on with an fp32 weight too (48-56 registers, where the pieces cut further
    under a raised hint spilled 40-136 bytes per thread at these widths)."""
    from cutile_norms.cutile.rmsnorm_fwd_config import split_between

    cfg = split_between(N)
    report = ptxas_report(compile_cubin(cfg, N, "bfloat16", w_dtype, has_w=True, store_rstd=True))
    assert report["spill_stores"] == 0, f"N={N} {cfg.short()}: {report}"
    assert report["registers"] * report["threads"][0] * cfg.occupancy <= 65536, (cfg.short(), report)