"""The launch config of the CuTe DSL fused add + norm forward (pure Python: imports without CuTe DSL):
the forward's analytic heuristic (rmsnorm_fwd_config.analytic_config), with one change where the
second operand weighs on registers."""
from __future__ import annotations

import functools

from .rmsnorm_fwd_config import ONE_CTA_BYTES, SLICE_BYTES, SMEM_MAX, FwdConfig, analytic_config

# 16-bit rows of SLICE_BYTES - ONE_CTA_BYTES (N = 8193 ... 24576) in one CTA of ONE_CTA_THREADS threads,
# not the forward's 128: a thread then holds r's vectors beside x's and the weight's, and at 128 threads
# ptxas holds 255 registers and spills 86 bytes per thread at N = 20480 (bf16 weight; 768 with an fp32
# weight; 280 at 24568), against 124 / 186 / 150 registers and no spills at 256 (sm_90a, the kernel since
# y is rounded where it is stored, 2.28; the forward alone at 20480 measured 0.976 x copy over 256
# threads against 0.965 over 128 on an H200, 2.11).
ONE_CTA_THREADS = 256


@functools.lru_cache(maxsize=4096)
def add_config(N: int, elem_bytes: int) -> FwdConfig | None:
    """The config for rows of N elements of `elem_bytes` (x, r and h of one dtype); None where the two
    tiles do not fit a CTA's (or a cluster's) shared memory."""
    one_cta = elem_bytes == 2 and SLICE_BYTES < N * elem_bytes <= ONE_CTA_BYTES  # (fp32: the forward's rule)
    cfg = analytic_config(N, elem_bytes, one_cta_threads=ONE_CTA_THREADS if one_cta else None)
    if cfg is None or cfg.smem_bytes(elem_bytes, N, operands=2) > SMEM_MAX:
        return None
    return cfg
