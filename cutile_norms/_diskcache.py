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
the source of the package's CuTe modules and of the package modules they import (constants such as
the FP8 formats' bounds are compiled in), the machine type, the target arch and the compile key
(dtypes, N, launch config, flags). Writers write a temporary file, flush it to disk and rename it
into place, so processes filling the cache at once never read a partial file (two writers of one key
write the same bytes; the last rename wins). An entry whose ELF section table does not fit in the file
(cut short) is never loaded; an entry that fails to load is removed (where the folder allows) and
compiled again. Entries take the mode the umask gives (a cache a team shares is readable by it).
A folder that exists but is not writable (a cache baked into an image) is read: its CuTe entries load,
new ones are not stored (cuTile's cache is not pointed there: it writes). Writable or not, the folder is trusted: its shared libraries are loaded
into the process, so anyone who can write to it can run code there (as with Triton's and cuTile's
caches); a relative CUTILE_NORMS_CACHE_DIR is taken from the working folder at first use.
"""
from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import os
import platform
import shutil
import struct
import subprocess
import sys
import tempfile
import time
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
    """The cache folder (absolute), created on first use; None when switched off, when no home folder can
    be found for the default, or when it can neither be created nor read (one warning). `writable()`
    says whether entries are stored there too."""
    if os.environ.get(ENV_SWITCH, "1").strip().lower() in ("0", "false", "no", "off", "disable", "disabled"):
        return None
    home = os.path.expanduser("~")
    if not os.environ.get(ENV_DIR) and not os.environ.get("XDG_CACHE_HOME") and home.startswith("~"):
        warnings.warn(f"cutile_norms: no home folder for the compile cache; kernels are compiled in every "
                      f"process (set {ENV_DIR})", stacklevel=3)
        return None
    root = os.environ.get(ENV_DIR) or os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.join(home, ".cache"),
                                                   "cutile_norms")
    path = Path(root).absolute()
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        if not path.is_dir():
            warnings.warn(f"cutile_norms: compile cache folder {root!r} cannot be made ({exc}); kernels are "
                          f"compiled in every process (set {ENV_DIR} to a writable folder)", stacklevel=3)
            return None
    if not _probe_writable(path):
        warnings.warn(f"cutile_norms: compile cache folder {root!r} is not writable: its kernels are loaded, "
                      f"new ones are compiled in every process (set {ENV_DIR} to a writable folder)", stacklevel=3)
    return path


@functools.lru_cache(maxsize=None)
def _probe_writable(path: Path) -> bool:
    try:
        tempfile.NamedTemporaryFile(dir=path, prefix=".probe-", delete=True).close()
        return True
    except OSError:
        return False


def writable() -> bool:
    """Whether new entries are stored in the cache folder (it is on and writable)."""
    root = cache_dir()
    return root is not None and _probe_writable(root)


def point_cutile_cache() -> None:
    """cuTile's own disk cache in a folder of ours, unless the user set CUDA_TILE_CACHE_DIR (to anything,
    the empty string, cuTile's off switch, included), before cuda.tile runs."""
    root = cache_dir()
    if root is not None and writable() and "CUDA_TILE_CACHE_DIR" not in os.environ:
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
    """The package version, the machine type, CuTe DSL's and tvm_ffi's versions (tvm_ffi loads the shared
    libraries), its CUTE_DSL_* settings (the target arch, debug, line info, optimisation level,
    assertions: any may change the binary) and the package's sources (its top-level modules and the CuTe
    ones), hashed. Read from package metadata: no import."""
    package = sys.modules.get(__package__)  # (imported by now: this runs at a kernel's first compile)
    h = hashlib.sha256(str(getattr(package, "__version__", "?")).encode())
    h.update(platform.machine().encode())
    h.update(repr(sorted((k, v) for k, v in os.environ.items() if k.startswith("CUTE_DSL_"))).encode())
    for dist in ("nvidia-cutlass-dsl", "nvidia-cutlass-dsl-libs-base", "apache-tvm-ffi"):
        try:
            h.update(f"{dist}={importlib.metadata.version(dist)}".encode())
        except importlib.metadata.PackageNotFoundError:
            h.update(f"{dist}=?".encode())
    here = Path(__file__).parent  # the CuTe modules and the package modules they import (reference.py's
    for source in [*sorted(here.glob("*.py")), *sorted((here / "cute").glob("*.py"))]:  # FP8 bounds, ...)
        h.update(str(source.relative_to(here)).encode())
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
        if not whole_elf(path):
            raise ValueError("cut short")
        from cutlass.cute.runtime import load_module

        module = load_module(str(path), enable_tvm_ffi=True)
        fn = getattr(module, name)
    except Exception:  # noqa: BLE001 -- a stale or partial entry: compile again, replace it
        _discard(path)
        return None
    _loaded[str(path)] = module
    _touch(path)
    if fast_load() and writable() and not path.with_suffix(".so").exists() and not _link_failed_lately(path):
        link_shared(path)
    return fn


NOLINK_SECONDS = 86400  # a failed link is tried again after this (a compiler fixed or installed since)


def _link_failed_lately(obj: Path) -> bool:
    try:
        return time.time() - obj.with_suffix(".nolink").stat().st_mtime < NOLINK_SECONDS
    except OSError:
        return False


def whole_elf(path: Path) -> bool:
    """Whether `path` is a 64-bit ELF file whose section header table (written last, at its end) lies
    inside it: a file cut short (a writer killed, a disk full, a power loss) fails, and is never handed
    to the loader, which mapped one and died on a bus error at the first call."""
    try:
        with open(path, "rb") as f:
            head = f.read(64)
            size = os.fstat(f.fileno()).st_size
    except OSError:
        return False
    if len(head) < 64 or head[:5] != b"\x7fELF\x02":
        return False
    (shoff,) = struct.unpack_from("<Q", head, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", head, 0x3A)
    return 64 <= shoff and shoff + shentsize * shnum <= size


def _discard(path: Path) -> None:
    """Remove a broken entry where the folder allows (a read-only cache keeps it, unused)."""
    try:
        path.unlink(missing_ok=True)
    except OSError:
        pass


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
        if not whole_elf(so):
            raise ValueError("cut short")
        import tvm_ffi

        module = tvm_ffi.load_module(str(so))
        fn = getattr(module, name)
    except Exception:  # noqa: BLE001 -- a stale or partial library: the object file, or a compile
        _discard(so)
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
            with open(tmp, "rb") as f:  # on disk before it is named: a crash leaves no short entry
                os.fsync(f.fileno())
            os.chmod(tmp, 0o666 & ~_umask())  # (mkstemp's 0600 would keep a shared cache's entries private)
            os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


@functools.lru_cache(maxsize=None)
def _umask() -> int:
    """This process's umask, read without changing it (Linux's /proc), else the common 022."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1], 8) for line in f if line.startswith("Umask:"))
    except (OSError, StopIteration, ValueError):
        return 0o022


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
        else:  # a failed link is not tried again at each load of the object (every process ran the compiler)
            obj.with_suffix(".nolink").touch()
    except Exception:  # noqa: BLE001 -- the object file is the entry; the library only saves an import
        return


def store_cute(entry: tuple[Path, str], fn) -> None:
    """Export `fn` (cute.compile's result) to `entry`: a temporary file renamed into place."""
    path, name = entry
    if not writable():
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)

        def export(tmp: str) -> bool:
            fn.export_to_c(tmp, function_name=name)
            return True

        _write_into(path, export)
        if fast_load():
            link_shared(path)
        evict(path.parent, keep=path)
    except Exception as exc:  # noqa: BLE001 -- the kernel runs; only the next process compiles again
        warnings.warn(f"cutile_norms: could not store a compiled kernel in {path.parent} ({type(exc).__name__}: "
                      f"{exc})", stacklevel=3)


STALE_TEMP_SECONDS = 3600  # a writer's temporary file this old belongs to a writer that died


def evict(folder: Path, keep: Path | None = None) -> None:
    """Past the size bound, the least recently used objects and libraries go until 3/4 of it is left
    (`keep`'s object and library stay: a bound smaller than one entry keeps the newest). Another writer's
    temporary `.name-*` files are left alone, unless older than STALE_TEMP_SECONDS (their writer died)."""
    limit, now = max_bytes(), time.time()
    kept = set() if keep is None else {keep, keep.with_suffix(".so")}
    files = []
    for p in [*folder.glob("*.o"), *folder.glob("*.so"), *folder.glob(".*")]:
        try:
            st = p.stat()
        except FileNotFoundError:  # another process evicted it
            continue
        if p.name.startswith("."):
            if not p.name.startswith(".probe-") and now - st.st_mtime > STALE_TEMP_SECONDS:
                _discard(p)
            continue
        if p not in kept:
            files.append((st.st_mtime, st.st_size, p))
    total = sum(size for _, size, _ in files) + sum(_size(p) for p in kept)
    if total <= limit:
        return
    for _, size, p in sorted(files, key=lambda f: f[0]):
        if total <= 0.75 * limit:
            break
        _discard(p)
        if p.suffix == ".o":
            _discard(p.with_suffix(".nolink"))
        total -= size


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:  # (absent, or evicted by another process meanwhile)
        return 0
