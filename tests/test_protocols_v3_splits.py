"""Protocol v3's splits: declared once, disjoint, and the report refuses selection rows."""

from __future__ import annotations

import pytest

from hf_tta.benchmarks.grid import DEFAULT_IMAGE_CONDITIONS
from hf_tta.benchmarks.protocols.v3_splits import (
    REPORT,
    SELECTION,
    check_report_rows,
    check_selection_rows,
    run_arguments,
    split_of,
)
from hf_tta.data.corruptions import (
    CHAR_CORRUPTIONS,
    TEST_IMAGE_CORRUPTIONS,
    VALIDATION_IMAGE_CORRUPTIONS,
    WORD_CORRUPTIONS,
)


def test_the_splits_are_the_declared_ones_and_disjoint():
    assert SELECTION.seeds == (0,) and REPORT.seeds == (3, 4, 5)
    assert SELECTION.image_corruptions == VALIDATION_IMAGE_CORRUPTIONS and SELECTION.limit == 500
    assert set(REPORT.image_corruptions) == set(TEST_IMAGE_CORRUPTIONS) and REPORT.limit is None
    assert {s for _, s in SELECTION.image_conditions} == {5} and {s for _, s in REPORT.image_conditions} == {3, 5}
    assert SELECTION.text_corruptions == CHAR_CORRUPTIONS and REPORT.text_corruptions == WORD_CORRUPTIONS
    assert SELECTION.text_severities == (7,) and REPORT.text_severities == (3, 7)
    assert not set(SELECTION.image_corruptions) & set(REPORT.image_corruptions)
    assert not set(SELECTION.seeds) & set(REPORT.seeds)
    assert set(REPORT.streams) == {"clean", "noto", "diverse", "switch", "degenerate"}
    assert all(c in TEST_IMAGE_CORRUPTIONS for c, _ in DEFAULT_IMAGE_CONDITIONS)  # the main job reports


def _row(shift, seed, objective="tcr", severity=5):
    return {"direction": "i2t", "shift": shift, "severity": severity, "objective": objective, "seed": seed}


@pytest.mark.parametrize(
    ("row", "split"),
    [
        (_row("gaussian_blur", 0), "selection"),
        (_row("gaussian_blur", 3), "selection"),  # a validation corruption on any seed: never reported
        (_row("ocr", 4), "selection"),
        (_row("clean", 0, severity=None), "selection"),
        (_row("snow", 3), "report"),
        (_row("synonym_replacement", 5), "report"),
        (_row("clean", 5, severity=None), "report"),
        (_row("snow", 0), "selection"),  # seed 0 is the selection seed
        (_row("snow", 1), "neither"),  # an earlier protocol's held-out seed
    ],
)
def test_split_of(row, split):
    assert split_of(row) == split


def test_the_report_refuses_selection_rows_in_one_line():
    good = [_row("snow", 3), _row("contrast", 4, "source", 1)]
    assert check_report_rows(good) == good
    with pytest.raises(ValueError, match=r"^1 of 3 rows are not on the report split \(first: tcr on i2t/spatter/5 seed 3"):
        check_report_rows([*good, _row("spatter", 3)])
    assert check_selection_rows([_row("spatter", 0)])
    with pytest.raises(ValueError, match="selection split"):
        check_selection_rows([_row("snow", 3)])


def test_run_arguments():
    sel = run_arguments(SELECTION, "i2t")
    assert sel[:6] == ["--direction", "i2t", "--seeds", "0", "--scoring", "before_update"]
    assert "--limit" in sel and "--degenerate" in sel and "--clean" in sel and "--no-style" in sel
    assert sel[sel.index("--corruptions") + 1] == "speckle_noise,gaussian_blur,spatter,saturate"
    rep = run_arguments(REPORT, "i2t", default_grid=True, streams=False)
    assert rep[rep.index("--corruptions") + 1] == "default" and "--limit" not in rep and "--seeds" in rep
    assert rep[rep.index("--seeds") + 1] == "3,4,5"
    t2i = run_arguments(REPORT, "t2i", corruptions=False)
    assert t2i[t2i.index("--text-corruptions") + 1] == "" and "--style" in t2i and "--switch" in t2i
    with pytest.raises(ValueError, match="default_grid"):
        run_arguments(SELECTION, "i2t", default_grid=True)
