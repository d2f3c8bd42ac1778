#!/usr/bin/env python
"""Protocol v3's report-split tables (:mod:`hf_tta.benchmarks.protocols.v3_summary` prints them under their topics): the default
grid, the 15 test corruptions, the streams and the papers' after-update column, each row against the source of the
same columns and seeds (share of lost recall won back, Δ R@1 with its one-sided 95 % bound, the verdict)."""

from __future__ import annotations

import numpy as np

from hf_tta.benchmarks.figures import figure

from .v3_rows import (
    STREAMS,
    complete,
    corruption_columns,
    held_columns,
    hits,
    mean_r1,
    report_cells,
    share,
    verdict,
)


def report_lines(rows: list[dict], direction: str, seeds: tuple[int, ...] = (3, 4, 5)) -> list[str]:
    """The report split's table (default grid for i2t): R@1 per column, share, Δ with its one-sided bound, verdict;
    the rows that ran on every seed of ``seeds``."""
    from hf_tta.benchmarks.report import abbreviation

    src, cells_by = report_cells(rows, direction, seeds)
    cols = [c for c in corruption_columns(src) if all(s in src[c] for s in seeds)]
    head = f"| row | {' | '.join(f'{abbreviation(c[0])} {c[1]}' for c in cols)} | won back | Δ R@1 [one-sided 95 % bound] | vs the source (margin 0.5) |"
    lines = [head, "|---|" + "---|" * (len(cols) + 3),
             f"| clean (source) | {' | '.join(figure(mean_r1(src, ('clean', None), seeds)) for _ in cols)} | | | |",
             f"| source | {' | '.join(figure(mean_r1(src, c, seeds)) for c in cols)} | | | |"]
    for name, cells in sorted(cells_by.items()):
        if not complete(cells, cols, seeds):
            continue
        ni = verdict(cells, src, cols)
        lines.append(f"| {name} | {' | '.join(figure(mean_r1(cells, c, seeds)) for c in cols)} | "
                     f"{figure(share(cells, src, cols), percent=True)} | "
                     f"{figure(ni.delta, sign=True)} [{figure(ni.lower, sign=True)}] | {ni.verdict} |")
    return lines


def corruption_lines(rows: list[dict], direction: str, seeds: tuple[int, ...] = (3,)) -> list[str]:
    """The 15 test corruptions (phase ``corruptions``, seed 3): the share won back at each severity and over all
    columns, Δ R@1 with its one-sided bound and the verdict over all columns, and the worst column."""
    from hf_tta.benchmarks.report import abbreviation

    src, cells_by = report_cells(rows, direction, seeds, phase="corruptions")
    cols = [c for c in corruption_columns(src) if all(s in src[c] for s in seeds)]
    severities = sorted({c[1] for c in cols})
    lines = [f"| row | {' | '.join(f'won back, severity {v}' for v in severities)} | won back, all {len(cols)} | "
             "Δ R@1 [one-sided 95 % bound] | vs the source (margin 0.5) | worst column: Δ R@1 |", "|---|" + "---|" * (len(severities) + 4)]
    for name, cells in sorted(cells_by.items()):
        if not complete(cells, cols, seeds):
            continue
        ni = verdict(cells, src, cols)
        worst = min(cols, key=lambda c: mean_r1(cells, c, seeds) - mean_r1(src, c, seeds))
        by_severity = [figure(share(cells, src, [c for c in cols if c[1] == v]), percent=True) for v in severities]
        lines.append(f"| {name} | {' | '.join(by_severity)} | {figure(share(cells, src, cols), percent=True)} | "
                     f"{figure(ni.delta, sign=True)} [{figure(ni.lower, sign=True)}] | {ni.verdict} | "
                     f"{abbreviation(worst[0])} {worst[1]}: {figure(mean_r1(cells, worst, seeds) - mean_r1(src, worst, seeds), sign=True)} |")
    return lines


def stream_lines(rows: list[dict], direction: str, seeds: tuple[int, ...] = (3, 4, 5), phase: str = "report") -> list[str]:
    """The report split's streams per row of ``phase``: Δ R@1 against the source with its one-sided bound and the
    verdict."""
    from hf_tta.benchmarks.report import abbreviation

    src, cells_by = report_cells(rows, direction, seeds, phase=phase)
    lines = ["| row | stream | source R@1 | Δ R@1 [one-sided 95 % bound] | vs the source (margin 0.5) |", "|---|---|---|---|---|"]
    for name, cells in sorted(cells_by.items()):
        for stream in STREAMS:
            c = (stream, None)
            if c not in src or not complete(cells, [c], seeds):
                continue
            ni = verdict(cells, src, [c])
            lines.append(f"| {name} | {abbreviation(stream)} | {figure(mean_r1(src, c, seeds))} | {figure(ni.delta, sign=True)} "
                         f"[{figure(ni.lower, sign=True)}] | {ni.verdict} |")
    return lines


def after_lines(rows: list[dict], direction: str, seeds: tuple[int, ...] = (3,)) -> list[str]:
    """The papers' after-update scoring (phase ``after``) beside the prequential row of the same objective and lr on
    the same columns and seeds: each row's share both ways, and the gain the after-update scoring adds, Δ R@1 (after −
    before) with its two-sided 95 % interval (items and seeds resampled jointly). The columns are the report's that the
    after-update runs hold (their own source rows name them; the header counts them)."""
    from hf_tta.benchmarks.figures import interval
    from hf_tta.benchmarks.intervals import paired_bootstrap

    src, before = report_cells(rows, direction, seeds)
    after_src, after = report_cells(rows, direction, seeds, phase="after")
    cols = held_columns(src, after_src, seeds)
    lines = [f"| row ({len(cols)} column{'s' if len(cols) != 1 else ''}) | won back, prequential (protocol v3) | won back, after the update (the papers' scoring) | "
             "Δ R@1 after − before [95 % interval] |", "|---|---|---|---|"]
    for name, post in sorted(after.items()):
        pre = before.get(name, {})
        if not (complete(post, cols, seeds) and complete(pre, cols, seeds)):
            continue
        diffs = [np.stack([hits(post[c][s]) - hits(pre[c][s]) for s in seeds]) for c in cols]
        delta, (lo, hi) = paired_bootstrap(diffs)
        lines.append(f"| {name} | {figure(share(pre, src, cols), percent=True)} | {figure(share(post, src, cols), percent=True)} | "
                     f"{figure(delta, sign=True)} {interval(lo, hi)} |")
    return lines
