"""Retrieval metrics from top-k results (:class:`hf_tta.gallery.TopKScores`), for galleries too large for a dense
score matrix.

Ranks follow the dense metric's pessimistic convention: a relevant item's rank is ``1 + #{other items scoring >= it}``.
Within the top-k this is exact whenever no item outside the top-k scores exactly the k-th value (a tie straddling the
cut-off); a relevant item outside the top-k has a rank ``> k`` that the results cannot tell, so ``R@K`` needs ``K <= k``,
and the median rank is reported only when it lies inside the top-k (``inf`` otherwise). No mAP (it needs every rank).
"""

from __future__ import annotations

from typing import Iterable

import torch

from ..gallery.base import TopKScores
from .recall import Relevance, relevance_to_index


def topk_relevant_ranks(topk: TopKScores, relevant: Relevance) -> torch.Tensor:
    """Best (smallest) pessimistic rank of each query's relevant items within its top-k: ``(B,)``, ``inf`` if none of
    them is in the top-k."""
    values, indices = topk.values.float(), topk.indices
    values = torch.nan_to_num(values, nan=float("-inf"))  # NaN ranks last, as in the dense metric (torch.topk puts it first)
    idx = relevance_to_index(relevant, values.shape[0], device=indices.device)  # (B, R), -1 padding
    if not (idx >= 0).any(dim=1).all():
        bad = int((~(idx >= 0).any(dim=1)).nonzero()[0])
        raise ValueError(f"Query {bad} has no relevant item: every query needs at least one.")
    hit = (indices[:, :, None] == idx[:, None, :]) & (idx[:, None, :] >= 0)  # (B, k, R)
    is_rel = hit.any(dim=2)  # (B, k): which top-k entries are relevant
    # pessimistic rank of entry j: number of top-k entries scoring >= it (itself included)
    ranks = (values[:, None, :] >= values[:, :, None]).sum(-1).float()  # (B, k)
    return ranks.masked_fill(~is_rel, float("inf")).min(dim=1).values


def topk_retrieval_metrics(topk: TopKScores, relevant: Relevance, ks: Iterable[int] = (1, 5, 10)) -> dict[str, float]:
    """R@K (%) and the median rank from top-k results, for every ``K <= k``.

    Args:
        topk (`TopKScores`): each query's ``k`` best items (``TTAOutput.topk``, ``TTAWrapper.adapt_stream`` with a
            top-k gallery backend).
        relevant: each query's relevant gallery items (global indices), as for :func:`hf_tta.retrieval_metrics`.
        ks: the cut-offs, each at most ``k``.

    Example:
        >>> import torch
        >>> from hf_tta.gallery import TopKScores
        >>> top = TopKScores(torch.tensor([[0.9, 0.5], [0.8, 0.7]]), torch.tensor([[3, 7], [1, 4]]))
        >>> topk_retrieval_metrics(top, [[7], [2]], ks=(1, 2))["R@2"]
        50.0
    """
    if not isinstance(topk, TopKScores):
        raise TypeError(f"topk must be a TopKScores (TTAOutput.topk), got {type(topk).__name__}.")
    ks = tuple(int(k) for k in ks)
    if any(k > topk.k or k < 1 for k in ks):
        raise ValueError(
            f"Every cut-off must be between 1 and the results' k={topk.k}, got ks={ks}: search more neighbours."
        )
    best = topk_relevant_ranks(topk, relevant).cpu()
    out = {f"R@{k}": 100.0 * int((best <= k).sum()) / best.numel() for k in ks}
    out["medr"] = best.double().quantile(0.5).item()  # inf when the median relevant item is outside the top-k
    out["num_queries"] = int(best.numel())
    return out
