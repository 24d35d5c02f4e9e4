"""Dispatch decisions on simulated devices (no GPU needed)."""
import pytest
import torch

from cutile_norms import dispatch
from cutile_norms._platform import CPU, DeviceInfo, Toolchain

H100 = DeviceInfo("nvidia", "NVIDIA H100 80GB HBM3", (9, 0), 132, 0)
B200 = DeviceInfo("nvidia", "NVIDIA B200", (10, 0), 148, 0)
A100 = DeviceInfo("nvidia", "NVIDIA A100-SXM4-80GB", (8, 0), 108, 0)
MI300 = DeviceInfo("amd", "AMD Instinct MI300X", (9, 4), 304, 0)
ALL_TOOLS = Toolchain(cutile=None, cute=None, triton=None)
NO_CUTILE = Toolchain(cutile="`import cuda.tile` failed: ModuleNotFoundError", cute=None, triton=None)

CUTILE_MODES = ["multi_wave_reload", "multi_wave_cached", "static_persistent"]


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
    assert choice.mode in CUTILE_MODES
    assert "measured table sm_90/bfloat16" in choice.reason and "sm_100 not measured" in choice.reason
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
    assert dispatch.table_arch(dev, {a: {} for a in measured}) == expected


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
        assert c.backward_mode == "triton" and "0.947" in c.reason, c
    for dtype, N in ((torch.bfloat16, 4096), (torch.bfloat16, 8192), (torch.float32, 7168)):
        c = dispatch.resolve(None, H100, ALL_TOOLS, dtype, 4096, N)
        assert c.backward_mode == "multi_wave_cached" or c.backward_mode == c.mode != "triton", (dtype, N, c)
    no_triton = Toolchain(cutile=None, cute=None, triton="`import triton` failed: ModuleNotFoundError")
    c = dispatch.resolve(None, H100, no_triton, torch.bfloat16, 4096, 7168)
    assert c.backward_mode == c.mode != "triton", c
    # 16-bit rows of 32768 to 262144 elements: the CuTe DSL backward (its backend takes misaligned rows
    # to the cuTile kernel), whatever the forward
    for dtype, N in ((torch.bfloat16, 32768), (torch.bfloat16, 65536), (torch.float16, 262144), (torch.bfloat16, 100000)):
        c = dispatch.resolve(None, H100, ALL_TOOLS, dtype, 512, N)
        assert c.backward_mode == "tma_smem_cached", (dtype, N, c)
    for dtype, N in ((torch.bfloat16, 16384), (torch.float32, 262144), (torch.bfloat16, 1 << 20)):
        c = dispatch.resolve(None, H100, ALL_TOOLS, dtype, 512, N)
        assert c.backward_mode != "tma_smem_cached" or c.mode == "tma_smem_cached", (dtype, N, c)


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
            assert "bench/rmsnorm.py" in table["source"][arch]["commands"][dtype]["command"], f"{arch}/{dtype}"
            assert dtype in ("bfloat16", "float16", "float32")
            for row in rows:
                mode = dispatch.MODES[row["mode"]]
                assert mode.status == dispatch.STABLE, f"{arch}/{dtype}: table row picks {row['mode']}"
                assert row["n_min"] <= row["n_max"] and row["m_min"] <= row["m_max"]
            # the N ranges of each M band start at 1 without gaps; the band for every M reaches 2^18
            for m_band in {(r["m_min"], r["m_max"]) for r in rows}:
                band = sorted((r for r in rows if (r["m_min"], r["m_max"]) == m_band), key=lambda r: r["n_min"])
                assert band[0]["n_min"] == 1 and (m_band[1] < 2 ** 40 or band[-1]["n_max"] >= 2 ** 18)
                for a, b in zip(band, band[1:]):
                    assert b["n_min"] == a["n_max"] + 1, f"{arch}/{dtype}: gap between {a} and {b}"


def _bench_result(sweep_winners: dict, small: dict) -> dict:
    """A bench result (bench/rmsnorm.py's JSON) with the given winners: {N: mode} at large M, and
    {(N, M): {mode: us}} for the small-M sweep; the other modes measure 10 % slower."""
    def impls(best):
        return [{"impl": f"cn.{m}", "fwd_vs_copy": 0.99 if m == best else 0.9} for m in CUTILE_MODES]
    return {"arch": "sm_90", "gpu": "NVIDIA H100", "dtype": "bfloat16", "sm_count": 132, "date": "today",
            "command": "python bench/rmsnorm.py --write-table",
            "sweep": [{"N": n, "impls": impls(m)} for n, m in sorted(sweep_winners.items())],
            "small_m": [{"N": n, "M": m, "copy_us": 4.0, "impls": [{"impl": f"cn.{k}", "fwd_us": v} for k, v in t.items()]}
                        for (n, m), t in sorted(small.items())]}


def test_written_table_has_small_m_rows_first(tmp_path, monkeypatch):
    """bench/rmsnorm.py --write-table: rows for M below the SM count from the small-M sweep (the mode
    whose worst time over those Ms is nearest the fastest), then rows for a few waves (M = 1024 here),
    then the large-M rows by N; resolve() picks by M. The M bands reach twice the widest N measured:
    wider rows at small M take the large-M rows."""
    from bench.rmsnorm import write_table
    from cutile_norms import rmsnorm

    monkeypatch.setattr(dispatch, "TABLE_PATH", str(tmp_path / "table.json"))
    monkeypatch.setattr(dispatch, "measured_table", lambda: __import__("json").load(open(tmp_path / "table.json")))
    rmsnorm._route.cache_clear()
    t = {"multi_wave_cached": 4.6, "multi_wave_reload": 4.9, "static_persistent": 4.8}
    small = {(4096, 1): t, (4096, 64): {"multi_wave_cached": 5.5, "multi_wave_reload": 5.9, "static_persistent": 5.4},
             (4096, 1024): {"multi_wave_cached": 9.0, "multi_wave_reload": 9.9, "static_persistent": 8.0}}
    write_table(_bench_result({1024: "static_persistent", 4096: "multi_wave_reload", 65536: "multi_wave_cached"}, small))
    rows = dispatch.measured_table()["tables"]["sm_90"]["bfloat16"]
    assert [(r["m_min"], r["m_max"], r["n_max"], r["mode"]) for r in rows] == [
        (1, 64, 8192, "multi_wave_cached"), (65, 1024, 8192, "static_persistent"),
        (1, 1 << 40, 2048, "static_persistent"), (1, 1 << 40, 16384, "multi_wave_reload"),
        (1, 1 << 40, 1 << 40, "multi_wave_cached")]
    assert "M=1: 4.6 us" in rows[0]["evidence"] and "1.02x the fastest" in rows[0]["evidence"]
    assert "M=1024: 8.0 us" in rows[1]["evidence"]
    for M, mode in ((1, "multi_wave_cached"), (64, "multi_wave_cached"), (65, "static_persistent"),
                    (1024, "static_persistent"), (1025, "multi_wave_reload"), (1 << 20, "multi_wave_reload")):
        assert dispatch.resolve(None, H100, ALL_TOOLS, torch.bfloat16, M, 4096).mode == mode, M
    for M in (1, 1024):  # beyond twice the widest N of the small-M sweep: the large-M rows
        assert dispatch.resolve(None, H100, ALL_TOOLS, torch.bfloat16, M, 1 << 18).mode == "multi_wave_cached"
    rmsnorm._route.cache_clear()
