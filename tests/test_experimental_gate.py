"""The experimental gate, each case in a fresh interpreter (the opt-in is process-wide)."""
import os
import subprocess
import sys
import warnings

import pytest

from cutile_norms._experimental import ExperimentalKernelWarning, experimental_kernel, is_experimental

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(code: str, **env):
    full_env = {k: v for k, v in os.environ.items() if k != "CUTILE_NORMS_EXPERIMENTAL"}
    full_env.update(env)
    full_env["PYTHONPATH"] = ROOT + os.pathsep + full_env.get("PYTHONPATH", "")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=full_env, cwd=ROOT)


def test_import_refused_without_opt_in():
    r = run("import cutile_norms.experimental")
    assert r.returncode != 0
    assert "ImportError" in r.stderr and "CUTILE_NORMS_EXPERIMENTAL=1" in r.stderr and "enable_experimental" in r.stderr


@pytest.mark.parametrize("value", ["1", "true"])
def test_import_allowed_by_environment(value):
    r = run("import cutile_norms.experimental as e; print(type(e.MODES).__name__)", CUTILE_NORMS_EXPERIMENTAL=value)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "dict"


def test_import_allowed_after_enable_experimental():
    r = run("import cutile_norms as cn; cn.enable_experimental(); import cutile_norms.experimental; print('ok')")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "ok"


def test_environment_zero_does_not_opt_in():
    r = run("import cutile_norms.experimental", CUTILE_NORMS_EXPERIMENTAL="0")
    assert r.returncode != 0 and "ImportError" in r.stderr


def test_experimental_kernel_warns_once_at_first_launch():
    calls = []

    @experimental_kernel
    def launch(a, b=0):
        calls.append((a, b))
        return a + b

    assert is_experimental(launch)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert launch(1, b=2) == 3
        assert launch(4) == 4
    assert calls == [(1, 2), (4, 0)]
    hits = [w for w in caught if issubclass(w.category, ExperimentalKernelWarning)]
    assert len(hits) == 1 and "not validated on hardware" in str(hits[0].message)
