"""What the Triton tests share: the devices they run on and a simulated GPU for the interpreter."""
from __future__ import annotations

import json
import os
import subprocess
import sys

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


class Launches:
    """A kernel that counts its launches (kernel[grid](...)) and is the kernel otherwise: monkeypatched
    over a module's kernel name, it tells which entry point a launch ran."""

    def __init__(self, kernel):
        self.kernel, self.count = kernel, 0

    def __getitem__(self, grid):
        self.count += 1
        return self.kernel[grid]

    def __getattr__(self, name):
        return getattr(self.kernel, name)


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def compile_in_child(child: str, cases: list) -> dict:
    """Run the script `child` (it compiles `cases`, given as JSON in argv[1], and prints one line
    "RESULT <json>") in a process without TRITON_INTERPRET: under the interpreter, which the CPU test
    session turns on, `triton.jit` gives functions that cannot be compiled."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, "-c", child, json.dumps(cases)], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=900)
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and line, f"compile child failed: {proc.stderr[-2000:]}"
    return json.loads(line[0][len("RESULT "):])


def compile_fixture(child: str, cases: list):
    """A module-scoped fixture: {case id: the child's record} from one `compile_in_child` run."""
    return pytest.fixture(scope="module", name="compiled")(lambda: compile_in_child(child, cases))


def case_id(case) -> str:
    return "-".join(map(str, case))


def compiled_case(compiled: dict, case) -> dict:
    """The child's record of `case`, asserted compiled (a cubin, for the case's arch)."""
    r = compiled[case_id(case)]
    assert "error" not in r, r.get("error")
    assert r["cubin"] > 0 and r.get("target", True), f"no cubin for {case_id(case)}"
    return r
