"""DTensor (cutile_norms/distributed.py) on a one-rank gloo mesh on the CPU: the ops' sharding rules,
eager and under torch.compile, for rms_norm, the residual add and add_rms_norm_. Each result is
compared with the same call on the full tensors (same mode, so the same bits), and each grad's
placement checked (x's for dx, Partial for the weight's where the rows are sharded). Then two ranks
(tests/two_ranks.py through torchrun): tensor + sequence parallel and FSDP2 training of a patched
Llama-shaped model against one device, on 2 CPU processes (gloo) and on 2 GPUs (NCCL).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings

import pytest
import torch
import torch.distributed as dist

import cutile_norms as cn
from cutile_norms import distributed
from tests.conftest import SAME_MATH_FP32_GRAD, random_rows, random_weight

dtensor = pytest.importorskip("torch.distributed.tensor")
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.tensor import Partial, Replicate, Shard, distribute_tensor  # noqa: E402

MODES = ["torch", None, "triton"]


@pytest.fixture(scope="module")
def mesh():
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield init_device_mesh("cpu", (1,))
    dist.destroy_process_group()


def test_rules_registered_when_dtensor_is_imported_after():
    code = ("import cutile_norms, sys; assert 'torch.distributed.tensor' not in sys.modules; "
            "import torch.distributed.tensor; from cutile_norms import distributed; print(distributed._registered)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "True", out.stderr[-2000:]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("placement", [Shard(0), Shard(1), Replicate()], ids=str)
def test_rms_norm_on_shards(mesh, seed, mode, placement):
    x_full = random_rows((4, 6, 64), torch.float32, "cpu")
    w_full = random_weight(64, torch.float32, "cpu")
    x = distribute_tensor(x_full, mesh, [placement]).requires_grad_()
    w = distribute_tensor(w_full, mesh, [Replicate()]).requires_grad_()
    y = cn.rms_norm(x, w, 1e-6, mode=mode)
    assert isinstance(y, dtensor.DTensor) and tuple(y.placements) == (placement,)
    xr, wr = x_full.clone().requires_grad_(), w_full.clone().requires_grad_()
    yr = cn.rms_norm(xr, wr, 1e-6, mode=mode)
    assert torch.equal(y.full_tensor(), yr)
    dy = torch.randn_like(yr)
    y.backward(distribute_tensor(dy, mesh, [placement]))
    yr.backward(dy)
    # dx: on the CPU mode=None runs the reference; the op's closed form and autograd through the
    # reference's ops are both fp32, in different orders
    assert tuple(x.grad.placements) == (placement,)
    assert torch.allclose(x.grad.full_tensor(), xr.grad, **SAME_MATH_FP32_GRAD)
    # rows sharded: each shard's dw is a partial sum (reduced on demand); rows replicated: the whole dw
    allowed = ((Replicate(),),) if isinstance(placement, Replicate) else ((Partial(),), (Replicate(),))
    assert tuple(w.grad.placements) in allowed, w.grad.placements
    assert torch.allclose(w.grad.full_tensor(), wr.grad, **SAME_MATH_FP32_GRAD)


@pytest.mark.parametrize("mode", MODES)
def test_hidden_dim_sharded_warns_once_and_is_right(mesh, seed, mode):
    x_full = random_rows((5, 32), torch.float32, "cpu")
    w_full = random_weight(32, torch.float32, "cpu")
    x = distribute_tensor(x_full, mesh, [Shard(1)])
    w = distribute_tensor(w_full, mesh, [Replicate()])
    distributed._warned.clear()  # once per process and placements: start afresh
    with pytest.warns(UserWarning, match="all-gather per call"):
        y = cn.rms_norm(x, w, 1e-6, mode=mode)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # once: the second call is silent
        cn.rms_norm(x, w, 1e-6, mode=mode)
    assert torch.equal(y.full_tensor(), cn.rms_norm(x_full, w_full, 1e-6, mode=mode))


@pytest.mark.parametrize("mode", [None, "triton"])
def test_residual_add_on_shards(mesh, seed, mode):
    x_full, r_full = random_rows((3, 4, 48), torch.float32, "cpu"), random_rows((3, 4, 48), torch.float32, "cpu")
    w_full = random_weight(48, torch.float32, "cpu")
    x = distribute_tensor(x_full, mesh, [Shard(1)]).requires_grad_()
    r = distribute_tensor(r_full, mesh, [Shard(1)]).requires_grad_()
    w = distribute_tensor(w_full, mesh, [Replicate()]).requires_grad_()
    y, h = cn.rms_norm(x, w, mode=mode, residual=r)
    yr, hr = cn.rms_norm(x_full, w_full, mode=mode, residual=r_full)
    assert torch.equal(y.full_tensor(), yr) and torch.equal(h.full_tensor(), hr)
    (y.sum() + h.sum()).backward()
    assert tuple(x.grad.placements) == (Shard(1),) and tuple(r.grad.placements) == (Shard(1),)
    xi, ri = distribute_tensor(x_full, mesh, [Shard(0)]), distribute_tensor(r_full, mesh, [Shard(0)])
    cn.add_rms_norm_(xi, ri, w.detach(), mode=mode)
    assert torch.equal(ri.full_tensor(), hr) and torch.equal(xi.full_tensor(), yr)


@pytest.mark.parametrize("mode", [None, "triton"])
def test_torch_compile_with_dtensor(mesh, seed, mode):
    x_full, w_full = random_rows((8, 64), torch.float32, "cpu"), random_weight(64, torch.float32, "cpu")
    x = distribute_tensor(x_full, mesh, [Shard(0)])
    w = distribute_tensor(w_full, mesh, [Replicate()])
    compiled = torch.compile(lambda a, b: cn.rms_norm(a, b, 1e-6, mode=mode) * 2, fullgraph=True,
                             backend="aot_eager")
    y = compiled(x, w)
    assert tuple(y.placements) == (Shard(0),)
    assert torch.equal(y.full_tensor(), cn.rms_norm(x_full, w_full, 1e-6, mode=mode) * 2)


@pytest.mark.parametrize("kw", [{}, {"group_size": 32}, {"scale": 0.02}], ids=["token", "group", "static"])
def test_fp8_on_shards(mesh, seed, kw):
    x_full, w_full = random_rows((4, 3, 64), torch.float32, "cpu"), random_weight(64, torch.float32, "cpu")
    x = distribute_tensor(x_full, mesh, [Shard(1)])
    w = distribute_tensor(w_full, mesh, [Replicate()])
    q, s = cn.rms_norm_fp8(x, w, **kw)
    qr, sr = cn.rms_norm_fp8(x_full, w_full, **kw)
    assert tuple(q.placements) == (Shard(1),)
    assert torch.equal(q.full_tensor().float(), qr.float()) and torch.equal(s.full_tensor(), sr)


def test_in_place_needs_matching_placements(mesh):
    x = distribute_tensor(torch.randn(4, 32), mesh, [Shard(0)])
    r = distribute_tensor(torch.randn(4, 32), mesh, [Replicate()])
    with pytest.raises(ValueError, match="same mesh and placements"):
        cn.add_rms_norm_(x, r)
    xs, rs = (distribute_tensor(torch.randn(4, 32), mesh, [Shard(1)]) for _ in range(2))
    with pytest.raises(ValueError, match="normalized dim"):
        cn.add_rms_norm_(xs, rs)


def run_two_ranks(*args: str) -> dict:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           os.path.join(root, "tests", "two_ranks.py"), *args]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=root)
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
    assert lines, f"no result (rc {out.returncode}): {out.stderr[-3000:]}"
    result = json.loads(lines[-1])
    assert out.returncode == 0 and not result["misses"], result["misses"] or out.stderr[-3000:]
    return result


def test_two_cpu_ranks_tensor_sequence_parallel_and_fsdp2():
    """Two gloo ranks, fp32, eager and compiled: every loss and grad against one process."""
    result = run_two_ranks("--device", "cpu", "--dtype", "float32", "--steps", "2")
    assert result["compiled"] == "ran" and result["patched_norms"] == 9


@pytest.mark.gpu
@pytest.mark.big  # alone, with both GPUs visible (tests/run_sharded.py gives each shard one GPU)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_two_gpus_tensor_sequence_parallel_and_fsdp2(dtype):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    result = run_two_ranks("--device", "cuda", "--dtype", dtype, "--steps", "3")
    print(json.dumps(result))
    assert result["compiled"] == "ran"
