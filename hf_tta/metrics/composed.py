"""Composed image retrieval metrics as REST reports them (Table III: FashionIQ R@10 / R@50 per category; Table A.8:
CIRR R@1/5/10/50 and Recall_subset@1/2/3), in pure torch on a ``(queries, gallery)`` score matrix.

Conventions of the CIR evaluation code REST's BLIP-2 setting follows (CLIP4Cir / SPRC ``compute_*_val_metrics``):

- one target per query; R@K = 100 x the share of queries whose target ranks in the top K;
- CIRR removes each query's reference image from its ranking (``exclude``) before both metrics;
- Recall_subset@K ranks only the query's image set (CIRR ``img_set.members``, 6 images), the reference removed, and
  counts the target within the top K of that subset.

Ties are broken by the gallery order (a stable sort), so results are deterministic.
"""

from __future__ import annotations

from typing import Iterable, Mapping, Sequence

import torch

FIQ_KS = (10, 50)
CIRR_KS = (1, 5, 10, 50)
CIRR_SUBSET_KS = (1, 2, 3)


def _masked(scores: torch.Tensor, exclude: Sequence[int] | torch.Tensor | None) -> torch.Tensor:
    scores = scores.detach().float().clone()
    if exclude is not None:
        ex = torch.as_tensor(exclude, dtype=torch.long, device=scores.device)
        keep = ex >= 0  # -1: nothing to exclude (the reference is not in the gallery)
        rows = torch.arange(scores.shape[0], device=scores.device)[keep]
        scores[rows, ex[keep]] = float("-inf")
    return scores


def target_ranks(scores: torch.Tensor, targets: Sequence[int] | torch.Tensor, exclude=None) -> torch.Tensor:
    """0-based rank of each query's target: the number of gallery items scored above it (ties: earlier items
    first, as a stable descending sort)."""
    if scores.dim() != 2:
        raise ValueError(f"scores must be (queries, gallery); got shape {tuple(scores.shape)}.")
    t = torch.as_tensor(targets, dtype=torch.long, device=scores.device)
    if t.shape != (scores.shape[0],):
        raise ValueError(f"targets must hold one gallery index per query ({scores.shape[0]}); got shape {tuple(t.shape)}.")
    if ((t < 0) | (t >= scores.shape[1])).any():
        raise ValueError(f"targets must index the gallery (0..{scores.shape[1] - 1}).")
    s = _masked(scores, exclude)
    own = s.gather(1, t[:, None])
    idx = torch.arange(s.shape[1], device=s.device)[None, :]
    above = (s > own) | ((s == own) & (idx < t[:, None]))
    return above.sum(dim=1)


def composed_recall(scores: torch.Tensor, targets, ks: Iterable[int] = CIRR_KS, exclude=None) -> dict[str, float]:
    """``{"R@K": %}``: the share of queries whose target is in the top K (after ``exclude``)."""
    ranks = target_ranks(scores, targets, exclude)
    return {f"R@{k}": 100.0 * (ranks < k).float().mean().item() for k in ks}


def recall_subset(scores: torch.Tensor, targets, members: Sequence[Sequence[int]], ks: Iterable[int] = CIRR_SUBSET_KS,
                  exclude=None) -> dict[str, float]:
    """CIRR's ``Recall_subset@K``: rank only each query's image set (gallery positions ``members[i]``, the reference
    removed via ``exclude``); the target must be a member."""
    s = _masked(scores, exclude)
    t = torch.as_tensor(targets, dtype=torch.long)
    if len(members) != s.shape[0]:
        raise ValueError(f"members must list one image set per query ({s.shape[0]}); got {len(members)}.")
    width = max(len(m) for m in members)
    pos = torch.full((s.shape[0], width), -1, dtype=torch.long)
    for i, m in enumerate(members):  # ragged sets -> a padded index matrix (once, not on a hot path)
        pos[i, : len(m)] = torch.as_tensor(list(m), dtype=torch.long)
    if not (pos == t[:, None]).any(dim=1).all():
        raise ValueError("Every query's target must be in its image set (CIRR img_set.members).")
    sub = torch.where(pos >= 0, s.gather(1, pos.clamp(min=0).to(s.device)), torch.tensor(float("-inf"), device=s.device))
    excluded = sub == float("-inf")  # padding and the excluded reference
    own = s.gather(1, t[:, None].to(s.device))
    order = torch.arange(width)[None, :].to(s.device)
    tpos = (pos == t[:, None]).float().argmax(dim=1, keepdim=True).to(s.device)
    above = ((sub > own) | ((sub == own) & (order < tpos))) & ~excluded
    ranks = above.sum(dim=1)
    return {f"Recall_subset@{k}": 100.0 * (ranks < k).float().mean().item() for k in ks}


def cirr_metrics(scores: torch.Tensor, targets, references, members: Sequence[Sequence[int]] | None = None) -> dict[str, float]:
    """REST's CIRR columns: R@1/5/10/50 and Recall_subset@1/2/3, each query's reference removed; plus CLIP4Cir's
    headline ``(R@5 + Recall_subset@1) / 2`` as ``avg``."""
    out = composed_recall(scores, targets, CIRR_KS, exclude=references)
    if members is not None:
        out.update(recall_subset(scores, targets, members, CIRR_SUBSET_KS, exclude=references))
        out["avg"] = (out["R@5"] + out["Recall_subset@1"]) / 2
    return out


def fiq_metrics(per_category: Mapping[str, tuple[torch.Tensor, Sequence[int]]]) -> dict[str, float]:
    """REST's FashionIQ columns: ``<category>/R@10`` and ``<category>/R@50`` per category (each scored against its
    own category's gallery), and their means over the categories (``R@10``, ``R@50``)."""
    out: dict[str, float] = {}
    for cat, (scores, targets) in per_category.items():
        for k, v in composed_recall(scores, targets, FIQ_KS).items():
            out[f"{cat}/{k}"] = v
    for k in FIQ_KS:
        vals = [out[f"{c}/R@{k}"] for c in per_category]
        out[f"R@{k}"] = sum(vals) / len(vals) if vals else float("nan")
    return out


__all__ = ["CIRR_KS", "CIRR_SUBSET_KS", "FIQ_KS", "cirr_metrics", "composed_recall", "fiq_metrics", "recall_subset", "target_ranks"]
