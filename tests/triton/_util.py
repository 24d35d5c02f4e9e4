"""What the Triton tests share: the devices they run on and a simulated GPU for the interpreter."""
from __future__ import annotations

import os

import pytest
import torch

from cutile_norms._platform import DeviceInfo

# CPU: the kernels in Triton's interpreter (TRITON_INTERPRET=1, set by tests/conftest.py without a GPU);
# cuda: compiled, on the GPU
DEVICES = [pytest.param("cpu", marks=pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                                        reason="Triton's interpreter is off (TRITON_INTERPRET)")),
           pytest.param("cuda", marks=pytest.mark.gpu)]

# the interpreter's device: 4 "SMs", so the persistent grids loop and split rows exchange their sums
INTERPRETED = DeviceInfo("nvidia", "interpreter", (9, 0), 4)


def device_for(device: str) -> DeviceInfo:
    if device == "cpu":
        return INTERPRETED
    from cutile_norms._platform import device_info

    return device_info("cuda")


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()
