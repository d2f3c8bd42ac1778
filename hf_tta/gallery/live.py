"""``LiveGallery``: a dense in-memory gallery that changes while it is searched, with stable external ids.

It holds ``(ids, embeddings)`` and changes with :meth:`LiveGallery.add`, :meth:`~LiveGallery.remove` and
:meth:`~LiveGallery.replace` (only the new items are encoded; the rest are kept as they are). Every change builds new
tensors and swaps them in (copy-on-write), so a :meth:`~LiveGallery.snapshot` taken before a change is never modified:
an answer computed on a snapshot uses one consistent version (its :class:`~hf_tta.GalleryCache`, the id of each
column, the version number). Positions follow the rules of :mod:`hf_tta.gallery.ids` (add appends, remove closes the
gaps keeping the order, replace keeps the position), and each change returns a
:class:`~hf_tta.gallery.ids.GalleryChange` for position-keyed objective state
(:meth:`hf_tta.objectives.Objective.on_gallery_change`); :meth:`~LiveGallery.changes_since` replays them to a consumer
that was behind.

A change copies the ``N x D`` tensor once (what keeps old snapshots intact); for galleries that change often and are
too large for that, use a top-k backend (:class:`~hf_tta.gallery.ChunkedGallery`, :class:`~hf_tta.gallery.FaissGallery`),
which change in place under a readers-writer lock.

    >>> live = LiveGallery(tta.encode_gallery(captions).embeddings, "text", ids=caption_ids)  # doctest: +SKIP
    >>> live.add([1234], tta.encode_gallery(new_caption).embeddings)  # doctest: +SKIP
    >>> snap = live.snapshot()  # doctest: +SKIP
    >>> out = tta.adapt_step(queries, snap.cache)  # doctest: +SKIP
    >>> best_ids = snap.to_ids(out.scores.argmax(1))  # doctest: +SKIP
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

import numpy as np
import torch

from .cache import GalleryCache
from .ids import ChangeLog, GalleryChange, IdMap, as_id_array, check_new_rows

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class GallerySnapshot:
    """One version of a :class:`LiveGallery`.

    Args:
        cache (`GalleryCache`): the embeddings of this version (never changed afterwards).
        ids (`torch.Tensor` of shape `(N,)`): the external id of each row of ``cache`` (``int64``).
        version (`int`): the gallery version.
    """

    cache: GalleryCache
    ids: torch.Tensor
    version: int

    def __len__(self) -> int:
        return self.ids.shape[0]

    def to_ids(self, positions: torch.Tensor) -> torch.Tensor:
        """External ids of ``positions`` (columns of a score matrix against :attr:`cache`), on their device."""
        return self.ids[positions.cpu()].to(positions.device)

    def topk_ids(self, scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(values, ids)`` of each row's ``k`` best columns of ``scores`` ``(B, N)`` (ties: the lower position)."""
        if scores.shape[-1] != len(self):
            raise ValueError(f"Scores of {scores.shape[-1]} columns are not of this snapshot ({len(self)} items).")
        values, cols = scores.sort(dim=-1, descending=True, stable=True)
        k = min(k, scores.shape[-1])
        return values[..., :k], self.to_ids(cols[..., :k])


class LiveGallery:
    """A dense gallery of ``(N, D)`` (or multi-vector ``(N, Q, D)``) source-model embeddings with external ids.

    Args:
        embeddings (`torch.Tensor`): the cached, L2-normalised embeddings (as :class:`~hf_tta.GalleryCache` takes them).
        modality (`str`): the gallery modality.
        ids (*optional*): the external id of each row ``(N,)`` (distinct integers); default ``0 .. N-1``.
        version (*optional*): the version it starts at (a gallery reloaded after a restart goes on from its saved
            version, so one number never names two galleries); default 0.
    """

    def __init__(self, embeddings: torch.Tensor, modality: str, ids=None, version: int = 0):
        first = GalleryCache(embeddings, modality)  # every check of the dense gallery (shape, dtype, finite)
        if isinstance(version, bool) or not isinstance(version, int) or version < 0:
            raise ValueError(f"version must be an integer >= 0 (the version a saved gallery had), got {version!r}.")
        ids_map = IdMap.range(len(first)) if ids is None else IdMap(ids)
        if len(ids_map) != len(first):
            raise ValueError(f"{len(ids_map)} ids for {len(first)} embeddings: pass one id per row.")
        self.modality = modality
        self._lock = threading.Lock()  # serialises changes; readers take the current version without waiting
        self._log = ChangeLog()
        self._state = (first.embeddings, ids_map, version, first)  # swapped as one tuple: (embeddings, ids, version, cache)

    # ---------------------------------------------------------------------------------------- reading
    def __len__(self) -> int:
        return self._state[0].shape[0]

    @property
    def dim(self) -> int:
        return self._state[0].shape[-1]

    @property
    def version(self) -> int:
        return self._state[2]

    @property
    def ids(self) -> torch.Tensor:
        return torch.from_numpy(self._state[1].ids.copy())

    def positions_of(self, ids) -> torch.Tensor:
        """Current positions of ``ids`` (an unknown id is refused)."""
        return torch.from_numpy(self._state[1].positions(ids, "look up"))

    def snapshot(self) -> GallerySnapshot:
        """The current version: an immutable :class:`~hf_tta.GalleryCache`, its ids and version number."""
        emb, ids, version, cache = self._state
        if cache is None:  # built once per version, on first use
            cache = GalleryCache(emb, self.modality)
            with self._lock:
                if self._state[2] == version:
                    self._state = (emb, ids, version, cache)
        return GallerySnapshot(cache=cache, ids=torch.from_numpy(ids.ids.copy()), version=version)

    def changes_since(self, version: int) -> list[GalleryChange] | None:
        """The changes after ``version`` (``None``: too old, rebuild position-keyed state)."""
        return self._log.since(version, self.version)

    # ---------------------------------------------------------------------------------------- changes
    def _rows(self, embeddings, count: int, emb: torch.Tensor) -> torch.Tensor:
        embeddings = check_new_rows(embeddings, count, tuple(emb.shape[1:]))
        if embeddings.dtype != emb.dtype or embeddings.device != emb.device:
            logger.info("New gallery embeddings cast from %s on %s to %s on %s.", embeddings.dtype, embeddings.device,
                        emb.dtype, emb.device)
        return embeddings.detach().to(emb.device, emb.dtype)

    def _commit(self, emb, ids: IdMap, kind: str, changed: np.ndarray, positions: np.ndarray, old: int) -> GalleryChange:
        version = self._state[2] + 1
        self._state = (emb, ids, version, None)
        return self._log.record(GalleryChange(
            kind=kind, ids=torch.from_numpy(changed.copy()), positions=torch.from_numpy(positions.astype(np.int64)),
            old_size=old, new_size=emb.shape[0], version=version,
        ))

    def add(self, ids, embeddings: torch.Tensor) -> GalleryChange:
        """Append new items (new external ``ids``, their embeddings ``(M, D)``) at positions ``N .. N+M-1``."""
        with self._lock:
            emb, idmap, _, _ = self._state
            new = idmap.check_new(ids)
            rows = self._rows(embeddings, new.size, emb)
            n = emb.shape[0]
            return self._commit(torch.cat([emb, rows]), idmap.added(new), "add", new, np.arange(n, n + new.size), n)

    def remove(self, ids) -> GalleryChange:
        """Delete the items ``ids``; the others keep their order."""
        with self._lock:
            emb, idmap, _, _ = self._state
            arr = as_id_array(ids)
            if arr.size == 0:
                raise ValueError("No ids given: remove at least one item.")
            pos = idmap.positions(arr, "remove")
            if pos.size >= len(idmap):
                raise ValueError("Cannot remove every item: a gallery keeps at least one (build a new one instead).")
            keep = np.ones(len(idmap), dtype=bool)
            keep[pos] = False
            kept = emb[torch.from_numpy(keep).to(emb.device)]
            return self._commit(kept, idmap.removed(keep), "remove", arr, pos, emb.shape[0])

    def replace(self, ids, embeddings: torch.Tensor) -> GalleryChange:
        """New embeddings for the existing items ``ids`` (same ids, same positions)."""
        with self._lock:
            emb, idmap, _, _ = self._state
            arr = as_id_array(ids)
            if arr.size == 0:
                raise ValueError("No ids given: replace at least one item.")
            pos = idmap.positions(arr, "replace")
            rows = self._rows(embeddings, arr.size, emb)
            new = emb.clone()
            new[torch.from_numpy(pos).to(emb.device)] = rows
            return self._commit(new, idmap, "replace", arr, pos, emb.shape[0])
