"""The FP8-output RMSNorm kernel (cutile_norms/triton/rmsnorm_fp8*.py), called directly, against the
reference quantizer (reference.fp8_scale, reference.fp8_quantize) applied to y computed from the
kernel's own rstd in the kernel's op order: the scales bit for bit everywhere, q bit for bit on the GPU.

Under Triton's interpreter (the CPU CI) an fp32 -> fp8 conversion is not the GPU's (measured: NaN
becomes 384 in e4m3, and values land up to 8 fp8 steps away), so q is checked on the GPU only; the
interpreter checks everything else (h, rstd, the scales, the shapes). Compiled for sm_90 and sm_100 in
a child process: the PTX must round and saturate in one cvt (cvt.rn.satfinite to e4m3 / e5m2) and
compute the scale and its reciprocal with IEEE division (div.rn), once per scale, not per element.
"""
from __future__ import annotations

import pytest
import torch

from tests.conftest import fp8_reference, random_rows, random_weight, same_bits_or_both_nan
from tests.triton._util import DEVICES, case_id, compile_fixture, compiled_case


@pytest.fixture
def kernel():
    from cutile_norms.triton.rmsnorm_fp8 import rms_norm_fp8
    return rms_norm_fp8


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("out_dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=str)
@pytest.mark.parametrize("kind", ["token", "group", "group_ue8m0", "static", "static_saturating", "token_ub",
                                  "residual"])
@pytest.mark.parametrize("N", [256, 1024, 2560, 5120, 13312])  # 2560, 5120, 13312: blocks padded past 1/8
def test_matches_the_reference_quantizer(kernel, seed, device, out_dtype, kind, N):
    check_against_the_reference(kernel, seed, device, out_dtype, kind, N)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["token", "static", "residual"])
@pytest.mark.parametrize("N", [1160, 2056])
def test_rows_of_8_mod_16_at_a_stride_of_4(kernel, seed, device, kind, N):
    """Rows of N = 8 (mod 16), x's rows N + 4 apart: the kernel's ALIGN hint (4, from the stride) where
    Triton infers none."""
    check_against_the_reference(kernel, seed, device, torch.float8_e4m3fn, kind, N, pad=4)


def check_against_the_reference(kernel, seed, device, out_dtype, kind, N, pad=0):
    x = random_rows((7, N + pad), torch.bfloat16, device)[:, :N]
    x[1] = 0.0
    x[2, 5] = float("inf")
    x[3, 6] = float("nan")
    w = random_weight(N, torch.bfloat16, device)
    r = random_rows((7, N), torch.bfloat16, device) if kind == "residual" else None
    # static_saturating: |y| / s past both formats' largest values, saturated to them
    scale = torch.tensor([{"static": 0.01, "static_saturating": 1e-5}[kind]], device=device) if kind.startswith(
        "static") else None
    ub = 2.0 if kind == "token_ub" else None
    group = 128 if kind.startswith("group") else None
    q, s, h, rstd = kernel(x, r, w, 1e-6, 0.0, out_dtype, torch.bfloat16 if r is not None else None, scale, ub, group,
                           kind == "group_ue8m0")
    src = x
    if r is not None:
        # x holds a NaN (NaN where the reference has one); cpu: the interpreter's bf16 truncates (one ulp)
        h_ref = (x.float() + r.float()).to(torch.bfloat16).float()
        if device == "cpu":
            fin = torch.isfinite(h_ref)
            assert torch.equal(torch.isfinite(h.float()), fin) and torch.equal(torch.isnan(h.float()), torch.isnan(h_ref))
            assert ((h.float() - h_ref).abs()[fin] <= h_ref.abs()[fin] * 2 ** -7).all(), "h off by more than one ulp"
        else:
            assert same_bits_or_both_nan(h.float(), h_ref)
        src = h
    # rstd against fp64 on the finite rows (row 1 all zeros: 1 / sqrt(eps)); y below is built from it
    finite = torch.isfinite(src.float()).all(dim=-1)
    rstd64 = torch.rsqrt(src.double().square().mean(dim=-1) + 1e-6)
    assert torch.allclose(rstd.double()[finite], rstd64[finite], rtol=1e-5, atol=0), f"{kind} N={N}: rstd"
    y = (src.float() * rstd[:, None]) * w.float()  # the kernel's op order (offset 0: w as it is), from its rstd
    s_ref, q_ref = fp8_reference(y, out_dtype, scale, group, ub, kind == "group_ue8m0")
    what = f"{kind} {out_dtype} N={N} [seed {seed}]"
    assert s.shape == s_ref.shape and same_bits_or_both_nan(s, s_ref), f"{what}: scales"
    if scale is None:  # inf in a row: rstd 0, y NaN at the inf, 0 elsewhere; NaN in a row: rstd and y all NaN
        assert torch.isnan(s[3]).all() and torch.isnan(s[2]).any(), f"{what}: NaN scales where y has NaN"
        if group:
            assert torch.isnan(s[2]).sum() == 1, f"{what}: only the inf's group has a NaN scale"
    if device == "cuda":
        assert same_bits_or_both_nan(q.float(), q_ref.float()), f"{what}: q differs from the reference quantizer"


CHILD = r"""
import json, re, sys, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from cutile_norms.triton.rmsnorm_fp8_config import launch_config
from cutile_norms.triton.rmsnorm_fp8_kernel import rms_norm_fp8_kernel
from cutile_norms.triton.tiling import offset_align
out = {}
for N, fp8, group, arch in json.loads(sys.argv[1]):
    key = f"{N}-{fp8}-{group}-{arch}"
    try:
        K = rms_norm_fp8_kernel
        block, rows, warps = launch_config(N, group or None)
        sig = {"X": "*bf16", "R": "*bf16", "W": "*bf16", "Q": f"*{fp8}", "H": "*bf16", "S": "*fp32", "SCALE": "*fp32",
               "RSTD": "*fp32", "M": "i32", "stride_x": "i32", "stride_r": "i32", "eps": "fp32", "offset": "fp32",
               "scale_ub": "fp32", "N": "i32"}
        consts = dict(BLOCK_N=block, ROWS=rows, GROUP=group, STATIC=False, HAS_R=True, HAS_W=True, HAS_UB=True,
                      UE8M0=group > 0, TOP=448.0 if fp8 == "fp8e4nv" else 57344.0, MIN_AMAX=1e-12, INT64=False,
                      ALIGN=offset_align(N))
        # what the JIT specialises at a launch (row strides N): 16-byte aligned pointers, and the integer
        # arguments divisible by 16 where they are
        ints = ["stride_x", "stride_r", "N"] if N % 16 == 0 else []
        attrs = {(K.arg_names.index(k),): [["tt.divisibility", 16]] for k in sig if sig[k][0] == "*" or k in ints}
        sig.update({k: "constexpr" for k in consts})
        src = ASTSource(fn=K, signature=sig, constexprs={(K.arg_names.index(k),): v for k, v in consts.items()},
                        attrs=attrs)
        c = triton.compile(src, target=GPUTarget("cuda", arch, 32), options={"num_warps": warps})
        ptx = c.asm["ptx"]
        cvt = "cvt.rn.satfinite.e4m3x2.f32" if fp8 == "fp8e4nv" else "cvt.rn.satfinite.e5m2x2.f32"
        out[key] = dict(cubin=len(c.asm["cubin"]), target=f".target sm_{arch}" in ptx, cvt=cvt in ptx,
                        divs=ptx.count("div.rn.f32"), rows=rows, max_nan=ptx.count("max.NaN.f32"),
                        mins=ptx.count("min.f32"), b16=len(re.findall(r"(ld|st)\.global(\.[A-Za-z0-9_:]+)*\.b16", ptx)))
    except Exception as exc:
        out[key] = dict(error=f"{type(exc).__name__}: {exc}"[:500])
print("RESULT " + json.dumps(out))
"""
# 1160 and 2056: rows of N = 8 (mod 16), their row offsets and column bounds said to be multiples of 8
# (tiling.offset_align), or 2-byte loads of x and r and stores of h (per-token and static scales only:
# groups of 128 need N a multiple of 128)
COMPILE_CASES = [(N, f, g, a) for N in (256, 1160, 2056, 4096, 5120, 12288, 13312, 16384) for f in ("fp8e4nv", "fp8e5")
                 for g in ((0, 128) if N % 128 == 0 else (0,)) for a in (90, 100)]


compiled = compile_fixture(CHILD, COMPILE_CASES)


@pytest.mark.parametrize("case", COMPILE_CASES, ids=case_id)
def test_compiles_for_sm90_and_sm100(compiled, case):
    r = compiled_case(compiled, case)
    assert r["cvt"], "q is not rounded and saturated by one cvt.rn.satfinite"
    # IEEE division for the scale and its reciprocal, once per scale: two for each row of the tile a
    # thread touches (a row's scale is held by each of its threads), two for each group; never one
    # per element (32 values a thread)
    assert r["divs"] >= 2, "the scale or its reciprocal is not an IEEE division (div.rn)"
    if case[2] == 0:
        assert r["divs"] <= 2 * r["rows"], f"{r['divs']} div.rn for {r['rows']} rows: a division per element?"
    # the amax by max.NaN (NaN carried, no count of NaN), and no clamp per element (the conversion
    # saturates; min.f32 only for the upper bound, once per scale)
    assert r["max_nan"] > 0, "the amax is not a NaN-propagating max (max.NaN.f32)"
    assert r["mins"] <= r["divs"], f"{r['mins']} min.f32 against {r['divs']} scales: a clamp per element?"
    if case[0] >= 1024:  # (narrower blocks hold fewer weights than threads: single-element weight loads)
        assert r["b16"] == 0, f"{r['b16']} 2-byte global loads or stores: rows not moved in vectors"


def test_every_width_is_one_block_in_registers():
    """Every row the kernel takes (up to fp8.FP8_KERNEL_MAX_N columns, any group size that divides it)
    is one power-of-two block of whole groups, at 32 or 64 values per thread."""
    from cutile_norms.fp8 import FP8_KERNEL_MAX_N
    from cutile_norms.triton.rmsnorm_fp8_config import launch_config

    for group in (None, 128):
        for N in range(group or 1, FP8_KERNEL_MAX_N + 1, group or 1):
            block, rows, warps = launch_config(N, group)
            assert block >= N and block & (block - 1) == 0 and block % (group or 1) == 0, (N, group, block)
            assert block * rows // (32 * warps) in (32, 64) or block * rows < 32 * 32, (N, group, block, rows, warps)
