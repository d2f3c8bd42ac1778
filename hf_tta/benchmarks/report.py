"""Per-group tables of benchmark rows (one per severity and direction, and the other streams: what the model cards
recompute), their summary, and the order of merged rows. The main job's one table is :mod:`.main_table`; the files
:mod:`.outputs`."""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from .bands import won_back_by_band
from .grid import AV_DIRECTIONS, ORACLE_ROWS, SOURCE, Condition
from .intervals import BOOTSTRAP_SAMPLES, below_source_claim, detection_limit, paired_bootstrap  # noqa: F401

IMAGE_ABBREVIATIONS = {
    "gaussian_noise": "Gauss.",
    "shot_noise": "Shot",
    "impulse_noise": "Impul.",
    "speckle_noise": "Speckle",
    "defocus_blur": "Defoc.",
    "glass_blur": "Glass",
    "motion_blur": "Motion",
    "zoom_blur": "Zoom",
    "snow": "Snow",
    "frost": "Frost",
    "fog": "Fog",
    "brightness": "Brit.",
    "contrast": "Contr.",
    "elastic_transform": "Elastic",
    "pixelate": "Pixel",
    "jpeg_compression": "JPEG",
    "gaussian_blur": "G.blur",
    "spatter": "Spatter",
    "saturate": "Satur.",
}
OTHER_ABBREVIATIONS = {"clean": "Clean", "noto": "Noto", "diverse": "Diverse", "switch": "Switch", "degenerate": "Degen."}
#: AudioSet-O's multi-distribution shifts as REST's Table IV names them (N+B, ..., N+W).
AV_ABBREVIATIONS = {
    s: "+".join(part[0].upper() for part in s.split("_"))
    for s in ("noise_blur", "noise_digital", "blur_digital", "noise_blur_digital", "noise_weather")
}


#: FIQ-O / CIRR-O columns as REST's Tables III and A.8 name them (Noise*+Char, ...).
AV_ABBREVIATIONS.update({f"{i}_{t}": f"{i.capitalize()}*+{t.capitalize()}" for i in ("noise", "blur", "weather", "digital")
                         for t in ("char", "word", "sent")})


def abbreviation(shift: str) -> str:
    if shift in IMAGE_ABBREVIATIONS:
        return IMAGE_ABBREVIATIONS[shift]
    if shift in OTHER_ABBREVIATIONS:
        return OTHER_ABBREVIATIONS[shift]
    if shift in AV_ABBREVIATIONS:
        return AV_ABBREVIATIONS[shift]
    try:
        from ..data.corruptions import TEXT_CORRUPTION_ABBREVIATIONS

        return TEXT_CORRUPTION_ABBREVIATIONS.get(shift, shift)
    except Exception:  # pragma: no cover
        return shift


def _group_of(row: dict) -> str:
    return Condition(row["direction"], row["shift"], row["severity"]).group


#: How the ``shifts`` table's title names each stream.
SHIFT_WORDS = {"clean": "clean", "noto": "unseen style (noto)", "diverse": "diverse", "switch": "switching",
               "degenerate": "degenerate"}


def _group_title(group: str, shifts: Sequence[str] = ()) -> str:
    if group in AV_DIRECTIONS:
        q, g = AV_DIRECTIONS[group]
        return f"Query shift on {q}→{g} retrieval ({q} queries, clean {g} gallery), R@1 (%)"
    if group == "shifts":  # only the streams that ran
        names = [SHIFT_WORDS.get(s, s) for s in dict.fromkeys(shifts)]
        listed = ", ".join(names[:-1]) + (" and " if len(names) > 1 else "") + names[-1] if names else "other"
        return f"{listed[0].upper()}{listed[1:]} stream{'s' if len(names) != 1 else ''}, R@1 (%)"
    direction, _, severity = group.split("-")
    what = "image corruptions, image→text (TR@1)" if direction == "i2t" else "text corruptions, text→image (IR@1)"
    return f"Query shift on {what}, severity {severity}"


#: Display names of the supervised ceilings (they are not methods).
ROW_LABELS = {"oracle": "oracle (LN)†", "oracle_all": "oracle (all)†", "recommended": "recommended preset"}
#: Below this many R@1 points lost on a shift, no share of lost recall is reported (nothing to win back).
MIN_LOST_RECALL = 1.0


def row_label(objective: str) -> str:
    return ROW_LABELS.get(objective, objective)


def _mean_std(values: Sequence[float]) -> tuple[float, float]:
    arr = np.asarray(values, dtype=np.float64)
    return float(arr.mean()), float(arr.std(ddof=1)) if len(arr) > 1 else 0.0


def won_back(method: float | None, source: float | None, clean: float | None) -> float | None:
    """The share of lost recall won back, ``(R@1_method - R@1_source) / (R@1_clean - R@1_source)`` (a fraction);
    ``None`` where less than :data:`MIN_LOST_RECALL` points were lost."""
    if method is None or source is None or clean is None or clean - source < MIN_LOST_RECALL:
        return None
    return (method - source) / (clean - source)


def _hits(row: dict) -> np.ndarray | None:
    h = row.get("hits")
    return None if not h else np.frombuffer(h.encode("ascii"), dtype=np.uint8) - ord("0")


def _visible(rows: Sequence[dict]) -> list[dict]:
    """Rows shown in tables: a clean stream that only the source model ran is the won-back reference, not a column."""
    adapted = {(r["direction"], r["shift"]) for r in rows if r["objective"] != SOURCE}
    return [r for r in rows if r["shift"] != "clean" or (r["direction"], "clean") in adapted]


def clean_reference(rows: Sequence[dict], metric: str = "R@1") -> dict[str, float]:
    """Per direction, the source model's mean R@1 on the clean stream (over seeds)."""
    out: dict[str, list[float]] = {}
    for r in rows:
        if r["objective"] == SOURCE and r["shift"] == "clean" and "error" not in r and metric in r:
            out.setdefault(r["direction"], []).append(r[metric])
    return {d: float(np.mean(v)) for d, v in out.items()}


def build_tables(rows: Sequence[dict], metric: str = "R@1") -> list[dict[str, Any]]:
    """Tables shaped like TCR's Table 1: one per group, rows = source then each objective (then the oracle
    ceilings), columns = the shifts (and direction, for the ``shifts`` group) and their average.

    Each cell is the mean over seeds (``stds``: their standard deviation). Each row also carries, against the source
    model, the share of lost recall won back per shift (``won_back``) and on average (``won_back_mean``: the ratio of
    the averages, ``(avg_method - avg_source) / (avg_clean - avg_source)``), the worst shift's change (``worst_delta``,
    ``worst_shift``) and the mean difference with its 95 % interval (``delta``, ``delta_ci``: the hierarchical paired
    bootstrap of :mod:`.intervals`, seeds then items jointly across columns, from the per-query hits; R@1 only) and
    the interval's detection limit (``detection_limit``, its half-width)."""
    clean = clean_reference(rows, metric)
    groups: dict[str, list[dict]] = {}
    for r in _visible(rows):
        groups.setdefault(_group_of(r), []).append(r)
    tables = []
    for group, grows in groups.items():
        columns: list[tuple[str, str]] = []
        for r in grows:
            col = (r["direction"], r["shift"])
            if col not in columns:
                columns.append(col)
        objectives: list[str] = []
        for r in sorted(grows, key=lambda r: (r["objective"] != SOURCE, r["objective"] in ORACLE_ROWS)):
            if r["objective"] not in objectives:
                objectives.append(r["objective"])
        cells: dict[tuple, list[dict]] = {}
        for r in grows:
            cells.setdefault((r["objective"], (r["direction"], r["shift"])), []).append(r)
        header = [(abbreviation(s) if group != "shifts" else f"{abbreviation(s)} {d}") for d, s in columns]
        refs = [None if s == "clean" else clean.get(d) for d, s in columns]
        body = []
        for obj in objectives:
            values, stds, status, seeds, col_seeds = [], [], [], set(), set()
            for col in columns:
                rs = cells.get((obj, col), [])
                ok = [r for r in rs if "error" not in r and metric in r]
                if ok and len(ok) == len(rs):
                    m, sd = _mean_std([r[metric] for r in ok])
                    values.append(m)
                    stds.append(sd)
                    status.append("ok")
                    seeds.update(r.get("seed", 0) for r in ok)
                    col_seeds.add(frozenset(r.get("seed", 0) for r in ok))
                else:
                    values.append(None)
                    stds.append(None)
                    status.append("missing" if not rs else "error")
            # an average over columns of different seeds would mix seed sets (e.g. a 2-seed column with 3-seed ones)
            complete = all(v is not None for v in values) and len(col_seeds) <= 1
            avg = float(np.mean(values)) if complete and values else None
            avg_std = None
            if complete and len(seeds) > 1:  # std over seeds of the per-seed averages
                per_seed = [[r[metric] for c in columns for r in cells[(obj, c)] if r.get("seed", 0) == sd] for sd in sorted(seeds)]
                if all(len(p) == len(columns) for p in per_seed):
                    avg_std = _mean_std([float(np.mean(p)) for p in per_seed])[1]
            body.append({"objective": obj, "label": row_label(obj), "values": values, "stds": stds, "status": status,
                         "avg": avg, "avg_std": avg_std, "seeds": sorted(seeds)})
            runs = [r for col in columns for r in cells.get((obj, col), []) if "safety" in r]
            if runs:  # what the safety layer did over the row's streams (summed over shifts and seeds)
                body[-1]["safety"] = {a: sum(int(r["safety"].get(a, 0)) for r in runs) for a in SAFETY_COLUMNS}
        source = next((b for b in body if b["objective"] == SOURCE), None)
        for b in body:
            if source is None or b is source:
                continue
            b["won_back"] = [won_back(m, s_, c) for m, s_, c in zip(b["values"], source["values"], refs)]
            shift_cols = [i for i, c in enumerate(refs) if c is not None]
            if shift_cols and b["avg"] is not None and all(source["values"][i] is not None for i in shift_cols):
                mean = lambda vs: float(np.mean([vs[i] for i in shift_cols]))  # noqa: E731
                b["won_back_mean"] = won_back(mean(b["values"]), mean(source["values"]), mean(refs))
            if shift_cols:  # where methods can act: the share won back per band of the source's kept recall
                b["won_back_bands"] = won_back_by_band(b["values"], source["values"], refs, MIN_LOST_RECALL)
            deltas = [(m - s_, i) for i, (m, s_) in enumerate(zip(b["values"], source["values"])) if m is not None and s_ is not None]
            if deltas:
                worst, i = min(deltas)
                b["worst_delta"], b["worst_shift"] = worst, header[i]
            if metric == "R@1":
                diffs, items = [], []
                for col in columns:
                    src_hits = {r.get("seed", 0): _hits(r) for r in cells.get((SOURCE, col), [])}
                    runs = sorted(cells.get((b["objective"], col), []), key=lambda r: r.get("seed", 0))
                    pairs = [(_hits(r), src_hits.get(r.get("seed", 0))) for r in runs]
                    if not pairs or any(h is None or sh is None or len(h) != len(sh) for h, sh in pairs):
                        diffs = None
                        break
                    diffs.append(np.stack([h.astype(np.int8) - sh.astype(np.int8) for h, sh in pairs]))
                    items.append((col[0], len(pairs[0][0])))  # a direction's columns of one length: the same items
                if diffs:
                    b["delta"], b["delta_ci"] = paired_bootstrap(diffs, items=items)
                    b["detection_limit"] = detection_limit(b["delta_ci"])
        tables.append({"group": group, "title": _group_title(group, [r["shift"] for r in grows]), "columns": header, "rows": body, "metric": metric,
                       "clean": refs})
    return tables


def _cell(value: float | None, std: float | None, status: str, seeds: int) -> str:
    if value is None:
        return "–" if status == "missing" else "err"
    return f"{value:.1f} ± {std:.1f}" if seeds > 1 and std is not None else f"{value:.1f}"


def _pct(x: float | None) -> str:
    return "–" if x is None else f"{int(round(100 * x))}%"  # no "-0%"


def format_table(table: dict[str, Any], source_label: str = "Source model") -> str:
    """Markdown table (as in the papers: the source model, then '• objective' rows, then Avg.), with mean ± std over
    seeds, each row's mean difference to the source model [paired bootstrap 95 % interval], the share of lost
    recall won back and the worst shift's change; then the share won back per shift. "Below the source?" says
    ``not below (limit x)`` unless the whole interval is below zero: ``x`` (its half-width) is how far below the source
    a row would have to be for this interval to detect it."""
    with_delta = any("delta" in r for r in table["rows"])
    with_safety = any("safety" in r for r in table["rows"])
    cols = ["Method", *table["columns"], "Avg.", *(["Δ vs source [95% CI]", "Below the source?"] if with_delta else []),
            "Won back", "Worst Δ", *(["Safety skips/rollbacks/resets"] if with_safety else [])]
    lines = [f"**{table['title']}**", "", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for row in table["rows"]:
        name = source_label if row["objective"] == SOURCE else f"• {row.get('label', row['objective'])}"
        n = len(row.get("seeds", ()))
        status = row.get("status", ["error"] * len(row["values"]))
        stds = row.get("stds", [None] * len(row["values"]))
        vals = [_cell(v, sd, st, n) for v, sd, st in zip(row["values"], stds, status)]
        avg = _cell(row["avg"], row.get("avg_std"), "missing", n)
        extra = []
        if with_delta:
            d, ci = row.get("delta"), row.get("delta_ci")
            extra += ["–" if d is None else f"{d:+.1f} [{ci[0]:+.1f}, {ci[1]:+.1f}]", below_source_claim(d, ci)]
        worst = row.get("worst_delta")
        extra += [_pct(row.get("won_back_mean")), "–" if worst is None else f"{worst:+.1f} ({row['worst_shift']})"]
        if with_safety:
            extra.append("/".join(str(row["safety"][a]) for a in SAFETY_COLUMNS) if "safety" in row else "–")
        lines.append("| " + " | ".join([name, *vals, avg, *extra]) + " |")
    if any(r.get("won_back") for r in table["rows"]):
        lines += ["", "Share of lost recall won back, (R@1 − source) / (clean − source):", "",
                  "| Method | " + " | ".join(table["columns"]) + " | Mean |", "|" + "---|" * (len(table["columns"]) + 2)]
        for row in table["rows"]:
            if row.get("won_back"):
                lines.append("| " + " | ".join([f"• {row.get('label', row['objective'])}", *map(_pct, row["won_back"]),
                                                  _pct(row.get("won_back_mean"))]) + " |")
    lines += _band_lines(table)
    if any(r["objective"] in ORACLE_ROWS for r in table["rows"]):
        lines += ["", "† supervised ceilings (trained on the true captions with the methods' stream, batches, steps and "
                  "optimiser), not methods: they bound what a label-free objective on those parameters could reach."]
    return "\n".join(lines)


def _band_lines(table: dict[str, Any]) -> list[str]:
    """The share won back per band of kept recall (:mod:`.bands`): one column per band that holds a column."""
    rows = [r for r in table["rows"] if r.get("won_back_bands")]
    if not rows:
        return []
    bands = rows[0]["won_back_bands"]
    used = [i for i, b in enumerate(bands) if b["columns"]]
    if not used:  # no column lost recall: no band to show (and no table without columns)
        return []
    header = [f"{bands[i]['label']} ({len(bands[i]['columns'])} col., {_pct(bands[i]['loss_share'])} of the loss)" for i in used]
    lines = ["", "Share of lost recall won back by how much of its clean recall the source keeps on the column "
             "(ratio of sums over the columns in each band):", "", "| Method | " + " | ".join(header) + " |",
             "|" + "---|" * (len(used) + 1)]
    for r in rows:
        lines.append("| " + " | ".join([f"• {r.get('label', r['objective'])}",
                                          *(_pct(r["won_back_bands"][i]["won_back"]) for i in used)]) + " |")
    return lines


def won_back_line(table: dict[str, Any]) -> str:
    """One line per table for the console: each row's share of lost recall won back and its worst shift."""
    parts = []
    for r in table["rows"]:
        if r["objective"] == SOURCE or "won_back" not in r:
            continue
        worst = r.get("worst_delta")
        d = r.get("delta")
        ci = (f", Δ {d:+.1f} [{r['delta_ci'][0]:+.1f}, {r['delta_ci'][1]:+.1f}], {below_source_claim(d, r['delta_ci'])}"
              if d is not None else "")
        parts.append(f"{r.get('label', r['objective'])} {_pct(r.get('won_back_mean'))}"
                     + ("" if worst is None else f" (worst {worst:+.1f} on {r['worst_shift']}{ci})"))
    return f"won back of the lost R@1, {table['group']}: " + ("; ".join(parts) if parts else "–")


def summarize(rows: Sequence[dict]) -> dict[str, Any]:
    """Per table and row: mean R@1, the gain over the source model with its bootstrap interval, the share of lost
    recall won back (per shift and on average) and the worst shift's change."""
    out = {}
    for t in build_tables(rows):
        src = next((r["avg"] for r in t["rows"] if r["objective"] == SOURCE), None)
        out[t["group"]] = {
            r["objective"]: {
                "mean_R@1": None if r["avg"] is None else round(r["avg"], 2),
                "std_R@1": None if r.get("avg_std") is None else round(r["avg_std"], 2),
                "seeds": r.get("seeds", []),
                "gain_over_source": None if r["avg"] is None or src is None else round(r["avg"] - src, 2),
                "gain_ci95": r.get("delta_ci"),
                "detection_limit": r.get("detection_limit"),
                "won_back_mean": None if r.get("won_back_mean") is None else round(r["won_back_mean"], 4),
                "won_back": None if "won_back" not in r else {
                    c: (None if w is None else round(w, 4)) for c, w in zip(t["columns"], r["won_back"])
                },
                "won_back_by_band": None if not r.get("won_back_bands") else {
                    b["label"]: None if b["won_back"] is None else round(b["won_back"], 4) for b in r["won_back_bands"]
                },
                "worst_shift": r.get("worst_shift"),
                "worst_delta": None if r.get("worst_delta") is None else round(r["worst_delta"], 2),
            }
            for r in t["rows"]
        }
    return out


# ------------------------------------------------------------------------------------------------ outputs
CSV_FIELDS = (
    "direction", "shift", "severity", "objective", "seed", "R@1", "R@5", "R@10", "uniformity_before", "uniformity_after",
    "gap_before", "gap_after", "num_queries", "gallery_size", "updates", "skipped_steps", "gradient_decoupling", "seconds", "error",
    "safety_skip_degenerate", "safety_rollback", "safety_reset",
)
#: The safety layer's actions (hf_tta.safety.SAFETY_ACTIONS), in the tables' "skips/rollbacks/resets" column.
SAFETY_COLUMNS = ("skip_degenerate", "rollback", "reset")


# ------------------------------------------------------------------------------------------------ merging
def canonical_order():
    """Sort key of result rows: shifts in the library's order (image corruptions, text corruptions, then the rest by
    name), severities ascending, the source model first, the objectives in registry order, seeds ascending."""
    from ..data.corruptions import ALL_IMAGE_CORRUPTIONS, TEXT_CORRUPTIONS
    from ..objectives import available_objectives

    shifts = {name: i for i, name in enumerate((*ALL_IMAGE_CORRUPTIONS, *TEXT_CORRUPTIONS))}
    objectives = {name: i for i, name in enumerate(available_objectives())}
    return lambda r: (
        r["direction"],
        shifts.get(r["shift"], len(shifts)),
        r["shift"],
        r.get("severity") or 0,
        -1 if r["objective"] == SOURCE else objectives.get(r["objective"].split("@")[0].split("+")[0], len(objectives)),
        r["objective"],  # an objective's variants (tcr, tcr+gd, tcr+safe) stay together
        r.get("seed") or 0,
    )


def row_key(row: dict) -> tuple:
    """What identifies a run: (direction, shift, severity, objective, seed)."""
    return (row["direction"], row["shift"], row.get("severity"), row["objective"], row.get("seed", 0))


def merge_rows(rows: Sequence[dict]) -> list[dict]:
    """Rows of several runs or shards as one run: each run once (a condition's source row may come from several
    shards) and in the order of a single run (shards interleave conditions)."""
    seen, unique = set(), []
    for r in rows:
        key = row_key(r)
        if key not in seen:
            seen.add(key)
            unique.append(r)
    return sorted(unique, key=canonical_order())
