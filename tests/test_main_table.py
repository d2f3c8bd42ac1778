"""The main job's table (TCR's Table 1 shape) from rows with hand-computed figures, its Markdown and its plot."""

from __future__ import annotations

import pytest

from hf_tta.benchmarks import SOURCE, format_main_table, main_tables
from hf_tta.benchmarks.figures import figure
from hf_tta.benchmarks.main_table import plot_limits, wrapped_title
from hf_tta.benchmarks.outputs import format_main_tables, write_outputs

Q = 100


def _row(shift, objective, hits, severity=None, seed=0, direction="i2t", **extra):
    r1 = 100.0 * hits.count("1") / len(hits)
    return {"direction": direction, "shift": shift, "severity": severity, "objective": objective, "seed": seed,
            "R@1": r1, "R@5": r1, "R@10": r1, "hits": hits, **extra}


def _hits(n_right: int, start: int = 0) -> str:
    return "0" * start + "1" * n_right + "0" * (Q - start - n_right)


@pytest.fixture()
def rows():
    """Clean 80; fog 5: source 20, tcr 50 (+30 on 30 items); snow 2: source 60, tcr 58 (−2); noto: source 30,
    tcr 30. Won back over the grid: (30 − 2) / ((80 − 20) + (80 − 60)) = 28 / 80 = 35 %."""
    return [
        _row("clean", SOURCE, _hits(80)),
        _row("fog", SOURCE, _hits(20), 5), _row("fog", "tcr", _hits(50), 5),
        _row("snow", SOURCE, _hits(60), 2), _row("snow", "tcr", _hits(58), 2),
        _row("noto", SOURCE, _hits(30)), _row("noto", "tcr", _hits(30)),
    ]


def test_one_table_with_the_clean_reference_every_corruption_and_the_won_back_share(rows):
    (table,) = main_tables(rows, scoring="before_update")
    assert [c["label"] for c in table["columns"]] == ["Clean", "Snow 2", "Fog 5", "Noto"]  # ImageNet-C's order
    assert [c["grid"] for c in table["columns"]] == [False, True, True, False]
    assert table["clean"] == 80.0
    source, tcr = table["rows"]
    assert source["values"] == [80.0, 60.0, 20.0, 30.0] and source["avg"] == 40.0
    assert tcr["values"] == [None, 58.0, 50.0, 30.0] and tcr["status"][0] == "missing"
    assert tcr["won_back"] == pytest.approx(0.35)  # a ratio of sums, not the mean of 50 % and −10 %
    assert tcr["grid"]["delta"] == pytest.approx(14.0)  # the mean of +30 and −2 over the two columns
    lo, hi = tcr["grid"]["ci"]
    assert lo < 14.0 < hi and tcr["grid"]["lower"] > -0.5 and not tcr["grid"]["below"]
    assert tcr["streams"]["Noto"]["delta"] == 0.0 and tcr["streams"]["Noto"]["ci"] == [0.0, 0.0]

    text = format_main_table(table)
    lines = text.splitlines()
    assert lines[0] == ("**Image→text retrieval (image queries) under query shift, R@1 (%): 2 corruption streams + Noto; "
                        "1 seed (0); scored prequentially (each batch answered before the model adapts on it)**")
    assert "the source model's R@1 on the clean queries is 80.0, the denominator of every won-back share" in text
    header = "| Method | Clean | Snow 2 | Fog 5 | Avg. | Noto | Won back | Δ vs source [95 % CI] | vs source (margin −0.5) |"
    assert lines.count(header) == 1
    table_lines = [line for line in lines if line.startswith("|")]
    assert len({line.count("|") for line in table_lines}) == 1 and len(table_lines) == 4  # header, rule, two rows
    assert "| Source model | 80.0 | 60.0 | 20.0 | 40.0 | 30.0 | – | – | – |" in lines
    bound = figure(tcr["grid"]["lower"], sign=True)
    assert (f"| • tcr | – | 58.0 | 50.0 | 54.0 | 30.0 | 35.0 % | +14.0 [{figure(lo, sign=True)}, {figure(hi, sign=True)}] | "
            f"not below (bound {bound} > −0.5) |") in lines
    assert "- Noto: tcr +0.0 [+0.0, +0.0], not below (bound +0.0 > −0.5)" in lines


def test_a_row_below_the_source_says_harm_with_its_bound():
    rows = [_row("clean", SOURCE, _hits(90)), _row("fog", SOURCE, _hits(60), 5), _row("fog", "tent", _hits(40, start=20), 5)]
    (table,) = main_tables(rows)
    tent = table["rows"][1]
    assert tent["grid"]["below"] and tent["grid"]["ci"][1] < 0 and tent["won_back"] == pytest.approx(-20 / 30)
    assert f"| harm (bound {figure(tent['grid']['lower'], sign=True)} ≤ −0.5) |" in format_main_table(table)


def test_a_row_whose_interval_spans_zero_but_whose_bound_misses_the_margin_is_inconclusive():
    """Protocol v4's third word: 2 of 100 queries lost and 1 gained (Δ −1.0, interval across 0, bound below −0.5) is
    not harm (before: "below the source")."""
    rows = [_row("clean", SOURCE, _hits(90)), _row("fog", SOURCE, _hits(60), 5), _row("fog", "tent", "00" + "1" * 59 + "0" * (Q - 61), 5)]
    (table,) = main_tables(rows)
    g = table["rows"][1]["grid"]
    assert g["ci"][0] < 0 < g["ci"][1] and g["lower"] <= -0.5 and g["word"] == "inconclusive"
    assert f"| inconclusive (bound {figure(g['lower'], sign=True)} ≤ −0.5) |" in format_main_table(table)
    assert "scored" not in table["title"]  # no scoring rule given: none claimed


def test_one_table_per_direction_and_severities_in_blocks():
    rows = [_row("clean", SOURCE, _hits(80)), _row("clean", SOURCE, _hits(70), direction="t2i")]
    for sev in (5, 3):
        rows += [_row(s, SOURCE, _hits(40), sev) for s in ("fog", "snow")]
    rows += [_row("ocr", SOURCE, _hits(30), 7, direction="t2i")]
    i2t, t2i = main_tables(rows)
    assert [c["label"] for c in i2t["columns"]] == ["Clean", "Snow 3", "Fog 3", "Snow 5", "Fog 5"]
    assert [c["label"] for c in t2i["columns"]] == ["Clean", "OCR 7"] and t2i["clean"] == 70.0
    assert format_main_tables(rows).count("| Method |") == 2


def test_plot_axis_sits_around_the_data_and_the_clean_line(rows):
    (table,) = main_tables(rows)
    lo, hi = plot_limits(table)
    assert 0 < lo < 20.0 and 80.0 < hi < 100.0  # not 0-100: the gain shows; the clean line (80) inside
    title = wrapped_title(table, 7.0)
    assert title.replace("\n", " ") == table["title"] and max(map(len, title.splitlines())) <= 77


def test_results_md_holds_the_printed_table_and_the_plot_is_drawn(rows, tmp_path):
    paths = write_outputs(rows, tmp_path, {"identity": {"scoring": "after_update"}})
    assert (tmp_path / "results.md").read_text() == format_main_tables(rows, "after_update") + "\n"
    assert "scored after each batch's update (the papers' protocol)" in (tmp_path / "results.md").read_text()
    assert paths["plot_r1_i2t"].endswith("r1_i2t.png") and (tmp_path / "r1_i2t.png").stat().st_size > 10_000
