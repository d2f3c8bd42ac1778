"""Exact chunked gallery: top-k by blocks of the ``B x N`` score matrix, never the whole matrix at once.

The embeddings are held in memory in any float dtype (``float16`` halves the footprint: 10^7 x 512 items take 10 GB)
or read block by block from a memory-mapped safetensors file (:meth:`ChunkedGallery.load` with ``mmap=True``). Each
block is cast to float32 before scoring, so the search is exact for the stored values.

Multi-vector items ``(N, Q, D)`` (BLIP-2's Q-Former tokens) are scored per block by the max over each item's vectors
(:func:`~hf_tta.gallery.base.item_scores`, the expression of ``ModelAdapter.score``), so the top-k ids and scores are
those of the dense :class:`~hf_tta.GalleryCache` path; ``chunk_size`` then counts vectors (``chunk_size // Q`` items
per block), so a block's scores take the same memory as for single-vector items.

A live index (:meth:`~hf_tta.gallery.GalleryBackend.add` / ``remove`` / ``replace``): the rows live in a buffer with
spare capacity (grown by an eighth when full, so appending one item at a time costs amortised ``O(D)``); a removal
moves only the rows after the first removed one; a replacement overwrites its rows. The caller's tensor is never
written: the first change copies it. A memory-mapped gallery is read-only (load it with ``mmap=False`` to change it).
"""

from __future__ import annotations

import json
import os
from typing import Iterable

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from .base import GalleryBackend, TopKScores, check_k, item_scores, merge_topk
from .cache import single_vector
from .ids import IdMap
from .stats import BLOCK_ROWS

EMBEDDINGS_FILE = "gallery.safetensors"
MANIFEST_FILE = "gallery.json"
_KEY = "embeddings"


class ChunkedGallery(GalleryBackend):
    """Exact top-k over ``(N, D)`` or multi-vector ``(N, Q, D)`` embeddings, scored ``chunk_size`` vectors at a time.

    Args:
        embeddings (`torch.Tensor` of shape `(N, D)` or `(N, Q, D)`): L2-normalised embeddings (any float dtype; kept
            as given, so pass ``float16`` to halve the memory).
        modality (`str`): the gallery modality.
        k (`int`): neighbours per query (candidate set and returned width). Default 100.
        chunk_size (`int`): vectors scored per block (items for ``(N, D)``, ``max(1, chunk_size // Q)`` items for
            ``(N, Q, D)``); memory of a block is ``B x chunk_size`` scores plus the block cast to float32. Default 65,536.
        ids (*optional*): the external id of each row ``(N,)`` (distinct integers); default ``0 .. N-1``.
    """

    exact = True

    def __init__(self, embeddings: torch.Tensor, modality: str, k: int = 100, chunk_size: int = 65536, ids=None):
        self.check_embeddings(embeddings)
        if not embeddings.is_floating_point():
            raise TypeError(f"Gallery embeddings must be floating point, got {embeddings.dtype}.")
        self._buf = embeddings.detach()
        self._owned = False  # the caller's tensor: copied before the first change
        self.modality = modality
        self.k = check_k(k)
        self.chunk_size = check_k(chunk_size)
        self._file: str | None = None
        self._n, self._dim = embeddings.shape[0], embeddings.shape[-1]
        self.num_vectors = embeddings.shape[1] if embeddings.dim() == 3 else None
        if ids is not None:
            self._set_id_map(IdMap(ids))

    @property
    def embeddings(self) -> torch.Tensor | None:
        """The ``(N, D)`` (or ``(N, Q, D)``) rows of the current version (a view: copy it to keep it across changes); ``None`` when
        memory-mapped."""
        return None if self._file is not None else self._buf[: self._n]

    # ---------------------------------------------------------------------------------------- construction
    @classmethod
    def from_chunks(
        cls, chunks: Iterable[torch.Tensor], num_items: int, dim: int, modality: str, dtype=torch.float16,
        num_vectors: int | None = None, **kwargs,
    ) -> "ChunkedGallery":
        """Fill a preallocated ``(num_items, dim)`` (or ``(num_items, num_vectors, dim)``) store of ``dtype`` from an
        iterable of ``(n_i, dim)`` (``(n_i, num_vectors, dim)``) blocks, so no full float32 copy ever exists (e.g. the
        output of ``encode_gallery`` run over a DataLoader, block by block)."""
        item = (dim,) if num_vectors is None else (num_vectors, dim)
        store = torch.empty(num_items, *item, dtype=dtype)
        start = 0
        for block in chunks:
            if tuple(block.shape[1:]) != item or block.dim() != len(item) + 1:
                raise ValueError(f"Every block must be (n, {', '.join(map(str, item))}), got {tuple(block.shape)}.")
            if start + block.shape[0] > num_items:
                raise ValueError(f"The blocks hold more than num_items={num_items} rows.")
            store[start : start + block.shape[0]] = block.detach().to("cpu", dtype)
            start += block.shape[0]
        if start != num_items:
            raise ValueError(f"The blocks hold {start} rows, expected num_items={num_items}.")
        return cls(store, modality, **kwargs)

    def save(self, directory: str | os.PathLike) -> None:
        """``gallery.safetensors`` (the embeddings), ``gallery.json`` (modality, k, chunk size) and, when computed,
        ``gallery_stats.safetensors`` (:meth:`statistics` and :meth:`kmeans`, so they are not recomputed after ``load``)."""
        os.makedirs(directory, exist_ok=True)
        with self.reading():
            if self._file is None:
                save_file({_KEY: self.embeddings.cpu().contiguous()}, os.path.join(directory, EMBEDDINGS_FILE))
            elif os.path.abspath(self._file) != os.path.abspath(os.path.join(directory, EMBEDDINGS_FILE)):
                save_file({_KEY: self._read(0, self._n)}, os.path.join(directory, EMBEDDINGS_FILE))
            manifest = {"backend": "chunked", "modality": self.modality, "k": self.k, "chunk_size": self.chunk_size}
            with open(os.path.join(directory, MANIFEST_FILE), "w") as fh:
                json.dump(manifest, fh, indent=2)
            self.save_ids(directory)
            self.save_statistics(directory)

    @classmethod
    def load(
        cls, directory: str | os.PathLike, mmap: bool = False, device: str = "cpu", **overrides
    ) -> "ChunkedGallery":
        """Load what :meth:`save` wrote. ``mmap=True`` keeps the embeddings on disk (page cache) and reads one block
        per chunk at search time, so a gallery larger than the free memory can still be searched exactly."""
        path = os.path.join(directory, EMBEDDINGS_FILE)
        with open(os.path.join(directory, MANIFEST_FILE)) as fh:
            manifest = json.load(fh)
        kwargs = {"k": manifest["k"], "chunk_size": manifest["chunk_size"], **overrides}
        if not mmap:
            with safe_open(path, framework="pt", device=device) as fh:
                self = cls(fh.get_tensor(_KEY), manifest["modality"], **kwargs)
        else:
            store = _memmap_safetensors(path, _KEY)
            self = cls(torch.from_numpy(np.array(store[:1])), manifest["modality"], **kwargs)  # validated on one row
            self._file, self._n = path, store.shape[0]
            self._memmap, self._buf = store, None
        self.load_ids(directory)
        self.load_statistics(directory)
        return self

    # ---------------------------------------------------------------------------------------- interface
    def __len__(self) -> int:
        return self._n

    @property
    def dim(self) -> int:
        return self._dim

    @property
    def device(self) -> torch.device:
        return torch.device("cpu") if self._file is not None else self.embeddings.device

    def to(self, device) -> "ChunkedGallery":
        if self._file is not None:
            raise ValueError(
                "A memory-mapped ChunkedGallery stays on the CPU: its blocks are moved to the queries' device."
            )
        with self.reading():
            # an owned buffer changes in place later: the moved gallery gets its own rows, even on the same device
            rows = self.embeddings.to(device, copy=self._owned)
            moved = ChunkedGallery(rows, self.modality, self.k, self.chunk_size)
            moved._set_id_map(self.id_map)
            moved.__dict__["_version"] = self.version
            moved._stats_cache().update(self._stats_cache())  # the statistics do not depend on the device
            return moved

    def _read(self, start: int, end: int) -> torch.Tensor:
        if self._file is None:
            return self._buf[start:end]
        return torch.from_numpy(np.array(self._memmap[start:end]))  # a writable copy of the block

    # ---------------------------------------------------------------------------------------- live index
    def _check_change(self, kind: str) -> None:
        if self._file is not None:
            raise ValueError(f"A memory-mapped ChunkedGallery is read-only: load it with mmap=False to {kind} items.")

    def _own(self, rows: int) -> None:
        """Make the buffer ours (a copy of the caller's tensor) with room for ``rows`` rows."""
        if self._owned and self._buf.shape[0] >= rows:
            return
        cap = rows if rows <= self._n else rows + max(self._n // 8, 1024)
        buf = torch.empty(cap, *self.item_shape, dtype=self._buf.dtype, device=self._buf.device)
        buf[: self._n] = self._buf[: self._n]
        self._buf, self._owned = buf, True

    def _add(self, ids: np.ndarray, rows: torch.Tensor) -> None:
        self._own(self._n + rows.shape[0])
        self._buf[self._n : self._n + rows.shape[0]] = rows.to(self._buf.device, self._buf.dtype)
        self._n += rows.shape[0]

    def _remove(self, positions: np.ndarray, keep: np.ndarray, ids: np.ndarray) -> None:
        self._own(self._n)
        first, new_n = int(positions.min()), int(keep.sum())
        tail = torch.from_numpy(keep[first:]).to(self._buf.device)
        self._buf[first:new_n] = self._buf[first : self._n][tail]
        self._n = new_n

    def _replace(self, positions: np.ndarray, ids: np.ndarray, rows: torch.Tensor) -> None:
        self._own(self._n)
        self._buf[torch.from_numpy(positions).to(self._buf.device)] = rows.to(self._buf.device, self._buf.dtype)

    # ---------------------------------------------------------------------------------------- search
    def iter_blocks(self, rows: int = BLOCK_ROWS):
        for start in range(0, self._n, rows):
            yield start, single_vector(self._read(start, min(start + rows, self._n)).to(self.device, torch.float32))

    @torch.no_grad()
    def search(self, queries: torch.Tensor, k: int) -> TopKScores:
        with self.reading():
            return self._search(queries, k)

    def _search(self, queries: torch.Tensor, k: int) -> TopKScores:
        k = min(check_k(k), self._n)
        q = queries.detach().float()
        best_v = best_i = None
        step = max(1, self.chunk_size // (self.num_vectors or 1))
        for start in range(0, self._n, step):
            block = self._read(start, min(start + step, self._n)).to(q.device, torch.float32)
            s = item_scores(q, block)
            v, i = s.topk(min(k, s.shape[1]), dim=1)
            i = i + start
            if best_v is None:
                best_v, best_i = v, i
            else:
                merged = merge_topk(torch.cat([best_v, v], 1), torch.cat([best_i, i], 1), k)
                best_v, best_i = merged.values, merged.indices
        return merge_topk(best_v, best_i, k)

    def gather(self, indices: torch.Tensor) -> torch.Tensor:
        with self.reading():
            return self._gather(indices)

    def _gather(self, indices: torch.Tensor) -> torch.Tensor:
        spare = self._buf is not None and self._buf.shape[0] > self._n  # rows past N are not items
        if spare and indices.numel() and (int(indices.min()) < 0 or int(indices.max()) >= self._n):
            raise IndexError(f"Gallery positions must lie in [0, {self._n}), got {int(indices.min())}..{int(indices.max())}.")
        if self._file is None:
            return self._buf[indices.to(self._buf.device)].float()
        rows = self._memmap[indices.cpu().numpy()]  # fancy indexing reads only these rows from the file
        return torch.from_numpy(rows).float()


_NUMPY_DTYPES = {"F16": np.float16, "F32": np.float32, "F64": np.float64}


def _memmap_safetensors(path: str, key: str) -> np.ndarray:
    """A read-only ``numpy.memmap`` of one tensor of a safetensors file (format: 8-byte little-endian header length,
    JSON header with ``dtype``/``shape``/``data_offsets``, then the raw buffer), so rows are read from disk on demand."""
    with open(path, "rb") as fh:
        header_len = int.from_bytes(fh.read(8), "little")
        header = json.loads(fh.read(header_len))
    info = header[key]
    if info["dtype"] not in _NUMPY_DTYPES:
        raise ValueError(
            f"mmap=True supports float16/32/64 embeddings, the file holds {info['dtype']}: load with mmap=False."
        )
    begin = info["data_offsets"][0]
    return np.memmap(
        path, dtype=_NUMPY_DTYPES[info["dtype"]], mode="r", offset=8 + header_len + begin, shape=tuple(info["shape"])
    )
