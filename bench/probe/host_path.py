"""Host cost per forward call, layer by layer, at N = 4096, M = 1 (bf16): where a call's host time goes.

    python3 bench/probe/host_path.py

Each line: µs per call, back to back (CUDA events around 2000 calls, `per_call_us`: host-bound here)
and the host's own time per call (perf_counter, no sync); then a profile of forward + backward pairs. Layers, outermost first: cn.rms_norm
(mode=None and explicit), the backend's forward (no validation, no routing), the launch function with
a config, ct.launch alone with arguments prepared once; beside them torch's F.rms_norm and a clone.
"""
from __future__ import annotations

import os
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from bench.timing import per_call_us  # noqa: E402


def host_us(fn, calls: int = 3000) -> float:
    for _ in range(200):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    t = (time.perf_counter() - t0) / calls * 1e6
    torch.cuda.synchronize()
    return t


def main() -> int:
    if not torch.cuda.is_available():
        print("No CUDA GPU here: nothing to time.")
        return 0
    import cutile_norms as cn
    from cutile_norms import dispatch
    from cutile_norms._platform import device_info
    from cutile_norms.cutile import rmsnorm_fwd as F

    N = int(os.environ.get("N", 4096))
    x = torch.randn(1, N, device="cuda", dtype=torch.bfloat16)
    w = (1 + 0.1 * torch.randn(N, device="cuda")).to(torch.bfloat16)
    dev = device_info("cuda")
    mode = "multi_wave_cached"
    be = dispatch.backend(mode)
    cfg = be.config(N, x.dtype, dev)
    y, rstd = F.output_buffers(1, N, x.dtype, x.device, False)
    kernel, consts = F._prepared(cfg, N, F._align_elems(N, 2), True, False, 0)
    stream = F._raw_stream(0)
    args = (x.view(-1), w, F._flat(y, F._round16(N)), F._flat(y, 16), 1, N, 1e-6, 0.0) + consts
    grid = (F.grid_size(cfg, 1, dev.sm_count),)
    xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
    dy = torch.randn_like(x)
    cases = {
        "x.clone()": lambda: x.clone(),
        "torch.empty_like(x)": lambda: torch.empty_like(x),
        "F.rms_norm": lambda: torch.nn.functional.rms_norm(x, (N,), w, 1e-6),
        "cn.rms_norm mode=None": lambda: cn.rms_norm(x, w),
        f"cn.rms_norm mode={mode}": lambda: cn.rms_norm(x, w, mode=mode),
        "backend.forward": lambda: be.forward(x, w, 1e-6, 0.0, False, dev),
        "launch(cfg)": lambda: F.launch(cfg, x, w, 1e-6, 0.0, False, dev.sm_count),
        "ct.launch, args prepared": lambda: F.ct.launch(stream, grid, kernel, args),
        "torch.ops op (compile path)": lambda: torch.ops.cutile_norms.rms_norm_fwd(x, w, 1e-6, 0.0, mode, False),
        "fwd+bwd cn autograd": lambda: torch.autograd.grad(cn.rms_norm(xg, wg), (xg, wg), dy),
        "fwd+bwd F.rms_norm autograd": lambda: torch.autograd.grad(
            torch.nn.functional.rms_norm(xg, (N,), wg, 1e-6), (xg, wg), dy),
    }
    print(f"# {torch.cuda.get_device_name()}, N={N}, M=1, bf16: per call back to back (events) | host only")
    for name, fn in cases.items():
        ctx = torch.enable_grad() if name.startswith("fwd+bwd") else torch.no_grad()
        with ctx:
            ev, host = per_call_us(fn, calls=2000, reps=5), host_us(fn)
        print(f"{name:<32} {ev:7.1f} us | {host:7.1f} us", flush=True)
    # where the host time of forward + backward goes: the top functions by own time over 2000 pairs
    import cProfile
    import pstats
    prof = cProfile.Profile()
    pair = cases["fwd+bwd cn autograd"]
    with torch.enable_grad():
        prof.enable()
        for _ in range(2000):
            pair()
        prof.disable()
    torch.cuda.synchronize()
    pstats.Stats(prof).sort_stats("tottime").print_stats(22)
    return 0


if __name__ == "__main__":
    sys.exit(main())
