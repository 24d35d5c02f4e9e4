"""Backward launches to profile: each case launched twice (compile + warm), then once more, so that
`ncu --launch-skip` can take the third. Without ncu it prints the CUDA-event time of each case.

    UNDER_NCU=1 ncu --csv --kernel-name regex:rms_norm_bwd --metrics gpu__time_duration.sum,... \\
        python3 bench/probe/bwd_launches.py 2880:46603:dw 2880:46603:nodw > run.csv
    python3 bench/probe/ncu_table.py run.csv --every 3 --offset 2

A case is N:M:dw|nodw[:split:blocks_per_sm:tile_m[:pf]]; the config is the library's unless given.
UNDER_NCU=1: launch each case three times, time nothing.
"""
from __future__ import annotations

import dataclasses
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from bench.timing import device_ms  # noqa: E402
from cutile_norms._platform import device_info  # noqa: E402
from cutile_norms.cutile import rmsnorm_bwd as B  # noqa: E402
from cutile_norms.reference import rms_norm_reference  # noqa: E402


def main(argv) -> int:
    if not torch.cuda.is_available():
        print("No CUDA GPU here: nothing to launch.")
        return 0
    dev = device_info("cuda")
    for case in argv:
        parts = case.split(":")
        N, M, need_dw = int(parts[0]), int(parts[1]), parts[2] == "dw"
        cfg = B.default_config(N, 2, dev, "bfloat16")
        if len(parts) > 3:
            cfg = B.cut_pieces(dataclasses.replace(cfg, split=int(parts[3]), blocks_per_sm=int(parts[4]),
                                                   tile_m=int(parts[5]), prefetch=parts[6:7] == ["pf"]), N)
        x = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
        w = (1 + 0.1 * torch.randn(N, device="cuda")).to(torch.bfloat16)
        dy = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
        rstd = torch.empty(-(-M // 16) * 16, device="cuda")[:M]
        rstd.copy_(rms_norm_reference(x, w, 1e-6)[1])
        fn = lambda: B.launch(cfg, dy, x, w, rstd, 0.0, True, need_dw, dev.sm_count)  # noqa: E731
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        if os.environ.get("UNDER_NCU"):  # profile the three launches only
            continue
        us = device_ms(fn, reps=30)["median_ms"] * 1e3
        gbs = 3 * M * N * 2 / (us * 1e-6) / 1e9
        print(f"{case}: {cfg.short()} R={B.grid_rows(cfg, M, dev.sm_count)}: {us:.1f} us, {gbs:.0f} GB/s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
