"""The compile cache on disk (cutile_norms/_diskcache.py): a CuTe DSL kernel compiled in one process is
linked from disk in the next (no compile), two processes filling one cache at once, the off switch, an
unloadable entry, the size bound, and the keys. The CPU compiles for sm_90a (CUTE_DSL_ARCH) in child
processes, each with its own process-wide compile state; on the GPU a second process runs the loaded
kernel against the fp64 reference.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import torch

from cutile_norms import _diskcache

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CHILD = r"""
import json, os, sys, torch
from cutile_norms.cute import rmsnorm_bwd as B, rmsnorm_fwd as F
from cutile_norms.cute.rmsnorm_bwd_config import analytic_config as bwd_config
from cutile_norms.cute.rmsnorm_fwd_config import analytic_config as fwd_config
fns = []
arch = os.environ.get("CHILD_ARCH", "sm_90a") or None  # "": cute.compile's default target (CUTE_DSL_ARCH)
for N in json.loads(sys.argv[1]):
    fns.append(F.compile_forward(torch.bfloat16, torch.bfloat16, N, fwd_config(N, 2), True, True, arch))
    fns.append(B.compile_backward(torch.bfloat16, torch.bfloat16, N, bwd_config(N, 2), True, True, arch))
print("RESULT " + json.dumps({"compiled": F.CACHE.count + B.CACHE.count, "loaded": F.CACHE.loaded + B.CACHE.loaded,
                              "callable": all(callable(f) for f in fns)}))
"""


def python_path() -> str:
    """The repository first, then whatever path this process was given (where the DSLs may live)."""
    return os.pathsep.join([ROOT] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])


def child(cache, widths, extra_env=None, wait=True):
    env = dict(os.environ, CUTILE_NORMS_CACHE_DIR=str(cache), CUTE_DSL_ARCH="sm_90a", CUDA_VISIBLE_DEVICES="",
               PYTHONPATH=python_path())
    env.update(extra_env or {})
    proc = subprocess.Popen([sys.executable, "-c", CHILD, json.dumps(widths)], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    return result(proc) if wait else proc


def result(proc) -> dict:
    out, err = proc.communicate(timeout=600)
    lines = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, err[-3000:]
    return json.loads(lines[-1][len("RESULT "):])


def objects(cache):
    return sorted((cache / "cute").glob("*.o")) if (cache / "cute").exists() else []


@pytest.fixture(scope="module")
def cutlass_here():
    pytest.importorskip("cutlass.cute", reason="CuTe DSL is not installed")


def test_second_process_links_instead_of_compiling(cutlass_here, tmp_path):
    first = child(tmp_path, [4096, 2880])
    assert first == {"compiled": 4, "loaded": 0, "callable": True}
    assert len(objects(tmp_path)) == 4  # forward and backward of each width
    second = child(tmp_path, [4096, 2880])
    assert second == {"compiled": 0, "loaded": 4, "callable": True}
    third = child(tmp_path, [4096, 8192])  # a new width compiles that width only
    assert third == {"compiled": 2, "loaded": 2, "callable": True}


def test_two_processes_fill_one_cache_at_once(cutlass_here, tmp_path):
    procs = [child(tmp_path, [1024, 5120], wait=False) for _ in range(2)]
    results = [result(p) for p in procs]
    assert all(r["callable"] and r["compiled"] + r["loaded"] == 4 for r in results), results
    assert not list((tmp_path / "cute").glob(".*")), "a temporary file was left behind"
    assert child(tmp_path, [1024, 5120]) == {"compiled": 0, "loaded": 4, "callable": True}


def test_off_switch_reads_and_writes_nothing(cutlass_here, tmp_path):
    for _ in range(2):
        assert child(tmp_path, [4096], {"CUTILE_NORMS_DISK_CACHE": "0"}) == {"compiled": 2, "loaded": 0,
                                                                              "callable": True}
    assert not objects(tmp_path)


def test_unloadable_entry_is_compiled_again_and_replaced(cutlass_here, tmp_path):
    child(tmp_path, [4096])
    libs = list((tmp_path / "cute").glob("*.so"))  # (none where there is no C compiler)
    for p in objects(tmp_path) + libs:
        p.write_bytes(b"not an object file")
    assert child(tmp_path, [4096]) == {"compiled": 2, "loaded": 0, "callable": True}
    assert all(p.stat().st_size > 1000 for p in objects(tmp_path) + libs)
    assert child(tmp_path, [4096])["loaded"] == 2


FAST_CHILD = CHILD.replace('"callable": all(callable(f) for f in fns)}', '"callable": all(callable(f) for f in fns), '
                           '"cutlass": "cutlass" in sys.modules}')


def test_fast_load_keeps_shared_libraries_and_loads_them_without_cute_dsl(cutlass_here, tmp_path):
    """By default every object gets a shared library beside it, and a later process loads the kernels
    from those without importing CuTe DSL (`cutlass`). An object written with CUTILE_NORMS_FAST_LOAD=0
    gets its library at its first load without the switch; a library that does not load is removed,
    and the object file loads instead and links it again."""
    env = {_diskcache.ENV_FAST_LOAD: "1"}
    assert child(tmp_path, [4096], {_diskcache.ENV_FAST_LOAD: ""}) == {"compiled": 2, "loaded": 0, "callable": True}
    libs = sorted((tmp_path / "cute").glob("*.so"))
    assert [p.with_suffix(".o") for p in libs] == objects(tmp_path) and len(libs) == 2
    assert fast_child(tmp_path, [4096], env) == {"compiled": 0, "loaded": 2, "callable": True, "cutlass": False}
    off = {_diskcache.ENV_FAST_LOAD: "0"}
    assert child(tmp_path, [2880], off) == {"compiled": 2, "loaded": 0, "callable": True}  # off: no library
    assert len(list((tmp_path / "cute").glob("*.so"))) == 2
    assert fast_child(tmp_path, [2880], env)["loaded"] == 2  # linked now
    assert fast_child(tmp_path, [2880], env) == {"compiled": 0, "loaded": 2, "callable": True, "cutlass": False}
    for p in (tmp_path / "cute").glob("*.so"):
        p.write_bytes(b"not a shared library")
    assert fast_child(tmp_path, [4096, 2880], env)["loaded"] == 4
    assert fast_child(tmp_path, [4096, 2880], env)["cutlass"] is False
    assert not list((tmp_path / "cute").glob(".*")), "a temporary file was left behind"


def fast_child(cache, widths, extra_env):
    env = dict(os.environ, CUTILE_NORMS_CACHE_DIR=str(cache), CUTE_DSL_ARCH="sm_90a", CUDA_VISIBLE_DEVICES="",
               PYTHONPATH=python_path(), **extra_env)
    proc = subprocess.Popen([sys.executable, "-c", FAST_CHILD, json.dumps(widths)], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    return result(proc)


@pytest.mark.parametrize("cache", ["linked-here", "other-install", "empty"])
def test_fast_load_probes_cute_dsl_without_importing_it(tmp_path, cache):
    """Where an install of this fingerprint (package, CuTe DSL and tvm_ffi versions) linked shared
    libraries into the cache, the toolchain finds CuTe DSL installed without importing it (the import
    is what a first call would pay; it comes at a compile). With none yet, or only another install's
    libraries (a cache folder shared between environments), it imports CuTe DSL up front, so an
    install that does not import is found before mode=None routes to it."""
    import importlib.util

    (tmp_path / "cute").mkdir()
    if cache == "linked-here":
        _diskcache.linked_marker(tmp_path).touch()
    if cache == "other-install":
        (tmp_path / "cute" / "0123.so").write_bytes(b"another install's library")
        (tmp_path / "cute" / "linked-0123456789abcdef01234567").touch()
    code = ("import sys, cutile_norms as cn; from cutile_norms._platform import toolchain; "
            "print('RESULT', toolchain().error('cute'), 'cutlass' in sys.modules)")
    env = dict(os.environ, CUTILE_NORMS_CACHE_DIR=str(tmp_path), PYTHONPATH=python_path(), CUDA_VISIBLE_DEVICES="")
    env.pop(_diskcache.ENV_FAST_LOAD, None)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    line = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT")][-1]
    installed = importlib.util.find_spec("cutlass") is not None and importlib.util.find_spec("tvm_ffi") is not None
    if cache == "linked-here":
        assert line.split()[-1] == "False", (line, out.stderr[-2000:])  # never imported
    if installed:
        assert line == f"RESULT None {cache != 'linked-here'}", (line, out.stderr[-2000:])


def test_size_bound_drops_the_least_recently_used(tmp_path, monkeypatch):
    folder = tmp_path / "cute"
    folder.mkdir()
    now = time.time()
    for i in range(8):  # 8 objects of 256 KiB, used one after another
        p = folder / f"{i:02d}.o"
        p.write_bytes(os.urandom(1 << 18))
        os.utime(p, (now - 100 + i, now - 100 + i))
    (folder / ".00-writer.o").write_bytes(os.urandom(1 << 18))  # another process's file being written
    monkeypatch.setenv(_diskcache.ENV_MAX_MB, "1")  # 4 objects fit; eviction leaves at most 3/4 MiB
    _diskcache.max_bytes.cache_clear()
    try:
        _diskcache.evict(folder)
    finally:
        _diskcache.max_bytes.cache_clear()
    assert sorted(p.name for p in folder.glob("*.o")) == [".00-writer.o", "05.o", "06.o", "07.o"]


def test_a_bound_smaller_than_an_entry_keeps_the_newest_and_old_temporaries_go(tmp_path, monkeypatch):
    folder = tmp_path / "cute"
    folder.mkdir()
    old, new = folder / "old.o", folder / "new.o"
    for p in (old, new):
        p.write_bytes(os.urandom(1 << 18))
    dead, live = folder / ".dead-writer.o", folder / ".live-writer.o"
    for p in (dead, live):
        p.write_bytes(b"partial")
    stale = time.time() - _diskcache.STALE_TEMP_SECONDS - 60
    os.utime(dead, (stale, stale))
    monkeypatch.setenv(_diskcache.ENV_MAX_MB, "0.1")
    _diskcache.max_bytes.cache_clear()
    try:
        _diskcache.evict(folder, keep=new)
    finally:
        _diskcache.max_bytes.cache_clear()
    assert sorted(p.name for p in folder.iterdir()) == [".live-writer.o", "new.o"]


def test_only_a_whole_elf_file_is_loaded(tmp_path):
    """The section header table sits at an ELF file's end: a copy cut short fails the check (the loader
    mapped such a library and the process died at the first call)."""
    import shutil

    exe = shutil.which("true") or sys.executable
    whole = tmp_path / "whole.so"
    whole.write_bytes(open(exe, "rb").read())
    assert _diskcache.whole_elf(whole)
    for size in (whole.stat().st_size - 1, whole.stat().st_size // 2, 63, 0):
        cut = tmp_path / f"cut{size}.so"
        cut.write_bytes(whole.read_bytes()[:size])
        assert not _diskcache.whole_elf(cut), size
    assert _diskcache.load_cute((tmp_path / "cut63.o", "f")) is None  # (no .o: the cut library only, refused)


def test_an_entry_cut_short_is_compiled_again(cutlass_here, tmp_path):
    child(tmp_path, [4096])
    entries = objects(tmp_path) + list((tmp_path / "cute").glob("*.so"))
    sizes = {p: p.stat().st_size for p in entries}
    for p in entries:
        p.write_bytes(p.read_bytes()[:sizes[p] - 4096])
    assert child(tmp_path, [4096]) == {"compiled": 2, "loaded": 0, "callable": True}
    assert all(p.stat().st_size == sizes[p] for p in entries)


def test_a_failed_link_is_not_tried_again_at_each_load(cutlass_here, tmp_path):
    cc = tmp_path / "cc"
    calls = tmp_path / "calls"
    cc.write_text(f"#!/bin/sh\necho x >> {calls}\nexit 1\n")
    cc.chmod(0o755)
    cache = tmp_path / "cache"
    assert child(cache, [4096], {"CC": str(cc)})["compiled"] == 2
    made = calls.read_text().count("x")
    assert made == 2 and len(list((cache / "cute").glob("*.nolink"))) == 2
    assert child(cache, [4096], {"CC": str(cc)})["loaded"] == 2
    assert calls.read_text().count("x") == made, "the compiler ran again at a load"


def test_a_read_only_cache_is_read_and_a_broken_entry_left_there(tmp_path, monkeypatch):
    """A folder that cannot be written (a cache in a read-only image): one warning, nothing stored, and a
    broken entry that cannot be removed is skipped, not raised from the kernel's call."""
    monkeypatch.setenv(_diskcache.ENV_DIR, str(tmp_path))
    monkeypatch.delenv(_diskcache.ENV_SWITCH, raising=False)
    monkeypatch.setattr(_diskcache, "_probe_writable", lambda path: False)
    _diskcache.cache_dir.cache_clear()
    try:
        with pytest.warns(UserWarning, match="not writable: its kernels are loaded"):
            assert _diskcache.cache_dir() == tmp_path
        assert not _diskcache.writable()
        (tmp_path / "cute").mkdir()
        broken = tmp_path / "cute" / "broken.o"
        broken.write_bytes(b"")

        def refuse(self, missing_ok=False):
            raise PermissionError(f"read-only: {self}")

        monkeypatch.setattr(type(broken), "unlink", refuse)
        assert _diskcache.load_cute((broken, "f")) is None and broken.exists()
        class Compiled:  # what cute.compile returns, as store_cute uses it
            def export_to_c(self, path, function_name):
                open(path, "wb").write(b"object")

        _diskcache.store_cute((tmp_path / "cute" / "new.o", "f"), Compiled())
        assert not (tmp_path / "cute" / "new.o").exists()
    finally:
        _diskcache.cache_dir.cache_clear()


def test_the_fingerprint_covers_the_modules_the_cute_kernels_import(monkeypatch):
    """reference.py's FP8 bounds are compiled into the FP8 kernel: a change there is a new key."""
    import pathlib

    _diskcache._cute_fingerprint.cache_clear()
    before = _diskcache._cute_fingerprint()
    read = pathlib.Path.read_bytes
    monkeypatch.setattr(pathlib.Path, "read_bytes",
                        lambda self: read(self) + (b"#" if self.name == "reference.py" else b""))
    _diskcache._cute_fingerprint.cache_clear()
    try:
        assert _diskcache._cute_fingerprint() != before
    finally:
        monkeypatch.undo()
        _diskcache._cute_fingerprint.cache_clear()


def test_a_bad_size_bound_warns_and_keeps_the_default(monkeypatch):
    monkeypatch.setenv(_diskcache.ENV_MAX_MB, "2G")
    _diskcache.max_bytes.cache_clear()
    try:
        with pytest.warns(UserWarning, match="not a positive number"):
            assert _diskcache.max_bytes() == _diskcache.DEFAULT_MAX_MB * 2 ** 20
    finally:
        _diskcache.max_bytes.cache_clear()


def test_the_target_arch_setting_is_part_of_the_key(cutlass_here, tmp_path):
    """A kernel built for CUTE_DSL_ARCH=sm_100a is not what a process targeting sm_90a loads."""
    default_target = {"CHILD_ARCH": ""}
    assert child(tmp_path, [4096], {"CUTE_DSL_ARCH": "sm_100a", **default_target})["compiled"] == 2
    assert child(tmp_path, [4096], {"CUTE_DSL_ARCH": "sm_90a", **default_target})["compiled"] == 2
    assert child(tmp_path, [4096], {"CUTE_DSL_ARCH": "sm_100a", **default_target})["loaded"] == 2


def test_keys_separate_what_changes_the_binary(tmp_path, monkeypatch):
    monkeypatch.setenv(_diskcache.ENV_DIR, str(tmp_path))
    monkeypatch.delenv(_diskcache.ENV_SWITCH, raising=False)
    _diskcache.cache_dir.cache_clear()
    try:
        base = (torch.bfloat16, torch.bfloat16, 4096, "cfg", True, True)
        variants = [base, (torch.float16,) + base[1:], base[:2] + (4104,) + base[3:], base[:4] + (False, True)]
        paths = {_diskcache.cute_entry("sm_90a", k)[0] for k in variants}
        paths.add(_diskcache.cute_entry("sm_100a", base)[0])
        assert len(paths) == 5 and all(p.parent == tmp_path / "cute" for p in paths)
        assert _diskcache.cute_entry("sm_90a", base) == _diskcache.cute_entry("sm_90a", base)  # stable
        monkeypatch.setenv(_diskcache.ENV_SWITCH, "0")
        _diskcache.cache_dir.cache_clear()
        assert _diskcache.cute_entry("sm_90a", base) is None
    finally:
        _diskcache.cache_dir.cache_clear()


# 32 KiB bf16 rows: the forward and the backward are both CuTe DSL kernels (the backward takes rows
# from dispatch.CUTE_BWD_MIN_BYTES), so the first process compiles two and the second loads both.
GPU_CHILD = r"""
import json, sys, torch, cutile_norms as cn
from cutile_norms.cute import rmsnorm_bwd as B, rmsnorm_fwd as F
torch.manual_seed(int(sys.argv[1]))
x = torch.randn(300, 16384, device="cuda", dtype=torch.bfloat16, requires_grad=True)
w = (1 + 0.1 * torch.randn(16384, device="cuda")).to(torch.bfloat16).requires_grad_()
dy = torch.randn(300, 16384, device="cuda", dtype=torch.bfloat16)
y = cn.rms_norm(x, w, mode="tma_smem_cached")
cutlass_after_forward = "cutlass" in sys.modules
y.backward(dy)
x64, w64, dy64 = x.detach().double(), w.detach().double(), dy.double()
rstd = torch.rsqrt(x64.square().mean(-1, keepdim=True) + 1e-6)
ref, xhat, g = x64 * rstd * w64, x64 * rstd, dy64 * w64
dx = rstd * (g - xhat * (g * xhat).mean(-1, keepdim=True))
dw = (dy64 * xhat).sum(0)
rel = lambda a, e: float(((a.double() - e).abs() / (e.abs() + 1e-2 * e.abs().mean())).max())  # NaN stays NaN
print("RESULT " + json.dumps({"compiled": F.CACHE.count + B.CACHE.count, "loaded": F.CACHE.loaded + B.CACHE.loaded,
                              "err": rel(y, ref), "dx_err": rel(x.grad, dx), "dw_err": rel(w.grad, dw),
                              "cutlass_after_forward": cutlass_after_forward}))
"""


@pytest.mark.gpu
@pytest.mark.parametrize("fast_load", [False, True])
def test_loaded_kernel_runs_on_the_gpu(tmp_path, fast_load, seed):
    """A second process runs the kernels it loaded (by default from the shared libraries, its forward
    without importing CuTe DSL; with CUTILE_NORMS_FAST_LOAD=0 from the object files)."""
    if cn_mode_unavailable():
        pytest.skip(cn_mode_unavailable())
    env = dict(os.environ, CUTILE_NORMS_CACHE_DIR=str(tmp_path), PYTHONPATH=python_path(),
               **{_diskcache.ENV_FAST_LOAD: "1" if fast_load else "0"})
    runs = []
    for _ in range(2):
        out = subprocess.run([sys.executable, "-c", GPU_CHILD, str(seed)], env=env, capture_output=True, text=True,
                             timeout=600)
        lines = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")]
        assert out.returncode == 0 and lines, out.stderr[-3000:]
        runs.append(json.loads(lines[-1][len("RESULT "):]))
    assert runs[0]["compiled"] >= 2 and runs[1]["compiled"] == 0 and runs[1]["loaded"] == runs[0]["compiled"], runs
    for r in runs:  # y, dx and dw in bf16: a rounding or two of bf16 relative to each value (NaN fails)
        assert r["err"] <= 2 ** -7 and r["dx_err"] <= 2 ** -6 and r["dw_err"] <= 2 ** -6, runs
    assert runs[1]["cutlass_after_forward"] is not fast_load, runs


def cn_mode_unavailable():
    import cutile_norms as cn

    return cn.available_modes().get("tma_smem_cached")
