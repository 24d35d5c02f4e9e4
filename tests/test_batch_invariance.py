"""Batch invariance: a row's y is the same bits whatever batch it comes in (M = 1, a decode step's few
rows, a training step's thousands), for mode=None and for every GPU mode asked for by name, without
grad and with it (the forward that saves rstd). mode=None picks one mode per width for every M
(dispatch.FORWARD_RULE), and each kernel's reduction order depends on N only."""
from __future__ import annotations

import pytest
import torch

import cutile_norms as cn
from cutile_norms import dispatch
from tests.conftest import check_forward, random_rows, random_weight


EPS = 1e-6
MODES = [m for m in dispatch.MODES if m != "torch"] + [None]
# narrow rows in tiles of several, one-CTA rows, a row not a multiple of 16 elements, cluster rows,
# split rows
WIDTHS = [128, 2048, 4096, 4120, 10240, 20480, 36568, 65536]


@pytest.mark.gpu
@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
@pytest.mark.parametrize("N,dtype", [(n, torch.bfloat16) for n in WIDTHS] + [(33352, torch.float32)],
                         ids=lambda v: str(v).removeprefix("torch."))  # fp32 rows of 8-16 CTA slices
@pytest.mark.parametrize("mode", MODES, ids=lambda m: str(m))
def test_rows_do_not_depend_on_the_batch(mode, N, dtype, grad, seed):
    why = cn.available_modes().get(mode) if mode is not None else None
    if why:
        pytest.skip(why)
    M = 1024
    x = random_rows((M, N), dtype, "cuda")
    w = random_weight(N, dtype, "cuda").requires_grad_(grad)
    with torch.set_grad_enabled(grad):
        full = cn.rms_norm(x.requires_grad_(grad), w, EPS, mode=mode).detach()
        check_forward(x.detach(), w.detach(), EPS, 0.0, full, None, f"mode={mode} N={N} M={M}", seed)
        for start, m in ((0, 1), (5, 1), (0, 8), (3, 16), (100, 64), (512, 300)):
            part = cn.rms_norm(x.detach()[start:start + m].clone().requires_grad_(grad), w, EPS, mode=mode).detach()
            assert torch.equal(part, full[start:start + m]), (
                f"mode={mode} N={N}: rows {start}..{start + m - 1} alone differ from the same rows in a batch of "
                f"{M} (max abs diff {(part.float() - full[start:start + m].float()).abs().max().item():.3g}); seed {seed}")


def test_one_row_is_judged_as_its_batch_for_mode_none():
    """mode=None: a row of a tensor whose rows are not 16-byte aligned is refused alone as its batch
    is (the same kernel whatever M, so the same bits); by name, one row at any stride runs."""
    from cutile_norms.cute.rmsnorm_fwd import TMA_SMEM_CACHED

    base = torch.empty(4, 4096 + 4, dtype=torch.bfloat16)  # row stride 4100: rows 2 by 8 bytes off 16
    one, batch = base[:1, :4096], base[:, :4096]
    assert TMA_SMEM_CACHED.unsupported(batch) is not None
    assert TMA_SMEM_CACHED.unsupported(one, batch_invariant=True) is not None
    assert TMA_SMEM_CACHED.unsupported(one) is None
    contiguous = torch.empty(1, 4096, dtype=torch.bfloat16)
    assert TMA_SMEM_CACHED.unsupported(contiguous, batch_invariant=True) is None
