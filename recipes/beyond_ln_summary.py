#!/usr/bin/env python
"""Tables and choices of issue 29's study (``recipes/beyond_ln.py``) from its rows alone.

    python recipes/beyond_ln_summary.py runs/beyond-ln                      # print the tables
    python recipes/beyond_ln_summary.py runs/beyond-ln --export model_cards/results/beyond-ln
    python recipes/beyond_ln_summary.py model_cards/results/beyond-ln/rows.jsonl   # the card's tables

``--export`` writes ``rows.jsonl`` (every run's row with per-query hits, tagged with its phase and config) and
``results.json`` (the tables' figures and the choices), from which the card's figures are recomputed.

Figures: R@1 (%) per column, mean over seeds; **won back** = the share of lost recall won back, ratio of sums over the
columns and seeds, sum(R@1 - source) / sum(clean - source); **worst** = the lowest column difference to the source
(mean over seeds); for the report, the difference to TCR on the LayerNorms with its 95 % interval (paired bootstrap,
items resampled jointly across columns and seeds resampled: :func:`hf_tta.benchmarks.intervals.paired_bootstrap`).
"""

from __future__ import annotations

import argparse
import json
import subprocess
from collections import defaultdict
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]

MAX_DROP = 1.0  # the candidates' rule: no selection column more than this many R@1 points below the source
STREAMS = ("clean", "diverse", "switch", "noto", "degenerate")


def load(out: Path | list[Path], direction: str | None = None) -> list[dict]:
    """Every finished run's row under ``out/<phase>/<config>/<part>/rows.jsonl``, tagged with phase and config; or the
    rows of an exported ``rows.jsonl`` (already tagged); several of these together for a list (a later round's runs
    next to the exported rows of the earlier ones). ``direction``: only that study's rows (``i2t`` / ``t2i``)."""
    if direction is not None:
        return [r for r in load(out) if r["direction"] == direction]
    if isinstance(out, (list, tuple)):
        return _deduplicated([row for o in out for row in load(o)])
    out = Path(out)
    if out.is_file():
        return [json.loads(line) for line in out.read_text().splitlines() if line.strip()]
    rows = []
    for path in sorted(out.glob("*/*/*/rows.jsonl")):
        phase, config = path.parts[-4], path.parts[-3]
        for line in path.read_text().splitlines()[1:]:
            row = json.loads(line)
            if "error" not in row:
                rows.append({**row, "phase": phase, "config": config})
    return rows


def _deduplicated(rows: list[dict]) -> list[dict]:
    """One row per run (phase, config, objective, stream, seed): a run that two sources hold (a rerun next to the
    exported rows) must have the same per-query hits, else the sources are refused."""
    seen: dict[tuple, dict] = {}
    for r in rows:
        key = (r["direction"], r["phase"], r["config"], r["objective"], _column(r), r["seed"])
        if key in seen and seen[key]["hits"] != r["hits"]:
            raise ValueError(f"two rows of {key} differ in their hits: a rerun must reproduce the exported run.")
        seen.setdefault(key, r)
    return list(seen.values())


def _column(row: dict) -> tuple:
    return (row["shift"], row.get("severity"))


def _label(row: dict) -> str:
    return row["config"] if row["phase"] == "ceilings" else f"{row['config']}:{row['objective']}"


def _by(rows: list[dict], phase: str):
    """``(sources, labels)``: source rows by (column, seed) and the other rows by label -> (column, seed)."""
    sources: dict = {}
    labels: dict = defaultdict(dict)
    for r in rows:
        if r["phase"] != phase:
            continue
        key = (_column(r), r["seed"])
        if r["objective"] == "source":
            if key in sources and sources[key]["hits"] != r["hits"]:
                raise ValueError(f"two source rows of {key} differ: the runs of one phase must share their streams.")
            sources[key] = r
        else:
            labels[_label(r)][key] = r
    return sources, labels


def score(rows_by_key: dict, sources: dict, columns: list[tuple]) -> dict:
    """R@1 per column (mean over seeds), the won-back share over ``columns`` and seeds, and the worst column."""
    keys = [k for k in rows_by_key if k[0] in columns]
    if not keys or any((k[0], k[1]) not in sources for k in keys):
        return {}
    clean = {seed: sources[(("clean", None), seed)]["R@1"] for _, seed in keys if (("clean", None), seed) in sources}
    gained = sum(rows_by_key[k]["R@1"] - sources[k]["R@1"] for k in keys)
    lost = sum(clean[k[1]] - sources[k]["R@1"] for k in keys)
    per_col = defaultdict(list)
    for k in keys:
        per_col[k[0]].append(rows_by_key[k]["R@1"] - sources[k]["R@1"])
    deltas = {c: float(np.mean(v)) for c, v in per_col.items()}
    r1 = defaultdict(list)
    for k in keys:
        r1[k[0]].append(rows_by_key[k]["R@1"])
    return {
        "R@1": {_name(c): round(float(np.mean(v)), 2) for c, v in r1.items()},
        "won_back": round(100.0 * gained / lost, 2) if lost > 0 else None,
        "worst": round(min(deltas.values()), 2),
        "worst_column": _name(min(deltas, key=deltas.get)),
        "runs": len(keys),
        "complete": len(keys) == len(columns) * len({s for _, s in keys}),
        "safety": _safety(rows_by_key[k] for k in keys),
    }


def _safety(rows) -> dict:
    total: dict = defaultdict(int)
    for r in rows:
        for k, v in (r.get("safety") or {}).items():
            total[k] += v
    return dict(total)


def _name(column: tuple) -> str:
    shift, severity = column
    return shift if severity is None else f"{shift} {severity}"


def corruption_columns(sources: dict) -> list[tuple]:
    return sorted({c for c, _ in sources if c[0] not in STREAMS}, key=lambda c: (c[1] or 0, c[0]))


def choose_lrs(rows: list[dict]) -> dict[str, dict]:
    """Each parameter set's learning rate: the highest won-back share on the selection split (ceilings phase)."""
    sources, labels = _by(rows, "ceilings")
    columns = corruption_columns(sources)
    best: dict[str, dict] = {}
    for label, runs in labels.items():
        name, lr = label.rsplit("-lr", 1)
        s = score(runs, sources, columns)
        if s and s["complete"] and (name not in best or s["won_back"] > best[name]["won_back"]):
            best[name] = {"lr": lr, **s}
    return best


def choose_candidate(rows: list[dict]) -> tuple[str | None, dict[str, dict]]:
    """The label-free row with the highest won-back share among those with no selection column more than
    :data:`MAX_DROP` below the source (candidates phase); every scored row is returned.

    Once any candidate's streams ran (round 3), the walk goes down the eligible rows by share and takes the first
    whose streams are none more than :data:`MAX_DROP` below the source; a row whose streams did not run stops it
    (``None``: run them)."""
    sources, labels = _by(rows, "candidates")
    columns = corruption_columns(sources)
    scored = {label: score(runs, sources, columns) for label, runs in labels.items()}
    scored = {k: v for k, v in scored.items() if v and v["complete"]}
    eligible = sorted((k for k, v in scored.items() if v["worst"] >= -MAX_DROP), key=lambda k: -scored[k]["won_back"])
    deltas = stream_deltas(rows, "candidates")
    if not deltas:
        return (eligible[0] if eligible else None), scored
    for label in eligible:
        if label not in deltas:
            return None, scored
        if min(deltas[label].values()) >= -MAX_DROP:
            return label, scored
    return None, scored


def stream_deltas(rows: list[dict], phase: str) -> dict[str, dict[str, float]]:
    """Per label, each stream's R@1 difference to the source (mean over seeds) in ``phase``."""
    sources, labels = _by(rows, phase)
    out: dict[str, dict[str, float]] = {}
    for label, runs in labels.items():
        for shift in STREAMS:
            keys = [k for k in runs if k[0][0] == shift and k in sources]
            if keys:
                out.setdefault(label, {})[shift] = float(np.mean([runs[k]["R@1"] - sources[k]["R@1"] for k in keys]))
    return out


def versus(rows: list[dict], label: str, reference: str, phase: str = "report", columns: list | None = None) -> dict | None:
    """``label`` minus ``reference`` over ``columns`` (default: the phase's corruption columns): mean R@1 difference
    and its interval."""
    from hf_tta.benchmarks.intervals import paired_bootstrap

    sources, labels = _by(rows, phase)
    columns = corruption_columns(sources) if columns is None else columns
    a, b = labels.get(label, {}), labels.get(reference, {})
    diffs = []
    for column in columns:
        seeds = sorted(s for c, s in a if c == column and (c, s) in b)
        if not seeds:
            return None
        hits = [[np.frombuffer(x[(column, s)]["hits"].encode(), dtype=np.uint8) - 48 for s in seeds] for x in (a, b)]
        diffs.append(np.asarray(hits[0], dtype=np.float64) - np.asarray(hits[1], dtype=np.float64))
    mean, ci = paired_bootstrap(diffs)
    return {"delta": mean, "ci": ci}


def _hits(row: dict) -> np.ndarray:
    return np.frombuffer(row["hits"].encode(), dtype=np.uint8).astype(np.float64) - 48


#: TCR on the LayerNorms at its paper's lr, and at the lr controls' (image tower 3e-3, text tower 1e-3)
REFERENCES = ("tcr-ln:tcr", "tcr-ln-lr3e-3:tcr", "tcr-ln-lr1e-3:tcr")


def report_lines(rows: list[dict], references: tuple[str, ...] = REFERENCES) -> list[str]:
    """Per label of the report: won back at each severity, the difference to each of ``references`` that ran over the
    corruption columns both ran (95 % interval, items joint across columns, seeds resampled), and the worst column
    against the source with its interval (``below`` only when the whole interval is below zero, else the detection
    limit)."""
    from hf_tta.benchmarks.intervals import below_source_claim, paired_bootstrap

    sources, labels = _by(rows, "report")
    columns = corruption_columns(sources)
    lines = []
    for label in sorted(labels):
        runs = labels[label]
        by_severity = []
        for severity in sorted({c[1] for c in columns}):
            s = score(runs, sources, [c for c in columns if c[1] == severity])
            if s:
                by_severity.append(f"severity {severity} {s['won_back']:.1f} %")
        against = []
        for reference in references:
            shared = [c for c in columns if any(k[0] == c for k in runs) and any(k[0] == c for k in labels.get(reference, {}))]
            vs = versus(rows, label, reference, columns=shared) if label != reference and shared else None
            if vs is not None:
                against.append(f"against {reference} {vs['delta']:+.1f} R@1 [{vs['ci'][0]:+.1f}, {vs['ci'][1]:+.1f}] "
                               f"over {len(shared)} columns")
        worst = score(runs, sources, columns)
        column = next(c for c in columns if _name(c) == worst["worst_column"])
        seeds = sorted(k[1] for k in runs if k[0] == column)
        delta, ci = paired_bootstrap([np.stack([_hits(runs[(column, s)]) - _hits(sources[(column, s)]) for s in seeds])])
        text = f"- {label}: won back {', '.join(by_severity)}"
        text += "".join(f"; {a}" for a in against)
        text += f"; worst column {worst['worst_column']} {delta:+.1f} [{ci[0]:+.1f}, {ci[1]:+.1f}]: {below_source_claim(delta, ci)}"
        lines.append(text)
    return lines


def _table(title: str, scored: dict[str, dict], columns: list[str]) -> str:
    lines = [f"**{title}**", "", "| row | " + " | ".join(columns) + " | won back | worst Δ | safety |",
             "|---|" + "---|" * (len(columns) + 3)]
    for label, s in sorted(scored.items(), key=lambda kv: -(kv[1]["won_back"] or 0)):
        cells = " | ".join(f"{s['R@1'].get(c, float('nan')):.1f}" for c in columns)
        safety = "/".join(str(s["safety"].get(k, 0)) for k in ("skip_degenerate", "rollback", "reset")) if s["safety"] else "–"
        lines.append(f"| {label} | {cells} | {s['won_back']:.1f} % | {s['worst']:+.1f} ({s['worst_column']}) | {safety} |")
    return "\n".join(lines)


def summarise(out: Path | list[Path], direction: str = "i2t") -> str:
    rows = load(out, direction)
    parts = []
    for phase in ("ceilings", "candidates", "report"):
        sources, labels = _by(rows, phase)
        if not labels:
            continue
        columns = corruption_columns(sources)
        scored = {label: score(runs, sources, columns) for label, runs in labels.items()}
        scored = {k: v for k, v in scored.items() if v}
        names = [_name(c) for c in columns]
        source_row = {"R@1": {_name(c): float(np.mean([r["R@1"] for (cc, _), r in sources.items() if cc == c])) for c in columns},
                      "won_back": 0.0, "worst": 0.0, "worst_column": "–", "safety": {}}
        parts.append(_table(f"{phase} ({len({s for _, s in sources})} seed(s))", {"source": source_row, **scored}, names))
        if phase == "report":
            parts.append("\n".join(report_lines(rows)))
        if stream_deltas(rows, phase):
            parts.append(_streams_table(rows, phase))
    if any(r["phase"] == "ceilings" for r in rows):
        parts.append("Chosen learning rates: " + ", ".join(f"{k} {v['lr']} ({v['won_back']:.1f} %)" for k, v in choose_lrs(rows).items()))
    if any(r["phase"] == "candidates" for r in rows):
        chosen, _ = choose_candidate(rows)
        rule = f"highest won back with no column below the source by more than {MAX_DROP}"
        if stream_deltas(rows, "candidates"):
            rule += ", nor any of its seed-0 streams"
        parts.append(f"Chosen candidate (rule: {rule}): {chosen}")
    return "\n\n".join(parts)


def _streams_table(rows: list[dict], phase: str = "report") -> str:
    """The phase's extra streams (clean, degenerate, ...): R@1 per seed-mean, the difference to the source with its
    95 % interval (items and seeds resampled) and whether it is below the source (else the detection limit)."""
    from hf_tta.benchmarks.intervals import below_source_claim, paired_bootstrap

    sources, labels = _by(rows, phase)
    lines = ["| row | stream | R@1 | Δ vs source [95 % CI] | below the source? | safety |", "|---|---|---|---|---|---|"]
    for label in sorted(labels):
        for shift in STREAMS:
            keys = sorted(k for k in labels[label] if k[0][0] == shift and k in sources)
            if not keys:
                continue
            r1 = float(np.mean([labels[label][k]["R@1"] for k in keys]))
            delta, ci = paired_bootstrap([np.stack([_hits(labels[label][k]) - _hits(sources[k]) for k in keys])])
            safety = _safety(labels[label][k] for k in keys)
            counts = "/".join(str(safety.get(k, 0)) for k in ("skip_degenerate", "rollback", "reset")) if safety else "–"
            lines.append(f"| {label} | {shift} | {r1:.1f} | {delta:+.1f} [{ci[0]:+.1f}, {ci[1]:+.1f}] | "
                         f"{below_source_claim(delta, ci)} | {counts} |")
    return "\n".join(lines)


def export(out: Path | list[Path], dest: Path) -> None:
    rows = load(out)  # every direction; results.json per direction
    dest.mkdir(parents=True, exist_ok=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=REPO).stdout.strip()
    with open(dest / "rows.jsonl", "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    results: dict = {"exported_at_commit": commit}
    for direction in sorted({r["direction"] for r in rows}):  # i2t at the top level, another direction under its name
        study = [r for r in rows if r["direction"] == direction]
        part = results if direction == "i2t" else results.setdefault(direction, {})
        part["phases"] = {}
        for phase in ("ceilings", "candidates", "report"):
            sources, labels = _by(study, phase)
            columns = corruption_columns(sources)
            part["phases"][phase] = {label: score(runs, sources, columns) for label, runs in labels.items()}
        part["chosen_lrs"] = {k: v["lr"] for k, v in choose_lrs(study).items()}
        part["chosen_candidate"] = choose_candidate(study)[0]
    (dest / "results.json").write_text(json.dumps(results, indent=1) + "\n")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("out", type=Path, nargs="+", help="run folders and/or exported rows.jsonl files")
    parser.add_argument("--export", type=Path)
    parser.add_argument("--direction", default="i2t", help="which study to print: i2t (image tower) or t2i (text tower)")
    args = parser.parse_args(argv)
    if args.export:
        export(args.out, args.export)
    print(summarise(args.out, args.direction))


if __name__ == "__main__":
    main()
