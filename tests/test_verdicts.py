"""Protocol v4's statistics (hf_tta/benchmarks/verdicts.py), by hand on small cases."""

import math

import numpy as np
import pytest

from hf_tta.benchmarks.verdicts import compare, round_figure, seed_bound, shares, stable, verdict


@pytest.mark.parametrize("lower,upper,word", [
    (-0.49, 1.0, "not below"),      # bound above the margin
    (-0.5, 1.0, "inconclusive"),    # at the margin: not above it
    (-0.5, -0.01, "harm"),          # whole interval below 0, bound at the margin
    (-2.0, 0.0, "inconclusive"),    # the interval touches 0: not harm
    (-2.0, -0.1, "harm"),
    (-0.8, 0.3, "inconclusive"),    # a positive upper end, bound below the margin: not shown non-inferior
    (0.2, 0.9, "not below"),
])
def test_the_three_words(lower, upper, word):
    assert verdict(lower, upper) == word


def test_compare_on_identical_rows_is_exactly_zero_and_not_below():
    diffs = [np.zeros((3, 50)), np.zeros((3, 50))]
    c = compare(diffs, samples=200)
    assert (c.delta, c.lower, c.ci, c.verdict, c.stable) == (0.0, 0.0, (0.0, 0.0), "not below", True)


def test_compare_on_a_row_that_loses_every_fifth_query_is_harm():
    d = np.zeros((3, 100))
    d[:, ::5] = -1  # 20 % of the queries lost in every seed: Δ = -20 R@1; a replicate draws 100 items, so about
    c = compare([d], samples=200)  # -20 +- 2 sd of a binomial share (sd 4 points): the whole interval far below 0
    assert c.delta == pytest.approx(-20.0) and c.ci[0] < -20.0 < c.ci[1] < -5.0 and c.lower < -0.5
    assert c.verdict == "harm" and c.words() == "harm"


def test_an_unstable_verdict_is_said_so():
    # 24 queries lost and 26 gained of 2,000 (Δ +0.1 R@1): with 300 resamples the one-sided bound sits on the margin,
    # so RNG seeds 0-4 disagree (0, 3, 4 "inconclusive", 1, 2 "not below"); 4,000 resamples settle the case
    d = np.zeros((1, 2000))
    d[0, :24], d[0, 24:50] = -1, 1
    c = compare([d], samples=300, seed=0)
    assert c.verdict == "inconclusive" and c.stable is False and c.words() == "inconclusive (unstable over RNG seeds)"
    assert stable([d], "not below", samples=300) is False
    d[0, :20], d[0, 20:50] = -1, 1  # 20 lost, 30 gained: far enough from the margin for every seed
    assert compare([d], samples=300).stable is True


def test_the_seed_level_bound_is_the_one_sided_t_bound():
    assert seed_bound([1.0, 2.0, 3.0]) is None  # fewer than 5 seeds
    x = [1.0, 2.0, 3.0, 4.0, 5.0]  # mean 3, sd sqrt(2.5), t(0.95, 4) = 2.1318...
    assert seed_bound(x) == pytest.approx(3 - 2.131846786 * math.sqrt(2.5) / math.sqrt(5), rel=1e-6)


def test_shares_pooled_mean_of_columns_apart_and_worst_by_hand():
    clean = 100.0
    source = {"a": 50.0, "b": 90.0, "c": 97.0}  # losses 50, 10 and 3 (c is under 5: apart)
    row = {"a": 75.0, "b": 91.0, "c": 96.0}
    s = shares(row, source, clean)
    assert s.pooled == pytest.approx((25 + 1) / (50 + 10))  # 43.3 %
    assert s.mean_of_columns == pytest.approx((25 / 50 + 1 / 10) / 2)  # 30 %
    assert s.pooled_columns == ("a", "b") and s.apart == ("c",)
    assert s.worst == "c" and s.worst_delta == pytest.approx(-1.0)


def test_one_function_rounds():
    assert round_figure(0.4349, percent=True) == "43.5 %" and round_figure(-0.55, sign=True) == "−0.6"
