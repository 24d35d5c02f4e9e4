"""The compile cache on disk: what a fresh process would otherwise compile again.

Per DSL:
  * CuTe DSL (`cute.compile` has no cache of its own): each compiled kernel is exported as an object
    file (`export_to_c`) and a later process links it in (`cute.runtime.load_module`, ~3 ms against
    0.7-0.9 s to compile one; measured on the CPU for sm_90a and in the H100 profile of a first call).
    The object is also linked into a shared library beside it (the system C compiler, the DSL's
    runtime libraries found through its RUNPATH), which a later process loads with `tvm_ffi` alone,
    without `import cutlass`: a fresh process's first call at N = 4096, M = 1 took 0.21-0.35 s on an
    H200 so, against 2.5-3.4 s importing CuTe DSL and loading the object file (docs/performance.md 2.15).
    Where there is no C compiler, or the link fails, the object file is the entry.
  * cuTile: its own cubin cache, pointed at a folder here (CUDA_TILE_CACHE_DIR) unless the user set one.
  * Triton: its own cache (~/.triton/cache, TRITON_CACHE_DIR), left as the user has it.

Settings (read once per process):
  CUTILE_NORMS_CACHE_DIR      the folder (default: $XDG_CACHE_HOME/cutile_norms or ~/.cache/cutile_norms)
  CUTILE_NORMS_DISK_CACHE=0   off: nothing read or written here, CUDA_TILE_CACHE_DIR left alone
  CUTILE_NORMS_CACHE_MAX_MB   the bound on the CuTe objects (default 1024): past it the least recently
                              used files go, down to 3/4 of it
  CUTILE_NORMS_FAST_LOAD=0    CuTe kernels kept as object files only, loaded through CuTe DSL (by
                              default they are also kept as shared libraries, and where the cache
                              holds some, CuTe DSL is imported only at a compile)

An entry's name hashes everything that changes the binary: the package version, the DSL's version,
the source of the package's CuTe modules, the target arch and the compile key (dtypes, N, launch
config, flags). Writers write a temporary file and rename it into place, so processes filling the
cache at once never read a partial file (two writers of one key write the same bytes; the last
rename wins). An entry that fails to load is removed and compiled again.
"""
from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import os
import shutil
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

ENV_DIR = "CUTILE_NORMS_CACHE_DIR"
ENV_SWITCH = "CUTILE_NORMS_DISK_CACHE"
ENV_MAX_MB = "CUTILE_NORMS_CACHE_MAX_MB"
ENV_FAST_LOAD = "CUTILE_NORMS_FAST_LOAD"
DEFAULT_MAX_MB = 1024
_loaded: dict = {}  # path -> the module object (keeps the linked code alive)


@functools.lru_cache(maxsize=None)
def cache_dir() -> Path | None:
    """The cache folder, created on first use; None when switched off or not writable (one warning)."""
    if os.environ.get(ENV_SWITCH, "1").strip().lower() in ("0", "false", "no", "off"):
        return None
    root = os.environ.get(ENV_DIR) or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "cutile_norms")
    try:
        path = Path(root)
        path.mkdir(parents=True, exist_ok=True)
        probe = tempfile.NamedTemporaryFile(dir=path, prefix=".probe-", delete=True)
        probe.close()
    except OSError as exc:
        warnings.warn(f"cutile_norms: compile cache folder {root!r} is not writable ({exc}); kernels are "
                      f"compiled in every process (set {ENV_DIR} to a writable folder)", stacklevel=3)
        return None
    return path


def point_cutile_cache() -> None:
    """cuTile's own disk cache in a folder of ours, unless the user set CUDA_TILE_CACHE_DIR (to anything,
    the empty string, cuTile's off switch, included), before cuda.tile runs."""
    root = cache_dir()
    if root is not None and "CUDA_TILE_CACHE_DIR" not in os.environ:
        os.environ["CUDA_TILE_CACHE_DIR"] = str(root / "cutile")


@functools.lru_cache(maxsize=None)
def max_bytes() -> float:
    """CUTILE_NORMS_CACHE_MAX_MB in bytes (read once; a value that is not a number: the default, one warning)."""
    raw = os.environ.get(ENV_MAX_MB, str(DEFAULT_MAX_MB))
    try:
        value = float(raw)
        if not value > 0:
            raise ValueError
    except ValueError:
        warnings.warn(f"cutile_norms: {ENV_MAX_MB}={raw!r} is not a positive number of MiB; using {DEFAULT_MAX_MB}",
                      stacklevel=2)
        value = DEFAULT_MAX_MB
    return value * 2 ** 20


@functools.lru_cache(maxsize=None)
def _cute_fingerprint() -> str:
    """The package version, CuTe DSL's and tvm_ffi's versions (tvm_ffi loads the shared libraries), its
    CUTE_DSL_* settings (the target arch, debug, line info, optimisation level, assertions: any may
    change the binary) and the package's CuTe sources, hashed. Read from package metadata: no import."""
    package = sys.modules.get(__package__)  # (imported by now: this runs at a kernel's first compile)
    h = hashlib.sha256(str(getattr(package, "__version__", "?")).encode())
    h.update(repr(sorted((k, v) for k, v in os.environ.items() if k.startswith("CUTE_DSL_"))).encode())
    for dist in ("nvidia-cutlass-dsl", "nvidia-cutlass-dsl-libs-base", "apache-tvm-ffi"):
        try:
            h.update(f"{dist}={importlib.metadata.version(dist)}".encode())
        except importlib.metadata.PackageNotFoundError:
            h.update(f"{dist}=?".encode())
    folder = Path(__file__).parent / "cute"
    for source in sorted(folder.glob("*.py")):
        h.update(source.name.encode())
        h.update(source.read_bytes())
    return h.hexdigest()


def cute_entry(arch: str | None, key: tuple) -> tuple[Path, str] | None:
    """(the object file, its exported function name) for a CuTe compile key on `arch` (None: what
    cute.compile targets by default: CUTE_DSL_ARCH if set, else the current GPU's), or None when the
    cache is off."""
    root = cache_dir()
    if root is None:
        return None
    if arch is None:
        arch = os.environ.get("CUTE_DSL_ARCH") or _current_arch()
    digest = hashlib.sha256(f"{_cute_fingerprint()}|{arch}|{key!r}".encode()).hexdigest()[:32]
    return root / "cute" / f"{digest}.o", f"cutile_norms_{digest}"


def _current_arch() -> str:
    """The arch cute.compile targets by default: the current GPU's ("sm_90a" on Hopper), or, with no
    GPU, its own default (a fixed name here: the same environment gives the same binary)."""
    import torch

    if not torch.cuda.is_available():
        return "cute-default-without-gpu"
    major, minor = torch.cuda.get_device_capability()
    return f"sm_{major}{minor}a"


def fast_load() -> bool:
    """CuTe kernels kept as shared libraries too, and loaded from them (CUTILE_NORMS_FAST_LOAD=0: not)."""
    return os.environ.get(ENV_FAST_LOAD, "1").strip().lower() not in ("0", "false", "no", "off")


def linked_marker(root: Path) -> Path:
    """The file that says an install of this fingerprint (the same package, CuTe DSL and tvm_ffi
    versions) imported CuTe DSL and linked a kernel into a shared library in this cache."""
    return root / "cute" / f"linked-{_cute_fingerprint()[:24]}"


def has_shared_libraries() -> bool:
    """Whether an install of this fingerprint has linked CuTe kernels into shared libraries in this
    cache: a process that loads them may leave the import of CuTe DSL to its first compile (it did
    import there). Another install's libraries, in a cache folder shared between environments, do not
    count."""
    root = cache_dir()
    return root is not None and linked_marker(root).exists()


def load_cute(entry: tuple[Path, str]):
    """The compiled function stored at `entry`, or None (absent, or unloadable: then removed). With
    fast_load(), from the entry's shared library where there is one (no CuTe DSL import)."""
    path, name = entry
    if fast_load():
        fn = _load_shared(path.with_suffix(".so"), name)
        if fn is not None:
            return fn
    if not path.exists():
        return None
    try:
        from cutlass.cute.runtime import load_module

        module = load_module(str(path), enable_tvm_ffi=True)
        fn = getattr(module, name)
    except Exception:  # noqa: BLE001 -- a stale or partial entry: compile again, replace it
        path.unlink(missing_ok=True)
        return None
    _loaded[str(path)] = module
    _touch(path)
    if fast_load() and not path.with_suffix(".so").exists():
        link_shared(path)
    return fn


def _touch(path: Path) -> None:
    try:
        os.utime(path)  # recently used: the last to go when the bound is passed
    except OSError:
        pass


def _load_shared(so: Path, name: str):
    """The function `name` of the shared library `so` through tvm_ffi (the same C entry point that
    `load_module` finds in the object file), or None (absent, or unloadable: then removed)."""
    if not so.exists():
        return None
    try:
        import tvm_ffi

        module = tvm_ffi.load_module(str(so))
        fn = getattr(module, name)
    except Exception:  # noqa: BLE001 -- a stale or partial library: the object file, or a compile
        so.unlink(missing_ok=True)
        return None
    _loaded[str(so)] = module
    _touch(so)
    return fn


def _write_into(path: Path, write) -> None:
    """`write(tmp)` makes a temporary file beside `path` (named `.<stem>-*`, which eviction leaves
    alone), renamed into place where it returns True: readers never see a partial file."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.stem}-", suffix=path.suffix)
    os.close(fd)
    try:
        if write(tmp):
            os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def link_shared(obj: Path) -> None:
    """The object file linked into a shared library beside it (`.so`); it needs the DSL's runtime
    libraries, found through the library's RUNPATH. Nothing where there is no C compiler or the link
    fails (the object file still loads)."""
    cc = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if cc is None:
        return
    try:
        from cutlass.runtime import find_runtime_libraries

        libs = find_runtime_libraries(enable_tvm_ffi=True)
        rpaths = [f"-Wl,-rpath,{os.path.dirname(lib)}" for lib in libs]
        _write_into(obj.with_suffix(".so"), lambda tmp: subprocess.run(
            [cc, "-shared", "-o", tmp, str(obj), *libs, *rpaths], capture_output=True, timeout=300).returncode == 0)
        if obj.with_suffix(".so").exists():
            linked_marker(obj.parent.parent).touch()
    except Exception:  # noqa: BLE001 -- the object file is the entry; the library only saves an import
        return


def store_cute(entry: tuple[Path, str], fn) -> None:
    """Export `fn` (cute.compile's result) to `entry`: a temporary file renamed into place."""
    path, name = entry
    try:
        path.parent.mkdir(parents=True, exist_ok=True)

        def export(tmp: str) -> bool:
            fn.export_to_c(tmp, function_name=name)
            return True

        _write_into(path, export)
        if fast_load():
            link_shared(path)
        evict(path.parent)
    except Exception as exc:  # noqa: BLE001 -- the kernel runs; only the next process compiles again
        warnings.warn(f"cutile_norms: could not store a compiled kernel in {path.parent} ({type(exc).__name__}: "
                      f"{exc})", stacklevel=3)


def evict(folder: Path) -> None:
    """Past the size bound, the least recently used objects and libraries go until 3/4 of it is left
    (entries only: another writer's temporary `.name-*` files are left alone)."""
    limit = max_bytes()
    files = []
    for p in [*folder.glob("*.o"), *folder.glob("*.so")]:
        if p.name.startswith("."):
            continue
        try:
            st = p.stat()
        except FileNotFoundError:  # another process evicted it
            continue
        files.append((st.st_mtime, st.st_size, p))
    total = sum(size for _, size, _ in files)
    if total <= limit:
        return
    for _, size, p in sorted(files, key=lambda f: f[0]):
        if total <= 0.75 * limit:
            break
        p.unlink(missing_ok=True)
        total -= size
