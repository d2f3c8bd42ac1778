"""Protocol v4's statistics: a row against the source model, in three words that do not flip with the RNG seed.

* :func:`compare`: the mean paired difference (row − source, R@1 points, the mean over columns) with its one-sided
  95 % lower bound and two-sided 95 % interval from the hierarchical paired bootstrap of
  :mod:`hf_tta.benchmarks.intervals` (seeds, then query items **jointly** across every column and seed: the same
  resampled items in each), at the registered :data:`RESAMPLES` and :data:`RNG_SEED`.
* :func:`verdict`: **not below** when the lower bound is above ``-margin`` (0.5 R@1); **harm** when the whole
  two-sided interval is below 0 and the lower bound is at or below ``-margin``; **inconclusive** otherwise (a row with
  a positive mean but a wide interval is "not shown non-inferior", not harm).
* :func:`stable` re-draws the bootstrap with the RNG seeds 0-4 for every verdict within :data:`STABLE_DISTANCE` of its
  thresholds: a verdict that changes is printed with its instability (:attr:`Comparison.stable`); a bound within a
  query or two of the margin can flip at any number of resamples, so the tables say so rather than hide it.
* :func:`seed_bound`: next to the joint bound, the one-sided 95 % Student-t lower bound over per-seed mean differences
  where a row has at least :data:`MIN_SEEDS_FOR_T` seeds (with 3 seeds it is far wider than the joint one).
* :func:`shares`: the pooled share of lost recall won back, Σ(row − source) / Σ(clean − source), and the mean of
  per-column shares, over the columns whose source loss is at least :data:`MIN_LOSS` R@1 (the others are listed
  apart); the row's worst column (lowest Δ) with its bound.

Nothing here rounds: :func:`round_figure` (the one rounding function, :func:`hf_tta.benchmarks.figures.figure`) rounds
each figure once, where a table prints it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np

from .figures import figure as round_figure
from .intervals import bootstrap_replicates

__all__ = ["RESAMPLES", "RNG_SEED", "MARGIN", "MIN_LOSS", "Comparison", "compare", "verdict", "seed_bound", "shares",
           "round_figure"]

#: The registered bootstrap (``registrations/default-study.json``): resamples and RNG seed.
RESAMPLES = 4000
RNG_SEED = 20261128
#: The non-inferiority margin (R@1 points).
MARGIN = 0.5
#: Columns whose source model loses less than this (R@1 points, against clean) are listed apart, not pooled.
MIN_LOSS = 5.0
#: A seed-level t bound is printed from this many seeds on.
MIN_SEEDS_FOR_T = 5
VERDICTS = ("not below", "harm", "inconclusive")
#: The RNG seeds a verdict must survive (:func:`stable`).
STABILITY_SEEDS = (0, 1, 2, 3, 4)


def verdict(lower: float, upper: float, margin: float = MARGIN) -> str:
    """``"not below"`` if ``lower > -margin``; ``"harm"`` if ``upper < 0`` and ``lower <= -margin``; else
    ``"inconclusive"``. ``lower`` is the one-sided 95 % bound, ``upper`` the two-sided interval's upper end."""
    if lower > -margin:
        return "not below"
    if upper < 0:
        return "harm"
    return "inconclusive"


@dataclass(frozen=True)
class Comparison:
    """A row against the source over some columns and seeds: ``delta`` (R@1 points), the one-sided 95 % ``lower``
    bound, the two-sided 95 % ``ci``, the ``verdict`` at the registered RNG seed and whether it is the same under
    every :data:`STABILITY_SEEDS` seed (``stable``); unrounded."""

    delta: float
    lower: float
    ci: tuple[float, float]
    verdict: str
    stable: bool = True

    def words(self) -> str:
        """The verdict as printed: with ``(unstable)`` when an RNG seed changes it."""
        return self.verdict if self.stable else f"{self.verdict} (unstable over RNG seeds)"


def _draw(diffs: Sequence[np.ndarray], seed: int, samples: int, margin: float) -> tuple[float, float, tuple[float, float], str]:
    mean, reps = bootstrap_replicates(diffs, samples, seed)
    lower = float(np.percentile(reps, 5.0))
    lo, hi = (float(v) for v in np.percentile(reps, [2.5, 97.5]))
    return mean, lower, (lo, hi), verdict(lower, hi, margin)


#: A verdict whose bounds are farther than this (R@1 points) from the thresholds it is judged at (the lower bound from
#: ``-margin``, the upper end from 0) cannot change with the RNG seed: at 4,000 resamples a percentile moves by a few
#: hundredths of a point between seeds. Only closer verdicts are re-drawn under :data:`STABILITY_SEEDS`.
STABLE_DISTANCE = 0.25


def compare(diffs: Sequence[np.ndarray], samples: int = RESAMPLES, seed: int = RNG_SEED, margin: float = MARGIN,
            check_stability: bool = True) -> Comparison:
    """The :class:`Comparison` of paired differences ``diffs`` (one ``(seeds, items)`` 0/±1 array per column: row hit −
    source hit of the same query and seed; columns with as many items hold the same items)."""
    mean, lower, ci, word = _draw(diffs, seed, samples, margin)
    near = abs(lower + margin) < STABLE_DISTANCE or (lower <= -margin and abs(ci[1]) < STABLE_DISTANCE)
    ok = stable(diffs, word, samples, margin) if check_stability and near else True
    return Comparison(mean, lower, ci, word, ok)


def stable(diffs: Sequence[np.ndarray], word: str, samples: int = RESAMPLES, margin: float = MARGIN) -> bool:
    """Whether the verdict is ``word`` under every RNG seed of :data:`STABILITY_SEEDS`."""
    return all(_draw(diffs, s, samples, margin)[3] == word for s in STABILITY_SEEDS)


def seed_bound(per_seed: Sequence[float], confidence: float = 0.95) -> float | None:
    """The one-sided Student-t lower bound of the mean of per-seed differences (``mean - t_{conf, n-1} s / sqrt(n)``),
    or ``None`` with fewer than :data:`MIN_SEEDS_FOR_T` seeds."""
    x = np.asarray(per_seed, dtype=np.float64)
    if x.size < MIN_SEEDS_FOR_T:
        return None
    from scipy.stats import t

    return float(x.mean() - t.ppf(confidence, x.size - 1) * x.std(ddof=1) / math.sqrt(x.size))


@dataclass(frozen=True)
class Shares:
    """Shares of lost recall won back over the pooled columns (a ratio of sums, and the mean of per-column shares),
    the columns left out for a source loss under :data:`MIN_LOSS`, and the worst column (lowest Δ) with its Δ."""

    pooled: float
    mean_of_columns: float
    pooled_columns: tuple
    apart: tuple
    worst: tuple
    worst_delta: float


def shares(row: Mapping[tuple, float], source: Mapping[tuple, float], clean: float, min_loss: float = MIN_LOSS) -> Shares:
    """``row`` and ``source``: R@1 per column (means over seeds, same columns); ``clean``: the source's clean R@1.
    Pooled share Σ(row − source) / Σ(clean − source) and the mean of (row − source) / (clean − source) over the columns
    whose source loss ``clean − source`` is at least ``min_loss``; those under it are listed in ``apart``."""
    cols = [c for c in source if c in row]
    pooled = tuple(c for c in cols if clean - source[c] >= min_loss)
    apart = tuple(c for c in cols if clean - source[c] < min_loss)
    lost = sum(clean - source[c] for c in pooled)
    won = sum(row[c] - source[c] for c in pooled)
    per = [(row[c] - source[c]) / (clean - source[c]) for c in pooled]
    worst = min(cols, key=lambda c: row[c] - source[c])
    return Shares(won / lost if lost > 0 else math.nan, float(np.mean(per)) if per else math.nan, pooled, apart, worst,
                  row[worst] - source[worst])
