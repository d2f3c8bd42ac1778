"""What the wrapper does with a top-k backend (see :mod:`hf_tta.gallery.base`): refuse objectives that need the full
score matrix, gather the batch's candidate items, and turn the candidate scores into each query's top-k."""

from __future__ import annotations

from typing import TYPE_CHECKING, Mapping, Sequence

import torch

from .base import GalleryBackend, TopKScores

if TYPE_CHECKING:  # pragma: no cover
    from ..objectives.base import Objective


def check_gallery_access(gallery: GalleryBackend, objectives: Mapping[str, Objective | None]) -> None:
    """Refuse an objective (by role: ``"objective"``, ``"score_transform"``) that needs every item's score at every
    step (``Objective.gallery_access == "full"``)."""
    for role, obj in objectives.items():
        if obj is not None and getattr(obj, "gallery_access", "softmax") == "full":
            raise ValueError(
                f"The {role} {obj.name!r} needs every gallery item's score at every step (gallery_access='full'), "
                f"which a top-k backend ({type(gallery).__name__}) does not provide: pass the dense GalleryCache instead."
            )


@torch.no_grad()
def candidate_items(
    q: torch.Tensor,
    gallery: GalleryBackend,
    objective: Objective,
    searchers: Sequence[tuple[Objective, Mapping[str, torch.Tensor]]],
    seed: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The union ``C`` of the batch's top-k items (sorted global indices) and their cached embeddings, on ``q``'s device.

    ``C`` also holds the top-k of each searcher's ``search_vectors`` (an objective with its state); ``objective``'s
    ``candidate_extras`` (REST's centroids) follow the embeddings as extra rows. A multi-vector gallery's candidates
    keep their shape ``(|C|, Q, D)`` (the adapter's ``score`` and ``single_vector`` need it); a single-vector extra row
    ``c`` then becomes ``Q`` copies of ``c``, whose max-over-vectors score is ``q . c`` and whose single-vector view is
    ``c`` again (a normalised centroid)."""
    k = max(gallery.k, getattr(objective, "gallery_k", 0) or 0)
    qd = q.detach().float()
    with gallery.reading():  # one version of a live gallery for the searches, the gathered rows and the extras
        found = [gallery.search_tokens(qd, k).flatten()]
        for obj, state in searchers:
            extra = obj.search_vectors(qd, state)
            if extra is not None:
                found.append(gallery.search_tokens(extra, k).flatten())
        ids = torch.unique(torch.cat([f.to(q.device) for f in found]))
        emb = gallery.gather(ids).to(q.device)
        extras = objective.candidate_extras(gallery, seed)
    if extras is not None:
        extras = extras.to(emb)
        if emb.dim() == 3 and extras.dim() == 2:
            extras = extras[:, None].expand(-1, emb.shape[1], -1)
        emb = torch.cat([emb, extras])
    return ids, emb


def candidate_topk(scores: torch.Tensor, ids: torch.Tensor, k: int) -> TopKScores:
    """Each query's top-``k`` (global indices) from its scores against the candidates ``ids`` (``(B, |C|)``, then the
    candidate extras' columns, which are dropped)."""
    # a stable sort: equal scores keep the smaller gallery index first (the columns are in index order); columns
    # after the candidates are the objective's candidate_extras (REST's centroids), not gallery items
    scores = scores[:, : ids.numel()]
    values, local = scores.sort(dim=1, descending=True, stable=True)
    k = min(k, scores.shape[1])
    return TopKScores(values[:, :k], ids[local[:, :k]])
