"""Decode-sized calls: what a serving loop pays per RMSNorm call and per token (host + GPU, back to back).

    python bench/decode.py [--hidden 2048] [--head-dim 128] [--layers 8] [--batches 1,8,64]
                           [--ns 128,2048,4096] [--ms 1,16,64] [--runs 5] [--first-call 3] [--out F]

Three parts, each a median of --runs interleaved runs, then the first call:
  * calls: a no-grad `rms_norm` per mode at M rows of N (the decode shapes: M = batch x heads for a
    QK-norm, M = batch for a hidden norm), µs per call back to back (events around 200 calls), beside
    torch's `F.rms_norm` and a clone of x: what mode=None's small-M rows are chosen by;
  * eager decode: a Llama-shaped model (torch.nn.RMSNorm before attention and MLP, QK-norm over the head
    dim, a final norm; bf16, random weights), ms per generated token for --batches sequences, unpatched
    against `cutile_norms.patch(model)`;
  * the same decode step captured in a CUDA graph and replayed;
  * first call: --first-call fresh processes one after another, each timing `import cutile_norms` and
    its first no-grad call at N = 4096, M = 1 (what a new rank or server process stalls for; the disk
    cache fills in the first one).
Every patched output is checked against the unpatched model's first (bf16 tolerance) before timing.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import subprocess
import sys

import torch
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import cutile_norms as cn  # noqa: E402
from bench.probe.common import no_gpu, write_json  # noqa: E402
from bench.timing import per_call_us  # noqa: E402
from cutile_norms import dispatch  # noqa: E402


class Attention(torch.nn.Module):
    def __init__(self, hidden: int, head_dim: int):
        super().__init__()
        self.heads, self.head_dim = hidden // head_dim, head_dim
        self.q_proj = torch.nn.Linear(hidden, hidden, bias=False)
        self.k_proj = torch.nn.Linear(hidden, hidden, bias=False)
        self.v_proj = torch.nn.Linear(hidden, hidden, bias=False)
        self.o_proj = torch.nn.Linear(hidden, hidden, bias=False)
        self.q_norm = torch.nn.RMSNorm(head_dim, eps=1e-6)
        self.k_norm = torch.nn.RMSNorm(head_dim, eps=1e-6)

    def forward(self, h, k_cache, v_cache):
        B = h.shape[0]
        q = self.q_norm(self.q_proj(h).view(B, 1, self.heads, self.head_dim)).transpose(1, 2)
        k = self.k_norm(self.k_proj(h).view(B, 1, self.heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(h).view(B, 1, self.heads, self.head_dim).transpose(1, 2)
        a = F.scaled_dot_product_attention(q, torch.cat([k_cache, k], 2), torch.cat([v_cache, v], 2))
        return self.o_proj(a.transpose(1, 2).reshape(B, 1, -1))


class Layer(torch.nn.Module):
    def __init__(self, hidden: int, head_dim: int):
        super().__init__()
        self.input_layernorm = torch.nn.RMSNorm(hidden, eps=1e-6)
        self.self_attn = Attention(hidden, head_dim)
        self.post_attention_layernorm = torch.nn.RMSNorm(hidden, eps=1e-6)
        self.gate_up = torch.nn.Linear(hidden, 2 * 4 * hidden, bias=False)
        self.down = torch.nn.Linear(4 * hidden, hidden, bias=False)

    def forward(self, x, k_cache, v_cache):
        x = x + self.self_attn(self.input_layernorm(x), k_cache, v_cache)
        g, u = self.gate_up(self.post_attention_layernorm(x)).chunk(2, -1)
        return x + self.down(F.silu(g) * u)


class Decoder(torch.nn.Module):
    """One decode step of a Llama/Qwen3-shaped stack over a fixed KV cache (its attention reads the
    cache; the norms are what this bench is about)."""

    def __init__(self, hidden: int, head_dim: int, layers: int):
        super().__init__()
        self.layers = torch.nn.ModuleList(Layer(hidden, head_dim) for _ in range(layers))
        self.norm = torch.nn.RMSNorm(hidden, eps=1e-6)

    def forward(self, x, caches):
        for layer, (k, v) in zip(self.layers, caches):
            x = layer(x, k, v)
        return self.norm(x)


def step_ms(fn, steps: int = 100) -> float:
    """ms per call of fn back to back (host-bound loops show their host time), events around `steps`."""
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(steps):
        fn()
    b.record()
    b.synchronize()
    return a.elapsed_time(b) / steps


def graphed(fn):
    """fn captured in a CUDA graph (its inputs are fixed tensors): a replay per call."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g.replay


def calls(ns, ms, runs) -> list:
    modes = [m for m in dispatch.MODES if m != "torch" and cn.available_modes("cuda")[m] is None] + [None]
    rows = []
    for N in ns:
        for M in ms:
            x = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
            w = (1 + 0.1 * torch.randn(N, device="cuda")).to(torch.bfloat16)
            fns = {"F.rms_norm": lambda: F.rms_norm(x, (N,), w, 1e-6), "clone": lambda: x.clone()}
            for m in modes:
                fns[f"cn.{m}"] = (lambda m: (lambda: cn.rms_norm(x, w, 1e-6, mode=m)))(m)
            us = {k: [] for k in fns}
            with torch.no_grad():
                for _ in range(runs):
                    for k, fn in fns.items():
                        us[k].append(per_call_us(fn))
            rec = {"N": N, "M": M, "us": {k: statistics.median(v) for k, v in us.items()},
                   "us_runs": {k: [round(t, 2) for t in v] for k, v in us.items()}}
            rows.append(rec)
            print(f"calls N={N:>6} M={M:>4} " + "  ".join(f"{k} {v:.1f}" for k, v in rec["us"].items()), flush=True)
    return rows


def decode(hidden, head_dim, layers, batches, runs, cache_len: int = 256) -> list:
    torch.manual_seed(0)
    base = Decoder(hidden, head_dim, layers).to("cuda", torch.bfloat16).eval()
    for p in base.parameters():
        if p.dim() == 1:  # norms' weights: not all ones
            p.data = (1 + 0.1 * torch.randn_like(p, dtype=torch.float32)).to(p.dtype)
    patched = copy.deepcopy(base)
    cn.patch(patched)
    rows = []
    for B in batches:
        caches = [(torch.randn(B, hidden // head_dim, cache_len, head_dim, device="cuda", dtype=torch.bfloat16),
                   torch.randn(B, hidden // head_dim, cache_len, head_dim, device="cuda", dtype=torch.bfloat16))
                  for _ in range(layers)]
        x = torch.randn(B, 1, hidden, device="cuda", dtype=torch.bfloat16)
        rec = {"batch": B}
        with torch.no_grad():
            ref, got = base(x, caches).float(), patched(x, caches).float()
            err = ((got - ref).norm() / ref.norm()).item()
            if not err < 2e-2:
                raise AssertionError(f"patched model differs from torch's: relative error {err:.3g} at batch {B}")
            rec["rel_err"] = err
            fns = {"torch eager": lambda: base(x, caches), "patched eager": lambda: patched(x, caches)}
            fns["torch graph"] = graphed(fns["torch eager"])
            fns["patched graph"] = graphed(fns["patched eager"])
            ms = {k: [] for k in fns}
            for _ in range(runs):
                for k, fn in fns.items():
                    ms[k].append(step_ms(fn))
        rec["ms"] = {k: statistics.median(v) for k, v in ms.items()}
        rec["ms_runs"] = {k: [round(t, 4) for t in v] for k, v in ms.items()}
        rec["eager_ratio"] = rec["ms"]["patched eager"] / rec["ms"]["torch eager"]
        rec["graph_ratio"] = rec["ms"]["patched graph"] / rec["ms"]["torch graph"]
        rows.append(rec)
        print(f"decode batch={B:>3} " + "  ".join(f"{k} {v:.3f} ms" for k, v in rec["ms"].items())
              + f"  | patched/torch eager {rec['eager_ratio']:.2f}x, graph {rec['graph_ratio']:.2f}x", flush=True)
    return rows


FIRST_CALL = r"""
import json, sys, time, torch
torch.cuda.init(); x = torch.randn(1, int(sys.argv[1]), device="cuda", dtype=torch.bfloat16); w = torch.randn_like(x[0])
torch.cuda.synchronize(); t0 = time.perf_counter()
import cutile_norms as cn
with torch.no_grad():
    cn.rms_norm(x, w)
torch.cuda.synchronize(); print(json.dumps({"import_and_first_call_s": time.perf_counter() - t0}))
"""


def first_calls(N: int, processes: int) -> list:
    """Seconds from `import cutile_norms` to the end of the first no-grad call at M = 1 (CUDA already up),
    in `processes` fresh processes one after another (the disk cache fills in the first)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    out = [json.loads(subprocess.run([sys.executable, "-c", FIRST_CALL, str(N)], env=env, capture_output=True,
                                     text=True, check=True).stdout.splitlines()[-1])["import_and_first_call_s"]
           for _ in range(processes)]
    print(f"first call N={N} M=1, fresh processes: " + ", ".join(f"{t:.2f} s" for t in out), flush=True)
    return out


def main() -> int:
    ints = lambda s: [int(v) for v in s.split(",") if v]  # noqa: E731
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--batches", type=ints, default=[1, 8, 64])
    p.add_argument("--ns", type=ints, default=[128, 2048, 4096])
    p.add_argument("--ms", type=ints, default=[1, 16, 64])
    p.add_argument("--runs", type=int, default=5, help="interleaved runs per point (host-bound times vary run to run)")
    p.add_argument("--first-call", type=int, default=3, help="fresh processes timing their first call (0: none)")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if no_gpu("this bench times GPU calls and a model's decode step"):
        return 0
    print(f"# {torch.cuda.get_device_name()} bf16, {args.runs} runs per point (medians)", flush=True)
    result = {"gpu": torch.cuda.get_device_name(), "command": "python bench/decode.py " + " ".join(sys.argv[1:]),
              "calls": calls(args.ns, args.ms, args.runs),
              "decode": decode(args.hidden, args.head_dim, args.layers, args.batches, args.runs),
              "first_call_s": first_calls(4096, args.first_call) if args.first_call else []}
    write_json(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
