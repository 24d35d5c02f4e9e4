"""cuTile RMSNorm forward (cutile_norms/cutile/rmsnorm_fwd.py).

GPU tests (marked `gpu`, skipped without an sm_90+ GPU): every mode against the fp64 reference over
the dtype / width / M matrix, outputs poisoned with NaN before the launch. CPU tests: the piece split.
The compile checks for sm_90/sm_100 live in test_rmsnorm_fwd_compile.py.
"""
from __future__ import annotations

import pytest
import torch

from cutile_norms import dispatch

from tests.conftest import DW_SUM, assert_close, random_rows, random_weight, reference64

MODES = dispatch.modes_of("cutile")
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
    from cutile_norms.cutile.rmsnorm_fwd_config import row_pieces

    pieces = row_pieces(n, piece_min)
    off = 0
    for i, (o, size) in enumerate(pieces):
        assert o == off and size & (size - 1) == 0 and o % size == 0
        off += size
        if i < len(pieces) - 1:
            assert size >= piece_min or size == n  # only the last piece may be padded / small
    assert off >= n and pieces[-1][0] < n and off - n < pieces[-1][1]


@pytest.mark.parametrize("n", [1000, 2880, 32768, 40000, 65536, 100003, 262144])
@pytest.mark.parametrize("split", [1, 2, 4, 8, 16, 64])
def test_split_parts_cover_the_row(n, split):
    """The split kernel's parts: 16-element aligned starts, every column in exactly one part."""
    from cutile_norms.cutile.rmsnorm_fwd_config import split_part

    part = split_part(n, split)
    assert part % 16 == 0 and part * split >= n
    if 1 < split and n > 16 * split * (split - 1):  # rounding to 16 overshoots by < 16 per part
        assert part * (split - 1) < n  # the last part holds at least one column (empty parts, which
        # only arise for tiny parts, would still be correct: fully masked, a partial sum of 0)


def test_stream_config_and_output_padding():
    """The stream kernel is persistent; its y and rstd allocations are padded to whole row tiles."""
    from cutile_norms.cutile.rmsnorm_fwd import grid_size, output_buffers, row_pad
    from cutile_norms.cutile.rmsnorm_fwd_config import FwdConfig

    with pytest.raises(ValueError, match="persistent"):
        FwdConfig("stream")
    cfg = FwdConfig("stream", tile_m=32, persistent=True, blocks_per_sm=4)
    assert row_pad(cfg) == 32 and row_pad(FwdConfig("stream", persistent=True)) == 16
    assert row_pad(FwdConfig("cached", tile_m=32)) == 1
    assert grid_size(cfg, 1000, 132) == 32 and grid_size(cfg, 10 ** 6, 132) == 4 * 132
    y, rstd = output_buffers(33, 100, torch.bfloat16, "cpu", True, pad_rows=32)
    assert y.shape == (33, 100) and y.is_contiguous() and rstd.shape == (33,)
    assert y.untyped_storage().nbytes() == 64 * 100 * 2 and rstd.untyped_storage().nbytes() == 64 * 4
    y, rstd = output_buffers(3, 7, torch.float32, "cpu", True)  # the flat kernels: length rounded to 16
    assert y.untyped_storage().nbytes() == 32 * 4 and rstd.untyped_storage().nbytes() == 16 * 4


def test_fp32_weight_planes_round_trip_exactly():
    """An fp32 weight for 16-bit x (from PLANES_MIN_N columns) goes to the kernels as int16 planes:
    low halves of the bits, then the high halves from round16(N). Joined again they give back every
    bit pattern: signed zeros, denormals, the largest finite values, inf and NaN."""
    from cutile_norms.cutile.rmsnorm_fwd import PLANES_MIN_N, weight_planes, weight_planes_offset

    N = 2049
    w = torch.randn(N) * torch.exp2(torch.randint(-40, 40, (N,)).float())
    w[:6] = torch.tensor([-0.0, 1e-40, -3.4e38, float("inf"), float("nan"), 1.0])
    planes = weight_planes(w[::1])
    npad = 2064  # round16(2049)
    assert planes.dtype == torch.int16 and planes.numel() == 2 * npad
    lo = planes[:N].to(torch.int32) & 0xFFFF
    hi = planes[npad:npad + N].to(torch.int32) << 16
    assert torch.equal((hi | lo).view(torch.float32).view(torch.int32), w.view(torch.int32))
    strided = torch.randn(2 * N)[::2]  # a non-contiguous weight
    planes = weight_planes(strided)
    back = ((planes[npad:npad + N].to(torch.int32) << 16) | (planes[:N].to(torch.int32) & 0xFFFF)).view(torch.float32)
    assert torch.equal(back, strided)
    f32 = torch.float32
    assert weight_planes_offset(torch.bfloat16, f32, N) == npad and weight_planes_offset(torch.float16, f32, N) == npad
    assert weight_planes_offset(torch.bfloat16, f32, PLANES_MIN_N - 1) == 0  # narrow rows: fp32 as it is
    assert weight_planes_offset(torch.float32, f32, N) == 0 and weight_planes_offset(torch.bfloat16, None, N) == 0
    assert weight_planes_offset(torch.bfloat16, torch.bfloat16, N) == 0


def test_split_grid_is_split_blocks_per_row():
    from cutile_norms.cutile.rmsnorm_fwd import grid_size
    from cutile_norms.cutile.rmsnorm_fwd_config import FwdConfig

    assert grid_size(FwdConfig("split", split=4), 1000, 132) == 4000
    assert grid_size(FwdConfig("cached", tile_m=4), 1001, 132) == 251


# ------------------------------------------------------------------------------------------------
# GPU
# ------------------------------------------------------------------------------------------------
def _device_info():
    from cutile_norms._platform import device_info

    return device_info("cuda")


def _run_backend(mode, x2d, w, offset, store_rstd=True, cfg=None, eps=EPS, poison=0xFF):
    """The mode's backend (with its own config, or `cfg`) on output buffers poisoned with the byte
    `poison` (0xFF: NaN in every float type; 0 where NaN is the expected output); returns (y, rstd)."""
    from cutile_norms import dispatch
    from cutile_norms.cutile.rmsnorm_fwd import output_buffers, row_pad

    M, N = x2d.shape
    backend = dispatch.backend(mode)
    pad = row_pad(cfg or backend.config(N, x2d.dtype, _device_info()))
    y_flat, rstd = output_buffers(M, N, x2d.dtype, x2d.device, store_rstd, pad_rows=pad)
    for t in (y_flat, rstd):  # the whole allocations, padding included
        if t is not None:
            t.untyped_storage().fill_(poison)
    y, r = backend.forward(x2d, w, eps, offset, store_rstd, _device_info(), cfg=cfg, out=(y_flat, rstd))
    torch.cuda.synchronize()
    return y, r


def _assert_config_matches_reference(cfg, x, w, offset, what, seed):
    """multi_wave_cached's backend with `cfg` on poisoned buffers: y (x's dtype tolerance) and rstd
    against the fp64 reference."""
    y, rstd = _run_backend("multi_wave_cached", x, w, offset, cfg=cfg)
    y64, rstd64 = reference64(x, w, EPS, offset)
    assert_close(y, y64, x.dtype, f"{cfg.short()} {what} y", seed)
    assert_close(rstd, rstd64, torch.float32, f"{cfg.short()} {what} rstd", seed)


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
    torch.testing.assert_close(dw.double(), ew, **DW_SUM, msg=f"{mode} dw [seed {seed}]")


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


# (N, split, piece_min): power-of-two parts; parts that split does not divide evenly (the last part
# short: 40000 / 8, 1000 / 4); a non-power-of-two part in pieces (100003 / 8); 16 blocks per row
SPLIT_CASES = [(32768, 2, 1 << 30), (65536, 4, 1 << 30), (40000, 8, 2048), (1000, 4, 64), (100003, 8, 2048),
               (262144, 16, 1 << 30)]


def _run_split(x, w, offset, split, piece_min, store_rstd=True, nww=8, poison=0xFF):
    from cutile_norms.cutile.rmsnorm_fwd_config import FwdConfig

    cfg = FwdConfig("split", split=split, piece_min=piece_min, num_worker_warps=nww)
    return _run_backend("multi_wave_cached", x, w, offset, store_rstd, cfg=cfg, poison=poison)


@pytest.mark.gpu
@pytest.mark.parametrize("N,split,piece_min", SPLIT_CASES)
@pytest.mark.parametrize("x_dtype,w_dtype", DTYPES)
@pytest.mark.parametrize("M", [1, 7, 300])
def test_split_kernel_matches_reference(seed, N, split, piece_min, x_dtype, w_dtype, M):
    """The row split over `split` blocks that exchange partial sums through global memory."""
    x = random_rows((M, N), DT[x_dtype], "cuda")
    w = random_weight(N, DT[w_dtype], "cuda")
    y, rstd = _run_split(x, w, 0.0, split, piece_min)
    y64, rstd64 = reference64(x, w, EPS, 0.0)
    assert_close(y, y64, DT[x_dtype], f"split={split} y", seed)
    assert_close(rstd, rstd64, torch.float32, f"split={split} rstd", seed)


@pytest.mark.gpu
@pytest.mark.parametrize("N,split,piece_min", SPLIT_CASES[:3])
@pytest.mark.parametrize("case", ["offset1", "no_weight", "no_rstd"])
def test_split_kernel_offset_no_weight_no_rstd(seed, N, split, piece_min, case):
    x = random_rows((33, N), torch.bfloat16, "cuda")
    w = None if case == "no_weight" else random_weight(N, torch.bfloat16, "cuda")
    offset = 1.0 if case == "offset1" else 0.0
    y, rstd = _run_split(x, w, offset, split, piece_min, store_rstd=case != "no_rstd")
    y64, rstd64 = reference64(x, w, EPS, offset)
    assert_close(y, y64, torch.bfloat16, f"split {case}", seed)
    if case != "no_rstd":
        assert_close(rstd, rstd64, torch.float32, f"split {case} rstd", seed)


@pytest.mark.gpu
def test_split_kernel_full_size_and_launch_chunks(seed, monkeypatch):
    """M = 2^27 / N rows (thousands of blocks waiting on each other), then the same with the int32
    indexing limit lowered so the launch is cut into row chunks, each with its own workspace."""
    from cutile_norms.cutile import rmsnorm_fwd

    N = 65536
    x = random_rows(((1 << 27) // N, N), torch.bfloat16, "cuda")
    w = random_weight(N, torch.bfloat16, "cuda")
    y64, rstd64 = reference64(x, w, EPS, 0.0)
    y, rstd = _run_split(x, w, 0.0, 4, 1 << 30)
    assert_close(y, y64, torch.bfloat16, "split full size", seed)
    monkeypatch.setattr(rmsnorm_fwd, "_MAX_FLAT", 81 * N)  # 64 rows per launch -> 32 launches
    y, rstd = _run_split(x, w, 0.0, 4, 1 << 30)
    assert_close(y, y64, torch.bfloat16, "split chunked", seed)
    assert_close(rstd, rstd64, torch.float32, "split chunked rstd", seed)


@pytest.mark.gpu
def test_split_kernel_workspace_across_launches_streams_and_graphs(seed):
    """The slots are kept between launches (a sign bit flips per launch instead of a clear): back to
    back launches with different M and split on one stream, then on a second stream while the first
    is busy, then a captured CUDA graph replayed with new inputs: every result against the reference."""
    from cutile_norms.cutile.rmsnorm_fwd import launch
    from cutile_norms.cutile.rmsnorm_fwd_config import FwdConfig

    def check(y, x, w, what):
        assert_close(y, reference64(x, w, EPS, 0.0)[0], torch.bfloat16, what, seed)

    N = 40000
    w = random_weight(N, torch.bfloat16, "cuda")
    cfgs = {s: FwdConfig("split", split=s, piece_min=2048, packed=True) for s in (4, 8)}
    runs = []
    for M, s in ((300, 8), (7, 8), (301, 8), (64, 4), (300, 8), (1, 4), (300, 8)):  # no sync in between
        x = random_rows((M, N), torch.bfloat16, "cuda")
        runs.append((launch(cfgs[s], x, w, EPS, 0.0, False, 132)[0], x, f"M={M} split={s}"))
    for y, x, what in runs:
        check(y, x, w, what)
    side = torch.cuda.Stream()
    xa, xb = (random_rows((257, N), torch.bfloat16, "cuda") for _ in range(2))
    ya = launch(cfgs[8], xa, w, EPS, 0.0, False, 132)[0]
    with torch.cuda.stream(side):
        yb = launch(cfgs[8], xb, w, EPS, 0.0, False, 132)[0]
    torch.cuda.synchronize()
    check(ya, xa, w, "main stream")
    check(yb, xb, w, "side stream")
    static_x = random_rows((33, N), torch.bfloat16, "cuda")
    graph = torch.cuda.CUDAGraph()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        launch(cfgs[8], static_x, w, EPS, 0.0, False, 132)  # compiled and its workspace made outside the capture
        with torch.cuda.graph(graph, stream=side):
            static_y = launch(cfgs[8], static_x, w, EPS, 0.0, False, 132)[0]
    for i in range(3):
        static_x.copy_(random_rows((33, N), torch.bfloat16, "cuda"))
        static_y.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        check(static_y, static_x, w, f"graph replay {i}")


@pytest.mark.gpu
def test_split_kernel_nan_row_does_not_hang(seed):
    """A NaN in a row makes its partial sum NaN, which is not "-1 = not yet written": the row's
    blocks finish (NaN out for that row only) instead of waiting forever."""
    x = random_rows((16, 65536), torch.bfloat16, "cuda")
    x[5, 12345] = float("nan")
    w = random_weight(65536, torch.bfloat16, "cuda")
    y, _ = _run_split(x, w, 0.0, 4, 1 << 30, poison=0)  # (zeros: a NaN the kernel did not write fails)
    assert torch.isnan(y[5]).all()
    keep = torch.arange(16, device="cuda") != 5
    assert_close(y[keep], reference64(x[keep], w, EPS, 0.0)[0], torch.bfloat16, "split other rows", seed)


@pytest.mark.gpu
@pytest.mark.parametrize("N,split,piece_min", SPLIT_CASES)
@pytest.mark.parametrize("x_dtype,w_dtype", DTYPES)
@pytest.mark.parametrize("w_early", [False, True])
def test_split_kernel_tie_slot_matches_reference(seed, N, split, piece_min, x_dtype, w_dtype, w_early):
    """tie_slot: the block's workspace slot tied to x's first piece's squares (its load goes out with x's).
    Three launches on the same workspace (the sign flips each time), every one on poisoned buffers."""
    from cutile_norms.cutile.rmsnorm_fwd_config import FwdConfig

    cfg = FwdConfig("split", split=split, piece_min=piece_min, packed=x_dtype != "float32", w_early=w_early,
                    tie_slot=True)
    x = random_rows((300, N), DT[x_dtype], "cuda")
    w = random_weight(N, DT[w_dtype], "cuda")
    for launch in range(3):
        _assert_config_matches_reference(cfg, x, w, 0.0, f"tie_slot launch {launch}", seed)


def _packed_configs(N):
    from cutile_norms.cutile.rmsnorm_fwd_config import FwdConfig, cached_piece_min

    return [FwdConfig("cached", piece_min=cached_piece_min(N), packed=True, num_worker_warps=8),
            FwdConfig("split", split=4, piece_min=cached_piece_min(N // 4), occupancy=8)]


@pytest.mark.gpu
@pytest.mark.parametrize("N", [5120, 16384])
@pytest.mark.parametrize("x_dtype,w_dtype", DTYPES)
@pytest.mark.parametrize("which", [0, 1])
def test_packed_x_matches_reference(seed, N, x_dtype, w_dtype, which):
    """16-bit x kept as loaded and widened a second time by bit operations (cached `packed`, split)."""
    x = random_rows((65, N), DT[x_dtype], "cuda")
    w = random_weight(N, DT[w_dtype], "cuda")
    _assert_config_matches_reference(_packed_configs(N)[which], x, w, 1.0, "packed", seed)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("which", [0, 1])
def test_packed_widening_of_extreme_values(seed, dtype, which):
    """Rows of only subnormals (fp16: with eps tiny, y is O(1), so a subnormal widened wrongly
    shows), and rows mixing huge values with small normals: fp16's largest finite value; for bf16
    2^56, since the fp32 sum of squares (as in every fp32-accumulating RMSNorm) overflows near bf16's max."""
    N = 16384
    cfg = _packed_configs(N)[which]
    info = torch.finfo(DT[dtype])
    sub = (torch.rand(8, N, device="cuda") * 0.9 + 0.05) * info.tiny  # below the smallest normal
    sub = sub * torch.where(torch.rand_like(sub) < 0.5, -1.0, 1.0)
    big = random_rows((8, N), torch.float32, "cuda") * 1e-3
    big[:, ::97] = (info.max if dtype == "float16" else 2.0 ** 56) * torch.where(torch.rand_like(big[:, ::97]) < 0.5, -1.0, 1.0)
    x = torch.cat([sub, big]).to(DT[dtype])
    assert (x[:8] != 0).float().mean() > 0.9 and (x[:8].abs() < info.tiny).all()
    for eps in (1e-30, EPS):
        y, rstd = _run_backend("multi_wave_cached", x, None, 0.0, cfg=cfg, eps=eps)
        y64, rstd64 = reference64(x, None, eps, 0.0)
        assert_close(y, y64, DT[dtype], f"{cfg.short()} eps={eps}", seed)
        assert_close(rstd, rstd64, torch.float32, f"{cfg.short()} rstd eps={eps}", seed)


# ------------------------------------------------------------------------------------------------
# GPU: w_early (the weight's bits tied to the sum of squares, so its loads go out with x's)
# ------------------------------------------------------------------------------------------------
# (kernel, N, split): one-row cached tiles (a masked padded piece at 1000 and 5000; at 1000 an fp32
# weight with bf16 x is no planes yet and is tied element by element), split rows (a short last
# part at 40000, 2 parts at 8192), multi-row tiles ("rows": x tied to the weight element by element),
# and a persistent grid holding the weight's bits, tied to each tile's x ("rows_hoisted": 2-row
# tiles, "row_hoisted": one row in pieces with a masked tail; one block per SM, so blocks loop)
W_EARLY_CASES = [("cached", 1000, 1), ("cached", 5000, 1), ("cached", 16384, 1), ("split", 8192, 2), ("split", 40000, 8),
                 ("split", 65536, 8), ("rows", 1000, 1), ("rows_hoisted", 512, 1), ("row_hoisted", 2880, 1)]
# same-width weights (one 32-bit view of both), fp32 weight as planes, a 16-bit weight with fp32 x
# (tied element by element)
W_EARLY_DTYPES = DTYPES + [("float16", "float32"), ("float32", "bfloat16")]


def _w_early_config(kernel, N, split, x_dtype):
    from cutile_norms.cutile.rmsnorm_fwd_config import FwdConfig, cached_piece_min, split_part

    packed = x_dtype != "float32"
    if kernel == "split":
        return FwdConfig("split", split=split, piece_min=cached_piece_min(split_part(N, split)), packed=packed,
                         occupancy=6, w_early=True)
    if kernel == "rows":
        return FwdConfig("cached", tile_m=4, piece_min=cached_piece_min(N), w_early=True)
    if kernel in ("rows_hoisted", "row_hoisted"):
        return FwdConfig("cached", tile_m=2 if kernel == "rows_hoisted" else 1, piece_min=min(1024, cached_piece_min(N)),
                         packed=packed and kernel == "row_hoisted", persistent=True, blocks_per_sm=1, hoist_w=True,
                         w_early=True)
    return FwdConfig("cached", piece_min=cached_piece_min(N), packed=packed, num_worker_warps=8, occupancy=3,
                     w_early=True)


@pytest.mark.gpu
@pytest.mark.parametrize("kernel,N,split", W_EARLY_CASES)
@pytest.mark.parametrize("x_dtype,w_dtype", W_EARLY_DTYPES)
@pytest.mark.parametrize("M", [1, 300])
def test_w_early_matches_reference(seed, kernel, N, split, x_dtype, w_dtype, M):
    x = random_rows((M, N), DT[x_dtype], "cuda")
    w = random_weight(N, DT[w_dtype], "cuda")
    _assert_config_matches_reference(_w_early_config(kernel, N, split, x_dtype), x, w, 0.0, "w_early", seed)


@pytest.mark.gpu
@pytest.mark.parametrize("kernel,N,split", W_EARLY_CASES)
@pytest.mark.parametrize("case", ["offset1", "no_weight", "strided"])
def test_w_early_offset_no_weight_strided(seed, kernel, N, split, case):
    """Gemma's 1 + w, no weight (nothing to tie), and rows with a stride past N (a view of a wider x)."""
    x = random_rows((33, N + 64 if case == "strided" else N), torch.bfloat16, "cuda")[:, :N]
    w = None if case == "no_weight" else random_weight(N, torch.bfloat16, "cuda")
    _assert_config_matches_reference(_w_early_config(kernel, N, split, "bfloat16"), x, w,
                                     1.0 if case == "offset1" else 0.0, f"w_early {case}", seed)


@pytest.mark.gpu
def test_w_early_weight_special_values(seed):
    """The tie is x | (w & 0) on the bits: weights that are inf, NaN, -0 or denormal change nothing
    in the sum of squares and reach y as they are (compared where finite; NaN/inf columns checked
    to be non-finite exactly where the reference is)."""
    N = 65536
    x = random_rows((17, N), torch.bfloat16, "cuda")
    w = random_weight(N, torch.bfloat16, "cuda")
    w[:4] = torch.tensor([float("nan"), float("inf"), -0.0, 1e-40], dtype=torch.bfloat16)
    y64, rstd64 = reference64(x, w, EPS, 0.0)
    for kernel, split in (("split", 8), ("cached", 1)):
        y, rstd = _run_backend("multi_wave_cached", x, w, 0.0, cfg=_w_early_config(kernel, N, split, "bfloat16"),
                               poison=0)  # (zeros: the NaN / inf columns must be written)
        assert_close(rstd, rstd64, torch.float32, f"{kernel} special w rstd", seed)
        assert torch.equal(torch.isfinite(y), torch.isfinite(y64.to(y.dtype))), f"{kernel}: non-finite columns differ"
        assert_close(y[:, 4:], y64[:, 4:], torch.bfloat16, f"{kernel} special w y", seed)


# ------------------------------------------------------------------------------------------------
# GPU: the stream kernel (static_persistent: the next row tile loaded while this one is reduced)
# ------------------------------------------------------------------------------------------------
# (N, tile_m, piece_min): narrow rows in multi-row tiles; a padded last piece (1000); pieces (2880);
# one row per tile, packed 16-bit x
STREAM_CASES = [(128, 32, 128), (512, 16, 512), (1000, 4, 512), (2880, 1, 1024), (4096, 1, 4096), (8192, 1, 8192)]


def _run_stream(x, w, offset, tile_m, piece_min, store_rstd=True, hoist_w=True, blocks_per_sm=2, nww=None):
    from cutile_norms.cutile.rmsnorm_fwd_config import FwdConfig

    cfg = FwdConfig("stream", tile_m=tile_m, piece_min=piece_min, packed=tile_m == 1 and x.element_size() == 2,
                    persistent=True, blocks_per_sm=blocks_per_sm, hoist_w=hoist_w, num_worker_warps=nww)
    return _run_backend("static_persistent", x, w, offset, store_rstd, cfg=cfg)


@pytest.mark.gpu
@pytest.mark.parametrize("N,tile_m,piece_min", STREAM_CASES)
@pytest.mark.parametrize("x_dtype,w_dtype", DTYPES)
@pytest.mark.parametrize("M", [1, 7, 33, 5000])
@pytest.mark.parametrize("hoist_w", [True, False])
def test_stream_kernel_matches_reference(seed, N, tile_m, piece_min, x_dtype, w_dtype, M, hoist_w):
    """M = 1 and 7: fewer tiles than blocks (grid = tiles); 33: a partial last tile; 5000: every
    block loops (264 blocks), prefetching its next tile."""
    x = random_rows((M, N), DT[x_dtype], "cuda")
    w = random_weight(N, DT[w_dtype], "cuda")
    y, rstd = _run_stream(x, w, 0.0, tile_m, piece_min, hoist_w=hoist_w)
    y64, rstd64 = reference64(x, w, EPS, 0.0)
    assert_close(y, y64, DT[x_dtype], f"stream tile_m={tile_m} y", seed)
    assert_close(rstd, rstd64, torch.float32, f"stream tile_m={tile_m} rstd", seed)


@pytest.mark.gpu
@pytest.mark.parametrize("N,tile_m,piece_min", STREAM_CASES)
@pytest.mark.parametrize("case", ["offset1", "no_weight", "no_rstd", "offset1_reload_w"])
def test_stream_kernel_offset_no_weight_no_rstd(seed, N, tile_m, piece_min, case):
    x = random_rows((301, N), torch.bfloat16, "cuda")
    w = None if case == "no_weight" else random_weight(N, torch.bfloat16, "cuda")
    offset = 1.0 if case.startswith("offset1") else 0.0
    y, rstd = _run_stream(x, w, offset, tile_m, piece_min, store_rstd=case != "no_rstd",
                          hoist_w=case != "offset1_reload_w", nww=8)
    y64, rstd64 = reference64(x, w, EPS, offset)
    assert_close(y, y64, torch.bfloat16, f"stream {case}", seed)
    if case != "no_rstd":
        assert_close(rstd, rstd64, torch.float32, f"stream {case} rstd", seed)


@pytest.mark.gpu
@pytest.mark.parametrize("tile_m,N", [(16, 512), (1, 4096)])
def test_stream_kernel_full_size_strided_and_launch_chunks(seed, monkeypatch, tile_m, N):
    """The bench's size; then rows with a stride != N; then the int32 limit lowered so the launch is
    cut into row chunks (each chunk's padded tile rows must stay inside the next chunk's rows)."""
    from cutile_norms.cutile import rmsnorm_fwd

    M = (1 << 27) // N
    x = random_rows((M, N), torch.bfloat16, "cuda")
    w = random_weight(N, torch.bfloat16, "cuda")
    y64, rstd64 = reference64(x, w, EPS, 0.0)
    y, _ = _run_stream(x, w, 0.0, tile_m, N)
    assert_close(y, y64, torch.bfloat16, "stream full size", seed)
    xs = random_rows((999, N + 64), torch.bfloat16, "cuda")[:, 24:24 + N]
    y, rstd = _run_stream(xs, w, 0.0, tile_m, N)
    ys64, rstds64 = reference64(xs, w, EPS, 0.0)
    assert_close(y, ys64, torch.bfloat16, "stream strided", seed)
    assert_close(rstd, rstds64, torch.float32, "stream strided rstd", seed)
    xc = x[:1000 + 7]
    monkeypatch.setattr(rmsnorm_fwd, "_MAX_FLAT", 128 * N)  # 112 rows per launch -> 9 launches
    y, rstd = _run_stream(xc, w, 0.0, tile_m, N)
    assert_close(y, y64[:1007], torch.bfloat16, "stream chunked", seed)
    assert_close(rstd, rstd64[:1007], torch.float32, "stream chunked rstd", seed)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("N", [2048, 4096, 8192, 65536])
def test_fp32_weight_with_16_bit_x_is_exact(seed, mode, N):
    """bf16 x with an fp32 weight whose values need all 24 mantissa bits and a wide exponent range
    (passed as int16 planes from 2048 columns): a lost or swapped half would be far off."""
    x = random_rows((33, N), torch.bfloat16, "cuda")
    w = (1 + torch.rand(N, device="cuda")) * torch.exp2(torch.randint(-30, 30, (N,), device="cuda").float())
    w[::7] = -w[::7]
    y, rstd = _run_backend(mode, x, w, 0.0)
    y64, rstd64 = reference64(x, w, EPS, 0.0)
    assert_close(y, y64, torch.bfloat16, f"{mode} fp32 weight", seed)
    assert_close(rstd, rstd64, torch.float32, f"{mode} fp32 weight rstd", seed)


# ------------------------------------------------------------------------------------------------
# GPU: widths just above a power of two, and M * N past int32 indexing without grad
# ------------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("mode", MODES + [None])
@pytest.mark.parametrize("N", [3, 17, 1025, 2049, 4097, 8193, 65537])
@pytest.mark.parametrize("x_dtype,w_dtype", [("bfloat16", "bfloat16"), ("float16", "float32"), ("float32", "float32")])
def test_widths_just_above_a_power_of_two(seed, mode, N, x_dtype, w_dtype):
    """A last piece of one column: the weight's tie to x's loads goes element by element there (its
    bits are no whole number of 32-bit words; this failed to compile in multi_wave_cached)."""
    import cutile_norms as cn

    x = random_rows((37, N), DT[x_dtype], "cuda")
    w = random_weight(N, DT[w_dtype], "cuda")
    assert_close(cn.rms_norm(x, w, EPS, mode=mode), reference64(x, w, EPS, 0.0)[0], DT[x_dtype], f"{mode} N={N}", seed)


@pytest.mark.gpu
@pytest.mark.big
@pytest.mark.parametrize("with_weight", [True, False])
def test_inference_past_int32_indexing(seed, with_weight):
    """M * N > 2^31 (bf16, N = 8192) without grad: the launch is cut into row chunks (ct.launch
    raised OverflowError on a placeholder array of the whole output's length)."""
    import cutile_norms as cn

    N = 8192
    M = (1 << 31) // N + 64
    free, _ = torch.cuda.mem_get_info()
    if free < 3 * M * N * 2 + (4 << 30):
        pytest.skip(f"needs ~{3 * M * N * 2 >> 30} GiB of free GPU memory, {free >> 30} free")
    x = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
    w = random_weight(N, torch.bfloat16, "cuda") if with_weight else None
    with torch.no_grad():
        y = cn.rms_norm(x, w, EPS)
    for rows in (slice(0, 64), slice(M // 2 - 7, M // 2 + 9), slice(M - 64, M)):
        assert_close(y[rows], reference64(x[rows], w, EPS, 0.0)[0], torch.bfloat16, f"rows {rows}", seed)


@pytest.mark.gpu
@pytest.mark.big
@pytest.mark.parametrize("mode", ["multi_wave_cached", "static_persistent"])
def test_expanded_rows_past_int32_indexing(seed, mode):
    """x expanded from one row (row stride 0): its span is one row, but y has M * N > 2^31 elements,
    so the launch is cut into row chunks (the call plans' fast path launched one and ct.launch raised
    OverflowError on y)."""
    import cutile_norms as cn

    N = 8192
    M = (1 << 31) // N + 64
    free, _ = torch.cuda.mem_get_info()
    if free < 2 * M * N * 2 + (4 << 30):
        pytest.skip(f"needs ~{2 * M * N * 2 >> 30} GiB of free GPU memory, {free >> 30} free")
    row = random_rows((1, N), torch.bfloat16, "cuda")
    w = random_weight(N, torch.bfloat16, "cuda")
    with torch.no_grad():
        y = cn.rms_norm(row.expand(M, N), w, EPS, mode=mode)
    assert y.shape == (M, N)
    assert_close(y[:1], reference64(row, w, EPS, 0.0)[0], torch.bfloat16, f"{mode} row 0", seed)
    assert torch.equal(y, y[:1].expand(M, N)), f"{mode}: rows differ from row 0 (a chunk left unwritten?)"
