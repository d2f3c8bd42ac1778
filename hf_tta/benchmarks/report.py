"""Tables, outputs and plots of benchmark rows: TCR-Table-1-shaped tables, results.json/.csv/.md, PNG plots,
and the order of merged rows."""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from .grid import AV_DIRECTIONS, SOURCE, Condition


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
}
OTHER_ABBREVIATIONS = {"clean": "Clean", "noto": "Noto", "diverse": "Diverse"}
#: AudioSet-O's multi-distribution shifts as REST's Table IV names them (N+B, ..., N+W).
AV_ABBREVIATIONS = {
    s: "+".join(part[0].upper() for part in s.split("_"))
    for s in ("noise_blur", "noise_digital", "blur_digital", "noise_blur_digital", "noise_weather")
}


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


def _group_title(group: str) -> str:
    if group in AV_DIRECTIONS:
        q, g = AV_DIRECTIONS[group]
        return f"Query shift on {q}→{g} retrieval ({q} queries, clean {g} gallery), R@1 (%)"
    if group == "shifts":
        return "Clean, unseen style (noto) and diverse shift, R@1 (%)"
    direction, _, severity = group.split("-")
    what = "image corruptions, image→text (TR@1)" if direction == "i2t" else "text corruptions, text→image (IR@1)"
    return f"Query shift on {what}, severity {severity}"


def build_tables(rows: Sequence[dict], metric: str = "R@1") -> list[dict[str, Any]]:
    """Tables shaped like TCR's Table 1: one per group, rows = source then each objective, columns = the shifts
    (and direction, for the ``shifts`` group) and their average."""
    groups: dict[str, list[dict]] = {}
    for r in rows:
        groups.setdefault(_group_of(r), []).append(r)
    tables = []
    for group, grows in groups.items():
        columns: list[tuple[str, str]] = []
        for r in grows:
            col = (r["direction"], r["shift"])
            if col not in columns:
                columns.append(col)
        objectives: list[str] = []
        for r in sorted(grows, key=lambda r: r["objective"] != SOURCE):
            if r["objective"] not in objectives:
                objectives.append(r["objective"])
        cells = {(r["objective"], (r["direction"], r["shift"])): r for r in grows}
        header = [
            (abbreviation(s) if group != "shifts" else f"{abbreviation(s)} {d}") for d, s in columns
        ]
        body = []
        for obj in objectives:
            values, status = [], []
            for col in columns:
                r = cells.get((obj, col))
                ok_cell = r is not None and "error" not in r and metric in r
                values.append(r[metric] if ok_cell else None)
                status.append("ok" if ok_cell else ("missing" if r is None else "error"))
            ok = [v for v in values if v is not None]
            avg = sum(ok) / len(ok) if ok and len(ok) == len(values) else None
            body.append({"objective": obj, "values": values, "status": status, "avg": avg})
        tables.append({"group": group, "title": _group_title(group), "columns": header, "rows": body, "metric": metric})
    return tables


def format_table(table: dict[str, Any], source_label: str = "Source model") -> str:
    """Markdown table (as in the papers: the source model, then '• objective' rows, then Avg.)."""
    cols = ["Method", *table["columns"], "Avg."]
    lines = [f"**{table['title']}**", "", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for row in table["rows"]:
        name = source_label if row["objective"] == SOURCE else f"• {row['objective']}"
        status = row.get("status", ["error"] * len(row["values"]))
        vals = [f"{v:.1f}" if v is not None else ("–" if st == "missing" else "err") for v, st in zip(row["values"], status)]
        avg = "–" if row["avg"] is None else f"{row['avg']:.1f}"
        lines.append("| " + " | ".join([name, *vals, avg]) + " |")
    return "\n".join(lines)


def summarize(rows: Sequence[dict]) -> dict[str, Any]:
    """Mean R@1 per objective over each table's columns, and the gain over the source model."""
    out = {}
    for t in build_tables(rows):
        src = next((r["avg"] for r in t["rows"] if r["objective"] == SOURCE), None)
        out[t["group"]] = {
            r["objective"]: {
                "mean_R@1": None if r["avg"] is None else round(r["avg"], 2),
                "gain_over_source": None if r["avg"] is None or src is None else round(r["avg"] - src, 2),
            }
            for r in t["rows"]
        }
    return out


# ------------------------------------------------------------------------------------------------ outputs
CSV_FIELDS = (
    "direction", "shift", "severity", "objective", "R@1", "R@5", "R@10", "uniformity_before", "uniformity_after",
    "gap_before", "gap_after", "num_queries", "gallery_size", "updates", "skipped_steps", "seconds", "error",
)


def write_outputs(rows: Sequence[dict], folder, meta: dict[str, Any], plots: bool = True) -> dict[str, str]:
    """Write ``results.json``, ``results.csv``, ``results.md`` and the PNG plots; returns their paths."""
    import csv
    import json
    from pathlib import Path

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tables = build_tables(rows)
    paths = {}
    payload = {"meta": meta, "summary": summarize(rows), "tables": tables, "rows": list(rows)}
    (folder / "results.json").write_text(json.dumps(payload, indent=1, default=str) + "\n")
    paths["json"] = str(folder / "results.json")
    with open(folder / "results.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=CSV_FIELDS, extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow(r)
    paths["csv"] = str(folder / "results.csv")
    (folder / "results.md").write_text("\n\n".join(format_table(t) for t in tables) + "\n")
    paths["markdown"] = str(folder / "results.md")
    if plots:
        paths.update(draw_plots(rows, folder))
    return paths


def draw_plots(rows: Sequence[dict], folder) -> dict[str, str]:
    """R@1 per shift for each objective, and query uniformity / query–gallery gap before and after adaptation."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from pathlib import Path

    folder = Path(folder)
    out = {}
    for t in build_tables(rows):
        n_cols, objs = len(t["columns"]), [r["objective"] for r in t["rows"]]
        fig, ax = plt.subplots(figsize=(min(18.0, max(6.0, 2 + n_cols * (0.3 + 0.07 * len(objs)))), 4.5))
        width = 0.85 / max(1, len(objs))
        x = np.arange(n_cols)
        colours = plt.get_cmap("tab20" if len(objs) > 10 else "tab10")
        for k, r in enumerate(t["rows"]):
            vals = [np.nan if v is None else v for v in r["values"]]
            ax.bar(x + (k - (len(objs) - 1) / 2) * width, vals, width, color=colours(k),
                   label="source model" if r["objective"] == SOURCE else r["objective"])
        ax.set_xticks(x, t["columns"], rotation=45, ha="right")
        ax.set_ylabel("R@1 (%)")
        ax.set_title(t["title"], fontsize=10)
        ax.set_ylim(0, 100)
        ax.legend(fontsize=8, ncol=1 if len(objs) <= 8 else 2, loc="upper left", bbox_to_anchor=(1.01, 1.0))
        fig.tight_layout()
        path = folder / f"r1_{t['group']}.png"
        fig.savefig(path, dpi=120)
        plt.close(fig)
        out[f"plot_r1_{t['group']}"] = str(path)

    diag = [r for r in rows if "error" not in r and "uniformity_before" in r]
    if diag:
        objectives = list(dict.fromkeys(r["objective"] for r in sorted(diag, key=lambda r: r["objective"] != SOURCE)))
        conds = list(dict.fromkeys(f"{abbreviation(r['shift'])} {r['direction']}" for r in diag))
        fig, axes = plt.subplots(1, 2, figsize=(max(8.0, 0.5 * len(conds) + 6), 4))
        for ax, key, label in ((axes[0], "uniformity", "query uniformity (Eq. 14, higher = more spread)"),
                               (axes[1], "gap", "query–gallery gap (Eq. 15)")):
            colours = plt.get_cmap("tab20" if len(objectives) > 10 else "tab10")
            for i, obj in enumerate(objectives):
                by = {f"{abbreviation(r['shift'])} {r['direction']}": r for r in diag if r["objective"] == obj}
                ys = [by[c][f"{key}_after"] if c in by else np.nan for c in conds]
                style = dict(color="black", linewidth=2, marker="s", markersize=4, zorder=5) if obj == SOURCE else dict(color=colours(i), marker="o", markersize=3)
                ax.plot(range(len(conds)), ys, label="before (source)" if obj == SOURCE else f"after {obj}", **style)
            ax.set_xticks(range(len(conds)), conds, rotation=45, ha="right", fontsize=8)
            ax.set_title(label, fontsize=10)
        axes[1].legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
        fig.tight_layout()
        path = folder / "diagnostics.png"
        fig.savefig(path, dpi=120)
        plt.close(fig)
        out["plot_diagnostics"] = str(path)
    return out


# ------------------------------------------------------------------------------------------------ merging
def canonical_order():
    """Sort key of result rows: shifts in the library's order (image corruptions, text corruptions, then the rest by
    name), severities ascending, the source model first, the objectives in registry order, seeds ascending."""
    from ..data.corruptions import IMAGE_CORRUPTIONS, TEXT_CORRUPTIONS
    from ..objectives import available_objectives

    shifts = {name: i for i, name in enumerate((*IMAGE_CORRUPTIONS, *TEXT_CORRUPTIONS))}
    objectives = {name: i for i, name in enumerate(available_objectives())}
    return lambda r: (
        r["direction"],
        shifts.get(r["shift"], len(shifts)),
        r["shift"],
        r.get("severity") or 0,
        -1 if r["objective"] == SOURCE else objectives.get(r["objective"], len(objectives)),
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
