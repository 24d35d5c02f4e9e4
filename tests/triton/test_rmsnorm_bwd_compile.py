"""Compile checks (CPU only, no GPU): the split rows' TMA backward (rms_norm_bwd_tma_kernel) built for
sm_90 and sm_100 by `triton.compile` (Triton's own ptxas) for every config the heuristic gives wide
rows, and the PTX shows what the kernel relies on, which the interpreter cannot run: bulk tensor copies
issued rows ahead by the pipeliner (more copies than the two a row needs), the one-warp poll in
inline assembly with its named barrier, integer atomics only (the exchange: no float atomics). And the
row kernel (rms_norm_bwd_kernel), for sm_90 and sm_100, moves x, dy and dx in 16-byte vectors where N is
8 (mod 16), as where it is a multiple of 16 (its ALIGN hint).

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


ROW_CHILD = r"""
import json, re, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from cutile_norms.triton.tiling import offset_align
from cutile_norms.triton.rmsnorm_bwd_config import analytic_config
from cutile_norms.triton.rmsnorm_bwd_kernel import rms_norm_bwd_kernel as K
from tests.cute.ptx_util import ptxas_report

out = {}
for N, arch in json.loads(sys.argv[1]):
    cfg = analytic_config(N, 2, "nvidia", 132)
    sig = {"DY": "*bf16", "X": "*bf16", "W": "*bf16", "RSTD": "*fp32", "DX": "*bf16", "DW": "*fp32", "SLOTS": "*i64",
           "M": "i32", "stride_x": "i32", "stride_dy": "i32", "offset": "fp32", "N": "i32", "PART": "i32"}
    consts = dict(BLOCK_N=cfg.block_n, CHUNKS=cfg.chunks, ROWS=cfg.rows, SPLIT=cfg.split, HAS_W=True, NEED_DX=True,
                  NEED_DW=True, ACC_2D=cfg.acc_2d and cfg.rows > 1, PREFETCH=cfg.prefetch and cfg.chunks == 1,
                  PHASE=0, INT64=False, ALIGN=offset_align(N, N, N, cfg.part))
    sig.update({k: "constexpr" for k in consts})
    # what the JIT specialises at a launch on contiguous rows: 16-byte aligned pointers, and the integer
    # arguments divisible by 16 where they are
    ints = [k for k in ("stride_x", "stride_dy", "N", "PART") if N % 16 == 0]
    attrs = {(K.arg_names.index(k),): [["tt.divisibility", 16]]
             for k in ["DY", "X", "W", "RSTD", "DX", "DW", "SLOTS"] + ints}
    src = ASTSource(fn=K, signature=sig, constexprs={(K.arg_names.index(k),): v for k, v in consts.items()},
                    attrs=attrs)
    ptx = triton.compile(src, target=GPUTarget("cuda", arch, 32),
                         options={"num_warps": cfg.num_warps, "num_stages": cfg.num_stages}).asm["ptx"]
    out[f"{N}-{arch}"] = dict(v4_loads=len(re.findall(r"ld\.global(\.[a-z]+)*\.v4", ptx)),
                       b16=len(re.findall(r"(ld|st)\.global(\.[a-z]+)*\.b16", ptx)),
                       v4_stores=len(re.findall(r"st\.global(\.[a-z]+)*\.v4", ptx)),
                       warps=cfg.num_warps, per_thread=cfg.rows * cfg.block_n // (32 * cfg.num_warps),
                       **(ptxas_report(ptx, "sm_90a") if arch == 90 else {}))
print("RESULT " + json.dumps(out))
"""

# N = 8 (mod 16) beside the multiple of 16 below; and the narrow rows' configs (rmsnorm_bwd_config.py:
# NARROW_16, PAD_32) at both ends of their bands and between
ROW_WIDTHS = [(n, arch) for n in (1120, 1128, 1504, 1512, 3616, 3624, 7168, 7176, 768, 1000, 1032, 1536, 1544, 2040)
              for arch in ARCHS]


@pytest.fixture(scope="module")
def row_kernel():
    from tests.triton._util import compile_in_child
    return compile_in_child(ROW_CHILD, ROW_WIDTHS)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("N", [1128, 1512, 3624, 7176])
def test_rows_of_8_mod_16_move_in_16_byte_vectors(row_kernel, N, arch):
    """bf16 rows of N = 8 (mod 16) start 16-byte aligned, but Triton infers alignment only from integer
    arguments divisible by 16: without the ALIGN hint N = 1128 compiled to 34 2-byte loads (0.32 x copy on
    an H200, against 0.69 at 1120). With it, as many 16-byte loads as the neighbouring multiple of 16."""
    r, ref = row_kernel[f"{N}-{arch}"], row_kernel[f"{N - 8}-{arch}"]
    assert r["b16"] <= 1 and r["v4_loads"] >= 4 and r["v4_loads"] >= ref["v4_loads"] - 1, (r, ref)
    assert r["v4_stores"] >= 1, r


@pytest.mark.parametrize("N,per_thread", [(768, 16), (1000, 16), (1032, 32), (1128, 32), (1536, 32), (1544, 16),
                                          (2040, 16), (3624, 8)])
def test_narrow_rows_fit_in_registers(row_kernel, N, per_thread):
    """The narrow 16-bit rows' configs (16 values per thread up to 2048 columns, 2 rows x 32 per thread at
    1025-1536, 8 past 2048 columns where N is not a power of two) with the next tile prefetched: no
    spills on sm_90a (ptxas), at the values per thread the rule gives."""
    r = row_kernel[f"{N}-90"]
    assert r["per_thread"] == per_thread, r
    assert r["spill_stores"] == 0 and r["registers"] <= 255, r


ROWS_TMA_CHILD = r"""
import json, re, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from cutile_norms._platform import DeviceInfo
from dataclasses import replace
from cutile_norms.triton.rmsnorm_bwd_config import (analytic_config, tma_rows_config, tma_rows_rule,
                                                    tma_rows_shared_bytes, tma_rows_take)
from cutile_norms.triton.rmsnorm_bwd_kernel import TMA_ROWS_DH_KERNELS, TMA_ROWS_KERNELS
from tests.cute.ptx_util import ptxas_report

TY = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}
out = {}
for case in json.loads(sys.argv[1]):
    N, x, w, model, arch = case[:5]
    dh = len(case) > 5  # the dh entry points, the rule's dh bands
    rule = tma_rows_rule(DeviceInfo("nvidia", f"NVIDIA {model}", (9, 0), 132))
    cfg = analytic_config(N, 2, "nvidia", 132, tma_rows=rule)
    cfg = tma_rows_config(replace(cfg, **tma_rows_take(N, 2, rule, dh=True)) if dh else cfg)
    P = cfg.pieces
    K = (TMA_ROWS_DH_KERNELS if dh else TMA_ROWS_KERNELS)[len(P) - 1]
    streams = 4 if dh else 3  # x, dy, dx (and dh): one descriptor per piece each
    descs = [f"tensordesc<{TY[x]}[{cfg.rows},{p}]>" for p in P]
    sig = {name: descs[i % len(P)] for i, name in enumerate(K.arg_names[:streams * len(P)])}
    sig.update({"W": f"*{TY[w or x]}", "RSTD": "*fp32", "DW": "*fp32", "M": "i32", "offset": "fp32", "N": "i32"})
    consts = dict(ROWS=cfg.rows, PIECES=P, STARTS=cfg.piece_starts, HAS_W=w is not None, NEED_DW=True,
                  STAGES=cfg.tma_stages)
    sig.update({k: "constexpr" for k in consts})
    src = ASTSource(fn=K, signature=sig, constexprs={(K.arg_names.index(k),): v for k, v in consts.items()})
    c = triton.compile(src, target=GPUTarget("cuda", arch, 32),
                       options={"num_warps": cfg.num_warps, "num_stages": cfg.num_stages})
    ptx = c.asm["ptx"]
    out["-".join(map(str, case))] = dict(
        stages=cfg.tma_stages, shared=c.metadata.shared, box=cfg.rows * sum(P), pieces=len(P), reads=streams - 1,
        estimate=tma_rows_shared_bytes(cfg, cfg.tma_stages, 2, 2, 2 if dh else 0),
        loads=len(re.findall(r"cp\.async\.bulk\.tensor\.2d\.shared::cluster\.global", ptx)),
        stores=len(re.findall(r"cp\.async\.bulk\.tensor\.2d\.global\.shared::cta", ptx)),
        **(ptxas_report(ptx, "sm_90a") if arch == 90 else {}))
print("RESULT " + json.dumps(out))
"""

# (N, x dtype, weight dtype, GPU model, arch): both ends of the band and padded blocks, the H100's and the
# H200's bytes in flight (3 to 5 stages) and tiles (8192 elements; the H200's up to 16384: 768, 1536)
ROWS_TMA_CASES = [(N, x, w, m, a) for N, x, w in ((520, "bfloat16", "bfloat16"), (768, "bfloat16", "bfloat16"),
                                                  (1536, "float16", "float32"), (2048, "bfloat16", None))
                  for m in ("H100", "H200") for a in ARCHS if m == "H100" or N >= 768] + \
    [(N, x, w, "H200", a) for N, x, w in ((1280, "bfloat16", "bfloat16"), (1152, "float16", "float32"),
                                          (7168, "bfloat16", "bfloat16"), (6160, "bfloat16", None)) for a in ARCHS] + \
    [(N, x, w, "H200", a, "dh") for N, x, w in ((544, "bfloat16", "bfloat16"), (896, "float16", "float32"),
                                                (1088, "bfloat16", None), (1152, "bfloat16", "bfloat16"),
                                                (6144, "bfloat16", "float32"), (7168, "float16", "float16"))
     for a in ARCHS]  # with dh: the H200's dh bands (one block, 8-row 2048 blocks, two pieces, the wide band)


@pytest.fixture(scope="module")
def rows_tma():
    from tests.triton._util import compile_in_child
    return compile_in_child(ROWS_TMA_CHILD, ROWS_TMA_CASES)


@pytest.mark.parametrize("case", ROWS_TMA_CASES, ids=case_id)
def test_narrow_rows_tma_kernel_pipelines_its_tiles(rows_tma, case):
    """rms_norm_bwd_tma_rows_kernel (and its two-piece entry, rms_norm_bwd_tma_rows2_kernel, and both with dh,
    the "dh" cases): x's and dy's (and dh's) bulk tensor copies issued tiles ahead (at least one a stage per
    piece for each), dx written by a bulk tensor
    copy per piece, its STAGES - 1 tiles of x and dy plus one of dx within an
    SM's shared memory and within tma_rows_shared_bytes (the estimate the launch caps the stages by on
    GPUs with less), and no spills on sm_90a (ptxas) at tiles of TILE_ELEMS. The H200's tiles of up to
    twice that spill at 8 warps (308 and 280 bytes of spill stores at 768 and 1536) and measured 1-11 %
    faster there than the unspilled 8192-element tiles (768: 0.933 against 0.856); at 16 warps they do
    not spill and ran at 0.44-0.57 at 640-896 (rmsnorm_bwd_config's H200 rule, docs/performance.md 2.27)."""
    from cutile_norms.triton.rmsnorm_bwd_config import TILE_ELEMS

    r = rows_tma[case_id(case)]
    assert r["loads"] >= r["reads"] * r["stages"] * r["pieces"] and r["stores"] >= r["pieces"], r
    assert r["shared"] <= min(227 * 1024, r["estimate"]), r
    # the larger tiles: within twice what they spilled when measured, so that a blow-up fails
    assert r.get("spill_stores", 0) == 0 if r["box"] <= TILE_ELEMS else r.get("spill_stores", 0) <= 640, r
