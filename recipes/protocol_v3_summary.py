#!/usr/bin/env python
"""Choices and tables of protocol v3 (``recipes/protocol_v3.py``) from its rows alone.

    python recipes/protocol_v3_summary.py /work/runs/v3 --direction i2t            # print the tables
    python recipes/protocol_v3_summary.py /work/runs/v3 --export model_cards/results/protocol-v3
    python recipes/protocol_v3_summary.py model_cards/results/protocol-v3/rows.jsonl   # the card's tables

Every figure is computed from per-query hits and printed through :func:`hf_tta.benchmarks.figures.figure` (one
rounding); every "not below the source" is :func:`hf_tta.benchmarks.intervals.non_inferiority` (one-sided 95 %
lower bound above −0.5 R@1, items and seeds resampled jointly).

**The choice rules, written before the selection runs were read** (selection split only, :mod:`hf_tta.benchmarks.splits`):

* **share** of a row = the share of lost recall won back on the split's corruption columns, a ratio of sums over the
  columns (and seeds): Σ (R@1_row − R@1_source) / Σ (R@1_clean − R@1_source).
* **A method's lr**: among the lrs of its grid whose clean stream is not below the source, the highest share (ties:
  the lower lr) whose degenerate stream is not below the source either, walking the :data:`DEGENERATE_WALK` best by
  share. If neither passes the degenerate stream, the best clean-passing lr is chosen and flagged "degenerate below
  the source" (the safety layer's job, reported). If no lr passes the clean stream, the paper's lr stays, flagged.
  A choice at the grid's edge is flagged, and the ``extend`` phase adds the next half-decade before it is final.
* **A ceiling's lr** (``oracle``, ``oracle_all``: supervised, not deployable): the highest share.
* **The preset** (``preset`` phase: TCR and REST with DN and the safety layer, at their selected and the paper's lr,
  the default safety layer and one without its drift rule): among candidates with no selection column and no stream
  (clean, degenerate) below the source, the highest share; a candidate within :data:`PRESET_TIE` of the best share
  that is simpler wins (TCR before REST, the paper's lr, the default safety layer: the current preset wins ties).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from hf_tta.benchmarks.figures import figure  # noqa: E402
from hf_tta.benchmarks.intervals import non_inferiority  # noqa: E402

DEGENERATE_WALK = 2
PRESET_TIE = 0.01
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
    and run settings (lr, scoring, safety, score transform, degenerate batches, slice); or the rows of an exported
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
            settings = {k: head.get(k) for k in ("lr", "scoring", "safety", "score_transform", "degenerate_batches", "limit", "steps")}
            for line in lines[1:]:
                row = json.loads(line)
                if "error" not in row:
                    rows.append({**row, "phase": phase, "config": config, **settings})
    return [r for r in rows if direction is None or r["direction"] == direction]


def hits(row: dict) -> np.ndarray:
    return np.frombuffer(row["hits"].encode("ascii"), dtype=np.uint8).astype(np.int8) - ord("0")


def column(row: dict) -> tuple:
    return (row["shift"], row.get("severity"))


def label(row: dict) -> str:
    """A row's name in the tables: its objective (row) and lr (``auto``: issue 37's probe), and the preset phase's
    safety variant; a run without an lr (a training-free row, phase ``cheaper``) by its row alone."""
    variant = "-lite" if "-lite" in row["config"] else ""
    if row.get("lr") is None:  # issue 37's probe ("auto"), or a training-free row (no lr)
        return f"{row['objective']}{variant}" + ("@auto" if row.get("lr_search") else "")
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
    """The selection split's corruption columns in a direction (:data:`hf_tta.benchmarks.splits.SELECTION`)."""
    from hf_tta.benchmarks.splits import SELECTION

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


def selection_table(rows: list[dict], direction: str) -> dict[str, dict[float, dict]]:
    """Per objective and lr on the selection split: share, clean and degenerate verdicts (``None``: not run)."""
    rows = [r for r in rows if r["direction"] == direction and r["seed"] == 0]
    src = sources(rows)
    table: dict[str, dict[float, dict]] = defaultdict(dict)
    cells_by = by_label(rows, ("select", "degenerate"))
    for name, cells in cells_by.items():
        objective, lr = name.split("@")[0], next(iter(next(iter(cells.values())).values()))["lr"]
        cols = selection_columns(direction)
        if any(c not in cells for c in cols):
            continue  # a run still going: every selection column or none
        entry = {"share": share(cells, src, cols), "columns": len(cols)}
        for stream in ("clean", "degenerate"):
            key = (stream, None)
            entry[stream] = verdict(cells, src, [key]) if key in cells else None
        table[objective][lr] = entry
    return table


def choose(objective: str, lrs: dict[float, dict], direction: str) -> dict:
    """The rule of the module docstring for one objective: ``{"lr", "flags", "walk"}``; ``walk`` lists the lrs whose
    degenerate stream the rule still needs (run the ``degenerate`` phase)."""
    ranked = sorted(lrs, key=lambda lr: (-(lrs[lr]["share"] or -np.inf), lr))
    grid = sorted(lrs)  # the lrs run: the grid and any extension
    flags: list[str] = []
    if objective in CEILINGS:
        lr = ranked[0]
    else:
        eligible = [lr for lr in ranked if lrs[lr]["clean"] is not None and not lrs[lr]["clean"].below]
        if not eligible:
            return {"lr": PAPER_LR, "flags": ["no lr passes the clean stream"], "walk": []}
        walk = eligible[:DEGENERATE_WALK]
        missing = [lr for lr in walk if lrs[lr]["degenerate"] is None]
        passing = [lr for lr in walk if lrs[lr]["degenerate"] is not None and not lrs[lr]["degenerate"].below]
        if missing and not (passing and walk.index(passing[0]) < min(walk.index(m) for m in missing)):
            return {"lr": None, "flags": ["degenerate stream pending"], "walk": missing}
        lr = passing[0] if passing else walk[0]
        if not passing:
            flags.append("degenerate below the source at its best lrs")
    if lr in (min(grid), max(grid)) and len(grid) > 1:
        flags.append("at the grid's edge")
    return {"lr": lr, "flags": flags, "walk": []}


def choices(rows: list[dict], direction: str) -> dict[str, dict]:
    return {name: choose(name, lrs, direction) for name, lrs in selection_table(rows, direction).items()}


def selected_lrs(rows: list[dict], direction: str) -> dict[str, str]:
    """Each objective's chosen lr as a folder name; refuses while a choice is pending."""
    chosen = choices(rows, direction)
    pending = [n for n, c in chosen.items() if c["lr"] is None]
    if pending:
        raise SystemExit(f"the choice of {pending} waits for the degenerate phase: run it first.")
    return {n: lr_name(c["lr"]) for n, c in chosen.items()}


def degenerate_walk(rows: list[dict], direction: str) -> list[tuple[str, str]]:
    return [(n, lr_name(lr)) for n, c in choices(rows, direction).items() for lr in c["walk"]]


def edge_lrs(rows: list[dict], direction: str) -> dict[str, str]:
    """The next half-decade beyond the edge for every objective chosen at its grid's edge."""
    out = {}
    table = selection_table(rows, direction)
    for name, c in choices(rows, direction).items():
        if c["lr"] is not None and "at the grid's edge" in c["flags"]:
            low, high = LR_BEYOND[direction]
            nxt = high if c["lr"] >= max(LR_GRID[direction]) else low
            if nxt not in table[name]:
                out[name] = lr_name(nxt)
    return out


# ------------------------------------------------------------------------------------------------ the preset
def preset_candidates(rows: list[dict], direction: str) -> dict[str, dict]:
    """The preset phase's candidates on the selection split: share, worst column/stream verdict, eligibility."""
    rows = [r for r in rows if r["direction"] == direction and r["seed"] == 0]
    src = sources(rows)
    out = {}
    for name, cells in by_label(rows, ("preset",)).items():
        cols = selection_columns(direction)
        streams = [c for c in (("clean", None), ("degenerate", None)) if c in cells]
        if any(c not in cells for c in cols) or len(streams) < 2:
            continue  # not every selection column and stream ran yet
        checks = {c: verdict(cells, src, [c]) for c in [*cols, *streams]}
        worst = min(checks.items(), key=lambda kv: kv[1].lower)
        out[name] = {"share": share(cells, src, cols), "worst": worst, "eligible": not any(v.below for v in checks.values()),
                     "row": name.split("@")[0].replace("-lite", ""), "lr": next(iter(cells[cols[0]].values()))["lr"],
                     "lite": "-lite" in name}
    return out


def _simplicity(c: dict) -> tuple:
    """Tie order: TCR before REST, the paper's lr, the default safety layer."""
    return (not c["row"].startswith("tcr"), c["lr"] != PAPER_LR, c["lite"])


def selected_preset(rows: list[dict], direction: str) -> dict | None:
    """The preset rule (module docstring): ``{"name", "row", "args"}`` for the report, or ``None`` (no candidate
    rows yet, or none eligible)."""
    cands = {n: c for n, c in preset_candidates(rows, direction).items() if c["eligible"] and c["share"] is not None}
    if not cands:
        return None
    best = max(c["share"] for c in cands.values())
    name = min((n for n, c in cands.items() if c["share"] >= best - PRESET_TIE), key=lambda n: _simplicity(cands[n]))
    c = cands[name]
    args = ["--lr", lr_name(c["lr"])] + (["--safety", '{"min_agreement": 0, "max_agreement_drop": 1}'] if c["lite"] else [])
    return {"name": f"preset-{c['row']}{'-lite' if c['lite'] else ''}-lr{lr_name(c['lr'])}", "row": c["row"], "args": args,
            "label": name}


# ------------------------------------------------------------------------------------------------ label-free proxies
#: Label-free signals every row records (the adapted model's query embeddings at the end of the stream, TCR Fig. 1),
#: each with the sign under which "higher is better" is its hypothesis: more uniform queries, a smaller query–gallery gap.
PROXIES = {"uniformity": ("uniformity_after", 1.0), "gap": ("gap_after", -1.0)}


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


def proxy_study(rows: list[dict], direction: str) -> dict[str, dict[str, dict]]:
    """Per objective and proxy, over the lrs of its selection runs: Spearman's rank correlation of the proxy (mean
    over the selection columns, signed so that higher is better) with the true share, and the regret: the share lost
    by taking the proxy's best lr instead of the labels' best (issue 37's proxy study, from the selection rows)."""
    sel = [r for r in rows if r["direction"] == direction and r["seed"] == 0 and r["phase"] == "select"]
    table = selection_table(rows, direction)
    cols = set(selection_columns(direction))
    out: dict[str, dict[str, dict]] = {}
    for name, lrs in table.items():
        ordered = sorted(lrs)
        if len(ordered) < 3:
            continue
        truth = np.array([lrs[lr]["share"] for lr in ordered])
        out[name] = {}
        for proxy, (key, sign) in PROXIES.items():
            values = np.array([np.mean([r[key] for r in sel if r["objective"] == name and r["lr"] == lr and column(r) in cols])
                               for lr in ordered]) * sign
            rho = spearman(values, truth)
            out[name][proxy] = {"rho": float(rho), "regret": float(truth.max() - truth[int(np.argmax(values))]),
                                "proxy_lr": ordered[int(np.argmax(values))], "label_lr": ordered[int(np.argmax(truth))]}
    return out


def proxy_lines(rows: list[dict], direction: str) -> list[str]:
    study = proxy_study(rows, direction)
    lines = ["| objective | " + " | ".join(f"{p}: ρ, lr, regret" for p in PROXIES) + " | labels' lr |",
             "|---|" + "---|" * (len(PROXIES) + 1)]
    for name in sorted(study, key=lambda n: (n in CEILINGS, n)):
        cells = [f"{figure(v['rho'], 2, sign=True)}, {lr_name(v['proxy_lr'])}, {figure(v['regret'], percent=True)}"
                 for v in study[name].values()]
        lines.append(f"| {name} | {' | '.join(cells)} | {lr_name(next(iter(study[name].values()))['label_lr'])} |")
    return lines


# ------------------------------------------------------------------------------------------------ tables
def _ci(ni) -> str:
    from hf_tta.benchmarks.figures import interval

    return interval(ni.lower, ni.delta) if ni else "–"


def selection_lines(rows: list[dict], direction: str) -> list[str]:
    """The selection split's table: every objective's share at every lr, the choice in bold, its flags."""
    table = selection_table(rows, direction)
    chosen = choices(rows, direction)
    lrs = sorted({lr for t in table.values() for lr in t})
    lines = [f"| objective | {' | '.join(lr_name(lr) for lr in lrs)} | chosen | clean, degenerate at the chosen lr | flags |",
             "|---|" + "---|" * (len(lrs) + 3)]
    for name in sorted(table, key=lambda n: (n in CEILINGS, n)):
        t, c = table[name], chosen[name]
        cells = []
        for lr in lrs:
            text = figure(t[lr]["share"], percent=True) if lr in t else ""
            cells.append(f"**{text}**" if lr == c["lr"] and text else text)
        at = t.get(c["lr"], {})
        streams = ", ".join(v.verdict if v else "not run" for v in (at.get("clean"), at.get("degenerate"))) if name not in CEILINGS else "–"
        lines.append(f"| {name} | {' | '.join(cells)} | {lr_name(c['lr']) if c['lr'] else 'pending'} | {streams} | "
                     f"{'; '.join(c['flags']) or '–'} |")
    return lines


def _report(rows: list[dict], direction: str, seeds: tuple[int, ...], phase: str = "report"):
    """The report split's rows of a phase (refusing selection rows), its source rows and its labelled cells."""
    from hf_tta.benchmarks.splits import check_report_rows

    rows = check_report_rows([r for r in rows if r["direction"] == direction and r["phase"] == phase and r["seed"] in seeds])
    return sources(rows), by_label(rows, (phase,))


def _complete(cells: dict, cols: list[tuple], seeds: tuple[int, ...]) -> bool:
    return all(c in cells and all(s in cells[c] for s in seeds) for c in cols)


def _r1(cells: dict, c: tuple, seeds: tuple[int, ...]) -> float:
    return float(np.mean([hits(cells[c][s]).mean() * 100 for s in seeds]))


def report_lines(rows: list[dict], direction: str, seeds: tuple[int, ...] = (3, 4, 5)) -> list[str]:
    """The report split's table (default grid for i2t): R@1 per column, share, Δ with its one-sided bound, verdict;
    the rows that ran on every seed of ``seeds``."""
    from hf_tta.benchmarks.report import abbreviation

    src, cells_by = _report(rows, direction, seeds)
    cols = [c for c in corruption_columns(src) if all(s in src[c] for s in seeds)]
    head = f"| row | {' | '.join(f'{abbreviation(c[0])} {c[1]}' for c in cols)} | won back | Δ R@1 [one-sided 95 % bound] | vs the source (margin 0.5) |"
    lines = [head, "|---|" + "---|" * (len(cols) + 3),
             f"| clean (source) | {' | '.join(figure(_r1(src, ('clean', None), seeds)) for _ in cols)} | | | |",
             f"| source | {' | '.join(figure(_r1(src, c, seeds)) for c in cols)} | | | |"]
    for name, cells in sorted(cells_by.items()):
        if not _complete(cells, cols, seeds):
            continue
        ni = verdict(cells, src, cols)
        lines.append(f"| {name} | {' | '.join(figure(_r1(cells, c, seeds)) for c in cols)} | "
                     f"{figure(share(cells, src, cols), percent=True)} | "
                     f"{figure(ni.delta, sign=True)} [{figure(ni.lower, sign=True)}] | {ni.verdict} |")
    return lines


def stream_lines(rows: list[dict], direction: str, seeds: tuple[int, ...] = (3, 4, 5)) -> list[str]:
    """The report split's streams per row: Δ R@1 against the source with its one-sided bound and the verdict."""
    from hf_tta.benchmarks.report import abbreviation

    src, cells_by = _report(rows, direction, seeds)
    lines = ["| row | stream | source R@1 | Δ R@1 [one-sided 95 % bound] | vs the source (margin 0.5) |", "|---|---|---|---|---|"]
    for name, cells in sorted(cells_by.items()):
        for stream in STREAMS:
            c = (stream, None)
            if c not in src or not _complete(cells, [c], seeds):
                continue
            ni = verdict(cells, src, [c])
            lines.append(f"| {name} | {abbreviation(stream)} | {figure(_r1(src, c, seeds))} | {figure(ni.delta, sign=True)} "
                         f"[{figure(ni.lower, sign=True)}] | {ni.verdict} |")
    return lines


def after_lines(rows: list[dict], direction: str, seeds: tuple[int, ...] = (3,)) -> list[str]:
    """The papers' after-update scoring (phase ``after``) beside the prequential row of the same objective and lr on
    the same columns and seeds: each row's share both ways, and the gain the after-update scoring adds, Δ R@1 (after −
    before) with its two-sided 95 % interval (items and seeds resampled jointly)."""
    from hf_tta.benchmarks.figures import interval
    from hf_tta.benchmarks.intervals import paired_bootstrap

    src, before = _report(rows, direction, seeds)
    _, after = _report(rows, direction, seeds, phase="after")
    cols = [c for c in corruption_columns(src) if all(s in src[c] for s in seeds)]
    lines = ["| row | won back, prequential (protocol v3) | won back, after the update (the papers' scoring) | "
             "Δ R@1 after − before [95 % interval] |", "|---|---|---|---|"]
    for name, post in sorted(after.items()):
        pre = before.get(name, {})
        if not (_complete(post, cols, seeds) and _complete(pre, cols, seeds)):
            continue
        diffs = [np.stack([hits(post[c][s]) - hits(pre[c][s]) for s in seeds]) for c in cols]
        delta, (lo, hi) = paired_bootstrap(diffs)
        lines.append(f"| {name} | {figure(share(pre, src, cols), percent=True)} | {figure(share(post, src, cols), percent=True)} | "
                     f"{figure(delta, sign=True)} {interval(lo, hi)} |")
    return lines


def _preset_lines(rows: list[dict], direction: str) -> list[str]:
    preset = preset_candidates(rows, direction)
    if not preset:
        return []
    lines = ["| candidate | won back | worst column or stream | eligible |", "|---|---|---|---|"]
    for name, c in sorted(preset.items()):
        (col, ni) = c["worst"]
        lines.append(f"| {name} | {figure(c['share'], percent=True)} | {col[0]} {col[1] or ''}: {ni.verdict} | "
                     f"{'yes' if c['eligible'] else 'no'} |")
    chosen = selected_preset(rows, direction)
    return [*lines, "", f"chosen: {chosen['label'] if chosen else 'none eligible'}"]


def _share_at(fixed: dict, objective: str, lr_of: dict, src: dict, cols: list[tuple]) -> float | None:
    """The share the fixed-lr selection rows give when each column runs at ``lr_of[column]`` (``None`` where a
    column's lr has no fixed-lr row)."""
    cells = {}
    for c in cols:
        row = fixed.get(f"{objective}@{lr_name(lr_of[c])}", {}).get(c) if lr_of.get(c) else None
        if not row:
            return None
        cells[c] = {0: row}
    return share(cells, src, cols)


def auto_lines(rows: list[dict], direction: str) -> list[str]:
    """Issue 37's label-free lr probe (phase ``auto``, seed 0, the selection split) against the labelled choice.

    Per objective: the labelled lr and its share; the probe's run (its default proxy): the lr it chose per stream,
    its share and that share over the labelled one, its clean and degenerate verdicts; for every proxy the share the
    fixed-lr selection rows give at the lrs that proxy would have chosen per stream, over the labelled share (an
    estimate: those rows adapt at that lr from the first batch, without the probe); and the run's passes of the query
    tower against a fixed-lr run of the same stream, ``(n − probed) · (2S + 1) + probe passes`` over ``n · (2S + 1)``
    (``S`` steps per batch, one answering forward each batch, prequential)."""
    from hf_tta.benchmarks.report import abbreviation

    sel = [r for r in rows if r["direction"] == direction and r["seed"] == 0]
    auto: dict[str, dict[tuple, dict]] = defaultdict(dict)
    for r in sel:
        if r["phase"] == "auto" and r["objective"] != SOURCE and r.get("lr_search"):
            auto[r["objective"]][column(r)] = r
    if not auto:
        return []
    src = {c: {0: by_seed[0]} for c, by_seed in sources(sel).items() if 0 in by_seed}
    table, labelled = selection_table(rows, direction), choices(rows, direction)
    fixed = {name: {c: by_seed[0] for c, by_seed in cells.items() if 0 in by_seed}
             for name, cells in by_label(sel, ("select", "extend", "degenerate")).items()}
    cols = selection_columns(direction)
    proxies = sorted({p for runs in auto.values() for r in runs.values() for p in r["lr_search"]["choices"]})
    lines = [f"| objective | labelled lr (share) | probe: lr per stream | probe share (of labelled) | clean, degenerate | "
             f"{' | '.join(f'{p}: share (of labelled)' for p in proxies)} | passes vs fixed lr |",
             "|---|" + "---|" * (len(proxies) + 5)]
    for name, runs in sorted(auto.items()):
        lab_lr = labelled.get(name, {}).get("lr")
        lab = table.get(name, {}).get(lab_lr, {}).get("share") if lab_lr else None
        of = lambda x: f"{figure(x, percent=True)} ({figure(x / lab, percent=True) if x is not None and lab else '–'})"  # noqa: E731
        done = all(c in runs for c in cols)
        run_share = share({c: {0: runs[c]} for c in cols}, src, cols) if done else None
        chosen = ", ".join(f"{abbreviation(c[0])}: {lr_name(runs[c]['lr_search']['chosen'])}" for c in [*cols, ("clean", None), ("degenerate", None)] if c in runs)
        verdicts = ", ".join(verdict({c: {0: runs[c]}}, src, [c]).verdict if c in runs else "not run" for c in (("clean", None), ("degenerate", None)))
        per_proxy = [of(_share_at(fixed, name, {c: runs[c]["lr_search"]["choices"].get(p) for c in cols}, src, cols)) if done else "–"
                     for p in proxies]
        n = probed = probe_passes = 0
        for r in runs.values():
            steps, ls = int(r.get("steps") or 3), r["lr_search"]
            n += r["num_queries"] * (2 * steps + 1)
            probed += ls["queries"] * (2 * steps + 1)
            probe_passes += ls["forward"] + ls["backward"]
        cost = (n - probed + probe_passes) / n if n else None
        lines.append(f"| {name} | {lr_name(lab_lr) if lab_lr else '–'} ({figure(lab, percent=True)}) | {chosen} | "
                     f"{of(run_share) if done else '–'} | {verdicts} | {' | '.join(per_proxy)} | {figure(cost, 2)}× |")
    return lines


def auto_report_lines(rows: list[dict], direction: str, seeds: tuple[int, ...] = (3,)) -> list[str]:
    """The probe on the report split (phase ``auto``, seed 3) beside the same objective at its labelled lr and at the
    paper's lr (phase ``report``, same seed and columns): shares, the probe's share of the labelled one, the lrs it
    chose per column, and its verdict against the source."""
    from hf_tta.benchmarks.report import abbreviation

    _, auto = _report(rows, direction, seeds, phase="auto")
    src, report = _report(rows, direction, seeds)  # the report's source rows (the probe's runs hold the same ones)
    labelled = {n: c["lr"] for n, c in choices(rows, direction).items()}
    cols = [c for c in corruption_columns(src) if all(s in src[c] for s in seeds)]
    lines = ["| objective | probe: lr per column | won back: probe | at the labelled lr | probe / labelled | at the paper's lr | "
             "probe vs the source (margin 0.5) |", "|---|---|---|---|---|---|---|"]
    for name, cells in sorted(auto.items()):
        objective = name.split("@")[0]
        if not _complete(cells, cols, seeds) or labelled.get(objective) is None:
            continue
        at = {lr: report.get(f"{objective}@{lr_name(lr)}", {}) for lr in (labelled[objective], PAPER_LR)}
        shares = {lr: share(c, src, cols) if _complete(c, cols, seeds) else None for lr, c in at.items()}
        mine, lab = share(cells, src, cols), shares[labelled[objective]]
        chosen = ", ".join(f"{abbreviation(c[0])} {c[1]}: {lr_name(cells[c][seeds[0]]['lr_search']['chosen'])}" for c in cols)
        lines.append(f"| {objective} | {chosen} | {figure(mine, percent=True)} | {lr_name(labelled[objective])}: "
                     f"{figure(lab, percent=True)} | {figure(mine / lab if lab else None, percent=True)} | "
                     f"{figure(shares[PAPER_LR], percent=True)} | {verdict(cells, src, cols).verdict} |")
    return lines


def _cheaper_order(name: str) -> tuple:
    """The cheaper table's order: the transforms alone, then each method on every batch, with each transform, and at
    falling budgets."""
    from hf_tta.benchmarks.grid import SCORE_TRANSFORMS, row_spec

    spec = row_spec(name)
    return (spec.objective not in SCORE_TRANSFORMS, spec.objective, spec.budget is not None, -(spec.budget or 1.0),
            spec.score_transform or "")


def _cost(cells: dict, runs: dict, cols: list[tuple], seeds: tuple[int, ...]) -> tuple[str, str]:
    """``(forward, backward passes per query; seconds per query and their ratio to the source row of the same run)``
    over the columns and seeds (query-weighted), ``–`` where a row predates the cost columns."""
    picked = [cells[c][s] for c in cols for s in seeds]
    if any(r.get("forward_per_query") is None or r.get("stream_seconds") is None for r in picked):
        return "–", "–"
    queries = sum(r["num_queries"] for r in picked)
    forward = sum(r["forward_per_query"] * r["num_queries"] for r in picked) / queries
    backward = sum(r["backward_per_query"] * r["num_queries"] for r in picked) / queries
    seconds = sum(r["stream_seconds"] for r in picked)
    own = [runs.get((r["config"], column(r), r["seed"])) for r in picked]
    ratio = None
    if all(o is not None and o.get("stream_seconds") for o in own):
        ratio = seconds / sum(o["stream_seconds"] for o in own)
    return (f"{figure(forward, 2)}, {figure(backward, 2)}",
            f"{figure(seconds / queries * 1000, 2)} ms ({figure(ratio, 2)}×)" if ratio is not None else f"{figure(seconds / queries * 1000, 2)} ms")


def cheaper_lines(rows: list[dict], direction: str, seeds: tuple[int, ...] = (3, 4, 5)) -> list[str]:
    """Phase ``cheaper`` (issue 39): per row, the share won back over the report split's corruption columns, the
    worst column (or stream) against the source with its one-sided bound and :func:`verdict`, the passes per query
    through the query tower (forward, backward) and the seconds per query with their ratio to the source row of the
    same run (``stream_seconds``: each run times its source beside its row). Rows complete on every seed only."""
    from hf_tta.benchmarks.report import abbreviation

    src, cells_by = _report(rows, direction, seeds, phase="cheaper")
    phase_rows = [r for r in rows if r["direction"] == direction and r["phase"] == "cheaper" and r["seed"] in seeds]
    runs = {(r["config"], column(r), r["seed"]): r for r in phase_rows if r["objective"] == SOURCE}
    cols = [c for c in corruption_columns(src) if all(s in src[c] for s in seeds)]
    lines = ["| row | won back | worst column vs the source: Δ R@1, verdict (one-sided 95 % bound, margin 0.5) | "
             "passes per query (forward, backward) | seconds per query (× the source's, same run) |", "|---|---|---|---|---|"]
    if not cols:
        return lines
    own = [r for r in runs.values() if column(r) in cols]  # the source rows of every run: their mean time
    passes = _cost(src, runs, cols, seeds)[0]
    seconds = sum(r.get("stream_seconds") or 0.0 for r in own) / sum(r["num_queries"] for r in own) * 1000
    lines.append(f"| source | – | – | {passes} | {figure(seconds, 2)} ms (1×, mean of {len({r['config'] for r in own})} runs) |")
    for name, cells in sorted(cells_by.items(), key=lambda kv: _cheaper_order(kv[0].split("@")[0])):
        if not _complete(cells, cols, seeds):
            continue
        streams = [c for c in cells if c not in cols and c in src and _complete(cells, [c], seeds)]
        checks = {c: verdict(cells, src, [c]) for c in [*cols, *streams]}
        (col, ni) = min(checks.items(), key=lambda kv: kv[1].lower)
        passes, seconds = _cost(cells, runs, cols, seeds)
        lines.append(f"| {name} | {figure(share(cells, src, cols), percent=True)} | {abbreviation(col[0])} {col[1] or ''}: "
                     f"{figure(ni.delta, sign=True)}, {ni.verdict} | {passes} | {seconds} |")
    return lines


#: The summary's parts, in order: ``(name, title, lines)``; the results card prints each under its topic
#: (``<!-- v3: rows.jsonl i2t report -->``), the command line prints them all. A part without rows is left out.
PARTS = (
    ("selection", "Selection split ({d}): share of lost recall won back per lr, seed 0, 500-concept slice", selection_lines),
    ("proxies", "Label-free proxies against the true share across the lr grid ({d}, selection split)",
     lambda rows, d: proxy_lines(rows, d) if proxy_study(rows, d) else []),
    ("preset", "Preset candidates ({d}, selection split)", _preset_lines),
    ("auto", "The label-free lr probe against the labelled choice ({d}, selection split, seed 0)", auto_lines),
    ("autoreport", "The label-free lr probe on the report split ({d}, default grid, seed 3)", auto_report_lines),
    ("report", "Report split ({d}), default grid, seeds 3, 4, 5, all queries, prequential", report_lines),
    ("streams", "Report split ({d}): streams, seeds 3, 4, 5", stream_lines),
    ("seed3", "Report split ({d}): every objective at the paper's lr and at its selected lr, seed 3",
     lambda rows, d: report_lines(rows, d, seeds=(3,))),
    ("after", "The papers' after-update scoring next to the prequential rows ({d}, report split, seed 3)", after_lines),
    ("cheaper", "Cheaper alternatives ({d}, report split, seeds 3, 4, 5, prequential): training-free score transforms "
     "and update budgets", cheaper_lines),
)


def summarise(out, direction: str = "i2t", part: str | None = None) -> str:
    """The tables of :data:`PARTS` (``part``: one of them) for the rows under ``out`` in ``direction``."""
    names = [name for name, _, _ in PARTS]
    if part is not None and part not in names:
        raise ValueError(f"part {part!r}: one of {', '.join(names)}")
    rows = load(out, direction)
    blocks = []
    for name, title, lines_of in PARTS:
        if part not in (None, name):
            continue
        phase = {"after": "after", "autoreport": "auto", "cheaper": "cheaper"}.get(name, "report")
        has_rows = name in ("selection", "proxies", "preset", "auto") or any(r["phase"] == phase for r in rows)
        lines = lines_of(rows, direction) if has_rows else []
        if len(lines) > 2 or (name == "selection" and lines):
            blocks.append("\n".join([f"**{title.format(d=direction)}**", "", *lines]))
    return "\n\n".join(blocks)


def export(out: Path, dest: Path) -> None:
    """Every row (per-query hits included) into ``dest/rows.jsonl``."""
    dest.mkdir(parents=True, exist_ok=True)
    rows = load(out)
    with open(dest / "rows.jsonl", "w") as f:
        for r in rows:
            f.write(json.dumps(r, sort_keys=True) + "\n")
    print(f"wrote {len(rows)} rows to {dest / 'rows.jsonl'}")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("out", type=Path, nargs="+")
    parser.add_argument("--direction", choices=["i2t", "t2i"], default="i2t")
    parser.add_argument("--export", type=Path)
    parser.add_argument("--part", choices=[name for name, _, _ in PARTS], help="print one table (default: all)")
    args = parser.parse_args(argv)
    if args.export:
        export(args.out[0], args.export)
        return
    print(summarise(args.out, args.direction, args.part))


if __name__ == "__main__":
    main()
