"""REST (hf_tta/objectives/rest.py): candidate set, k-means centroids, hard mining and the objective's state, on small
tensors against values derived by hand."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from hf_tta.objectives import build_objective, softmax_entropy
from hf_tta.objectives.rest import (
    MASKED_LOGIT,
    candidate_indices,
    centroid_score_scale,
    centroid_scores,
    hard_mining_loss,
    spherical_kmeans,
)
from objective_helpers import score_inputs


def test_rest_candidate_set_eq4():
    # 3 queries, 5 items, K = 2: top-2 of q0 = (0, 1), q1 = (1, 2), q2 = (0, 4)
    s = torch.tensor([[0.9, 0.8, 0.1, 0.0, 0.2], [0.1, 0.9, 0.8, 0.0, 0.2], [0.9, 0.1, 0.0, 0.2, 0.8]])
    idx, rep = candidate_indices(s, 2)
    assert idx.tolist() == [[0, 1, 2, 0, 4], [1, 0, 1, 0, 4], [0, 0, 1, 1, 2]]
    # a union: later copies (and copies of the positive) are masked, the positive never is
    assert rep.tolist() == [
        [False, False, False, True, False],
        [False, False, True, True, False],
        [False, True, False, True, False],
    ]


def test_rest_kmeans_and_centroid_scores():
    g = F.normalize(torch.tensor([[1.0, 0.1, 0], [1.0, -0.1, 0], [0, 1.0, 0.1], [0, 1.0, -0.1], [0.1, 0, 1.0]]), dim=1)
    centroids, labels = spherical_kmeans(g, 3, torch.Generator().manual_seed(0))
    assert labels[0] == labels[1] and labels[2] == labels[3] and len(set(labels.tolist())) == 3
    # centroid scores from the gallery scores equal the cosine with the normalised centroid
    q = F.normalize(torch.randn(4, 3), dim=1)
    scale = centroid_score_scale(g, labels, 3)
    assert torch.allclose(centroid_scores(q @ g.T, labels, scale), q @ centroids.T, atol=1e-6)
    # deterministic with the same generator
    assert torch.equal(spherical_kmeans(g, 3, torch.Generator().manual_seed(0))[1], labels)


def test_rest_hard_mining_eq14():
    sims = torch.tensor([[0.8, 0.6, 0.2], [0.5, 0.4, 0.45]], requires_grad=True)
    masked = torch.tensor([[False, False, False], [False, False, True]])
    h = hard_mining_loss(sims, sims / 0.02, masked, "affine", 1e-6)
    # row 0: hardest other = 0.6; row 1: 0.45 is masked, so 0.4
    expected = [-math.log(0.9) + math.log(0.8), -math.log(0.75) + math.log(0.7)]
    assert h.tolist() == pytest.approx(expected, abs=1e-6)
    hs = hard_mining_loss(sims, sims / 0.02, masked, "softmax", 1e-6)
    assert hs[0].item() == pytest.approx((0.6 - 0.8) / 0.02, abs=1e-4)  # log p_k - log p_j = (s_k - s_j) / tau


def test_rest_objective_state_logits_and_reset():
    torch.manual_seed(0)
    zq, zg = F.normalize(torch.randn(4, 8), dim=1), F.normalize(torch.randn(30, 8), dim=1)
    zq.requires_grad_(True)
    rest = build_objective("rest", {"num_neighbours": 3, "num_clusters": 4})
    state = rest.init_state()
    out = rest(score_inputs(zq @ zg.T, zq, zg), state)
    assert out.logits.shape == (4, 1 + 3 * 3 + 4) and out.n_selected > 0 and torch.isfinite(out.loss)
    assert torch.equal(out.logits_fn(zq @ zg.T), out.logits)
    p = out.logits.softmax(1)
    assert (p[out.logits == MASKED_LOGIT] == 0).all() and torch.isfinite(softmax_entropy(out.logits)).all()
    assert all(isinstance(v, torch.Tensor) for v in state.values())
    labels = state["kmeans_labels"].clone()
    assert labels.shape == (30,)
    rest(score_inputs(zq @ zg.T, zq, zg), state)  # cached: the same clustering
    assert torch.equal(state["kmeans_labels"], labels)
    zg2 = F.normalize(torch.randn(12, 8), dim=1)
    rest(score_inputs(zq @ zg2.T, zq, zg2), state)  # a new gallery is clustered again
    assert state["kmeans_labels"].shape == (12,)
    out.loss.backward()
    assert zq.grad is not None and torch.isfinite(zq.grad).all()
