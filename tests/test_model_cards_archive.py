"""The archived cards' checks (protocol v3's results card and the options card's v3 and v2 prose): their tables are
recomputed from their committed rows and each figure of their prose is printed by those tables. In a file of their own
so that two test workers recompute them beside the current cards' (``tests/test_model_cards.py``)."""

from __future__ import annotations

import re

import pytest

from test_model_cards import CARDS, NOT_PROSE, check_recipe_blocks, quoted_figures, unprinted


@pytest.mark.slow
def test_the_archived_v3_cards_recipe_blocks_are_recomputed_from_their_rows():
    check_recipe_blocks("emoji-benchmark-results-v3.md", "v3")


def _v3_tables() -> str:
    from hf_tta.benchmarks.protocols import v3_summary

    rows = CARDS / "results" / "protocol-v3" / "rows.jsonl"
    return v3_summary.summarise(rows, "i2t") + "\n" + v3_summary.summarise(rows, "t2i")


def _v2_tables() -> str:
    """The v2 card's tables (each recomputed from its rows by the tests above)."""
    return "\n".join(line for line in (CARDS / "emoji-benchmark-results-v2.md").read_text().splitlines() if line.startswith("|"))


@pytest.mark.slow
@pytest.mark.parametrize("section, end, tables", [("## Protocol v3", "## Protocol v2", _v3_tables), ("## Protocol v2", None, _v2_tables)],
                         ids=["v3", "v2"])
def test_every_figure_of_the_options_cards_prose_is_printed_from_rows(section, end, tables):
    """Issue 50: each figure the options card's prose quotes (a number with a decimal point or a per cent sign) is
    printed by the tables of the committed rows it summarises: protocol v3's summary, or the v2 card's recomputed
    tables. Before, derived ratios (83.5 % of a ceiling, 1.39x) and levels read off logs stood there unchecked."""
    text = (CARDS / "options.md").read_text()
    prose = text[text.index(section): text.index(end) if end else None]
    printed = tables().replace(" %", "%")
    quoted = quoted_figures(re.sub(NOT_PROSE, "", prose))
    assert len(quoted) > 40
    missing = unprinted(quoted, printed)
    assert not missing, f"options.md {section}: figures printed by no table of its rows: {missing}"
