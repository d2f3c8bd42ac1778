"""The one place a benchmark figure is rounded: every table, card and summary prints through :func:`figure`.

Figures are computed unrounded (R@1 from per-query hits, shares as ratios of sums, bootstrap bounds) and rounded
once, here, when printed: a value rounded to 3 decimals and then to 1 can land on the other side of a half
(19.049 → 19.05 → "19.1"), which is why nothing upstream rounds. Halves round to even after exact decimal
conversion of the float (:class:`decimal.Decimal`), so the printed digit is that of the value, not of its binary
neighbour.
"""

from __future__ import annotations

from decimal import ROUND_HALF_EVEN, Decimal


def figure(value: float | None, digits: int = 1, sign: bool = False, percent: bool = False, missing: str = "–") -> str:
    """``value`` rounded once to ``digits`` decimals; ``sign``: a leading + or − (U+2212); ``percent``: a share
    (a fraction) printed as a percentage with a % sign; ``None`` or NaN prints ``missing``.

    >>> figure(19.049), figure(-0.53, sign=True), figure(0.3025, percent=True), figure(None)
    ('19.0', '−0.5', '30.2 %', '–')
    """
    if value is None or value != value:
        return missing
    x = Decimal(float(value) * (100 if percent else 1))
    q = x.quantize(Decimal(1).scaleb(-digits), rounding=ROUND_HALF_EVEN)
    if q == 0:
        q = abs(q)  # no "-0.0"
    text = f"{abs(q):.{digits}f}"
    if q < 0:
        text = "−" + text
    elif sign:
        text = "+" + text
    return text + (" %" if percent else "")


def interval(lo: float, hi: float, digits: int = 1) -> str:
    """A 95 % interval, each bound rounded once: ``[−0.9, +0.3]``."""
    return f"[{figure(lo, digits, sign=True)}, {figure(hi, digits, sign=True)}]"
