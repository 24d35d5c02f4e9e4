"""cutile_norms.warmup: the row counts it visits, its records and its refusals on the CPU; on the GPU,
that after it no call over the warmed range compiles a CuTe kernel or stalls (a compile takes >= 0.1 s;
a call after warm-up well under 50 ms)."""
from __future__ import annotations

import time

import pytest
import torch

import cutile_norms as cn
from cutile_norms.warmup import row_counts


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


def test_one_dtype_and_no_weight(capsys):
    recs = cn.warmup(64, dtypes=torch.float32, rows=(2, 4), weight_dtype=None, device="cpu", verbose=False)
    assert [(r["N"], r["dtype"], r["rows"]) for r in recs] == [(64, "float32", [2, 4])]
    assert capsys.readouterr().out == ""


@pytest.mark.gpu
@pytest.mark.parametrize("N", [4096, 20480])
def test_no_call_compiles_after_warmup(N):
    from cutile_norms.cute import rmsnorm_bwd, rmsnorm_fwd

    cn.warmup([N], rows=(1, 32768), verbose=False)
    counts = rmsnorm_fwd.CACHE.count + rmsnorm_bwd.CACHE.count
    w = (1 + 0.1 * torch.randn(N, device="cuda")).to(torch.bfloat16).requires_grad_()
    slowest = 0.0
    for M in (1, 3, 64, 100, 1000, 4097, 32768):
        x = torch.randn(M, N, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        torch.cuda.synchronize()
        t = time.perf_counter()
        cn.rms_norm(x, w).backward(torch.ones(M, N, device="cuda", dtype=torch.bfloat16))
        with torch.no_grad():
            cn.rms_norm(x, w)
        torch.cuda.synchronize()
        slowest = max(slowest, time.perf_counter() - t)
    assert rmsnorm_fwd.CACHE.count + rmsnorm_bwd.CACHE.count == counts, "a CuTe kernel compiled after warmup"
    assert slowest < 0.05, f"a call took {slowest:.3f} s after warmup (a compile?)"
