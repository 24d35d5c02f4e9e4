"""Ahead-of-time compilation of the cuTile kernels on a machine without a GPU (the CI compile checks).

`compile_cubin` runs the real toolchain (cuTile front end + tileiras) for an sm_90/sm_100 target;
`ptxas_report` re-assembles the PTX embedded in the cubin with `ptxas -v` to read registers and spills.
"""
from __future__ import annotations

import functools
import io
import os
import re
import shutil
import struct
import subprocess
import tempfile

import cuda.tile as ct
from cuda.tile.compilation import export_kernel

from cutile_norms.cutile import rmsnorm_fwd, rmsnorm_fwd_config

CT_DTYPES = {"float16": ct.float16, "bfloat16": ct.bfloat16, "float32": ct.float32}


def compile_cubin(cfg: rmsnorm_fwd_config.FwdConfig, N: int, x_dtype: str, w_dtype: str, *, has_w: bool = True,
                  store_rstd: bool = True, arch: str = "sm_90") -> bytes:
    kernel, sig = rmsnorm_fwd.export_signature(cfg, N, CT_DTYPES[x_dtype], CT_DTYPES[w_dtype], has_w, store_rstd)
    buf = io.BytesIO()
    export_kernel(kernel, [sig], buf, gpu_code=arch, output_format="cubin")
    return buf.getvalue()


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
    text = _elf_sections(cubin)[".nv_debug_ptx_txt"].decode(errors="replace").replace("\x00", "\n")
    return text.split(".nv_intermediate_source_section")[0]


@functools.lru_cache(maxsize=None)
def ptxas_path() -> str:
    """The ptxas next to the tileiras that cuTile uses (same CUDA version), else the one on PATH."""
    try:
        from cuda.tile._compile import _find_compiler_bin  # private, but it is how cuTile finds its tools
        candidate = os.path.join(os.path.dirname(_find_compiler_bin().path), "ptxas")
        if os.path.exists(candidate):
            return candidate
    except Exception:
        pass
    found = shutil.which("ptxas")
    if not found:
        raise FileNotFoundError("no ptxas next to tileiras or on PATH (pip install nvidia-cuda-nvcc)")
    return found


def ptxas_report(cubin: bytes, arch: str = "sm_90a") -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "k.ptx")
        with open(src, "w") as f:
            f.write(embedded_ptx(cubin))
        r = subprocess.run([ptxas_path(), f"-arch={arch}", "-v", src, "-o", os.path.join(tmp, "k.o")],
                           capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"ptxas failed: {r.stderr[-500:]}")
    regs = re.search(r"Used (\d+) registers", r.stderr)
    spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", r.stderr)
    return {"registers": int(regs.group(1)), "spill_stores": int(spill.group(1)), "spill_loads": int(spill.group(2)),
            "threads": [int(t) for t in re.findall(r"\.reqntid (\d+)", embedded_ptx(cubin))]}


def cuobjdump_path() -> str | None:
    """cuobjdump from the nvidia-cuda-cuobjdump wheel (its -sass needs nvdisasm, from
    nvidia-cuda-nvdisasm, next to it), else the one on PATH; None if neither is installed."""
    try:
        import nvidia
        for root in nvidia.__path__:
            for sub in ("cu13", "cuda_cuobjdump"):
                candidate = os.path.join(root, sub, "bin", "cuobjdump")
                if os.path.exists(candidate) and os.path.exists(os.path.join(root, sub, "bin", "nvdisasm")):
                    return candidate
    except ImportError:
        pass
    return shutil.which("cuobjdump")


def sass_opcodes(cubin: bytes) -> list[str]:
    """The SASS instructions of the cubin's kernel in program order, as opcodes with their modifiers
    (`LDG.E.128`, `FMUL.RZ`, ...): what ptxas scheduled, where the PTX order is only tileiras's."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        r = subprocess.run([cuobjdump_path(), "-sass", path], capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"cuobjdump failed: {r.stderr[-500:]}")
    return [m.group(1) for m in re.finditer(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", r.stdout)]
