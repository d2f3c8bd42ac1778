"""SHOT (hf_tta/objectives/shot.py): the clustering pseudo-labels and the information-maximisation loss, by hand."""

from __future__ import annotations

import pytest
import torch

from hf_tta.objectives import build_objective, softmax_entropy
from hf_tta.objectives.shot import shot_pseudo_labels
from objective_helpers import score_inputs


def test_shot_pseudo_labels_and_loss():
    s = torch.tensor([[2.0, 0.0], [0.5, 0.0], [0.0, 1.0]])
    # SHOT's pseudo-labels: the features of row 1 sit with row 2's cluster, so it is relabelled although it predicts 0
    feats = torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.05, 1.0]])
    probs = torch.tensor([[0.9, 0.1], [0.6, 0.4], [0.2, 0.8]])
    assert shot_pseudo_labels(feats, probs).tolist() == [0, 1, 1]
    shot = build_objective("shot", {"tau": 1.0, "beta": 0.0})
    out = shot(score_inputs(s), {})
    p = s.softmax(1)
    assert out.loss.item() == pytest.approx((softmax_entropy(s).mean() + (p.mean(0) * (p.mean(0) + 1e-5).log()).sum()).item(), abs=1e-6)
