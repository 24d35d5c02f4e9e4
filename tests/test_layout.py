"""The package's shape: config modules import without the DSLs (a machine without cuTile or CuTe DSL
can read and test every launch rule), and no module imports another's private names."""
from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest

from cutile_norms import dispatch

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "cutile_norms"
CONFIG_MODULES = ["cutile_norms.cutile.rmsnorm_fwd_config", "cutile_norms.cute.rmsnorm_fwd_config",
                  "cutile_norms.cute.rmsnorm_bwd_config", "cutile_norms.cutile.rmsnorm_bwd_config",
                  "cutile_norms.triton.rmsnorm_fwd_config", "cutile_norms.triton.rmsnorm_bwd_config",
                  "cutile_norms.cutile.add_rmsnorm_fwd_config", "cutile_norms.triton.add_rmsnorm_fwd_config",
                  "cutile_norms.triton.add_rmsnorm_bwd_config", "cutile_norms.triton.rmsnorm_fp8_config",
                  "cutile_norms.cute.rmsnorm_fp8_config",
                  "cutile_norms.dispatch"]


@pytest.mark.parametrize("module", CONFIG_MODULES)
def test_config_modules_import_without_the_dsls(module):
    """In a fresh interpreter where `import cuda.tile`, `import cutlass` and `import triton` fail."""
    code = ("import sys\n"
            "for name in ('cuda.tile', 'cuda', 'cutlass', 'cutlass.cute', 'triton'):\n"
            "    sys.modules[name] = None\n"
            f"import {module}\n"
            f"assert 'cuda.tile' not in sys.modules or sys.modules['cuda.tile'] is None\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       cwd=PACKAGE.parent)
    assert r.returncode == 0, r.stderr[-2000:]


def test_no_private_name_is_imported_across_modules():
    """A name starting with "_" stays in its module: what another module needs is public (a shared
    module per DSL, cutile_norms/_util.py across DSLs)."""
    import ast

    imported = []
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.level > 0 or (node.module or "").startswith("cutile_norms")):
                imported += [f"{path.relative_to(PACKAGE)}: {node.module}.{a.name}" for a in node.names
                             if a.name.startswith("_")]
    assert not imported, imported


@pytest.mark.parametrize("mode", [m for m in dispatch.modes_of() if m != "torch"])
def test_every_mode_implements_the_typed_backends(mode):
    """dispatch.MODES points at objects of the typed interface (backends.py), forward and backward: the
    API layer calls nothing else (no duck typing)."""
    from cutile_norms.backends import BackwardBackend, ForwardBackend

    fwd = dispatch.backend(mode)
    assert isinstance(fwd, ForwardBackend) and isinstance(fwd.takes_every_row, bool), mode
    assert fwd.mode == mode
    assert isinstance(dispatch.backward_backend(mode), BackwardBackend), mode


def test_no_module_is_over_450_lines():
    """A module past ~450 lines splits along its seams (kernel / config / launch, shared helpers)."""
    long = {str(p.relative_to(PACKAGE)): n for p in PACKAGE.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > 450}
    assert not long, long
