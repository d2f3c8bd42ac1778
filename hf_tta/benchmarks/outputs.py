"""The files of a benchmark run: ``results.json`` (meta, summary, the per-group tables, the main tables and every
row), ``results.csv`` (one line per run), ``results.md`` (the main tables, as printed) and the PNG plots (one per
direction: R@1 with the clean line and the gain over the source; the embedding diagnostics)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import numpy as np

from .grid import SOURCE
from .main_table import draw_main_plot, format_main_table, main_tables
from .report import CSV_FIELDS, abbreviation, build_tables, summarize


def scoring_of(meta: dict[str, Any]) -> str | None:
    """The scoring rule a run's meta records (``identity.scoring``), if any."""
    return (meta.get("identity") or {}).get("scoring")


def format_main_tables(rows: Sequence[dict], scoring: str | None = None) -> str:
    """Every main table of ``rows`` (one per direction) as Markdown, as the main job prints and ``results.md`` holds."""
    return "\n\n".join(format_main_table(t) for t in main_tables(rows, scoring=scoring))


def write_outputs(rows: Sequence[dict], folder, meta: dict[str, Any], plots: bool = True) -> dict[str, str]:
    """Write ``results.json``, ``results.csv``, ``results.md`` and the PNG plots; returns their paths."""
    import csv
    import json

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    scoring = scoring_of(meta)
    paths = {}
    payload = {"meta": meta, "summary": summarize(rows), "tables": build_tables(rows),
               "main_tables": main_tables(rows, scoring=scoring), "rows": list(rows)}
    (folder / "results.json").write_text(json.dumps(payload, indent=1, default=str) + "\n")
    paths["json"] = str(folder / "results.json")
    with open(folder / "results.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=CSV_FIELDS, extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow({**r, **{f"safety_{a}": n for a, n in (r.get("safety") or {}).items()}})
    paths["csv"] = str(folder / "results.csv")
    (folder / "results.md").write_text(format_main_tables(rows, scoring) + "\n")
    paths["markdown"] = str(folder / "results.md")
    if plots:
        paths.update(draw_plots(rows, folder, scoring))
    return paths


def draw_plots(rows: Sequence[dict], folder, scoring: str | None = None) -> dict[str, str]:
    """Per direction, R@1 per column with the clean line and each method's gain over the source
    (:func:`.main_table.draw_main_plot`, ``r1_<direction>.png``); and query uniformity / query–gallery gap before and
    after adaptation (``diagnostics.png``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    folder = Path(folder)
    out = {}
    for t in main_tables(rows, scoring=scoring):
        out[f"plot_r1_{t['direction']}"] = draw_main_plot(t, folder / f"r1_{t['direction']}.png")

    first_seed = min((r.get("seed", 0) for r in rows), default=0)  # diagnostics of one seed (the first)
    diag = [r for r in rows if "error" not in r and "uniformity_before" in r and r.get("seed", 0) == first_seed]
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
        fig.savefig(path, dpi=120, bbox_inches="tight")
        plt.close(fig)
        out["plot_diagnostics"] = str(path)
    return out
