"""Retrieval metrics from a score matrix with several relevant items per query.

``R@K`` is the percentage of queries with at least one relevant item in their top ``K`` (the COCO/Flickr
convention, "hit rate"); ``medr``/``meanr`` are the median/mean rank (1-based) of the best-ranked relevant item;
``mAP`` is the mean over queries of average precision over all their relevant items. Percentages, as in the
papers' tables. Works on the whole matrix or chunk by chunk (:class:`RetrievalMetricAccumulator`) so a
25k x 5k COCO matrix never has to be held at once.
"""

from __future__ import annotations

from typing import Iterable, Sequence

import torch

Relevance = torch.Tensor | Sequence[Sequence[int]] | Sequence[int]


def relevance_to_index(relevant: Relevance, num_queries: int, device=None) -> torch.Tensor:
    """Relevant gallery indices as a ``(B, R)`` long tensor padded with ``-1``.

    Accepts a ``(B, N)`` boolean mask, a ``(B,)`` or ``(B, R)`` index tensor (``-1`` = padding), or a list of
    lists of indices (ragged).
    """
    if isinstance(relevant, torch.Tensor):
        if relevant.dtype == torch.bool:
            if relevant.dim() != 2:
                raise ValueError(f"A relevance mask must be (queries, gallery); got {tuple(relevant.shape)}.")
            counts = relevant.sum(1)
            r = int(counts.max().item()) if relevant.numel() else 0
            idx = torch.full((relevant.shape[0], max(r, 1)), -1, dtype=torch.long, device=relevant.device)
            rows, cols = relevant.nonzero(as_tuple=True)
            # position of each hit within its row
            offsets = torch.cumsum(relevant.long(), dim=1)[rows, cols] - 1
            idx[rows, offsets] = cols
            out = idx
        else:
            out = relevant.long()
            if out.dim() == 1:
                out = out[:, None]
    else:
        rows = [[int(r)] if not hasattr(r, "__len__") else [int(x) for x in r] for r in relevant]
        width = max((len(r) for r in rows), default=1) or 1
        out = torch.full((len(rows), width), -1, dtype=torch.long)
        for i, r in enumerate(rows):  # list input only: the ragged → padded conversion, done once
            if r:
                out[i, : len(r)] = torch.tensor(r, dtype=torch.long)
    if out.shape[0] != num_queries:
        raise ValueError(f"Relevance has {out.shape[0]} rows but the scores have {num_queries} queries.")
    if device is not None:
        out = out.to(device)
    return out


def relevant_ranks(scores: torch.Tensor, relevant: Relevance) -> tuple[torch.Tensor, torch.Tensor]:
    """1-based rank of every relevant item of every query: ``(B, R)`` with ``inf`` at padding, plus the mask.

    The rank of item ``j`` is ``1 + #{items scored strictly higher}`` (ties resolved in the item's favour).
    """
    if scores.dim() != 2:
        raise ValueError(f"scores must be (queries, gallery); got shape {tuple(scores.shape)}.")
    idx = relevance_to_index(relevant, scores.shape[0], device=scores.device)
    valid = idx >= 0
    if (idx >= scores.shape[1]).any():
        raise ValueError(f"A relevant index is >= the gallery size {scores.shape[1]}.")
    if not valid.any(dim=1).all():
        bad = int((~valid.any(dim=1)).nonzero()[0])
        raise ValueError(f"Query {bad} has no relevant item: every query needs at least one.")
    rel_scores = scores.gather(1, idx.clamp(min=0))  # (B, R)
    ranks = (scores[:, None, :] > rel_scores[:, :, None]).sum(-1).float() + 1  # (B, R)
    return ranks.masked_fill(~valid, float("inf")), valid


class RetrievalMetricAccumulator:
    """Accumulates per-query best rank and average precision over chunks of score rows."""

    def __init__(self, ks: Iterable[int] = (1, 5, 10)):
        self.ks = tuple(int(k) for k in ks)
        self._best: list[torch.Tensor] = []
        self._ap: list[torch.Tensor] = []

    def update(self, scores: torch.Tensor, relevant: Relevance) -> None:
        scores = scores.detach().float()
        ranks, valid = relevant_ranks(scores, relevant)
        self._best.append(ranks.min(dim=1).values.cpu())
        sorted_ranks, _ = ranks.sort(dim=1)  # padding (inf) goes last
        pos = torch.arange(1, ranks.shape[1] + 1, device=ranks.device, dtype=torch.float)
        precision = pos / sorted_ranks  # precision at the k-th relevant item; 0 at padding
        n_rel = valid.sum(1).float()
        self._ap.append((precision.sum(1) / n_rel).cpu())

    def compute(self) -> dict[str, float]:
        if not self._best:
            raise ValueError("No scores were added.")
        best = torch.cat(self._best)
        out = {f"R@{k}": 100.0 * (best <= k).float().mean().item() for k in self.ks}
        out["medr"] = best.quantile(0.5).item()
        out["meanr"] = best.mean().item()
        out["mAP"] = 100.0 * torch.cat(self._ap).mean().item()
        out["num_queries"] = int(best.numel())
        return out


def retrieval_metrics(scores: torch.Tensor, relevant: Relevance, ks: Iterable[int] = (1, 5, 10)) -> dict[str, float]:
    """R@K (%), median/mean rank and mAP (%) of a ``(queries, gallery)`` score matrix.

    Args:
        scores (`torch.Tensor` of shape `(B, N)`): higher is more similar.
        relevant: the relevant gallery items of each query: a ``(B, N)`` bool mask, a ``(B,)``/``(B, R)`` index
            tensor padded with ``-1``, or a list of lists (i2t on COCO: 5 captions per image).
        ks: the cut-offs of R@K.

    Example:
        >>> import torch
        >>> scores = torch.tensor([[0.9, 0.1, 0.3], [0.2, 0.8, 0.7], [0.5, 0.6, 0.4]])
        >>> m = retrieval_metrics(scores, [[0], [2], [2, 0]], ks=(1, 2))
        >>> round(m["R@1"], 2), round(m["R@2"], 2), m["medr"]
        (33.33, 100.0, 2.0)
    """
    acc = RetrievalMetricAccumulator(ks)
    acc.update(scores, relevant)
    return acc.compute()


def uniformity(emb: torch.Tensor) -> float:
    """Mean distance to the centre (TCR Eq. 14)."""
    return (emb - emb.mean(0)).norm(dim=1).mean().item()


def modality_gap(query: torch.Tensor, gallery: torch.Tensor) -> float:
    """Distance between the query and gallery centres (TCR Eq. 15)."""
    return (query.mean(0) - gallery.mean(0)).norm().item()
