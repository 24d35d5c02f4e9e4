"""Compile checks (CPU only, no GPU) of the Triton forward (rms_norm_fwd_kernel, and rms_norm_fwd_fixed_kernel
where the rule compiles N in), built for sm_90 and sm_100 by `triton.compile`: they move x and y in 16-byte vectors
where N is 8 (mod 16), as where it is a multiple of 16 (the ALIGN hint, tiling.offset_align, or N itself), whole
rows in registers, rows in two passes and split rows alike, and where N is compiled in at a row stride of N + 8.

The compiles run in one child process without TRITON_INTERPRET (tests/triton/_util.py).
"""
from __future__ import annotations

import pytest

from tests.triton._util import compile_in_child

CHILD = r"""
import json, re, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from cutile_norms.triton.rmsnorm_fwd_config import analytic_config
from cutile_norms.triton.rmsnorm_fwd_kernel import rms_norm_fwd_fixed_kernel as F, rms_norm_fwd_kernel as R
from cutile_norms.triton.tiling import offset_align

out = {}
for N, arch, stride in json.loads(sys.argv[1]):
    cfg = analytic_config(N, 2, "nvidia", 132)
    if cfg.fixed_n:  # two passes with N compiled in (rms_norm_fwd_fixed_kernel)
        K = F
        sig = {"X": "*bf16", "W": "*bf16", "Y": "*bf16", "RSTD": "*fp32", "stride_x": "i32", "eps": "fp32",
               "offset": "fp32"}
        consts = dict(N=N, BLOCK_N=cfg.block_n, HAS_W=True, HAS_OFFSET=False, STORE_RSTD=True,
                      CONTIG=stride == N, INT64=False, ALIGN=offset_align(stride))
        ints = ["stride_x"] if stride % 16 == 0 else []
    else:
        K = R
        sig = {"X": "*bf16", "W": "*bf16", "Y": "*bf16", "RSTD": "*fp32", "SLOTS": "*i64", "M": "i32",
               "stride_x": "i32", "eps": "fp32", "offset": "fp32", "N": "i32", "PART": "i32"}
        consts = dict(BLOCK_N=cfg.block_n, CHUNKS=cfg.chunks, ROWS=cfg.rows, SPLIT=cfg.split, HAS_W=True,
                      HAS_OFFSET=False, STORE_RSTD=True, PREFETCH=cfg.prefetch and cfg.chunks == 1,
                      ONE_TILE=cfg.programs_per_sm == 0 and (cfg.split > 1 or cfg.one_tile), PHASE=0, INT64=False,
                      ALIGN=offset_align(stride, N, cfg.part))
        ints = [k for k in ("stride_x", "N", "PART") if N % 16 == 0]
    sig.update({k: "constexpr" for k in consts})
    # what the JIT specialises at a launch: 16-byte aligned pointers, and the integer arguments
    # divisible by 16 where they are
    attrs = {(K.arg_names.index(k),): [["tt.divisibility", 16]] for k in ["X", "W", "Y", "RSTD"] + ints}
    if K is R:
        attrs[(K.arg_names.index("SLOTS"),)] = [["tt.divisibility", 16]]
    src = ASTSource(fn=K, signature=sig, constexprs={(K.arg_names.index(k),): v for k, v in consts.items()},
                    attrs=attrs)
    ptx = triton.compile(src, target=GPUTarget("cuda", arch, 32),
                         options={"num_warps": cfg.num_warps, "num_stages": cfg.num_stages}).asm["ptx"]
    out[f"{N}-{arch}-{stride}"] = dict(fixed=cfg.fixed_n, chunks=cfg.chunks,
                       v4_loads=len(re.findall(r"ld\.global(\.[A-Za-z0-9_:]+)*\.v4", ptx)),
                       b16=len(re.findall(r"(ld|st)\.global(\.[A-Za-z0-9_:]+)*\.b16", ptx)),
                       v4_stores=len(re.findall(r"st\.global(\.[A-Za-z0-9_:]+)*\.v4", ptx)))
print("RESULT " + json.dumps(out))
"""

# N = 8 (mod 16) beside the multiple of 16 below it: whole rows (744), rows in two passes with N compiled in
# (1128, 9880, 20488), split rows (34808: the widths the H200 measured at 0.23-0.25 x copy in the `triton` mode);
# the rows at a stride of N + 8 too where N is compiled in (the stride then a runtime multiple of 8)
PAIRS = [(744, 736), (1128, 1120), (9880, 9872), (20488, 20480), (34808, 34800)]
STRIDED = (1128, 9880, 20488)


def _cases():
    return [(n, arch, stride) for pair in PAIRS for n in pair for arch in (90, 100)
            for stride in ((n, n + 8) if n in STRIDED else (n,))]


@pytest.fixture(scope="module")
def compiled():
    return compile_in_child(CHILD, _cases())


@pytest.mark.parametrize("arch", [90, 100])
@pytest.mark.parametrize("N,ref", PAIRS)
def test_rows_of_8_mod_16_move_in_16_byte_vectors(compiled, N, ref, arch):
    r, base = compiled[f"{N}-{arch}-{N}"], compiled[f"{ref}-{arch}-{ref}"]
    assert r["fixed"] == (N in STRIDED)  # the kernel each pair is meant to check
    assert r["b16"] == 0 and r["v4_loads"] >= max(1, base["v4_loads"] - 1), (r, base)
    assert r["v4_stores"] >= max(1, base["v4_stores"] - 1), (r, base)
    if N in STRIDED:  # x's rows N + 8 apart (ALIGN 8): the same vectors
        s = compiled[f"{N}-{arch}-{N + 8}"]
        assert s["b16"] == 0 and s["v4_loads"] >= r["v4_loads"] and s["v4_stores"] >= r["v4_stores"], (s, r)
