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
    points = {8 * rng.randint(1, 40000): {A: rng.uniform(0.6, 1.0), B: rng.uniform(0.6, 1.0)} for _ in range(60)}
    for e in (2, 4):
        rows = band_rows(points, e)
        assert rows[0]["n_min"] == 1 and rows[-1]["n_max"] == 1 << 40
        for a, b in zip(rows, rows[1:]):
            assert b["n_min"] == a["n_max"] + 1
        for row in rows:
            ns = [n for n in points if row["n_min"] <= n <= row["n_max"]]
            worst = {m: min(points[n][m] for n in ns) for m in (A, B)}
            assert worst[row["mode"]] == max(worst.values()), (row, worst)
            assert row["n_max"] == 1 << 40 or row["n_max"] * e in dispatch.FORWARD_BAND_EDGES


def test_a_mode_missing_at_one_width_of_a_band_does_not_compete_there():
    rows = band_rows({1024: {A: 0.9, B: 0.99}, 2048: {A: 0.95}}, 2)
    assert [r["mode"] for r in rows] == [A]


def test_a_run_over_some_bands_keeps_the_other_bands_rows():
    from cutile_norms.forward_table import merge_rows

    e = 2
    before = band_rows({1024: {A: 0.99, B: 0.9}, 28000: {A: 0.8, B: 0.95}, 40000: {A: 0.9, B: 0.85}}, e)
    run = band_rows({30000: {A: 0.97, B: 0.93}, 50000: {A: 0.7, B: 0.96}}, e)
    rows = merge_rows(before, run)
    assert [r["mode"] for r in rows] == [A, A, B]  # the first band as before, the others from the run
    assert rows[0] == before[0] and rows[1:] == run
    for a, b in zip(rows, rows[1:]):
        assert b["n_min"] == a["n_max"] + 1
