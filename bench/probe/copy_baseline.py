"""Probe: is the same-run copy baseline stable? (clone / copy_ into a preallocated tensor, under an L2
flush by writing, by reading, or none; over fresh allocations.) Prints GB/s per variant."""
import statistics
import torch

N_ELEM = 1 << 27
l2 = torch.cuda.get_device_properties(0).L2_cache_size
wbuf = torch.empty(256 << 20, dtype=torch.int8, device="cuda")
rbuf = torch.ones(64 << 20, dtype=torch.float32, device="cuda")  # 256 MB


def flush_write():
    wbuf.zero_()


def flush_read():
    rbuf.sum()


def t(fn, flush, reps=30):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for s, e in ev:
        if flush:
            flush()
        s.record(); fn(); e.record()
    torch.cuda.synchronize()
    ms = statistics.median(s.elapsed_time(e) for s, e in ev)
    return 2 * N_ELEM * 2 / (ms * 1e-3) / 1e9


for trial in range(4):
    x = torch.randn(N_ELEM // 4096, 4096, device="cuda").to(torch.bfloat16)
    y = torch.empty_like(x)
    junk = [torch.empty(int(1e8 * (trial + 1)), dtype=torch.int8, device="cuda")]  # shift the allocator
    row = {}
    for fname, fl in (("write", flush_write), ("read", flush_read), ("none", None)):
        row[f"clone/{fname}"] = t(lambda: x.clone(), fl)
        row[f"copy_/{fname}"] = t(lambda: y.copy_(x), fl)
    print(f"trial {trial}: " + "  ".join(f"{k} {v:.0f}" for k, v in row.items()), flush=True)
    del x, y, junk
    torch.cuda.empty_cache()
