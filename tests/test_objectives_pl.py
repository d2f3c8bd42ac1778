"""Pseudo-labelling (hf_tta/objectives/pl.py): the confidence threshold and the cross-entropy, by hand."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hf_tta.objectives import build_objective
from objective_helpers import score_inputs


def test_pl_threshold_and_cross_entropy():
    s = torch.tensor([[2.0, 0.0], [0.5, 0.0], [0.0, 1.0]])
    pl = build_objective("pl", {"tau": 1.0, "threshold": 0.7})
    out = pl(score_inputs(s), {})
    assert out.n_selected == 2 and out.loss.item() == pytest.approx(F.cross_entropy(s[[0, 2]], torch.tensor([0, 1])).item())
