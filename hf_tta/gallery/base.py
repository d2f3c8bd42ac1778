"""The gallery-backend interface: a cached gallery that answers exact-score top-k searches.

The in-memory dense gallery (:class:`hf_tta.GalleryCache`) hands objectives the whole ``(B, N)`` score matrix. A
*top-k backend* (:class:`ChunkedGallery`, :class:`FaissGallery`, :class:`ShardedGallery`) never does: per step the
wrapper searches each query's ``k`` nearest items, takes the union ``C`` of the batch's results, gathers those
items' cached embeddings and re-scores them exactly with the (grad-carrying) query embeddings. Objectives then see
``C`` as their gallery: ``scores`` is ``(B, |C|)`` and ``gallery_emb`` is ``(|C|, D)``. What that changes for each
objective is declared by ``Objective.gallery_access`` (``"topk"``: exact with ``k >= Objective.gallery_k``;
``"softmax"``: a softmax over the gallery becomes a softmax over ``C``; ``"full"``: needs the whole gallery, refused).
"""

from __future__ import annotations

import abc
from dataclasses import dataclass

import torch


@dataclass
class TopKScores:
    """Each query's ``k`` best gallery items, best first.

    Args:
        values (`torch.Tensor` of shape `(B, k)`): their scores (descending along each row).
        indices (`torch.Tensor` of shape `(B, k)`): their global gallery indices (``int64``).
    """

    values: torch.Tensor
    indices: torch.Tensor

    def __post_init__(self):
        if self.values.shape != self.indices.shape or self.values.dim() != 2:
            raise ValueError(
                f"TopKScores needs (B, k) values and indices of one shape, got {tuple(self.values.shape)} and "
                f"{tuple(self.indices.shape)}."
            )

    def __len__(self) -> int:
        return self.values.shape[0]

    @property
    def k(self) -> int:
        return self.values.shape[1]

    def to(self, device) -> "TopKScores":
        return TopKScores(self.values.to(device), self.indices.to(device))

    @staticmethod
    def cat(parts: list["TopKScores"]) -> "TopKScores":
        """Concatenate the results of several batches (rows)."""
        return TopKScores(torch.cat([p.values for p in parts]), torch.cat([p.indices for p in parts]))


def merge_topk(values: torch.Tensor, indices: torch.Tensor, k: int) -> TopKScores:
    """Keep the ``k`` best of several partial top-k lists laid side by side (``(B, m)`` each, any order).

    Equal scores keep the smaller gallery index first, so the merge is independent of how the gallery was split."""
    k = min(k, values.shape[1])
    # sort by index first, then a stable sort by descending value: ties end up in index order
    order = indices.argsort(dim=1, stable=True)
    values, indices = values.gather(1, order), indices.gather(1, order)
    top = values.argsort(dim=1, descending=True, stable=True)[:, :k]
    return TopKScores(values.gather(1, top), indices.gather(1, top))


def check_k(k: int) -> int:
    if not isinstance(k, int) or isinstance(k, bool) or k < 1:
        raise ValueError(f"k must be a positive integer (neighbours per query), got {k!r}.")
    return k


class GalleryBackend(abc.ABC):
    """A cached gallery of ``N`` single-vector, L2-normalised embeddings ``(N, D)`` answering top-k searches.

    Subclasses implement :meth:`search` (no grad: which items are each query's nearest), :meth:`gather` (the exact
    cached embeddings of given items, re-scored by the wrapper with grad) and ``__len__``/``dim``/``device``.

    Attributes:
        modality (`str`): the gallery modality (``"text"``, ``"image"``, ...).
        k (`int`): neighbours per query, both the size of the candidate set searched per query and the width of the
            returned :class:`TopKScores`.
        exact (`bool`): whether :meth:`search` returns the exact top-k (chunked, flat) or an approximation (IVF, HNSW).
    """

    modality: str
    k: int
    exact: bool = True

    @abc.abstractmethod
    def __len__(self) -> int: ...

    @property
    @abc.abstractmethod
    def dim(self) -> int: ...

    @property
    @abc.abstractmethod
    def device(self) -> torch.device: ...

    @abc.abstractmethod
    def search(self, queries: torch.Tensor, k: int) -> TopKScores:
        """Top-``k`` items of each query ``(B, D)`` by inner product (no grad); ``k`` is capped at ``len(self)``."""

    @abc.abstractmethod
    def gather(self, indices: torch.Tensor) -> torch.Tensor:
        """The cached embeddings ``(M, D)`` (float32, on :attr:`device`) of the items ``indices`` ``(M,)``."""

    def search_tokens(self, queries: torch.Tensor, k: int) -> torch.Tensor:
        """Candidate indices ``(B, m)`` for single- ``(B, D)`` or multi-vector ``(B, Q, D)`` queries (scored by a max
        over their vectors: the exact top-k of the max lies in the union of the per-vector top-k)."""
        if queries.dim() == 2:
            return self.search(queries, k).indices
        if queries.dim() == 3:
            b, q, d = queries.shape
            return self.search(queries.reshape(b * q, d), k).indices.reshape(b, -1)
        raise ValueError(f"Query embeddings must be (B, D) or (B, Q, D), got {tuple(queries.shape)}.")

    def check_embeddings(self, embeddings: torch.Tensor) -> None:
        if embeddings.dim() != 2:
            raise ValueError(
                f"{type(self).__name__} holds single-vector embeddings (N, D), got {tuple(embeddings.shape)}: "
                "use the dense GalleryCache for a multi-vector gallery."
            )
        if embeddings.shape[0] == 0:
            raise ValueError("The gallery is empty.")
