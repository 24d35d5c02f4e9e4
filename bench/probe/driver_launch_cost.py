"""Where a cached driver launch's host time goes (N = 4096, M = 1, bf16, the forward's cached kernel).

    python3 bench/probe/driver_launch_cost.py

µs per call back to back on the host (perf_counter, 20000 calls): the argument check, the packing,
cuCtxGetCurrent, cuLaunchKernel through ctypes (CUfunction from cuModuleLoadData, and the CUkernel of
cuLibraryLoadData as cuTile loads it), cuda.bindings' cuLaunchKernel, and ct.launch.
"""
from __future__ import annotations

import ctypes
import os
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)


def per_call(fn, calls=20000):
    for _ in range(500):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    t = (time.perf_counter() - t0) / calls * 1e6
    torch.cuda.synchronize()
    return t


def main():
    import cuda.tile as ct
    from cutile_norms._platform import device_info
    from cutile_norms.cutile import _driver_launch as DL
    from cutile_norms.cutile import rmsnorm_fwd as F

    N = 4096
    dev = device_info("cuda")
    x = torch.randn(1, N, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(N, device="cuda", dtype=torch.bfloat16)
    cfg = F.default_config("multi_wave_cached", N, 2, dev, "bfloat16")
    kernel, consts = F._prepared(cfg, N, 8, True, False, 0)
    y = torch.empty(N, device="cuda", dtype=torch.bfloat16)
    args = (x.view(-1), w, y, y, 1, N, 1e-6, 0.0) + consts
    stream = F._raw_stream(0)
    site = DL.DriverLaunch(kernel)
    site.launch(stream, (1,), args, 0)
    v = site.variants[0][0]
    drv = DL._driver()
    vals = v.values(args)
    ctx = ctypes.c_void_p()
    grid = (1,)
    bx, by, bz = v.block
    lib = ctypes.CDLL("libcuda.so.1")
    rows = {
        "values(args)": lambda: v.values(args),
        "pack": lambda: v.pack(v.buffer, 0, *vals),
        "cuCtxGetCurrent": lambda: drv._get_ctx(ctypes.byref(ctx)),
        "cuLaunchKernel (ctypes, argtypes)": lambda: drv._launch(v.function, 1, 1, 1, bx, by, bz, 0, stream, v.params, None),
        "cuLaunchKernel (ctypes, no argtypes)": lambda: lib.cuLaunchKernel(ctypes.c_void_p(v.function), 1, 1, 1, bx, by, bz, 0,
                                                                           ctypes.c_void_p(stream), v.params, None),
        "_Driver.launch": lambda: drv.launch(v, grid, stream),
        "DriverLaunch.launch": lambda: site.launch(stream, grid, args, 0),
        "ct.launch": lambda: ct.launch(stream, grid, kernel, args),
        "torch.empty(4096)": lambda: torch.empty(N, device="cuda", dtype=torch.bfloat16),
    }
    try:
        from cuda.bindings import driver as cbd
        fn = cbd.CUfunction(v.function)
        st = cbd.CUstream(stream)
        rows["cuda.bindings cuLaunchKernel"] = lambda: cbd.cuLaunchKernel(fn, 1, 1, 1, bx, by, bz, 0, st, v.params, 0)
    except Exception as e:  # noqa: BLE001
        print("cuda.bindings:", type(e).__name__, e)
    # the same cubin loaded as cuTile loads it (a context-independent library, its CUkernel)
    try:
        import io
        from cuda.tile.compilation import CallingConvention, KernelSignature, export_kernel
        sig = KernelSignature.from_kernel_args(kernel, args, CallingConvention.cutile_python_v2())
        buf = io.BytesIO()
        export_kernel(kernel, [sig], buf, gpu_code="sm_90", output_format="cubin")
        libh, kern = ctypes.c_void_p(), ctypes.c_void_p()
        lib.cuLibraryLoadData.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_char_p, ctypes.c_void_p,
                                          ctypes.c_void_p, ctypes.c_uint, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint]
        drv.check(lib.cuLibraryLoadData(ctypes.byref(libh), buf.getvalue(), None, None, 0, None, None, 0), "load")
        lib.cuLibraryGetKernel.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p, ctypes.c_char_p]
        drv.check(lib.cuLibraryGetKernel(ctypes.byref(kern), libh, sig.symbol.encode()), "get kernel")
        rows["cuLaunchKernel (CUkernel, ctypes)"] = lambda: drv._launch(kern.value, 1, 1, 1, bx, by, bz, 0, stream,
                                                                          v.params, None)
    except Exception as e:  # noqa: BLE001
        print("cuLibrary:", type(e).__name__, e)
    print(f"# {torch.cuda.get_device_name()}: host µs per call, back to back")
    for name, fn in rows.items():
        print(f"{name:<40} {per_call(fn):7.2f}", flush=True)
    print("rc of one ctypes launch:", drv._launch(v.function, 1, 1, 1, bx, by, bz, 0, stream, v.params, None))


if __name__ == "__main__":
    main()
