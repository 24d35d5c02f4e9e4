"""cutile_norms.warmup: the row counts it visits, its records and its refusals on the CPU; on the GPU,
that after it no call over the warmed range compiles a CuTe kernel or stalls: a compile takes >= 0.1 s,
so a call's first run may take at most 50 ms more than the same call repeated (the repeat, not a fixed
time, is the yardstick: on a GPU shared with other test processes a warm call at M = 32768 has taken
over 50 ms). The 20480-column cases are marked `big`: their 32768 rows hold over 8 GiB (more than a
shard's share of the GPU: they ran out of memory there) and a wall-time bound is judged on a GPU no other
process shares (tests/run_sharded.py runs the `big` tests alone)."""
from __future__ import annotations

import time

import pytest
import torch

import cutile_norms as cn
from cutile_norms.fp8 import FP8_KERNEL_MAX_N
from cutile_norms.warmup import row_counts

# the widths of the GPU tests: 20480 alone on the GPU (module docstring)
GPU_WIDTHS = [4096, pytest.param(20480, marks=pytest.mark.big)]


def _stall(call, *leaves) -> float:
    """How much longer `call`'s first run took than its second (seconds): a compile's cost. The leaves'
    grads are cleared before each run, so both allocate the same."""
    times = []
    for _ in range(2):
        for t in leaves:
            t.grad = None
        torch.cuda.synchronize()
        t = time.perf_counter()
        call()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return times[0] - times[1]


def test_row_counts_cover_every_power_of_two_and_the_ends():
    assert row_counts(1, 32768) == [2 ** k for k in range(16)]
    assert row_counts(3, 100) == [3, 4, 8, 16, 32, 64, 100]
    assert row_counts(5, 5) == [5]
    for bad in ((0, 4), (8, 4)):
        with pytest.raises(ValueError, match="rows must be"):
            row_counts(*bad)


def test_records_and_skips_on_the_cpu(capsys):
    recs = cn.warmup([64, 1000], dtypes=(torch.float32,), rows=(1, 300), max_elements=64 * 256, device="cpu")
    assert [(r["N"], r["dtype"]) for r in recs] == [(64, "float32"), (1000, "float32")]
    assert recs[0]["rows"] == [1, 2, 4, 8, 16, 32, 64, 128, 256] and recs[0]["skipped_rows"] == [300]
    assert recs[1]["rows"] == [1, 2, 4, 8, 16] and recs[1]["skipped_rows"] == [32, 64, 128, 256, 300]
    out = capsys.readouterr().out
    assert "N=64 float32 rows 1..256" in out and "skipped rows [300]" in out


def test_bad_arguments_are_refused():
    for bad in ([], [0], [-8]):
        with pytest.raises(ValueError, match="widths must be"):
            cn.warmup(bad, device="cpu")
    with pytest.raises(TypeError, match="dtypes must be"):
        cn.warmup([64], dtypes=("float32",), device="cpu")
    with pytest.raises(TypeError, match="weight_dtype must be"):
        cn.warmup([64], weight_dtype="float32", device="cpu")
    with pytest.raises(ValueError, match="rows must be"):
        cn.warmup([64], rows=8, device="cpu")
    # nothing rounded or read as a number silently, and every dtype checked before the first call
    for bad in ([64.9], True, ["64"], 4096.0, [64, False]):
        with pytest.raises(TypeError, match="widths must be"):
            cn.warmup(bad, device="cpu")
    with pytest.raises(TypeError, match="rows must be ints"):
        cn.warmup([64], rows=(True, 2), device="cpu")
    for bad in (torch.int32, (torch.float32, torch.float8_e4m3fn)):
        with pytest.raises(TypeError, match="dtypes must be"):
            cn.warmup([64], dtypes=bad, device="cpu")
    with pytest.raises(TypeError, match="residual must be"):
        cn.warmup([64], residual=torch.int32, device="cpu")
    with pytest.raises(TypeError, match="must be each x dtype's own or float32"):
        cn.warmup([64], dtypes=(torch.float16, torch.bfloat16), weight_dtype=torch.float16, device="cpu")
    with pytest.raises(TypeError, match="fp8 must be a bool"):
        cn.warmup([64], fp8="no", device="cpu")


def test_numpy_ints_are_taken_and_the_cpu_says_nothing_compiles():
    import numpy as np

    with pytest.warns(UserWarning, match="no GPU kernel is compiled"):
        recs = cn.warmup(np.int64(64), dtypes=torch.float32, rows=(np.int64(1), 2), device="cpu", verbose=False)
    assert recs[0]["N"] == 64 and recs[0]["rows"] == [1, 2]


def test_one_dtype_and_no_weight(capsys):
    recs = cn.warmup(64, dtypes=torch.float32, rows=(2, 4), weight_dtype=None, device="cpu", verbose=False)
    assert [(r["N"], r["dtype"], r["rows"]) for r in recs] == [(64, "float32", [2, 4])]
    assert capsys.readouterr().out == ""


@pytest.mark.gpu
@pytest.mark.parametrize("N", GPU_WIDTHS)
def test_no_call_compiles_after_warmup(N):
    from cutile_norms.cute import rmsnorm_bwd, rmsnorm_fwd

    cn.warmup([N], rows=(1, 32768), verbose=False)
    counts = rmsnorm_fwd.CACHE.count + rmsnorm_bwd.CACHE.count
    w = (1 + 0.1 * torch.randn(N, device="cuda")).to(torch.bfloat16).requires_grad_()
    stall = 0.0
    for M in (1, 3, 64, 100, 1000, 4097, 32768):
        x = torch.randn(M, N, device="cuda", dtype=torch.bfloat16, requires_grad=True)

        def call():
            cn.rms_norm(x, w).backward(torch.ones(M, N, device="cuda", dtype=torch.bfloat16))
            with torch.no_grad():
                cn.rms_norm(x, w)

        stall = max(stall, _stall(call, x, w))
    assert rmsnorm_fwd.CACHE.count + rmsnorm_bwd.CACHE.count == counts, "a CuTe kernel compiled after warmup"
    assert stall < 0.05, f"a call's first run took {stall:.3f} s more than its repeat after warmup (a compile?)"


def test_residual_and_fp8_on_the_cpu(capsys):
    """residual=True / a dtype and fp8=True run those ops too (the CPU: their torch paths), and say so."""
    recs = cn.warmup([256], dtypes=(torch.float32,), rows=(1, 4), residual=torch.float32, fp8=True, device="cpu")
    assert recs[0]["residual"] and recs[0]["fp8"] and recs[0]["rows"] == [1, 2, 4]
    assert "residual add, fp8" in capsys.readouterr().out
    assert cn.warmup([64], dtypes=(torch.bfloat16,), rows=(2, 2), residual=True, device="cpu",
                     verbose=False)[0]["residual"]
    with pytest.raises(TypeError, match="residual must be"):
        cn.warmup([64], residual="float32", device="cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("N", GPU_WIDTHS)
def test_no_residual_or_fp8_call_stalls_after_warmup(N):
    """The residual add (Triton's fused forward up to 32768 columns, cuTile's split forward past it) and
    the FP8 output, after warmup(residual=True, fp8=True): no call's first run over the range stalls."""
    cn.warmup([N], rows=(1, 32768), residual=True, fp8=True, verbose=False)
    w = (1 + 0.1 * torch.randn(N, device="cuda")).to(torch.bfloat16).requires_grad_()
    stall = 0.0
    for M in (1, 3, 64, 100, 1000, 4097, 32768):
        x = torch.randn(M, N, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        r = torch.randn(M, N, device="cuda", dtype=torch.bfloat16, requires_grad=True)

        def call():
            y, h = cn.rms_norm(x, w, residual=r)
            torch.autograd.backward((y, h), (torch.ones_like(y), torch.ones_like(h)))
            with torch.no_grad():
                cn.rms_norm(x, w, residual=r)
                if N <= FP8_KERNEL_MAX_N:  # (wider rows: torch ops, nothing to compile)
                    cn.rms_norm_fp8(x, w)
                    cn.rms_norm_fp8(x, w, group_size=128)

        stall = max(stall, _stall(call, x, r, w))
    assert stall < 0.05, f"a call's first run took {stall:.3f} s more than its repeat after warmup (a compile?)"
