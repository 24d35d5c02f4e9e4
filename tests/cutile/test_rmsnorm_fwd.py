"""cuTile RMSNorm forward (cutile_norms/cutile/rmsnorm_fwd.py).

GPU tests (marked `gpu`, skipped without an sm_90+ GPU): every mode against the fp64 reference over
the dtype / width / M matrix, outputs poisoned with NaN before the launch. CPU tests: the piece split.
The compile checks for sm_90/sm_100 live in test_rmsnorm_fwd_compile.py.
"""
from __future__ import annotations

import pytest
import torch

from tests.conftest import assert_close, random_rows, random_weight, reference64

MODES = ["multi_wave_cached", "static_persistent", "multi_wave_reload"]
WIDTHS = [128, 1000, 2880, 4096, 5120, 16384, 65536]
DTYPES = [("bfloat16", "bfloat16"), ("float16", "float16"), ("float32", "float32"), ("bfloat16", "float32")]
DT = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
EPS = 1e-6


# ------------------------------------------------------------------------------------------------
# CPU: the power-of-two piece split of a row
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("n", [1, 7, 128, 1000, 2880, 4096, 5120, 7168, 65536, 100003])
@pytest.mark.parametrize("piece_min", [1, 64, 1024, 1 << 30])
def test_row_pieces_cover_the_row(n, piece_min):
    from cutile_norms.cutile.rmsnorm_fwd import row_pieces

    pieces = row_pieces(n, piece_min)
    off = 0
    for i, (o, size) in enumerate(pieces):
        assert o == off and size & (size - 1) == 0 and o % size == 0
        off += size
        if i < len(pieces) - 1:
            assert size >= piece_min or size == n  # only the last piece may be padded / small
    assert off >= n and pieces[-1][0] < n and off - n < pieces[-1][1]


# ------------------------------------------------------------------------------------------------
# GPU
# ------------------------------------------------------------------------------------------------
def _device_info():
    from cutile_norms._platform import device_info

    return device_info("cuda")


def _run_backend(mode, x2d, w, offset, store_rstd=True):
    """The mode's backend on poisoned output buffers; returns (y, rstd)."""
    from cutile_norms import dispatch
    from cutile_norms.cutile.rmsnorm_fwd import output_buffers

    M, N = x2d.shape
    y_flat, rstd = output_buffers(M, N, x2d.dtype, x2d.device, store_rstd)
    y_flat.fill_(float("nan"))
    if rstd is not None:
        rstd.fill_(float("nan"))
    y, r = dispatch.backend(mode).forward(x2d, w, EPS, offset, store_rstd, _device_info(), out=(y_flat, rstd))
    torch.cuda.synchronize()
    return y, r


@pytest.mark.gpu
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("N", WIDTHS)
@pytest.mark.parametrize("x_dtype,w_dtype", DTYPES)
@pytest.mark.parametrize("M", [1, 7, 4096])
def test_matches_reference(seed, mode, N, x_dtype, w_dtype, M):
    x = random_rows((M, N), DT[x_dtype], "cuda")
    w = random_weight(N, DT[w_dtype], "cuda")
    y, rstd = _run_backend(mode, x, w, 0.0)
    y64, rstd64 = reference64(x, w, EPS, 0.0)
    assert y.dtype == x.dtype and y.is_contiguous()
    assert_close(y, y64, DT[x_dtype], f"{mode} y", seed)
    assert_close(rstd, rstd64, torch.float32, f"{mode} rstd", seed)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("N", WIDTHS)
def test_full_size_bf16(seed, mode, N):
    """M = 2^27 / N: the bench's size (every row tile of a multi-wave grid)."""
    M = (1 << 27) // N
    x = random_rows((M, N), torch.bfloat16, "cuda")
    w = random_weight(N, torch.bfloat16, "cuda")
    y, _ = _run_backend(mode, x, w, 0.0, store_rstd=False)
    assert_close(y, reference64(x, w, EPS, 0.0)[0], torch.bfloat16, f"{mode} M={M}", seed)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("N", WIDTHS)
@pytest.mark.parametrize("case", ["offset1", "no_weight", "offset1_fp32_weight"])
def test_offset_and_no_weight(seed, mode, N, case):
    x = random_rows((37, N), torch.bfloat16, "cuda")
    w = None if case == "no_weight" else random_weight(N, torch.float32 if "fp32" in case else torch.bfloat16, "cuda")
    offset = 0.0 if case == "no_weight" else 1.0
    y, rstd = _run_backend(mode, x, w, offset)
    y64, rstd64 = reference64(x, w, EPS, offset)
    assert_close(y, y64, torch.bfloat16, f"{mode} {case}", seed)
    assert_close(rstd, rstd64, torch.float32, f"{mode} {case} rstd", seed)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_large_magnitudes_accumulate_in_fp32(seed, mode, dtype):
    # x^2 of ~300 overflows fp16 (max 65504): a 16-bit sum of squares would give inf / 0
    x = (random_rows((64, 4096), torch.float32, "cuda") * 300).to(DT[dtype])
    y, _ = _run_backend(mode, x, None, 0.0)
    assert_close(y, reference64(x, None, EPS, 0.0)[0], DT[dtype], f"{mode} large", seed)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", MODES)
def test_strided_rows_and_leading_dims(seed, mode):
    import cutile_norms as cn

    base = random_rows((3, 5, 3000), torch.bfloat16, "cuda")
    for x in (base[..., :2880], base[..., 8:2888], base[:, ::2, :2048]):  # row stride != N, odd base offsets
        w = random_weight(x.shape[-1], torch.bfloat16, "cuda")
        y = cn.rms_norm(x, w, EPS, mode=mode)
        assert y.shape == x.shape and y.is_contiguous()
        assert_close(y, reference64(x, w, EPS, 0.0)[0], torch.bfloat16, f"{mode} strided {tuple(x.stride())}", seed)
    xt = random_rows((1024, 6), torch.float32, "cuda").t()  # last-dim stride != 1: copied
    assert_close(cn.rms_norm(xt, mode=mode), reference64(xt, None, EPS, 0.0)[0], torch.float32, "transposed", seed)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", MODES)
def test_autograd_through_the_kernel_forward(seed, mode):
    import cutile_norms as cn

    x = random_rows((4, 9, 1000), torch.bfloat16, "cuda").requires_grad_()
    w = random_weight(1000, torch.float32, "cuda").requires_grad_()
    dy = torch.randn_like(x)
    y = cn.rms_norm(x, w, EPS, mode=mode, offset=1.0)
    dx, dw = torch.autograd.grad(y, [x, w], dy)
    x64, w64 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    ex, ew = torch.autograd.grad(reference64(x64, w64, EPS, 1.0)[0], [x64, w64], dy.double())
    assert_close(y, reference64(x, w, EPS, 1.0)[0], torch.bfloat16, f"{mode} y", seed)
    assert_close(dx, ex, torch.bfloat16, f"{mode} dx", seed)
    torch.testing.assert_close(dw.double(), ew, rtol=1e-3, atol=1e-3, msg=f"{mode} dw [seed {seed}]")


@pytest.mark.gpu
@pytest.mark.parametrize("mode", MODES)
def test_no_recompilation_when_only_M_changes(seed, mode):
    """Five M at a fixed N: one compile for the first call, none after (M is a runtime scalar)."""
    import cuda.tile as ct

    import cutile_norms as cn

    compiles = []
    original = ct.kernel._compile

    def counting(self, *args, **kwargs):
        compiles.append(self)
        return original(self, *args, **kwargs)

    N = 4096 + 64 * (MODES.index(mode) + 1)  # a width no other test compiled
    w = random_weight(N, torch.bfloat16, "cuda")
    ct.kernel._compile = counting
    try:
        for M in (4096, 1, 7, 1000, 65537):
            x = random_rows((M, N), torch.bfloat16, "cuda")
            y = cn.rms_norm(x, w, EPS, mode=mode)
            assert_close(y, reference64(x, w, EPS, 0.0)[0], torch.bfloat16, f"{mode} M={M}", seed)
    finally:
        ct.kernel._compile = original
    assert len(compiles) == 1, f"{mode}: {len(compiles)} compiles for 5 values of M at N={N}"


@pytest.mark.gpu
def test_mode_none_and_explain_on_gpu(seed):
    import cutile_norms as cn

    x = random_rows((8, 512, 4096), torch.bfloat16, "cuda")
    w = random_weight(4096, torch.bfloat16, "cuda")
    assert_close(cn.rms_norm(x, w), reference64(x, w, EPS, 0.0)[0], torch.bfloat16, "mode=None", seed)
    text = cn.explain(x, w)
    assert "M=4096, N=4096" in text and "kernel:" in text and "why:" in text
    for mode in MODES:
        assert cn.available_modes("cuda")[mode] is None
        assert "cuTile" in cn.explain(x, w, mode=mode)


@pytest.mark.gpu
def test_module_on_gpu(seed):
    import cutile_norms as cn

    for mode in MODES + [None]:
        m = cn.RMSNorm(2880, mode=mode, offset=1.0, device="cuda", dtype=torch.bfloat16)
        with torch.no_grad():
            m.weight.copy_(0.1 * torch.randn(2880, device="cuda"))
        x = random_rows((2, 33, 2880), torch.bfloat16, "cuda")
        assert_close(m(x), reference64(x, m.weight, EPS, 1.0)[0], torch.bfloat16, f"module {mode}", seed)
