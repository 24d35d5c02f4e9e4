"""Two ranks training a patched Llama-shaped model: tensor + sequence parallel (TorchTitan's plan:
`SequenceParallel` on the norms, Shard(1) activations between blocks) and FSDP2 (`fully_shard`),
eager and under torch.compile, each against the same model trained on one device. Run by
tests/test_distributed.py through torchrun (2 GPUs with NCCL, or 2 CPU processes with gloo):

    torchrun --nproc_per_node 2 tests/two_ranks.py --device cuda --dtype float32 --steps 3

Every step's loss and every parameter's grad (full_tensor() of the DTensor grads) are compared with the
single-device run; the sequence-parallel step's collectives (CommDebugMode) are compared with the same
plan on the unpatched model (torch.nn.RMSNorm, which aten's own sharding rules serve): the library
must add no collective to what the plan asks for. Rank 0 prints one JSON line; exit status 1 on a miss.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import sys

import torch
import torch.distributed as dist

# the repository root in place of tests/ (whose triton/ folder would shadow the triton package)
sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

import cutile_norms as cn  # noqa: E402

# max |a - b| / max |b| per tensor: fp32 differs only in the order of the TP matmuls' and the grads'
# sums (<= 1e-6 measured on 2 CPU ranks over 2 steps); bf16 holds 8 bits, and three SGD steps carry
# the rounding on (<= 1.5e-2 measured)
TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 3e-2}
# the patched model against torch.nn.RMSNorm on one device: fp32 norms agree to rounding; bf16 rounds
# the norm's output once where torch's module rounds twice, and three steps carry it on
UNPATCHED_TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 6e-2}


class Attention(torch.nn.Module):
    def __init__(self, hidden, heads):
        super().__init__()
        self.head_dim = hidden // heads
        self.wq, self.wk, self.wv, self.wo = (torch.nn.Linear(hidden, hidden, bias=False) for _ in range(4))
        self.q_norm, self.k_norm = torch.nn.RMSNorm(self.head_dim), torch.nn.RMSNorm(self.head_dim)

    def forward(self, x):
        b, t, _ = x.shape  # a rank's heads only under tensor parallelism: -1, not the model's head count
        q, k, v = (p(x).view(b, t, -1, self.head_dim) for p in (self.wq, self.wk, self.wv))
        q, k = self.q_norm(q), self.k_norm(k)  # QK-norm over head_dim, on each rank's local heads
        q, k, v = (z.transpose(1, 2) for z in (q, k, v))
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, t, -1))


class FeedForward(torch.nn.Module):
    def __init__(self, hidden):
        super().__init__()
        self.w1, self.w3 = torch.nn.Linear(hidden, 2 * hidden, bias=False), torch.nn.Linear(hidden, 2 * hidden, bias=False)
        self.w2 = torch.nn.Linear(2 * hidden, hidden, bias=False)

    def forward(self, x):
        return self.w2(torch.nn.functional.silu(self.w1(x)) * self.w3(x))


class Block(torch.nn.Module):
    def __init__(self, hidden, heads):
        super().__init__()
        self.attention_norm, self.ffn_norm = torch.nn.RMSNorm(hidden, eps=1e-5), torch.nn.RMSNorm(hidden, eps=1e-5)
        self.attention, self.feed_forward = Attention(hidden, heads), FeedForward(hidden)

    def forward(self, x):
        h = x + self.attention(self.attention_norm(x))
        return h + self.feed_forward(self.ffn_norm(h))


class Llama(torch.nn.Module):
    def __init__(self, hidden=256, heads=8, layers=2, vocab=512):
        super().__init__()
        self.tok_embeddings = torch.nn.Embedding(vocab, hidden)
        self.layers = torch.nn.ModuleDict({str(i): Block(hidden, heads) for i in range(layers)})
        self.norm, self.output = torch.nn.RMSNorm(hidden, eps=1e-5), torch.nn.Linear(hidden, vocab, bias=False)

    def forward(self, tokens):
        h = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = layer(h)
        return self.output(self.norm(h))


def tp_sp(model, mesh):
    """TorchTitan's tensor + sequence parallel plan (its llama3 parallelize_llama, without loss_parallel,
    with its qwen3 plan's QK-norms)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel, parallelize_module)

    parallelize_module(model, mesh, {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate(), use_local_output=True),
    })
    for block in model.layers.values():
        parallelize_module(block, mesh, {
            "attention_norm": SequenceParallel(),
            "attention": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(), "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
            # QK-norm runs on each rank's heads (dim 2 of [b, t, heads, head_dim]); its weight is
            # replicated and its grad sums over every rank's heads
            "attention.q_norm": SequenceParallel(sequence_dim=2, use_local_output=True),
            "attention.k_norm": SequenceParallel(sequence_dim=2, use_local_output=True),
            "ffn_norm": SequenceParallel(),
            "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "feed_forward.w1": ColwiseParallel(), "feed_forward.w3": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
        })
    return model


def fsdp2(model, mesh):
    from torch.distributed.fsdp import fully_shard

    for block in model.layers.values():
        fully_shard(block, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def rel_err(a, b) -> float:
    a, b = a.double().cpu(), b.double().cpu()
    if not b.abs().max() > 0:  # an all-zero reference grad would make any grad pass
        return float("nan")
    return float((a - b).abs().max() / b.abs().max())


def train(model, batches, steps, compiled):
    """Per step: the loss and {name: grad}; SGD so every rank's update is the same elementwise math."""
    run = torch.compile(model) if compiled else model
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    out = []
    for step in range(steps):
        tokens, targets = batches[step]
        logits = run(tokens)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
        loss.backward()
        out.append((full(loss.detach()).item(), {n: full(p.grad).detach().clone() for n, p in model.named_parameters()}))
        opt.step()
        opt.zero_grad(set_to_none=True)
    return out


def compare(got, ref, tol, what) -> list[str]:
    misses = []
    for step, ((loss, grads), (rloss, rgrads)) in enumerate(zip(got, ref)):
        if not abs(loss - rloss) <= tol * abs(rloss):
            misses.append(f"{what} step {step}: loss {loss} vs {rloss}")
        for name, g in rgrads.items():
            err = rel_err(grads[name], g)
            if not err <= tol:  # NaN fails
                misses.append(f"{what} step {step}: grad {name} rel err {err:.2e} > {tol}")
    return misses


def comm_counts(model, tokens) -> dict:
    from torch.distributed.tensor.debug import CommDebugMode

    with CommDebugMode() as comm:
        model(tokens).float().sum().backward()
    model.zero_grad(set_to_none=True)
    return {str(k).split(".")[-1]: v for k, v in comm.get_comm_counts().items()}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--mode", default=None, help="cutile_norms mode (default None: the measured choice)")
    p.add_argument("--no-compile", action="store_true")
    args = p.parse_args()
    from torch.distributed.device_mesh import init_device_mesh

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    mesh = init_device_mesh(args.device, (world,))
    dtype, dev = getattr(torch, args.dtype), torch.device(args.device, torch.cuda.current_device()) \
        if args.device == "cuda" else torch.device("cpu")
    torch.manual_seed(1234)  # the same weights and batches on every rank
    base = Llama().to(dev, dtype)
    for m in base.modules():  # norm weights away from 1, so a dropped weight or a wrong grad shows
        if isinstance(m, torch.nn.RMSNorm):
            torch.nn.init.normal_(m.weight, 1.0, 0.2)
    batches = [(torch.randint(0, 512, (2 * world, 32), device=dev), torch.randint(0, 512, (2 * world, 32), device=dev))
               for _ in range(args.steps)]
    patched = copy.deepcopy(base)
    swapped = cn.patch(patched, mode=args.mode)
    assert len(swapped) == 2 * 2 + 2 * 2 + 1, swapped
    tol, misses, result = TOLERANCE[dtype], [], {"world": world, "device": args.device, "dtype": args.dtype,
                                                 "patched_norms": len(swapped)}
    ref = train(copy.deepcopy(patched), batches, args.steps, compiled=False)  # one device, the whole batch
    # and the patched model on one device against the unpatched one (the kernels against torch's norm)
    misses += compare(ref, train(copy.deepcopy(base), batches, args.steps, compiled=False),
                      UNPATCHED_TOLERANCE[dtype], "patched against unpatched, one device")
    for compiled in ([False] if args.no_compile else [False, True]):
        tag = "compiled" if compiled else "eager"
        got = train(tp_sp(copy.deepcopy(patched), mesh), batches, args.steps, compiled)
        misses += compare(got, ref, tol, f"TP+SP {tag}")
        # FSDP2: each rank its half of the batch; the reduce-scatter averages the ranks' grads, the
        # mean of the halves' mean losses is the whole batch's
        half = [(t[rank::world], y[rank::world]) for t, y in batches]
        got = train(fsdp2(copy.deepcopy(patched), mesh), half, args.steps, compiled)
        got = [(_all_mean(loss, dev), g) for loss, g in got]
        misses += compare(got, ref, tol, f"FSDP2 {tag}")
        result[tag] = "ran"
    ours = comm_counts(tp_sp(copy.deepcopy(patched), mesh), batches[0][0])
    torchs = comm_counts(tp_sp(copy.deepcopy(base), mesh), batches[0][0])
    result["collectives_patched"], result["collectives_torch_norm"] = ours, torchs
    if ours != torchs:
        misses.append(f"TP+SP collectives {ours} differ from the unpatched model's {torchs}")
    result["misses"] = misses
    if rank == 0:
        print(json.dumps(result), flush=True)
    dist.barrier()  # no collective of either rank in flight when the group goes
    dist.destroy_process_group()
    return 1 if misses else 0


def _all_mean(value: float, dev) -> float:
    t = torch.tensor([value], dtype=torch.float64, device=dev)
    dist.all_reduce(t)
    return float(t) / dist.get_world_size()


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # Every check has run and rank 0 has printed the result. Leave without the interpreter's finalization
    # and the C++ static destructors: there a gloo rank has aborted once after a clean
    # destroy_process_group ("terminate called without an active exception", SIGABRT, in CI), which
    # would fail a run whose every comparison passed.
    os._exit(code)
