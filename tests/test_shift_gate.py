"""The shift gate's statistic and rule, by hand on small feature matrices."""

import math

import pytest
import torch

from hf_tta.shift_gate import VARIANCE_FLOOR, ShiftGate, ShiftGateConfig


def _gate(threshold=1.5, min_reference=2):
    gate = ShiftGate(ShiftGateConfig(threshold=threshold, min_reference=min_reference))
    # reference: feature 0 takes 0, 2 (mean 1, unbiased var 2); feature 1 takes 1, 1, ... constant -> var = floor
    gate.fit(torch.tensor([[0.0, 5.0], [2.0, 5.0]]))
    return gate


def test_fit_takes_the_mean_and_the_unbiased_variance():
    gate = _gate()
    assert torch.allclose(gate.mean, torch.tensor([1.0, 5.0], dtype=torch.float64))
    assert torch.allclose(gate.var, torch.tensor([2.0 + VARIANCE_FLOOR, VARIANCE_FLOOR], dtype=torch.float64))


def test_the_statistic_is_the_mean_squared_z_score():
    gate = ShiftGate(ShiftGateConfig(min_reference=2))
    gate.fit(torch.tensor([[0.0, 0.0], [2.0, 4.0]]))  # means (1, 2), variances (2, 8)
    batch = torch.tensor([[3.0, 2.0], [1.0, 6.0]])
    # query 1: (3-1)^2/2 = 2, (2-2)^2/8 = 0 -> 1;  query 2: 0, (6-2)^2/8 = 2 -> 1;  T = 1
    assert gate.statistic(batch) == pytest.approx(1.0, rel=1e-9)
    assert gate.statistic(torch.tensor([[5.0, 2.0]])) == pytest.approx((16 / 2 + 0) / 2, rel=1e-9)  # 4


@pytest.mark.parametrize("statistic,open_", [(1.4, False), (1.5, False), (1.6, True)])
def test_the_gate_opens_strictly_above_its_threshold(statistic, open_):
    assert _gate(1.5).is_open(statistic) is open_


def test_without_a_reference_the_gate_stays_open_and_says_so_once(caplog):
    gate = ShiftGate(ShiftGateConfig())
    t = gate.statistic(torch.zeros(4, 3))
    assert math.isnan(t)
    with caplog.at_level("WARNING", logger="hf_tta.shift_gate"):
        assert gate.is_open(t) and gate.is_open(t)
    assert sum("fit_shift_gate" in r.message for r in caplog.records) == 1


@pytest.mark.parametrize("features,match", [
    (torch.zeros(3, 2), "pass at least 32"),
    (torch.full((40, 2), float("nan")), "non-finite"),
    (torch.zeros(40), r"\(N, D\)"),
])
def test_a_bad_reference_is_refused_and_changes_nothing(features, match):
    gate = ShiftGate(ShiftGateConfig())
    with pytest.raises(ValueError, match=match):
        gate.fit(features)
    assert not gate.fitted


def test_a_batch_of_another_width_is_refused():
    with pytest.raises(ValueError, match="another model"):
        _gate().statistic(torch.zeros(2, 3))


def test_the_reference_round_trips_through_state_tensors():
    gate, other = _gate(), ShiftGate(ShiftGateConfig(min_reference=2))
    other.load_state_tensors(gate.state_tensors())
    assert torch.equal(other.mean, gate.mean) and torch.equal(other.var, gate.var) and other.count == 2
    other.load_state_tensors({})
    assert not other.fitted


@pytest.mark.parametrize("kwargs,match", [({"threshold": 0}, "threshold"), ({"min_reference": 1}, "at least 2")])
def test_bad_settings_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ShiftGateConfig(**kwargs)
