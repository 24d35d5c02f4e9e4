"""Public API: rms_norm, RMSNorm as a drop-in for torch.nn.RMSNorm, explain, available_modes (on the CPU),
and the call plans' shapes of a decode step, tensors on another GPU than the current one (on the GPU)."""
import pytest
import torch

import cutile_norms as cn
from cutile_norms import dispatch
from tests.conftest import (VS_TORCH_MODULE, assert_close, assert_stored_sum, check_backward, random_rows, random_weight,
                            reference64)

GPU_MODES = [m for m in dispatch.modes_of() if m != "torch"] + [None]


def test_public_names():
    for name in ["rms_norm", "RMSNorm", "available_modes", "explain", "enable_experimental"]:
        assert callable(getattr(cn, name))
    assert set(cn.available_modes("cpu")) == set(dispatch.modes_of())


def test_available_modes_on_cpu_names_reasons():
    modes = cn.available_modes("cpu")
    assert modes["torch"] is None
    for name in dispatch.modes_of("cutile") + dispatch.modes_of("cute"):
        assert "CPU" in modes[name]


def test_mode_none_on_cpu_runs_the_reference(seed):
    x = random_rows((2, 3, 256), torch.bfloat16, "cpu")
    w = random_weight(256, torch.bfloat16, "cpu")
    y = cn.rms_norm(x, w)
    assert y.shape == x.shape and y.dtype == x.dtype
    assert_close(y, reference64(x, w, 1e-6, 0.0)[0], torch.bfloat16, "mode=None on CPU", seed)


def test_non_contiguous_inputs(seed):
    base = random_rows((6, 512), torch.float32, "cpu")
    strided_rows = base[:, :300]  # row stride 512 != N
    transposed = random_rows((300, 6), torch.float32, "cpu").t()  # last-dim stride != 1
    for x in (strided_rows, transposed):
        w = random_weight(300, torch.float32, "cpu")
        assert_close(cn.rms_norm(x, w), reference64(x, w, 1e-6, 0.0)[0], torch.float32, "non-contiguous", seed)


def test_explain_on_cpu():
    text = cn.explain(torch.randn(4, 8, 128), torch.ones(128))
    assert "M=32, N=128" in text and "mode: torch" in text and "CPU" in text


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_module_is_a_drop_in_for_torch_rmsnorm(seed, dtype):
    ours, theirs = cn.RMSNorm(256, eps=1e-5, dtype=dtype), torch.nn.RMSNorm(256, eps=1e-5, dtype=dtype)
    assert list(ours.state_dict()) == list(theirs.state_dict()) == ["weight"]
    with torch.no_grad():
        theirs.weight.copy_(random_weight(256, dtype, "cpu"))
    ours.load_state_dict(theirs.state_dict())
    theirs.load_state_dict(ours.state_dict())
    x = random_rows((3, 7, 256), dtype, "cpu")
    assert_close(ours(x), reference64(x, theirs.weight, 1e-5, 0.0)[0], dtype, "module", seed)
    assert torch.allclose(ours(x).float(), theirs(x).float(), **VS_TORCH_MODULE)


def test_module_without_affine_and_multi_dim_shape(seed):
    x = random_rows((5, 4, 32), torch.float32, "cpu")
    m = cn.RMSNorm((4, 32), elementwise_affine=False)
    assert m.weight is None and list(m.state_dict()) == []
    expected = reference64(x.reshape(5, 128), None, 1e-6, 0.0)[0].reshape(5, 4, 32)
    assert_close(m(x), expected, torch.float32, "normalized over two dims", seed)


def test_module_offset_initialises_to_unit_scale(seed):
    m = cn.RMSNorm(64, eps=1e-6, offset=1.0)  # the eps the reference below uses (the default is torch's, None)
    assert torch.all(m.weight == 0)  # Gemma: 1 + w with w = 0
    x = random_rows((3, 64), torch.float32, "cpu")
    assert_close(m(x), reference64(x, None, 1e-6, 0.0)[0], torch.float32, "offset init", seed)


def test_module_gradients_reach_the_weight(seed):
    """dx and dw of the module (offset 1, a random weight) against the fp64 closed form."""
    m = cn.RMSNorm(128, eps=1e-6, offset=1.0)
    w = random_weight(128, torch.float32, "cpu") - 1.0
    with torch.no_grad():
        m.weight.copy_(w)
    x = random_rows((4, 128), torch.float32, "cpu").requires_grad_()
    dy = random_rows((4, 128), torch.float32, "cpu")
    m(x).backward(dy)
    check_backward(x.detach(), w, dy, 1.0, x.grad, m.weight.grad, "module offset 1", seed)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(1, 4096), (1, 1, 4096), (8, 1, 2048), (4, 16, 1, 128), (64, 1, 4096), (3, 2, 5, 1024),
                                   (4096,)])
@pytest.mark.parametrize("mode", GPU_MODES, ids=lambda m: str(m))
def test_decode_shapes_through_the_call_plans(mode, shape, seed):
    """The shapes a decode step calls with (2-D, [batch, 1, hidden], QK-norm's [batch, heads, 1, head_dim]),
    without grad, twice (the call plan made, then reused), by `rms_norm` and by the module (its own path to
    the call plan): y in x's shape, against the fp64 reference.
    Before each call the caching allocator is handed a block of NaN bytes of y's size, which an output
    the plan allocates and the kernel leaves unwritten would come back with."""
    why = cn.available_modes().get(mode) if mode is not None else None
    if why:
        pytest.skip(why)
    x = random_rows(shape, torch.bfloat16, "cuda")
    w = random_weight(shape[-1], torch.bfloat16, "cuda")
    expected = reference64(x.reshape(-1, shape[-1]), w, 1e-6, 0.0)[0].reshape(shape)
    module = cn.RMSNorm(shape[-1], eps=1e-6, mode=mode, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        module.weight.copy_(w)
    for call in range(2):
        for how, fn in (("rms_norm", lambda: cn.rms_norm(x, w, 1e-6, mode=mode)), ("module", lambda: module(x))):
            torch.empty_like(x).untyped_storage().fill_(0xFF)  # freed at once: the next block of this size
            with torch.no_grad():
                y = fn()
            assert y.shape == x.shape and y.is_contiguous()
            assert_close(y, expected, torch.bfloat16, f"{how} mode={mode} shape={shape} call {call}", seed)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", GPU_MODES, ids=lambda m: str(m))
def test_rows_further_apart_than_int32_indexing(mode, seed):
    """17 rows of 4096 elements, 2^27 + 64 apart (as x[:, 0] of a [17, 32768, 4096] batch: a 4.3 GiB span
    holding 70 K elements): 16 such rows span past 2^31 elements, the cuTile kernels' flat int32 indexing,
    whose launches come in chunks of 16 rows (they refused these rows). The forward without and with
    grad, dx and dw (dy as far apart), the residual add and its backward, the FP8 output per token."""
    why = cn.available_modes().get(mode) if mode is not None else None
    if why:
        pytest.skip(why)
    M, N, S = 17, 4096, (1 << 27) + 64
    free, _ = torch.cuda.mem_get_info()
    if free < 3 * M * S * 2 + (2 << 30):
        pytest.skip(f"needs ~{3 * M * S * 2 >> 30} GiB of free GPU memory, {free >> 30} free")

    def far_rows():  # only the rows are written: the rest of the span is never read
        t = torch.empty(M * S, dtype=torch.bfloat16, device="cuda").as_strided((M, N), (S, 1))
        return t.copy_(random_rows((M, N), torch.bfloat16, "cuda"))

    x, dy, r = far_rows(), far_rows(), far_rows()
    w = random_weight(N, torch.bfloat16, "cuda")
    tag = f"mode={mode} rows {S} apart"
    with torch.no_grad():
        assert_close(cn.rms_norm(x, w, 1e-6, mode=mode), reference64(x, w, 1e-6, 0.0)[0], torch.bfloat16,
                     f"{tag} no grad", seed)
    xg, wg = x.detach().requires_grad_(), w.detach().clone().requires_grad_()
    y = cn.rms_norm(xg, wg, 1e-6, mode=mode)
    assert_close(y.detach(), reference64(x, w, 1e-6, 0.0)[0], torch.bfloat16, f"{tag} grad path", seed)
    y.backward(dy)
    check_backward(x, w, dy, 0.0, xg.grad, wg.grad, tag, seed)
    with torch.no_grad():
        y, h = cn.add_rms_norm(x, r, w, 1e-6, mode=mode)
    assert_stored_sum(h, x, r, f"{tag} residual h", seed)
    assert_close(y, reference64(h, w, 1e-6, 0.0)[0], torch.bfloat16, f"{tag} residual y", seed)
    xg, rg, wg = x.detach().requires_grad_(), r.detach().requires_grad_(), w.detach().clone().requires_grad_()
    y, h = cn.add_rms_norm(xg, rg, wg, 1e-6, mode=mode)
    y.backward(dy)  # (dy as far apart: the fused backward's rows by its stride)
    check_backward(h.detach(), w, dy, 0.0, xg.grad, wg.grad, f"{tag} residual", seed)
    assert torch.equal(xg.grad, rg.grad), f"{tag}: dx = dr"
    q, s = cn.rms_norm_fp8(x, w, 1e-6, mode=mode)
    qr, sr = cn.rms_norm_fp8(x.contiguous(), w, 1e-6, mode=mode)
    assert torch.equal(q.view(torch.uint8), qr.view(torch.uint8)) and torch.equal(s, sr), \
        f"{tag}: the FP8 output differs from that of the same rows contiguous (the same kernel, another stride)"


def _every_form(x, r, w, mode):
    """Each public form's outputs on these tensors: the no-grad forward, the forward and its dx and dw, the
    residual add's (y, h), the in-place add's x and residual, the FP8 output's (q, scales)."""
    out = {}
    with torch.no_grad():
        out["y"] = cn.rms_norm(x, w, 1e-6, mode=mode)
        out["y, h"] = cn.rms_norm(x, w, 1e-6, mode=mode, residual=r)
        xi, ri = x.clone(), r.clone()
        cn.add_rms_norm_(xi, ri, w, 1e-6, mode=mode)
        out["add_rms_norm_"] = (xi, ri)
        if mode in (None, "triton", "tma_smem_cached"):  # the modes with an FP8 kernel or path
            out["fp8"] = cn.rms_norm_fp8(x, w, 1e-6, mode=mode)[:2]
    xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = cn.rms_norm(xg, wg, 1e-6, mode=mode)
    y.backward(torch.ones_like(y) + x)
    out["training y, dx, dw"] = (y.detach(), xg.grad, wg.grad)
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("N", [4096, 32768])
@pytest.mark.parametrize("mode", GPU_MODES, ids=lambda m: str(m))
def test_tensors_on_another_gpu_than_the_current_one(mode, N, seed):
    """A model spread over the GPUs of one process (transformers' device_map="auto") calls its later layers'
    norms with cuda:0 still current: every form runs on x's GPU, its outputs there and bit-identical to the same
    calls made with that GPU current (a kernel launched on the current GPU would read another GPU's memory)."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    why = cn.available_modes("cuda:1").get(mode) if mode is not None else None
    if why:
        pytest.skip(why)
    x = random_rows((64, N), torch.bfloat16, "cuda:1")
    r = random_rows((64, N), torch.bfloat16, "cuda:1")
    w = random_weight(N, torch.bfloat16, "cuda:1")
    with torch.cuda.device(0):  # first: the call plans are made (and the kernels built) with cuda:0 current
        got = _every_form(x, r, w, mode)
        assert torch.cuda.current_device() == 0, f"mode={mode}: a call left another GPU current"
        torch.cuda.synchronize(1)
    with torch.cuda.device(1):
        expected = _every_form(x, r, w, mode)
        torch.cuda.synchronize()
    for form, want in expected.items():
        for i, (a, b) in enumerate(zip(got[form] if isinstance(got[form], tuple) else (got[form],),
                                       want if isinstance(want, tuple) else (want,))):
            assert a.device == x.device, f"mode={mode} N={N} {form}[{i}] on {a.device} [seed {seed}]"
            if a.element_size() == 1 and a.is_floating_point():  # (FP8: compared as bytes)
                a, b = a.view(torch.uint8), b.view(torch.uint8)
            assert torch.equal(a, b), f"mode={mode} N={N} {form}[{i}] differs with cuda:0 current [seed {seed}]"


def test_calls_switch_to_the_gpu_their_tensors_lie_on(monkeypatch):
    """_platform.on_its_gpu (every custom op's implementation) and on_gpu (the call plans): with several
    GPUs, a call on a tensor of a GPU other than the current one runs with that GPU current, and one on the current
    GPU's tensor, a CPU tensor or with one GPU runs as it is (fake CUDA tensors stand in for real ones here; the
    GPU test above runs the forms themselves on cuda:1)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from cutile_norms import _platform

    seen = []

    class Device:  # torch.cuda.device, recorded
        def __init__(self, index):
            self.index = index

        def __enter__(self):
            seen.append(("enter", self.index))

        def __exit__(self, *exc):
            seen.append("exit")

    monkeypatch.setattr(torch.cuda, "device", Device)
    monkeypatch.setattr(_platform, "current_gpu", lambda: 0)
    monkeypatch.setattr(_platform, "_GPU_COUNT", [2])
    with FakeTensorMode(allow_non_fake_inputs=True):
        on1, on0 = torch.empty(2, device="cuda:1"), torch.empty(2, device="cuda:0")
    run = _platform.on_its_gpu(lambda t, tag=None: seen.append(tag))
    run(on1, tag="cuda:1")
    run(on0, tag="cuda:0")
    run(torch.empty(2), tag="cpu")
    assert seen == [("enter", 1), "cuda:1", "exit", "cuda:0", "cpu"]
    seen.clear()  # a call plan of cuda:1's tensors, then of cuda:0's (on_gpu: the plan's GPU fixed by its key)
    _platform.on_gpu(lambda: seen.append("plan 1"), 1)()
    _platform.on_gpu(lambda: seen.append("plan 0"), 0)()
    assert seen == [("enter", 1), "plan 1", "exit", "plan 0"]
    seen.clear()
    monkeypatch.setattr(_platform, "_GPU_COUNT", [1])
    run(on1, tag="one GPU")
    assert seen == ["one GPU"]
