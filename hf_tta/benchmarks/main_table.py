"""The main job's table: one per direction, shaped like TCR's Table 1, and its plot.

Columns: the clean reference (the source model's clean R@1, the denominator of every share), every corruption stream
of the grid (one column per corruption and severity), their average, then the other streams that ran (Noto, diverse,
switching, degenerate). Rows: the source model, each method, the supervised ceilings last. Each method row carries,
over the grid's corruption columns,

* the share of lost recall won back, a ratio of sums: ``Σ(R@1 − source) / Σ(clean − source)``;
* the mean difference to the source with its 95 % interval (:func:`.verdicts.compare`: seeds and items resampled
  jointly across columns);
* protocol v4's verdict (:func:`.verdicts.compare`, the same rule, resamples and RNG seed as the protocol's tables):
  *not below* when the one-sided 95 % lower bound of the difference is above −0.5 R@1, *harm* when the whole interval
  is below 0 and the bound at or below −0.5, *inconclusive* otherwise, printed with its bound (and "unstable" when an
  RNG seed would change it);

and, for every other stream, its own difference, interval and verdict. Nothing is rounded here: every figure is
printed through :func:`.figures.figure` / :func:`.figures.interval`.
"""

from __future__ import annotations

import textwrap
from typing import Any, Sequence

import numpy as np

from .figures import figure, interval
from .grid import AV_DIRECTIONS, ORACLE_ROWS, OTHER_SHIFTS, SOURCE
from .report import MIN_LOST_RECALL, SAFETY_COLUMNS, abbreviation, canonical_order, clean_reference, row_label
from .verdicts import MARGIN, Comparison
from .verdicts import compare as compare_to_source

#: How each scoring rule is named in the table's title.
SCORING_WORDS = {
    "before_update": "scored prequentially (each batch answered before the model adapts on it)",
    "after_update": "scored after each batch's update (the papers' protocol)",
}
DIRECTION_WORDS = {"i2t": "Image→text retrieval (image queries)", "t2i": "Text→image retrieval (caption queries)"}
CEILINGS_NOTE = ("† supervised ceilings (trained on the true captions with the methods' stream, batches, steps and optimiser), "
                 "not methods: they bound what a label-free objective on those parameters could reach.")


def _hits(row: dict) -> np.ndarray | None:
    h = row.get("hits")
    return None if not h else np.frombuffer(h.encode("ascii"), dtype=np.uint8).astype(np.int8) - ord("0")


def _column_label(shift: str, severity: int | None) -> str:
    return abbreviation(shift) if severity is None else f"{abbreviation(shift)} {severity}"


def _direction_words(direction: str) -> str:
    if direction in AV_DIRECTIONS:
        q, g = AV_DIRECTIONS[direction]
        return f"{q.capitalize()}→{g} retrieval ({q} queries)"
    return DIRECTION_WORDS.get(direction, direction)


def _comparison(method_runs: list[dict], source_runs: list[dict], direction: str) -> dict | None:
    """Per-seed paired differences of one column, ``(seeds, queries)``, or ``None`` without hits for every seed."""
    src = {r.get("seed", 0): _hits(r) for r in source_runs}
    pairs = [(_hits(r), src.get(r.get("seed", 0))) for r in sorted(method_runs, key=lambda r: r.get("seed", 0))]
    if not pairs or any(h is None or s is None or len(h) != len(s) for h, s in pairs):
        return None
    return {"diffs": np.stack([h - s for h, s in pairs]), "items": (direction, len(pairs[0][0]))}


def _versus_source(columns: list[dict]) -> dict | None:
    """Mean difference, 95 % interval and protocol v4's verdict over ``columns`` (outputs of :func:`_comparison`)."""
    if not columns or any(c is None for c in columns):
        return None
    c = compare_to_source([col["diffs"] for col in columns])
    return {"delta": c.delta, "ci": list(c.ci), "lower": c.lower, "margin": MARGIN, "below": c.lower <= -MARGIN,
            "word": c.verdict, "verdict": _verdict_words(c)}


def _verdict_words(c: Comparison) -> str:
    """``not below (bound +0.4 > −0.5)``, ``harm (bound −1.6 ≤ −0.5)``, ``inconclusive (bound −1.2 ≤ −0.5)``."""
    sign = ">" if c.lower > -MARGIN else "≤"
    return f"{c.words()} (bound {figure(c.lower, sign=True)} {sign} −{figure(MARGIN)})"


def main_tables(rows: Sequence[dict], metric: str = "R@1", scoring: str | None = None) -> list[dict[str, Any]]:
    """One table per direction (see the module docstring); ``scoring`` names the rows' scoring rule in the title.

    Each table: ``direction``, ``title``, ``clean`` (the source's clean R@1, mean over seeds), ``columns`` (dicts of
    ``shift``, ``severity``, ``label``, ``grid``: a corruption column of the aggregate), ``seeds`` and ``rows``: per
    row ``objective``, ``label``, ``values`` (mean over seeds per column; ``None`` with ``status`` missing/error),
    ``avg`` (over the grid), and for methods ``won_back``, ``grid`` (:func:`_versus_source` over the grid columns),
    ``streams`` (label → the same per other stream) and ``safety`` (the safety layer's actions, summed)."""
    clean_of = clean_reference(rows, metric)
    order = canonical_order()
    by_direction: dict[str, list[dict]] = {}
    for r in sorted(rows, key=order):
        by_direction.setdefault(r["direction"], []).append(r)
    tables = []
    for direction, drows in by_direction.items():
        cells: dict[tuple, list[dict]] = {}
        for r in drows:
            cells.setdefault((r["objective"], r["shift"], r.get("severity")), []).append(r)
        keys = list(dict.fromkeys((r["shift"], r.get("severity")) for r in drows))
        grid = [k for k in keys if k[0] not in OTHER_SHIFTS]  # the library's order (TCR's: by family) ...
        if len({s for s, _ in grid}) < len(grid):  # ... in one block per severity where a corruption has several
            grid.sort(key=lambda k: k[1] or 0)
        others = [(s, None) for s in OTHER_SHIFTS if (s, None) in keys]
        columns = [{"shift": s, "severity": sev, "label": _column_label(s, sev), "grid": (s, sev) in grid}
                   for s, sev in ([("clean", None)] if ("clean", None) in others else []) + grid + [k for k in others if k[0] != "clean"]]
        run_order = [r["objective"] for r in rows if r["direction"] == direction]  # the grid's order of rows
        objectives = sorted(dict.fromkeys(run_order), key=lambda o: (o != SOURCE, o in ORACLE_ROWS))
        clean = clean_of.get(direction)
        source_values: dict[tuple, float | None] = {}
        body = []
        for obj in objectives:
            values, status = [], []
            for col in columns:
                runs = cells.get((obj, col["shift"], col["severity"]), [])
                ok = [r[metric] for r in runs if "error" not in r and metric in r]
                values.append(float(np.mean(ok)) if ok and len(ok) == len(runs) else None)
                status.append("ok" if values[-1] is not None else "missing" if not runs else "error")
            grid_values = [v for v, c in zip(values, columns) if c["grid"]]
            row = {"objective": obj, "label": row_label(obj), "values": values, "status": status,
                   "avg": float(np.mean(grid_values)) if grid_values and None not in grid_values else None}
            runs = [r for c in columns for r in cells.get((obj, c["shift"], c["severity"]), []) if "safety" in r]
            if runs:
                row["safety"] = {a: sum(int(r["safety"].get(a, 0)) for r in runs) for a in SAFETY_COLUMNS}
            if obj == SOURCE:
                source_values = {(c["shift"], c["severity"]): v for c, v in zip(columns, values)}
            else:
                _method_figures(row, columns, cells, source_values, clean, direction, metric)
            body.append(row)
        seeds = sorted({r.get("seed", 0) for r in drows})
        tables.append({"direction": direction, "title": _title(direction, columns, seeds, scoring), "clean": clean,
                       "columns": columns, "seeds": seeds, "rows": body, "metric": metric, "scoring": scoring})
    return tables


def _method_figures(row: dict, columns: list[dict], cells: dict, source_values: dict, clean: float | None,
                    direction: str, metric: str) -> None:
    """A method row's won-back share, its difference to the source over the grid and per other stream."""
    grid = [c for c in columns if c["grid"]]
    pairs = [(v, source_values.get((c["shift"], c["severity"]))) for v, c in zip(row["values"], columns) if c["grid"]]
    if grid and clean is not None and all(m is not None and s is not None for m, s in pairs):
        lost = sum(clean - s for _, s in pairs)
        row["won_back"] = sum(m - s for m, s in pairs) / lost if lost >= MIN_LOST_RECALL else None
    if metric != "R@1":
        return

    def compare(col: dict) -> dict | None:
        return _comparison(cells.get((row["objective"], col["shift"], col["severity"]), []),
                           cells.get((SOURCE, col["shift"], col["severity"]), []), direction)

    row["grid"] = _versus_source([compare(c) for c in grid]) if grid else None
    row["streams"] = {c["label"]: _versus_source([compare(c)]) for c in columns
                      if not c["grid"] and cells.get((row["objective"], c["shift"], c["severity"]))}


def _title(direction: str, columns: list[dict], seeds: list[int], scoring: str | None) -> str:
    grid = [c["label"] for c in columns if c["grid"]]
    others = [c["label"] for c in columns if not c["grid"] and c["shift"] != "clean"]
    what = f"{len(grid)} corruption stream{'s' if len(grid) != 1 else ''}" if grid else "no corruption stream"
    what += "".join(f" + {o}" for o in others)
    seed_words = f"{len(seeds)} seed{'s' if len(seeds) != 1 else ''} ({', '.join(map(str, seeds))})"
    if grid or others:
        parts = [f"{_direction_words(direction)} under query shift, R@1 (%): {what}", seed_words]
    else:
        parts = [f"{_direction_words(direction)}, R@1 (%): the clean stream", seed_words]
    if scoring in SCORING_WORDS:
        parts.append(SCORING_WORDS[scoring])
    return "; ".join(parts)


def format_main_table(table: dict[str, Any], source_label: str = "Source model") -> str:
    """The table as Markdown: a bold title, the clean reference line, the table, then what each summary column
    means, every other stream's difference to the source with its verdict, and the ceilings' note."""
    cols = table["columns"]
    grid = [c for c in cols if c["grid"]]
    split = max([i + 1 for i, c in enumerate(cols) if c["grid"] or c["shift"] == "clean"], default=0)
    with_safety = any("safety" in r for r in table["rows"])
    header = ["Method", *(c["label"] for c in cols[:split]), *(["Avg."] if grid else []), *(c["label"] for c in cols[split:])]
    if grid:
        header += ["Won back", "Δ vs source [95 % CI]", f"vs source (margin −{figure(MARGIN)})"]
    if with_safety:
        header.append("Safety skips/rollbacks/resets")
    lines = [f"**{table['title']}**", ""]
    if table["clean"] is not None:
        lines += [f"Clean reference: the source model's R@1 on the clean queries is {figure(table['clean'])}, the "
                  "denominator of every won-back share.", ""]
    numeric = len(header) - 1 - (1 if grid else 0) - (1 if with_safety else 0)  # the verdict and the counts are words
    lines += ["| " + " | ".join(header) + " |", "|---|" + "---:|" * numeric + "---|" * (len(header) - 1 - numeric)]
    for row in table["rows"]:
        name = source_label if row["objective"] == SOURCE else f"• {row['label']}"
        vals = [figure(v, missing="–" if s == "missing" else "err") for v, s in zip(row["values"], row["status"])]
        cells = [name, *vals[:split], *([figure(row["avg"])] if grid else []), *vals[split:]]
        if grid:
            g = row.get("grid")
            cells += ["–" if row["objective"] == SOURCE else figure(row.get("won_back"), percent=True),
                      "–" if not g else f"{figure(g['delta'], sign=True)} {interval(*g['ci'])}",
                      "–" if not g else g["verdict"]]
        if with_safety:
            cells.append("/".join(str(row["safety"][a]) for a in SAFETY_COLUMNS) if "safety" in row else "–")
        lines.append("| " + " | ".join(cells) + " |")
    if grid:
        lines += ["", f"Avg., won back and Δ are over the {len(grid)} corruption column{'s' if len(grid) != 1 else ''}: won back "
                  "= Σ(R@1 − source) / Σ(clean − source) (ratio of sums); Δ's 95 % interval and the one-sided 95 % bound "
                  f"resample items and seeds jointly; verdicts (protocol v4): not below = the bound is above −{figure(MARGIN)} "
                  f"R@1, harm = the whole interval is below 0 and the bound at or below −{figure(MARGIN)}, inconclusive "
                  "otherwise."]
    stream_lines = []
    for c in cols:
        parts = [f"{r['label']} {_versus(r['streams'][c['label']])}" for r in table["rows"]
                 if c["label"] in r.get("streams", {})]
        if parts:
            stream_lines.append(f"- {c['label']}: " + "; ".join(parts))
    if stream_lines:
        lines += ["", "Other streams, Δ vs source [95 % CI] and verdict:", *stream_lines]
    if any(r["objective"] in ORACLE_ROWS for r in table["rows"]):
        lines += ["", CEILINGS_NOTE]
    return "\n".join(lines)


def _versus(v: dict | None) -> str:
    if v is None:
        return "– (no per-query hits)"
    return f"{figure(v['delta'], sign=True)} {interval(*v['ci'])}, {v['verdict']}"


# ------------------------------------------------------------------------------------------------ plot
def plot_limits(table: dict[str, Any], pad: float = 0.08) -> tuple[float, float]:
    """The R@1 axis of the table's plot: around the data and the clean line (not 0–100), never below 0."""
    values = [v for r in table["rows"] for v, c in zip(r["values"], table["columns"]) if v is not None and c["shift"] != "clean"]
    values += [table["clean"]] if table["clean"] is not None else []
    if not values:
        return 0.0, 100.0
    lo, hi = min(values), max(values)
    margin = max(pad * (hi - lo), 1.0)
    return max(0.0, lo - margin), hi + margin  # above the clean line too, so that it shows


def draw_main_plot(table: dict[str, Any], path) -> str:
    """Two panels: R@1 per column for each row with the clean reference as a line (axis around the data), and each
    method's difference to the source per column (the gain). The title is wrapped, never cut."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = [c for c in table["columns"] if c["shift"] != "clean"] or table["columns"]
    index = [table["columns"].index(c) for c in cols]
    rows = table["rows"]
    source = next((r for r in rows if r["objective"] == SOURCE), None)
    width_in = min(18.0, max(7.0, 2.5 + len(cols) * (0.35 + 0.08 * len(rows))))
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(width_in, 7.5), sharex=True, height_ratios=(3, 2))
    x = np.arange(len(cols))
    width = 0.85 / max(1, len(rows))
    colours = plt.get_cmap("tab20" if len(rows) > 10 else "tab10")
    methods = [r for r in rows if r is not source]
    for k, r in enumerate(rows):
        vals = [np.nan if r["values"][i] is None else r["values"][i] for i in index]
        top.bar(x + (k - (len(rows) - 1) / 2) * width, vals, width, color=colours(k),
                label="source model" if r is source else r["label"])
    if table["clean"] is not None:
        top.axhline(table["clean"], color="black", linestyle="--", linewidth=1.2,
                    label=f"clean (source): {figure(table['clean'])}")
    top.set_ylim(*plot_limits(table))
    top.set_ylabel("R@1 (%)")
    top.legend(fontsize=8, ncol=1 if len(rows) <= 8 else 2, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    mwidth = 0.85 / max(1, len(methods))
    for k, r in enumerate(methods):
        gains = [np.nan if source is None or r["values"][i] is None or source["values"][i] is None
                 else r["values"][i] - source["values"][i] for i in index]
        bottom.bar(x + (k - (len(methods) - 1) / 2) * mwidth, gains, mwidth, color=colours(k + 1), label=r["label"])
    bottom.axhline(0.0, color="black", linewidth=0.8)
    bottom.set_ylabel("Δ R@1 vs source")
    bottom.set_xticks(x, [c["label"] for c in cols], rotation=45, ha="right")
    fig.suptitle(wrapped_title(table, width_in), fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120, bbox_inches="tight")  # nothing cut at the edges
    plt.close(fig)
    return str(path)


def wrapped_title(table: dict[str, Any], width_in: float) -> str:
    """The table's title in lines that fit a figure ``width_in`` inches wide at 10 pt (about 11 characters an inch)."""
    return "\n".join(textwrap.wrap(table["title"], width=max(40, int(width_in * 11))))
