"""Scratch buffers the kernels keep between launches (cuTile and Triton alike): the split kernels' row
slots and counters, the backward's tickets and dw partials.

One buffer per (kind, device, stream), regrown by doubling when a launch needs more: launches on one
stream run in order, so they may share it. Two rules make this safe under CUDA graphs:

  * Under stream capture a new buffer is made for the captured launch and not kept: its zero fill is
    captured and replays with the kernel, and the graph's pool owns its memory.
  * A kept buffer is allocated on a helper thread. torch.compile's CUDA graphs (cudagraph trees) run
    their warm-up with the current thread's allocations routed to the graph's private pool; a kept
    buffer made there stays alive after the call and the next recording refuses to start ("tensors
    in the cudagraph pool not tracked as outputs"). Pool routing is per thread, so the helper thread's
    allocation lands in the ordinary pool. It costs ~0.1 ms, once per buffer (and per regrowth).
"""
from __future__ import annotations

import threading

import torch

_BUFFERS: dict = {}  # (kind, device index, raw stream) -> tensor

# current_raw_stream(device_index): the current stream's raw CUstream handle, the key of the buffers
# (cuTile's ct.launch takes it too); building a torch.cuda.Stream object per call cost 2.9 us of a
# 23 us call on an H200 host (docs/design.md)
current_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def _round16(n: int) -> int:
    return (n + 15) & ~15


def _allocate_outside_pools(numel: int, dtype: torch.dtype, device: torch.device, zero: bool) -> torch.Tensor:
    out = []

    def allocate():
        with torch.cuda.device(device):
            t = (torch.zeros if zero else torch.empty)(numel, dtype=dtype, device=device)
            torch.cuda.current_stream().synchronize()  # the fill is done before any stream uses it
            out.append(t)

    worker = threading.Thread(target=allocate)
    worker.start()
    worker.join()
    if not out:
        raise RuntimeError(f"allocating a {numel}-element {dtype} workspace on {device} failed")
    return out[0]


def workspace(kind: str, numel: int, dtype: torch.dtype, device: torch.device, stream: int,
              zero: bool) -> torch.Tensor:
    """A buffer of at least `numel` elements (a multiple of 16) for `kind` on this device and stream.
    `zero`: allocated all 0 (counters and slots, which the kernels leave as they found them or flip)."""
    if device.type != "cuda":  # the Triton interpreter's CPU tensors: nothing is kept
        return (torch.zeros if zero else torch.empty)(_round16(numel), dtype=dtype, device=device)
    key = (kind, device.index, stream)
    ws = _BUFFERS.get(key)
    capturing = torch.cuda.is_current_stream_capturing()
    if ws is not None and ws.numel() >= numel and not capturing:
        return ws
    if capturing:
        return (torch.zeros if zero else torch.empty)(_round16(numel), dtype=dtype, device=device)
    need = _round16(max(numel, 2 * ws.numel() if ws is not None else 0))
    if ws is not None:  # the launches queued on `stream` may still use the old buffer: free it in order
        ws.record_stream(torch.cuda.ExternalStream(stream, device=device))
    ws = _BUFFERS[key] = _allocate_outside_pools(need, dtype, device, zero)
    return ws


def grad_outputs(x2d: torch.Tensor, weight, need_dx: bool, need_dw: bool, out=None):
    """(dx [M, N] in x's dtype or None, dw [N] in the weight's dtype or None): the backward's outputs,
    the caller's `out` pair when given."""
    if out is not None:
        return out
    dx = torch.empty(x2d.shape, dtype=x2d.dtype, device=x2d.device) if need_dx else None
    dw = torch.empty(weight.shape[0], dtype=weight.dtype, device=x2d.device) if need_dw else None
    return dx, dw
