"""Compile checks (CPU only, no GPU) of the Triton forward (rms_norm_fwd_kernel), built for sm_90 and sm_100 by
`triton.compile` (sm_100 too): it moves x and y in 16-byte vectors where N is 8 (mod 16), as where it is a multiple
of 16 (its ALIGN hint, tiling.offset_align), whole rows in registers and rows in chunks alike.

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
from cutile_norms.triton.rmsnorm_fwd_kernel import rms_norm_fwd_kernel as K
from cutile_norms.triton.tiling import offset_align

out = {}
for N, arch in json.loads(sys.argv[1]):
    cfg = analytic_config(N, 2, "nvidia", 132)
    sig = {"X": "*bf16", "W": "*bf16", "Y": "*bf16", "RSTD": "*fp32", "SLOTS": "*i64", "M": "i32",
           "stride_x": "i32", "eps": "fp32", "offset": "fp32", "N": "i32", "PART": "i32"}
    consts = dict(BLOCK_N=cfg.block_n, CHUNKS=cfg.chunks, ROWS=cfg.rows, SPLIT=cfg.split, HAS_W=True,
                  HAS_OFFSET=False, STORE_RSTD=True, PREFETCH=cfg.prefetch and cfg.chunks == 1,
                  ONE_TILE=cfg.programs_per_sm == 0 and (cfg.split > 1 or cfg.one_tile), PHASE=0, INT64=False,
                  ALIGN=offset_align(N, N, cfg.part))
    sig.update({k: "constexpr" for k in consts})
    # what the JIT specialises at a launch on contiguous rows: 16-byte aligned pointers, and the integer
    # arguments divisible by 16 where they are
    ints = [k for k in ("stride_x", "N", "PART") if N % 16 == 0]
    attrs = {(K.arg_names.index(k),): [["tt.divisibility", 16]] for k in ["X", "W", "Y", "RSTD", "SLOTS"] + ints}
    src = ASTSource(fn=K, signature=sig, constexprs={(K.arg_names.index(k),): v for k, v in consts.items()},
                    attrs=attrs)
    ptx = triton.compile(src, target=GPUTarget("cuda", arch, 32),
                         options={"num_warps": cfg.num_warps, "num_stages": cfg.num_stages}).asm["ptx"]
    out[f"{N}-{arch}"] = dict(chunks=cfg.chunks, v4_loads=len(re.findall(r"ld\.global(\.[a-z]+)*\.v4", ptx)),
                       b16=len(re.findall(r"(ld|st)\.global(\.[a-z]+)*\.b16", ptx)),
                       v4_stores=len(re.findall(r"st\.global(\.[a-z]+)*\.v4", ptx)))
print("RESULT " + json.dumps(out))
"""

# N = 8 (mod 16) beside the multiple of 16 below it: whole rows (1128), rows in chunks (9880, 34808: the
# widths the H200 measured at 0.23-0.25 x copy in the `triton` mode)
PAIRS = [(1128, 1120), (9880, 9872), (34808, 34800)]


@pytest.fixture(scope="module")
def compiled():
    return compile_in_child(CHILD, [(n, arch) for pair in PAIRS for n in pair for arch in (90, 100)])


@pytest.mark.parametrize("arch", [90, 100])
@pytest.mark.parametrize("N,ref", PAIRS)
def test_rows_of_8_mod_16_move_in_16_byte_vectors(compiled, N, ref, arch):
    r, base = compiled[f"{N}-{arch}"], compiled[f"{ref}-{arch}"]
    assert r["b16"] == 0 and r["v4_loads"] >= max(1, base["v4_loads"] - 1), (r, base)
    assert r["v4_stores"] >= max(1, base["v4_stores"] - 1), (r, base)
