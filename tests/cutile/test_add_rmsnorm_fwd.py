"""The fused residual add + RMSNorm split forward in cuTile (cutile_norms/cutile/add_rmsnorm_fwd*.py).

CPU: the launch rule, and the kernel compiled for sm_90 and sm_100 (ptxas at sm_90: within the
occupancy hint's registers, no spills but a few bytes with an fp32 weight). GPU (`gpu`): called directly with outputs poisoned with NaN; h against
the fp32 sum rounded once (bit for bit), y and rstd against the fp64 norm of h as stored; dtype pairs,
weight None, offset, strided rows, in place, and rows past 2^32 elements (`big`).
"""
from __future__ import annotations

import pytest
import torch

from cutile_norms.cutile import add_rmsnorm_fwd_config as cfg
from tests.conftest import assert_close, assert_stored_sum, poisoned, random_rows, random_weight, reference64

ct = pytest.importorskip("cuda.tile")


@pytest.fixture
def kernel():
    from cutile_norms.cutile import add_rmsnorm_fwd
    return add_rmsnorm_fwd


@pytest.mark.parametrize("N", [32, 20000, 33416, 65536, 149992, 262144, 600000])
@pytest.mark.parametrize("h_bytes", [2, 4])
def test_split_rule(N, h_bytes):
    """The fewest power-of-two parts of at most 16 KiB of the widest operand (64 at most), each one
    padded piece, every block with columns of its own row and all of them covered; the launch sizes
    them by the widest of x, r and h."""
    from cutile_norms.cutile.rmsnorm_fwd_config import row_pieces

    split, part, piece = cfg.split_config(N, h_bytes)
    assert split & (split - 1) == 0 and 2 <= split <= cfg.MAX_SPLIT
    assert part % 16 == 0 and split * part >= N > (split - 1) * part - 16
    assert part * h_bytes <= cfg.PART_BYTES or split == cfg.MAX_SPLIT
    assert split == 2 or (split // 2) * cfg.PART_BYTES // h_bytes < N  # no fewer parts would do
    assert row_pieces(part, piece) == ((0, piece),) and piece >= part
    widest = cfg.constants(N, N, N, 2, h_bytes, 2, True, True)  # an fp32 residual under 16-bit x and h
    assert widest[1:4] == (split, part, piece)


COMPILE = [(N, x, r, h, w) for N in (20000, 33416, 131072)
           for x, r, h, w in (("bfloat16",) * 4, ("float16", "float16", "float16", "float32"),
                              ("bfloat16", "float32", "float32", "bfloat16"),
                              ("bfloat16", "float32", "bfloat16", "bfloat16"))]  # an fp32 residual, 16-bit h


@pytest.mark.parametrize("arch", ["sm_90", "sm_100"])
@pytest.mark.parametrize("N,x,r,h,w", COMPILE)
def test_compiles_without_spills(kernel, N, x, r, h, w, arch):
    import io

    from cuda.tile.compilation import export_kernel

    from tests.cutile.compile_util import ptxas_report

    dt = {"float16": ct.float16, "bfloat16": ct.bfloat16, "float32": ct.float32}
    k, sig = kernel.export_signature(N, dt[x], dt[r], dt[h], dt[w])
    buf = io.BytesIO()
    export_kernel(k, [sig], buf, gpu_code=arch, output_format="cubin")
    cubin = buf.getvalue()
    assert cubin[:4] == b"\x7fELF"
    if arch == "sm_90":
        report = ptxas_report(cubin)
        # an fp32 weight's piece doubles its registers: 4-20 bytes per thread at these widths (sm_90 ptxas)
        assert report["spill_stores"] <= (32 if w == "float32" else 0), report
        assert report["registers"] * report["threads"][0] * cfg.OCCUPANCY <= 65536, report


def test_polls_inside_its_wait_loop(kernel):
    """sm_90 PTX: the relaxed gpu-scope poll of the row's slots sits inside a loop after the exchange
    that publishes the block's partial sum (a poll hoisted out of the loop spins forever). h and y are
    stored as 16-byte vectors; the compiler places h's stores after the exchange, beside y's."""
    import io
    import re

    from cuda.tile.compilation import export_kernel

    from tests.cutile.compile_util import embedded_ptx

    k, sig = kernel.export_signature(33416, ct.bfloat16, ct.bfloat16, ct.bfloat16, ct.bfloat16)
    buf = io.BytesIO()
    export_kernel(k, [sig], buf, gpu_code="sm_90", output_format="cubin")
    ptx = embedded_ptx(buf.getvalue())
    after = ptx.split("atom.global.exch.b32", 1)[1]
    assert after.count("st.global.v4") >= 2, "h and y not stored as 16-byte vectors"
    load = after.index("ld.relaxed.gpu.global")
    loop_labels = re.findall(r"^(\$L__BB\d+_\d+):", after[:load], re.M)
    assert loop_labels, "no loop header before the poll"
    assert re.search(r"bra\s+" + re.escape(loop_labels[-1]) + ";", after[load:]), "the poll is not inside a loop"


def run_and_check(kernel, s, M, N, x_dtype, r_dtype, h_dtype, w_dtype, offset, in_place=False, stride_pad=0):
    x = random_rows((M, N + stride_pad), x_dtype, "cuda")[:, :N]
    r = random_rows((M, N), r_dtype, "cuda")
    w = random_weight(N, w_dtype, "cuda") if w_dtype else None
    if in_place:
        xi, ri = x.clone(), r.clone()
        y, h, rstd = kernel.add_rms_norm_fwd(xi, ri, w, 1e-6, offset, h_dtype, True, out=(xi, ri))
        assert y.data_ptr() == xi.data_ptr() and h.data_ptr() == ri.data_ptr()
    else:
        out = (poisoned(torch.empty(M, N, dtype=x_dtype, device="cuda")),
               poisoned(torch.empty(M, N, dtype=h_dtype, device="cuda")))
        y, h, rstd = kernel.add_rms_norm_fwd(x, r, w, 1e-6, offset, h_dtype, True, out=out)
    what = f"M={M} N={N} x={x_dtype} r={r_dtype} h={h_dtype} w={w_dtype} offset={offset} in_place={in_place}"
    assert_stored_sum(h, x, r, what, s)
    ey, er = reference64(h, w, 1e-6, offset)  # y normalizes h as stored
    assert y.dtype == x_dtype
    assert_close(y, ey, x_dtype, f"{what} y", s)
    assert_close(rstd, er, torch.float32, f"{what} rstd", s)


@pytest.mark.gpu
@pytest.mark.parametrize("M,N", [(1, 16384 + 16), (3, 20000), (7, 33416), (5, 65536), (2, 149992), (1, 600000),
                                 (5, cfg.MIN_N), (9, 1000), (33, 2048), (4, 4104), (300, 8192)])  # (a cuTile mode named)
def test_matches_reference(kernel, seed, M, N):
    run_and_check(kernel, seed, M, N, torch.bfloat16, torch.bfloat16, torch.bfloat16, torch.bfloat16, 0.0)


@pytest.mark.gpu
@pytest.mark.parametrize("x_dtype,r_dtype,h_dtype,w_dtype", [
    (torch.bfloat16, torch.float32, torch.float32, torch.float32), (torch.float16, torch.float16, torch.float16, None),
    (torch.float16, torch.float32, torch.float16, torch.float16), (torch.float32, torch.float32, torch.float32, torch.float32),
    (torch.bfloat16, torch.bfloat16, torch.float32, torch.bfloat16)])
@pytest.mark.parametrize("N", [18440, 83352])
def test_dtype_pairs(kernel, seed, x_dtype, r_dtype, h_dtype, w_dtype, N):
    run_and_check(kernel, seed, 5, N, x_dtype, r_dtype, h_dtype, w_dtype, 1.0 if w_dtype else 0.0)


@pytest.mark.gpu
@pytest.mark.parametrize("N", [16392, 40960, 131080])
def test_in_place_strided_rows_and_repeated_launches(kernel, seed, N):
    """In place (y into x, h into r), x rows 8 elements apart beyond N, and launches back to back
    (every launch flips the slots' sign: a stale slot would pass the wait with another launch's sum)."""
    for _ in range(3):
        run_and_check(kernel, seed, 9, N, torch.bfloat16, torch.bfloat16, torch.bfloat16, torch.bfloat16, 0.0,
                      in_place=True)
        run_and_check(kernel, seed, 9, N, torch.float16, torch.float16, torch.float16, torch.float16, 0.0,
                      stride_pad=8)


@pytest.mark.gpu
@pytest.mark.big
def test_rows_past_2_32_elements(kernel, seed):
    """[16400, 262144] bf16 (2^32 + 2^22 elements): the launch is cut into row chunks under int32
    indexing; rows at the start, the middle and the end checked."""
    M, N = 16400, 262144
    x = torch.randn(M, N, dtype=torch.bfloat16, device="cuda")
    r = torch.randn(M, N, dtype=torch.bfloat16, device="cuda")
    w = random_weight(N, torch.bfloat16, "cuda")
    y, h, rstd = kernel.add_rms_norm_fwd(x, r, w, 1e-6, 0.0, torch.bfloat16, True)
    for rows in (slice(0, 3), slice(M // 2 - 1, M // 2 + 2), slice(M - 3, M)):
        what = f"rows {rows.start}..{rows.stop} of [{M}, {N}]"
        assert_stored_sum(h[rows], x[rows], r[rows], what, seed)
        ey, er = reference64(h[rows], w, 1e-6, 0.0)
        assert_close(y[rows], ey, torch.bfloat16, f"{what} y", seed)
        assert_close(rstd[rows], er, torch.float32, f"{what} rstd", seed)
