"""Segment-wise corruption of temporal queries (video frames, audio samples): REST's multi-distribution and
diverse shifts (AudioSet-O / AudioSet-D, REST §3 and Table IV).

- **Multi-distribution shift** (AudioSet-O): with ``k`` corruptions the query is cut into ``k`` equal temporal
  segments (REST says only "split into k segments"; equal lengths are the natural reading) and segment ``i`` gets
  corruption ``i``, in the order given.
- **Diverse shift** (AudioSet-D): the query is cut into ``num_segments`` equal segments and each segment draws its
  corruption uniformly from a pool; the draw of query ``index`` depends only on ``(seed, index)``.

A plan is a list of :class:`Segment` ``(name, level, start, end)`` over the time axis (frames or samples); ``level``
is the severity of a video corruption or the SNR in dB of an audio corruption. :func:`apply_plan` corrupts a copy of
the query segment by segment with a modality's corruption function; segment ``i`` is seeded with
``derive_seed(seed, "segment", i)``.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from .base import derive_seed


@dataclass(frozen=True)
class Segment:
    """Corruption ``name`` at ``level`` on the half-open time span ``[start, end)``."""

    name: str
    level: float
    start: int
    end: int


def segment_bounds(length: int, k: int) -> list[tuple[int, int]]:
    """``k`` contiguous, near-equal ``[start, end)`` spans covering ``range(length)`` (longer ones last)."""
    if k < 1:
        raise ValueError(f"Need at least one segment; got k={k}.")
    if length < k:
        raise ValueError(f"Cannot cut a query of length {length} into {k} non-empty segments.")
    edges = np.floor(np.linspace(0, length, k + 1)).astype(int)
    return [(int(a), int(b)) for a, b in zip(edges[:-1], edges[1:])]


def multi_shift_plan(length: int, corruptions: Sequence[tuple[str, float]]) -> list[Segment]:
    """AudioSet-O: segment ``i`` of ``len(corruptions)`` equal segments gets ``corruptions[i] = (name, level)``."""
    if not corruptions:
        raise ValueError("A multi-distribution shift needs at least one corruption.")
    bounds = segment_bounds(length, len(corruptions))
    return [Segment(str(n), float(lv), s, e) for (n, lv), (s, e) in zip(corruptions, bounds)]


def diverse_shift_plan(
    length: int, pool: Sequence[tuple[str, float]], num_segments: int, seed: int, index: int
) -> list[Segment]:
    """AudioSet-D: each of ``num_segments`` equal segments of query ``index`` draws ``(name, level)`` from ``pool``."""
    if not pool:
        raise ValueError("The pool of corruptions is empty.")
    rng = random.Random(derive_seed(seed, "segments", int(index)))
    draws = [pool[rng.randrange(len(pool))] for _ in range(num_segments)]
    return multi_shift_plan(length, draws)


CorruptFn = Callable[[np.ndarray, str, float, int], np.ndarray]


def apply_plan(x: np.ndarray, plan: Sequence[Segment], corrupt: CorruptFn, seed: int) -> np.ndarray:
    """A corrupted copy of ``x`` (time on axis 0): ``out[s:e] = corrupt(x[s:e], name, level, segment_seed)``.

    Time outside every segment is copied unchanged.
    """
    out = np.array(x, copy=True)
    for i, seg in enumerate(plan):
        if not 0 <= seg.start < seg.end <= x.shape[0]:
            raise ValueError(f"Segment {seg} is outside the query's {x.shape[0]} time steps.")
        out[seg.start : seg.end] = corrupt(x[seg.start : seg.end], seg.name, seg.level, derive_seed(seed, "segment", i))
    return out


__all__ = ["Segment", "apply_plan", "diverse_shift_plan", "multi_shift_plan", "segment_bounds"]
