#!/usr/bin/env python
"""Protocol v3's "cheaper alternatives" table (issue 39): the training-free re-scorers alone and under TCR and REST,
and TCR and REST on an update budget, with their passes per query and time against the source row of the same run
(``python -m hf_tta.benchmarks.protocols.v3 cheaper``; printed by ``python -m hf_tta.benchmarks.protocols.v3_summary --part cheaper``)."""

from __future__ import annotations

import numpy as np

from hf_tta.benchmarks.figures import figure

from .v3_rows import SOURCE, column, complete, corruption_columns, hits, report_cells, share, verdict


def _cheaper_order(name: str) -> tuple:
    """The cheaper table's order: the transforms alone, then each method on every batch, with each transform, and at
    falling budgets."""
    from hf_tta.benchmarks.grid import SCORE_TRANSFORMS, row_spec

    spec = row_spec(name)
    return (spec.objective not in SCORE_TRANSFORMS, spec.objective, spec.budget is not None, -(spec.budget or 1.0),
            spec.score_transform or "")


def passes(cells: dict, cols: list[tuple], seeds: tuple[int, ...]) -> tuple[float, float] | None:
    """The query tower's forward and backward passes per query over the columns and seeds (query-weighted); ``None``
    where a row predates the cost columns."""
    picked = [cells[c][s] for c in cols for s in seeds]
    if any(r.get("forward_per_query") is None for r in picked):
        return None
    queries = sum(r["num_queries"] for r in picked)
    return (sum(r["forward_per_query"] * r["num_queries"] for r in picked) / queries,
            sum(r["backward_per_query"] * r["num_queries"] for r in picked) / queries)


def _cost(cells: dict, runs: dict, cols: list[tuple], seeds: tuple[int, ...]) -> tuple[str, str]:
    """``(forward, backward passes per query; seconds per query, the device, and their ratio to the source row of the
    same run)`` over the columns and seeds (query-weighted), ``–`` where a row predates the cost columns."""
    picked = [cells[c][s] for c in cols for s in seeds]
    counted = passes(cells, cols, seeds)
    if counted is None or any(r.get("stream_seconds") is None for r in picked):
        return "–", "–"
    forward, backward = counted
    queries = sum(r["num_queries"] for r in picked)
    seconds = sum(r["stream_seconds"] for r in picked)
    own = [runs.get((r["config"], column(r), r["seed"])) for r in picked]
    ratio = None
    if all(o is not None and o.get("stream_seconds") for o in own):
        ratio = seconds / sum(o["stream_seconds"] for o in own)
    time = f"{figure(seconds / queries * 1000, 2)} ms on {_devices(picked)}"
    return f"{figure(forward, 2)}, {figure(backward, 2)}", f"{time} ({figure(ratio, 2)}×)" if ratio is not None else time


def _devices(rows: list[dict]) -> str:
    """The device(s) the rows ran on, from their runs' headers (seconds are comparable only on one device)."""
    return " and ".join(sorted({r.get("device") or "an unrecorded device" for r in rows}))


def _against_every_batch(name: str, cells: dict, cells_by: dict, cols: list[tuple], seeds: tuple[int, ...]) -> str:
    """A method's row with a transform or on a budget against the same method and lr on every batch (same phase):
    Δ R@1 with its two-sided 95 % interval, items and seeds resampled jointly (``–`` for the method itself, a
    transform alone, or where the method's row is missing)."""
    from hf_tta.benchmarks.figures import interval
    from hf_tta.benchmarks.grid import SCORE_TRANSFORMS, row_spec
    from hf_tta.benchmarks.intervals import paired_bootstrap

    row, _, lr = name.partition("@")
    spec = row_spec(row)
    base = cells_by.get(f"{spec.objective}@{lr}")
    if spec.objective in SCORE_TRANSFORMS or row == spec.objective or base is None or not complete(base, cols, seeds):
        return "–"
    delta, (lo, hi) = paired_bootstrap([np.stack([hits(cells[c][s]) - hits(base[c][s]) for s in seeds]) for c in cols])
    return f"{figure(delta, sign=True)} {interval(lo, hi)}"


def cheaper_lines(rows: list[dict], direction: str, seeds: tuple[int, ...] = (3, 4, 5)) -> list[str]:
    """Phase ``cheaper`` (issue 39): per row, the share won back over the report split's corruption columns, the
    worst column (or stream) against the source with its one-sided bound and :func:`verdict`, the passes per query
    through the query tower (forward, backward) and the seconds per query with their ratio to the source row of the
    same run (``stream_seconds``: each run times its source beside its row). Rows complete on every seed only."""
    from hf_tta.benchmarks.report import abbreviation

    src, cells_by = report_cells(rows, direction, seeds, phase="cheaper")
    phase_rows = [r for r in rows if r["direction"] == direction and r["phase"] == "cheaper" and r["seed"] in seeds]
    runs = {(r["config"], column(r), r["seed"]): r for r in phase_rows if r["objective"] == SOURCE}
    cols = [c for c in corruption_columns(src) if all(s in src[c] for s in seeds)]
    lines = ["| row | won back | worst column vs the source: Δ R@1, verdict (one-sided 95 % bound, margin 0.5) | "
             "Δ R@1 vs the method on every batch [95 % interval] | passes per query (forward, backward) | "
             "seconds per query, device (× the source's, same run) |", "|---|---|---|---|---|---|"]
    if not cols:
        return lines
    own = [r for r in runs.values() if column(r) in cols]  # the source rows of every run: their mean time per device
    passes = _cost(src, runs, cols, seeds)[0]
    times = []
    for device in sorted({_devices([r]) for r in own}):
        mine = [r for r in own if _devices([r]) == device]
        seconds = sum(r.get("stream_seconds") or 0.0 for r in mine) / sum(r["num_queries"] for r in mine) * 1000
        n = len({r["config"] for r in mine})
        times.append(f"{figure(seconds, 2)} ms on {device} (1×, mean of {n} run{'s' * (n != 1)})")
    lines.append(f"| source | – | – | – | {passes} | {'; '.join(times)} |")
    for name, cells in sorted(cells_by.items(), key=lambda kv: _cheaper_order(kv[0].split("@")[0])):
        if not complete(cells, cols, seeds):
            continue
        streams = [c for c in cells if c not in cols and c in src and complete(cells, [c], seeds)]
        checks = {c: verdict(cells, src, [c]) for c in [*cols, *streams]}
        (col, ni) = min(checks.items(), key=lambda kv: kv[1].lower)
        passes, seconds = _cost(cells, runs, cols, seeds)
        lines.append(f"| {name} | {figure(share(cells, src, cols), percent=True)} | {abbreviation(col[0])} {col[1] or ''}: "
                     f"{figure(ni.delta, sign=True)}, {ni.verdict} | {_against_every_batch(name, cells, cells_by, cols, seeds)} | "
                     f"{passes} | {seconds} |")
    return lines
