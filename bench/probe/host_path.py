"""Host cost per forward call, layer by layer, at N = 4096, M = 1 (bf16): where a call's host time goes.

    python3 bench/probe/host_path.py

Each line: µs per call, back to back (CUDA events around 2000 calls, `per_call_us`: host-bound here)
and the host's own time per call (perf_counter, no sync); then a profile of forward + backward pairs. Layers, outermost first: cn.rms_norm
(mode=None and explicit), the backend's forward (no validation, no routing), the launch function with
a config, ct.launch alone with arguments prepared once, the backward without autograd, the forward
with grad; beside them torch's F.rms_norm and clones through a C++ node and a Python Function (also
with 16 extra torch view calls in the forward: what a torch call costs inside a forward + backward). Then
forward + backward pairs split in phases (perf_counter), the pair with a clone-only backward, and the
backward alone on the main thread and on a worker thread.
"""
from __future__ import annotations

import contextlib
import os
import statistics
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


class _CloneFunction(torch.autograd.Function):
    """The least a Python autograd.Function can do on the GPU: one clone forward, one clone backward."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, dy):
        return dy.clone()


class _CloneBusyFunction(_CloneFunction):
    """_CloneFunction with ~40 µs of pure Python in the backward (holding the GIL on the engine's thread)."""

    @staticmethod
    def backward(ctx, dy):
        t = time.perf_counter() + 40e-6
        while time.perf_counter() < t:
            pass
        return _CloneFunction.backward(ctx, dy)


class _CloneViewsFunction(_CloneFunction):
    """_CloneFunction with VIEWS extra `view` calls in its forward: each torch call lets go of the GIL,
    which the autograd engine's thread may take (the GIL hand-off test)."""
    VIEWS = 16

    @staticmethod
    def forward(ctx, x):
        for _ in range(_CloneViewsFunction.VIEWS):
            x.view(-1)
        return x.clone()


@contextlib.contextmanager
def rmsnorm_backward_replaced(R, backward):
    """cutile_norms' autograd Function with `backward` in place of its own, for the block."""
    inner = R._RMSNormFunction.backward
    R._RMSNormFunction.backward = staticmethod(backward)
    try:
        yield inner
    finally:
        R._RMSNormFunction.backward = staticmethod(inner)


def main() -> int:
    if not torch.cuda.is_available():
        print("No CUDA GPU here: nothing to time.")
        return 0
    import cutile_norms as cn
    from cutile_norms import dispatch
    from cutile_norms._platform import device_info
    from cutile_norms._workspace import current_raw_stream
    from cutile_norms.cutile import rmsnorm_fwd as F
    from cutile_norms.cutile.common import align_elems, flat, round16

    N = int(os.environ.get("N", 4096))
    x = torch.randn(1, N, device="cuda", dtype=torch.bfloat16)
    w = (1 + 0.1 * torch.randn(N, device="cuda")).to(torch.bfloat16)
    dev = device_info("cuda")
    mode = "multi_wave_cached"
    be = dispatch.backend(mode)
    cfg = be.config(N, x.dtype, dev)
    y, rstd = F.output_buffers(1, N, x.dtype, x.device, False)
    kernel, consts = F.prepared(cfg, N, align_elems(N, 2), True, False, 0)
    stream = current_raw_stream(0)
    args = (x.view(-1), w, flat(y, round16(N)), flat(y, 16), 1, N, 1e-6, 0.0) + consts
    grid = (F.grid_size(cfg, 1, dev.sm_count),)
    xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
    dy = torch.randn_like(x)
    from cutile_norms.cutile import rmsnorm_bwd as B
    bwd_be = dispatch.backward_backend(dispatch.resolve(None, dev, cn._platform.toolchain(), x.dtype, 1, N).backward_mode
                                       or mode)
    bcfg = bwd_be.config(N, x.dtype, dev, w.dtype)
    rstd1 = torch.rsqrt(x.float().square().mean(-1) + 1e-6)
    from cutile_norms import rmsnorm as R
    run_rstd = be.launcher(1, N, N, x.dtype, w.dtype, True, dev)
    cases = {
        "x.clone()": lambda: x.clone(),
        "torch.empty_like(x)": lambda: torch.empty_like(x),
        "F.rms_norm": lambda: torch.nn.functional.rms_norm(x, (N,), w, 1e-6),
        "cn.rms_norm mode=None": lambda: cn.rms_norm(x, w),
        f"cn.rms_norm mode={mode}": lambda: cn.rms_norm(x, w, mode=mode),
        "backend.forward": lambda: be.forward(x, w, 1e-6, 0.0, False, dev),
        "launch(cfg)": lambda: F.launch(cfg, x, w, 1e-6, 0.0, False, dev.sm_count),
        "ct.launch, args prepared": lambda: F.ct.launch(stream, grid, kernel, args),
        "backward backend (no autograd)": lambda: bwd_be.backward(dy, x, w, rstd1, 0.0, True, True, dev),
        "backward launch(cfg)": lambda: B.launch(bcfg, dy, x, w, rstd1, 0.0, True, True, dev.sm_count),
        "fwd+grad cn.rms_norm (no backward)": lambda: cn.rms_norm(xg, wg),
        "fwd+grad launcher run (store rstd)": lambda: run_rstd(x, w, 1e-6, 0.0, None),
        "fwd+grad Function.apply": lambda: R._RMSNormFunction.apply(xg.view(1, N), wg, 1e-6, 0.0, mode, "", dev, run_rstd),
        "fwd+grad clone Function.apply": lambda: _CloneFunction.apply(xg),
        "torch.ops op (compile path)": lambda: torch.ops.cutile_norms.rms_norm_fwd(x, w, 1e-6, 0.0, mode, False),
        "fwd+bwd cn autograd": lambda: torch.autograd.grad(cn.rms_norm(xg, wg), (xg, wg), dy),
        "fwd+bwd F.rms_norm autograd": lambda: torch.autograd.grad(
            torch.nn.functional.rms_norm(xg, (N,), wg, 1e-6), (xg, wg), dy),
        "fwd+bwd clone, C++ node": lambda: torch.autograd.grad(xg.clone(), (xg,), dy),
        "fwd+bwd clone, Python Function": lambda: torch.autograd.grad(_CloneFunction.apply(xg), (xg,), dy),
        "fwd+bwd clone, Function + 40us Python": lambda: torch.autograd.grad(_CloneBusyFunction.apply(xg), (xg,), dy),
        "16 x.view(-1) alone": lambda: [xg.view(-1) for _ in range(16)],
        "fwd+bwd clone, Function + 16 views": lambda: torch.autograd.grad(_CloneViewsFunction.apply(xg), (xg,), dy),
        "fwd+bwd clone, C++ node + 16 views": lambda: torch.autograd.grad(
            [xg.view(-1) for _ in range(16)][0].clone(), (xg,), dy.view(-1)),
    }
    print(f"# {torch.cuda.get_device_name()}, N={N}, M=1, bf16: per call back to back (events) | host only")
    for name, fn in cases.items():
        ctx = torch.enable_grad() if name.startswith("fwd+") else torch.no_grad()
        with ctx:
            ev, host = per_call_us(fn, calls=2000, reps=5), host_us(fn)
        print(f"{name:<32} {ev:7.1f} us | {host:7.1f} us", flush=True)
    # forward + backward pairs split in phases by perf_counter (no profiler): the forward call, the
    # backward's Python body (on the autograd engine's device thread), and the rest of autograd.grad
    import threading
    body, threads = [], set()
    inner = R._RMSNormFunction.backward

    def timed_backward(ctx, dy_):
        t = time.perf_counter()
        threads.add(threading.get_ident())
        out = inner(ctx, dy_)
        body.append(time.perf_counter() - t)
        return out

    fwd_t, grad_t = [], []
    with rmsnorm_backward_replaced(R, timed_backward), torch.enable_grad():
        for i in range(1200):
            t0 = time.perf_counter()
            yy = cn.rms_norm(xg, wg)
            t1 = time.perf_counter()
            torch.autograd.grad(yy, (xg, wg), dy)
            t2 = time.perf_counter()
            if i >= 200:
                fwd_t.append(t1 - t0)
                grad_t.append(t2 - t1)
    torch.cuda.synchronize()
    med = statistics.median
    print(f"phases (median µs): forward {med(fwd_t) * 1e6:.1f}, autograd.grad {med(grad_t) * 1e6:.1f} of which the "
          f"backward's body {med(body[200:]) * 1e6:.1f} (on {len(threads)} thread(s), main thread: "
          f"{threading.get_ident() in threads})", flush=True)

    # the same graph with a backward that only clones: what the forward costs inside a pair
    def clone_backward(ctx, dy_):
        return dy_.clone(), None, None, None, None, None, None, None

    def dx_only():
        return torch.autograd.grad(cn.rms_norm(xg, wg), (xg,), dy)
    with torch.enable_grad():
        t_real = per_call_us(dx_only, calls=1000, reps=5)
        with rmsnorm_backward_replaced(R, clone_backward):
            t_clone_bwd = per_call_us(dx_only, calls=1000, reps=5)
    print(f"fwd+bwd cn, dx only: {t_real:.1f} µs per pair; with a clone-only backward: {t_clone_bwd:.1f}", flush=True)
    # the backward's body alone on the main thread and on another thread (no autograd)
    for where in ("main thread", "a worker thread"):
        times = []

        def loop():
            for _ in range(1200):
                t = time.perf_counter()
                bwd_be.backward(dy, x, w, rstd1, 0.0, True, True, dev)
                times.append(time.perf_counter() - t)
        if where == "main thread":
            loop()
        else:
            th = threading.Thread(target=loop)
            th.start()
            th.join()
        torch.cuda.synchronize()
        print(f"backward backend on {where}: median {med(times[200:]) * 1e6:.1f} µs", flush=True)
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
