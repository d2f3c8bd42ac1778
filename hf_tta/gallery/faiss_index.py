"""FAISS gallery: approximate (IVF, HNSW) or exact (flat) top-k search over a vector index built from the cached
source-model gallery embeddings, saved and loaded beside a JSON manifest (``faiss.write_index``; never pickle).

Requires ``faiss-cpu`` (``pip install "hf_tta[index]"``). With a GPU build of FAISS and queries on CUDA the index is
copied to the GPU once (``faiss.index_cpu_to_gpu``); otherwise it searches on the CPU and the results are moved to the
queries' device.

A live index (:meth:`~hf_tta.gallery.GalleryBackend.add` / ``remove`` / ``replace``): the index's labels are the
items' external ids. IVF indexes store them natively (``add_with_ids``, ``remove_ids``; the id -> list map becomes a
hash table, ``faiss.DirectMap.Hashtable``, at the first change or when built with ids); other indexes are wrapped in
``faiss.IndexIDMap2`` (labels and ``reconstruct`` by id): when built with ids, or at the first change of an index built
without (its stored vectors are re-added once, no re-encoding; for HNSW that rebuilds the graph). HNSW cannot remove
items (FAISS does not implement it): ``remove`` and ``replace`` are refused there. Positions (what ``search`` returns
and ``gather`` takes) follow the backend-wide rules of :mod:`hf_tta.gallery.ids`, whatever FAISS's internal order; the
id of each position is saved beside the index (``gallery_ids.safetensors``) once it differs from ``0 .. N-1``.
A memory-mapped index (``load(mmap=True)``) is read-only.

Multi-vector items ``(N, Q, D)`` (BLIP-2's Q-Former tokens, an item scored by the max over its vectors): the index
holds every vector, ``N * Q`` of them, vector ``t`` of item ``i`` under the label ``i * Q + t`` (``i``: the position
while the labels are positions, the external id once they are ids; ids must then lie in ``[0, 2**63 // Q)``). A search
fetches the ``k * Q`` best vectors (at least ``k`` distinct items), keeps each item's best hit, takes the ``k`` best
items and re-scores them exactly (the max over all their stored vectors, :func:`~hf_tta.gallery.base.item_scores`),
so the returned scores are exact for the stored vectors. With a flat index the ``k`` items are the exact top-k (the
exact top-k items are the first ``k`` distinct items of the exact vector ranking, all within its first ``k * Q``);
with an approximate index (IVF, HNSW) recall can differ from exact as for single vectors: an item whose vectors the
index's probes miss is not found. ``remove`` and ``replace`` delete all ``Q`` vectors of an item.
"""

from __future__ import annotations

import json
import math
import os
from typing import Iterable

import numpy as np
import torch

from .base import IDS_FILE, GalleryBackend, TopKScores, check_item_queries, check_k, item_scores, merge_topk
from .ids import IdMap
from .stats import BLOCK_ROWS

INDEX_FILE = "gallery.faiss"
MANIFEST_FILE = "gallery.json"
#: Index presets by name; ``{nlist}``/``{m}`` are filled from the gallery size and dimension.
PRESETS = {
    "flat": "Flat",  # exact inner product
    "ivf": "IVF{nlist},Flat",  # inverted lists, exact vectors (4 bytes / dim / item)
    "ivf_sq8": "IVF{nlist},SQ8",  # inverted lists, 8-bit scalar-quantised vectors (1 byte / dim / item)
    "ivf_pq": "IVF{nlist},PQ{m}",  # inverted lists, product-quantised codes (m bytes / item)
    "hnsw": "HNSW32,Flat",  # graph index, exact vectors
}


def _faiss():
    try:
        import faiss
    except ImportError as err:  # pragma: no cover - the index extra is part of the test extra
        raise ImportError('FaissGallery needs faiss: pip install "hf_tta[index]" (faiss-cpu).') from err
    return faiss


def default_nlist(num_items: int) -> int:
    """Inverted lists: ``sqrt(N)`` (FAISS's guideline is 4 sqrt(N) to 16 sqrt(N); sqrt(N) keeps training on a CPU short),
    at least 1 and at most 4096."""
    return int(min(4096, max(1, round(math.sqrt(num_items)))))


class FaissGallery(GalleryBackend):
    """A gallery searched through a FAISS index (inner product on L2-normalised embeddings = cosine).

    Build it with :meth:`build` from the gallery embeddings (a tensor, or blocks of one), save it with :meth:`save`
    and reload it with :meth:`load`. Search returns the index's (possibly approximate) top-k; the wrapper then
    re-scores the candidates exactly against the embeddings :meth:`gather` returns, which are the index's stored
    vectors (exact for ``flat``/``ivf``/``hnsw``, quantised for ``ivf_sq8``/``ivf_pq``).

    Args:
        index: a FAISS index with ``metric_type == METRIC_INNER_PRODUCT`` holding the gallery.
        modality (`str`): the gallery modality.
        k (`int`): neighbours per query (candidate set and returned width). Default 100.
        nprobe (`int`): inverted lists visited per query (IVF indexes). Default 32.
        ef_search (`int`): HNSW search breadth. Default 128.
        factory (`str`): the ``faiss.index_factory`` string the index was built from (kept in the manifest).
        ids (*optional*): the external id of each position ``(N,)``; default: the index's labels in their order
            (``0 .. N-1`` for an index built without ids). They must be the index's labels.
        read_only (`bool`): refuse changes (a memory-mapped index).
        num_vectors (`int`, *optional*): vectors per item ``Q`` of a multi-vector gallery (the index then holds
            ``N * Q`` vectors labelled ``item * Q + t``, see the module docstring); ``None`` for single vectors.
    """

    def __init__(
        self, index, modality: str, k: int = 100, nprobe: int = 32, ef_search: int = 128, factory: str = "",
        ids=None, read_only: bool = False, num_vectors: int | None = None,
    ):
        faiss = _faiss()
        if index.ntotal == 0:
            raise ValueError("The FAISS index is empty: add the gallery embeddings first (FaissGallery.build).")
        self.num_vectors = None if num_vectors is None else check_k(num_vectors)
        if index.ntotal % self._q:
            raise ValueError(f"The FAISS index holds {index.ntotal} vectors, not a multiple of num_vectors={self._q}.")
        if index.metric_type != faiss.METRIC_INNER_PRODUCT:
            raise ValueError("The FAISS index must use METRIC_INNER_PRODUCT (cosine on normalised embeddings).")
        self.index, self.modality, self.factory = index, modality, factory
        self.k, self.nprobe, self.ef_search = check_k(k), check_k(nprobe), check_k(ef_search)
        self.exact = factory in ("", "Flat") and isinstance(self._base(), faiss.IndexFlat)
        self._read_only = read_only
        self._apply_search_params(self._base())
        if ids is None and self._id_wrapped():
            labels = faiss.vector_to_array(index.id_map).astype(np.int64)
            labels = labels[labels % self._q == 0] // self._q  # each item's first vector names it
            ids = None if np.array_equal(np.sort(labels), np.arange(labels.size)) else labels
        if ids is not None:
            self._set_id_map(IdMap(ids))
            self._check_ids(self.id_map.ids)
        ivf = self._ivf(index)
        # a plain index's labels are positions (until its first change): no id lookup per search
        self._plain = not self._id_wrapped() and self.id_map.is_range()
        if not self._plain and ivf is None and not self._id_wrapped():
            raise ValueError("A FAISS index without ids has labels 0 .. N-1: pass ids to FaissGallery.build instead.")
        if ivf is not None:  # reconstruct() of an IVF index needs its id -> list map (a hash table for arbitrary ids)
            if self.id_map.is_range():
                ivf.make_direct_map()
            else:
                ivf.set_direct_map_type(faiss.DirectMap.Hashtable)
        self._gpu_index = None

    @property
    def _q(self) -> int:
        return self.num_vectors or 1

    def _check_ids(self, ids: np.ndarray) -> None:
        _check_item_ids(ids, self._q)

    def _labels(self, items: np.ndarray) -> np.ndarray:
        return _vector_labels(items, self._q)

    def _id_wrapped(self) -> bool:
        faiss = _faiss()
        return isinstance(self.index, (faiss.IndexIDMap, faiss.IndexIDMap2))

    def _base(self):
        """The index inside an ``IndexIDMap2`` wrapper (the index itself otherwise)."""
        return _faiss().downcast_index(self.index.index) if self._id_wrapped() else self.index

    @staticmethod
    def _ivf(index):
        faiss = _faiss()
        try:
            return faiss.extract_index_ivf(index)
        except RuntimeError:
            return None

    def _apply_search_params(self, index) -> None:
        ivf = self._ivf(index)
        if ivf is not None:
            ivf.nprobe = self.nprobe
        if hasattr(index, "hnsw"):
            index.hnsw.efSearch = self.ef_search

    # ---------------------------------------------------------------------------------------- construction
    @classmethod
    def build(
        cls,
        embeddings: torch.Tensor | Iterable[torch.Tensor],
        modality: str,
        index: str = "ivf",
        num_items: int | None = None,
        nlist: int | None = None,
        pq_m: int | None = None,
        train_size: int | None = None,
        seed: int = 0,
        **kwargs,
    ) -> "FaissGallery":
        """Build an index from the gallery embeddings ``(N, D)`` or multi-vector ``(N, Q, D)`` (a tensor, or an
        iterable of ``(n_i, D)`` / ``(n_i, Q, D)`` blocks; pass ``num_items`` then so the preset can size the inverted
        lists). A multi-vector gallery indexes its ``N * Q`` vectors (nlist and train_size count vectors).

        Args:
            index (`str`): a preset (``"flat"``, ``"ivf"``, ``"ivf_sq8"``, ``"ivf_pq"``, ``"hnsw"``) or any
                ``faiss.index_factory`` string (e.g. ``"IVF4096,SQ8"``).
            nlist (`int`, *optional*): inverted lists for the IVF presets (default :func:`default_nlist`).
            pq_m (`int`, *optional*): bytes per code for ``ivf_pq`` (default ``D // 8``).
            train_size (`int`, *optional*): vectors the quantisers are trained on: the first ``train_size`` items
                (default ``min(N, 32 * nlist)``, at least 10,000 when available).
            ids (*optional*): the external id of each item ``(N,)`` (the index's labels); default ``0 .. N-1``.
            kwargs: ``k``, ``nprobe``, ``ef_search`` of :class:`FaissGallery`.
        """
        faiss = _faiss()
        ids = kwargs.pop("ids", None)
        if ids is not None:
            ids = IdMap(ids).ids  # distinct integers
        if isinstance(embeddings, torch.Tensor):
            if embeddings.dim() not in (2, 3) or 0 in embeddings.shape:
                raise ValueError(f"FaissGallery.build needs (N, D) or (N, Q, D) embeddings, got {tuple(embeddings.shape)}.")
            num_items = embeddings.shape[0]
            blocks: Iterable[torch.Tensor] = embeddings.split(65536)
        else:
            if num_items is None:
                raise ValueError("Pass num_items when building from an iterable of blocks.")
            blocks = embeddings
        it = iter(blocks)
        head = next(it)
        q = head.shape[1] if head.dim() == 3 else None
        if head.dim() not in (2, 3) or 0 in head.shape[1:]:
            raise ValueError(f"FaissGallery.build needs (n, D) or (n, Q, D) blocks, got {tuple(head.shape)}.")
        item = tuple(head.shape[1:])

        def flat(block: torch.Tensor) -> np.ndarray:  # an item's vectors as consecutive rows
            if tuple(block.shape[1:]) != item:
                raise ValueError(f"Every block must be (n, {', '.join(map(str, item))}), got {tuple(block.shape)}.")
            return _as_numpy(block.reshape(-1, item[-1]))

        first, per_item = flat(head), q or 1
        dim = first.shape[1]
        nlist = nlist or default_nlist(num_items * per_item)
        factory = PRESETS.get(index, index).format(nlist=nlist, m=pq_m or max(1, dim // 8))
        idx = faiss.index_factory(dim, factory, faiss.METRIC_INNER_PRODUCT)
        pending = [first]
        if not idx.is_trained:
            want = min(num_items * per_item, train_size or max(32 * nlist, 10000))
            have = sum(len(p) for p in pending)
            while have < want:
                try:
                    pending.append(flat(next(it)))
                except StopIteration:
                    break
                have += len(pending[-1])
            sample = np.concatenate(pending)[:want]
            ivf = cls._ivf(idx)
            if ivf is not None:
                ivf.cp.seed = seed
            idx.train(sample)
            del sample
        labels = None
        if ids is not None:
            if ids.size != num_items:
                raise ValueError(f"{ids.size} ids for num_items={num_items} items: pass one id per item.")
            _check_item_ids(ids, per_item)
            labels = _vector_labels(ids, per_item)
            if cls._ivf(idx) is None:
                idx = faiss.IndexIDMap2(idx)
            else:
                cls._ivf(idx).set_direct_map_type(faiss.DirectMap.Hashtable)
        added = 0
        for block in (*pending, *map(flat, it)):
            if labels is None:
                idx.add(block)
            elif added + len(block) <= labels.size:
                idx.add_with_ids(block, labels[added : added + len(block)])
            added += len(block)
        if added != num_items * per_item:
            raise ValueError(f"The blocks hold {added // per_item} items, expected num_items={num_items}.")
        return cls(idx, modality, factory=factory, ids=ids, num_vectors=q, **kwargs)

    def save(self, directory: str | os.PathLike) -> None:
        """``gallery.faiss`` (``faiss.write_index``), ``gallery.json`` (modality, factory, k, nprobe, ef_search) and,
        when computed, ``gallery_stats.safetensors`` (:meth:`statistics` and :meth:`kmeans`)."""
        faiss = _faiss()
        os.makedirs(directory, exist_ok=True)
        with self.reading():
            self._save(faiss, directory)

    def _save(self, faiss, directory) -> None:
        faiss.write_index(self.index, os.path.join(directory, INDEX_FILE))
        self.save_ids(directory)
        manifest = {
            "backend": "faiss",
            "modality": self.modality,
            "factory": self.factory,
            "k": self.k,
            "nprobe": self.nprobe,
            "ef_search": self.ef_search,
            "num_items": len(self),
            "dim": self.dim,
            "num_vectors": self.num_vectors,
        }
        with open(os.path.join(directory, MANIFEST_FILE), "w") as fh:
            json.dump(manifest, fh, indent=2)
        self.save_statistics(directory)

    @classmethod
    def load(cls, directory: str | os.PathLike, mmap: bool = False, **overrides) -> "FaissGallery":
        """Load what :meth:`save` wrote; ``mmap=True`` memory-maps the index file (``faiss.IO_FLAG_MMAP``)."""
        faiss = _faiss()
        with open(os.path.join(directory, MANIFEST_FILE)) as fh:
            manifest = json.load(fh)
        if manifest.get("backend") != "faiss":
            raise ValueError(f"{directory!r} holds a {manifest.get('backend')!r} gallery, not a FAISS one.")
        flags = faiss.IO_FLAG_MMAP if mmap else 0
        index = faiss.read_index(os.path.join(directory, INDEX_FILE), flags)
        kwargs = {k: manifest[k] for k in ("k", "nprobe", "ef_search")}
        kwargs.update(overrides)
        ids_path = os.path.join(directory, IDS_FILE)
        if os.path.exists(ids_path):
            from safetensors.torch import load_file

            kwargs["ids"] = load_file(ids_path)["ids"]
        self = cls(index, manifest["modality"], factory=manifest["factory"], read_only=mmap,
                   num_vectors=manifest.get("num_vectors"), **kwargs)
        self.load_statistics(directory)
        return self

    # ---------------------------------------------------------------------------------------- interface
    def __len__(self) -> int:
        return int(self.index.ntotal) // self._q

    @property
    def dim(self) -> int:
        return int(self.index.d)

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    def _searcher(self, device: torch.device):
        """The GPU copy of the index for CUDA queries when FAISS has GPU support; the CPU index otherwise."""
        faiss = _faiss()
        if device.type != "cuda" or not hasattr(faiss, "StandardGpuResources"):
            return self.index
        if self._gpu_index is None:  # pragma: no cover - needs a GPU build of faiss
            self._gpu_res = faiss.StandardGpuResources()
            self._gpu_index = faiss.index_cpu_to_gpu(self._gpu_res, device.index or 0, self.index)
            self._apply_search_params(self._gpu_index)
        return self._gpu_index

    @torch.no_grad()
    def search(self, queries: torch.Tensor, k: int) -> TopKScores:
        with self.reading():
            k = min(check_k(k), len(self))
            if self.num_vectors is not None:
                return self._search_items(queries, k)
            values, labels = self._searcher(queries.device).search(_as_numpy(queries), k)
            # an approximate index can return fewer than k hits (-1): fill with the first hit, a duplicate that the
            # wrapper's candidate union removes
            missing = labels < 0
            if missing.any():
                labels = np.where(missing, labels[:, :1], labels)
                values = np.where(missing, values[:, :1], values)
            positions = labels if self._labels_are_positions() else self._positions(labels)
        return TopKScores(torch.from_numpy(values).to(queries.device), torch.from_numpy(positions).to(queries.device))

    def _search_items(self, queries: torch.Tensor, k: int) -> TopKScores:
        """Multi-vector search: the ``k * Q`` best vectors, each item's best hit, the ``k`` best items, re-scored
        exactly (see the module docstring)."""
        check_item_queries(queries)
        values, labels = self._searcher(queries.device).search(_as_numpy(queries), min(k * self._q, self.index.ntotal))
        items = labels // self._q  # -1 (no hit) stays -1
        missing = labels < 0
        if not self._labels_are_positions():  # a stand-in id where nothing was found, masked next
            items = self._positions(np.where(missing, self.id_map.ids[0], items))
        pos = np.where(missing, -1, items)
        pos_t, hit = torch.from_numpy(pos), torch.from_numpy(values).masked_fill(torch.from_numpy(missing), -torch.inf)
        # the hits come best first: an item's first hit is its best; keep one hit per item
        order = pos_t.argsort(dim=1, stable=True)
        run = pos_t.gather(1, order)
        first = torch.ones_like(run, dtype=torch.bool)
        first[:, 1:] = run[:, 1:] != run[:, :-1]
        hit = hit.masked_fill(~torch.empty_like(first).scatter_(1, order, first), -torch.inf)
        best, col = hit.topk(min(k, hit.shape[1]), dim=1)
        cand = pos_t.gather(1, col)
        # an approximate index can find fewer than k items: fill with the row's best item, a duplicate that the
        # wrapper's candidate union removes
        cand = torch.where(best > -torch.inf, cand, cand[:, :1]).clamp(min=0)
        uniq, inv = torch.unique(cand, return_inverse=True)
        exact = item_scores(queries.detach().float().cpu(), self.gather(uniq)).gather(1, inv)
        return merge_topk(exact, cand, k).to(queries.device)

    def _labels_are_positions(self) -> bool:
        return self._plain

    def _positions(self, labels: np.ndarray) -> np.ndarray:
        pos, found = self.id_map.lookup(labels.reshape(-1))
        if not found.all():  # pragma: no cover - the index and the id map are changed together under the write lock
            raise RuntimeError("The FAISS index returned a label that is not a gallery id: the index was changed directly.")
        return pos.reshape(labels.shape)

    def iter_blocks(self, rows: int = BLOCK_ROWS):
        """The index's stored vectors in position order (decoded for quantised indexes; the single-vector view of
        multi-vector items)."""
        n = len(self)
        for start in range(0, n, rows):
            yield start, self.gather_single(torch.arange(start, min(start + rows, n)))

    def gather(self, indices: torch.Tensor) -> torch.Tensor:
        with self.reading():
            pos = np.ascontiguousarray(indices.cpu().numpy().astype(np.int64))
            if pos.size and (pos.min() < 0 or pos.max() >= len(self)):
                raise IndexError(f"Gallery positions must lie in [0, {len(self)}), got {pos.min()}..{pos.max()}.")
            labels = pos if self._labels_are_positions() else np.ascontiguousarray(self.id_map.ids[pos])
            rows = torch.from_numpy(self.index.reconstruct_batch(self._labels(labels)))
            return rows if self.num_vectors is None else rows.view(pos.size, self._q, self.dim)

    # ---------------------------------------------------------------------------------------- live index
    def _check_change(self, kind: str) -> None:
        faiss = _faiss()
        if self._read_only:
            raise ValueError(f"A memory-mapped FaissGallery is read-only: load it with mmap=False to {kind} items.")
        if kind != "add" and isinstance(self._base(), faiss.IndexHNSW):
            raise ValueError(
                f"FAISS HNSW indexes cannot remove items, so cannot {kind} them: rebuild with FaissGallery.build, or use "
                "the flat or ivf presets for a gallery that changes."
            )

    def _ensure_ids(self) -> None:
        """Make the index's labels external ids: a hash-table direct map (IVF), or an ``IndexIDMap2`` wrapper holding
        the current vectors under the current ids (other indexes, once)."""
        faiss = _faiss()
        plain, self._plain = self._plain, False  # labels are ids from now on (not positions)
        ivf = self._ivf(self.index)
        if ivf is not None:
            ids = np.ascontiguousarray(self.id_map.ids)
            relabel = plain and not self.id_map.is_range()  # labels 0 .. N-1 but other ids (a shard): relabel once
            vectors = self.index.reconstruct_n(0, self.index.ntotal) if relabel else None
            if relabel:
                self.index.reset()
            if ivf.direct_map.type != faiss.DirectMap.Hashtable:
                ivf.set_direct_map_type(faiss.DirectMap.Hashtable)
            if relabel:
                self.index.add_with_ids(vectors, self._labels(ids))
            return
        if self._id_wrapped():
            return
        vectors = self.index.reconstruct_n(0, self.index.ntotal)  # labels are positions in a plain index
        empty = faiss.clone_index(self.index)
        empty.reset()
        wrapped = faiss.IndexIDMap2(empty)
        wrapped.add_with_ids(vectors, self._labels(self.id_map.ids))
        self._keep_alive = empty  # the wrapper does not own the inner index's Python object
        self.index = wrapped
        self._apply_search_params(self._base())

    def _add(self, ids: np.ndarray, rows: torch.Tensor) -> None:
        self._check_ids(ids)  # before anything moves
        self._ensure_ids()
        self.index.add_with_ids(_as_numpy(rows.reshape(-1, self.dim)), self._labels(ids))
        self._gpu_index = None

    def _remove(self, positions: np.ndarray, keep: np.ndarray, ids: np.ndarray) -> None:
        self._ensure_ids()
        removed = self.index.remove_ids(self._labels(ids))
        if removed != ids.size * self._q:  # pragma: no cover - every id was checked against the id map first
            raise RuntimeError(f"FAISS removed {removed} of {ids.size * self._q} vectors: the index and its ids disagree.")
        self._gpu_index = None

    def _replace(self, positions: np.ndarray, ids: np.ndarray, rows: torch.Tensor) -> None:
        self._ensure_ids()
        self.index.remove_ids(self._labels(ids))
        self.index.add_with_ids(_as_numpy(rows.reshape(-1, self.dim)), self._labels(ids))
        self._gpu_index = None


def _as_numpy(x: torch.Tensor) -> np.ndarray:
    return np.ascontiguousarray(x.detach().to("cpu", torch.float32).numpy())


def _check_item_ids(ids: np.ndarray, q: int) -> None:
    """Multi-vector labels ``id * Q + t`` must fit in int64: ids in ``[0, 2**63 // Q)``."""
    if q > 1 and ids.size and (ids.min() < 0 or ids.max() >= 2**63 // q):
        raise ValueError(
            f"A multi-vector FaissGallery labels vector t of item i as i * {q} + t: ids must lie in [0, {2**63 // q}), "
            f"got {int(ids.min())}..{int(ids.max())}."
        )


def _vector_labels(items: np.ndarray, q: int) -> np.ndarray:
    """The index labels of every vector of the items labelled ``items``: ``item * Q + t`` (the items' own for Q = 1)."""
    items = np.ascontiguousarray(items, dtype=np.int64)
    return items if q == 1 else np.ascontiguousarray((items[:, None] * q + np.arange(q)).reshape(-1))
