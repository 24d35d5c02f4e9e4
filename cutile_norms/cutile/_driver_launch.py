"""cuTile kernels launched through a cached `cuLaunchKernel`: the host path at batch 1.

`ct.launch` works out a kernel's parameter constraints (dtypes, alignments, divisibility, aliasing)
from the tensors on every call, which cost ~15 us of host time per launch on an H100 host with every
argument prepared (bench/NOTES.md, "The host path"). Here the constraints of a launch are worked out
once, the kernel is compiled for them with cuTile's own exporter (`export_kernel`, the compiler that
`ct.launch` runs), loaded with the CUDA driver, and later launches with the same signature only check
the few facts the constraints assumed (dtypes, 16-byte alignment, lengths divisible by 16, which
arguments share a start) and write the parameters into a fixed buffer for `cuLaunchKernel`.

What it takes (anything else goes to `ct.launch`, as does every launch when
CUTILE_NORMS_CUTILE_LAUNCH=ct): 1-D and 2-D arrays and scalars, a kernel with a fixed block size (`.reqntid`),
no cluster and no dynamic shared memory. The parameter layout comes from the compiled kernel itself
(its PTX `.entry`), and a layout that does not match what the constraints predict disables the path for
that kernel (`DriverLaunch.disabled` says why).

Aliasing: a written argument must not overlap another argument unless it starts at the same address
(which the check sees). The launch wrappers meet this: what a kernel writes is a fresh output or a
library workspace; the only shared arguments are the placeholders they pass for arrays a kernel never
touches, which start where the array they stand in for starts.
"""
from __future__ import annotations

import ctypes
import io
import os
import re
import struct
import threading
from dataclasses import dataclass

import cuda.tile as ct
import torch

MAX_VARIANTS = 4  # signatures per launch site (alignments or dtypes that change between calls)
_ENABLED = os.environ.get("CUTILE_NORMS_CUTILE_LAUNCH", "driver") != "ct"

# ------------------------------------------------------------------------------------------------
# The compiled kernel's parameter list, read from the PTX cuTile embeds in its cubin
# ------------------------------------------------------------------------------------------------
_PTX_BITS = {"u64": 64, "b64": 64, "s64": 64, "f64": 64, "u32": 32, "b32": 32, "s32": 32, "f32": 32}


def _elf_sections(data: bytes) -> dict[str, bytes]:
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)
    headers = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)]
    names_at = headers[shstrndx][4]
    out = {}
    for name_off, sh_type, _, _, offset, size, *_ in headers:
        name = data[names_at + name_off: data.index(b"\0", names_at + name_off)].decode()
        out[name] = b"" if sh_type == 8 else data[offset: offset + size]  # 8 = NOBITS
    return out


def embedded_ptx(cubin: bytes) -> str:
    """The PTX text cuTile keeps in the cubin's `.nv_debug_ptx_txt` section."""
    text = _elf_sections(cubin).get(".nv_debug_ptx_txt", b"").decode(errors="replace").replace("\x00", "\n")
    return text.split(".nv_intermediate_source_section")[0]


def entry_layout(ptx: str, symbol: str) -> tuple[list[str], tuple[int, int, int]]:
    """(the .entry's parameter types in order, e.g. ['u64', 'u32', ...], its required block size).
    Raises ValueError for what the driver path does not take: no entry, a parameter that is not a
    scalar, no `.reqntid`, a cluster, dynamic shared memory."""
    at = ptx.find(f".entry {symbol}(")
    if at < 0:
        raise ValueError(f"no .entry {symbol} in the kernel's PTX")
    close = ptx.index(")", at)
    types = []
    for chunk in ptx[ptx.index("(", at) + 1:close].split(","):
        m = re.match(r"\s*\.param\s+\.(\w+)", chunk)
        if m is None or "[" in chunk or m.group(1) not in _PTX_BITS:
            raise ValueError(f"kernel parameter {chunk.strip()[:40]!r} is not a scalar the driver path packs")
        types.append(m.group(1))
    body_start = ptx.find("{", close)
    directives = ptx[close:body_start]
    ntid = re.search(r"\.reqntid\s+(\d+)(?:\s*,\s*(\d+))?(?:\s*,\s*(\d+))?", directives)
    if ntid is None:
        raise ValueError("the kernel has no .reqntid (a fixed block size)")
    if re.search(r"\.(reqnctapercluster|explicitcluster|maxclusterrank)", directives):
        raise ValueError("the kernel runs in clusters")
    if re.search(r"\.extern\s+\.shared", ptx):
        raise ValueError("the kernel uses dynamic shared memory")
    block = tuple(int(v) if v else 1 for v in ntid.groups())
    return types, block


# ------------------------------------------------------------------------------------------------
# What a launch's arguments must satisfy for a compiled variant, and where each value goes
# ------------------------------------------------------------------------------------------------
_TORCH_DTYPE = {ct.float16: torch.float16, ct.bfloat16: torch.bfloat16, ct.float32: torch.float32,
                ct.float64: torch.float64, ct.int8: torch.int8, ct.int16: torch.int16, ct.int32: torch.int32,
                ct.int64: torch.int64, ct.uint8: torch.uint8, ct.bool_: torch.bool}
_INT_RANGE = {ct.int32: (-(1 << 31), 1 << 31), ct.int64: (-(1 << 63), 1 << 63), ct.uint32: (0, 1 << 32)}
# a slot per parameter, 8 bytes each (cuLaunchKernel reads each parameter's own size from its pointer):
# (struct format, the PTX bit width it must have)
_SCALAR_SLOT = {ct.int32: ("i4x", 32), ct.uint32: ("I4x", 32), ct.int64: ("q", 64), ct.float32: ("f4x", 32),
                ct.float64: ("d", 64)}


@dataclass(frozen=True)
class ArrayParam:
    """An array argument as a compiled variant assumes it (cuTile's ArrayConstraint, per dim)."""
    index: int  # argument position
    dtype: torch.dtype
    base_div: int  # the data pointer is a multiple of this (bytes)
    shape_div: tuple  # each dim's length is a multiple of this
    shape_const: tuple  # each dim's length: this value (a launch specialises lengths of 1), or None
    stride_const: tuple  # each dim's stride: this value, or None
    stride_div: tuple
    stride_min: tuple  # each dim's stride is at least this, or None
    narrow: bool  # 32-bit lengths and strides
    disjoint: bool  # no two elements share an address

    @property
    def ndim(self) -> int:
        return len(self.shape_div)


def parameter_slots(sig) -> tuple[list, list, list, list]:
    """What a KernelSignature's parameters need at launch: (arrays, scalars, constants, slots):
    ArrayParams, (index, cuTile dtype), (index, value), and (struct format, PTX bit width) of each
    kernel parameter in order. An array is its pointer, then its lengths, then its strides (cuTile's
    calling convention: 1 + 2 x ndim words); a constant takes no parameter. Raises ValueError for
    what the driver path does not take."""
    from cuda.tile.compilation import ArrayConstraint, ConstantConstraint, ScalarConstraint

    arrays, scalars, consts, slots = [], [], [], []
    for i, c in enumerate(sig.parameters):
        if isinstance(c, ConstantConstraint):
            consts.append((i, c.value))
        elif isinstance(c, ArrayConstraint):
            if not 1 <= c.ndim <= 2 or c.dtype not in _TORCH_DTYPE or c.index_dtype not in (ct.int32, ct.int64):
                raise ValueError(f"argument {i}: a {c.ndim}-D {c.dtype} array (the driver path takes 1-D and 2-D)")
            narrow = c.index_dtype == ct.int32
            arrays.append(ArrayParam(i, _TORCH_DTYPE[c.dtype], c.base_addr_divisible_by, tuple(c.shape_divisible_by),
                                     tuple(c.shape_constant), tuple(c.stride_constant), tuple(c.stride_divisible_by),
                                     tuple(c.stride_lower_bound_incl), narrow, not c.may_alias_internally))
            slots += [("Q", 64)] + [("i4x", 32) if narrow else ("q", 64)] * (2 * c.ndim)
        elif isinstance(c, ScalarConstraint):
            if c.dtype not in _SCALAR_SLOT:
                raise ValueError(f"argument {i}: a {c.dtype} scalar")
            scalars.append((i, c.dtype))
            slots.append(_SCALAR_SLOT[c.dtype])
        else:
            raise ValueError(f"argument {i}: a {type(c).__name__} (the driver path takes arrays and scalars)")
    return arrays, scalars, consts, slots


def check_layout(types: list[str], slots: list) -> None:
    """Raises ValueError unless the PTX parameter types have the widths the slots predict."""
    if [_PTX_BITS[t] for t in types] != [bits for _, bits in slots]:
        raise ValueError(f"the kernel's parameters {types} are not the layout its constraints predict")


class _Variant:
    """One compiled signature: the checks its arguments must pass and the parameter buffer."""

    def __init__(self, kernel, args: tuple, device_index: int):
        from cuda.tile.compilation import CallingConvention, KernelSignature, export_kernel

        sig = KernelSignature.from_kernel_args(kernel, args, CallingConvention.cutile_python_v2())
        arrays, scalars, consts, slots = parameter_slots(sig)
        buf = io.BytesIO()
        major, minor = torch.cuda.get_device_capability(device_index)
        export_kernel(kernel, [sig], buf, gpu_code=f"sm_{major}{minor}", output_format="cubin")
        cubin = buf.getvalue()
        types, self.block = entry_layout(embedded_ptx(cubin), sig.symbol)
        check_layout(types, slots)
        self.nargs = len(args)
        self.values = argument_check(arrays, scalars, consts, len(args), _alias_pattern(arrays, args))
        self.pack = struct.Struct("<" + "".join(f for f, _ in slots)).pack_into
        self.buffer = ctypes.create_string_buffer(8 * len(types))
        base = ctypes.addressof(self.buffer)
        self.params = (ctypes.c_void_p * len(types))(*(base + 8 * k for k in range(len(types))))
        self.function, self.context = _driver().load(cubin, sig.symbol, device_index)


def _alias_pattern(arrays, args) -> tuple:
    """For each array argument, the first array argument that starts at the same address."""
    ptrs = [args[a.index].data_ptr() for a in arrays]
    return tuple(ptrs.index(p) for p in ptrs)


def argument_check(arrays, scalars, consts, nargs: int, alias: tuple, on_gpu: bool = True):
    """values(args) -> the parameter values in slot order, or None when `args` break an assumption
    of the variant (constants, dtypes, dims, alignment, divisibility, strides, index range, disjoint
    elements, which arrays share a start). Generated as straight-line code: a loop over the
    arguments cost ~6 us per call on a CPU machine's host, the straight-line check under half.
    on_gpu=False drops the tensors' device check (the CPU tests of the check itself)."""
    env = {f"D{a.index}": a.dtype for a in arrays}
    lines = ["def values(args):", f"    if len(args) != {nargs}: return None"]
    idx = [i for i, _ in consts]
    if idx == list(range(nargs - len(idx), nargs)):  # the constants are the tail: one comparison
        env["C"] = tuple(v for _, v in consts)
        lines.append(f"    if args[{nargs - len(idx)}:] != C: return None")
    else:
        for k, (i, v) in enumerate(consts):
            env[f"C{k}"] = v
            lines.append(f"    if args[{i}] != C{k} or type(args[{i}]) is not type(C{k}): return None")
    lines.append("    try:")
    bad, names = [], {}
    for a in arrays:
        i, d = a.index, range(a.ndim)
        n, st = [f"n{i}_{k}" for k in d], [f"s{i}_{k}" for k in d]
        lines += [f"        a{i} = args[{i}]",
                  f"        if a{i}.dtype is not D{i}{' or not a%d.is_cuda' % i if on_gpu else ''}: return None",
                  f"        {', '.join(n)}, = a{i}.shape", f"        p{i} = a{i}.data_ptr()",
                  f"        {', '.join(st)}, = a{i}.stride()"]
        names[i] = [f"p{i}"] + n + st
        if a.base_div > 1:
            bad.append(f"p{i} % {a.base_div}")
        for k in d:
            if a.shape_const[k] is not None:  # still passed as a parameter (1 + 2 x ndim words)
                bad.append(f"{n[k]} != {a.shape_const[k]}")
            elif a.shape_div[k] > 1:
                bad.append(f"{n[k]} % {a.shape_div[k]}")
            if a.stride_const[k] is not None:
                bad.append(f"{st[k]} != {a.stride_const[k]}")
                continue
            if a.stride_div[k] > 1:
                bad.append(f"{st[k]} % {a.stride_div[k]}")
            if a.stride_min[k] is not None:
                bad.append(f"{st[k]} < {a.stride_min[k]}")
            if a.narrow:
                bad.append(f"not -2147483648 <= {st[k]} < 2147483648")
        if a.narrow:
            bad += [f"{n[k]} >= 2147483648" for k in d]
        if a.disjoint:  # what disjoint elements look like here: rows that do not overlap, else refused
            bad.append(f"({n[0]} > 1 and {st[0]} == 0)" if a.ndim == 1 else
                       f"({n[0]} > 1 and {st[0]} < {n[1]} * {st[1]}) or ({n[1]} > 1 and {st[1]} < 1)")
    ptrs = [f"p{a.index}" for a in arrays]
    for k, first in enumerate(alias):  # the same starts as at compile time, and no others
        if first != k:
            bad.append(f"{ptrs[k]} != {ptrs[first]}")
    if len(ptrs) > 1:
        bad.append(f"len({{{', '.join(ptrs)}}}) != {len(set(alias))}")
    for i, dtype in scalars:
        lo_hi = _INT_RANGE.get(dtype)
        lines.append(f"        v{i} = args[{i}]")
        if lo_hi is not None:
            bad.append(f"type(v{i}) is not int or not {lo_hi[0]} <= v{i} < {lo_hi[1]}")
        else:
            bad.append(f"type(v{i}) is not float and type(v{i}) is not int")
        names[i] = [f"v{i}"]
    if bad:
        lines.append("        if " + " or ".join(f"({b})" for b in bad) + ": return None")
    lines += ["    except (AttributeError, ValueError, TypeError):", "        return None",
              f"    return ({', '.join(n for i in sorted(names) for n in names[i])},)"]
    exec("\n".join(lines), env)  # noqa: S102 (generated from the signature, no outside input)
    return env["values"]


class DriverLaunch:
    """The driver-launch path of one launch site (one kernel object with its constants): up to
    MAX_VARIANTS compiled signatures, tried in order; `launch` falls back to `ct.launch`."""

    def __init__(self, kernel):
        self.kernel = kernel
        self.variants: dict[int, list[_Variant]] = {}  # device index -> variants
        self.disabled: str | None = None  # why this site launches through ct.launch, if it does
        self._lock = threading.Lock()

    def launch(self, stream: int, grid: tuple, args: tuple, device_index: int) -> None:
        if self.disabled is None and _ENABLED:
            variants = self.variants.get(device_index, ())
            for v in variants:
                vals = v.values(args)
                if vals is not None:
                    v.pack(v.buffer, 0, *vals)
                    _driver().launch(v, grid, stream)
                    return
            # a new variant compiles and loads a module: never while a CUDA graph is being captured
            if len(variants) < MAX_VARIANTS and not torch.cuda.is_current_stream_capturing() and \
                    self._add(args, device_index):
                return self.launch(stream, grid, args, device_index)
        ct.launch(stream, grid, self.kernel, args)

    def _add(self, args: tuple, device_index: int) -> bool:
        with self._lock:
            try:
                v = _Variant(self.kernel, args, device_index)
            except Exception as e:  # anything the path cannot take: ct.launch from now on
                self.disabled = f"{type(e).__name__}: {e}"
                return False
            if v.values(args) is None:
                self.disabled = "a compiled variant rejects the arguments it was compiled for"
                return False
            self.variants.setdefault(device_index, []).append(v)
            return True


# ------------------------------------------------------------------------------------------------
# The CUDA driver, through ctypes (torch has loaded libcuda already)
# ------------------------------------------------------------------------------------------------
class _Driver:
    def __init__(self):
        lib = ctypes.CDLL("libcuda.so.1" if os.name != "nt" else "nvcuda.dll")
        vp, u = ctypes.c_void_p, ctypes.c_uint
        self._get_ctx = lib.cuCtxGetCurrent
        self._get_ctx.argtypes = [ctypes.POINTER(vp)]
        self._push = lib.cuCtxPushCurrent_v2
        self._push.argtypes = [vp]
        self._pop = lib.cuCtxPopCurrent_v2
        self._pop.argtypes = [ctypes.POINTER(vp)]
        self._load = lib.cuModuleLoadData
        self._load.argtypes = [ctypes.POINTER(vp), ctypes.c_char_p]
        self._get_fn = lib.cuModuleGetFunction
        self._get_fn.argtypes = [ctypes.POINTER(vp), vp, ctypes.c_char_p]
        self._launch = lib.cuLaunchKernel
        self._launch.argtypes = [vp, u, u, u, u, u, u, u, vp, vp, vp]
        self._err = lib.cuGetErrorString
        self._err.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]

    def check(self, rc: int, what: str) -> None:
        if rc:
            msg = ctypes.c_char_p()
            self._err(rc, ctypes.byref(msg))
            raise RuntimeError(f"{what} failed: CUDA error {rc} ({(msg.value or b'?').decode()})")

    def load(self, cubin: bytes, symbol: str, device_index: int):
        """(CUfunction, the CUcontext it belongs to): the device's primary context, torch's."""
        with torch.cuda.device(device_index):
            torch.cuda.init()
            torch.empty(1, device=f"cuda:{device_index}")  # the runtime makes the primary context current
            ctx = ctypes.c_void_p()
            self.check(self._get_ctx(ctypes.byref(ctx)), "cuCtxGetCurrent")
            module, fn = ctypes.c_void_p(), ctypes.c_void_p()
            self.check(self._load(ctypes.byref(module), cubin), "cuModuleLoadData")
            self.check(self._get_fn(ctypes.byref(fn), module, symbol.encode()), "cuModuleGetFunction")
        return fn.value, ctx.value

    def launch(self, v: _Variant, grid: tuple, stream: int) -> None:
        ctx = ctypes.c_void_p()
        self._get_ctx(ctypes.byref(ctx))
        switch = ctx.value != v.context
        if switch:  # another device's context is current on this thread: launch in the kernel's
            self.check(self._push(v.context), "cuCtxPushCurrent")
        try:
            gx, gy, gz = (tuple(grid) + (1, 1))[:3]
            bx, by, bz = v.block
            self.check(self._launch(v.function, gx, gy, gz, bx, by, bz, 0, stream, v.params, None),
                       "cuLaunchKernel")
        finally:
            if switch:
                self._pop(ctypes.byref(ctypes.c_void_p()))


_DRIVER: _Driver | None = None


def _driver() -> _Driver:
    global _DRIVER
    if _DRIVER is None:
        _DRIVER = _Driver()
    return _DRIVER


_SITES: dict = {}  # (kernel object, compile-time constants) -> DriverLaunch


def driver_launch(kernel, consts: tuple) -> DriverLaunch:
    """The driver-launch path of the launch site (kernel object, compile-time constants)."""
    site = _SITES.get((kernel, consts))
    if site is None:
        site = _SITES[(kernel, consts)] = DriverLaunch(kernel)
    return site


def launch(stream: int, grid: tuple, kernel, args: tuple, consts: tuple, device_index: int) -> None:
    """`ct.launch(stream, grid, kernel, args)`, through the cached driver launch where it can."""
    driver_launch(kernel, consts).launch(stream, grid, args, device_index)
