"""cutile_norms/forward_table.py: mode=None's forward rows from measured ratios (FORWARD_RULE)."""
from __future__ import annotations

import random

from cutile_norms import dispatch
from cutile_norms.forward_table import band_rows, merge_points

A, B = "tma_smem_cached", "multi_wave_cached"


def test_merge_keeps_the_lowest_ratio_of_each_width_and_mode():
    merged = merge_points([{"4096": {A: 0.99, B: 0.97}, "8192": {A: 1.0}},
                           {4096: {A: 0.95, B: 0.98}, 20480: {B: 0.9}}])
    assert merged == {4096: {A: 0.95, B: 0.97}, 8192: {A: 1.0}, 20480: {B: 0.9}}


def test_bands_cover_every_width_once_and_take_the_best_worst_case():
    rng = random.Random(7)
    ns = [8 * rng.randint(1, 40000) for _ in range(60)]
    ns += [300, 1000, 3000, 14000, 16000, 20000, 30000, 50000]  # every band
    points = {n: {A: rng.uniform(0.6, 1.0), B: rng.uniform(0.6, 1.0)} for n in ns}
    for e in (2, 4):
        rows = band_rows(points, e)
        assert rows[0]["n_min"] == 1 and rows[-1]["n_max"] == 1 << 40
        for a, b in zip(rows, rows[1:]):
            assert b["n_min"] == a["n_max"] + 1
        for row in rows:
            ns = [n for n in points if row["n_min"] <= n <= row["n_max"]]
            worst = {m: min(points[n][m] for n in ns) for m in (A, B)}
            assert worst[row["mode"]] == max(worst.values()), (row, worst)
            assert row["n_max"] == 1 << 40 or row["n_max"] in {edge // e for edge in dispatch.FORWARD_BAND_EDGES}


def test_a_mode_missing_at_one_width_of_a_band_does_not_compete_there():
    rows = band_rows({1032: {A: 0.9, B: 0.99}, 2048: {A: 0.95}}, 2)
    assert [r["mode"] for r in rows] == [A]


def test_a_run_over_some_bands_keeps_the_other_bands_rows():
    from cutile_norms.forward_table import merge_rows

    e = 2
    before = band_rows({1500: {A: 0.99, B: 0.9}, 10000: {A: 0.98, B: 0.9}, 28000: {A: 0.8, B: 0.95},
                        40000: {A: 0.9, B: 0.85}}, e)
    run = band_rows({30000: {A: 0.97, B: 0.93}, 50000: {A: 0.7, B: 0.96}}, e)
    rows = merge_rows(before, run)
    assert [r["mode"] for r in rows] == [A, A, A, B]  # the first two bands as before, the others from the run
    assert rows[:2] == before[:2] and rows[2:] == run
    for a, b in zip(rows, rows[1:]):
        assert b["n_min"] == a["n_max"] + 1


def test_rows_written_before_an_edge_keep_the_widths_a_later_run_leaves():
    """A row of an earlier table that a later run's rows cover in part (written before a band edge was
    added) keeps the widths on either side, its evidence saying what it was written for; nothing
    overlaps and nothing is left uncovered."""
    from cutile_norms.forward_table import merge_rows

    old = [{"n_min": 1, "n_max": 24576, "m_min": 1, "m_max": 1 << 40, "mode": A, "evidence": "old"},
           {"n_min": 24577, "n_max": 1 << 40, "m_min": 1, "m_max": 1 << 40, "mode": B, "evidence": "old 2"}]
    new = [dict(old[0], n_min=4096, n_max=12000, mode=B, evidence="new")]
    rows = merge_rows(old, new)
    assert [(r["n_min"], r["n_max"], r["mode"]) for r in rows] == [
        (1, 4095, A), (4096, 12000, B), (12001, 24576, A), (24577, 1 << 40, B)]
    assert rows[0]["evidence"].startswith("old [written for N 1-24576; N 1-4095 kept")
    assert rows[3] == old[1]  # untouched rows as they were
    again = merge_rows(rows, [dict(old[0], n_min=1, n_max=2000, mode=B, evidence="newer")])
    assert [(r["n_min"], r["n_max"]) for r in again][:2] == [(1, 2000), (2001, 4095)]
    assert again[1]["evidence"] == "old [written for N 1-24576; N 2001-4095 kept where a later run's rows do not reach]"
