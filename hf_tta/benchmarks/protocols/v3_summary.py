#!/usr/bin/env python
"""Choices and tables of protocol v3 (:mod:`hf_tta.benchmarks.protocols.v3`) from its rows alone.

    python -m hf_tta.benchmarks.protocols.v3_summary /work/runs/v3 --direction i2t            # print the tables
    python -m hf_tta.benchmarks.protocols.v3_summary /work/runs/v3 --export model_cards/results/protocol-v3
    python -m hf_tta.benchmarks.protocols.v3_summary model_cards/results/protocol-v3/rows.jsonl   # the card's tables

Every figure is computed from per-query hits and printed through :func:`hf_tta.benchmarks.figures.figure` (one
rounding); every "not below the source" is :func:`hf_tta.benchmarks.intervals.non_inferiority` (one-sided 95 %
lower bound above −0.5 R@1, items and seeds resampled jointly).

**The choice rules, written before the selection runs were read** (selection split only, :mod:`hf_tta.benchmarks.protocols.v3_splits`):

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
from collections import defaultdict
from pathlib import Path

import numpy as np

from hf_tta.benchmarks.figures import figure

from .v3_costs import cheaper_lines
from .v3_report import after_lines, corruption_lines, report_lines, stream_lines  # noqa: F401
from .v3_rows import (
    CEILINGS,
    LR_BEYOND,
    LR_GRID,
    PAPER_LR,
    SOURCE,
    by_label,
    column,
    complete,
    export,
    held_columns,
    label,
    load,
    lr_name,
    report_cells,
    selection_columns,
    share,
    sources,
    spearman,
    verdict,
)

DEGENERATE_WALK = 2
PRESET_TIE = 0.01


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


def _selector_runs(rows: list[dict], direction: str) -> tuple[list[dict], dict[str, dict[tuple, dict]], dict]:
    """The selection split's rows (seed 0), the selectors' runs on it by label and column, and the source rows."""
    sel = [r for r in rows if r["direction"] == direction and r["seed"] == 0]
    auto: dict[str, dict[tuple, dict]] = defaultdict(dict)
    for r in sel:
        if r["phase"] == "auto" and r["objective"] != SOURCE and r.get("lr_search"):
            auto[label(r)][column(r)] = r
    return sel, auto, {c: {0: by_seed[0]} for c, by_seed in sources(sel).items() if 0 in by_seed}


def chosen_selectors(rows: list[dict], direction: str) -> dict[str, str]:
    """Issue 37's choice of one selector per objective, from the selection split alone: among the selectors whose
    clean and degenerate streams are not below the source, the highest share (ties: the name first in order); an
    objective none of whose selectors passes both streams gets none (the selectors' answer to "never below the source"
    is the safety rule, not the share). ``{objective: selector}``; the ``auto`` phase reports these on every report
    seed and stream."""
    _, auto, src = _selector_runs(rows, direction)
    cols, streams = selection_columns(direction), [("clean", None), ("degenerate", None)]
    best: dict[str, tuple[float, str]] = {}
    for name, runs in sorted(auto.items()):
        objective, chosen = name.split("@")
        if any(c not in runs for c in [*cols, *streams]) or any(verdict({c: {0: runs[c]}}, src, [c]).below for c in streams):
            continue
        mine = share({c: {0: runs[c]} for c in cols}, src, cols)
        if objective not in best or mine > best[objective][0]:
            best[objective] = (mine, chosen)
    return {objective: chosen for objective, (_, chosen) in best.items()}


def auto_lines(rows: list[dict], direction: str) -> list[str]:
    """Issue 37's label-free lr probe (phase ``auto``, seed 0, the selection split) against the labelled choice.

    Per objective and selector: the labelled lr and its share; the selector's run: the lr in use at the end of each
    stream (the probe's choice; the online rule's last), its share and that share over the labelled one, its clean
    and degenerate verdicts; for every proxy the share the
    fixed-lr selection rows give at the lrs that proxy would have chosen per stream, over the labelled share (an
    estimate: those rows adapt at that lr from the first batch, without the probe); and the run's passes of the query
    tower against a fixed-lr run of the same stream, ``(n − probed) · (2S + 1) + probe passes`` over ``n · (2S + 1)``
    (``S`` steps per batch, one answering forward each batch, prequential)."""
    from hf_tta.benchmarks.report import abbreviation

    sel, auto, src = _selector_runs(rows, direction)
    if not auto:
        return []
    table, labelled = selection_table(rows, direction), choices(rows, direction)
    fixed = {name: {c: by_seed[0] for c, by_seed in cells.items() if 0 in by_seed}
             for name, cells in by_label(sel, ("select", "extend", "degenerate")).items()}
    cols = selection_columns(direction)
    proxies = sorted({p for runs in auto.values() for r in runs.values() for p in r["lr_search"]["choices"]})
    lines = [f"| selector | labelled lr (share) | lr per stream, at the end | share (of labelled) | clean, degenerate | "
             f"{' | '.join(f'{p}: share (of labelled)' for p in proxies)} | passes vs fixed lr |",
             "|---|" + "---|" * (len(proxies) + 5)]
    for name, runs in sorted(auto.items()):
        objective = name.split("@")[0]
        lab_lr = labelled.get(objective, {}).get("lr")
        lab = table.get(objective, {}).get(lab_lr, {}).get("share") if lab_lr else None
        of = lambda x: f"{figure(x, percent=True)} ({figure(x / lab, percent=True) if x is not None and lab else '–'})"  # noqa: E731
        done = all(c in runs for c in cols)
        run_share = share({c: {0: runs[c]} for c in cols}, src, cols) if done else None
        chosen = ", ".join(f"{abbreviation(c[0])}: {lr_name(runs[c]['lr_search']['lr'])}" for c in [*cols, ("clean", None), ("degenerate", None)] if c in runs)
        verdicts = ", ".join(verdict({c: {0: runs[c]}}, src, [c]).verdict if c in runs else "not run" for c in (("clean", None), ("degenerate", None)))
        per_proxy = [of(_share_at(fixed, objective, {c: runs[c]["lr_search"]["choices"].get(p) for c in cols}, src, cols)) if done else "–"
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
    chose per column, and its verdict against the source. Each selector on the report's columns its runs hold on every
    seed of ``seeds`` (counted; the report may have gained columns since), the labelled rows on the same ones; its
    passes per query against a fixed-lr run's ``1 + S`` forwards and ``S`` backwards (``S`` steps per batch; with the
    safety layer a fixed-lr run also makes one more forward)."""
    from hf_tta.benchmarks.report import abbreviation

    from .v3_costs import passes  # noqa: PLC0415

    _, auto = report_cells(rows, direction, seeds, phase="auto")
    src, report = report_cells(rows, direction, seeds)  # the report's source rows (the probe's runs hold the same ones)
    labelled = {n: c["lr"] for n, c in choices(rows, direction).items()}
    lines = ["| selector | columns | lr per column at the end (first seed) | won back | at the labelled lr | of the labelled | "
             "at the paper's lr | vs the source (margin 0.5) | passes per query (× a fixed lr's) |", "|---|---|---|---|---|---|---|---|---|"]
    for name, cells in sorted(auto.items()):
        objective = name.split("@")[0]
        cols = held_columns(src, cells, seeds)
        if not cols or labelled.get(objective) is None:
            continue
        at = {lr: report.get(f"{objective}@{lr_name(lr)}", {}) for lr in (labelled[objective], PAPER_LR)}
        shares = {lr: share(c, src, cols) if complete(c, cols, seeds) else None for lr, c in at.items()}
        mine, lab = share(cells, src, cols), shares[labelled[objective]]
        chosen = ", ".join(f"{abbreviation(c[0])} {c[1]}: {lr_name(cells[c][seeds[0]]['lr_search']['lr'])}" for c in cols)
        counted, steps = passes(cells, cols, seeds), cells[cols[0]][seeds[0]].get("steps")
        cost = "–" if counted is None or not steps else (f"{figure(counted[0], 2)}, {figure(counted[1], 2)} "
                                                         f"({figure(sum(counted) / (2 * steps + 1), 2)}×)")
        lines.append(f"| {name} | {len(cols)} | {chosen} | {figure(mine, percent=True)} | {lr_name(labelled[objective])}: "
                     f"{figure(lab, percent=True)} | {figure(mine / lab if lab else None, percent=True)} | "
                     f"{figure(shares[PAPER_LR], percent=True)} | {verdict(cells, src, cols).verdict} | {cost} |")
    return lines


#: The summary's parts, in order: ``(name, title, lines)``; the results card prints each under its topic
#: (``<!-- v3: rows.jsonl i2t report -->``), the command line prints them all. A part without rows is left out.
PARTS = (
    ("selection", "Selection split ({d}): share of lost recall won back per lr, seed 0, 500-concept slice", selection_lines),
    ("proxies", "Label-free proxies against the true share across the lr grid ({d}, selection split)",
     lambda rows, d: proxy_lines(rows, d) if proxy_study(rows, d) else []),
    ("preset", "Preset candidates ({d}, selection split)", _preset_lines),
    ("auto", "Label-free lr selectors against the labelled choice ({d}, selection split, seed 0)", auto_lines),
    ("autoreport", "Label-free lr selectors on the report split ({d}, default grid, seed 3)", auto_report_lines),
    ("autochosen", "The selectors chosen on the selection split, on the report split ({d}, default grid, seeds 3, 4, 5)",
     lambda rows, d: auto_report_lines(rows, d, seeds=(3, 4, 5))),
    ("autostreams", "The selectors chosen on the selection split, on the report split's streams ({d}, seeds 3, 4, 5)",
     lambda rows, d: stream_lines(rows, d, phase="auto")),
    ("report", "Report split ({d}), default grid, seeds 3, 4, 5, all queries, prequential", report_lines),
    ("streams", "Report split ({d}): streams, seeds 3, 4, 5", stream_lines),
    ("seed3", "Report split ({d}): every objective at the paper's lr and at its selected lr, seed 3",
     lambda rows, d: report_lines(rows, d, seeds=(3,))),
    ("corruptions", "Report split ({d}): the 15 ImageNet-C test corruptions at severities 3 and 5, seed 3", corruption_lines),
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
        phase = {"after": "after", "autoreport": "auto", "autochosen": "auto", "autostreams": "auto", "cheaper": "cheaper", "corruptions": "corruptions"}.get(name, "report")
        has_rows = name in ("selection", "proxies", "preset", "auto") or any(r["phase"] == phase for r in rows)
        lines = lines_of(rows, direction) if has_rows else []
        if len(lines) > 2 or (name == "selection" and lines):
            blocks.append("\n".join([f"**{title.format(d=direction)}**", "", *lines]))
    return "\n\n".join(blocks)


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
