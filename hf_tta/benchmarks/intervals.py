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

Protocol v3 declares the claim's margin (:data:`MARGIN`): a row is **not below the source** when the one-sided 95 %
lower bound of (row − source), the 5th percentile of the same replicates, is above −0.5 R@1; otherwise it is
**below the source** (:func:`non_inferiority`). Nothing here rounds: :func:`hf_tta.benchmarks.figures.figure`
rounds each figure once, where it is printed.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Hashable, Sequence

import numpy as np

BOOTSTRAP_SAMPLES = 1000
#: Protocol v3's non-inferiority margin (R@1 points): "not below the source" means the one-sided 95 % lower bound of
#: (row − source), items and seeds resampled jointly, is above ``-MARGIN``.
MARGIN = 0.5


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


@functools.lru_cache(maxsize=64)
def _draws(seed: int, samples: int, sizes: tuple[int, ...]) -> tuple[np.ndarray, ...]:
    """The multiplicities :func:`_counts` draws, in order, from one ``default_rng(seed)`` for each of ``sizes``, as
    read-only arrays (``uint8`` where every count fits: 5 MB for 4,000 draws of 1,275 items). The draws are a function
    of these arguments alone, so the many rows of a card that share a shape and an RNG seed draw them once (drawing
    was most of a card's recomputation)."""
    rng = np.random.default_rng(seed)
    out = []
    for n in sizes:
        a = _counts(rng, n, samples)
        a = a.astype(np.uint8) if a.max(initial=0) < 256 else a
        a.flags.writeable = False
        out.append(a)
    return tuple(out)


def bootstrap_replicates(
    diffs: Sequence[np.ndarray],
    samples: int = BOOTSTRAP_SAMPLES,
    seed: int = 0,
    items: Sequence[Hashable] | None = None,
    joint: bool = True,
) -> tuple[float, np.ndarray]:
    """The mean paired difference (R@1 points, the mean over columns) and its ``(samples,)`` hierarchical bootstrap
    replicates (seeds, then items jointly across columns); the arguments are :func:`paired_bootstrap`'s."""
    diffs = [np.atleast_2d(np.asarray(d, dtype=np.float64)) for d in diffs]
    if not diffs or any(d.size == 0 for d in diffs):
        raise ValueError("paired_bootstrap needs at least one column with at least one seed and one query.")
    labels = list(items) if items is not None else [d.shape[1] for d in diffs]
    if len(labels) != len(diffs):
        raise ValueError(f"items names {len(labels)} columns but diffs has {len(diffs)}.")
    if not joint:
        labels = list(range(len(diffs)))
    index: dict = {}  # ("seeds", key) / ("items", label) -> the index of its draw in ``sizes``
    sizes: list[int] = []  # the draws in the order they are made: seeds first, then items (the hierarchy's order)
    columns = []  # each column's (seed draw, item draw) indices
    for d, label in zip(diffs, labels):
        s, n = d.shape
        seed_key, item_key = ("seeds", (s,) if joint else (label, s)), ("items", label)
        if item_key in index and sizes[index[item_key]] != n:
            raise ValueError(f"Columns labelled {label!r} hold the same items but have {sizes[index[item_key]]} and {n} queries.")
        for key, size in ((seed_key, s), (item_key, n)):
            if key not in index:
                index[key] = len(sizes)
                sizes.append(size)
        columns.append((index[seed_key], index[item_key]))
    drawn = _draws(int(seed), int(samples), tuple(sizes))
    seed_counts, item_counts = [drawn[i] for i, _ in columns], [drawn[j] for _, j in columns]
    mean = 100.0 * float(np.mean([d.mean() for d in diffs]))
    return mean, replicates(diffs, item_counts, seed_counts)


def paired_bootstrap(
    diffs: Sequence[np.ndarray],
    samples: int = BOOTSTRAP_SAMPLES,
    seed: int = 0,
    items: Sequence[Hashable] | None = None,
    joint: bool = True,
) -> tuple[float, list[float]]:
    """Mean paired difference (R@1 points, the mean over columns) and its 95 % hierarchical bootstrap interval,
    unrounded.

    Args:
        diffs: one ``(seeds, queries)`` array per column: method hit − source hit of the same query and seed.
        items: per column, which item set it holds; columns with equal labels are resampled with one shared draw of
            item indices (and must have as many queries). Default: columns with the same number of queries hold the
            same items (true of the benchmark's corruption columns).
        joint: ``False`` resamples every column's seeds and items on its own (columns as independent samples): the
            narrower interval of the former report, kept for comparison.
    """
    mean, reps = bootstrap_replicates(diffs, samples, seed, items, joint)
    lo, hi = np.percentile(reps, [2.5, 97.5])
    return mean, [float(lo), float(hi)]


@dataclass(frozen=True)
class NonInferiority:
    """Protocol v3's verdict on a row against the source: the mean difference ``delta``, the one-sided 95 % lower
    bound ``lower`` (the 5th percentile of the hierarchical bootstrap) and ``margin``; unrounded."""

    delta: float
    lower: float
    margin: float = MARGIN

    @property
    def below(self) -> bool:
        """Below the source: the lower bound does not clear ``-margin``."""
        return self.lower <= -self.margin

    @property
    def verdict(self) -> str:
        from .figures import figure

        word = "below the source" if self.below else "not below the source"
        sign = "≤" if self.below else ">"
        return f"{word} (bound {figure(self.lower, sign=True)} {sign} −{figure(self.margin)})"


def non_inferiority(
    diffs: Sequence[np.ndarray],
    margin: float = MARGIN,
    samples: int = BOOTSTRAP_SAMPLES,
    seed: int = 0,
    items: Sequence[Hashable] | None = None,
) -> NonInferiority:
    """Whether a row is not below the source by the declared margin: the one-sided 95 % lower bound of the mean
    difference (items and seeds resampled jointly, as :func:`paired_bootstrap`) against ``-margin``."""
    mean, reps = bootstrap_replicates(diffs, samples, seed, items)
    return NonInferiority(mean, float(np.percentile(reps, 5.0)), margin)


def detection_limit(ci: Sequence[float]) -> float:
    """The smallest drop below the source that the interval could detect: its half-width (R@1 points)."""
    return (float(ci[1]) - float(ci[0])) / 2.0


def below_source_claim(delta: float | None, ci: Sequence[float] | None) -> str:
    """What the report says about a row against the source: ``below`` when the whole interval is below zero, else
    ``not below (limit 0.4)``, the detection limit under which a drop would go unseen."""
    if delta is None or ci is None:
        return "–"
    from .figures import figure

    if ci[1] < 0:
        return "below"
    return f"not below (limit {figure(detection_limit(ci))})"
