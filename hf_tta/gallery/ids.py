"""Stable external ids of a live gallery: the id <-> position map, the change events and the readers-writer lock.

A gallery backend addresses its items by *position* ``0 .. N-1`` (what :meth:`GalleryBackend.search` returns and
:meth:`GalleryBackend.gather` takes, and what per-item objective state is keyed by); a live gallery also gives every
item a stable 64-bit *external id* that survives additions, removals, replacements and save/load. Positions follow
these rules (the same for every backend): :meth:`add` appends at the end in the given order, :meth:`remove` deletes and
closes the gaps keeping the survivors' order, :meth:`replace` keeps the position. Each change is described by a
:class:`GalleryChange`, from which position-keyed state is remapped (:meth:`GalleryChange.remap`).

:class:`IdMap` is immutable (every change returns a new one) and vectorised: a change costs ``O(N)`` integer work
(never a Python loop per item, never a re-sort), so that a 10^7-item gallery remaps in tens of milliseconds.
"""

from __future__ import annotations

import threading
from collections import deque
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

import numpy as np
import torch

CHANGE_KINDS = ("add", "remove", "replace")
#: Changes a live gallery remembers for :meth:`changes_since` (a consumer further behind rebuilds its state).
CHANGE_LOG = 1024


def as_id_array(ids, name: str = "ids") -> np.ndarray:
    """``ids`` (a tensor, array or sequence of integers) as a 1-D ``int64`` numpy array; anything else is refused."""
    if isinstance(ids, torch.Tensor):
        if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
            raise TypeError(f"{name} must be integers, got a {ids.dtype} tensor.")
        arr = ids.detach().cpu().numpy()
    else:
        arr = np.asarray(ids)
        if arr.dtype == object or not np.issubdtype(arr.dtype, np.integer):
            raise TypeError(f"{name} must be integers, got {arr.dtype}.")
    if arr.ndim != 1:
        raise ValueError(f"{name} must be one-dimensional, got shape {tuple(arr.shape)}.")
    return np.ascontiguousarray(arr.astype(np.int64, copy=False))


def _first_duplicate(arr: np.ndarray) -> int | None:
    s = np.sort(arr)
    dup = np.nonzero(s[1:] == s[:-1])[0]
    return int(s[dup[0]]) if dup.size else None


class IdMap:
    """The external id of each position (``ids[p]``) and the reverse lookup, both vectorised.

    Args:
        ids: the ids in position order (distinct integers).
    """

    __slots__ = ("ids", "_order", "_sorted")

    def __init__(self, ids, _order: np.ndarray | None = None):
        arr = as_id_array(ids)
        if _order is None:
            _order = np.argsort(arr, kind="stable")
            dup = _first_duplicate(arr)
            if dup is not None:
                raise ValueError(f"Gallery ids must be distinct: {dup} appears twice.")
        self.ids = arr
        self.ids.flags.writeable = False
        self._order = _order  # positions sorted by id
        self._sorted = arr[_order]  # the ids, sorted

    @classmethod
    def range(cls, n: int) -> "IdMap":
        """Ids ``0 .. n-1`` (a gallery built without ids: id = original position)."""
        ids = np.arange(n, dtype=np.int64)
        return cls(ids, _order=ids.copy())

    def __len__(self) -> int:
        return self.ids.shape[0]

    def is_range(self) -> bool:
        return bool(np.array_equal(self.ids, np.arange(len(self), dtype=np.int64)))

    def lookup(self, ids) -> tuple[np.ndarray, np.ndarray]:
        """``(positions, found)`` of ``ids`` (position ``-1`` where not found)."""
        arr = as_id_array(ids)
        at = np.searchsorted(self._sorted, arr).clip(max=max(len(self) - 1, 0))
        found = (self._sorted[at] == arr) if len(self) else np.zeros(arr.shape, bool)
        return np.where(found, self._order[at], -1), found

    def positions(self, ids, what: str = "remove") -> np.ndarray:
        """Positions of ``ids``; an unknown or repeated id is refused (one line naming it)."""
        arr = as_id_array(ids)
        pos, found = self.lookup(arr)
        if not found.all():
            missing = arr[~found]
            raise ValueError(
                f"Cannot {what} unknown gallery id(s) {missing[:5].tolist()} ({missing.size} unknown): see backend.ids."
            )
        dup = _first_duplicate(arr)
        if dup is not None:
            raise ValueError(f"Cannot {what} gallery id {dup} twice in one call.")
        return pos

    def check_new(self, ids) -> np.ndarray:
        """``ids`` as an array after checking that none is in the gallery and none repeats."""
        arr = as_id_array(ids)
        if arr.size == 0:
            raise ValueError("No ids given: add at least one item.")
        dup = _first_duplicate(arr)
        if dup is not None:
            raise ValueError(f"Cannot add gallery id {dup} twice in one call.")
        _, found = self.lookup(arr)
        if found.any():
            taken = arr[found]
            raise ValueError(f"Gallery id(s) {taken[:5].tolist()} already exist: use replace() to change their embeddings.")
        return arr

    def added(self, new: np.ndarray, at: int | None = None) -> "IdMap":
        """The map after inserting ``new`` (checked by :meth:`check_new`) at positions ``at ..`` (default ``N``: appended;
        a sharded gallery inserts at the end of a shard); later positions move up by ``len(new)``."""
        n = len(self)
        at = n if at is None else at
        new_order = np.argsort(new, kind="stable")
        where = np.searchsorted(self._sorted, new[new_order])
        old = np.where(self._order >= at, self._order + new.size, self._order)
        order = np.insert(old, where, at + new_order)
        return IdMap(np.concatenate([self.ids[:at], new, self.ids[at:]]), _order=order)

    def removed(self, keep: np.ndarray) -> "IdMap":
        """The map after keeping the positions where ``keep`` (a bool mask over positions) is set."""
        new_pos = np.cumsum(keep) - 1
        kept_sorted = keep[self._order]
        return IdMap(self.ids[keep], _order=new_pos[self._order[kept_sorted]])


@dataclass(frozen=True)
class GalleryChange:
    """One change of a live gallery, handed to :meth:`hf_tta.objectives.Objective.on_gallery_change`.

    Args:
        kind (`str`): ``"add"``, ``"remove"`` or ``"replace"``.
        ids (`torch.Tensor` of shape `(M,)`): the external ids changed (``int64``).
        positions (`torch.Tensor` of shape `(M,)`): their positions: after the change for ``"add"`` (a block
            ``a .. a+M-1``: ``a = N``, appended, except in a sharded gallery, where it is the end of the receiving shard
            and later positions move up by ``M``), before it for ``"remove"``, unchanged for ``"replace"``.
        old_size (`int`), new_size (`int`): the gallery size before and after.
        version (`int`): the gallery version after the change (each change adds one).
    """

    kind: str
    ids: torch.Tensor
    positions: torch.Tensor
    old_size: int
    new_size: int
    version: int

    def __post_init__(self):
        if self.kind not in CHANGE_KINDS:
            raise ValueError(f"A gallery change is one of {CHANGE_KINDS}, got {self.kind!r}.")

    def position_map(self, device=None) -> torch.Tensor:
        """``(old_size,)``: the new position of every old position, ``-1`` for a removed item."""
        old = torch.arange(self.old_size, device=device)
        if self.kind == "add":
            return torch.where(old >= self.insert_at, old + self.ids.numel(), old)
        if self.kind == "replace":
            return old
        keep = torch.ones(self.old_size, dtype=torch.bool, device=device)
        keep[self.positions.to(device)] = False
        return torch.where(keep, keep.long().cumsum(0) - 1, torch.full_like(keep, -1, dtype=torch.long))

    @property
    def insert_at(self) -> int:
        """Where an ``"add"`` inserted its block (``N`` unless sharded)."""
        return int(self.positions[0]) if self.kind == "add" and self.positions.numel() else self.old_size

    def remap(self, positions: torch.Tensor) -> torch.Tensor:
        """Old positions -> new positions (``-1`` for removed items); the identity for replace."""
        if self.kind == "replace":
            return positions
        return self.position_map(positions.device)[positions]

    def remap_vector(self, values: torch.Tensor, fill=0) -> torch.Tensor:
        """A per-item vector ``(old_size, ...)`` as it is for the new gallery: removed rows dropped, ``fill`` rows
        appended for added items; a replaced item keeps its row (use :attr:`positions` to reset it). An empty vector
        (state not yet created) stays empty."""
        if values.shape[0] == 0:
            return values
        if values.shape[0] != self.old_size:
            raise ValueError(f"A per-item vector of {values.shape[0]} rows does not match the gallery ({self.old_size}).")
        if self.kind == "remove":
            return values[self.position_map(values.device) >= 0]
        if self.kind == "add":
            pad = torch.full((self.new_size - self.old_size, *values.shape[1:]), fill, dtype=values.dtype, device=values.device)
            at = self.insert_at
            return torch.cat([values[:at], pad, values[at:]])
        return values


class ChangeLog:
    """The last :data:`CHANGE_LOG` changes of a gallery, for consumers that catch up between steps (a wrapper)."""

    def __init__(self, size: int = CHANGE_LOG):
        self._log: deque[GalleryChange] = deque(maxlen=size)

    def record(self, change: GalleryChange) -> GalleryChange:
        self._log.append(change)
        return change

    def since(self, version: int, current: int) -> list[GalleryChange] | None:
        if version == current:
            return []
        log = list(self._log)  # one copy (a writer may append meanwhile)
        if version > current or not log or log[0].version > version + 1:
            return None
        return [c for c in log if version < c.version <= current]


class ReadWriteLock:
    """Many concurrent readers or one writer; writers are preferred (a waiting writer holds new readers back), and a
    thread that already reads may read again (nested ``search`` inside ``reading()``) without deadlocking."""

    def __init__(self):
        self._cond = threading.Condition(threading.Lock())
        self._readers = 0
        self._writer: int | None = None
        self._waiting = 0
        self._local = threading.local()

    @contextmanager
    def read(self) -> Iterator[None]:
        depth = getattr(self._local, "depth", 0)
        me = threading.get_ident()
        if depth or self._writer == me:  # nested read, or the writer reading its own state
            self._local.depth = depth + 1
            try:
                yield
            finally:
                self._local.depth -= 1
            return
        with self._cond:
            while self._writer is not None or self._waiting:
                self._cond.wait()
            self._readers += 1
        self._local.depth = 1
        try:
            yield
        finally:
            self._local.depth = 0
            with self._cond:
                self._readers -= 1
                if not self._readers:
                    self._cond.notify_all()

    @contextmanager
    def write(self) -> Iterator[None]:
        if getattr(self._local, "depth", 0):
            raise RuntimeError("A gallery cannot be changed inside backend.reading() of the same thread.")
        with self._cond:
            self._waiting += 1
            try:
                while self._writer is not None or self._readers:
                    self._cond.wait()
            finally:
                self._waiting -= 1
            self._writer = threading.get_ident()
        try:
            yield
        finally:
            with self._cond:
                self._writer = None
                self._cond.notify_all()


def check_new_rows(embeddings, count: int, item_shape: tuple[int, ...]) -> torch.Tensor:
    """New gallery rows for ``count`` ids: a finite floating-point ``(count, *item_shape)`` tensor (detached), or a
    one-line error naming what is wrong."""
    if not isinstance(embeddings, torch.Tensor):
        raise TypeError(f"Embeddings must be a tensor, got {type(embeddings).__name__}.")
    if not embeddings.is_floating_point() or tuple(embeddings.shape[1:]) != tuple(item_shape) or embeddings.dim() < 2:
        raise ValueError(
            f"Embeddings must be a floating-point (M, {', '.join(map(str, item_shape))}) tensor (this gallery's item "
            f"shape and dimension), got {embeddings.dtype} of shape {tuple(embeddings.shape)}."
        )
    if embeddings.shape[0] != count:
        raise ValueError(f"{count} ids for {embeddings.shape[0]} embeddings: pass one id per row.")
    if not torch.isfinite(embeddings).all():
        raise ValueError("The new embeddings contain NaN or inf values.")
    return embeddings.detach()
