"""Whole-gallery statistics of a top-k backend, computed once from its cached embeddings, streamed in blocks.

Objectives that need more of the gallery than the batch's candidates (``Objective.gallery_access == "stats"``) get it
from here: the mean embedding and a fingerprint (:class:`GalleryStatistics`, one pass) and spherical k-means
(:class:`GalleryKMeans`: REST's cluster negatives). Everything is computed from ``(block, D)`` float32 blocks of at most
:data:`BLOCK_ROWS` rows, so no ``N x D`` float32 copy is made beyond what the backend already holds; per-item vectors
(``N`` floats or ints) are kept, which is 40-80 MB at 10^7 items.

The k-means is the dense path's algorithm (:func:`hf_tta.objectives.rest.spherical_kmeans` runs this same code on
blocks of the same size), so an exact backend holding the same float32 vectors returns bit-identical labels and
centroids. It is seeded with an integer seed (the wrapper passes ``TTAConfig.seed``) so that a backend computes it once
and caches it for every wrapper with that seed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator

import torch
import torch.nn.functional as F

#: Rows per block of every statistics pass (also the block size of the dense k-means, so both compute alike).
BLOCK_ROWS = 65536
#: ``torch.multinomial`` takes at most 2^24 categories; larger galleries draw by inverse CDF.
_MULTINOMIAL_MAX = 2**24

Blocks = Callable[[], Iterator[tuple[int, torch.Tensor]]]


@dataclass
class GalleryStatistics:
    """One pass over the gallery.

    Args:
        mean (`torch.Tensor` of shape `(D,)`): the mean embedding (float32, accumulated in float64).
        fingerprint (`torch.Tensor` of shape `(3,)`): ``(N, sum, position-weighted sum)`` in float64, as
            :func:`hf_tta.objectives.base.gallery_fingerprint` computes it on a dense gallery (equal to ~1e-12).
        total (`torch.Tensor` of shape `(D,)`, *optional*): the float64 sum of the rows, and
        row_sums (`torch.Tensor` of shape `(N,)`, *optional*): each row's float64 sum: kept (in one process, not saved)
            so that a live gallery's change updates mean and fingerprint in ``O(N + M D)``
            (:func:`update_statistics`) instead of a new pass over the ``N x D`` embeddings.
    """

    mean: torch.Tensor
    fingerprint: torch.Tensor
    total: torch.Tensor | None = None
    row_sums: torch.Tensor | None = None


@dataclass
class GalleryKMeans:
    """Spherical k-means of the gallery.

    Args:
        centroids (`torch.Tensor` of shape `(K, D)`): the L2-normalised mean of each cluster's members (zero for an empty
            cluster), i.e. the vectors whose cosine with a query REST scores as its cluster negatives.
        labels (`torch.Tensor` of shape `(N,)`): each item's cluster (``int64``).
        counts (`torch.Tensor` of shape `(K,)`): items per cluster.
    """

    centroids: torch.Tensor
    labels: torch.Tensor
    counts: torch.Tensor


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x


def tensor_blocks(x: torch.Tensor, rows: int = BLOCK_ROWS) -> Blocks:
    """Blocks ``(start, float32 block)`` of an in-memory ``(N, D)`` tensor."""

    def blocks() -> Iterator[tuple[int, torch.Tensor]]:
        for start in range(0, x.shape[0], rows):
            yield start, x[start : start + rows].float()

    return blocks


def compute_statistics(
    blocks: Blocks, num_items: int, dim: int, reduce=_identity, keep_rows: bool = False
) -> GalleryStatistics:
    """Mean and fingerprint in one pass. ``blocks`` yields ``(global start, block)``; ``reduce`` sums a tensor over
    processes (a sharded gallery), the identity otherwise. ``keep_rows`` keeps the sum and the row sums (one process)."""
    total = torch.zeros(dim, dtype=torch.float64)
    fp = torch.zeros(2, dtype=torch.float64)
    kept = []
    for start, block in blocks():
        block = block.double()  # one cast for both sums (twice as fast as two float64-accumulating sums)
        total += block.sum(0).cpu()
        rows = block.sum(1).cpu()
        pos = torch.arange(start + 1, start + 1 + rows.numel(), dtype=torch.float64)
        fp += torch.stack([rows.sum(), (rows * pos).sum()])
        if keep_rows:
            kept.append(rows)
    total, fp = reduce(total), reduce(fp)
    return GalleryStatistics(
        mean=(total / num_items).float(),
        fingerprint=torch.cat([torch.tensor([float(num_items)], dtype=torch.float64), fp]),
        total=total if keep_rows else None,
        row_sums=(torch.cat(kept) if kept else torch.zeros(0, dtype=torch.float64)) if keep_rows else None,
    )


def update_statistics(
    stats: GalleryStatistics, kind: str, positions: torch.Tensor, old_rows: torch.Tensor | None,
    new_rows: torch.Tensor | None,
) -> GalleryStatistics | None:
    """Mean and fingerprint after a live gallery's change, from those before (with ``total`` and ``row_sums``) and the
    rows that left (``old_rows``: removed or replaced) and came (``new_rows``: added or replaced, as stored), without a
    pass over the gallery. ``positions``: as in :class:`~hf_tta.gallery.ids.GalleryChange`. ``None`` when ``stats``
    does not keep the row sums (then recompute)."""
    if stats.total is None or stats.row_sums is None:
        return None
    rs, total, pos = stats.row_sums, stats.total.clone(), positions.cpu()
    if kind == "add":
        new = new_rows.double().cpu()
        at = int(pos[0])
        rs = torch.cat([rs[:at], new.sum(1), rs[at:]])
        total += new.sum(0)
    elif kind == "remove":
        keep = torch.ones(rs.numel(), dtype=torch.bool)
        keep[pos] = False
        rs = rs[keep]
        total -= old_rows.double().cpu().sum(0)
    else:
        new, old = new_rows.double().cpu(), old_rows.double().cpu()
        rs = rs.index_copy(0, pos, new.sum(1))
        total += new.sum(0) - old.sum(0)
    n = rs.numel()
    weights = torch.arange(1, n + 1, dtype=torch.float64)
    fp = torch.stack([torch.tensor(float(n), dtype=torch.float64), rs.sum(), (rs * weights).sum()])
    return GalleryStatistics(mean=(total / n).float(), fingerprint=fp, total=total, row_sums=rs)


def _weighted_draw(weights: torch.Tensor, generator: torch.Generator) -> int:
    """One index drawn with probability proportional to ``weights`` (float64, CPU)."""
    if weights.numel() <= _MULTINOMIAL_MAX:
        return int(torch.multinomial(weights, 1, generator=generator))
    cdf = weights.cumsum(0)
    u = torch.rand((), dtype=torch.float64, generator=generator) * cdf[-1]
    return int(torch.searchsorted(cdf, u, right=True).clamp(max=weights.numel() - 1))


def member_sums(blocks: Blocks, labels: torch.Tensor, like: torch.Tensor, reduce=_identity) -> torch.Tensor:
    """Sum of each cluster's members ``(K, D)`` (``like``'s shape, dtype and device), rows added in gallery order."""
    sums = torch.zeros_like(like)
    for start, block in blocks():
        sums.index_add_(0, labels[start : start + block.shape[0]].to(block.device), block)
    return reduce(sums)


def blocked_spherical_kmeans(
    blocks: Blocks,
    num_items: int,
    row: Callable[[int], torch.Tensor],
    k: int,
    generator: torch.Generator,
    iters: int,
    reduce=_identity,
    gather_vector=_identity,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, bool]:
    """Cosine k-means of the gallery, block by block: k-means++ seeding with ``generator`` (CPU draws), then Lloyd
    iterations until the assignment is stable; an empty cluster keeps its previous centre; ``k`` is capped at ``N``.

    ``row(i)`` is item ``i`` (float32, on the blocks' device); ``reduce`` sums ``(K, D)`` partial sums over processes and
    ``gather_vector`` concatenates per-process ``(n_local,)`` vectors in rank order (identities in one process).
    Returns ``(centroids, labels, sums of the final labels' members, converged)``."""
    k = min(k, num_items)

    def per_item(fn) -> torch.Tensor:
        return gather_vector(torch.cat([fn(block) for _, block in blocks()]))

    first = int(torch.randint(num_items, (1,), generator=generator))
    centre = row(first)
    centres = [centre]
    dist = per_item(lambda b: (1 - b @ centre).clamp(min=0))
    for _ in range(1, k):
        weights = (dist**2).cpu().double()
        if weights.sum() <= 0:  # all remaining points coincide with a centre: any unused point will do
            weights = torch.ones(num_items, dtype=torch.float64)
        centre = row(_weighted_draw(weights, generator)).to(dist.device)
        centres.append(centre)
        dist = torch.minimum(dist, per_item(lambda b: (1 - b @ centre).clamp(min=0)).to(dist.device))
    centroids = torch.stack(centres)

    labels = per_item(lambda b: (b @ centroids.T).argmax(dim=1))
    for _ in range(iters):
        sums = member_sums(blocks, labels, centroids, reduce)
        counts = torch.bincount(labels, minlength=k)
        centroids = torch.where(counts.to(sums.device)[:, None] > 0, F.normalize(sums, dim=1), centroids)
        new = per_item(lambda b: (b @ centroids.T).argmax(dim=1))
        if torch.equal(new, labels):
            return centroids, labels, sums, True
        labels = new
    return centroids, labels, None, False


def gallery_kmeans(
    blocks: Blocks,
    num_items: int,
    row: Callable[[int], torch.Tensor],
    k: int,
    iters: int,
    seed: int,
    reduce=_identity,
    gather_vector=_identity,
) -> GalleryKMeans:
    """:func:`blocked_spherical_kmeans` seeded with ``seed``, with the normalised mean of each final cluster."""
    gen = torch.Generator().manual_seed(seed)
    centroids, labels, sums, converged = blocked_spherical_kmeans(blocks, num_items, row, k, gen, iters, reduce, gather_vector)
    if not converged:  # the last Lloyd step moved some items: their clusters' sums take one more pass
        sums = member_sums(blocks, labels, centroids, reduce)
    sums = sums.cpu()
    counts = torch.bincount(labels.cpu(), minlength=sums.shape[0])
    centroids = torch.where(counts[:, None] > 0, F.normalize(sums, dim=1), torch.zeros_like(sums))
    return GalleryKMeans(centroids=centroids, labels=labels.cpu(), counts=counts)
