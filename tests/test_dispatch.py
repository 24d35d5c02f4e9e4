"""Dispatch decisions on simulated devices (no GPU needed)."""
import pytest
import torch

from cutile_norms import dispatch
from cutile_norms._platform import CPU, DeviceInfo, Toolchain, table_arch

H100 = DeviceInfo("nvidia", "NVIDIA H100 80GB HBM3", (9, 0), 132, 0)
B200 = DeviceInfo("nvidia", "NVIDIA B200", (10, 0), 148, 0)
A100 = DeviceInfo("nvidia", "NVIDIA A100-SXM4-80GB", (8, 0), 108, 0)
MI300 = DeviceInfo("amd", "AMD Instinct MI300X", (9, 4), 304, 0)
ALL_TOOLS = Toolchain(cutile=None, cute=None, triton=None)
NO_CUTILE = Toolchain(cutile="`import cuda.tile` failed: ModuleNotFoundError", cute=None, triton=None)

CUTILE_MODES = dispatch.modes_of("cutile")


def reasons(dev, tools):
    return {name: dispatch.unavailable_reason(m, dev, tools) for name, m in dispatch.MODES.items()}


def test_hopper_runs_every_built_mode():
    r = reasons(H100, ALL_TOOLS)
    assert all(r[m] is None for m in CUTILE_MODES + ["tma_smem_cached", "triton", "torch"])


def test_ampere_is_refused_by_arch():
    r = reasons(A100, ALL_TOOLS)
    for m in CUTILE_MODES:
        assert "compute capability >= sm_90" in r[m] and "sm_80" in r[m]


def test_amd_is_refused_by_vendor():
    r = reasons(MI300, ALL_TOOLS)
    for m in CUTILE_MODES:
        assert "nvidia" in r[m] and "amd" in r[m]
    assert r["torch"] is None and r["triton"] is None


@pytest.mark.parametrize("dev,tools,why", [
    (MI300, ALL_TOOLS, "AMD GPU"),  # ROCm: cuTile and CuTe DSL are NVIDIA-only
    (A100, ALL_TOOLS, "no measurements for sm_80"),  # older than every measured arch
    (H100, NO_CUTILE, "cannot run here"),  # the table's row needs cuTile, which does not import
])
def test_mode_none_falls_back_to_triton(dev, tools, why):
    from cutile_norms import rmsnorm

    rmsnorm._route.cache_clear()
    c = dispatch.resolve(None, dev, tools, torch.bfloat16, 4096, 4096)
    assert c.mode == "triton" and why in c.reason and "Triton kernels run" in c.reason, c.reason
    no_triton = Toolchain(cutile=tools.cutile, cute=None, triton="`import triton` failed: ModuleNotFoundError")
    c = dispatch.resolve(None, dev, no_triton, torch.bfloat16, 4096, 4096)
    assert c.mode == "torch" and "needs triton" in c.reason, c.reason


def test_triton_on_cpu_tensors_only_under_the_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert "CPU tensors" in dispatch.unavailable_reason(dispatch.MODES["triton"], CPU, ALL_TOOLS)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert dispatch.unavailable_reason(dispatch.MODES["triton"], CPU, ALL_TOOLS) is None


def test_missing_dsl_is_the_reason():
    r = reasons(H100, NO_CUTILE)
    for m in CUTILE_MODES:
        assert "needs cutile" in r[m] and "ModuleNotFoundError" in r[m]


def test_cpu_tensors_with_a_gpu_mode_is_a_value_error():
    with pytest.raises(ValueError, match="CPU tensors"):
        dispatch.resolve("multi_wave_cached", CPU, ALL_TOOLS, torch.bfloat16, 4, 128)


def test_missing_arch_is_a_runtime_error():
    with pytest.raises(RuntimeError, match="compute capability"):
        dispatch.resolve("static_persistent", A100, ALL_TOOLS, torch.bfloat16, 4, 128)


def test_mode_none_on_cpu():
    assert dispatch.resolve(None, CPU, ALL_TOOLS, torch.float32, 4, 128).mode == "torch"


def test_unmeasured_arch_borrows_the_nearest_table_and_warns_once(monkeypatch):
    """A Blackwell GPU (no rows of its own) runs the sm_90 rows, not the reference; one warning per
    arch names the command that measures it; the reason says which table stood in."""
    monkeypatch.setattr(dispatch, "_warned_arches", set())
    with pytest.warns(dispatch.UnmeasuredDeviceWarning, match="bench/rmsnorm.py --write-table"):
        choice = dispatch.resolve(None, B200, ALL_TOOLS, torch.bfloat16, 4096, 4096)
    assert choice.mode in CUTILE_MODES + ["tma_smem_cached"]
    assert "measured table sm_90/bfloat16" in choice.reason and "NVIDIA B200 not measured" in choice.reason
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        dispatch.resolve(None, B200, ALL_TOOLS, torch.bfloat16, 64, 1024)  # no second warning
        # an arch older than every measured one borrows nothing: the reference, with the reason
        choice = dispatch.resolve(None, A100, ALL_TOOLS, torch.bfloat16, 4096, 4096)
    assert choice.mode == "triton" and "no measurements for sm_80" in choice.reason


@pytest.mark.parametrize("arch,measured,expected", [
    ((10, 0), ["sm_90"], "sm_90"), ((9, 0), ["sm_90", "sm_100"], "sm_90"), ((12, 0), ["sm_90", "sm_100"], "sm_100"),
    ((10, 3), ["sm_90", "sm_100", "sm_120"], "sm_100"), ((8, 9), ["sm_90"], None), ((10, 0), [], None)])
def test_table_arch_is_the_nearest_measured(arch, measured, expected):
    dev = DeviceInfo("nvidia", "GPU", arch, 100, 0)
    assert table_arch(dev, {a: {} for a in measured}) == expected


FAKE_TABLE = {
    "source": {"sm_90": {"gpu": "NVIDIA H100",
                         "commands": {"bfloat16": {"command": "python bench/rmsnorm.py --write-table"}}}},
    "tables": {"sm_90": {"bfloat16": [
        {"n_min": 1, "n_max": 1024, "m_min": 1, "m_max": 2 ** 31, "mode": "static_persistent", "evidence": "0.99x"},
        {"n_min": 1025, "n_max": 8192, "m_min": 1, "m_max": 2 ** 31, "mode": "multi_wave_cached", "evidence": "1.0x"},
        {"n_min": 8193, "n_max": 2 ** 20, "m_min": 1, "m_max": 2 ** 31, "mode": "experimental_one", "evidence": "?"},
    ]}},
}


@pytest.fixture
def fake_table(monkeypatch):
    from cutile_norms import rmsnorm

    rmsnorm._route.cache_clear()  # decisions are cached per process; this test swaps the table
    monkeypatch.setattr(dispatch, "measured_table", lambda: FAKE_TABLE)
    fake = dispatch.Mode("experimental_one", "cutile", "x:y", dispatch.EXPERIMENTAL, ("nvidia",), (9, 0), "test")
    monkeypatch.setitem(dispatch.MODES, "experimental_one", fake)
    monkeypatch.setenv("CUTILE_NORMS_EXPERIMENTAL", "1")  # even opted in, mode=None never picks it
    yield
    rmsnorm._route.cache_clear()


def test_mode_none_follows_the_measured_table(fake_table):
    c = dispatch.resolve(None, H100, ALL_TOOLS, torch.bfloat16, 1 << 20, 128)
    assert c.mode == "static_persistent" and "N in [1, 1024]" in c.reason and "bench/rmsnorm.py" in c.reason
    assert dispatch.resolve(None, H100, ALL_TOOLS, torch.bfloat16, 4096, 4096).mode == "multi_wave_cached"


def test_mode_none_runs_the_cutile_backward_behind_a_triton_forward(fake_table, monkeypatch):
    rows = FAKE_TABLE["tables"]["sm_90"]["bfloat16"] + [
        {"n_min": 2 ** 20 + 1, "n_max": 2 ** 21, "m_min": 1, "m_max": 2 ** 31, "mode": "triton", "evidence": "1.0x"}]
    monkeypatch.setitem(FAKE_TABLE["tables"]["sm_90"], "bfloat16", rows)
    c = dispatch.resolve(None, H100, ALL_TOOLS, torch.bfloat16, 4, 2 ** 21)
    assert (c.mode, c.backward_mode) == ("triton", "multi_wave_cached") and "cuTile persistent" in c.reason
    c = dispatch.resolve(None, H100, NO_CUTILE, torch.bfloat16, 4, 2 ** 21)  # no cuTile: Triton's own backward
    assert (c.mode, c.backward_mode) == ("triton", "triton")
    c = dispatch.resolve("triton", H100, ALL_TOOLS, torch.bfloat16, 4, 2 ** 21)  # asked for: its own backward
    assert (c.mode, c.backward_mode) == ("triton", "triton")
    c = dispatch.resolve(None, H100, ALL_TOOLS, torch.bfloat16, 4, 4096)
    assert (c.mode, c.backward_mode) == ("multi_wave_cached", "multi_wave_cached")


def test_mode_none_takes_the_backward_table_row():
    """BACKWARD_TABLE (with the shipped forward table): at 7168 (16-bit) Triton's backward measured ahead
    of the cuTile kernel, from 32768 (16-bit) the CuTe DSL one; at other widths, in fp32 and without
    Triton, the cuTile kernel runs."""
    for dtype in (torch.bfloat16, torch.float16):
        c = dispatch.resolve(None, H100, ALL_TOOLS, dtype, 4096, 7168)
        assert c.backward_mode == "triton" and "0.952" in c.reason, c
    for dtype, N in ((torch.bfloat16, 4096), (torch.bfloat16, 8192), (torch.float32, 7168)):
        c = dispatch.resolve(None, H100, ALL_TOOLS, dtype, 4096, N)
        assert c.backward_mode == "multi_wave_cached" or c.backward_mode == c.mode != "triton", (dtype, N, c)
    no_triton = Toolchain(cutile=None, cute=None, triton="`import triton` failed: ModuleNotFoundError")
    c = dispatch.resolve(None, H100, no_triton, torch.bfloat16, 4096, 7168)
    assert c.backward_mode == "multi_wave_cached", c
    # 16-bit rows from 24 KiB: that backward (its backend takes misaligned rows to the cuTile kernel),
    # whatever the forward, rows its slices tile exactly and rows whose last slice is part empty
    for dtype, N in ((torch.bfloat16, 12288), (torch.bfloat16, 14336), (torch.bfloat16, 14528), (torch.bfloat16, 20488),
                     (torch.bfloat16, 32768), (torch.bfloat16, 24576), (torch.bfloat16, 65536),
                     (torch.float16, 262144), (torch.bfloat16, 98304), (torch.bfloat16, 36568),
                     (torch.float16, 193488)):
        c = dispatch.resolve(None, H100, ALL_TOOLS, dtype, 512, N)
        assert c.backward_mode == c.dh_backward_mode == "tma_smem_cached", (dtype, N, c)
    # ... except 14529-20480 columns (backward_table.CUTILE_BWD_BAND): the cuTile kernel at rows of an odd
    # vector count (the CuTe one at even counts: its EVEN_SLICES or exact tiling), beside an fp32 weight also
    # at even rows past 20464 columns (CUTE_BWD_FP32_WEIGHT_MAX_BYTES); with dh (the residual add) the cuTile
    # one only to 36 KiB, and beside an fp32 weight not at all
    for dtype, N in ((torch.bfloat16, 14536), (torch.bfloat16, 16384), (torch.float16, 18112),
                     (torch.bfloat16, 18432), (torch.bfloat16, 19336), (torch.float16, 20480),
                     (torch.float16, 16440), (torch.bfloat16, 18440), (torch.bfloat16, 14592),
                     (torch.bfloat16, 17792), (torch.float16, 17808), (torch.bfloat16, 17800),
                     (torch.bfloat16, 20464), (torch.float16, 20352)):
        c = dispatch.resolve(None, H100, ALL_TOOLS, dtype, 512, N)
        if N % 16:
            assert c.backward_mode == "multi_wave_cached" and "CUTILE_BWD_BAND" in c.reason, (dtype, N, c)
        else:
            assert c.backward_mode == "tma_smem_cached", (dtype, N, c)
        assert c.dh_backward_mode == ("multi_wave_cached" if N <= 18432 else "tma_smem_cached"), (dtype, N, c)
        c = dispatch.resolve(None, H100, ALL_TOOLS, dtype, 512, N, fp32_weight=True)
        if N % 16 or N > 20464:
            assert c.backward_mode == "multi_wave_cached" and "fp32 weight" in c.reason, (dtype, N, c)
        else:
            # (the row named even where the forward is the same mode: explain() shows the backward's row)
            assert c.backward_mode == "tma_smem_cached" and "backward: tma_smem_cached's" in c.reason \
                and "fp32 weight" in c.reason, (dtype, N, c)
        assert c.dh_backward_mode == "tma_smem_cached", (dtype, N, c)
        how, mode, _ = dispatch.residual_backward(None, dispatch.resolve(None, H100, ALL_TOOLS, dtype, 512, N),
                                                  N, 2, H100, ALL_TOOLS)
        assert (how, mode) == (dispatch.BWD_DH_INSIDE, "multi_wave_cached" if N <= 18432 else "tma_smem_cached")
    # narrower rows, fp32, too long: the cuTile kernel, also behind mode="tma_smem_cached"
    for dtype, N in ((torch.bfloat16, 8192), (torch.float32, 262144), (torch.bfloat16, 1 << 20)):
        for mode in (None, "tma_smem_cached"):
            c = dispatch.resolve(mode, H100, ALL_TOOLS, dtype, 512, N)
            assert c.backward_mode == "multi_wave_cached", (dtype, N, mode, c)
    assert "under 24 KiB" in dispatch.resolve("tma_smem_cached", H100, ALL_TOOLS, torch.bfloat16, 512, 8192).reason


def test_residual_backward_without_dh_runs_the_norms_backward(monkeypatch):
    """Where no dh is read (h has no later use, or the fused kernels are switched off: dh added after),
    the residual add's backward runs the norm's own backward, not the one chosen for dh (at 19336 columns:
    the cuTile kernel, where the with-dh answer is the CuTe DSL one); Triton's fused kernel, which takes
    a missing dh, stays where it runs."""
    choice = dispatch.resolve(None, H100, ALL_TOOLS, torch.bfloat16, 512, 19336)
    assert (choice.backward_mode, choice.dh_backward_mode) == ("multi_wave_cached", "tma_smem_cached")
    assert dispatch.residual_backward(None, choice, 19336, 2, H100, ALL_TOOLS)[:2] == (dispatch.BWD_DH_INSIDE,
                                                                                     "tma_smem_cached")
    assert dispatch.residual_backward(None, choice, 19336, 2, H100, ALL_TOOLS, has_dh=False)[:2] == (
        dispatch.BWD_DH_AFTER, "multi_wave_cached")
    narrow = dispatch.resolve(None, H100, ALL_TOOLS, torch.bfloat16, 512, 1024)
    assert dispatch.residual_backward(None, narrow, 1024, 2, H100, ALL_TOOLS, has_dh=False)[0] == dispatch.BWD_FUSED
    monkeypatch.setenv(dispatch.ENV_FUSED, "0")
    assert dispatch.residual_backward(None, choice, 19336, 2, H100, ALL_TOOLS)[:2] == (dispatch.BWD_DH_AFTER,
                                                                                     "multi_wave_cached")


def test_every_entry_point_routes_with_the_weights_dtype(monkeypatch):
    """rms_norm (no grad, autograd, under the op), add_rms_norm (forward and backward) and explain hand
    dispatch.resolve whether the weight is fp32 beside 16-bit x (BACKWARD_TABLE's rows tell them apart)."""
    import cutile_norms as cn
    from cutile_norms import rmsnorm

    seen = []
    real = dispatch.resolve

    def spy(mode, dev, tools, dtype, M, N, fp32_weight=False):
        seen.append(fp32_weight)
        return real(mode, dev, tools, dtype, M, N, fp32_weight)

    monkeypatch.setattr(dispatch, "resolve", spy)
    x = torch.randn(4, 64, dtype=torch.bfloat16)
    for w_dtype, expect in ((torch.float32, True), (torch.bfloat16, False)):
        w = torch.randn(64, dtype=w_dtype)
        for call in (lambda: cn.rms_norm(x, w),
                     lambda: cn.rms_norm(x.clone().requires_grad_(), w).float().sum().backward(),
                     lambda: torch.ops.cutile_norms.rms_norm_fwd(x, w, 1e-6, 0.0, "", False),
                     lambda: torch.autograd.backward(cn.rms_norm(x.clone().requires_grad_(), w,
                                                                 residual=x.clone().requires_grad_())[0].float().sum()),
                     lambda: cn.explain(x, w, residual=x)):
            rmsnorm._route.cache_clear()
            rmsnorm._PLANS.clear()
            seen.clear()
            call()
            assert seen and all(f == expect for f in seen), (w_dtype, seen)


def test_an_h200_takes_its_own_backward_rows():
    """BACKWARD_TABLE's sm_90/H200 rows replace the arch's on an H200 (with the shipped forward table):
    at 8192 (16 KiB) Triton's backward there, the cuTile kernel's on an H100; the CuTe kernel from 24 KiB
    on both; an unmeasured model of the arch (H800) takes the H100's rows."""
    h200 = DeviceInfo("nvidia", "NVIDIA H200", (9, 0), 132, 0)
    h800 = DeviceInfo("nvidia", "NVIDIA H800", (9, 0), 132, 0)
    for dtype in (torch.bfloat16, torch.float16):
        c = dispatch.resolve(None, h200, ALL_TOOLS, dtype, 4096, 8192)
        assert c.backward_mode == "triton" and "NVIDIA H200" in c.reason and "0.914" in c.reason, c
        assert dispatch.resolve(None, H100, ALL_TOOLS, dtype, 4096, 8192).backward_mode == "multi_wave_cached"
        assert dispatch.resolve(None, h200, ALL_TOOLS, dtype, 4096, 24576).backward_mode == "tma_smem_cached"
        assert dispatch.resolve(None, h200, ALL_TOOLS, dtype, 4096, 6144).backward_mode == "multi_wave_cached"
    with pytest.warns(dispatch.UnmeasuredDeviceWarning):
        c = dispatch.resolve(None, h800, ALL_TOOLS, torch.bfloat16, 4096, 8192)
    assert c.backward_mode == "multi_wave_cached", c
    assert dispatch.resolve(None, h200, ALL_TOOLS, torch.float32, 4096, 8192).backward_mode != "triton"


def test_an_h200_runs_the_cute_backward_at_fp32_rows_of_10_to_256_kib():
    """backward_table.H200_FP32_CUTE_BWD_BYTES: an H200's fp32 rows of 2560-65536 columns run the CuTe
    DSL backward under mode=None, odd vector counts included; narrower and wider rows, rows it does not take
    (N not a multiple of 4), dh, the H100 and mode="tma_smem_cached" by name keep the cuTile kernel."""
    h200 = DeviceInfo("nvidia", "NVIDIA H200", (9, 0), 132, 0)
    for N in (2560, 3848, 4096, 6500, 9732, 13004, 20480, 37000, 65536):
        c = dispatch.resolve(None, h200, ALL_TOOLS, torch.float32, 4096, N)
        assert c.backward_mode == "tma_smem_cached" and "fp32 (fp32 weight)" in c.reason, (N, c)
        assert c.dh_backward_mode == "multi_wave_cached", (N, c)
        assert dispatch.resolve(None, H100, ALL_TOOLS, torch.float32, 4096, N).backward_mode == "multi_wave_cached"
        assert dispatch.resolve("tma_smem_cached", h200, ALL_TOOLS, torch.float32, 4096, N).backward_mode \
            == "multi_wave_cached"
    for N in (2048, 2556, 65540, 131072, 9730, 20481):
        assert dispatch.resolve(None, h200, ALL_TOOLS, torch.float32, 4096, N).backward_mode == "multi_wave_cached", N
    # 16-bit rows of those bytes keep their own rows (the CuTe kernel from 24 KiB, Triton at 8192)
    assert dispatch.resolve(None, h200, ALL_TOOLS, torch.bfloat16, 4096, 8192).backward_mode == "triton"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_an_h200_runs_the_cute_backward_from_16_kib_where_it_tiles_or_evens_the_row(dtype):
    """H200, 16-bit rows of 16-24 KiB (backward_table.H200_CUTE_BWD_MIN_BYTES): the CuTe DSL backward at
    rows its slices tile exactly (N a multiple of 1024 there), at rows a multiple of 32 bytes (its
    EVEN_SLICES: one CTA of 256 threads) and at every row from 11224 columns, beside either weight; the
    cuTile kernel at the other rows (an odd count of 16-byte vectors) and with dh (not measured there); the
    H100 (below 11592 columns: test_an_h100_runs_the_cute_backward_from_11592_columns) and
    mode="tma_smem_cached" by name keep the cuTile kernel under 24 KiB."""
    from cutile_norms.cute.rmsnorm_bwd_config import exact_tiling

    h200 = DeviceInfo("nvidia", "NVIDIA H200", (9, 0), 132, 0)
    for N in (8704, 9216, 9472, 10000, 10240, 11008, 11136, 11224, 11264, 11392, 11776, 12040, 12280):
        c = dispatch.resolve(None, h200, ALL_TOOLS, dtype, 4096, N)
        assert c.backward_mode == "tma_smem_cached" and "H200" in c.reason, (N, c)
        assert c.dh_backward_mode == "multi_wave_cached", (N, c)
        assert dispatch.resolve(None, h200, ALL_TOOLS, dtype, 4096, N, fp32_weight=True).backward_mode \
            == "tma_smem_cached"
        assert dispatch.resolve(None, H100, ALL_TOOLS, dtype, 4096, N).backward_mode \
            == ("tma_smem_cached" if N >= 11592 else "multi_wave_cached")
        assert dispatch.resolve("tma_smem_cached", h200, ALL_TOOLS, dtype, 4096, N).backward_mode \
            == "multi_wave_cached"
    for N in range(8200, 11224, 8):
        cute = exact_tiling(N, dtype.itemsize) is not None or N % 16 == 0
        for fp32_weight in (False, True):
            mode = dispatch.resolve(None, h200, ALL_TOOLS, dtype, 4096, N, fp32_weight=fp32_weight).backward_mode
            assert mode == ("tma_smem_cached" if cute else "multi_wave_cached"), (N, fp32_weight)
    assert [N for N in range(8200, 11224, 8) if exact_tiling(N, 2)] == [9216, 10240]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_an_h100_runs_the_cute_backward_from_11592_columns(dtype):
    """H100, 16-bit rows of 11592-12287 columns (backward_table.H100_CUTE_BWD_MIN_BYTES), either weight, no
    dh: the CuTe DSL backward, where the cuTile kernel's config comes from its table's 16384 entry (past the
    geometric mean of 8192 and 16384); below, on the 8192 entry's, the cuTile kernel; with dh the cuTile
    kernel; mode="tma_smem_cached" by name keeps the cuTile kernel under 24 KiB."""
    from cutile_norms.cutile.rmsnorm_bwd_config import config_and_source

    assert "N=8192 " in config_and_source(11584, 2, H100, "bfloat16")[1]
    assert "N=16384 " in config_and_source(11592, 2, H100, "bfloat16")[1]
    for N in range(11000, 12296, 8):
        for fp32_weight in (False, True):
            c = dispatch.resolve(None, H100, ALL_TOOLS, dtype, 4096, N, fp32_weight=fp32_weight)
            assert c.backward_mode == ("tma_smem_cached" if N >= 11592 else "multi_wave_cached"), (N, c)
            assert c.dh_backward_mode == ("tma_smem_cached" if N >= 12288 else "multi_wave_cached"), (N, c)
    for N in (11592, 12040, 12280):
        assert dispatch.resolve("tma_smem_cached", H100, ALL_TOOLS, dtype, 4096, N).backward_mode \
            == "multi_wave_cached"


def test_gpu_models_of_an_arch_have_their_own_tables(monkeypatch):
    """A model measured on its own (sm_90/H200) runs its rows; another model of the arch (H800) and a
    dtype the model lacks run the arch's rows, saying which GPU measured them and warning once."""
    from cutile_norms import rmsnorm

    row = {"n_min": 1, "n_max": 2 ** 40, "m_min": 1, "m_max": 2 ** 40, "evidence": "x"}
    table = {"source": {"sm_90": {"gpu": "NVIDIA H100 80GB HBM3", "commands": {}},
                        "sm_90/H200": {"gpu": "NVIDIA H200", "commands": {}}},
             "tables": {"sm_90": {"bfloat16": [{**row, "mode": "tma_smem_cached"}],
                                  "float16": [{**row, "mode": "tma_smem_cached"}]},
                        "sm_90/H200": {"bfloat16": [{**row, "mode": "multi_wave_cached"}]}}}
    monkeypatch.setattr(dispatch, "measured_table", lambda: table)
    monkeypatch.setattr(dispatch, "_warned_arches", set())
    rmsnorm._route.cache_clear()
    h200 = DeviceInfo("nvidia", "NVIDIA H200", (9, 0), 132, 0)
    h800 = DeviceInfo("nvidia", "NVIDIA H800", (9, 0), 132, 0)
    c = dispatch.resolve(None, h200, ALL_TOOLS, torch.bfloat16, 4, 4096)
    assert c.mode == "multi_wave_cached" and "measured table sm_90/H200/bfloat16" in c.reason
    assert "not measured" not in c.reason
    assert dispatch.resolve(None, H100, ALL_TOOLS, torch.bfloat16, 4, 4096).mode == "tma_smem_cached"
    with pytest.warns(dispatch.UnmeasuredDeviceWarning, match="NVIDIA H100 80GB HBM3"):
        c = dispatch.resolve(None, h200, ALL_TOOLS, torch.float16, 4, 4096)
    assert c.mode == "tma_smem_cached" and "NVIDIA H200 not measured in float16" in c.reason
    with pytest.warns(dispatch.UnmeasuredDeviceWarning):
        c = dispatch.resolve(None, h800, ALL_TOOLS, torch.bfloat16, 4, 4096)
    assert c.mode == "tma_smem_cached" and "the sm_90 table (NVIDIA H100 80GB HBM3) stands in" in c.reason
    rmsnorm._route.cache_clear()


def test_mode_none_never_picks_an_experimental_kernel(fake_table):
    c = dispatch.resolve(None, H100, ALL_TOOLS, torch.bfloat16, 64, 65536)
    assert c.mode == "triton" and "experimental_one row cannot run here" in c.reason


def test_mode_none_skips_rows_whose_dsl_is_missing(fake_table):
    c = dispatch.resolve(None, H100, NO_CUTILE, torch.bfloat16, 4096, 4096)
    assert c.mode == "triton" and "needs cutile" in c.reason


def test_mode_none_without_rows_for_the_dtype(fake_table):
    c = dispatch.resolve(None, H100, ALL_TOOLS, torch.float16, 4096, 4096)
    assert c.mode == "triton" and "float16" in c.reason


def test_explicit_experimental_mode_needs_the_opt_in(fake_table, monkeypatch):
    monkeypatch.delenv("CUTILE_NORMS_EXPERIMENTAL")
    with pytest.raises(RuntimeError, match="experimental"):
        dispatch.resolve("experimental_one", H100, ALL_TOOLS, torch.bfloat16, 4, 128)


def test_the_shipped_table_is_consistent():
    table = dispatch.measured_table()
    for arch, by_dtype in table["tables"].items():
        assert arch in table["source"], f"{arch}: no source (GPU, command) recorded"
        for dtype, rows in by_dtype.items():
            assert table["source"][arch]["commands"][dtype]["command"].startswith("python bench/"), f"{arch}/{dtype}"
            assert dtype in ("bfloat16", "float16", "float32")
            for row in rows:
                mode = dispatch.MODES[row["mode"]]
                assert mode.status == dispatch.STABLE, f"{arch}/{dtype}: table row picks {row['mode']}"
                assert row["n_min"] <= row["n_max"] and row["m_min"] <= row["m_max"]
            # one mode per width for every M (batch invariance), rows from N = 1 to 2^40 without gaps
            assert all((r["m_min"], r["m_max"]) == (1, 2 ** 40) for r in rows), f"{arch}/{dtype}: an M band"
            assert rows[0]["n_min"] == 1 and rows[-1]["n_max"] == 2 ** 40, f"{arch}/{dtype}"
            for a, b in zip(rows, rows[1:]):
                assert b["n_min"] == a["n_max"] + 1, f"{arch}/{dtype}: gap between {a} and {b}"


def _bench_result(ratios: dict, gpu: str = "NVIDIA H100 80GB HBM3") -> dict:
    """A bench result (bench/rmsnorm.py's JSON) with {N: {mode: forward ratio to a copy}}."""
    return {"arch": "sm_90", "gpu": gpu, "dtype": "bfloat16", "sm_count": 132, "date": "today",
            "command": "python bench/rmsnorm.py --write-table",
            "sweep": [{"N": n, "impls": [{"impl": f"cn.{m}", "fwd_vs_copy": r} for m, r in t.items()]}
                      for n, t in sorted(ratios.items())]}


def test_written_table_takes_the_best_worst_case_per_band(tmp_path, monkeypatch):
    """bench/rmsnorm.py --write-table (dispatch.FORWARD_RULE): per band of row bytes the mode whose worst
    ratio over the band's widths is the highest, for every M, not each width's winner; another GPU
    model of the arch gets its own table."""
    import json

    from bench.rmsnorm import write_table
    from cutile_norms import rmsnorm

    path = tmp_path / "table.json"
    monkeypatch.setattr(dispatch, "TABLE_PATH", str(path))
    monkeypatch.setattr(dispatch, "measured_table", lambda: json.load(open(path)))
    rmsnorm._route.cache_clear()
    a, b = "tma_smem_cached", "multi_wave_cached"
    write_table(_bench_result({512: {a: 1.00, b: 0.99}, 2048: {a: 0.97, b: 1.00}, 4096: {a: 0.99, b: 1.00},
                               10240: {a: 0.98, b: 0.93}, 28672: {a: 0.95, b: 0.99}, 40960: {a: 0.97, b: 0.99},
                               65536: {a: 0.99, b: 0.98}, 98368: {a: 0.74, b: 0.99}}))
    rows = dispatch.measured_table()["tables"]["sm_90"]["bfloat16"]
    e0, e1, e2, e3, e4, e5, e6 = (edge // 2 for edge in dispatch.FORWARD_BAND_EDGES)  # 16-bit elements
    assert [(r["n_min"], r["n_max"], r["m_min"], r["m_max"], r["mode"]) for r in rows] == [
        (1, e0, 1, 1 << 40, a), (e0 + 1, e1, 1, 1 << 40, b), (e1 + 1, e2, 1, 1 << 40, a),
        (e2 + 1, e3, 1, 1 << 40, b), (e3 + 1, e4, 1, 1 << 40, b), (e4 + 1, e5, 1, 1 << 40, a),
        (e5 + 1, e6, 1, 1 << 40, b)]  # past 256 KiB nothing measured: no row
    assert "worst of 2 widths 0.980x" in rows[2]["evidence"]  # 4096 (8 KiB) and 10240: 0.99 / 1.00, 0.98 / 0.93
    assert "runner-up multi_wave_cached worst 0.930" in rows[2]["evidence"]
    for M in (1, 64, 1 << 20):  # every M: one mode per width
        assert dispatch.resolve(None, H100, ALL_TOOLS, torch.bfloat16, M, 4096).mode == a
        assert dispatch.resolve(None, H100, ALL_TOOLS, torch.bfloat16, M, 65536).mode == a
        assert dispatch.resolve(None, H100, ALL_TOOLS, torch.bfloat16, M, 98368).mode == b
    write_table(_bench_result({4096: {a: 0.95, b: 0.99}}, gpu="NVIDIA H200"))
    table = dispatch.measured_table()
    assert table["tables"]["sm_90/H200"]["bfloat16"][0]["mode"] == b
    assert table["source"]["sm_90/H200"]["gpu"] == "NVIDIA H200"
    assert table["tables"]["sm_90"]["bfloat16"] == rows
    rmsnorm._route.cache_clear()


LAZY_CHILD = r"""
import json, os, sys
import torch
import cutile_norms
from cutile_norms import dispatch
from cutile_norms._platform import DeviceInfo, toolchain
before = {m: m in sys.modules for m in ("cuda.tile", "cutlass", "triton")}
cache_env_before = "CUDA_TILE_CACHE_DIR" in os.environ
h100 = DeviceInfo("nvidia", "NVIDIA H100 80GB HBM3", (9, 0), 132, 0)
choice = dispatch.resolve("tma_smem_cached", h100, toolchain(), torch.bfloat16, 1, 4096)
after = {m: m in sys.modules for m in ("cuda.tile", "cutlass", "triton")}
print("RESULT " + json.dumps(dict(before=before, after=after, mode=choice.mode, cache_env_before=cache_env_before,
                                  cache_env=os.environ.get("CUDA_TILE_CACHE_DIR"))))
"""


def test_the_process_toolchain_imports_only_what_a_decision_needs(tmp_path):
    """`import cutile_norms` imports no DSL, and a decision for a CuTe mode imports CuTe and cuTile (its
    backward) but not Triton: importing every DSL up front was a fifth of a fresh process's first call.
    cuTile's disk cache is pointed at ours before cuda.tile is imported."""
    import json
    import os
    import subprocess
    import sys

    pytest.importorskip("cutlass.cute")
    pytest.importorskip("cuda.tile")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {k: v for k, v in os.environ.items() if k not in ("CUDA_TILE_CACHE_DIR", "TRITON_INTERPRET")}
    env.update(PYTHONPATH=root, CUTILE_NORMS_CACHE_DIR=str(tmp_path))
    proc = subprocess.run([sys.executable, "-c", LAZY_CHILD], capture_output=True, text=True, env=env, cwd=root,
                          timeout=300)
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and line, proc.stderr[-2000:]
    r = json.loads(line[0][len("RESULT "):])
    assert r["before"] == {"cuda.tile": False, "cutlass": False, "triton": False}, r
    assert r["mode"] == "tma_smem_cached" and r["after"]["cutlass"] and r["after"]["cuda.tile"], r
    assert not r["after"]["triton"], r
    assert not r["cache_env_before"] and r["cache_env"] == str(tmp_path / "cutile"), r


@pytest.mark.parametrize("mode,N,h_bytes,expected", [
    (None, 4096, 2, dispatch.FUSED_ADD_KERNEL), ("triton", 16384, 2, dispatch.FUSED_ADD_KERNEL),
    ("multi_wave_cached", 4096, 2, dispatch.FUSED_ADD_SPLIT_KERNEL), ("static_persistent", 1536, 2,
                                                                        dispatch.FUSED_ADD_SPLIT_KERNEL),
    ("multi_wave_reload", 1535, 2, None), ("multi_wave_reload", 768, 4, dispatch.FUSED_ADD_SPLIT_KERNEL),
    ("multi_wave_reload", 16, 4, None), ("tma_smem_cached", 4096, 2, dispatch.FUSED_ADD_CUTE_KERNEL),
    (None, 20480, 2, dispatch.FUSED_ADD_KERNEL), ("triton", 32768, 4, dispatch.FUSED_ADD_KERNEL),
    (None, 32769, 2, dispatch.FUSED_ADD_SPLIT_KERNEL), ("static_persistent", 65536, 4, dispatch.FUSED_ADD_SPLIT_KERNEL),
    ("triton", 32769, 2, None), ("tma_smem_cached", 65536, 2, dispatch.FUSED_ADD_CUTE_KERNEL),
    (None, 524288, 2, dispatch.FUSED_ADD_SPLIT_KERNEL), (None, 524289, 2, None), (None, 262145, 4, None)])
def test_residual_add_kernel_rule(monkeypatch, mode, N, h_bytes, expected):
    """Triton's fused forward for rows of up to FUSED_ADD_MAX_N (mode None or "triton"), cuTile's split
    form past that (mode None) and from FUSED_ADD_SPLIT_MIN_BYTES rows under a cuTile mode named, up to its
    row bound in bytes of h; the CuTe DSL kernel under mode "tma_smem_cached" where it takes the tensors
    (cute_refusal, asked only then); else unfused, with a reason; CUTILE_NORMS_FUSED=0 switches all off."""
    monkeypatch.delenv(dispatch.ENV_FUSED, raising=False)
    asked = []

    def refusal():
        asked.append(1)
        return None

    kernel, why = dispatch.residual_add_kernel(mode, mode or "multi_wave_cached", N, h_bytes, H100, ALL_TOOLS, refusal)
    assert kernel == expected and why, (kernel, why)
    assert len(asked) == (mode == "tma_smem_cached")
    if mode == "tma_smem_cached":  # a caller that checks no tensors never gets the CuTe DSL kernel
        assert dispatch.residual_add_kernel(mode, mode, N, h_bytes, H100, ALL_TOOLS)[0] is None
    if expected == dispatch.FUSED_ADD_SPLIT_KERNEL:
        assert dispatch.residual_add_kernel(mode, "multi_wave_cached", N, h_bytes, H100, NO_CUTILE)[0] is None
    if expected == dispatch.FUSED_ADD_CUTE_KERNEL:
        kernel, why = dispatch.residual_add_kernel(mode, mode, N, h_bytes, H100, ALL_TOOLS, lambda: "not these rows")
        assert kernel is None and why == "not these rows"
    monkeypatch.setenv(dispatch.ENV_FUSED, "0")
    kernel, why = dispatch.residual_add_kernel(mode, mode or "multi_wave_cached", N, h_bytes, H100, ALL_TOOLS)
    assert kernel is None and dispatch.ENV_FUSED in why


@pytest.mark.parametrize("mode,N,tools,expected", [
    (None, dispatch.FUSED_ADD_FP32_WEIGHT_MAX_N, ALL_TOOLS, dispatch.FUSED_ADD_KERNEL),
    (None, dispatch.FUSED_ADD_FP32_WEIGHT_MAX_N + 8, ALL_TOOLS, dispatch.FUSED_ADD_SPLIT_KERNEL),
    (None, dispatch.FUSED_ADD_MAX_N, NO_CUTILE, dispatch.FUSED_ADD_KERNEL),
    ("triton", dispatch.FUSED_ADD_MAX_N, ALL_TOOLS, dispatch.FUSED_ADD_KERNEL)])
def test_residual_add_kernel_beside_an_fp32_weight(monkeypatch, mode, N, tools, expected):
    """Beside an fp32 weight Triton's 1024-thread rows spill: mode None runs cuTile's split kernel past
    FUSED_ADD_FP32_WEIGHT_MAX_N where cuTile runs, Triton's kernel where it does not; mode "triton" runs
    Triton's to FUSED_ADD_MAX_N (the same values, only slower)."""
    monkeypatch.delenv(dispatch.ENV_FUSED, raising=False)
    kernel, why = dispatch.residual_add_kernel(mode, mode or "multi_wave_cached", N, 2, H100, tools,
                                               fp32_weight=True)
    assert kernel == expected, (kernel, why)
    if expected == dispatch.FUSED_ADD_SPLIT_KERNEL:
        assert "fp32 weight" in why, why
        kernel_16bit_weight = dispatch.residual_add_kernel(mode, "multi_wave_cached", N, 2, H100, tools)[0]
        assert kernel_16bit_weight == dispatch.FUSED_ADD_KERNEL


@pytest.mark.parametrize("N", [dispatch.FUSED_ADD_FP32_WEIGHT_MAX_N + 8, 20480, dispatch.FUSED_ADD_MAX_N])
def test_residual_add_kernel_beside_an_fp32_weight_cute_first(monkeypatch, N):
    """Past FUSED_ADD_FP32_WEIGHT_MAX_N to FUSED_ADD_MAX_N beside an fp32 weight, mode None runs the CuTe
    DSL fused kernel on 16-bit rows where it runs and takes the tensors, else the split kernel (past
    FUSED_ADD_MAX_N too)."""
    monkeypatch.delenv(dispatch.ENV_FUSED, raising=False)
    no_cute = Toolchain(cutile=None, cute="`import cutlass` failed: ModuleNotFoundError", triton=None)

    def kernel(n, tools=ALL_TOOLS, refusal=lambda: None, fp32_weight=True):
        return dispatch.residual_add_kernel(None, "multi_wave_cached", n, 2, H100, tools, refusal, fp32_weight)[0]

    assert kernel(N) == dispatch.FUSED_ADD_CUTE_KERNEL
    assert "fp32 weight" in dispatch.residual_add_kernel(None, "multi_wave_cached", N, 2, H100, ALL_TOOLS,
                                                         lambda: None, True)[1]
    assert kernel(N, refusal=lambda: "not these rows") == dispatch.FUSED_ADD_SPLIT_KERNEL
    assert kernel(N, tools=no_cute) == dispatch.FUSED_ADD_SPLIT_KERNEL
    assert kernel(N, fp32_weight=False) == dispatch.FUSED_ADD_KERNEL  # a 16-bit weight: Triton's to 32768
    assert kernel(dispatch.FUSED_ADD_FP32_WEIGHT_MAX_N) == dispatch.FUSED_ADD_KERNEL
    assert kernel(dispatch.FUSED_ADD_MAX_N + 8) == dispatch.FUSED_ADD_SPLIT_KERNEL
    fp32_rows = dispatch.residual_add_kernel(None, "multi_wave_cached", N, 4, H100, ALL_TOOLS, lambda: None, True)
    assert fp32_rows[0] == dispatch.FUSED_ADD_SPLIT_KERNEL  # fp32 x, r or h: the split kernel (CuTe's unmeasured)


@pytest.mark.parametrize("mode,norm_mode,bwd_mode,N,tools,expected,runs", [
    (None, "triton", "triton", 1024, ALL_TOOLS, dispatch.BWD_FUSED, "triton"),  # rows of 2 KiB: Triton's kernel
    (None, "multi_wave_cached", "triton", 1025, ALL_TOOLS, dispatch.BWD_DH_INSIDE, "multi_wave_cached"),
    (None, "multi_wave_cached", "multi_wave_cached", 8192, ALL_TOOLS, dispatch.BWD_DH_INSIDE, "multi_wave_cached"),
    (None, "multi_wave_cached", "tma_smem_cached", 24576, ALL_TOOLS, dispatch.BWD_DH_INSIDE, "tma_smem_cached"),
    (None, "triton", "triton", 4096, NO_CUTILE, dispatch.BWD_FUSED, "triton"),  # no cuTile: Triton's to 8192
    (None, "triton", "triton", 8200, NO_CUTILE, dispatch.BWD_DH_AFTER, "triton"),
    ("triton", "triton", "triton", 8192, ALL_TOOLS, dispatch.BWD_FUSED, "triton"),  # asked for: to 8192
    ("triton", "triton", "triton", 8200, ALL_TOOLS, dispatch.BWD_DH_AFTER, "triton"),  # its norm backward, then dh
    ("multi_wave_cached", "multi_wave_cached", "multi_wave_cached", 512, ALL_TOOLS, dispatch.BWD_DH_INSIDE,
     "multi_wave_cached"),
    ("tma_smem_cached", "tma_smem_cached", "tma_smem_cached", 65536, ALL_TOOLS, dispatch.BWD_DH_INSIDE,
     "tma_smem_cached"),
    (None, "torch", "torch", 4096, ALL_TOOLS, dispatch.BWD_DH_AFTER, "torch")])
def test_residual_backward_rule(monkeypatch, mode, norm_mode, bwd_mode, N, tools, expected, runs):
    """mode None: Triton's fused backward for 16-bit rows of up to FUSED_ADD_BWD_TRITON_BYTES, the norm's
    backward reading dh above (the cuTile kernel where the norm's table runs Triton's); mode "triton":
    Triton's fused kernel up to FUSED_ADD_BWD_MAX_N, then its norm backward and an add; cuTile and CuTe
    modes read dh in their kernels. The CPU and CUTILE_NORMS_FUSED=0 add dh after. Every answer has a
    reason."""
    monkeypatch.delenv(dispatch.ENV_FUSED, raising=False)
    choice = dispatch.Choice(norm_mode, "the norm's", bwd_mode=bwd_mode)
    how, bwd, why = dispatch.residual_backward(mode, choice, N, 2, H100, tools)
    assert (how, bwd) == (expected, runs) and why, (how, bwd, why)
    assert dispatch.residual_backward(mode, choice, N, 2, CPU, tools)[0] == dispatch.BWD_DH_AFTER
    monkeypatch.setenv(dispatch.ENV_FUSED, "0")
    how, bwd, why = dispatch.residual_backward(mode, choice, N, 2, H100, tools)
    assert how == dispatch.BWD_DH_AFTER and bwd == bwd_mode and why


@pytest.mark.parametrize("N,fused", [(520, True), (896, True), (1024, True), (1040, False), (1088, True), (1152, True),
                                     (1368, False), (1456, True), (1472, False), (2048, False), (6136, False),
                                     (6144, True), (7168, True), (6152, False), (8192, True)])
def test_residual_backward_h200_dh_rows(monkeypatch, N, fused):
    """mode None on an H200, 16-bit h with dh: Triton's fused form (its TMA rows kernel reading dh,
    triton/add_rmsnorm_bwd_config.tma_rows) where the H200's rule takes the rows, also past
    FUSED_ADD_BWD_TRITON_BYTES (1088-1456 columns at a multiple of 16 filling 53 % of their block, and
    6144-8192 at a multiple of 16), mode "triton" too; elsewhere what ran before (the cuTile kernel reading dh
    past 2 KiB rows), and so without dh, on an H100, beside fp32 rows, and where the call's tensors are not
    ones the TMA form takes (by_tma False: add_rmsnorm_bwd_config.tensors_take_tma)."""
    monkeypatch.delenv(dispatch.ENV_FUSED, raising=False)
    h200 = DeviceInfo("nvidia", "NVIDIA H200", (9, 0), 132, 0)
    choice = dispatch.Choice("triton", "the norm's", bwd_mode="triton")
    how, bwd, why = dispatch.residual_backward(None, choice, N, 2, h200, ALL_TOOLS)
    if fused:
        assert how == dispatch.BWD_FUSED and "TMA rows kernel reading dh" in why, (N, how, why)
    else:
        assert "TMA" not in why and (how != dispatch.BWD_FUSED or N * 2 <= dispatch.FUSED_ADD_BWD_TRITON_BYTES), (N, why)
    named = dispatch.residual_backward("triton", choice, N, 2, h200, ALL_TOOLS)
    assert named[0] == dispatch.BWD_FUSED and ("TMA" in named[2]) == fused, (N, named)  # (to 8192: Triton's form)
    for dev, n_bytes, has_dh, by_tma in ((H100, 2, True, True), (h200, 4, True, True), (h200, 2, False, True),
                                         (h200, 2, True, False)):
        how, bwd, why = dispatch.residual_backward(None, choice, N, n_bytes, dev, ALL_TOOLS, has_dh=has_dh,
                                                   by_tma=by_tma)
        assert "TMA" not in why, (N, dev.name, n_bytes, has_dh, by_tma, why)
        if has_dh and N * n_bytes > dispatch.FUSED_ADD_BWD_TRITON_BYTES:  # as before: the cuTile kernel reads dh
            assert (how, bwd) == (dispatch.BWD_DH_INSIDE, "multi_wave_cached"), (N, dev.name, how, bwd)
