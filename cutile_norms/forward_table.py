"""mode=None's forward table written from measurements: FORWARD_RULE (dispatch.py, above
FORWARD_BAND_EDGES) applied to {N: {mode: ratio to a copy}}, and the rows stored in
tuning/rmsnorm_fwd.json under the measured GPU's key. The bench (`bench/rmsnorm.py --write-table`) and
the probe (`bench/probe/model_widths.py --write-table`) call it; dispatch.py reads what it wrote."""
from __future__ import annotations

import json
import os

import torch

from . import dispatch
from ._platform import table_key_for


def merge_points(runs: list[dict]) -> dict:
    """{N: {mode: ratio}} of several runs in one: a width and mode measured more than once keeps its
    lowest ratio (the rule ranks worst cases)."""
    out: dict = {}
    for run in runs:
        for n, ratios in run.items():
            cur = out.setdefault(int(n), {})
            for mode, r in ratios.items():
                cur[mode] = min(r, cur.get(mode, r))
    return out


def band_rows(points: dict, elem_bytes: int) -> list[dict]:
    """mode=None's rows from {N: {mode: ratio to copy}} by dispatch.FORWARD_RULE: per band of row bytes
    (dispatch.FORWARD_BAND_EDGES), the mode whose worst ratio over the band's measured widths is the
    highest, for every M. Only modes measured at every width of a band compete in it."""
    edges = [0, *dispatch.FORWARD_BAND_EDGES, 1 << 50]
    rows = []
    for lo, hi in zip(edges, edges[1:]):
        ns = sorted(n for n in points if lo < n * elem_bytes <= hi)
        common = set.intersection(*(set(points[n]) for n in ns)) if ns else set()
        if not common:
            continue
        worst = {m: min(points[n][m] for n in ns) for m in common}
        ranked = sorted(common, key=lambda m: (-worst[m], m))
        best = ranked[0]
        runner = f"; runner-up {ranked[1]} worst {worst[ranked[1]]:.3f}" if len(ranked) > 1 else ""
        rows.append({"n_min": lo // elem_bytes + 1, "n_max": min(hi // elem_bytes, 1 << 40), "m_min": 1,
                     "m_max": 1 << 40, "mode": best,
                     "evidence": f"worst of {len(ns)} widths {worst[best]:.3f}x copy (N={ns[0]}..{ns[-1]}: "
                                 + ", ".join(f"{n} {points[n][best]:.3f}" for n in ns) + f"){runner}"})
    return rows


def merge_rows(old: list[dict], new: list[dict]) -> list[dict]:
    """The rows of a table after a run that measured some bands: the run's rows, and what the earlier
    rows held outside them (an earlier row that a new one covers in part keeps the widths left to it:
    rows written before a band edge was added; their evidence stays as measured)."""
    kept = []
    for r in old:
        pieces = [(r["n_min"], r["n_max"])]
        for n in new:
            pieces = [q for lo, hi in pieces
                      for q in ((lo, min(hi, n["n_min"] - 1)), (max(lo, n["n_max"] + 1), hi)) if q[0] <= q[1]]
        evidence, span = r["evidence"], f"{r['n_min']}-{r['n_max']}"
        if evidence.endswith("do not reach]") and " [written for N " in evidence:  # clipped before: its first span
            evidence, note = evidence.rsplit(" [written for N ", 1)
            span = note.split(";", 1)[0]
        kept += [dict(r, n_min=lo, n_max=hi) if (lo, hi) == (r["n_min"], r["n_max"]) else
                 dict(r, n_min=lo, n_max=hi, evidence=f"{evidence} [written for N {span}; "
                                                      f"N {lo}-{hi} kept where a later run's rows do not reach]")
                 for lo, hi in pieces]
    return sorted(new + kept, key=lambda r: r["n_min"])


def write_rows(points: dict, dtype: str, arch: str, gpu: str, command: str, date: str) -> str:
    """Writes band_rows of {N: {mode: ratio}} (the stable modes' ratios to a copy; other keys are
    ignored) into tuning/rmsnorm_fwd.json under this GPU's table key, with the command that measured
    them; returns the table's path. Bands with no measured width keep their rows, and the record of
    the command that measured them is kept before this one's."""
    candidates = [m for m, spec in dispatch.MODES.items() if spec.status == dispatch.STABLE and m != "torch"]
    points = {n: {m: r for m, r in p.items() if m in candidates} for n, p in points.items()}
    e = torch.empty((), dtype=getattr(torch, dtype)).element_size()
    path = dispatch.TABLE_PATH
    table = json.load(open(path)) if os.path.exists(path) else {"source": {}, "tables": {}}
    key = table_key_for(table, arch, gpu)
    new = band_rows({n: p for n, p in points.items() if p}, e)
    old = table["tables"].setdefault(key, {}).get(dtype, [])
    rows = merge_rows(old, new)
    table["tables"][key][dtype] = rows
    src = table["source"].setdefault(key, {})
    src["gpu"] = gpu
    commands = src.setdefault("commands", {})
    if len(rows) > len(new) and dtype in commands:
        bands = ", ".join(f"N {r['n_min']}-{r['n_max']}" for r in new)
        command = f"{commands[dtype]['command']}; then for {bands} ({date}): {command}"
    commands[dtype] = {"command": command, "date": date}
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(table, f, indent=1)
        f.write("\n")
    return path
