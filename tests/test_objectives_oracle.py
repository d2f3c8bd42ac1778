"""The supervised oracle (hf_tta/objectives/oracle.py): -log of the softmax mass on the relevant items, by hand."""

from __future__ import annotations

import math

import pytest
import torch

from hf_tta.objectives import build_objective
from objective_helpers import score_inputs


def test_oracle_cross_entropy_over_all_relevant_items():
    """Row 0 has two relevant items (0 and 2), row 1 one (item 1), row 2 none (left out). tau = 1 for readable numbers:
    L = mean(-log(p_00 + p_02), -log p_11)."""
    s = torch.tensor([[1.0, 0.0, 0.5], [0.0, 2.0, 0.0], [0.3, 0.2, 0.1]], dtype=torch.float64)
    labels = torch.tensor([[True, False, True], [False, True, False], [False, False, False]])
    oracle = build_objective("oracle", {"tau": 1.0})
    out = oracle(score_inputs(s, labels=labels), {})
    z0, z1 = math.exp(1) + 1 + math.exp(0.5), 2 + math.exp(2)
    expected = (-math.log((math.exp(1) + math.exp(0.5)) / z0) - math.log(math.exp(2) / z1)) / 2
    assert out.n_selected == 2 and out.loss.item() == pytest.approx(expected, abs=1e-12)


def test_oracle_refuses_missing_or_misshapen_labels():
    oracle = build_objective("oracle")
    s = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="supervised"):
        oracle(score_inputs(s), {})
    with pytest.raises(ValueError, match="mask of shape"):
        oracle(score_inputs(s, labels=torch.ones(2, 2, dtype=torch.bool)), {})
    out = oracle(score_inputs(s, labels=torch.zeros(2, 3, dtype=torch.bool)), {})
    assert out.n_selected == 0 and out.loss is None
