"""The bounded adaptation queue: batches of batch_size, or min_batch after max_wait, never fewer; per tenant; a full
queue drops the oldest queries (counted) and never refuses one; refusals of bad settings."""

from __future__ import annotations

import numpy as np
import pytest

from hf_tta.service.batcher import AdaptQueue


def rows(n: int, start: int = 0) -> dict[str, np.ndarray]:
    return {"x": np.arange(start, start + n, dtype=np.float32)[:, None]}


def test_batches_by_size_then_by_wait_never_below_min():
    q = AdaptQueue(capacity=100, batch_size=4, min_batch=2, max_wait=1.0)
    q.put("a", rows(1, 0), now=0.0)
    assert q.take(now=5.0) is None  # 1 < min_batch: keeps accumulating however long it waits
    q.put("a", rows(4, 1), now=0.5)
    batch = q.take(now=0.6)
    assert batch.tenant == "a" and batch.n == 4 and batch.arrays["x"][:, 0].tolist() == [0, 1, 2, 3]
    assert batch.waited == pytest.approx(0.6)
    assert q.take(now=0.7) is None  # one left
    q.put("a", rows(1, 5), now=0.8)
    assert q.take(now=1.0) is None and q.take(now=1.6).arrays["x"][:, 0].tolist() == [4, 5]  # 2 after max_wait
    assert len(q) == 0 and q.enqueued["a"] == 6


def test_tenants_are_batched_apart_oldest_first():
    q = AdaptQueue(capacity=100, batch_size=2, min_batch=2, max_wait=1.0)
    q.put("b", rows(1, 10), now=1.0)
    q.put("a", rows(1, 20), now=2.0)
    q.put("a", rows(1, 21), now=3.0)
    q.put("b", rows(1, 11), now=4.0)
    assert [q.take(now=5.0).tenant, q.take(now=5.0).tenant] == ["b", "a"]  # b's oldest query waited longest


def test_full_queue_drops_oldest_and_counts():
    q = AdaptQueue(capacity=4, batch_size=4, min_batch=1, max_wait=1.0)
    q.put("a", rows(2, 0), now=0.0)
    q.put("b", rows(1, 100), now=1.0)
    assert q.put("b", rows(3, 101), now=2.0) == 2  # the two oldest (tenant a's) go
    assert dict(q.dropped) == {"a": 2} and q.depth() == {"a": 0, "b": 4}
    assert q.take(now=2.0).arrays["x"][:, 0].tolist() == [100, 101, 102, 103]


@pytest.mark.parametrize("kw", [dict(capacity=0), dict(batch_size=2, min_batch=3), dict(max_wait=0), dict(capacity=2, batch_size=4)])
def test_refusals(kw):
    with pytest.raises(ValueError):
        AdaptQueue(**{"capacity": 8, "batch_size": 4, "min_batch": 2, "max_wait": 1.0, **kw})
