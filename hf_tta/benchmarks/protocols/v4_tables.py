"""Protocol v4's tables, printed from the committed rows (``model_cards/results/protocol-v4/rows.jsonl``).

:func:`export` gathers the run folders of :mod:`.v4` into that one file (each row tagged with its run, its label, its
split and the commits its run folder recorded). :func:`summarise` prints one part of the results card from it, and
``tests/test_model_cards.py`` checks every ``<!-- v4: ... -->`` block of the card against it:

* ``selection``: each candidate's pooled share on the selection split's corruption columns and its clean and
  degenerate streams' Δ [one-sided bound] (the registered choice reads exactly these: :mod:`.v4_choice`);
* ``headline``: per report row, over the report's corruption columns and seeds, the pooled share and the mean of
  per-column shares (columns whose source loss is under 5 R@1 listed apart), the worst column with its bound, and the
  verdict over all columns (:mod:`hf_tta.benchmarks.verdicts`);
* ``streams``: the default grid's share and each stream's Δ [bound] and verdict, with the seed-level t bound where a
  row has 5 seeds (text rows: each column's shift-specific gain, the column gain minus the row's clean gain);
* ``main``: the main job's table (``hf-tta`` with no arguments, report seed 3): R@1 per column, share, verdict;
* ``v3verdicts``: protocol v3's stream rows judged again in v4's three words, where the word changes.

    python -m hf_tta.benchmarks.protocols.v4_tables export runs/v4 model_cards/results/protocol-v4/rows.jsonl
    python -m hf_tta.benchmarks.protocols.v4_tables print model_cards/results/protocol-v4/rows.jsonl headline i2t
    python -m hf_tta.benchmarks.protocols.v4_tables card model_cards/emoji-benchmark-results.md
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np

from ..verdicts import compare, round_figure, seed_bound, shares
from .v4_choice import (
    DESCRIPTIVE_STUDIES,
    MARGIN,
    ROUND_RULES,
    RULE_OPTIONS,
    STREAMS,
    choose_default,
    choose_lr,
    hits,
    in_listed_order,
    in_study,
    load,
    share_floor,
)
from .v4_choice import summarise as summarise_selection
from .v4_names import (  # noqa: F401  (the tables' names, re-exported)
    ANCHOR_RUNS,
    CURRENT_DEFAULT,
    IMAGE_ROW_NAMES,
    ROUND7_DEFAULT,
    ROUND8_DEFAULT,
    ROUND9_DEFAULT,
    row_name,
)

SOURCE = "source"

PARTS = ("selection", "r4", "r4streams", "r5", "r6", "r6headline", "r6streams", "r7", "r7headline", "r7streams", "r8",
         "r8headline", "r8streams", "r9", "r9headline", "r9streams", "r10", "r10headline", "r10streams", "r10check",
         "r11", "r11headline", "r11streams", "r12", "r12headline", "r12streams", "r10more", "r10morestreams",
         "onerule", "onerule10", "targets", "targets10more", "targets9", "targets8", "targets7", "targets6", "targets4", "headline", "streams", "main",
         "v3verdicts")


def export(out: Path, dest: Path) -> int:
    """Write the rows of the finished run folders under ``out`` (those with their ``results.json``: a run still going,
    or cut short, is left out whole and named, so a table never mixes a seed's finished columns with missing ones) to
    ``dest`` (JSON lines, sorted by run, row, column, seed), each with the commits its run recorded
    (``registration.txt``: registration [choice]; ``commit.txt``: the library). Returns the number of rows."""
    every = load(Path(out))
    unfinished = sorted({r["run"] for r in every if not (Path(out) / r["run"] / "results.json").is_file()})
    if unfinished:
        print(f"left out (not finished): {', '.join(unfinished)}")
    rows = [r for r in every if r["run"] not in unfinished]
    for r in rows:
        folder = Path(out) / r["run"]
        for name, key in (("registration.txt", "registration"), ("commit.txt", "commit")):
            if (folder / name).is_file():
                r[key] = (folder / name).read_text().strip()
    rows.sort(key=lambda r: (r["run"], r["objective"], r["shift"], str(r.get("severity")), r["seed"]))
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_text("".join(json.dumps(r, sort_keys=True) + "\n" for r in rows))
    return len(rows)


def read(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def _col(r: dict) -> tuple:
    return (r["shift"], r.get("severity"))


def _name(c: tuple) -> str:
    return c[0] if c[1] is None else f"{c[0]} {c[1]}"


def _report(rows: list[dict], direction: str, runs: str) -> tuple[dict, dict]:
    """Report rows of ``direction`` whose run name starts with ``rep-<direction>/<runs>``: the source's hits by
    (column, seed) and each row name's hits by (column, seed)."""
    src: dict = {}
    by: dict = defaultdict(dict)
    for r in rows:
        if r["split"] != "report" or r["direction"] != direction or not r["run"].startswith(f"rep-{direction}/{runs}"):
            continue
        key = (_col(r), r["seed"])
        if r["objective"] == SOURCE:
            if key in src and src[key]["hits"] != r["hits"]:
                raise ValueError(f"two source rows of {key} differ in their hits.")
            src[key] = r
        else:
            by[row_name(r)][key] = r
    return src, by


def _diffs(row: dict, src: dict, keys: list) -> list[np.ndarray]:
    """One ``(seeds, items)`` array per column of ``keys`` ((column, seed) pairs): row hit − source hit."""
    cols = sorted({c for c, _ in keys}, key=str)
    out = []
    for c in cols:
        seeds = sorted(s for cc, s in keys if cc == c)
        out.append(np.stack([(hits(row[(c, s)]) - hits(_source_of(src, c, s))).astype(np.float64) for s in seeds]))
    return out


def _source_of(src: dict, c: tuple, s: int) -> dict:
    # the degenerate stream's hits are its clean part: the same queries as the clean column's source row
    return src.get((c, s)) or src[(("clean", None), s)]


def _r1(rows_by_key: dict, keys: list, c: tuple) -> float:
    return float(np.mean([100 * hits(rows_by_key[k]).mean() for k in keys if k[0] == c]))


def headline(rows: list[dict], direction: str, runs: str = "headline") -> str:
    """The primary table: every report row over the headline columns (all seeds it holds) of the runs whose names
    start with ``runs`` (``r6-headline``: default-study-r6's report on its new seed)."""
    src, by = _report(rows, direction, runs)
    lines = ["| row | seeds | columns | share (pooled) | share (mean of columns) | worst column: Δ [bound] | Δ [bound] | verdict |",
             "|---|---:|---:|---:|---:|---|---:|---|"]
    apart_note = set()
    for name, row in sorted(by.items()):
        keys = [k for k in row if k in src]
        seeds = sorted({s for _, s in keys})
        cols = sorted({c for c, _ in keys if c[0] not in STREAMS}, key=str)
        if not cols:
            continue
        clean_keys = [k for k in src if k[0] == ("clean", None) and k[1] in seeds]
        clean = float(np.mean([100 * hits(src[k]).mean() for k in clean_keys])) if clean_keys else 100.0
        sh = shares({c: _r1(row, keys, c) for c in cols}, {c: _r1(src, keys, c) for c in cols}, clean)
        apart_note |= set(sh.apart)
        worst = compare(_diffs(row, src, [k for k in keys if k[0] == sh.worst]))
        allc = compare(_diffs(row, src, [k for k in keys if k[0] in cols]))
        lines.append(f"| {name} | {','.join(map(str, seeds))} | {len(cols)} | {round_figure(sh.pooled, percent=True)} | "
                     f"{round_figure(sh.mean_of_columns, percent=True)} | {_name(sh.worst)}: "
                     f"{round_figure(worst.delta, sign=True)} [{round_figure(worst.lower, sign=True)}] {worst.words()} | "
                     f"{round_figure(allc.delta, sign=True)} [{round_figure(allc.lower, sign=True)}] | {allc.words()} |")
    if apart_note:
        lines.append("")
        lines.append("Columns whose source loss is under 5 R@1, listed apart (not in the shares): "
                     + ", ".join(sorted(_name(c) for c in apart_note)) + ".")
    return "\n".join(lines)


def streams(rows: list[dict], direction: str, runs: str = "streams") -> str:
    """The secondary table: the default grid's share (image queries) and each stream's Δ [bound] verdict over the
    seeds a row holds, with the seed-level t bound from 5 seeds; for text rows each corruption column's
    shift-specific gain is in :func:`headline`'s companion line below. ``runs``: the run names' prefix
    (``r4-streams``: default-study-r4's report on its new seeds)."""
    src, by = _report(rows, direction, runs)
    present = [s for s in STREAMS if any(k[0] == (s, None) for k in [*src, *(k for row in by.values() for k in row)])]
    head = "| row | seeds | default grid share | " + " | ".join(present) + " |"
    lines = [head, "|---|---:|---:|" + "---|" * len(present)]
    for name, row in sorted(by.items()):
        keys = [k for k in row if k in src or k[0] == ("degenerate", None)]
        seeds = sorted({s for _, s in keys})
        grid = sorted({c for c, _ in keys if c[0] not in STREAMS}, key=str)
        share = "–"
        if grid:
            clean = float(np.mean([100 * hits(src[(("clean", None), s)]).mean() for s in seeds]))
            share = round_figure(shares({c: _r1(row, keys, c) for c in grid}, {c: _r1(src, keys, c) for c in grid}, clean, 0.0).pooled,
                                 percent=True)
        cells = []
        for st in present:
            ks = [k for k in keys if k[0] == (st, None)]
            if not ks:
                cells.append("–")
                continue
            c = compare(_diffs(row, src, ks))
            per_seed = [100 * float((hits(row[k]) - hits(_source_of(src, *k))).mean()) for k in ks]
            t = seed_bound(per_seed)
            tb = f", t {round_figure(t, sign=True)}" if t is not None else ""
            cells.append(f"{round_figure(c.delta, sign=True)} [{round_figure(c.lower, sign=True)}{tb}] {c.words()}")
        lines.append(f"| {name} | {','.join(map(str, seeds))} | {share} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def shift_specific(rows: list[dict], direction: str = "t2i") -> str:
    """Text rows: each row's mean gain over the corruption columns, its clean-stream gain, and their difference (the
    shift-specific gain), from the headline runs (their clean column; else the streams runs')."""
    src, by = _report(rows, direction, "headline")
    ssrc, sby = _report(rows, direction, "streams")
    lines = ["| row | corruption gain (R@1) | clean gain (R@1) | shift-specific gain |", "|---|---:|---:|---:|"]
    for name, row in sorted(by.items()):
        keys = [k for k in row if k in src and k[0][0] not in STREAMS]
        clean_rows, clean_src = (row, src) if any(k[0] == ("clean", None) for k in row) else (sby.get(name, {}), ssrc)
        ck = [k for k in clean_rows if k[0] == ("clean", None) and k in clean_src]  # the headline's own clean column first
        if not keys or not ck:
            continue
        gain = float(np.mean([100 * (hits(row[k]) - hits(src[k])).mean() for k in keys]))
        cgain = float(np.mean([100 * (hits(clean_rows[k]) - hits(clean_src[k])).mean() for k in ck]))
        lines.append(f"| {name} | {round_figure(gain, sign=True)} | {round_figure(cgain, sign=True)} | "
                     f"{round_figure(gain - cgain, sign=True)} |")
    return "\n".join(lines)


def selection(rows: list[dict], direction: str, study: str = "default-study") -> str:
    """The selection table of ``study`` and the choice its registered rule gives (:data:`.v4_choice.ROUND_RULES`:
    default-study's every round with the comparators, or default-study-r4's own runs with their Noto stream)."""
    _, required, tie = ROUND_RULES[study]
    options = RULE_OPTIONS.get(study, {})
    sel = in_listed_order(summarise_selection([r for r in rows if r["split"] == "selection" and in_study(study, r["run"])],
                                              direction), direction)
    worst_col = options.get("columns", False)  # the round's rule reads every corruption column: its worst is shown
    fewest = options.get("fewest_lost")  # the round's rule reads the answers lost and a share floor: shown
    floor = share_floor([s for s in sel if not s.label.startswith("comparators/")], fewest) if fewest else None
    lines = ["| candidate (run/row) | share | " + " | ".join(f"{st} Δ [bound]" for st in required)
             + (" | worst column: Δ [bound]" if worst_col else "") + (" | answers lost" if fewest else "")
             + " | passes per query | eligible |",
             "|---|---:|" + "---:|" * len(required) + ("---|" if worst_col else "") + ("---:|" if fewest else "")
             + "---:|---|"]
    for s in sorted(sel, key=lambda x: (x.label.startswith("comparators/"), -x.share)):
        cell = lambda d, b: f"{round_figure(d, sign=True)} [{round_figure(b, sign=True)}]"  # noqa: E731
        cells = [cell(*s.streams[st]) if st in s.streams else "–" for st in required]
        if worst_col:
            name, (d, b) = min(s.columns.items(), key=lambda kv: (kv[1][1], kv[0]))
            cells.append(f"{name}: {cell(d, b)}")
        if fewest:
            cells.append(str(s.lost))
        ok = "–" if s.label.startswith("comparators/") or any(st not in s.streams for st in required) else (
            "yes" if s.eligible(required, options.get("stream_margin", MARGIN), worst_col)
            and (floor is None or s.share >= floor) else "no")
        lines.append(f"| {s.label} | {round_figure(s.share, percent=True)} | " + " | ".join(cells)
                     + f" | {round_figure(s.passes, digits=2)} | {ok} |")
    lines.append("")
    if study in DESCRIPTIVE_STUDIES:
        lines.append("Descriptive: no choice reads these rows.")
        return "\n".join(lines)
    chosen, _ = choose_default([s for s in sel if not s.label.startswith("comparators/")], required, tie, **options)
    best = ", ".join(f"{o} {choose_lr(sel, o).label.split('/')[1]}" for o in ("tcr", "rest")
                     if any(s.label.startswith(f"comparators/{o}@") for s in sel))
    lines.append(f"Chosen by the registered rule: **{chosen.label if chosen else 'none eligible'}**"
                 + (f"; best labelled fixed lr: {best}." if best else "."))
    return "\n".join(lines)


def main_table(rows: list[dict], direction: str = "i2t", seed: int = 3) -> str:
    """The main job's rows (report seed 3, the default grid and the clean stream): R@1 per column, share, verdict; from
    the report's streams runs and the main job's own runs of the image defaults (``main-s3``, main-job-r6; ``main-r7-s3``, main-job-r7)."""
    src, by = _merged(rows, direction, ("streams", "main-"))
    keys = sorted({k for k in src if k[1] == seed and k[0][0] not in ("noto", "diverse", "switch", "degenerate")}, key=str)
    grid = [k for k in keys if k[0][0] != "clean"]
    head = "| row | clean | " + " | ".join(_name(k[0]) for k in grid) + " | share | Δ [bound] | verdict |"
    lines = [head, "|---|---:|" + "---:|" * len(grid) + "---:|---:|---|"]
    clean = 100 * hits(src[(("clean", None), seed)]).mean()
    lines.append(f"| source | {round_figure(clean)} | " + " | ".join(round_figure(100 * hits(src[k]).mean()) for k in grid)
                 + " | – | – | – |")
    for name in sorted(by, key=lambda n: (not n.startswith("recommended"), n)):  # the default first
        row = by.get(name, {})
        if not all(k in row for k in keys):
            continue
        sh = shares({k[0]: 100 * hits(row[k]).mean() for k in grid}, {k[0]: 100 * hits(src[k]).mean() for k in grid}, clean, 0.0)
        c = compare(_diffs(row, src, grid))
        lines.append(f"| {name} | {round_figure(100 * hits(row[keys[0]]).mean())} | "
                     + " | ".join(round_figure(100 * hits(row[k]).mean()) for k in grid)
                     + f" | {round_figure(sh.pooled, percent=True)} | {round_figure(c.delta, sign=True)} "
                       f"[{round_figure(c.lower, sign=True)}] | {c.words()} |")
    return "\n".join(lines)


#: Issue 48's targets, per (table part, query modality): the default's row name in the tables, the comparators it is
#: measured against (image: the best labelled fixed lr and the previous defaults; text: NNN alone and REST at its lr)
#: and the run prefixes of its headline and streams (an image default's headline ran on its round's new seeds only: the
#: comparators are read on the same seeds). ``targets``: the current defaults (image: default-study-r10's report on
#: seeds 23 to 26); ``targets9`` to ``targets4``: the earlier rounds' defaults on their report seeds.
TARGET_ROWS = {("targets", "i2t"): (CURRENT_DEFAULT, ("tcr@3e-2", ROUND9_DEFAULT), ("r10-headline",), ("r10-streams",)),
               # the same default on r10-headline-more's three new headline seeds and r10-streams-more's two stream seeds
               ("targets10more", "i2t"): (CURRENT_DEFAULT, ("tcr@3e-2",), ("r10more-headline",), ("r10more-streams",)),
               ("targets9", "i2t"): (ROUND9_DEFAULT, ("tcr@3e-2", ROUND8_DEFAULT), ("r9-headline",), ("r9-streams",)),
               ("targets8", "i2t"): (ROUND8_DEFAULT, ("tcr@3e-2", ROUND7_DEFAULT), ("r8-headline",), ("r8-streams",)),
               ("targets7", "i2t"): (ROUND7_DEFAULT, ("tcr@3e-2", IMAGE_ROW_NAMES["tcr+gate+anchor+safe@3e-2"]),
                                     ("r7-headline",), ("r7-streams",)),
               ("targets", "t2i"): ("recommended", ("nnn", "rest@1e-4"), ("headline",), ("streams",)),
               ("targets6", "i2t"): (IMAGE_ROW_NAMES["tcr+gate+anchor+safe@3e-2"], ("tcr@3e-2", IMAGE_ROW_NAMES["rest+dn+safe@1e-3"]),
                                     ("r6-headline",), ("r6-streams",)),
               ("targets4", "i2t"): (IMAGE_ROW_NAMES["rest+dn+safe@1e-3"], ("tcr@3e-2", IMAGE_ROW_NAMES["recommended"]),
                                     ("r4-headline",), ("streams", "r4-streams"))}


def _merged(rows: list[dict], direction: str, prefixes: tuple) -> tuple[dict, dict]:
    src, by = {}, defaultdict(dict)
    for prefix in prefixes:
        s, b = _report(rows, direction, prefix)
        src.update(s)
        for name, keyed in b.items():
            by[name].update(keyed)
    return src, by


def _passes(row: dict, keys: list) -> float:
    return float(np.mean([row[k].get("forward_per_query", 0) + row[k].get("backward_per_query", 0) for k in keys]))


def targets(rows: list[dict], direction: str, part: str = "targets") -> str:
    """The default against issue 48's targets: on the headline columns (the seeds the default ran, every row on those
    seeds) its pooled share, each comparator's and the ratio, its worst column; on the default grid (image) the same
    over every stream seed; each stream's verdict; forward + backward passes per query against the first comparator."""
    name, others, head, stream = TARGET_ROWS[(part, direction)]
    src, by = _merged(rows, direction, head)
    lines = ["| row | headline seeds | headline share | the default's ÷ this | default-grid share | worst headline column "
             "| headline columns not below | clean | noto | diverse | switch | degenerate | passes per query |",
             "|---|---:|---:|---:|---:|---|---:|---|---|---|---|---|---:|"]
    seeds = sorted({s for _, s in by.get(name, {})})
    ssrc, sby = _merged(rows, direction, stream)
    for shown in (name, *others):
        row = by.get(shown, {})
        keys = [k for k in row if k in src and k[1] in seeds and k[0][0] not in STREAMS]
        if not keys and shown in sby:  # a comparator whose headline was not run on these seeds: its streams alone
            lines.append(_streams_only(shown, sby[shown], ssrc))
            continue
        if not keys:
            continue
        cols = sorted({c for c, _ in keys}, key=str)
        clean = float(np.mean([100 * hits(src[(("clean", None), s)]).mean() for s in seeds]))
        sh = shares({c: _r1(row, keys, c) for c in cols}, {c: _r1(src, keys, c) for c in cols}, clean)
        if shown == name:
            base = sh.pooled
        verdicts = {c: compare(_diffs(row, src, [k for k in keys if k[0] == c])) for c in cols}  # each column once
        worst = verdicts[sh.worst]
        fine = sum(v.verdict == "not below" for v in verdicts.values())
        gshare, words = _grid_and_words(sby.get(shown, {}), ssrc)
        ratio = round_figure(base / sh.pooled, percent=True) if sh.pooled > 0 else "–"
        lines.append(f"| {shown} | {','.join(map(str, seeds))} | {round_figure(sh.pooled, percent=True)} | {ratio} | {gshare} | "
                     f"{_name(sh.worst)}: {round_figure(worst.delta, sign=True)} [{round_figure(worst.lower, sign=True)}] "
                     f"{worst.words()} | {fine}/{len(cols)} | " + " | ".join(words) + f" | {round_figure(_passes(row, keys), digits=2)} |")
    return "\n".join(lines)


def _grid_and_words(srow: dict, ssrc: dict) -> tuple[str, list[str]]:
    """A row's default-grid share over its stream runs' seeds and each stream's verdict."""
    skeys = [k for k in srow if k in ssrc or k[0] == ("degenerate", None)]
    grid = sorted({c for c, _ in skeys if c[0] not in STREAMS}, key=str)
    gshare = "–"
    if grid:
        sseeds = sorted({s for _, s in skeys})
        sclean = float(np.mean([100 * hits(ssrc[(("clean", None), s)]).mean() for s in sseeds]))
        gshare = round_figure(shares({c: _r1(srow, skeys, c) for c in grid}, {c: _r1(ssrc, skeys, c) for c in grid},
                                     sclean, 0.0).pooled, percent=True)
    words = []
    for st in ("clean", "noto", "diverse", "switch", "degenerate"):
        ks = [k for k in skeys if k[0] == (st, None)]
        words.append(compare(_diffs(srow, ssrc, ks)).words() if ks else "–")
    return gshare, words


def _streams_only(shown: str, srow: dict, ssrc: dict) -> str:
    gshare, words = _grid_and_words(srow, ssrc)
    return f"| {shown} | – | – | – | {gshare} | – | – | " + " | ".join(words) + " | – |"


def v3_verdicts(rows: list[dict], direction: str) -> str:
    """Protocol v3's report-phase stream rows (seeds 3-5) judged again with v4's three words: each (row, stream) whose
    v3 word ("not below" when the one-sided bound is above -0.5, else "below the source") and v4 word differ."""
    src: dict = {}
    by: dict = defaultdict(dict)
    for r in rows:
        if r.get("phase") != "report" or r["direction"] != direction or r["shift"] not in STREAMS or r["seed"] not in (3, 4, 5):
            continue
        key = (_col(r), r["seed"])
        if r["objective"] == SOURCE:
            src.setdefault(key, r)
        else:
            by[(r["config"], r["objective"])][key] = r
    lines = ["| v3 row | stream | Δ [bound] | v3 | v4 |", "|---|---|---:|---|---|"]
    for (config, objective), row in sorted(by.items()):
        for st in STREAMS:
            ks = [k for k in row if k[0] == (st, None) and _source_key(src, k)]
            if not ks:
                continue
            c = compare([np.stack([(hits(row[k]) - hits(_source_key(src, k))).astype(np.float64) for k in sorted(ks)])])
            old = "not below" if c.lower > -0.5 else "below the source"
            if old != c.verdict:
                lines.append(f"| {config} | {st} | {round_figure(c.delta, sign=True)} [{round_figure(c.lower, sign=True)}] | "
                             f"{old} | {c.words()} |")
    return "\n".join(lines)


def _source_key(src: dict, k: tuple) -> dict | None:
    return src.get(k) or src.get((("clean", None), k[1]))


#: The later rounds' parts: ``r<k>`` default-study-r<k>'s selection table and choice (its runs and its incumbent's),
#: ``r<k>headline`` / ``r<k>streams`` its report (the chosen row, TCR at 3e-2 and the incumbent, a folder each) on its
#: new seeds.
ROUND_PARTS = {"r4": (selection, "default-study-r4"), "r4streams": (streams, "r4-streams"),
               "r5": (selection, "default-study-r5"), "onerule": (selection, "one-rule-text"),
               "r10check": (selection, "r10-diverse-check"), "onerule10": (selection, "one-rule-text-r10"),
               "r10more": (headline, "r10more-headline"), "r10morestreams": (streams, "r10more-streams"),
               **{f"r{k}{kind}": (table, arg) for k in (6, 7, 8, 9, 10, 11, 12) for kind, table, arg in
                  (("", selection, f"default-study-r{k}"), ("headline", headline, f"r{k}-headline"),
                   ("streams", streams, f"r{k}-streams"))}}


def summarise(rows_path: Path, direction: str, part: str) -> str:
    rows = read(rows_path)
    if part == "selection":
        return selection(rows, direction)
    if part in ROUND_PARTS:  # a later round's selection table and choice, or its report on its new seeds
        table, arg = ROUND_PARTS[part]
        return table(rows, direction, arg)
    if part == "headline":
        return headline(rows, direction) + ("\n\n" + shift_specific(rows) if direction == "t2i" else "")
    if part == "streams":
        return streams(rows, direction)
    if part == "main":
        return main_table(rows, direction)
    if part in PARTS and part.startswith("targets"):  # issue 48's targets: the default against the best fixed lr (text: NNN, REST)
        return targets(rows, direction, part)
    if part == "v3verdicts":
        return v3_verdicts(rows, direction)
    raise ValueError(f"part must be one of {PARTS}; got {part!r}.")


BLOCK = re.compile(r"(<!-- v4: (?P<rows>\S+) (?P<direction>i2t|t2i) (?P<part>[a-z0-9]+) -->\n)(?P<body>.*?)(<!-- /v4 -->)", re.S)


def refresh_card(card: Path) -> int:
    """Rewrite every ``<!-- v4: <rows> <direction> <part> -->`` block of ``card`` from its rows (paths relative to
    the card's folder); returns the number of blocks. ``tests/test_model_cards.py`` checks them."""
    text = card.read_text(encoding="utf-8")
    n = 0

    def fill(m: re.Match) -> str:
        nonlocal n
        n += 1
        body = summarise(card.parent / m["rows"], m["direction"], m["part"])
        return f"{m.group(1)}{body}\n<!-- /v4 -->"

    card.write_text(BLOCK.sub(fill, text), encoding="utf-8")
    return n


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m hf_tta.benchmarks.protocols.v4_tables")
    sub = p.add_subparsers(dest="command", required=True)
    e = sub.add_parser("export")
    e.add_argument("out")
    e.add_argument("dest")
    pr = sub.add_parser("print")
    pr.add_argument("rows")
    pr.add_argument("part", choices=PARTS)
    pr.add_argument("direction", choices=("i2t", "t2i"))
    card = sub.add_parser("card")
    card.add_argument("card")
    args = p.parse_args(argv)
    if args.command == "card":
        print(f"refreshed {refresh_card(Path(args.card))} blocks of {args.card}")
    elif args.command == "export":
        print(f"wrote {export(Path(args.out), Path(args.dest))} rows to {args.dest}")
    else:
        print(summarise(Path(args.rows), args.direction, args.part))
    return 0


if __name__ == "__main__":
    sys.exit(main())
