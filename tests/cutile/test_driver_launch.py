"""The cuTile kernels' driver launch (cutile_norms/cutile/_driver_launch.py).

CPU: for every kernel variant the forward and backward launch with 1-D arguments, the parameter layout
predicted from the kernel's signature matches the compiled kernel's PTX `.entry` (the ABI the driver
path packs), and what the path refuses (clusters, dynamic shared memory, no fixed block size).
GPU: the driver path and `ct.launch` give bit-identical results (forward y and rstd, backward dx and
dw) over widths, batch sizes, dtypes, a weight or none, misaligned rows; each of those launch sites
really ran through the driver.
"""
from __future__ import annotations

import io

import pytest
import torch

from cuda.tile.compilation import export_kernel

from cutile_norms._platform import DeviceInfo
from cutile_norms.cutile import _driver_launch as DL
from cutile_norms.cutile import rmsnorm_bwd, rmsnorm_fwd
from tests.conftest import poisoned, random_rows, random_weight
from tests.cutile.compile_util import CT_DTYPES

H100 = DeviceInfo("nvidia", "H100 (simulated)", (9, 0), 132)
DT = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def _named(kernel, sig):
    """The signature with the symbol the launch's signature (KernelSignature.from_kernel_args) gets."""
    return sig.with_mangled_symbol(kernel._annotated_function.pyfunc.__name__)


def _exported(kernel, sig, arch="sm_90") -> str:
    buf = io.BytesIO()
    export_kernel(kernel, [sig], buf, gpu_code=arch, output_format="cubin")
    return DL.embedded_ptx(buf.getvalue())


# ------------------------------------------------------------------------------------------------
# CPU: the ABI
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["multi_wave_cached", "static_persistent", "multi_wave_reload"])
@pytest.mark.parametrize("N", [128, 4096, 4097, 65536])
@pytest.mark.parametrize("dtypes", [("bfloat16", "bfloat16"), ("float32", "float32")])
@pytest.mark.parametrize("has_w", [True, False])
def test_forward_layout_matches_the_compiled_entry(mode, N, dtypes, has_w):
    cfg = rmsnorm_fwd.default_config(mode, N, DT[dtypes[0]].itemsize, H100, dtypes[0])
    kernel, sig = rmsnorm_fwd.export_signature(cfg, N, CT_DTYPES[dtypes[0]], CT_DTYPES[dtypes[1]], has_w)
    sig = _named(kernel, sig)
    arrays, scalars, consts, slots = DL.parameter_slots(sig)
    types, block = DL.entry_layout(_exported(kernel, sig), sig.symbol)
    DL.check_layout(types, slots)  # raises on a mismatch
    n_arrays = 5 if cfg.kernel == "split" else 4
    assert len(arrays) == n_arrays and len(scalars) == 4
    assert len(types) == sum(1 + 2 * a.ndim for a in arrays) + 4 == len(slots)
    assert [a.ndim for a in arrays][2] == (2 if rmsnorm_fwd.row_pad(cfg) > 1 else 1)  # y: 2-D for the stream kernel
    assert [f for f, _ in slots[-4:]] == ["i4x", "i4x", "f4x", "f4x"]  # M, row stride, eps, offset
    assert block[0] % 32 == 0 and block[1:] == (1, 1)
    assert [i for i, _ in consts] == list(range(len(sig.parameters) - len(consts), len(sig.parameters)))


@pytest.mark.parametrize("N", [128, 2880, 4096, 16384, 262144])
@pytest.mark.parametrize("need_dx,need_dw", [(True, True), (True, False), (False, True)])
def test_backward_layout_matches_the_compiled_entry(N, need_dx, need_dw):
    cfg = rmsnorm_bwd.default_config(N, 2, H100, "bfloat16")
    kernel, sig = rmsnorm_bwd.export_signature(cfg, N, CT_DTYPES["bfloat16"], CT_DTYPES["bfloat16"],
                                               need_dx=need_dx, need_dw=need_dw)
    sig = _named(kernel, sig)
    arrays, scalars, consts, slots = DL.parameter_slots(sig)
    types, block = DL.entry_layout(_exported(kernel, sig), sig.symbol)
    DL.check_layout(types, slots)
    assert len(arrays) == 9 and len(scalars) == 6
    assert [a.ndim for a in arrays][4] == (2 if rmsnorm_bwd.dx_2d(cfg, N) else 1)  # dx
    assert len(types) == sum(1 + 2 * a.ndim for a in arrays) + 6 == len(slots)


def _check(arrays, scalars, consts, nargs, args):
    return DL.argument_check(arrays, scalars, consts, nargs, DL._alias_pattern(arrays, args), on_gpu=False)


def test_argument_check_accepts_what_it_was_built_for_and_nothing_else():
    """The generated check of a variant: x [N] bf16 16-byte aligned with length % 16, a 2-D y with
    unit column stride, M int32, eps float, two trailing constants; and what breaks each assumption."""
    import cuda.tile as ct

    N = 64
    x = torch.randn(N).to(torch.bfloat16)
    y = torch.empty(4, N, dtype=torch.bfloat16)
    arrays = [DL.ArrayParam(0, torch.bfloat16, 16, (16,), (None,), (1,), (1,), (None,), True, True),
              DL.ArrayParam(1, torch.bfloat16, 16, (1, 16), (4, None), (None, 1), (8, 1), (0, None), True, True)]
    scalars, consts = [(2, ct.int32), (3, ct.float32)], [(4, N), (5, True)]
    good = (x, y, 4, 1e-6, N, True)
    values = _check(arrays, scalars, consts, 6, good)
    assert values(good) == (x.data_ptr(), N, 1, y.data_ptr(), 4, N, N, 1, 4, 1e-6)
    bad = {
        "constant": (x, y, 4, 1e-6, N, False),
        "dtype": (x.half(), y, 4, 1e-6, N, True),
        "misaligned": (torch.randn(N + 16).to(torch.bfloat16)[1:N + 1], y, 4, 1e-6, N, True),
        "length": (x[:N - 8], y, 4, 1e-6, N, True),
        "2-D for 1-D": (x.view(4, 16), y, 4, 1e-6, N, True),
        "column stride": (x, y.t().contiguous().t(), 4, 1e-6, N, True),
        "row stride % 8": (x, torch.empty(4, N + 4, dtype=torch.bfloat16)[:, :N], 4, 1e-6, N, True),
        "constant rows": (x, torch.empty(5, N, dtype=torch.bfloat16), 4, 1e-6, N, True),
        "overlapping rows": (x, y[:1].expand(4, N), 4, 1e-6, N, True),
        "int32 range": (x, y, 1 << 31, 1e-6, N, True),
        "int type": (x, y, 4.0, 1e-6, N, True),
        "shared start": (x, x.view(1, N), 4, 1e-6, N, True),
        "not a tensor": (3, y, 4, 1e-6, N, True),
        "arity": good[:-1],
    }
    for why, args in bad.items():
        assert values(args) is None, why


def test_argument_check_keeps_the_shared_starts_it_was_built_with():
    import cuda.tile as ct

    a = torch.randn(32)
    arrays = [DL.ArrayParam(k, torch.float32, 16, (16,), (None,), (1,), (1,), (None,), True, False) for k in range(3)]
    values = _check(arrays, [(3, ct.int32)], [], 4, (a, a, torch.randn(32), 1))
    assert values((a, a, torch.randn(32), 1)) is not None
    b = torch.randn(32)
    assert values((a, b, torch.randn(32), 1)) is None  # no longer shared
    assert values((a, a, a, 1)) is None  # shared by one more


def test_layout_mismatch_is_refused():
    slots = [("Q", 64), ("i4x", 32), ("i4x", 32)]
    DL.check_layout(["u64", "u32", "u32"], slots)
    with pytest.raises(ValueError, match="layout"):
        DL.check_layout(["u64", "u32"], slots)
    with pytest.raises(ValueError, match="layout"):
        DL.check_layout(["u64", "u64", "u32"], slots)


_PTX = """.visible .entry k(
.param .u64 .ptr .global .align 1 k_param_0,
.param .u32 k_param_1,
.param .f32 k_param_2
)
{directives}
{{
{body}
}}"""


def test_entry_layout_reads_types_and_block():
    types, block = DL.entry_layout(_PTX.format(directives=".reqntid 256", body="ret;"), "k")
    assert types == ["u64", "u32", "f32"] and block == (256, 1, 1)
    _, block = DL.entry_layout(_PTX.format(directives=".reqntid 32, 4, 1", body="ret;"), "k")
    assert block == (32, 4, 1)


@pytest.mark.parametrize("directives,body,why", [
    (".maxntid 256", "ret;", "reqntid"),
    (".reqntid 128\n.reqnctapercluster 2, 1, 1", "ret;", "clusters"),
    (".reqntid 128", ".extern .shared .align 16 .b8 smem[];", "dynamic shared"),
])
def test_entry_layout_refuses(directives, body, why):
    with pytest.raises(ValueError, match=why):
        DL.entry_layout(_PTX.format(directives=directives, body=body), "k")
    with pytest.raises(ValueError, match="no .entry"):
        DL.entry_layout(_PTX.format(directives=directives, body=body), "other")


def test_entry_layout_refuses_array_parameters():
    ptx = ".visible .entry k(\n.param .align 8 .b8 k_param_0[16]\n)\n.reqntid 128\n{\nret;\n}"
    with pytest.raises(ValueError, match="not a scalar"):
        DL.entry_layout(ptx, "k")


# ------------------------------------------------------------------------------------------------
# GPU: the driver path against ct.launch, bit for bit
# ------------------------------------------------------------------------------------------------
def _both_paths(monkeypatch, fn):
    """fn() through the driver path, then through ct.launch (the path switched off)."""
    monkeypatch.setattr(DL, "_ENABLED", True)
    a = fn()
    torch.cuda.synchronize()
    monkeypatch.setattr(DL, "_ENABLED", False)
    b = fn()
    torch.cuda.synchronize()
    return a, b


def _same(a, b, what):
    assert a is not None and b is not None, what
    assert torch.isfinite(a.float()).all(), f"{what}: non-finite values (unwritten output?)"
    assert torch.equal(a, b), f"{what}: driver path and ct.launch differ ({int((a != b).sum())} elements)"


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["multi_wave_cached", "static_persistent", "multi_wave_reload"])
@pytest.mark.parametrize("N,M", [(128, 1), (4096, 1), (4096, 64), (4096, 1000), (2880, 33), (4097, 3),
                                 (65536, 5)])
@pytest.mark.parametrize("dtypes", [("bfloat16", "bfloat16"), ("float16", "float32"), ("float32", "float32"),
                                    ("bfloat16", None)])
def test_forward_driver_path_equals_ct_launch(monkeypatch, seed, mode, N, M, dtypes):
    import cutile_norms as cn
    from cutile_norms._platform import device_info

    x_dtype, w_dtype = DT[dtypes[0]], DT.get(dtypes[1])
    x = random_rows((M, N), x_dtype, "cuda")
    w = random_weight(N, w_dtype, "cuda") if w_dtype else None
    dev = device_info("cuda")
    be = cn.dispatch.backend(mode)
    run = be.launcher(M, N, N, x_dtype, w_dtype, True, dev)

    def fwd():
        y, rstd = run(x, w, 1e-6, 0.0, None)
        return y.clone(), rstd.clone()

    (ya, ra), (yb, rb) = _both_paths(monkeypatch, fwd)
    _same(ya, yb, f"y [{seed}]")
    _same(ra, rb, f"rstd [{seed}]")
    cfg = be.config(N, x_dtype, dev)
    if rmsnorm_fwd.launcher(cfg, N, N, x_dtype, w_dtype, True, dev.sm_count) is not None:
        kernel, consts = rmsnorm_fwd._prepared(cfg, N, rmsnorm_fwd._align_elems(N, x.element_size()),
                                               w is not None, True, 0)
        site = DL.driver_launch(kernel, consts)
        assert site.disabled is None and site.variants.get(x.device.index), site.disabled


@pytest.mark.gpu
@pytest.mark.parametrize("N,M", [(128, 1), (4096, 1), (4096, 64), (4096, 1024), (2880, 200), (8192, 7),
                                 (16384, 3), (4097, 50)])
@pytest.mark.parametrize("dtypes", [("bfloat16", "bfloat16"), ("float16", "float32"), ("float32", "float32"),
                                    ("bfloat16", None)])
@pytest.mark.parametrize("misaligned", [False, True])
def test_backward_driver_path_equals_ct_launch(monkeypatch, seed, N, M, dtypes, misaligned):
    from cutile_norms._platform import device_info

    x_dtype, w_dtype = DT[dtypes[0]], DT.get(dtypes[1])
    dev = device_info("cuda")
    x = random_rows((M, N + 1), x_dtype, "cuda")[:, 1:] if misaligned else random_rows((M, N), x_dtype, "cuda")
    dy = random_rows((M, N), x_dtype, "cuda")
    w = random_weight(N, w_dtype, "cuda") if w_dtype else None
    rstd = torch.rsqrt(x.float().square().mean(-1) + 1e-6).contiguous()
    cfg = rmsnorm_bwd.default_config(N, x.element_size(), dev, dtypes[0], w_dtype == torch.float32)

    def bwd():
        dx = poisoned(rmsnorm_bwd.dx_buffer(cfg, M, N, x_dtype, "cuda"))
        dw = poisoned(torch.empty(N, dtype=w_dtype, device="cuda")) if w is not None else None
        dx, dw = rmsnorm_bwd.launch(cfg, dy, x, w, rstd, 0.0, True, w is not None, dev.sm_count, out=(dx, dw))
        return dx.clone(), None if dw is None else dw.clone()

    (dxa, dwa), (dxb, dwb) = _both_paths(monkeypatch, bwd)
    _same(dxa, dxb, f"dx [{seed}]")
    if w is not None:
        _same(dwa, dwb, f"dw [{seed}]")


@pytest.mark.gpu
def test_the_batch_one_call_runs_through_the_driver(seed):
    """cn.rms_norm at N = 4096, M = 1 (the host-bound decode call) and its backward: both launch
    sites ran through the driver, not ct.launch."""
    import cutile_norms as cn

    DL._SITES.clear()
    x = random_rows((1, 4096), torch.bfloat16, "cuda").requires_grad_()
    w = random_weight(4096, torch.bfloat16, "cuda").requires_grad_()
    y = cn.rms_norm(x, w, mode="multi_wave_cached")
    y.backward(torch.randn_like(y))
    torch.cuda.synchronize()
    sites = list(DL._SITES.values())
    assert len(sites) >= 2, "expected a forward and a backward launch site"
    for s in sites:
        assert s.disabled is None and s.variants, s.disabled
