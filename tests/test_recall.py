"""Recall@K, ranks and mAP against hand-computed cases and a brute-force argsort reference."""

import pytest
import torch

from hf_tta.metrics import RetrievalMetricAccumulator, relevance_to_index, retrieval_metrics


def test_hand_computed_case():
    scores = torch.tensor([[0.9, 0.1, 0.3], [0.2, 0.8, 0.7], [0.5, 0.6, 0.4]])
    # q0: item 0 ranked 1. q1: item 2 ranked 2. q2: items {2, 0}: ranks 3 and 2 -> best 2.
    m = retrieval_metrics(scores, [[0], [2], [2, 0]], ks=(1, 2))
    assert m["R@1"] == pytest.approx(100 / 3)
    assert m["R@2"] == pytest.approx(100.0)
    assert m["medr"] == 2.0 and m["meanr"] == pytest.approx(5 / 3)
    # AP: q0 = 1; q1 = 1/2; q2 = mean(1/2, 2/3)
    assert m["mAP"] == pytest.approx(100 * (1 + 0.5 + (0.5 + 2 / 3) / 2) / 3)
    assert m["num_queries"] == 3


def test_input_forms_agree():
    scores = torch.randn(5, 9, generator=torch.Generator().manual_seed(0))
    lists = [[0, 3], [1], [8, 2, 5], [4], [7]]
    mask = torch.zeros(5, 9, dtype=torch.bool)
    for i, r in enumerate(lists):
        mask[i, r] = True
    a = retrieval_metrics(scores, lists)
    b = retrieval_metrics(scores, mask)
    c = retrieval_metrics(scores, relevance_to_index(lists, 5))
    assert a == b == c


def test_chunked_equals_full_and_matches_argsort_reference():
    g = torch.Generator().manual_seed(1)
    scores = torch.randn(40, 25, generator=g)
    rel = torch.randint(0, 25, (40, 5), generator=g)  # i2t-like: 5 relevant captions (may repeat)
    full = retrieval_metrics(scores, rel)
    acc = RetrievalMetricAccumulator()
    for start in range(0, 40, 7):
        acc.update(scores[start : start + 7], rel[start : start + 7])
    assert acc.compute() == pytest.approx(full)
    order = scores.argsort(dim=1, descending=True)
    best = torch.tensor([min(int((order[i] == j).nonzero()) for j in rel[i]) for i in range(40)]) + 1
    for k in (1, 5, 10):
        assert full[f"R@{k}"] == pytest.approx(100 * (best <= k).float().mean().item())


def test_t2i_single_relevant_index_vector():
    scores = torch.eye(4) + 0.01
    assert retrieval_metrics(scores, torch.arange(4))["R@1"] == 100.0
    assert retrieval_metrics(scores, torch.tensor([1, 0, 3, 2]))["R@1"] == 0.0


def test_errors():
    with pytest.raises(ValueError, match="no relevant item"):
        retrieval_metrics(torch.randn(2, 3), [[0], []])
    with pytest.raises(ValueError, match="rows"):
        retrieval_metrics(torch.randn(2, 3), [[0]])
    with pytest.raises(ValueError, match="gallery size"):
        retrieval_metrics(torch.randn(2, 3), [[0], [3]])
