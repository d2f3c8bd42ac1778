"""Tent (hf_tta/objectives/tent.py): the mean entropy of the softmax over the whole gallery at tau, by hand."""

from __future__ import annotations

import pytest
import torch

from hf_tta.objectives import build_objective
from objective_helpers import entropy_two, score_inputs


def test_tent_mean_entropy_over_the_gallery():
    """Two items, scores differing by 0.02 and 0.0 at tau = 0.01: entropies H(softmax([2, 0])) and ln 2."""
    s = torch.tensor([[0.52, 0.50], [0.3, 0.3]], dtype=torch.float64, requires_grad=True)
    tent = build_objective("tent")
    assert tent.config.tau == 0.01
    out = tent(score_inputs(s), {})
    expected = (entropy_two(2.0) + entropy_two(0.0)) / 2
    assert out.n_selected == 2 and out.loss.item() == pytest.approx(expected, abs=1e-12)
    assert out.temperature == 0.01 and torch.allclose(out.logits, s / 0.01)
    out.loss.backward()  # every query contributes: the uniform row's gradient is 0, the other's is not
    assert s.grad[1].abs().max().item() == pytest.approx(0.0, abs=1e-12) and s.grad[0].abs().max().item() > 0
