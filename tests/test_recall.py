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


def brute_force(scores: torch.Tensor, relevant: list[list[int]], ks=(1, 5, 10)) -> dict:
    """Reference: sort each row by (score descending, irrelevant before relevant) — the pessimistic order — in Python,
    and read ranks off the sorted list."""
    best, aps = [], []
    for row, rel in zip(scores.tolist(), relevant):
        rel = set(rel)
        order = sorted(range(len(row)), key=lambda j: (-row[j], j in rel, j))
        ranks = sorted(order.index(j) + 1 for j in rel)
        best.append(ranks[0])
        aps.append(sum((k + 1) / r for k, r in enumerate(ranks)) / len(ranks))
    n = len(best)
    out = {f"R@{k}": 100.0 * sum(b <= k for b in best) / n for k in ks}
    out.update(meanr=sum(best) / n, mAP=100.0 * sum(aps) / n, num_queries=n)
    return out


def test_constant_scores_give_zero_recall_at_one():
    # a collapsed model: every score equal -> every irrelevant item ties with the relevant one and ranks before it
    m = retrieval_metrics(torch.zeros(6, 10), torch.arange(6))
    assert m["R@1"] == 0.0 and m["R@5"] == 0.0 and m["R@10"] == 100.0
    assert m["medr"] == 10.0 and m["meanr"] == 10.0 and m["mAP"] == pytest.approx(10.0)
    # a single-item gallery is the one exception: nothing can rank before the relevant item
    assert retrieval_metrics(torch.zeros(3, 1), torch.zeros(3, dtype=torch.long))["R@1"] == 100.0
    # every item relevant: all ties are with relevant items, so the best rank is 1
    assert retrieval_metrics(torch.zeros(2, 4), torch.ones(2, 4, dtype=torch.bool))["R@1"] == 100.0


def test_tie_case_by_hand():
    # q0: relevant 1 (0.5) ties with irrelevant 0 and 3 -> rank 1 + #{0.9, 0.5, 0.5} = 4
    # q1: relevant {0, 2} both 0.7, irrelevant 1 at 0.7 ahead -> ranks 2 and 3; AP = (1/2 + 2/3) / 2
    scores = torch.tensor([[0.5, 0.5, 0.9, 0.5], [0.7, 0.7, 0.7, 0.1]])
    m = retrieval_metrics(scores, [[1], [0, 2]], ks=(1, 2, 4))
    assert m["R@1"] == 0.0 and m["R@2"] == 50.0 and m["R@4"] == 100.0
    assert m["meanr"] == 3.0 and m["medr"] == 3.0
    assert m["mAP"] == pytest.approx(100 * (1 / 4 + (1 / 2 + 2 / 3) / 2) / 2)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_quantised_scores_match_brute_force(seed):
    g = torch.Generator().manual_seed(seed)
    scores = (torch.rand(30, 17, generator=g) / 0.05).round() * 0.05  # 21 distinct values: many ties
    relevant = [sorted({int(i) for i in torch.randint(0, 17, (1 + q % 4,), generator=g)}) for q in range(30)]
    got = retrieval_metrics(scores, relevant)
    ref = brute_force(scores, relevant)
    for key, value in ref.items():
        assert got[key] == pytest.approx(value, abs=1e-12), key
    # chunked accumulation gives the same numbers
    acc = RetrievalMetricAccumulator()
    for start in range(0, 30, 8):
        acc.update(scores[start : start + 8], relevant[start : start + 8])
    assert acc.compute() == got


def test_nan_scores_rank_last_and_repeats_count_once():
    scores = torch.tensor([[float("nan"), 0.1, 0.2], [0.3, 0.2, 0.1]])
    m = retrieval_metrics(scores, [[0], [0, 0]], ks=(1, 3))
    assert m["R@1"] == 50.0 and m["R@3"] == 100.0 and m["meanr"] == 2.0
    assert m["mAP"] == pytest.approx(100 * (1 / 3 + 1) / 2)


def test_exact_arithmetic():
    scores = torch.eye(5)
    m = retrieval_metrics(scores, torch.tensor([0, 0, 0, 0, 0]), ks=(1,))  # one hit in five queries
    assert m["R@1"] == 20.0 and type(m["R@1"]) is float
    assert type(m["num_queries"]) is int and m["num_queries"] == 5
    assert type(m["meanr"]) is float and type(m["mAP"]) is float and type(m["medr"]) is float
    m3 = retrieval_metrics(torch.eye(3), torch.tensor([0, 1, 0]), ks=(1,))
    assert m3["R@1"] == 100.0 * 2 / 3  # the float64 value, bit for bit


def test_numpy_and_nested_bool_masks_are_masks_not_indices():
    import numpy as np

    scores = torch.tensor([[0.1, 0.9, 0.3, 0.2], [0.8, 0.1, 0.2, 0.3]])
    mask = torch.tensor([[False, False, True, False], [True, False, False, False]])
    want = retrieval_metrics(scores, mask)
    assert want["R@1"] == 50.0  # query 1's item 0 is its top-1; query 0's item 2 is second
    for form in (mask.numpy(), mask.tolist(), [[bool(x) for x in row] for row in mask.numpy()]):
        assert retrieval_metrics(scores, form) == want  # before: True/False were read as indices 1/0 (R@1 100)
    assert retrieval_metrics(scores, np.array([[2], [0]])) == want
    with pytest.raises(ValueError, match="3 columns but the gallery has 4"):
        retrieval_metrics(scores, mask[:, :3])
    with pytest.raises(ValueError, match="rectangular"):
        retrieval_metrics(scores, [[False, True, False, False], [True]])
    with pytest.raises(ValueError, match=">= 0"):
        retrieval_metrics(scores, [[2, -3], [0]])
    with pytest.raises(ValueError, match=">= 1"):
        retrieval_metrics(scores, mask, ks=(0,))


def test_topk_metric_ranks_nan_last_like_the_dense_metric():
    from hf_tta.gallery import TopKScores
    from hf_tta.metrics import topk_retrieval_metrics

    nan = float("nan")
    top = TopKScores(torch.tensor([[nan, nan, nan], [0.9, 0.5, 0.1]]), torch.tensor([[0, 1, 2], [3, 4, 5]]))
    m = topk_retrieval_metrics(top, [[0], [3]], ks=(1,))
    assert m["R@1"] == 50.0  # the all-NaN row has no hit (before: 100, NaN counted as the best score)
    dense = torch.full((2, 6), -1.0)
    dense[0, :3] = nan
    dense[1, 3:] = torch.tensor([0.9, 0.5, 0.1])
    assert retrieval_metrics(dense, [[0], [3]], ks=(1,))["R@1"] == 50.0
