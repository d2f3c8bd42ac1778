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
