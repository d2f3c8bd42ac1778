#!/usr/bin/env python
"""Protocol v3's rows and their arithmetic (:mod:`hf_tta.benchmarks.protocols.v3_summary` makes the choices and the tables):
loading a run folder or an exported ``rows.jsonl``, per-query hits, the columns and labels of the tables, the share of
lost recall won back (a ratio of sums) and the verdict against the source (:func:`hf_tta.benchmarks.intervals.non_inferiority`)."""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import numpy as np

from hf_tta.benchmarks.intervals import non_inferiority

SOURCE = "source"


STREAMS = ("clean", "noto", "diverse", "switch", "degenerate")


PAPER_LR = 3e-4


LR_GRID = {"i2t": (1e-4, 3e-4, 1e-3, 3e-3, 1e-2), "t2i": (1e-5, 3e-5, 1e-4, 3e-4, 1e-3, 3e-3)}


LR_BEYOND = {"i2t": (3e-5, 3e-2), "t2i": (3e-6, 1e-2)}


CEILINGS = ("oracle", "oracle_all")


def lr_name(lr: float) -> str:
    """``3e-4`` for 0.0003: the lr as the recipe's folders name it."""
    mantissa, exponent = f"{lr:.0e}".split("e")
    return f"{mantissa}e{int(exponent)}"


def load(out: Path | list[Path], direction: str | None = None) -> list[dict]:
    """Every finished run's row under ``out/<phase>/<direction>/<config>/rows.jsonl``, tagged with its phase, config
    and run settings (lr, scoring, safety, score transform, degenerate batches, slice, device); or the rows of an exported
    ``rows.jsonl`` (already tagged)."""
    if isinstance(out, (list, tuple)):
        return [r for o in out for r in load(o, direction)]
    out = Path(out)
    if out.is_file():
        rows = [json.loads(line) for line in out.read_text().splitlines() if line.strip()]
    else:
        rows = []
        for path in sorted(out.glob("*/*/*/rows.jsonl")):
            phase, config = path.parts[-4], path.parts[-2]
            lines = path.read_text().splitlines()
            head = json.loads(lines[0]).get("hf-tta-run", {}) if lines else {}
            settings = {k: head.get(k) for k in ("lr", "scoring", "safety", "score_transform", "degenerate_batches", "limit", "steps",
                                                  "device")}
            for line in lines[1:]:
                row = json.loads(line)
                if "error" not in row:
                    rows.append({**row, "phase": phase, "config": config, **settings})
    return [r for r in rows if direction is None or r["direction"] == direction]


def hits(row: dict) -> np.ndarray:
    return np.frombuffer(row["hits"].encode("ascii"), dtype=np.uint8).astype(np.int8) - ord("0")


def column(row: dict) -> tuple:
    return (row["shift"], row.get("severity"))


def selector(row: dict) -> str:
    """The lr selector of a phase-``auto`` run (issue 37), from its folder
    ``<objective>-<selector>[-degenerate|-report|-report45|-streams][~<columns added>]``
    (:mod:`hf_tta.benchmarks.protocols.v3`'s :data:`SELECTORS`: ``auto`` the probe, ``hg…`` the hypergradient rule)."""
    name = row["config"].split("~")[0].removeprefix(f"{row['objective']}-")  # ``~``: columns added by another run
    for suffix in ("-degenerate", "-report45", "-report", "-streams"):
        name = name.removesuffix(suffix)
    return name


def label(row: dict) -> str:
    """A row's name in the tables: its objective (row) and lr (or, for issue 37's selectors, the selector), and the
    preset phase's safety variant; a run without an lr (a training-free row, phase ``cheaper``) by its row alone."""
    variant = "-lite" if "-lite" in row["config"] else ""
    if row.get("lr") is None:  # issue 37's selectors, or a training-free row (no lr)
        return f"{row['objective']}{variant}" + (f"@{selector(row)}" if row.get("lr_search") else "")
    return f"{row['objective']}{variant}@{lr_name(row['lr'])}"


def sources(rows: list[dict]) -> dict[tuple, dict[int, dict]]:
    """The source model's rows by column and seed; two runs of one source row must agree in their hits."""
    out: dict[tuple, dict[int, dict]] = defaultdict(dict)
    for r in rows:
        if r["objective"] == SOURCE:
            held = out[column(r)].get(r["seed"])
            if held is not None and held["hits"] != r["hits"]:
                raise ValueError(f"two source rows of {column(r)} seed {r['seed']} differ in their hits.")
            out[column(r)][r["seed"]] = r
    return out


def by_label(rows: list[dict], phases: tuple[str, ...]) -> dict[str, dict[tuple, dict[int, dict]]]:
    out: dict[str, dict] = defaultdict(lambda: defaultdict(dict))
    for r in rows:
        if r["objective"] != SOURCE and r["phase"] in phases:
            out[label(r)][column(r)][r["seed"]] = r
    return out


def corruption_columns(cells: dict) -> list[tuple]:
    return sorted((c for c in cells if c[0] not in STREAMS), key=lambda c: (c[1] or 0, c[0]))


def selection_columns(direction: str) -> list[tuple]:
    """The selection split's corruption columns in a direction (:data:`hf_tta.benchmarks.protocols.v3_splits.SELECTION`)."""
    from .v3_splits import SELECTION

    if direction == "i2t":
        return list(SELECTION.image_conditions)
    return [(c, s) for c in SELECTION.text_corruptions for s in SELECTION.text_severities]


def share(cells: dict, src: dict, columns: list[tuple]) -> float | None:
    """Ratio of sums over columns and seeds: Σ (row − source) / Σ (clean − source), R@1 from hits."""
    gain = lost = 0.0
    for c in columns:
        for seed, row in cells.get(c, {}).items():
            s = src[c][seed]
            clean = src[("clean", None)][seed]
            gain += hits(row).mean() - hits(s).mean()
            lost += hits(clean).mean() - hits(s).mean()
    return gain / lost if lost > 0 else None


def verdict(cells: dict, src: dict, columns: list[tuple]):
    """:func:`non_inferiority` of the row against the source over ``columns`` (seeds and items jointly)."""
    diffs = []
    for c in columns:
        seeds = sorted(cells[c])
        diffs.append(np.stack([hits(cells[c][s]) - hits(src[c][s]) for s in seeds]))
    return non_inferiority(diffs)


def spearman(a: np.ndarray, b: np.ndarray) -> float:
    """Spearman's rank correlation (average ranks for ties); NaN when either side is constant."""
    def ranks(x):
        order = np.argsort(x, kind="stable")
        r = np.empty(len(x))
        r[order] = np.arange(len(x), dtype=float)
        for v in np.unique(x):  # ties share their mean rank
            r[x == v] = r[x == v].mean()
        return r

    if np.ptp(a) == 0 or np.ptp(b) == 0:
        return float("nan")
    return float(np.corrcoef(ranks(np.asarray(a, float)), ranks(np.asarray(b, float)))[0, 1])


def report_cells(rows: list[dict], direction: str, seeds: tuple[int, ...], phase: str = "report"):
    """The report split's rows of a phase (refusing selection rows), its source rows and its labelled cells."""
    from .v3_splits import check_report_rows

    rows = check_report_rows([r for r in rows if r["direction"] == direction and r["phase"] == phase and r["seed"] in seeds])
    return sources(rows), by_label(rows, (phase,))


def held_columns(src: dict, held: dict, seeds: tuple[int, ...]) -> list[tuple]:
    """The corruption columns of ``src`` that ``held`` (cells or source rows of another phase or row) has on every seed
    of ``seeds``: a table compares on those when the report gained columns after some runs."""
    return [c for c in corruption_columns(src) if all(s in src[c] and s in held.get(c, {}) for s in seeds)]


def complete(cells: dict, cols: list[tuple], seeds: tuple[int, ...]) -> bool:
    return all(c in cells and all(s in cells[c] for s in seeds) for c in cols)


def mean_r1(cells: dict, c: tuple, seeds: tuple[int, ...]) -> float:
    return float(np.mean([hits(cells[c][s]).mean() * 100 for s in seeds]))


def export(out: Path, dest: Path) -> None:
    """Every row (per-query hits included) into ``dest/rows.jsonl``."""
    dest.mkdir(parents=True, exist_ok=True)
    rows = load(out)
    with open(dest / "rows.jsonl", "w") as f:
        for r in rows:
            f.write(json.dumps(r, sort_keys=True) + "\n")
    print(f"wrote {len(rows)} rows to {dest / 'rows.jsonl'}")
