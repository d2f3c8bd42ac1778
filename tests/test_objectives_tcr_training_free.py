"""Training-free TCR (hf_tta/objectives/tcr_training_free.py; TCR App. C, Eq. 12-13), by hand."""

from __future__ import annotations

import math

import torch

from hf_tta.objectives import build_objective
from hf_tta.objectives.tcr_training_free import rectify_queries
from objective_helpers import embedding_inputs

R = math.sqrt(0.5)  # distance of each query to the query centre (0.5, 0.5)


def test_training_free_rectification_eq12_eq13():
    zq = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    zg = torch.tensor([[1.0, 0.0], [1.0, 0.0]])
    delta_s = torch.tensor(R / 2)
    # centre c = (.5,.5); scaled = c + 2 (z - c) = (1.5,-.5), (-.5,1.5); Delta_T = R;
    # offset = (1 - 0.5) * ((1,0) - c) = (.25,-.25)
    expected = torch.nn.functional.normalize(torch.tensor([[1.75, -0.75], [-0.25, 1.25]]), dim=1)
    assert torch.allclose(rectify_queries(zq, zg, delta_s, 2.0), expected, atol=1e-6)


def test_training_free_objective_changes_scores_not_parameters():
    torch.manual_seed(3)
    zq = torch.nn.functional.normalize(torch.randn(6, 4), dim=1)
    gallery = torch.nn.functional.normalize(torch.randn(12, 4), dim=1)
    obj = build_objective("tcr_training_free")
    out = obj(embedding_inputs(zq, gallery), obj.init_state())
    assert out.loss is None and out.scores.shape == (6, 12)
    assert not torch.allclose(out.scores, zq @ gallery.T)
