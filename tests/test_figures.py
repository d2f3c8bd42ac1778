"""The one function that rounds a benchmark figure, once."""

from __future__ import annotations

import pytest

from hf_tta.benchmarks.figures import figure, interval


@pytest.mark.parametrize(
    ("value", "kwargs", "text"),
    [
        (19.049, {}, "19.0"),  # rounded once: 19.049 -> "19.0" (rounding to 19.05 first would give "19.1")
        (4.349, {}, "4.3"),
        (17.35, {}, "17.4"),  # the float 17.35 is 17.350000000000001...: its digit, not a double rounding's
        (0.25, {"digits": 1}, "0.2"),  # an exact half rounds to even
        (-0.53, {"sign": True}, "−0.5"),
        (0.53, {"sign": True}, "+0.5"),
        (-0.04, {"sign": True}, "+0.0"),  # no "−0.0"
        (0.3025, {"percent": True}, "30.2 %"),
        (0.38, {"percent": True, "digits": 0}, "38 %"),
        (None, {}, "–"),
        (float("nan"), {}, "–"),
    ],
)
def test_figure(value, kwargs, text):
    assert figure(value, **kwargs) == text


def test_interval():
    assert interval(-0.91, 0.34) == "[−0.9, +0.3]"
