"""The answering side: the current published state of every tenant, read from the channel, and no-grad answers.

A polling thread reads the channel's version (a few bytes) every ``poll`` seconds; when it changed it copies the
whole blob (a lock-free seqlock read: :mod:`hf_tta.service.channel`), decodes it into each tenant's published
:class:`~hf_tta.state.AdapterState` (its :data:`~hf_tta.state.SERVED` parts) and replaces the dict of answering
states in one assignment. An answer reads that dict once and runs its whole forward (``TTAWrapper.answer``, no grad)
on a reader holding that tenant's state (:class:`hf_tta.readers.ReaderPool`: wrappers built from the source wrapper,
sharing every frozen tensor, made once and reused across versions and tenants), which nothing writes while it answers: every
answer is one published version's, and answers never wait for adaptation. A tenant with no state yet is answered by
the source model (version 0).

When the channel cannot be read (a Redis store down) the answers go on from the last state read and
:attr:`Answerer.store_error` says why (readiness reports it).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Mapping

import torch

from ..gallery.live import LiveGallery
from ..readers import ReaderPool
from ..state import AdapterState
from ..wrapper import TTAWrapper
from .codec import decode

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Current:
    """A tenant's answering state: its ``version``, when it was ``published`` (wall time; 0: the source) and its
    served parts (``state``, which a reader of :mod:`hf_tta.readers` answers with)."""

    version: int
    published: float
    state: AdapterState


@dataclass(frozen=True)
class Answer:
    """One answer: ``ids`` and ``scores`` ``(B, k)``, the tenant's state ``version`` and its ``age`` (s since it was
    published; ``None`` for the source state), the ``gallery_version``."""

    ids: torch.Tensor
    scores: torch.Tensor
    version: int
    age: float | None
    gallery_version: int


class Answerer:
    """See :mod:`hf_tta.service.answerer`. ``wrapper``: a plain :class:`~hf_tta.TTAWrapper` at the source state (this
    process's copy of the model); ``channel``: a reader's end (``None``: answer from the source only)."""

    def __init__(self, wrapper: TTAWrapper, channel: Any | None, poll: float = 0.01):
        self.readers = ReaderPool(wrapper)
        self.source = Current(0, 0.0, ReaderPool.capture(wrapper))
        self.channel, self.poll = channel, float(poll)
        self.states: dict[str, Current] = {}
        self.version = 0  # the channel's version last read
        self.counters: dict[str, Any] = {}
        self.safety: dict[str, dict[str, int]] = {}
        self.store_error: str | None = None
        self.store_error_since: float | None = None
        self.heartbeat = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self.channel is None:
            return
        self.refresh()
        self._thread = threading.Thread(target=self._run, name="hf_tta-service-read", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(2)

    def _run(self) -> None:
        while not self._stop.wait(self.poll):
            self.refresh()

    def refresh(self) -> bool:
        """Read the channel once; returns whether a new state was taken."""
        try:
            self.heartbeat = self.channel.heartbeat()
            if self.channel.latest_version() == self.version:
                self._ok()
                return False
            blob = self.channel.read()
        except Exception as err:  # noqa: BLE001 - store down: keep answering from the last state, say so
            if self.store_error is None:
                self.store_error_since = time.time()
                logger.error("The state store cannot be read (%s): answering from version %d.", err, self.version)
            self.store_error = f"{type(err).__name__}: {err}".splitlines()[0]
            return False
        self._ok()
        if blob is None or blob.version == self.version:
            return False
        snap = decode(blob.data)
        states = dict(self.states)
        for key, tenant in snap.tenants.items():
            old = states.get(key)
            if old is not None and old.version == tenant.version:
                continue
            states[key] = Current(tenant.version, tenant.published, tenant.state)
        for key in set(states) - set(snap.tenants):
            states.pop(key)
        self.states = states  # one assignment: answers see the old dict or the new one
        self.counters = snap.counters
        self.safety = {k: t.safety_counts for k, t in snap.tenants.items()}
        self.version = blob.version
        return True

    def _ok(self) -> None:
        if self.store_error is not None:
            logger.info("The state store is readable again.")
        self.store_error = self.store_error_since = None

    def current(self, tenant: str) -> Current:
        return self.states.get(tenant, self.source)

    @torch.no_grad()
    def answer(self, queries: Mapping[str, torch.Tensor], gallery: LiveGallery, k: int, tenant: str) -> Answer:
        """Answer ``queries`` with ``tenant``'s current state against one snapshot of ``gallery``."""
        state = self.current(tenant)  # one read: the whole answer uses this state
        snap = gallery.snapshot()
        with self.readers.reading(state.state) as reader:
            scores = reader.answer(queries, snap.cache).scores
        values, ids = snap.topk_ids(scores, k)
        age = time.time() - state.published if state.version else None
        return Answer(ids, values, state.version, age, snap.version)


__all__ = ["Answer", "Answerer", "Current"]
