"""Retrieval metrics from a score matrix with several relevant items per query.

``R@K`` is the percentage of queries with at least one relevant item in their top ``K`` (the COCO/Flickr
convention, "hit rate"); ``medr``/``meanr`` are the median/mean rank (1-based) of the best-ranked relevant item;
``mAP`` is the mean over queries of average precision over all their relevant items. Percentages, as in the
papers' tables. Works on the whole matrix or chunk by chunk (:class:`RetrievalMetricAccumulator`) so a
25k x 5k COCO matrix never has to be held at once.

Ties are counted **pessimistically**: an item tied with an irrelevant one is ranked after it, so a collapsed model
whose scores are all equal gets R@1 = 0 (unless the gallery has a single item, or every item is relevant), as BLIP's
``itm_eval`` (used by TCR) reports it, and quantised scores never read higher than their distinct values justify.
Ties among the relevant items of one query are broken in the order they are listed (this changes no metric: the best
rank and the sorted ranks of AP are the same for any order). A NaN score counts as the lowest score (``-inf``).

Arithmetic is exact: ranks and hit counts are integers; percentages, mean rank and mAP are Python floats computed
in float64 (1 hit in 5 queries is exactly 20.0).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np
import torch

Relevance = torch.Tensor | Sequence[Sequence[int]] | Sequence[int]


def _is_bool(x) -> bool:
    return isinstance(x, (bool, np.bool_))


def _as_array(relevant):
    """A NumPy array, or a nested list of bools (a mask), as a tensor; ragged index lists stay as they are."""
    if isinstance(relevant, torch.Tensor):
        return relevant
    if isinstance(relevant, np.ndarray):
        return torch.from_numpy(np.ascontiguousarray(relevant))
    first = next((r for r in relevant if hasattr(r, "__len__") and len(r)), None)
    if first is not None and _is_bool(first[0]):
        try:
            return torch.from_numpy(np.asarray(relevant, dtype=bool))
        except ValueError:
            raise ValueError("A relevance mask must be rectangular: one bool per gallery item for every query.") from None
    return relevant


def relevance_to_index(relevant: Relevance, num_queries: int, device=None, num_items: int | None = None) -> torch.Tensor:
    """Relevant gallery indices as a ``(B, R)`` long tensor padded with ``-1``.

    Accepts a ``(B, N)`` boolean mask (a tensor, a NumPy array or nested lists of bools), a ``(B,)`` or ``(B, R)``
    index tensor or array (``-1`` = padding), or a list of lists of indices (ragged). With ``num_items`` (the gallery
    size) a mask must be exactly that wide.
    """
    relevant = _as_array(relevant)
    if isinstance(relevant, torch.Tensor):
        if relevant.dtype == torch.bool:
            if relevant.dim() != 2:
                raise ValueError(f"A relevance mask must be (queries, gallery); got {tuple(relevant.shape)}.")
            if num_items is not None and relevant.shape[1] != num_items:
                raise ValueError(f"The relevance mask has {relevant.shape[1]} columns but the gallery has {num_items} items.")
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
    if (out < -1).any():
        raise ValueError(f"Relevant indices must be >= 0 (-1 pads a row); got {int(out.min())}.")
    if device is not None:
        out = out.to(device)
    return out


def relevant_ranks(scores: torch.Tensor, relevant: Relevance) -> tuple[torch.Tensor, torch.Tensor]:
    """1-based rank of every relevant item of every query: ``(B, R)`` long with ``0`` at padding, plus the mask.

    Pessimistic ties: ``rank_i = 1 + #{irrelevant j: s_j >= s_i} + #{relevant j: s_j > s_i, or s_j = s_i and j listed
    before i}``; with one relevant item this is ``1 + #{j != i: s_j >= s_i}``. An index listed twice for a query counts
    once (the repeat is padding).
    """
    if scores.dim() != 2:
        raise ValueError(f"scores must be (queries, gallery); got shape {tuple(scores.shape)}.")
    idx = relevance_to_index(relevant, scores.shape[0], device=scores.device, num_items=scores.shape[1])
    valid = idx >= 0
    if (idx >= scores.shape[1]).any():
        raise ValueError(f"A relevant index is >= the gallery size {scores.shape[1]}.")
    if not valid.any(dim=1).all():
        bad = int((~valid.any(dim=1)).nonzero()[0])
        raise ValueError(f"Query {bad} has no relevant item: every query needs at least one.")
    r = idx.shape[1]
    earlier = torch.ones(r, r, dtype=torch.bool, device=idx.device).tril(-1)  # [i, j]: j is listed before i
    repeat = ((idx[:, :, None] == idx[:, None, :]) & valid[:, None, :] & earlier).any(dim=2)
    valid = valid & ~repeat
    if scores.is_floating_point():
        scores = torch.nan_to_num(scores, nan=float("-inf"))  # NaN ranks last (pessimistic), never first
    rel = scores.gather(1, idx.clamp(min=0))  # (B, R)
    ge_all = (scores[:, None, :] >= rel[:, :, None]).sum(-1)  # (B, R): every item scored >= s_i, i itself included
    ge_rel = ((rel[:, None, :] >= rel[:, :, None]) & valid[:, None, :]).sum(-1)  # the relevant ones among them
    ahead_rel = (((rel[:, None, :] > rel[:, :, None]) | ((rel[:, None, :] == rel[:, :, None]) & earlier)) & valid[:, None, :]).sum(-1)
    ranks = 1 + (ge_all - ge_rel) + ahead_rel
    return ranks.masked_fill(~valid, 0), valid


class RetrievalMetricAccumulator:
    """Accumulates per-query best rank (integers) and average precision (float64) over chunks of score rows."""

    def __init__(self, ks: Iterable[int] = (1, 5, 10)):
        self.ks = tuple(int(k) for k in ks)
        if not self.ks or min(self.ks) < 1:
            raise ValueError(f"Every cut-off K of R@K must be >= 1, got ks={self.ks}.")
        self._best: list[torch.Tensor] = []
        self._ap: list[torch.Tensor] = []

    def update(self, scores: torch.Tensor, relevant: Relevance) -> None:
        ranks, valid = relevant_ranks(scores.detach(), relevant)
        big = torch.iinfo(ranks.dtype).max
        self._best.append(ranks.masked_fill(~valid, big).min(dim=1).values.cpu())
        sorted_ranks = ranks.masked_fill(~valid, big).sort(dim=1).values.double()  # padding goes last
        pos = torch.arange(1, ranks.shape[1] + 1, device=ranks.device, dtype=torch.float64)
        n_rel = valid.sum(1, keepdim=True)
        precision = torch.where(pos <= n_rel, pos / sorted_ranks, 0.0)  # precision at the k-th relevant item
        self._ap.append((precision.sum(1) / n_rel.squeeze(1).double()).cpu())

    def compute(self) -> dict[str, float]:
        if not self._best:
            raise ValueError("No scores were added.")
        best = torch.cat(self._best)
        n = int(best.numel())
        out: dict[str, float] = {f"R@{k}": 100.0 * int((best <= k).sum()) / n for k in self.ks}
        out["medr"] = float(best.double().quantile(0.5))
        out["meanr"] = int(best.sum()) / n
        out["mAP"] = 100.0 * float(torch.cat(self._ap).sum()) / n
        out["num_queries"] = n
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
