"""The bounded adaptation queue: answered queries wait here, per tenant, to be adapted on in micro-batches.

Policy (stated, counted): the queue holds at most ``capacity`` queries over all tenants; when a new query arrives at a
full queue the *oldest* queued query (of any tenant) is dropped from adaptation (it was already answered: answering
never waits for, or is refused by, this queue) and counted in :attr:`AdaptQueue.dropped`. A tenant's batch is ready
when it has ``batch_size`` queries, or ``min_batch`` queries of which the oldest waited ``max_wait`` seconds. Below
``min_batch`` queries keep accumulating: the safety layer judges no batch under its ``min_queries`` (8), so the
default ``min_batch=8`` makes every adapted batch one it can judge, at any request rate.
"""

from __future__ import annotations

import collections
import threading
import time
from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass(frozen=True)
class Batch:
    """A ready batch: the ``tenant``, its queries stacked per input name, ``n`` queries, the oldest's ``waited`` s."""

    tenant: str
    arrays: dict[str, np.ndarray]
    n: int
    waited: float


class AdaptQueue:
    """See :mod:`hf_tta.service.batcher`. Thread-safe; ``put`` never blocks for longer than a dict update."""

    def __init__(self, capacity: int = 512, batch_size: int = 32, min_batch: int = 8, max_wait: float = 1.0):
        for name, value in (("capacity", capacity), ("batch_size", batch_size), ("min_batch", min_batch)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r}: pass a positive integer.")
        if min_batch > batch_size or batch_size > capacity:
            raise ValueError(f"need min_batch <= batch_size <= capacity, got {min_batch}, {batch_size}, {capacity}.")
        if not max_wait > 0:
            raise ValueError(f"max_wait={max_wait!r}: pass a positive number of seconds.")
        self.capacity, self.batch_size, self.min_batch, self.max_wait = capacity, batch_size, min_batch, float(max_wait)
        self._lock = threading.Lock()
        self._queues: dict[str, collections.deque] = {}
        self._size = 0
        self.dropped: collections.Counter = collections.Counter()  # per tenant: dropped from adaptation (full queue)
        self.enqueued: collections.Counter = collections.Counter()

    def __len__(self) -> int:
        return self._size

    def depth(self) -> dict[str, int]:
        with self._lock:
            return {t: len(q) for t, q in self._queues.items()}

    def oldest_wait(self, now: float | None = None) -> dict[str, float]:
        """Per tenant, how long its oldest queued query has waited (s)."""
        now = time.monotonic() if now is None else now
        with self._lock:
            return {t: now - q[0][0] for t, q in self._queues.items() if q}

    def put(self, tenant: str, arrays: dict[str, np.ndarray], now: float | None = None) -> int:
        """Queue the rows of ``arrays`` (one or more queries) for ``tenant``; returns how many old queries it dropped."""
        now = time.monotonic() if now is None else now
        n = next(iter(arrays.values())).shape[0]
        rows = [{k: v[i] for k, v in arrays.items()} for i in range(n)] if n > 1 else [{k: v[0] for k, v in arrays.items()}]
        dropped = 0
        with self._lock:
            q = self._queues.setdefault(tenant, collections.deque())
            for row in rows:
                if self._size >= self.capacity:
                    self._drop_oldest()
                    dropped += 1
                q.append((now, row))
                self._size += 1
            self.enqueued[tenant] += n
        return dropped

    def _drop_oldest(self) -> None:
        tenant = min((t for t, q in self._queues.items() if q), key=lambda t: self._queues[t][0][0])
        self._queues[tenant].popleft()
        self._size -= 1
        self.dropped[tenant] += 1

    def _ready(self, now: float) -> list[tuple[float, str]]:
        return [
            (q[0][0], t) for t, q in self._queues.items()
            if len(q) >= self.batch_size or (len(q) >= self.min_batch and now - q[0][0] >= self.max_wait)
        ]

    def ready(self, now: float | None = None) -> bool:
        """Whether some tenant's batch is ready, or will be once its oldest query has waited ``max_wait``."""
        with self._lock:
            return any(len(q) >= self.min_batch for q in self._queues.values())

    def take(self, now: float | None = None) -> Batch | None:
        """The next ready batch (the tenant whose oldest query waited longest first), or ``None``."""
        now = time.monotonic() if now is None else now
        with self._lock:
            ready = self._ready(now)
            if not ready:
                return None
            tenant = min(ready)[1]
            q = self._queues[tenant]
            rows = [q.popleft() for _ in range(min(len(q), self.batch_size))]
            self._size -= len(rows)
        arrays = {k: np.stack([r[k] for _, r in rows]) for k in rows[0][1]}
        return Batch(tenant, arrays, len(rows), now - rows[0][0])

    def clear(self) -> int:
        """Drop every queued query (counted as dropped); returns how many."""
        with self._lock:
            n = self._size
            for t, q in self._queues.items():
                self.dropped[t] += len(q)
                q.clear()
            self._size = 0
        return n

    def stats(self) -> dict[str, Any]:
        return {"queued": self._size, "capacity": self.capacity, "dropped": dict(self.dropped),
                "enqueued": dict(self.enqueued), "batch_size": self.batch_size, "min_batch": self.min_batch,
                "max_wait": self.max_wait}


__all__ = ["AdaptQueue", "Batch"]
