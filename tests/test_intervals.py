"""The hierarchical paired bootstrap (seeds, then items jointly across columns) and its detection limit."""

from __future__ import annotations

import numpy as np
import pytest

from hf_tta.benchmarks.intervals import below_source_claim, detection_limit, paired_bootstrap, replicates


def test_replicates_by_hand():
    """Two columns, two seeds, three items; two replicates with given draws.
    Replicate 0 draws items (0, 0, 2) and seed 1 twice: column 1 = (1 + 1 + 0) / 3, column 2 = (1 + 1 + 0) / 3,
    mean 2/3. Replicate 1 draws item 1 three times and each seed once: column 1 = (0 + 1) / 2, column 2 = 0,
    mean 1/4."""
    d1 = np.array([[1, 0, 0], [1, 1, 0]])
    d2 = np.array([[0, 0, -1], [1, 0, 0]])
    items = np.array([[2, 0, 1], [0, 3, 0]])
    seeds = np.array([[0, 2], [1, 1]])
    got = replicates([d1, d2], [items, items], [seeds, seeds])
    assert got == pytest.approx([100 * 2 / 3, 25.0])


def test_seeded_bootstrap_is_deterministic_and_its_interval_brackets_the_mean():
    rng = np.random.default_rng(3)
    diffs = [rng.integers(-1, 2, size=(3, 50)) for _ in range(4)]
    a, b = paired_bootstrap(diffs, samples=200, seed=7), paired_bootstrap(diffs, samples=200, seed=7)
    assert a == b
    mean, (lo, hi) = a
    assert mean == pytest.approx(100 * np.mean([d.mean() for d in diffs]), abs=1e-3) and lo < mean < hi
    # identical differences everywhere: the interval is the point
    assert paired_bootstrap([np.ones((2, 10))] * 3) == (100.0, [100.0, 100.0])


def test_joint_item_resampling_is_wider_when_columns_share_hard_items():
    """Four corruption columns with the same per-item differences (an item gained in one column is gained in all):
    independent resampling averages four independent draws (half the width), the joint one does not."""
    rng = np.random.default_rng(0)
    d = (rng.random(400) < 0.2).astype(np.int8)  # +1 on about a fifth of the items
    diffs = [d[None, :]] * 4
    _, (jlo, jhi) = paired_bootstrap(diffs, samples=2000, seed=1)
    _, (ilo, ihi) = paired_bootstrap(diffs, samples=2000, seed=1, joint=False)
    assert (jhi - jlo) > 1.6 * (ihi - ilo)  # sqrt(4) = 2 in expectation


def test_seed_variance_enters_the_interval():
    """Seed 0 gains on every item, seed 1 on none: resampling items alone sees no spread (every item's mean over
    seeds is 0.5); resampling seeds gives the draws {0, 0}, {0, 1}, {1, 1}: the interval spans 0 to 100."""
    diffs = [np.stack([np.ones(30), np.zeros(30)])]
    mean, ci = paired_bootstrap(diffs, samples=500, seed=0)
    assert mean == 50.0 and ci == [0.0, 100.0]


def test_columns_holding_other_items_are_drawn_separately():
    d = np.ones((1, 5))
    with pytest.raises(ValueError, match="same items"):
        paired_bootstrap([d, np.ones((1, 6))], items=["a", "a"])
    with pytest.raises(ValueError, match="columns"):
        paired_bootstrap([d], items=["a", "b"])
    with pytest.raises(ValueError, match="at least one"):
        paired_bootstrap([])
    assert paired_bootstrap([d, np.ones((1, 6))])[0] == 100.0  # other lengths: other items, no shared draw


def test_detection_limit_and_claim():
    assert detection_limit([-0.4, 0.6]) == pytest.approx(0.5)
    assert below_source_claim(0.1, [-0.4, 0.6]) == "not below (limit 0.5)"
    assert below_source_claim(-1.0, [-1.5, -0.5]) == "below"
    assert below_source_claim(None, None) == "–"


def test_non_inferiority_bound_is_the_fifth_percentile_of_the_same_replicates():
    """The one-sided 95 % lower bound is the 5th percentile of the hierarchical bootstrap's replicates: for one
    column of one seed it is the 5th percentile of the mean of n draws of the differences."""
    from hf_tta.benchmarks.intervals import MARGIN, bootstrap_replicates, non_inferiority

    rng = np.random.default_rng(2)
    diffs = [rng.choice([-1, 0, 0, 0, 1], size=(2, 300)) for _ in range(3)]
    mean, reps = bootstrap_replicates(diffs, samples=400, seed=5)
    got = non_inferiority(diffs, samples=400, seed=5)
    assert got.delta == mean and got.lower == pytest.approx(np.percentile(reps, 5.0)) and got.margin == MARGIN == 0.5
    assert got.lower < got.delta < np.percentile(reps, 97.5)
    assert non_inferiority(diffs, samples=400, seed=5) == got  # seeded


@pytest.mark.parametrize(
    ("lost", "gained", "below"),
    [(0, 0, False),  # identical: delta 0, bound 0 > -0.5
     (10, 0, True),  # 10 of 400 lost: delta -2.5, bound about -4: below
     (3, 3, False),  # a wash with 6 of 400 items differing: the bound is what decides (checked in the test)
     ],
)
def test_non_inferiority_verdict_against_the_margin(lost, gained, below):
    from hf_tta.benchmarks.intervals import non_inferiority

    d = np.zeros((1, 400))
    d[0, :lost] = -1
    d[0, lost : lost + gained] = 1
    got = non_inferiority([d], samples=2000, seed=0)
    assert got.delta == pytest.approx(100 * (gained - lost) / 400)
    if (lost, gained) == (3, 3):  # 6 of 400 differ: the bound is about -1.645 * sqrt(6) / 4 = -1.0 R@1
        below = got.lower <= -0.5
        assert got.lower == pytest.approx(-1.645 * np.sqrt(6) / 4, abs=0.3)
    assert got.below is below
    assert got.verdict.startswith("below the source" if below else "not below the source")
    assert ("≤ −0.5" if below else "> −0.5") in got.verdict


def test_paired_bootstrap_no_longer_rounds():
    d = np.zeros((1, 3))
    d[0, 0] = 1
    mean, _ = paired_bootstrap([d], samples=10)
    assert mean == pytest.approx(100 / 3, abs=1e-12) and mean != 33.333  # unrounded


def test_the_draws_are_one_generators_seeds_then_items_in_order_drawn_or_read_back():
    """The memoised draws are exactly one ``default_rng(seed)``'s multinomial counts, seeds before items, each drawn
    once per shared key: the replicates equal :func:`replicates` on draws made by hand, drawn and read back."""
    from hf_tta.benchmarks.intervals import bootstrap_replicates

    rng = np.random.default_rng(3)
    diffs = [rng.integers(-1, 2, size=(2, 30)).astype(float), rng.integers(-1, 2, size=(2, 30)).astype(float),
             rng.integers(-1, 2, size=(2, 20)).astype(float)]
    by_hand = np.random.default_rng(11)
    counts = lambda n: by_hand.multinomial(n, np.full(n, 1.0 / n), size=200)  # noqa: E731
    seeds, items30, items20 = counts(2), counts(30), counts(20)  # the 20-item column's seeds share the first draw
    expected = replicates(diffs, [items30, items30, items20], [seeds, seeds, seeds])
    for _ in range(2):  # drawn, then read back from the cache
        mean, reps = bootstrap_replicates(diffs, samples=200, seed=11)
        assert np.array_equal(reps, expected) and mean == pytest.approx(100 * np.mean([d.mean() for d in diffs]))
