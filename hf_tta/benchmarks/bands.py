"""Where methods can act: how much of its clean recall the source model keeps on a stream.

A stream where the source keeps almost nothing (contrast 5: 0.1 of 96.4) or almost everything (Gaussian noise 5:
94.0) cannot tell methods apart. Two uses:

* the report's table of the share of lost recall won back per **band** of kept recall (:data:`KEPT_BANDS`: under
  25 %, 25-50 %, 50-75 %, over 75 % of clean), a ratio of sums over the columns in each band
  (:func:`won_back_by_band`);
* the **rule** that picks the default grid's image corruption for each ImageNet-C family
  (:func:`choose_representatives`): among the family's corruptions at severities 1-5, the (corruption, severity)
  whose source R@1 keeps between a quarter and three quarters of the clean R@1, closest to half; ties go to the lower
  severity, then to the earlier corruption in ImageNet-C's order. It reads the source model's rows only, never a
  method's: the grid is fixed before any method is seen on it.
"""

from __future__ import annotations

import logging
import math
from typing import Mapping, Sequence

from .grid import SOURCE

logger = logging.getLogger(__name__)

#: (lower, upper, label) of the kept-recall bands, source R@1 / clean R@1, lower bound included.
KEPT_BANDS = ((0.0, 0.25, "under 25 %"), (0.25, 0.5, "25–50 %"), (0.5, 0.75, "50–75 %"), (0.75, math.inf, "over 75 %"))
#: The band and the target of the representatives' rule.
RULE_BAND = (0.25, 0.75)
RULE_TARGET = 0.5


def kept_band(source: float, clean: float) -> int:
    """The index in :data:`KEPT_BANDS` of a stream where the source gets ``source`` R@1 against ``clean``."""
    if clean <= 0:
        raise ValueError(f"The clean R@1 must be positive to share recall out, got {clean}.")
    kept = source / clean
    return next(i for i, (lo, hi, _) in enumerate(KEPT_BANDS) if lo <= kept < hi or (i == 0 and kept < lo))


def won_back_by_band(
    method: Sequence[float | None], source: Sequence[float | None], clean: Sequence[float | None], min_lost: float = 1.0
) -> list[dict]:
    """Per band: the columns in it, their share of the row's lost recall, and the share won back,
    ``Σ (method − source) / Σ (clean − source)`` over those columns (``None`` where nothing was lost, or a value is
    missing). Columns with no clean reference or with less than ``min_lost`` points lost are left out."""
    bands = [{"label": label, "columns": [], "gain": 0.0, "lost": 0.0, "complete": True} for *_, label in KEPT_BANDS]
    for i, (m, s, c) in enumerate(zip(method, source, clean)):
        if c is None or s is None or c - s < min_lost:
            continue
        band = bands[kept_band(s, c)]
        band["columns"].append(i)
        band["lost"] += c - s
        if m is None:
            band["complete"] = False
        else:
            band["gain"] += m - s
    total = sum(b["lost"] for b in bands)
    return [
        {
            "label": b["label"],
            "columns": b["columns"],
            "loss_share": b["lost"] / total if total > 0 else None,
            "won_back": b["gain"] / b["lost"] if b["columns"] and b["complete"] else None,
        }
        for b in bands
    ]


def source_recall(rows: Sequence[Mapping], direction: str = "i2t", metric: str = "R@1") -> tuple[float, dict]:
    """The source model's clean R@1 and its R@1 per (shift, severity), each the mean over seeds, from the
    ``source`` rows only (any other row is ignored)."""
    per: dict[tuple, list[float]] = {}
    for r in rows:
        if r.get("objective") != SOURCE or r.get("direction") != direction or "error" in r or metric not in r:
            continue
        per.setdefault((r["shift"], r.get("severity")), []).append(float(r[metric]))
    clean = per.pop(("clean", None), None)
    if not clean:
        raise ValueError(f"No clean {direction} source row: the rule needs the clean R@1 (run the clean stream's source row).")
    return sum(clean) / len(clean), {k: sum(v) / len(v) for k, v in per.items()}


def choose_representatives(
    rows: Sequence[Mapping], families: Mapping[str, str] | None = None, direction: str = "i2t"
) -> dict[str, dict]:
    """The default grid's stream of each family by the stated rule (module docstring), from the source rows.

    Args:
        rows: benchmark rows; only ``objective == "source"`` rows of ``direction`` are read.
        families: corruption -> family, in the order ties are broken (default: ImageNet-C's categories).

    Returns: family -> ``{"corruption", "severity", "R@1", "kept", "in_band"}``. A family with no stream in the band
    gets its stream closest to half all the same, with ``in_band=False`` (and a warning)."""
    if families is None:
        from ..data.corruptions import IMAGE_CORRUPTION_CATEGORIES as families
    clean, recall = source_recall(rows, direction)
    order = {name: i for i, name in enumerate(families)}
    out = {}
    for family in dict.fromkeys(families.values()):
        candidates = [(shift, sev, r1) for (shift, sev), r1 in recall.items() if families.get(shift) == family]
        if not candidates:
            raise ValueError(f"No source row for the {family} family ({direction}): run its corruptions' source rows.")
        lo, hi = RULE_BAND

        def key(c):
            return (round(abs(c[2] / clean - RULE_TARGET), 9), c[1], order[c[0]])  # rounded: equal distances tie

        inside = [c for c in candidates if lo <= c[2] / clean <= hi]
        shift, sev, r1 = min(inside or candidates, key=key)
        if not inside:
            logger.warning("No %s stream keeps %d-%d %% of the clean R@1: %s %s is the closest to half (%.1f %%).",
                           family, 100 * lo, 100 * hi, shift, sev, 100 * r1 / clean)
        out[family] = {"corruption": shift, "severity": sev, "R@1": r1, "kept": r1 / clean, "in_band": bool(inside)}
    return out
