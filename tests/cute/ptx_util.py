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

