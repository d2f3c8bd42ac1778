"""FAISS gallery: approximate (IVF, HNSW) or exact (flat) top-k search over a vector index built from the cached
source-model gallery embeddings, saved and loaded beside a JSON manifest (``faiss.write_index``; never pickle).

Requires ``faiss-cpu`` (``pip install "hf_tta[index]"``). With a GPU build of FAISS and queries on CUDA the index is
copied to the GPU once (``faiss.index_cpu_to_gpu``); otherwise it searches on the CPU and the results are moved to the
queries' device.
"""

from __future__ import annotations

import json
import math
import os
from typing import Iterable

import numpy as np
import torch

from .base import GalleryBackend, TopKScores, check_k
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
    """

    def __init__(self, index, modality: str, k: int = 100, nprobe: int = 32, ef_search: int = 128, factory: str = ""):
        faiss = _faiss()
        if index.ntotal == 0:
            raise ValueError("The FAISS index is empty: add the gallery embeddings first (FaissGallery.build).")
        if index.metric_type != faiss.METRIC_INNER_PRODUCT:
            raise ValueError("The FAISS index must use METRIC_INNER_PRODUCT (cosine on normalised embeddings).")
        self.index, self.modality, self.factory = index, modality, factory
        self.k, self.nprobe, self.ef_search = check_k(k), check_k(nprobe), check_k(ef_search)
        self.exact = factory in ("", "Flat") and isinstance(index, faiss.IndexFlat)
        self._apply_search_params(index)
        ivf = self._ivf(index)
        if ivf is not None:  # reconstruct() of an IVF index needs its id -> list map
            ivf.make_direct_map()
        self._gpu_index = None

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
        """Build an index from the gallery embeddings ``(N, D)`` (a tensor, or an iterable of ``(n_i, D)`` blocks;
        pass ``num_items`` then so the preset can size the inverted lists).

        Args:
            index (`str`): a preset (``"flat"``, ``"ivf"``, ``"ivf_sq8"``, ``"ivf_pq"``, ``"hnsw"``) or any
                ``faiss.index_factory`` string (e.g. ``"IVF4096,SQ8"``).
            nlist (`int`, *optional*): inverted lists for the IVF presets (default :func:`default_nlist`).
            pq_m (`int`, *optional*): bytes per code for ``ivf_pq`` (default ``D // 8``).
            train_size (`int`, *optional*): vectors the quantisers are trained on: the first ``train_size`` items
                (default ``min(N, 32 * nlist)``, at least 10,000 when available).
            kwargs: ``k``, ``nprobe``, ``ef_search`` of :class:`FaissGallery`.
        """
        faiss = _faiss()
        if isinstance(embeddings, torch.Tensor):
            if embeddings.dim() != 2 or embeddings.shape[0] == 0:
                raise ValueError(f"FaissGallery.build needs (N, D) embeddings, got {tuple(embeddings.shape)}.")
            num_items = embeddings.shape[0]
            blocks: Iterable[torch.Tensor] = embeddings.split(65536)
        else:
            if num_items is None:
                raise ValueError("Pass num_items when building from an iterable of blocks.")
            blocks = embeddings
        it = iter(blocks)
        first = _as_numpy(next(it))
        dim = first.shape[1]
        nlist = nlist or default_nlist(num_items)
        factory = PRESETS.get(index, index).format(nlist=nlist, m=pq_m or max(1, dim // 8))
        idx = faiss.index_factory(dim, factory, faiss.METRIC_INNER_PRODUCT)
        pending = [first]
        if not idx.is_trained:
            want = min(num_items, train_size or max(32 * nlist, 10000))
            have = sum(len(p) for p in pending)
            while have < want:
                try:
                    pending.append(_as_numpy(next(it)))
                except StopIteration:
                    break
                have += len(pending[-1])
            sample = np.concatenate(pending)[:want]
            ivf = cls._ivf(idx)
            if ivf is not None:
                ivf.cp.seed = seed
            idx.train(sample)
            del sample
        for block in pending:
            idx.add(block)
        for block in it:
            idx.add(_as_numpy(block))
        if idx.ntotal != num_items:
            raise ValueError(f"The blocks hold {idx.ntotal} rows, expected num_items={num_items}.")
        return cls(idx, modality, factory=factory, **kwargs)

    def save(self, directory: str | os.PathLike) -> None:
        """``gallery.faiss`` (``faiss.write_index``), ``gallery.json`` (modality, factory, k, nprobe, ef_search) and,
        when computed, ``gallery_stats.safetensors`` (:meth:`statistics` and :meth:`kmeans`)."""
        faiss = _faiss()
        os.makedirs(directory, exist_ok=True)
        faiss.write_index(self.index, os.path.join(directory, INDEX_FILE))
        manifest = {
            "backend": "faiss",
            "modality": self.modality,
            "factory": self.factory,
            "k": self.k,
            "nprobe": self.nprobe,
            "ef_search": self.ef_search,
            "num_items": len(self),
            "dim": self.dim,
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
        self = cls(index, manifest["modality"], factory=manifest["factory"], **kwargs)
        self.load_statistics(directory)
        return self

    # ---------------------------------------------------------------------------------------- interface
    def __len__(self) -> int:
        return int(self.index.ntotal)

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
        k = min(check_k(k), len(self))
        values, indices = self._searcher(queries.device).search(_as_numpy(queries), k)
        values, indices = torch.from_numpy(values), torch.from_numpy(indices)
        # an approximate index can return fewer than k hits (-1): fill with the first hit, a duplicate that the
        # wrapper's candidate union removes
        missing = indices < 0
        if missing.any():
            indices = torch.where(missing, indices[:, :1], indices)
            values = torch.where(missing, values[:, :1], values)
        return TopKScores(values.to(queries.device), indices.to(queries.device))

    def iter_blocks(self, rows: int = BLOCK_ROWS):
        """The index's stored vectors in order (``reconstruct_n``: decoded for quantised indexes)."""
        n = len(self)
        for start in range(0, n, rows):
            yield start, torch.from_numpy(self.index.reconstruct_n(start, min(rows, n - start)))

    def gather(self, indices: torch.Tensor) -> torch.Tensor:
        ids = np.ascontiguousarray(indices.cpu().numpy().astype(np.int64))
        return torch.from_numpy(self.index.reconstruct_batch(ids))


def _as_numpy(x: torch.Tensor) -> np.ndarray:
    return np.ascontiguousarray(x.detach().to("cpu", torch.float32).numpy())
