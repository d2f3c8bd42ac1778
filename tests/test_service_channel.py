"""The state channels: a blob read back is the blob published (shared memory and a real redis-server the test
starts); a writer process publishing as fast as it can and a reader copying meanwhile: every copy is one whole blob
of the version it says (no torn read); the published state decodes to the adapter's AdapterState bit for bit."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import time
from functools import partial

import numpy as np
import pytest

from hf_tta import TTAConfig
from hf_tta.service.builders import build_wrapper
from hf_tta.service.channel import ChannelFull, SharedMemoryChannel
from hf_tta.service.codec import PUBLISHED, decode
from hf_tta.service.worker import Worker, WorkerSpec
from support import image_stream
from tiny_models import make_model


def blob_of(version: int) -> bytes:
    """A blob whose every 4-byte word and length follow from its version: odd versions are 4 kB and even ones 4 MB, so
    that a writer publishing an odd then an even version overtakes a reader still copying the previous even one (a
    reader that did not check the sequence counters fails this test: a copy would mix two versions)."""
    n = 1_000 if version % 2 else 1_000_000
    return (np.arange(n, dtype=np.uint32) ^ np.uint32(version * 2654435761 % 2**32)).tobytes()


WRITER = """
import importlib.util, sys
import numpy as np
spec = importlib.util.spec_from_file_location("channel", sys.argv[1])  # the module alone: a light process
channel_mod = sys.modules["channel"] = importlib.util.module_from_spec(spec)
spec.loader.exec_module(channel_mod)
def blob_of(version):
    n = 1_000 if version % 2 else 1_000_000
    return (np.arange(n, dtype=np.uint32) ^ np.uint32(version * 2654435761 % 2**32)).tobytes()
blobs = {v: blob_of(v) for v in range(1, 101)}  # 100 versions, precomputed: the writer only copies
channel = channel_mod.SharedMemoryChannel(sys.argv[2])
for i in range(1, int(sys.argv[3]) + 1):
    v = (i - 1) % 100 + 1
    channel.publish(i, blobs[v])
channel.close()
"""


def test_round_trip_and_refusal():
    channel = SharedMemoryChannel.create(64)
    try:
        assert channel.read() is None and channel.latest_version() == 0
        channel.publish(3, b"abc")
        got = channel.read()
        assert (got.version, got.data) == (3, b"abc") and channel.latest_version() == 3 and channel.heartbeat() > 0
        with pytest.raises(ChannelFull, match="state-capacity"):
            channel.publish(4, b"x" * 65)
        assert channel.read().data == b"abc"  # a refused publish changes nothing
    finally:
        channel.close()


def test_no_torn_reads_under_a_concurrent_writer():
    channel = SharedMemoryChannel.create(4_000_000)
    versions = 1000
    expected = {v: blob_of(v) for v in range(1, 101)}
    import hf_tta.service.channel as channel_module

    proc = subprocess.Popen([sys.executable, "-c", WRITER, channel_module.__file__, channel.name, str(versions)])
    try:
        seen, reads = set(), 0
        deadline = time.monotonic() + 60
        while proc.poll() is None or channel.latest_version() < versions:
            blob = channel.read()
            if blob is not None:
                assert blob.data == expected[(blob.version - 1) % 100 + 1]  # one whole blob, of the version it says
                seen.add(blob.version)
                reads += 1
            assert time.monotonic() < deadline
        assert proc.returncode == 0 and channel.read().version == versions and reads > 10 and len(seen) > 2
    finally:
        proc.wait(10)
        channel.close()


def test_published_state_is_the_adapters(gallery):
    config = TTAConfig(objective="tcr", query_modality="image", lr=1e-2, score_transform="dn")
    build = partial(build_wrapper, partial(make_model, "clip"), config)
    channel = SharedMemoryChannel.create(1 << 20)
    try:
        worker = Worker(WorkerSpec(build, {"kind": "shm", "name": channel.name}, max_tenants=2), channel)
        worker.handle(("gallery", gallery.embeddings.numpy()))
        for i, batch in enumerate(image_stream(3, size=8)):
            tenant = "a" if i % 2 == 0 else "b"
            reply = worker.handle(("adapt", i, tenant, {k: v.numpy() for k, v in batch.items()}))
            assert reply[0] == "done" and reply[-1] is None
            snap = decode(channel.read().data)
            for key, published in snap.tenants.items():
                expected = dataclasses.replace(worker.adapters.state(key).only(PUBLISHED), optimizer=None)
                assert published.state.equals(expected) and published.version == worker.adapters.tenants[key].version
        assert {k: t.version for k, t in snap.tenants.items()} == {"a": 2, "b": 1}
        refused = worker.handle(("adapt", 9, "c", {k: v.numpy() for k, v in batch.items()}))
        assert "tenant limit" in refused[-1]  # a third tenant: reported, the worker goes on
    finally:
        channel.close()


def test_redis_channel_and_store_down(redis_server, gallery):
    from hf_tta.service.answerer import Answerer
    from hf_tta.service.redis_channel import RedisChannel

    url, proc = redis_server
    config = TTAConfig(objective="tcr", query_modality="image", lr=1e-2)
    build = partial(build_wrapper, partial(make_model, "clip"), config)
    channel = RedisChannel(url, key="t")
    assert channel.read() is None and channel.latest_version() == 0
    worker = Worker(WorkerSpec(build, {"kind": "redis", "url": url, "key": "t"}), channel)
    worker.handle(("gallery", gallery.embeddings.numpy()))
    batch = image_stream(1, size=8)[0]
    worker.handle(("adapt", 1, "default", {k: v.numpy() for k, v in batch.items()}))
    replica = Answerer(build(), RedisChannel(url, key="t", timeout=0.2))  # another host's answerer
    assert replica.refresh() and replica.version == 1 and replica.store_error is None
    expected = dataclasses.replace(worker.adapters.state("default").only(PUBLISHED), optimizer=None)

    assert replica.current("default").state.equals(expected)
    proc.kill()
    proc.wait(5)
    assert not replica.refresh() and replica.store_error is not None  # store down: the last state stays
    from hf_tta.gallery.live import LiveGallery

    answer = replica.answer(batch, LiveGallery(gallery.embeddings, "text"), 3, "default")
    assert answer.version == 1 and answer.ids.shape == (8, 3)
    reply = worker.handle(("adapt", 2, "default", {k: v.numpy() for k, v in batch.items()}))
    assert reply[-1] is None and worker.adapters.counters["publish_errors"] == 1  # adapted; the publish is retried
    worker.tick()  # still down: no exception, nothing lost
    assert worker.unpublished and worker.adapters.version == 2


def test_a_redis_store_that_restarts_empty_gets_the_state_again_within_a_tick(redis_server, gallery):
    """Before: after a Redis restart the store stayed empty (no state, no heartbeat, readiness read the missing
    heartbeat as time 0) until the next adapted batch; now the worker's next tick publishes its version again."""
    import redis

    from hf_tta.service.redis_channel import RedisChannel

    url, _ = redis_server
    build = partial(build_wrapper, partial(make_model, "clip"), TTAConfig(objective="tcr", query_modality="image", lr=1e-2))
    channel = RedisChannel(url, key="t")
    worker = Worker(WorkerSpec(build, {"kind": "redis", "url": url, "key": "t"}), channel)
    worker.handle(("gallery", gallery.embeddings.numpy()))
    batch = image_stream(1, size=8)[0]
    worker.handle(("adapt", 1, "default", {k: v.numpy() for k, v in batch.items()}))
    assert channel.latest_version() == 1
    redis.Redis.from_url(url).flushall()  # what a restart without persistence leaves
    assert channel.latest_version() == 0 and channel.heartbeat() == 0.0
    worker.tick()
    assert channel.latest_version() == 1 and channel.heartbeat() > 0 and not worker.unpublished
    blob = channel.read()
    assert decode(blob.data).tenants["default"].state.equals(
        dataclasses.replace(worker.adapters.state("default").only(PUBLISHED), optimizer=None))
