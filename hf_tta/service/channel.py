"""The state channel: one adapting process publishes versioned blobs, any number of answering processes read them
without locks and never see a torn one.

:class:`SharedMemoryChannel` (one machine) is a seqlock over two slots in a :mod:`multiprocessing.shared_memory`
segment (why not a lock: a reader that held one could stall the writer, and a writer that died holding it would stall
every reader). The writer (one process) writes each new blob into the slot that is *not* the latest, bracketing the
write with its slot's sequence counter (odd while writing, even when done), then points the header at that slot. A
reader copies the latest slot's bytes between two reads of its sequence counter and keeps the copy only when both
reads are equal and even; otherwise a write overlapped its copy and it tries again. So a reader never blocks the
writer, the writer never waits for readers, and a copy is always one whole blob. (Python makes each 8-byte header
store and load one ``memoryview`` operation, in program order; x86-64's store ordering keeps them in that order for
the other processes. On weakly ordered CPUs the same protocol needs barriers that CPython does not expose.)

The header also holds the writer's *heartbeat* (wall time of its last sign of life), which the service's readiness
reads. :class:`hf_tta.service.redis_channel.RedisChannel` offers the same :class:`StateChannel` interface over Redis
for answer replicas on other hosts.

This module does not import torch: blobs are bytes (see :mod:`hf_tta.service.codec`).
"""

from __future__ import annotations

import struct
import time
from dataclasses import dataclass
from multiprocessing import shared_memory
from typing import Protocol

MAGIC = b"HFTTASC1"
# header: magic, capacity per slot, latest slot, heartbeat (f64), then per slot: seq, version, length, published (f64)
_HEAD = struct.Struct("<8sqqd")
_SLOT = struct.Struct("<qqqd")
HEADER_BYTES = 128


@dataclass(frozen=True)
class Blob:
    """One published blob: its ``version`` (the writer's counter, > 0), ``published`` (wall time, s) and ``data``."""

    version: int
    published: float
    data: bytes


class StateChannel(Protocol):
    """What the adapting process writes and the answering processes read (shared memory or Redis)."""

    def publish(self, version: int, data: bytes) -> None: ...

    def beat(self) -> None: ...

    def latest_version(self) -> int: ...

    def read(self) -> Blob | None: ...

    def heartbeat(self) -> float: ...

    def close(self) -> None: ...


class ChannelFull(ValueError):
    """A blob larger than the channel's slots (one line naming the fix)."""


class SharedMemoryChannel:
    """A seqlock'ed double buffer in shared memory (see :mod:`hf_tta.service.channel`).

    ``SharedMemoryChannel.create(capacity)`` makes a new segment (the owner unlinks it on :meth:`close`);
    ``SharedMemoryChannel(name)`` attaches to one (a writer or another reader). ``capacity``: the largest blob, bytes.
    """

    def __init__(self, name: str, *, _owner: bool = False, _shm: shared_memory.SharedMemory | None = None):
        self.shm = _shm if _shm is not None else _attach(name)
        self.owner = _owner
        self.buf = self.shm.buf
        magic, capacity, _, _ = _HEAD.unpack_from(self.buf, 0)
        if magic != MAGIC:
            raise ValueError(f"Shared memory {name!r} is not an hf_tta state channel.")
        self.capacity = capacity

    @classmethod
    def create(cls, capacity: int) -> SharedMemoryChannel:
        if capacity < 1:
            raise ValueError(f"capacity={capacity!r}: pass the largest blob's size in bytes.")
        shm = shared_memory.SharedMemory(create=True, size=HEADER_BYTES + 2 * capacity)
        _HEAD.pack_into(shm.buf, 0, MAGIC, capacity, -1, 0.0)
        for slot in (0, 1):
            _SLOT.pack_into(shm.buf, _HEAD.size + slot * _SLOT.size, 0, 0, 0, 0.0)
        return cls(shm.name, _owner=True, _shm=shm)

    @property
    def name(self) -> str:
        return self.shm.name

    def _slot_at(self, slot: int) -> int:
        return _HEAD.size + slot * _SLOT.size

    def _data_at(self, slot: int) -> int:
        return HEADER_BYTES + slot * self.capacity

    # ------------------------------------------------------------------------------------------ writer (one process)
    def publish(self, version: int, data: bytes) -> None:
        """Write ``data`` as ``version`` (one writer at a time)."""
        if len(data) > self.capacity:
            raise ChannelFull(f"A state of {len(data)} bytes does not fit the channel's {self.capacity}-byte slots: "
                              "raise the service's state capacity (--state-capacity-mb).")
        latest = self._latest_slot()
        slot = 0 if latest != 0 else 1
        at = self._slot_at(slot)
        seq = struct.unpack_from("<q", self.buf, at)[0]
        struct.pack_into("<q", self.buf, at, seq + 1)  # odd: writing
        start = self._data_at(slot)
        self.buf[start : start + len(data)] = data
        struct.pack_into("<qqd", self.buf, at + 8, version, len(data), time.time())
        struct.pack_into("<q", self.buf, at, seq + 2)  # even: done
        struct.pack_into("<q", self.buf, 16, slot)  # the header's latest slot
        self.beat()

    def beat(self) -> None:
        """Record that the writer is alive now."""
        struct.pack_into("<d", self.buf, 24, time.time())

    # ------------------------------------------------------------------------------------------ readers (any number)
    def _latest_slot(self) -> int:
        return struct.unpack_from("<q", self.buf, 16)[0]

    def heartbeat(self) -> float:
        return struct.unpack_from("<d", self.buf, 24)[0]

    def latest_version(self) -> int:
        """The latest blob's version (0: nothing published yet); a cheap poll."""
        slot = self._latest_slot()
        return 0 if slot < 0 else struct.unpack_from("<q", self.buf, self._slot_at(slot) + 8)[0]

    def read(self, attempts: int = 1000) -> Blob | None:
        """A copy of the latest whole blob (``None`` before the first publish)."""
        for _ in range(attempts):
            slot = self._latest_slot()
            if slot < 0:
                return None
            at = self._slot_at(slot)
            seq1, version, length, published = _SLOT.unpack_from(self.buf, at)
            if seq1 % 2 or length > self.capacity:
                time.sleep(0)
                continue
            start = self._data_at(slot)
            data = bytes(self.buf[start : start + length])
            seq2 = struct.unpack_from("<q", self.buf, at)[0]
            if seq1 == seq2:
                return Blob(version, published, data)
            time.sleep(0)
        raise TimeoutError("The state channel changed during every one of 1000 reads: the writer publishes too often.")

    def close(self) -> None:
        """Detach (and remove the segment when this object created it)."""
        self.buf = None
        self.shm.close()
        if self.owner:
            self.shm.unlink()


def _attach(name: str) -> shared_memory.SharedMemory:
    """Attach without registering the segment with this process's resource tracker, which would remove it when this
    process exits (Python < 3.13 registers every attach); only the owner removes it (``track=False`` from 3.13)."""
    import sys

    if sys.version_info >= (3, 13):
        return shared_memory.SharedMemory(name=name, track=False)
    from multiprocessing import resource_tracker

    register = resource_tracker.register
    resource_tracker.register = lambda *args, **kwargs: None
    try:
        return shared_memory.SharedMemory(name=name)
    finally:
        resource_tracker.register = register


__all__ = ["Blob", "ChannelFull", "SharedMemoryChannel", "StateChannel"]
