"""Compile checks (CPU only, no GPU): the split rows' TMA backward (rms_norm_bwd_tma_kernel) built for
sm_90 and sm_100 by `triton.compile` (Triton's own ptxas) for every config the heuristic gives wide
rows, and the PTX shows what the kernel relies on, which the interpreter cannot run: bulk tensor copies
issued rows ahead by the pipeliner (more copies than the two a row needs), the one-warp poll in
inline assembly with its named barrier, integer atomics only (the exchange: no float atomics).

The compiles run in one child process without TRITON_INTERPRET (under the interpreter, which the CPU
test session turns on, `triton.jit` gives functions that cannot be compiled).
"""
from __future__ import annotations

import pytest

from tests.triton._util import case_id, compile_fixture, compiled_case

ARCHS = [90, 100]
DTYPES = [("bfloat16", "bfloat16"), ("float16", "float32"), ("float32", "float32"), ("bfloat16", None)]
WIDTHS = [16384, 65536, 262144]
# (N, x dtype, weight dtype, need_dw, arch)
CASES = [(N, x, w, True, a) for N in WIDTHS for x, w in DTYPES for a in ARCHS] + \
        [(131072, "bfloat16", "bfloat16", False, a) for a in ARCHS]

CHILD = r"""
import json, re, sys
import torch, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from cutile_norms.triton.rmsnorm_bwd_config import analytic_config
from cutile_norms.triton.rmsnorm_bwd_kernel import rms_norm_bwd_tma_kernel as K

TY = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}
out = {}
for N, x, w, need_dw, arch in json.loads(sys.argv[1]):
    key = f"{N}-{x}-{w}-{need_dw}-{arch}"
    try:
        cfg = analytic_config(N, getattr(torch, x).itemsize, "nvidia", 132)
        inner = min(256, cfg.part)
        desc = f"tensordesc<{TY[x]}[1,{cfg.part // inner},{inner}]>"
        sig = {"XD": desc, "DYD": desc, "W": f"*{TY[w or x]}", "RSTD": "*fp32", "DX": f"*{TY[x]}", "DW": "*fp32",
               "SLOTS": "*i64", "M": "i32", "offset": "fp32", "N": "i32"}
        consts = dict(C=cfg.part // inner, INNER=inner, SPLIT=cfg.split, HAS_W=w is not None, NEED_DW=need_dw,
                      STAGES=cfg.tma_stages, PHASE=0, INT64=False)
        sig.update({k: "constexpr" for k in consts})
        src = ASTSource(fn=K, signature=sig, constexprs={(K.arg_names.index(k),): v for k, v in consts.items()})
        c = triton.compile(src, target=GPUTarget("cuda", arch, 32),
                           options={"num_warps": cfg.num_warps, "num_stages": cfg.num_stages})
        ptx = c.asm["ptx"]
        out[key] = dict(cubin=len(c.asm["cubin"]), stages=cfg.tma_stages, tiles=cfg.part * cfg.split == N,
                        copies=len(re.findall(r"cp\.async\.bulk\.tensor", ptx)),
                        poll="ld.relaxed.gpu.global.b64" in ptx and "barrier.sync 1" in ptx,
                        float_atomics=bool(re.search(r"(atom|red)[.\w]*\.f(16|32|64)", ptx)))
    except Exception as exc:
        out[key] = dict(error=f"{type(exc).__name__}: {exc}"[:500])
print("RESULT " + json.dumps(out))
"""


compiled = compile_fixture(CHILD, CASES)


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_compiles_and_pipelines(compiled, case):
    r = compiled_case(compiled, case)
    assert r["tiles"] and r["stages"] >= 2
    assert r["copies"] >= 2 * r["stages"], f"{r['copies']} bulk tensor copies: the row loop is not pipelined"
    assert r["poll"], "the one-warp poll (_poll_low_words) is missing"
    assert not r["float_atomics"]
