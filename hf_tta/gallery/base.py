"""The gallery-backend interface: a cached gallery that answers exact-score top-k searches.

The in-memory dense gallery (:class:`hf_tta.GalleryCache`) hands objectives the whole ``(B, N)`` score matrix. A
*top-k backend* (:class:`ChunkedGallery`, :class:`FaissGallery`, :class:`ShardedGallery`) never does: per step the
wrapper searches each query's ``k`` nearest items, takes the union ``C`` of the batch's results, gathers those
items' cached embeddings and re-scores them exactly with the (grad-carrying) query embeddings. Objectives then see
``C`` as their gallery: ``scores`` is ``(B, |C|)`` and ``gallery_emb`` is ``(|C|, D)``. What that changes for each
objective is declared by ``Objective.gallery_access``:

* ``"topk"``: only each query's top-``gallery_k`` items (TCR): exact with ``k >= Objective.gallery_k``;
* ``"softmax"``: a softmax over the gallery becomes a softmax over ``C`` (Tent, SAR, READ, DeYO, PL, SHOT, ...);
* ``"stats"``: statistics of the whole gallery, computed once per backend from its cached embeddings and cached on it
  (:meth:`GalleryBackend.statistics`: mean and fingerprint; :meth:`GalleryBackend.kmeans`: REST's centroids), saved
  beside the backend by ``save`` and read back by ``load``;
* ``"per_item"``: state per gallery item (EATA's running softmax average, TITAN's match counts, ClipTTA's memory
  labels), kept as a dense ``N``-vector keyed by global index into which the candidates' values are scattered (the
  objective gets ``ObjectiveInputs.candidate_ids``); a softmax over the gallery is taken over ``C``;
* ``"full"``: needs every item's score at every step; refused with a top-k backend (no built-in objective).

Multi-vector galleries: every backend also holds items of ``Q`` vectors each, ``(N, Q, D)`` (BLIP-2's Q-Former query
tokens; :attr:`GalleryBackend.num_vectors` is ``Q``, ``None`` for ``(N, D)``). An item's score is then the max over its
vectors of the cosine with a single-vector query (:func:`item_scores`, what ``ModelAdapter.score`` computes), so
:meth:`~GalleryBackend.search` ranks items by that max and :meth:`~GalleryBackend.gather` returns ``(M, Q, D)``: the
candidate view the wrapper scores keeps the ``(C, Q, D)`` shape. Whole-gallery statistics (mean, fingerprint,
k-means) are of the single-vector view of each item, the normalised mean of its vectors (:meth:`GalleryBackend.gather_single`,
``ModelAdapter.single_vector`` without scores), which is what an objective sees as ``gallery_emb`` on the dense path.

A live index: every backend gives each item a stable external id (:attr:`GalleryBackend.ids`; ``0 .. N-1`` when built
without ids) and changes in place with :meth:`~GalleryBackend.add`, :meth:`~GalleryBackend.remove` and
:meth:`~GalleryBackend.replace` (no other item is re-encoded or re-indexed), each returning a
:class:`~hf_tta.gallery.ids.GalleryChange` for position-keyed state (``Objective.on_gallery_change``). ``search`` and
``gather`` keep addressing positions (what the wrapper and per-item state use); :meth:`~GalleryBackend.search_ids`
answers in external ids. A readers-writer lock makes every search, gather and statistics pass see one version: a
change waits for the running reads and holds new ones back; ``with backend.reading():`` pins one version across
several calls (the wrapper's search, gather and scoring of one step). Every change bumps :attr:`~GalleryBackend.version`
and drops the cached statistics (mean, fingerprint, k-means), so they are recomputed for the new gallery.
"""

from __future__ import annotations

import abc
import os
import re
from dataclasses import dataclass
from typing import Iterator

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from .cache import single_vector
from .ids import ChangeLog, GalleryChange, IdMap, ReadWriteLock, as_id_array, check_new_rows
from .stats import (
    BLOCK_ROWS,
    GalleryKMeans,
    GalleryStatistics,
    compute_statistics,
    gallery_kmeans,
    update_statistics,
)

STATS_FILE = "gallery_stats.safetensors"
IDS_FILE = "gallery_ids.safetensors"
_KMEANS_KEY = re.compile(r"^kmeans\.k(\d+)\.iters(\d+)\.seed(-?\d+)\.(centroids|labels|counts)$")


@dataclass
class TopKScores:
    """Each query's ``k`` best gallery items, best first.

    Args:
        values (`torch.Tensor` of shape `(B, k)`): their scores (descending along each row).
        indices (`torch.Tensor` of shape `(B, k)`): their global gallery indices (``int64``), or their external ids
            (:meth:`GalleryBackend.search_ids`).
        version (`int`, *optional*): the gallery version the answer was computed on (:meth:`GalleryBackend.search_ids`).
    """

    values: torch.Tensor
    indices: torch.Tensor
    version: int | None = None

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
        return TopKScores(self.values.to(device), self.indices.to(device), self.version)

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


def check_item_queries(queries: torch.Tensor) -> None:
    """A multi-vector gallery is searched with single-vector ``(B, D)`` queries (one line otherwise)."""
    if queries.dim() != 2:
        raise ValueError(
            f"A multi-vector gallery is searched with single-vector (B, D) queries, got {tuple(queries.shape)}: "
            "multi-vector queries need a single-vector gallery."
        )


def item_scores(queries: torch.Tensor, items: torch.Tensor) -> torch.Tensor:
    """Exact scores ``(B, n)`` of single-vector queries ``(B, D)`` against items ``(n, D)``, or ``(n, Q, D)`` scored by the
    max over each item's vectors (the expression of ``ModelAdapter.score``, so both give the same floats)."""
    check_item_queries(queries)
    if items.dim() == 2:
        return queries @ items.T
    return torch.einsum("bd,nqd->bnq", queries, items).amax(dim=2)


def check_k(k: int) -> int:
    if not isinstance(k, int) or isinstance(k, bool) or k < 1:
        raise ValueError(f"k must be a positive integer (neighbours per query), got {k!r}.")
    return k


class GalleryBackend(abc.ABC):
    """A cached gallery of ``N`` L2-normalised embeddings, ``(N, D)`` or multi-vector ``(N, Q, D)``, answering top-k
    searches.

    Subclasses implement :meth:`search` (no grad: which items are each query's nearest), :meth:`gather` (the exact
    cached embeddings of given items, re-scored by the wrapper with grad) and ``__len__``/``dim``/``device``.

    Attributes:
        modality (`str`): the gallery modality (``"text"``, ``"image"``, ...).
        k (`int`): neighbours per query, both the size of the candidate set searched per query and the width of the
            returned :class:`TopKScores`.
        exact (`bool`): whether :meth:`search` returns the exact top-k (chunked, flat) or an approximation (IVF, HNSW).
        num_vectors (`int`, *optional*): vectors per item ``Q`` of a multi-vector gallery; ``None`` for ``(N, D)``.
    """

    modality: str
    k: int
    exact: bool = True
    num_vectors: int | None = None

    @property
    def item_shape(self) -> tuple[int, ...]:
        """The shape of one item's embedding: ``(D,)``, or ``(Q, D)`` for a multi-vector gallery."""
        return (self.dim,) if self.num_vectors is None else (self.num_vectors, self.dim)

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
        """Top-``k`` items of each query ``(B, D)`` by inner product (a multi-vector item: the max over its vectors,
        :func:`item_scores`; no grad); ``k`` is capped at ``len(self)``."""

    @abc.abstractmethod
    def gather(self, indices: torch.Tensor) -> torch.Tensor:
        """The cached embeddings ``(M, *item_shape)`` (float32, on :attr:`device`) of the items ``indices`` ``(M,)``."""

    def gather_single(self, indices: torch.Tensor) -> torch.Tensor:
        """The single-vector view ``(M, D)`` of the items ``indices``: :meth:`gather` itself, or for a multi-vector
        gallery the normalised mean of each item's vectors (``ModelAdapter.single_vector`` without scores)."""
        return single_vector(self.gather(indices).float())

    def search_tokens(self, queries: torch.Tensor, k: int) -> torch.Tensor:
        """Candidate indices ``(B, m)`` for single- ``(B, D)`` or multi-vector ``(B, Q, D)`` queries (scored by a max
        over their vectors: the exact top-k of the max lies in the union of the per-vector top-k)."""
        if queries.dim() == 2:
            return self.search(queries, k).indices
        if queries.dim() == 3:
            if self.num_vectors is not None:
                raise ValueError(
                    f"Multi-vector queries {tuple(queries.shape)} cannot be scored against a multi-vector gallery "
                    f"{(len(self), *self.item_shape)}: one side must be single-vector."
                )
            b, q, d = queries.shape
            return self.search(queries.reshape(b * q, d), k).indices.reshape(b, -1)
        raise ValueError(f"Query embeddings must be (B, D) or (B, Q, D), got {tuple(queries.shape)}.")

    def check_embeddings(self, embeddings: torch.Tensor) -> None:
        if embeddings.dim() not in (2, 3) or 0 in embeddings.shape[1:]:
            raise ValueError(
                f"{type(self).__name__} holds (N, D) or multi-vector (N, Q, D) embeddings, got {tuple(embeddings.shape)}."
            )
        if embeddings.shape[0] == 0:
            raise ValueError("The gallery is empty.")

    # ---------------------------------------------------------------------------------------- live index
    # Subclasses implement the storage side of a change (called under the write lock, after every check passed, so a
    # change that fails its checks leaves the backend untouched): ``_add(ids, rows)`` appends rows at positions
    # ``N ..`` (or inserts them and returns where: a shard's end); ``_remove(positions, keep, ids)`` deletes positions
    # (``keep``: bool mask over the old positions, order kept); ``_replace(positions, ids, rows)`` overwrites rows in
    # place. ``_check_change(kind)`` refuses a change the storage cannot make (a memory-mapped file, an HNSW graph's
    # removal) before anything moves.
    def _add(self, ids: np.ndarray, rows: torch.Tensor) -> int | None:
        raise NotImplementedError(f"{type(self).__name__} cannot add items.")

    def _remove(self, positions: np.ndarray, keep: np.ndarray, ids: np.ndarray) -> None:
        raise NotImplementedError(f"{type(self).__name__} cannot remove items.")

    def _replace(self, positions: np.ndarray, ids: np.ndarray, rows: torch.Tensor) -> None:
        raise NotImplementedError(f"{type(self).__name__} cannot replace items.")

    def _check_change(self, kind: str) -> None:
        """Raise (one line) when this backend cannot make a change of ``kind`` now."""

    def _lock(self) -> ReadWriteLock:
        lock = self.__dict__.get("_rw_lock")
        if lock is None:
            lock = self.__dict__.setdefault("_rw_lock", ReadWriteLock())
        return lock

    def reading(self):
        """``with backend.reading(): ...``: the gallery does not change inside (several calls see one version)."""
        return self._lock().read()

    @property
    def id_map(self) -> IdMap:
        """The :class:`~hf_tta.gallery.ids.IdMap` of the current version (ids ``0 .. N-1`` unless set)."""
        ids = self.__dict__.get("_id_map")
        if ids is None:
            ids = self.__dict__["_id_map"] = IdMap.range(len(self))
        elif len(ids) != len(self):  # pragma: no cover - every change updates both under the write lock
            raise RuntimeError(f"The gallery holds {len(self)} items but {len(ids)} ids: it was changed directly.")
        return ids

    def _set_id_map(self, ids: IdMap) -> None:
        if len(ids) != len(self):
            raise ValueError(f"{len(ids)} ids for a gallery of {len(self)} items.")
        self.__dict__["_id_map"] = ids

    @property
    def ids(self) -> torch.Tensor:
        """The external id of every position, ``(N,)`` ``int64`` (a copy)."""
        return torch.from_numpy(self.id_map.ids.copy())

    @property
    def version(self) -> int:
        """How many changes this backend has made (0 when built or loaded; not saved)."""
        return self.__dict__.get("_version", 0)

    def positions_of(self, ids) -> torch.Tensor:
        """Current positions of the external ``ids`` (an unknown id is refused)."""
        with self.reading():
            return torch.from_numpy(self.id_map.positions(ids, "look up"))

    def to_ids(self, positions: torch.Tensor) -> torch.Tensor:
        """External ids of ``positions`` (any shape), on ``positions``' device."""
        return torch.from_numpy(self.id_map.ids[positions.cpu().numpy()]).to(positions.device)

    @torch.no_grad()
    def search_ids(self, queries: torch.Tensor, k: int) -> TopKScores:
        """:meth:`search` answered in external ids, computed on one version (``TopKScores.version``)."""
        with self.reading():
            res = self.search(queries, k)
            return TopKScores(res.values, self.to_ids(res.indices), self.version)

    def _check_rows(self, embeddings, count: int) -> torch.Tensor:
        return check_new_rows(embeddings, count, self.item_shape)

    def changes_since(self, version: int) -> list[GalleryChange] | None:
        """The changes after ``version`` in order (``[]`` when current), or ``None`` when older than the log kept
        (:data:`~hf_tta.gallery.ids.CHANGE_LOG`): then position-keyed state must be rebuilt, not remapped."""
        return self.__dict__.setdefault("_change_log", ChangeLog()).since(version, self.version)

    def _incremental(self) -> bool:
        """Whether cached statistics can follow a change without a pass (one process, row sums kept)."""
        stats = self._stats_cache().get("statistics")
        return stats is not None and stats.row_sums is not None

    def _old_rows(self, positions: np.ndarray) -> torch.Tensor | None:
        """The stored rows about to leave (for :func:`update_statistics`), read before the change."""
        return self.gather_single(torch.from_numpy(positions)).double().cpu() if self._incremental() else None

    def _changed(
        self, kind: str, ids: np.ndarray, positions: np.ndarray, old_size: int, old_rows: torch.Tensor | None = None
    ) -> GalleryChange:
        self.__dict__["_version"] = self.version + 1
        cache = self._stats_cache()
        stats = cache.get("statistics") if self._incremental() else None
        cache.clear()  # k-means (and statistics without row sums) were of the old gallery: recomputed on next use
        if stats is not None:  # mean and fingerprint follow the change: O(N + M D), no pass over the gallery
            new_rows = None if kind == "remove" else self.gather_single(torch.from_numpy(np.asarray(positions))).double()
            updated = update_statistics(stats, kind, torch.from_numpy(np.asarray(positions)), old_rows, new_rows)
            if updated is not None:
                cache["statistics"] = updated
        return self.__dict__.setdefault("_change_log", ChangeLog()).record(GalleryChange(
            kind=kind,
            ids=torch.from_numpy(ids.copy()),
            positions=torch.from_numpy(np.asarray(positions, dtype=np.int64)),
            old_size=old_size,
            new_size=len(self),
            version=self.version,
        ))

    def add(self, ids, embeddings: torch.Tensor) -> GalleryChange:
        """Append items with new external ``ids`` ``(M,)`` and their cached embeddings ``(M, D)`` (L2-normalised, by
        the same source model) at positions ``N .. N+M-1``. A known or repeated id, or a wrong shape, is refused and
        nothing changes."""
        with self._lock().write():
            old = self.id_map
            new = old.check_new(ids)
            rows = self._check_rows(embeddings, new.size)
            self._check_change("add")
            n = len(self)
            at = self._add(new, rows)
            at = n if at is None else at
            self._set_id_map(old.added(new, at))
            return self._changed("add", new, np.arange(at, at + new.size), n)

    def remove(self, ids) -> GalleryChange:
        """Delete the items ``ids``; the others keep their order (positions after a removed one move down)."""
        with self._lock().write():
            old = self.id_map
            arr = as_id_array(ids)
            if arr.size == 0:
                raise ValueError("No ids given: remove at least one item.")
            pos = old.positions(arr, "remove")
            if pos.size >= len(old):
                raise ValueError("Cannot remove every item: a gallery keeps at least one (build a new one instead).")
            self._check_change("remove")
            keep = np.ones(len(old), dtype=bool)
            keep[pos] = False
            n, rows = len(self), self._old_rows(pos)
            self._remove(pos, keep, arr)
            self._set_id_map(old.removed(keep))
            return self._changed("remove", arr, pos, n, rows)

    def replace(self, ids, embeddings: torch.Tensor) -> GalleryChange:
        """New embeddings ``(M, D)`` for the existing items ``ids`` (same ids, same positions)."""
        with self._lock().write():
            arr = as_id_array(ids)
            if arr.size == 0:
                raise ValueError("No ids given: replace at least one item.")
            pos = self.id_map.positions(arr, "replace")
            rows = self._check_rows(embeddings, arr.size)
            self._check_change("replace")
            old_rows = self._old_rows(pos)
            self._replace(pos, arr, rows)
            return self._changed("replace", arr, pos, len(self), old_rows)

    def save_ids(self, directory: str | os.PathLike) -> None:
        """Write the external ids to ``directory/gallery_ids.safetensors`` (ids ``0 .. N-1``: no file, a stale one is
        removed, so a gallery that never changed saves exactly as before)."""
        path = os.path.join(directory, IDS_FILE)
        if not self.id_map.is_range():
            save_file({"ids": torch.from_numpy(self.id_map.ids.copy())}, path)
        elif os.path.exists(path):
            os.remove(path)

    def load_ids(self, directory: str | os.PathLike) -> None:
        """Read ``directory/gallery_ids.safetensors`` when it exists (checked against the gallery's size)."""
        path = os.path.join(directory, IDS_FILE)
        if os.path.exists(path):
            ids = load_file(path)["ids"]
            if ids.shape != (len(self),):
                raise ValueError(f"{path} holds {ids.shape[0]} ids for a gallery of {len(self)} items.")
            self._set_id_map(IdMap(ids))

    # ---------------------------------------------------------------------------------------- whole-gallery statistics
    def iter_blocks(self, rows: int = BLOCK_ROWS) -> Iterator[tuple[int, torch.Tensor]]:
        """``(start, block)``: the single-vector view (:meth:`gather_single`) of the items in gallery order, ``rows``
        items at a time, as float32 on :attr:`device` (backends override it with a sequential read)."""
        for start in range(0, len(self), rows):
            yield start, self.gather_single(torch.arange(start, min(start + rows, len(self)))).float()

    def _stats_cache(self) -> dict:
        cache = self.__dict__.get("_statistics_cache")
        if cache is None:
            cache = self.__dict__["_statistics_cache"] = {}
        return cache

    # the hooks a sharded gallery overrides with collectives (identities in one process)
    def _stat_blocks(self):
        return self.iter_blocks

    def _reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def _gather_vector(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def _row(self, index: int) -> torch.Tensor:
        return self.gather_single(torch.tensor([index]))[0].float()

    def statistics(self) -> GalleryStatistics:
        """Mean embedding and fingerprint of the whole gallery: one streamed pass, computed on first use and cached."""
        with self.reading():
            cache = self._stats_cache()
            if "statistics" not in cache:
                one_process = type(self)._reduce is GalleryBackend._reduce  # a shard's row sums are not the gallery's
                cache["statistics"] = compute_statistics(
                    self._stat_blocks(), len(self), self.dim, self._reduce, keep_rows=one_process
                )
            return cache["statistics"]

    def kmeans(self, k: int, iters: int = 50, seed: int = 0) -> GalleryKMeans:
        """Spherical k-means of the whole gallery (``k`` clusters, at most ``iters`` Lloyd iterations, k-means++ seeded
        with ``seed``): the algorithm of REST's dense path (:func:`hf_tta.objectives.rest.spherical_kmeans`), streamed
        in blocks; computed on first use per ``(k, iters, seed)`` and cached."""
        key = (int(k), int(iters), int(seed))
        with self.reading():
            cache = self._stats_cache().setdefault("kmeans", {})
            if key not in cache:
                cache[key] = gallery_kmeans(
                    self._stat_blocks(), len(self), self._row, k, iters, seed, self._reduce, self._gather_vector
                )
            return cache[key]

    def statistics_tensors(self) -> dict[str, torch.Tensor]:
        """The cached statistics as named tensors (what ``save`` writes to ``gallery_stats.safetensors``)."""
        cache = self._stats_cache()
        out: dict[str, torch.Tensor] = {}
        if "statistics" in cache:
            out["mean"], out["fingerprint"] = cache["statistics"].mean, cache["statistics"].fingerprint
        for (k, iters, seed), res in cache.get("kmeans", {}).items():
            for field in ("centroids", "labels", "counts"):
                out[f"kmeans.k{k}.iters{iters}.seed{seed}.{field}"] = getattr(res, field)
        return {name: t.detach().cpu().contiguous() for name, t in out.items()}

    def load_statistics_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        """Fill the cache from :meth:`statistics_tensors`' output (checked against this gallery's size and dimension)."""
        n, d = len(self), self.dim
        cache: dict = {}
        if "mean" in tensors:
            mean, fp = tensors["mean"], tensors["fingerprint"]
            if mean.shape != (d,) or int(fp[0]) != n:
                raise ValueError(f"The saved gallery statistics are of another gallery (N={int(fp[0])}, D={mean.shape[0]}).")
            cache["statistics"] = GalleryStatistics(mean=mean, fingerprint=fp)
        parts: dict[tuple, dict] = {}
        for name, t in tensors.items():
            m = _KMEANS_KEY.match(name)
            if m:
                parts.setdefault((int(m[1]), int(m[2]), int(m[3])), {})[m[4]] = t
        for key, fields in parts.items():
            res = GalleryKMeans(**fields)
            if res.labels.shape != (n,) or res.centroids.shape[1] != d:
                raise ValueError(f"The saved k-means {key} is of another gallery (labels {tuple(res.labels.shape)}).")
            cache.setdefault("kmeans", {})[key] = res
        self._stats_cache().update(cache)

    def save_statistics(self, directory: str | os.PathLike) -> None:
        """Write the cached statistics to ``directory/gallery_stats.safetensors`` (none cached: no file, and a stale one
        is removed)."""
        tensors, path = self.statistics_tensors(), os.path.join(directory, STATS_FILE)
        if tensors:
            save_file(tensors, path)
        elif os.path.exists(path):
            os.remove(path)

    def load_statistics(self, directory: str | os.PathLike) -> None:
        """Read ``directory/gallery_stats.safetensors`` when it exists."""
        path = os.path.join(directory, STATS_FILE)
        if os.path.exists(path):
            self.load_statistics_tensors(load_file(path))
