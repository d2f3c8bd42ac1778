"""The state channel over Redis (the ``redis`` client): the same :class:`~hf_tta.service.channel.StateChannel` as the
shared-memory one, for answer replicas on other hosts.

Layout: one hash ``<key>:state`` with the fields ``version``, ``published`` and ``blob``, written by one ``HSET``
(atomic in Redis: a reader's ``HMGET`` sees all three fields of one publish, never a mix), and ``<key>:heartbeat``
(the writer's wall time). Readers poll ``HGET version`` (a few bytes) and fetch the blob only when it changed.
Store down: every call raises the client's ``ConnectionError``; :class:`~hf_tta.service.answerer.Answerer` then keeps
answering from the last state it read and readiness says so. Short socket timeouts keep a dead store from stalling
the poll.
"""

from __future__ import annotations

import time

from .channel import Blob


class RedisChannel:
    """See :mod:`hf_tta.service.redis_channel`. ``url``: ``redis://host:port/db``; ``key``: the namespace."""

    def __init__(self, url: str, key: str = "hf_tta", timeout: float = 1.0):
        import redis

        self.client = redis.Redis.from_url(url, socket_timeout=timeout, socket_connect_timeout=timeout)
        self.key = key
        self.state_key, self.beat_key = f"{key}:state", f"{key}:heartbeat"

    def publish(self, version: int, data: bytes) -> None:
        self.client.hset(self.state_key, mapping={"version": int(version), "published": time.time(), "blob": data})
        self.beat()

    def beat(self) -> None:
        self.client.set(self.beat_key, time.time())

    def heartbeat(self) -> float:
        value = self.client.get(self.beat_key)
        return float(value) if value is not None else 0.0

    def latest_version(self) -> int:
        value = self.client.hget(self.state_key, "version")
        return int(value) if value is not None else 0

    def read(self) -> Blob | None:
        version, published, blob = self.client.hmget(self.state_key, ["version", "published", "blob"])
        if version is None or blob is None:
            return None
        return Blob(int(version), float(published), bytes(blob))

    def close(self) -> None:
        self.client.close()


__all__ = ["RedisChannel"]
