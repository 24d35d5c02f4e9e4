"""Reading the PTX of the CuTe DSL kernels in the compile tests."""
from __future__ import annotations


def address_ops(ptx: str, store: str) -> set[str]:
    """The opcodes of the 64-bit integer arithmetic that computes the address of the first `store`
    in the PTX (a walk back through the definitions of its %rd registers)."""
    lines = [ln.strip().rstrip(";") for ln in ptx.splitlines()]
    at = next(i for i, ln in enumerate(lines) if ln.startswith(store))
    todo = [lines[at].split("[", 1)[1].split("]")[0].split("+")[0]]
    seen, ops = set(), set()
    while todo:
        reg = todo.pop()
        if reg in seen:
            continue
        seen.add(reg)
        for ln in reversed(lines[:at]):  # straight-line code before the store: its last definition
            parts = ln.replace(",", " ").split()
            if len(parts) > 1 and parts[1] == reg and not parts[0].startswith(("st.", "@")):
                ops.add(parts[0])
                todo += [p for p in parts[2:] if p.startswith("%rd")]
                break
    return ops



def ptxas_report(ptx: str, arch: str) -> dict:
    """ptxas -v on the kernel's PTX: registers per thread and spill stores (bytes)."""
    import os
    import re
    import subprocess
    import tempfile

    from tests.cutile.compile_util import ptxas_path

    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        r = subprocess.run([ptxas_path(), f"-arch={arch}", "-v", src, "-o", os.path.join(tmp, "k.o")],
                           capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-500:]
    return {"registers": int(re.search(r"Used (\d+) registers", r.stderr).group(1)),
            "spill_stores": int(re.search(r"(\d+) bytes spill stores", r.stderr).group(1))}


def check_kernel_ptx(ptx: str, arch: str, spills_at_most: int = 0) -> None:
    """What every tma_smem_cached kernel must compile to: the target asked for, rows brought in by TMA
    bulk copies completing on mbarriers, 128-bit shared loads and global stores, no float atomics;
    on sm_90a, ptxas fits it in registers (spill stores up to `spills_at_most` bytes)."""
    import re

    assert f".target {arch}" in ptx, arch
    assert "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes" in ptx
    for op in ("ld.shared", "st.global"):  # 128 bits per instruction: v4 of 32-bit or v2 of 64-bit words
        assert re.search(rf"{re.escape(op)}(\.\w+)*\.(v4\.(b|f|u|s)32|v2\.(b|f|u|s)64)\b", ptx), op
    assert "atom.global.add.f32" not in ptx and "red.global.add.f32" not in ptx
    if arch == "sm_90a":
        report = ptxas_report(ptx, arch)
        assert report["spill_stores"] <= spills_at_most, report
