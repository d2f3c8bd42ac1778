"""Kept-recall bands: the won-back share per band and the rule that picks the default grid's streams."""

from __future__ import annotations

import pytest

from hf_tta.benchmarks.bands import choose_representatives, kept_band, won_back_by_band


def _src(shift, severity, r1, objective="source", seed=0):
    return {"direction": "i2t", "shift": shift, "severity": severity, "objective": objective, "seed": seed, "R@1": r1}


@pytest.mark.parametrize("source, band", [(0.0, 0), (24.9, 0), (25.0, 1), (49.9, 1), (50.0, 2), (75.0, 3), (100.0, 3), (120.0, 3)])
def test_kept_band_edges(source, band):
    assert kept_band(source, 100.0) == band


def test_won_back_by_band_is_a_ratio_of_sums_by_hand():
    """Clean 80. Columns: source 10 (kept 12.5 %, lost 70), 30 (37.5 %, lost 50), 70 (87.5 %, lost 10),
    79.5 (lost 0.5: left out), no clean reference (left out). Method: 24, 40, 72, 0, 0.
    Under 25 %: 14 / 70 = 0.2; 25-50 %: 10 / 50 = 0.2; 50-75 %: no column; over 75 %: 2 / 10 = 0.2.
    Loss shares: 70 / 130, 50 / 130, 0, 10 / 130."""
    bands = won_back_by_band([24, 40, 72, 0, 0], [10, 30, 70, 79.5, 5], [80, 80, 80, 80, None])
    assert [b["won_back"] for b in bands] == [pytest.approx(0.2), pytest.approx(0.2), None, pytest.approx(0.2)]
    assert [b["columns"] for b in bands] == [[0], [1], [], [2]]
    assert [b["loss_share"] for b in bands] == [pytest.approx(70 / 130), pytest.approx(50 / 130), 0.0, pytest.approx(10 / 130)]
    assert won_back_by_band([None, 40], [10, 30], [80, 80])[0]["won_back"] is None  # a missing value: no share


def test_rule_picks_the_stream_closest_to_half_within_the_band_from_source_rows_only():
    families = {"a1": "A", "a2": "A", "b1": "B", "c1": "C"}
    rows = [_src("clean", None, 80.0), _src("clean", None, 80.0, seed=1)]
    rows += [_src("a1", 1, 70.0), _src("a1", 2, 44.0), _src("a2", 3, 36.0), _src("a2", 5, 10.0)]  # 44/80 and 36/80: 0.05 off half each
    rows += [_src("b1", 1, 79.0), _src("b1", 5, 2.0)]  # nothing within 25-75 %
    rows += [_src("c1", 3, 30.0, seed=0), _src("c1", 3, 50.0, seed=1), _src("c1", 4, 20.0)]  # c1 3: mean 40 = half
    rows += [_src("a1", 5, 40.0, objective="tcr"), _src("b1", 3, 40.0, objective="tcr")]  # a method's rows: ignored
    got = choose_representatives(rows, families)
    assert (got["A"]["corruption"], got["A"]["severity"]) == ("a1", 2)  # the tie goes to the lower severity
    assert got["A"]["kept"] == pytest.approx(0.55) and got["A"]["in_band"]
    assert (got["B"]["corruption"], got["B"]["severity"], got["B"]["in_band"]) == ("b1", 5, False)  # 2.5 % is closer to half than 98.75 %
    assert (got["C"]["corruption"], got["C"]["severity"], got["C"]["R@1"]) == ("c1", 3, 40.0)
    with pytest.raises(ValueError, match="clean"):
        choose_representatives(rows[2:], families)
    with pytest.raises(ValueError, match="family"):
        choose_representatives(rows, {**families, "d1": "D"})


def test_default_grid_is_the_rule_applied_to_the_committed_source_sweep():
    """The default grid's streams are what the rule picks from the committed source rows (16 corruptions x severities
    1-5, seed 0); no method's row is read."""
    import json
    from pathlib import Path

    from hf_tta.benchmarks.grid import DEFAULT_IMAGE_CONDITIONS

    path = Path(__file__).resolve().parent.parent / "model_cards/results/source-severity-sweep/rows.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()[1:]]
    assert {r["objective"] for r in rows} == {"source"}
    assert len({(r["shift"], r["severity"]) for r in rows if r["shift"] != "clean"}) == 16 * 5
    chosen = choose_representatives(rows)
    assert tuple((c["corruption"], c["severity"]) for c in chosen.values()) == DEFAULT_IMAGE_CONDITIONS
