"""Every result table of the model cards is recomputed from the committed rows it cites.

A table in a card is preceded by a marker naming its rows::

    <!-- rows: results/v2-full-i2t/rows.jsonl seeds=0,1,2 group=i2t-severity-5 -->

(paths relative to ``model_cards/``; several files are merged as ``hf-tta merge`` does; ``seeds`` filters;
``objectives`` keeps these rows in this order; ``group`` picks the table of :func:`hf_tta.benchmarks.build_tables`). The test rebuilds the table from those rows with the
report's code and compares it line for line with the card (the card may retitle a table: its bold first line is not
compared). ``python tests/test_model_cards.py --write`` rewrites the marked tables from the rows.
"""

from __future__ import annotations

import functools
import json
import re
import sys
from pathlib import Path

import pytest

from hf_tta.benchmarks.report import build_tables, format_table, merge_rows

CARDS = Path(__file__).resolve().parent.parent / "model_cards"
MARKER = re.compile(r"^<!-- rows: (?P<spec>.*?) -->$")


def load_rows(path: Path) -> list[dict]:
    """The rows of a ``results.json`` or of a ``rows.jsonl`` progress file (its header line skipped)."""
    if path.suffix == ".jsonl":
        rows = [json.loads(line) for line in path.read_text().splitlines()[1:] if line.strip()]
    else:
        rows = json.loads(path.read_text())["rows"]
    return [r for r in rows if "error" not in r]


def parse_marker(spec: str) -> tuple[list[Path], dict[str, str]]:
    files, options = [], {}
    for token in spec.split():
        if "=" in token:
            key, value = token.split("=", 1)
            options[key] = value
        else:
            files.append(CARDS / token)
    return files, options


def expected_table(spec: str) -> list[str]:
    files, options = parse_marker(spec)
    missing = [str(f) for f in files if not f.is_file()]
    assert not missing, f"the card cites rows that are not committed: {missing}"
    rows = merge_rows([r for f in files for r in load_rows(f)])
    if "seeds" in options:
        seeds = {int(s) for s in options["seeds"].split(",")}
        rows = [r for r in rows if int(r.get("seed", 0)) in seeds]
    if "objectives" in options:  # these rows only, in this order (after the source model)
        order = ["source", *options["objectives"].split(",")]
        rows = sorted((r for r in rows if r["objective"] in order), key=lambda r: order.index(r["objective"]))
    tables = {t["group"]: t for t in build_tables(rows)}
    assert options["group"] in tables, f"no table {options['group']!r} in {spec}; tables: {list(tables)}"
    return format_table(tables[options["group"]]).split("\n")


def _block_end(lines: list[str], start: int) -> int:
    """The end of a format_table block whose title is ``lines[start]``."""
    part = ("|", "Share of lost", "†")
    j = start + 1
    while j < len(lines):
        if lines[j] == "":
            if j + 1 < len(lines) and lines[j + 1].startswith(part):
                j += 1
                continue
            break
        if not lines[j].startswith(part):
            break
        j += 1
    return j


def marked_tables(card: Path) -> list[tuple[int, str]]:
    """(line index of the table's title, marker spec) of every marked table of a card."""
    lines = card.read_text().split("\n")
    return [(i + 1, m["spec"]) for i, line in enumerate(lines) if (m := MARKER.match(line))]


CASES = [(card.name, line, spec) for card in sorted(CARDS.glob("*.md")) for line, spec in marked_tables(card)]


@pytest.mark.slow
def test_the_results_card_marks_its_main_tables():
    names = {c[0] for c in CASES}
    assert "emoji-benchmark-results-v2.md" in names
    assert sum(c[0] == "emoji-benchmark-results-v2.md" for c in CASES) >= 10


@pytest.mark.parametrize("card, line, spec", CASES, ids=[f"{c}:{n}" for c, n, _ in CASES])
@pytest.mark.slow
def test_card_table_is_recomputed_from_its_rows(card, line, spec):
    lines = (CARDS / card).read_text().split("\n")
    assert lines[line].startswith("**"), f"{card}:{line + 1}: a marker must precede the table's bold title"
    expected = expected_table(spec)
    got = lines[line : _block_end(lines, line)]
    assert got[1:] == expected[1:], f"{card}:{line + 1} differs from its rows ({spec})"


def sweep_table(rows: list[dict]) -> list[str]:
    """The card's table of the source model's R@1 per corruption and severity (kept share of clean in brackets),
    the stream the default grid's rule picks in bold."""
    from hf_tta.benchmarks.bands import choose_representatives, source_recall
    from hf_tta.benchmarks.report import abbreviation
    from hf_tta.data.corruptions import IMAGE_CORRUPTION_CATEGORIES

    clean, recall = source_recall(rows)
    picked = {(c["corruption"], c["severity"]) for c in choose_representatives(rows).values()}
    lines = ["| Corruption (family) | 1 | 2 | 3 | 4 | 5 |", "|---|---|---|---|---|---|"]
    for name, family in IMAGE_CORRUPTION_CATEGORIES.items():
        cells = []
        for sev in range(1, 6):
            r1 = recall[(name, sev)]
            cell = f"{r1:.1f} ({100 * r1 / clean:.0f} %)"
            cells.append(f"**{cell}**" if (name, sev) in picked else cell)
        lines.append(f"| {abbreviation(name)} ({family}) | " + " | ".join(cells) + " |")
    return lines


SWEEP = CARDS / "results/source-severity-sweep/rows.jsonl"


@pytest.mark.slow
def test_the_cards_severity_sweep_table_is_recomputed_from_its_rows():
    text = (CARDS / "emoji-benchmark-results-v3.md").read_text()
    assert "\n".join(sweep_table(load_rows(SWEEP))) in text


#: A block of a card printed by a recipe's summary from the committed rows it names::
#:
#:     <!-- study: results/beyond-ln/rows.jsonl [t2i] -->  (recipes/beyond_ln_summary.py: issue 29's study, i2t or t2i)
#:     <!-- batch-size: results/batch-size-recall -->      (recipes/batch_size_recall.py: its bs<B>/rows.jsonl)
#:     <!-- v3: results/protocol-v3/rows.jsonl i2t report -->  (hf_tta.benchmarks.protocols.v3_summary: one part of protocol v3's tables)
#:     ...the summary's output...
#:     <!-- /study -->  or  <!-- /batch-size -->
RECIPE_BLOCK = re.compile(
    r"<!-- (?P<kind>study|batch-size|v3|v4): (?P<rows>\S+)(?: (?P<direction>i2t|t2i))?(?: (?P<part>[a-z0-9]+))? -->\n(?P<body>.*?)<!-- /(?P=kind) -->", re.S
)


def _recipe(name: str):
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, CARDS.parent / "recipes" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@functools.lru_cache(maxsize=None)
def _v4_part(rows: Path, direction: str, part: str) -> str:
    """One part of protocol v4's tables, printed once per session (several tests read the same parts)."""
    from hf_tta.benchmarks.protocols.v4_tables import summarise

    return summarise(rows, direction, part)


def recipe_block(kind: str, rows: Path, direction: str | None = None, part: str | None = None) -> str:
    """What the recipe's summary prints for the committed rows of a ``kind`` block (``part``: one v3 table)."""
    if kind == "study":
        return _recipe("beyond_ln_summary").summarise(rows, direction or "i2t")
    if kind == "v3":
        from hf_tta.benchmarks.protocols import v3_summary

        return v3_summary.summarise(rows, direction or "i2t", part)
    if kind == "v4":  # protocol v4's tables (hf_tta.benchmarks.protocols.v4_tables)
        return _v4_part(rows, direction or "i2t", part)
    return _recipe("batch_size_recall").summary_of(rows)


def check_recipe_blocks(card: str, kind: str) -> None:
    """Each ``kind`` recipe block of ``card`` is the summary script's output on the committed rows."""
    blocks = [b for b in RECIPE_BLOCK.finditer((CARDS / card).read_text()) if b["kind"] == kind]
    assert blocks, f"{card} has no {kind} block"
    for block in blocks:
        assert block["body"].strip() == recipe_block(kind, CARDS / block["rows"], block["direction"], block["part"]).strip()


@pytest.mark.parametrize(
    "card,kind", [("emoji-benchmark-results-v2.md", "study"), ("serving.md", "batch-size"),
                  ("emoji-benchmark-results.md", "v4"), ("options.md", "v4")]
)
def test_the_recipe_blocks_are_recomputed_from_their_rows(card, kind):
    """Each recipe block of the card is the summary script's output on the committed rows (the archived protocol-v3
    card's: ``tests/test_model_cards_archive.py``)."""
    check_recipe_blocks(card, kind)


def write(card: Path) -> None:
    """Rewrite every marked table of ``card`` from its rows (the card's own title kept)."""
    lines = card.read_text().split("\n")
    for line, spec in reversed(marked_tables(card)):
        expected = expected_table(spec)
        lines[line : _block_end(lines, line)] = [lines[line], *expected[1:]]
    text = "\n".join(lines)
    for block in reversed(list(RECIPE_BLOCK.finditer(text))):
        body = recipe_block(block["kind"], CARDS / block["rows"], block["direction"], block["part"]).strip() + "\n"
        text = text[: block.start("body")] + body + text[block.end("body") :]
    card.write_text(text)


if __name__ == "__main__" and "--write" in sys.argv:
    for path in sorted(CARDS.glob("*.md")):
        if marked_tables(path) or RECIPE_BLOCK.search(path.read_text()):
            write(path)
            print("rewrote", path)


FIGURE = re.compile(r"[−+-]?\d+(?:\.\d+)? ?%?")
#: What the prose-figure checks leave out before reading figures: code, links, seed lists.
NOT_PROSE = r"`[^`]*`|\[[^\]]*\]\([^)]*\)|seeds? [\d, –-]+"


def quoted_figures(prose: str) -> list[str]:
    """The figures a card's prose quotes: numbers with a decimal point or a per cent sign."""
    return [f.strip() for f in FIGURE.findall(prose) if "." in f or "%" in f]


def unprinted(quoted: list[str], printed: str, settings=frozenset()) -> list[str]:
    """The quoted figures that are neither a named setting nor printed (signs and the minus sign's form aside)."""
    return [f for f in quoted if f not in settings and f.replace("-", "−").lstrip("+−").replace(" %", "%") not in printed]


@pytest.mark.slow
def test_the_readme_headline_quotes_the_main_jobs_rows():
    """Every figure of the README's headline (between ``<!-- main-job: <rows> -->`` and ``<!-- /main-job -->``) is
    printed by the main job's table of those committed rows (``hf_tta.benchmarks.protocols.v4_tables``)."""
    from hf_tta.benchmarks.protocols.v4_tables import summarise

    text = (CARDS.parent / "README.md").read_text()
    m = re.search(r"<!-- main-job: (\S+) -->\n(.*?)<!-- /main-job -->", text, re.S)
    assert m, "README.md has no main-job block"
    table = summarise(CARDS / m.group(1), "i2t", "main")
    quoted = [f.strip() for f in FIGURE.findall(re.sub(r"`[^`]*`|\[[^\]]*\]\([^)]*\)|seeds? [\d, ]+", "", m.group(2)))
              if "." in f or "%" in f]
    assert quoted, "the headline quotes no figure"
    for f in quoted:
        assert f.replace("-", "−").lstrip("+−") in table, f"README headline figure {f} is not in the main job's table"


@pytest.mark.parametrize("study", ["driver-refactor-rerun", "core-redesign-rerun"])
def test_re_run_rows_equal_their_committed_counterparts(study):
    """The refactors' re-runs (issue 24's core redesign, issue 46's batch driver) claim per-query hits identical to
    committed rows: their compare scripts say so from the committed files alone (exit 1 on any difference)."""
    import subprocess

    script = CARDS / "results" / study / "compare.py"
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "identical" in done.stdout and "DIFFERENT" not in done.stdout


def test_the_figures_in_the_presets_docstrings_are_those_of_the_rows():
    """hf_tta/preset.py quotes the selection shares of the image default (the tenth round's choice), of the ninth, eighth, seventh
    and sixth rounds', of the default of rounds 4-5 and of the gated TCR of rounds 1-3; they are the committed rows' (before: a text figure the cards had
    replaced stayed there)."""
    from hf_tta.benchmarks.protocols.v4_tables import summarise

    source = (CARDS.parent / "hf_tta" / "preset.py").read_text()
    quoted = set(re.findall(r"(\d+\.\d) %", source))
    rows = CARDS / "results" / "protocol-v4" / "rows.jsonl"
    named = {("r10", "| r10-w0.5-c0.7-a0.3-0.9/tcr+gate+anchor+safe@3e-2 |"), ("r10", "| r10-incumbent/tcr+gate+anchor+safe@3e-2 |"),
             ("r9", "| r9-w0.5-a0.3-0.9/tcr+gate+anchor+safe@3e-2 |"), ("r8", "| r8-w0.5-c0.7/tcr+gate+anchor+safe@3e-2 |"),
             ("r7", "| r7-w0.3/tcr+gate+anchor+safe@3e-2 |"), ("r6", "| r6-anchor0.01/tcr+gate+anchor+safe@3e-2 |"),
             ("r4", "| r4-previous/rest+dn+safe@1e-3 |"),
             ("r4", "| r4-incumbent/tcr+gate+safe@3e-2 |")}
    shares = set()
    for part, row in named:
        line = next(x for x in summarise(rows, "i2t", part).splitlines() if x.startswith(row))
        shares.add(line.split("|")[2].strip().removesuffix(" %"))
    assert quoted == shares, (quoted, shares)  # a new figure there needs a row here


#: Figures of the protocol-v4 prose that are settings, not measurements: the intervals' level, the margin within which a
#: verdict is re-drawn, ROID's momentum, issue 48's targets (85 % and 60 % of the best fixed lr, 90 % of the ceiling)
#: and the source anchor's settings (temperature and margins 0.01 and 0.02, momentum 0.8 and its complement 0.2, the
#: seventh round's ensemble weights 0.3 and 0.5 and the source's complement 0.7, the ninth round's agreement bands
#: 0.3-0.9 and 0.3-0.95, that is 30 % to 90 %, and the stricter stream margin −0.25 of rounds 8 and 9).
V4_SETTINGS = {"95 %", "0.25", "0.99", "85 %", "60 %", "90 %", "0.01", "0.02", "0.8", "0.2", "0.3", "0.5", "0.7", "0.9",
               "0.95", "30 %", "−0.25", "0.97"}


@pytest.mark.slow
@pytest.mark.parametrize("card, section", [("emoji-benchmark-results.md", None), ("options.md", ("## Protocol v4", "## Protocol v3"))],
                         ids=["results", "options-v4"])
def test_every_figure_of_the_v4_prose_is_printed_from_the_rows(card, section):
    """Issue 50: outside its printed blocks, each figure the protocol-v4 prose quotes is printed by a table of the
    committed rows (every part of :mod:`hf_tta.benchmarks.protocols.v4_tables`), or is a named setting."""
    from hf_tta.benchmarks.protocols.v4_tables import PARTS

    rows = CARDS / "results" / "protocol-v4" / "rows.jsonl"
    parts = [("i2t", p) for p in PARTS if p not in ("v3verdicts", "onerule", "onerule10")] + [
        ("t2i", p) for p in ("selection", "headline", "streams", "targets", "onerule", "onerule10")]
    printed = "\n".join(_v4_part(rows, d, p) for d, p in parts).replace(" %", "%")
    text = (CARDS / card).read_text()
    if section:
        text = text[text.index(section[0]): text.index(section[1])]
    prose = re.sub(r"<!-- v4: .*? -->.*?<!-- /v4 -->", "", text, flags=re.S)
    quoted = quoted_figures(re.sub(NOT_PROSE, "", prose))
    assert quoted
    missing = unprinted(quoted, printed, V4_SETTINGS)
    assert not missing, f"{card}: figures printed by no table of the v4 rows: {missing}"


#: Blocks whose tables a test recomputes from committed rows: the serving card's open-loop and capacity tables
#: (``tests/test_serve_recipe.py``) and its batch-size table (``test_the_recipe_blocks_are_recomputed_from_their_rows``).
RECOMPUTED_BLOCK = re.compile(r"<!-- (?P<kind>serving-open-loop|serving-capacity|batch-size): \S+ -->.*?<!-- /(?P=kind) -->", re.S)
#: A one-off measurement as it was printed (a timing or memory peak on a named machine: times are not rows a test can
#: recompute): ``<!-- measured: <commit> [<commit> ...] <how: a recipe path, hf-tta, or words> -->...<!-- /measured -->``.
MEASURED_BLOCK = re.compile(r"<!-- measured: (?P<how>[^>]*?) -->(?P<body>.*?)<!-- /measured -->", re.S)
#: Figures of these cards' prose that are settings, thresholds or targets, not measurements: the state store's tick
#: (0.25 s), issue 27's batch-1 target (80 %) and "more than 100 %", the intervals' level (95 %), the example weight
#: of gradient decoupling (0.3), the render factor (2.5), the tests' recall floors for approximate indexes (0.9, 0.85),
#: the safety layer's defaults (0.1, 0.5, 0.2, 0.9: :class:`hf_tta.SafetyConfig`, checked below), issue 49's capacity
#: targets (90 %, 1.5).
OPERATIONS_SETTINGS = {"0.25", "80 %", "100 %", "95 %", "0.3", "2.5", "0.9", "0.85", "0.1", "0.5", "0.2", "90 %", "1.5"}
#: Licences and package versions, which the figure pattern would read as numbers.
NOT_FIGURES = r"(?:CC BY-SA\s+|cc-by-sa-|Apache-|License |by-sa/|OpenMoji )\d+\.\d+|\d+\.\d+\.\d+[\w.]*"


@pytest.mark.parametrize("card", ["serving.md", "scaling.md", "architecture.md", "guarantees.md", "emoji-convnext-minilm.md",
                                  "emoji-retrieval-dataset.md"])
def test_every_figure_of_the_operations_cards_is_recomputed_or_a_declared_measurement(card):
    """Issue 50: each figure in the prose of the cards the v4 and options tests above do not read (serving, scaling,
    architecture, guarantees, the model card, the dataset card; the archived v1-v3 results cards stay as they were)
    is printed by a block a test recomputes from committed rows, is a named setting, or sits in a declared one-off
    measurement whose commits exist (and whose recipe, where it names one, is in ``recipes/``)."""
    import subprocess

    text = (CARDS / card).read_text()
    for block in MEASURED_BLOCK.finditer(text):
        words = block["how"].split()
        commits = [w for w in words if re.fullmatch(r"[0-9a-f]{7,40}", w)]
        assert commits and words[: len(commits)] == commits, f"{card}: a measured block names no commit first: {block['how']}"
        for commit in commits:
            found = subprocess.run(["git", "-C", str(CARDS.parent), "cat-file", "-e", f"{commit}^{{commit}}"], capture_output=True)
            assert found.returncode == 0, f"{card}: measured at {commit}, which is not in the repository's history"
        for recipe in (w for w in words if w.startswith("recipes/")):
            assert (CARDS.parent / recipe).is_file(), f"{card}: {recipe} does not exist"
        assert FIGURE.search(block["body"]), f"{card}: a measured block without a figure: {block['how']}"
    printed = "\n".join(b.group(0) for b in RECOMPUTED_BLOCK.finditer(text)).replace(" %", "%").replace("-", "−")
    prose = MEASURED_BLOCK.sub("", RECOMPUTED_BLOCK.sub("", text))
    prose = re.sub(rf"{NOT_PROSE}|{NOT_FIGURES}|<!-- .*? -->", "", prose)
    missing = unprinted(quoted_figures(prose), printed, OPERATIONS_SETTINGS)
    assert not missing, f"{card}: figures neither recomputed from rows nor a declared measurement or setting: {missing}"


def test_the_safety_settings_the_guarantees_card_names_are_the_defaults():
    """The guarantees card's thresholds (allowed as settings above) are :class:`hf_tta.SafetyConfig`'s defaults."""
    from hf_tta import SafetyConfig

    text, cfg = (CARDS / "guarantees.md").read_text(), SafetyConfig()
    for field in ("min_source_diversity", "collapse_ratio", "min_agreement", "max_agreement_drop", "agreement_ema_decay"):
        assert re.search(rf"`{field}`\)?\s*(?:=\s*|\(\s*)?{re.escape(str(getattr(cfg, field)))}\b", text), field
