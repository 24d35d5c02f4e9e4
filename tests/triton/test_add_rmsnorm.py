"""The fused residual add + RMSNorm kernels in Triton (cutile_norms/triton/add_rmsnorm_*.py). The
forward called directly: outputs poisoned with NaN first, h against the fp32 sum rounded once, y
against the fp64 norm of h as stored, rstd against fp64; in place (y into x, h into r). The backward
called directly against the fp64 closed form; both through the API on the GPU (tests/test_residual.py's
fused cases and the residual fuzz). Both compiled for sm_90 and sm_100 in a child process without the
interpreter.

Under Triton's interpreter (the CPU CI) an fp32 -> bf16 conversion truncates instead of rounding to
nearest (measured: 2023 of 4096 values one ulp below torch's), so bf16 h is checked within one ulp
there and bit for bit on the GPU.
"""
from __future__ import annotations

import pytest
import torch

from tests.conftest import (assert_close, assert_grad_close, assert_stored_sum, poison_next_allocations, poisoned,
                            random_rows, random_weight, reference64, reference_bwd64)
from tests.triton._util import DEVICES, Launches, case_id, compile_fixture, compiled_case


@pytest.fixture
def kernel():
    from cutile_norms.triton import add_rmsnorm_fwd
    return add_rmsnorm_fwd


def run_and_check(kernel, s, device, M, N, x_dtype, r_dtype, h_dtype, w_dtype, offset, in_place=False, stride_pad=0):
    x = random_rows((M, N + stride_pad), x_dtype, device)[:, :N]
    r = random_rows((M, N), r_dtype, device)
    w = random_weight(N, w_dtype, device) if w_dtype else None
    if in_place:
        xi, ri = x.clone(), r.clone()
        y, h, rstd = kernel.add_rms_norm_fwd(xi, ri, w, 1e-6, offset, h_dtype, True, out=(xi, ri))
        assert y.data_ptr() == xi.data_ptr() and h.data_ptr() == ri.data_ptr()
    else:
        out = (poisoned(torch.empty(M, N, dtype=x_dtype, device=device)),
               poisoned(torch.empty(M, N, dtype=h_dtype, device=device)))
        y, h, rstd = kernel.add_rms_norm_fwd(x, r, w, 1e-6, offset, h_dtype, True, out=out)
    what = f"M={M} N={N} x={x_dtype} r={r_dtype} h={h_dtype} w={w_dtype} offset={offset} in_place={in_place}"
    assert_stored_sum(h, x, r, what, s, interpreted_kernel=device == "cpu")
    ey, er = reference64(h, w, 1e-6, offset)  # y normalizes h as stored
    assert y.dtype == x_dtype
    assert_close(y, ey, x_dtype, f"{what} y", s)
    assert_close(rstd, er, torch.float32, f"{what} rstd", s)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("M,N", [(1, 1), (7, 64), (33, 1000), (3, 8192), (2, 8200), (2, 20000), (2, 40000)])
def test_matches_reference(kernel, seed, device, M, N):
    run_and_check(kernel, seed, device, M, N, torch.bfloat16, torch.bfloat16, torch.bfloat16, torch.bfloat16, 0.0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("x_dtype,r_dtype,h_dtype,w_dtype", [
    (torch.bfloat16, torch.float32, torch.float32, torch.float32), (torch.float16, torch.float16, torch.float16, None),
    (torch.float16, torch.float32, torch.float16, torch.float16), (torch.float32, torch.float32, torch.float32, torch.float32),
    (torch.bfloat16, torch.bfloat16, torch.float32, torch.bfloat16)])
@pytest.mark.parametrize("N", [768, 12000])
def test_dtype_pairs(kernel, seed, device, x_dtype, r_dtype, h_dtype, w_dtype, N):
    run_and_check(kernel, seed, device, 5, N, x_dtype, r_dtype, h_dtype, w_dtype, 1.0 if w_dtype else 0.0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("N", [96, 5000, 16384 + 8, 32768 + 8])
def test_in_place_and_strided_rows(kernel, seed, device, N):
    """In place (y into x, h into r), and x's rows N + 4 apart: a stride whose alignment (4 elements) is
    below N's where N = 8 (mod 16), so a launch that left the stride out of ALIGN would claim 8. Past
    32768 columns the kernel's two passes over chunks (which the API does not send it)."""
    run_and_check(kernel, seed, device, 9, N, torch.bfloat16, torch.bfloat16, torch.bfloat16, torch.bfloat16, 0.0,
                  in_place=True)
    run_and_check(kernel, seed, device, 9, N, torch.float16, torch.float16, torch.float16, torch.float16, 0.0,
                  stride_pad=4)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("N", [64, 1000, 2560, 8192])
@pytest.mark.parametrize("h_dtype,with_dh,with_w", [(torch.float32, True, True), (torch.float32, False, True),
                                                    (torch.float32, True, False), (torch.bfloat16, True, True)])
def test_backward_matches_reference(seed, device, N, h_dtype, with_dh, with_w):
    """The fused backward called directly: the grad into h against the fp64 closed form of the norm's
    backward at h plus dh, dw against its fp64 sum over the rows (a grid of fewer programs than row
    tiles, so programs loop and dw sums several programs' partials). Under the interpreter bf16 rounds
    by truncation, within bf16's tolerance."""
    from cutile_norms.triton.add_rmsnorm_bwd import add_rms_norm_bwd

    M = 37
    h = random_rows((M, N), h_dtype, device)
    w = random_weight(N, torch.bfloat16, device) if with_w else None
    dy = random_rows((M, N + 4), h_dtype, device)[:, :N]  # rows N + 4 apart: ALIGN from dy's stride
    dh = random_rows((M, N), h_dtype, device) if with_dh else None
    rstd = reference64(h, w, 1e-6, 0.0)[1].float()
    poison_next_allocations([M * N * h_dtype.itemsize] + ([N * w.element_size()] if with_w else []), device)
    g, dw = add_rms_norm_bwd(dy, dh, h, w, rstd, 0.0, True, 3, h_dtype)
    eg, ew, sg, sw = reference_bwd64(h, w, dy, 1e-6, 0.0)
    what = f"N={N} h={h_dtype} dh={with_dh} w={with_w}"
    assert g.dtype == h_dtype
    assert_grad_close(g, eg + (dh.double() if dh is not None else 0),
                      sg + (dh.double().abs() if dh is not None else 0), h_dtype, f"{what} grad into h", seed)
    if with_w:
        assert dw.dtype == w.dtype
        assert_grad_close(dw, ew, sw, w.dtype, f"{what} dw", seed)
    else:
        assert dw is None


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("N", [544, 896, 1088, 1152, 6144, 7168])
@pytest.mark.parametrize("dtype,w_dtype", [(torch.bfloat16, torch.bfloat16), (torch.float16, torch.float32),
                                           (torch.bfloat16, None)])
def test_backward_by_tma_with_dh(seed, device, N, dtype, w_dtype, monkeypatch):
    """The fused backward on an H200 (its rule given as the device; the interpreter or any sm_90+ GPU) at rows
    its dh bands take: Triton's TMA rows kernel reading dh (one 1024-column block of 16 rows at 544 / 896,
    a 2048-column block of 8 at 1088, two pieces at 1152 and 6144, one 8192 box at 7168), counted, against
    the fp64 closed form plus dh: M = 1 and 37 over 4 "SMs" (dw through the reduction), dy's rows strided,
    offset 1, dw wanted or not; rows 16 bytes off 32 up to 1024 columns still by TMA. Then what it leaves to
    the register kernel (add_rmsnorm_bwd_config.tensors_take_tma says no), right too: dh in another dtype, dy
    expanded (row stride 0), and past 1024 columns dh's rows 16 bytes off 32."""
    from cutile_norms._platform import DeviceInfo
    from cutile_norms.triton import add_rmsnorm_bwd, rmsnorm_bwd
    from cutile_norms.triton._common import shared_per_block
    from cutile_norms.triton.add_rmsnorm_bwd_config import tma_rows

    if device == "cuda" and (torch.cuda.get_device_capability() < (9, 0) or shared_per_block(torch.device("cuda"))
                             < 227 * 1024):
        pytest.skip("the H200's dh tiles need TMA (sm_90+) and 227 KiB of shared memory a block")
    h200 = DeviceInfo("nvidia", "NVIDIA H200", (9, 0), 4, 0)
    take = tma_rows(N, 2, h200)
    assert take, N
    name = "rms_norm_bwd_tma_rows2_dh_kernel" if take["tma_pieces"] else "rms_norm_bwd_tma_rows_dh_kernel"
    spy = Launches(getattr(rmsnorm_bwd, name))
    monkeypatch.setattr(rmsnorm_bwd, name, spy)

    def check(M, dh_of, need_dw, launched, what, dy_of=None):
        h = random_rows((M, N), dtype, device)
        w = random_weight(N, w_dtype, device) if w_dtype else None
        dy = dy_of(M) if dy_of else random_rows((M, N + 16), dtype, device)[:, :N]
        dh = dh_of(M)
        rstd = reference64(h, w, 1e-6, 1.0)[1].float()
        before = spy.count
        poisoned(torch.empty(M, N, dtype=dtype, device=device))  # freed: the grad's block on the GPU is this one
        g, dw = add_rmsnorm_bwd.add_rms_norm_bwd(dy, dh, h, w, rstd, 1.0, need_dw, 3, dtype, h200)
        assert spy.count == before + launched, f"{what}: {spy.count - before} TMA launches, expected {launched}"
        eg, ew, sg, sw = reference_bwd64(h, w, dy, 1e-6, 1.0)
        assert g.dtype == dtype and not g.isnan().any(), what
        assert_grad_close(g, eg + dh.double(), sg + dh.double().abs(), dtype, f"{what} grad into h", seed)
        if need_dw and w is not None:
            assert dw.dtype == w.dtype
            assert_grad_close(dw, ew, sw, w.dtype, f"{what} dw", seed)
        else:
            assert dw is None, what

    for M in (1, 37):
        check(M, lambda m: random_rows((m, N), dtype, device), True, 1, f"TMA N={N} M={M} {dtype}/{w_dtype}")
    check(37, lambda m: random_rows((m, N), dtype, device), False, 1, f"TMA N={N} dx alone")
    check(37, lambda m: random_rows((m, N), torch.float32, device), True, 0, f"fp32 dh N={N}")
    check(37, lambda m: random_rows((m, N), dtype, device), True, 0, f"dy expanded N={N}",
          dy_of=lambda m: random_rows((1, N), dtype, device).expand(m, N))
    off = lambda m: random_rows((m, N + 16), dtype, device)[:, 8:N + 8]  # noqa: E731
    check(37, off, True, int(N <= 1024), f"dh 16 bytes in, N={N}")


CHILD = r"""
import json, re, sys, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from cutile_norms.triton import add_rmsnorm_bwd_config, add_rmsnorm_bwd_kernel, add_rmsnorm_fwd_config
from cutile_norms.triton import add_rmsnorm_fwd_kernel
from cutile_norms.triton.tiling import offset_align
from tests.cute.ptx_util import ptxas_report
out = {}
for kind, N, x, h, arch in json.loads(sys.argv[1]):
    key = f"{kind}-{N}-{x}-{h}-{arch}"
    try:
        if kind == "fwd":
            K = add_rmsnorm_fwd_kernel.add_rms_norm_fwd_kernel
            block, chunks, rows, warps = add_rmsnorm_fwd_config.config(N)
            sig = {"X": f"*{x}", "R": f"*{x}", "W": f"*{x}", "Y": f"*{x}", "H": f"*{h}", "RSTD": "*fp32", "M": "i32",
                   "stride_x": "i32", "stride_r": "i32", "stride_y": "i32", "stride_h": "i32", "eps": "fp32",
                   "offset": "fp32", "N": "i32"}
            consts = dict(BLOCK_N=block, CHUNKS=chunks, ROWS=rows, HAS_W=True, STORE_RSTD=True, INT64=False,
                          ALIGN=offset_align(N))
        else:
            K = add_rmsnorm_bwd_kernel.add_rms_norm_bwd_kernel
            block, rows, warps = add_rmsnorm_bwd_config.config(N)
            sig = {"DY": f"*{x}", "DH": f"*{h}", "H": f"*{h}", "W": f"*{x}", "RSTD": "*fp32", "G": f"*{h}",
                   "DWP": "*fp32", "M": "i32", "stride_dy": "i32", "stride_dh": "i32", "stride_h": "i32",
                   "offset": "fp32", "N": "i32"}
            consts = dict(BLOCK_N=block, ROWS=rows, HAS_W=True, HAS_DH=True, NEED_DW=True, INT64=False,
                          ALIGN=offset_align(N))
        # what the JIT specialises at a launch (every row stride N here): 16-byte aligned pointers, and the
        # integer arguments divisible by 16 where they are
        ints = [k for k in sig if sig[k] == "i32" and k != "M"] if N % 16 == 0 else []
        attrs = {(K.arg_names.index(k),): [["tt.divisibility", 16]] for k in sig if sig[k][0] == "*" or k in ints}
        sig.update({k: "constexpr" for k in consts})
        src = ASTSource(fn=K, signature=sig, constexprs={(K.arg_names.index(k),): v for k, v in consts.items()},
                        attrs=attrs)
        c = triton.compile(src, target=GPUTarget("cuda", arch, 32), options={"num_warps": warps})
        ptx = c.asm["ptx"]
        out[key] = dict(cubin=len(c.asm["cubin"]), target=f".target sm_{arch}" in ptx,
                        rn=("cvt.rn.bf16.f32" in ptx or "cvt.rn.bf16x2.f32" in ptx) if h == "bf16" else True,
                        float_atomics=bool(re.search(r"(atom|red)[.\w]*\.f(16|32|64)", ptx)),
                        b16=len(re.findall(r"(ld|st)\.global(\.[A-Za-z0-9_:]+)*\.b16", ptx)),
                        **(ptxas_report(ptx, "sm_90a") if arch == 90 and kind == "fwd" else {}))
    except Exception as exc:
        out[key] = dict(error=f"{type(exc).__name__}: {exc}"[:500])
print("RESULT " + json.dumps(out))
"""
# with rows of N = 8 (mod 16) (1160, 9880 and 20488 forward, 1032 and 6152 backward): their row offsets
# and column bounds said to be multiples of 8 (tiling.offset_align), or 2-byte loads and stores
COMPILE_CASES = [(k, N, x, h, a) for k, widths in (("fwd", (128, 1160, 4096, 9880, 16384, 20488, 32768, 65536)),
                                                   ("bwd", (128, 1032, 4096, 6152, 8192)))
                 for N in widths for x, h in (("bf16", "bf16"), ("fp16", "fp32")) for a in (90, 100)]


compiled = compile_fixture(CHILD, COMPILE_CASES)


@pytest.mark.parametrize("case", COMPILE_CASES, ids=case_id)
def test_compiles_for_sm90_and_sm100(compiled, case):
    r = compiled_case(compiled, case)
    assert r["rn"], "h (or its grad) is not rounded to nearest (cvt.rn) on the GPU"
    assert not r["float_atomics"], "dw is summed in a fixed order: no float atomics"
    if case[0] == "fwd" and case[3] == "bf16" and case[4] == 90:  # 16-bit x, r and h: no spills (ptxas)
        assert r["spill_stores"] == 0, r  # (past 16384 columns 1024 threads hold 32 values of x and r each)
    if case[1] >= 1024:  # (at 128 columns over 128 threads the weight is one element a thread: one b16 load)
        assert r["b16"] == 0, f"{r['b16']} 2-byte global loads or stores: rows not moved in vectors"
