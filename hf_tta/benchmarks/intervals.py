"""Intervals of a row's difference to the source model: a hierarchical paired bootstrap over seeds and items.

Every column of a table (one corruption each) holds the same items, the benchmark's queries in the same order
(1,899 emoji on the emoji benchmark), and a run is repeated over seeds. A replicate therefore

1. draws the seeds with replacement (one draw shared by every column with the same number of seeds: seed ``k`` is
   the ``k``-th seed in every column), then
2. draws the items with replacement, **jointly** across columns: one draw of item indices shared by every column
   holding the same items (the same query ``i`` in every corruption column), and by every drawn seed,

and takes the mean over columns of each column's mean paired difference (method hit − source hit of the same item
and seed). Resampling each column's items independently treats the columns as independent samples of items although
an item that is hard in one column tends to be hard in the others: it gives intervals that are too narrow (on the
emoji grid up to 60 % narrower, issue 25), and leaving the seeds fixed leaves the seed-to-seed variance out.

The interval is the 2.5 and 97.5 % percentiles of the replicates (percentile bootstrap). Its half-width is the
**detection limit** of a "not below the source" claim: a row about that far below the source would be told apart
from it; a smaller drop would not (:func:`detection_limit`).
"""

from __future__ import annotations

from typing import Hashable, Sequence

import numpy as np

BOOTSTRAP_SAMPLES = 1000


def replicates(
    diffs: Sequence[np.ndarray], item_counts: Sequence[np.ndarray], seed_counts: Sequence[np.ndarray]
) -> np.ndarray:
    """The bootstrap statistic for given draws, ``(B,)`` in R@1 points.

    ``diffs[c]`` is column ``c``'s ``(S_c, N_c)`` paired differences; ``item_counts[c]`` ``(B, N_c)`` and
    ``seed_counts[c]`` ``(B, S_c)`` say how often replicate ``b`` drew each item and each seed (each row sums to
    ``N_c`` and ``S_c``). Replicate ``b`` of column ``c`` is ``Σ_s Σ_i w_bs c_bi D_c[s, i] / (S_c N_c)``, and the
    statistic is the mean over columns."""
    total = None
    for d, items, seeds in zip(diffs, item_counts, seed_counts):
        d = np.asarray(d, dtype=np.float64)
        per_seed = d @ np.asarray(items, dtype=np.float64).T  # (S, B): each seed's sum over the drawn items
        col = (np.asarray(seeds, dtype=np.float64).T * per_seed).sum(axis=0) / d.size
        total = col if total is None else total + col
    return 100.0 * total / len(diffs)


def _counts(rng: np.random.Generator, n: int, samples: int) -> np.ndarray:
    """``(samples, n)`` multiplicities of ``n`` draws with replacement from ``n`` things."""
    return rng.multinomial(n, np.full(n, 1.0 / n), size=samples)


def paired_bootstrap(
    diffs: Sequence[np.ndarray],
    samples: int = BOOTSTRAP_SAMPLES,
    seed: int = 0,
    items: Sequence[Hashable] | None = None,
    joint: bool = True,
) -> tuple[float, list[float]]:
    """Mean paired difference (R@1 points, the mean over columns) and its 95 % hierarchical bootstrap interval.

    Args:
        diffs: one ``(seeds, queries)`` array per column: method hit − source hit of the same query and seed.
        items: per column, which item set it holds; columns with equal labels are resampled with one shared draw of
            item indices (and must have as many queries). Default: columns with the same number of queries hold the
            same items (true of the benchmark's corruption columns).
        joint: ``False`` resamples every column's seeds and items on its own (columns as independent samples): the
            narrower interval of the former report, kept for comparison.
    """
    diffs = [np.atleast_2d(np.asarray(d, dtype=np.float64)) for d in diffs]
    if not diffs or any(d.size == 0 for d in diffs):
        raise ValueError("paired_bootstrap needs at least one column with at least one seed and one query.")
    labels = list(items) if items is not None else [d.shape[1] for d in diffs]
    if len(labels) != len(diffs):
        raise ValueError(f"items names {len(labels)} columns but diffs has {len(diffs)}.")
    if not joint:
        labels = list(range(len(diffs)))
    rng = np.random.default_rng(seed)
    item_draws: dict = {}
    seed_draws: dict = {}
    item_counts, seed_counts = [], []
    for d, label in zip(diffs, labels):
        s, n = d.shape
        if label in item_draws and item_draws[label].shape[1] != n:
            raise ValueError(f"Columns labelled {label!r} hold the same items but have {item_draws[label].shape[1]} and {n} queries.")
        seed_key = (s,) if joint else (label, s)
        if seed_key not in seed_draws:  # seeds first, then items: the hierarchy's order
            seed_draws[seed_key] = _counts(rng, s, samples)
        if label not in item_draws:
            item_draws[label] = _counts(rng, n, samples)
        item_counts.append(item_draws[label])
        seed_counts.append(seed_draws[seed_key])
    mean = 100.0 * float(np.mean([d.mean() for d in diffs]))
    lo, hi = np.percentile(replicates(diffs, item_counts, seed_counts), [2.5, 97.5])
    return round(mean, 3), [round(float(lo), 3), round(float(hi), 3)]


def detection_limit(ci: Sequence[float]) -> float:
    """The smallest drop below the source that the interval could detect: its half-width (R@1 points)."""
    return round((float(ci[1]) - float(ci[0])) / 2.0, 3)


def below_source_claim(delta: float | None, ci: Sequence[float] | None) -> str:
    """What the report says about a row against the source: ``below`` when the whole interval is below zero, else
    ``not below (limit 0.4)``, the detection limit under which a drop would go unseen."""
    if delta is None or ci is None:
        return "–"
    if ci[1] < 0:
        return "below"
    return f"not below (limit {detection_limit(ci):.1f})"
