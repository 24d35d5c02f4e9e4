"""Shared test machinery: the GPU gate, fresh seeds, tolerances, and the fp64 oracle.

Every check draws fresh random inputs (the seed is printed in any failure message so a failure can be
replayed with CUTILE_NORMS_TEST_SEED=<seed>), poisons outputs with NaN before a kernel runs, and
compares against the fp64 reference with the per-dtype tolerances below; NaN never passes.
"""
from __future__ import annotations

import atexit
import os
import secrets
import shutil
import tempfile

import pytest
import torch

# The compile cache on disk (cutile_norms/_diskcache.py) in a folder of this run's, not the user's
# (tests/run_sharded.py sets one for all its shards, so they share cuTile's and CuTe's compiles);
# a folder made here is removed at exit
if "CUTILE_NORMS_CACHE_DIR" not in os.environ:
    os.environ["CUTILE_NORMS_CACHE_DIR"] = tempfile.mkdtemp(prefix="cutile_norms_test_cache_")
    atexit.register(shutil.rmtree, os.environ["CUTILE_NORMS_CACHE_DIR"], ignore_errors=True)

# Without a GPU, Triton runs its kernels in its interpreter on CPU tensors (tests/triton/): set before
# anything imports triton's jit
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from cutile_norms.reference import fp8_quantize, fp8_scale, rms_norm_reference

# |y - ref| <= atol + rtol * |ref|, ref in fp64 (not rounded). bf16/fp16: one unit in the last place
# of the output dtype (the kernels round an fp32 result once: <= half an ulp, plus fp32 math error far
# below that); fp32: fp32 rounding over an N-term sum plus rsqrt.approx (~2 ulp); atol only covers
# values near zero / subnormals.
TOLERANCES = {
    torch.bfloat16: dict(rtol=2 ** -7, atol=1e-5),
    torch.float16: dict(rtol=2 ** -10, atol=1e-6),
    torch.float32: dict(rtol=2e-5, atol=1e-6),
}

# The comparisons that are not a kernel against the fp64 oracle, each with its reason:
# fp32 on both sides (a patched model against the original, ours against torch's module): they differ
# only in fp32 rounding order (rsqrt, the mean, where w is applied), which a residual stream and an lm
# head can grow a little; far below any real mistake (a dropped offset or a wrong eps moves results by
# >= 1e-3 relative). Gradients go through more fp32 ops.
SAME_MATH_FP32 = dict(rtol=1e-5, atol=1e-5)
SAME_MATH_FP32_GRAD = dict(rtol=1e-4, atol=1e-5)
# fp32 under torch.compile: inductor reorders the sum of squares
INDUCTOR_FP32 = dict(rtol=1e-4, atol=1e-4)
# two implementations that each round to 16 bits (ours and torch's, eager and compiled): one 16-bit
# rounding apart at most, plus bf16's 2^-8 relative step on the way
TWO_ROUNDINGS_16BIT = dict(rtol=2e-2, atol=2e-2)
# dw of a bf16 training step: an fp32 sum over M rows, rounded to the weight's dtype once
DW_SUM = dict(rtol=1e-3, atol=1e-3)
# fp64 closed form against fp64 autograd: the same math in fp64
FP64_SAME_MATH = dict(rtol=1e-10, atol=1e-12)
# ours against torch.nn.RMSNorm in a 16-bit dtype: torch's module rounds in between (its math type is
# x's dtype for some ops), two 16-bit roundings apart at most; VS_TORCH_SMALL_ROWS: rows scaled to 1e-4
# where eps matters (atol at the rows' scale)
VS_TORCH_MODULE = dict(rtol=2 ** -6, atol=1e-4)
VS_TORCH_SMALL_ROWS = dict(rtol=1e-2, atol=1e-5)


def gpu_skip_reason() -> str | None:
    if not torch.cuda.is_available():
        return "no CUDA GPU"
    if getattr(torch.version, "hip", None):
        return "ROCm device: the cuTile/CuTe kernels are NVIDIA-only"
    if torch.cuda.get_device_capability() < (9, 0):
        return f"compute capability {torch.cuda.get_device_capability()} < 9.0"
    return None


SHARD_VAR = "CUTILE_NORMS_TEST_SHARD"  # "i/k": run every k-th collected test from the i-th (tests/run_sharded.py)


def pytest_collection_modifyitems(config, items):
    reason = gpu_skip_reason()
    if reason:
        skip = pytest.mark.skip(reason=f"GPU test: {reason}")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)
    shard = os.environ.get(SHARD_VAR)
    if shard:
        i, k = (int(v) for v in shard.split("/"))
        keep = [item for n, item in enumerate(items) if n % k == i]
        config.hook.pytest_deselected(items=[item for n, item in enumerate(items) if n % k != i])
        items[:] = keep


@pytest.fixture(autouse=True)
def _shard_memory():
    """In a shard (tests/run_sharded.py) each process keeps to its share of the GPU's memory and
    returns its cached blocks after every test: 12 shards that each kept their allocator's cache ran
    an H100 out of memory."""
    shard = os.environ.get(SHARD_VAR)
    if shard and torch.cuda.is_available():
        k = int(shard.split("/")[1])
        torch.cuda.set_per_process_memory_fraction(min(1.0, 0.92 / k))
    yield
    if shard and torch.cuda.is_available():
        torch.cuda.empty_cache()


@pytest.fixture
def seed() -> int:
    """A fresh seed per test (or CUTILE_NORMS_TEST_SEED to replay one), already applied to torch."""
    s = int(os.environ.get("CUTILE_NORMS_TEST_SEED", secrets.randbits(31)))
    torch.manual_seed(s)
    return s


def random_rows(shape, dtype, device, scale: float = 1.0) -> torch.Tensor:
    """Random normal values with a random per-row scale (rows of very different magnitude)."""
    x = torch.randn(shape, dtype=torch.float32, device=device)
    row_scale = torch.exp(torch.randn(shape[:-1] + (1,), device=device)) * scale
    return (x * row_scale).to(dtype)


def random_weight(n, dtype, device) -> torch.Tensor:
    return (1.0 + 0.5 * torch.randn(n, device=device)).to(dtype)


def reference64(x, weight, eps, offset):
    """(y, rstd) in fp64 (y NOT rounded to x's dtype)."""
    xc = x.double()
    rstd = torch.rsqrt(xc.square().mean(dim=-1) + eps)
    y = xc * rstd.unsqueeze(-1)
    if weight is not None:
        y = y * (weight.double() + offset)
    return y, rstd


def assert_close(actual: torch.Tensor, expected64: torch.Tensor, dtype: torch.dtype, what: str, seed: int):
    """actual (any dtype) vs the fp64 expectation, per-dtype tolerance; NaN/inf never pass."""
    assert actual.shape == expected64.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected64.shape)}"
    assert torch.isfinite(expected64).all(), f"{what}: the reference is not finite (compare such rows another way)"
    a = actual.double()
    bad_values = ~torch.isfinite(a)
    assert not bad_values.any(), (f"{what}: {int(bad_values.sum())} non-finite values (unwritten output?) "
                                  f"[seed {seed}]")
    tol = TOLERANCES[dtype]
    err = (a - expected64).abs()
    limit = tol["atol"] + tol["rtol"] * expected64.abs()
    over = err > limit
    assert not over.any(), (f"{what}: {int(over.sum())}/{a.numel()} elements out of tolerance {tol}; "
                            f"worst abs err {err.max().item():.3g} [seed {seed}]")


def poisoned(t):
    """t (or None) filled with NaN bytes in every float type, padding included: an element a kernel
    does not write fails the comparison."""
    if t is not None:
        t.untyped_storage().fill_(0xFF)
    return t


def poison_next_allocations(nbytes, device) -> None:
    """On a GPU, blocks of these byte sizes filled with 0xFF (NaN in every float type) and freed: the
    caching allocator hands them to the next tensors of those sizes, the outputs a kernel's wrapper
    allocates, so one it leaves unwritten fails the comparison. Nothing on the CPU (no caching)."""
    if torch.device(device).type == "cuda":
        blocks = [torch.full((n,), 255, dtype=torch.uint8, device=device) for n in nbytes]
        torch.cuda.synchronize()
        del blocks


def assert_stored_sum(h, x, r, what, seed, interpreted_kernel=False):
    """h (the residual add's output) against x + r summed in fp32 and rounded once to h's dtype: bit for
    bit, or within one ulp where `interpreted_kernel` wrote a bf16 h (Triton's interpreter converts fp32
    to bf16 by truncation)."""
    expected = (x.float() + r.float()).to(h.dtype)
    assert torch.isfinite(h.float()).all(), f"{what}: non-finite h (unwritten?) [seed {seed}]"
    if interpreted_kernel and h.dtype == torch.bfloat16:
        err = (h.double() - expected.double()).abs()
        assert (err <= expected.double().abs() * 2 ** -7).all(), f"{what}: h off by more than one ulp [seed {seed}]"
    else:
        assert torch.equal(h, expected), f"{what}: h is not the fp32 sum rounded once [seed {seed}]"


def check_forward(x, w, eps, offset, y, rstd, what, seed):
    """A forward kernel's y (and rstd, unless None) against the fp64 reference."""
    ey, er = reference64(x, w, eps, offset)
    assert_close(y, ey, x.dtype, f"{what} y", seed)
    if rstd is not None:
        assert_close(rstd, er, torch.float32, f"{what} rstd", seed)


def reference_bwd64(x, w, dy, eps, offset):
    """(dx, dw, dx_scale, dw_scale) in fp64: the closed form, and the magnitudes of the terms each
    element is made of (the fp32 kernel's rounding is relative to those, not to a result near 0)."""
    xc, dyc = x.double(), dy.double()
    rstd = torch.rsqrt(xc.square().mean(dim=-1, keepdim=True) + eps)
    xhat = xc * rstd
    g = dyc if w is None else dyc * (w.double() + offset)
    c = (g * xhat).mean(dim=-1, keepdim=True)
    dx = rstd * (g - xhat * c)
    dx_scale = rstd * (g.abs() + xhat.abs() * (g * xhat).abs().mean(dim=-1, keepdim=True))
    dw = (dyc * xhat).sum(dim=0) if w is not None else None
    dw_scale = (dyc * xhat).abs().sum(dim=0) if w is not None else None
    return dx, dw, dx_scale, dw_scale


def assert_grad_close(actual, expected64, scale64, dtype, what, seed):
    """|actual - expected| <= rtol(dtype) * |expected| + 2^-16 * scale + atol; NaN/inf never pass."""
    assert actual is not None, f"{what}: not computed"
    assert actual.shape == expected64.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected64.shape)}"
    assert torch.isfinite(expected64).all(), f"{what}: the reference is not finite (compare such rows another way)"
    a = actual.double()
    bad = ~torch.isfinite(a)
    assert not bad.any(), f"{what}: {int(bad.sum())} non-finite values (unwritten output?) [seed {seed}]"
    tol = TOLERANCES[dtype]
    err = (a - expected64).abs()
    over = err > tol["atol"] + tol["rtol"] * expected64.abs() + 2.0 ** -16 * scale64
    assert not over.any(), (f"{what}: {int(over.sum())}/{a.numel()} elements out of tolerance; worst abs err "
                            f"{err.max().item():.3g} at {int(err.argmax())} [seed {seed}]")


def check_backward(x, w, dy, offset, dx, dw, what, seed, need_dx=True, need_dw=True, eps=1e-6, dh=None):
    """A backward's dx and dw (those asked for) against the fp64 closed form: the dtypes, then
    assert_grad_close. `dh` (the residual add's backward): expected in dx, its magnitude in the scale."""
    ex, ew, sx, sw = reference_bwd64(x, w, dy, eps, offset)
    if dh is not None:
        ex, sx = ex + dh.double(), sx + dh.double().abs()
    if need_dx:
        assert dx.dtype == x.dtype
        assert_grad_close(dx, ex, sx, x.dtype, f"{what} dx", seed)
    if need_dw and w is not None:
        assert dw.dtype == w.dtype
        assert_grad_close(dw, ew, sw, w.dtype, f"{what} dw", seed)



def check_backward_past_2_31(run, N, seed, eps=1e-6):
    """A backward over M * N > 2^31 bf16 elements (int64 row offsets): `run(x, w, dy)` -> (dx, dw);
    dx checked on rows at both ends, dw against an fp64 reference summed in row chunks (a whole one
    would not fit in memory)."""
    M = (1 << 31) // N + 5
    x = torch.randn(M, N, dtype=torch.bfloat16, device="cuda")
    w = random_weight(N, torch.bfloat16, "cuda")
    dy = torch.randn(M, N, dtype=torch.bfloat16, device="cuda")
    dx, dw = run(x, w, dy)
    rows = torch.cat([torch.arange(3), torch.arange(M - 3, M)]).cuda()
    rdx, _, dxs, _ = reference_bwd64(x[rows], w, dy[rows], eps, 0.0)
    assert_grad_close(dx[rows], rdx, dxs, torch.bfloat16, "dx head and tail rows", seed)
    rdw = torch.zeros(N, dtype=torch.float64, device="cuda")
    dws = torch.zeros_like(rdw)
    for r0 in range(0, M, 4096):
        xc, dyc = x[r0:r0 + 4096].double(), dy[r0:r0 + 4096].double()
        t = dyc * xc * torch.rsqrt(xc.square().mean(dim=-1, keepdim=True) + eps)
        rdw += t.sum(dim=0)
        dws += t.abs().sum(dim=0)
    assert_grad_close(dw, rdw, dws, torch.bfloat16, "dw", seed)


def check_graph_forward_backward(mode, M, N, seed, eps=1e-6):
    """rms_norm(mode=mode) forward + backward captured in one CUDA graph (after two warm-up runs on a
    side stream, which compile outside the capture) and replayed three times with new x and dy, the
    grads poisoned before each replay and checked against the fp64 closed form; then an eager
    forward + backward on the same stream (whatever counters, slots or tickets the kernels keep must
    be back in their starting state)."""
    import cutile_norms as cn

    x = random_rows((M, N), torch.bfloat16, "cuda").requires_grad_()
    w = random_weight(N, torch.bfloat16, "cuda").requires_grad_()
    dy = random_rows((M, N), torch.bfloat16, "cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            cn.rms_norm(x, w, eps, mode=mode).backward(dy)
            x.grad = w.grad = None
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        cn.rms_norm(x, w, eps, mode=mode).backward(dy)
    for i in range(3):
        with torch.no_grad():
            x.copy_(random_rows((M, N), torch.bfloat16, "cuda"))
            dy.copy_(random_rows((M, N), torch.bfloat16, "cuda"))
            x.grad.fill_(float("nan"))
            w.grad.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        check_backward(x.detach(), w.detach(), dy, 0.0, x.grad, w.grad, f"{mode} graph replay {i}", seed, eps=eps)
    x2 = random_rows((M, N), torch.bfloat16, "cuda").requires_grad_()
    w2 = w.detach().clone().requires_grad_()
    cn.rms_norm(x2, w2, eps, mode=mode).backward(dy)
    check_backward(x2.detach(), w2.detach(), dy, 0.0, x2.grad, w2.grad, f"{mode} eager after graph", seed, eps=eps)


__all__ = ["TOLERANCES", "random_rows", "random_weight", "reference64", "assert_close", "poisoned", "check_forward",
           "reference_bwd64",
           "assert_grad_close", "rms_norm_reference", "poison_next_allocations"]


def same_bits_or_both_nan(a, b) -> bool:
    """Equal values with equal signs (-0.0 is not +0.0), and NaN in the same places (NaN payloads aside)."""
    na, nb = torch.isnan(a), torch.isnan(b)
    if not torch.equal(na, nb):
        return False
    a, b = a[~na], b[~nb]
    return torch.equal(a, b) and torch.equal(torch.signbit(a), torch.signbit(b))


def fp8_reference(y, out_dtype, scale=None, group=None, ub=None, ue8m0=False):
    """(scales, q) by the reference quantizer (reference.fp8_scale, reference.fp8_quantize) from y (fp32,
    computed in the kernel's op order from its rstd): `scale` given (per tensor), 1 x `group` scales, or
    per row."""
    if scale is not None:
        return scale, fp8_quantize(y, scale, out_dtype)
    if group:
        yg = y.unflatten(-1, (y.shape[-1] // group, group))
        s = fp8_scale(yg.abs().amax(-1), out_dtype, ub, ue8m0)
        return s, fp8_quantize(yg, s.unsqueeze(-1), out_dtype).flatten(-2)
    s = fp8_scale(y.abs().amax(-1), out_dtype, ub)
    return s, fp8_quantize(y, s.unsqueeze(-1), out_dtype)
