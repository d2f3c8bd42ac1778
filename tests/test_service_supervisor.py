"""The supervisor's policies (issue 49): adaptation yields to answering while the answer path is behind, and a stop
skips the batches still queued for the worker (answered, dropped from adaptation) instead of adapting on them first."""

from __future__ import annotations

import os
import queue
import subprocess
import sys
import threading
from functools import partial

import numpy as np
import pytest

from hf_tta import TTAConfig
from hf_tta.service.batcher import AdaptQueue
from hf_tta.service.builders import build_wrapper
from hf_tta.service.channel import SharedMemoryChannel
from hf_tta.service.supervisor import Supervisor
from hf_tta.service.tenants import TenantAdapters
from hf_tta.service.worker import SKIPPED, WorkerSpec, worker_main
from support import image_stream, wait_for
from tiny_models import make_model

BUILD = partial(build_wrapper, partial(make_model, "clip"), TTAConfig(objective="tcr", query_modality="image", lr=1e-2))


def _arrays(seed: int = 0) -> dict[str, np.ndarray]:
    return {k: v.numpy() for k, v in image_stream(1, size=8, seed=seed)[0].items()}


def test_adaptation_holds_its_batches_while_the_answer_path_is_behind(gallery):
    """While ``behind()`` is true a ready batch stays queued (no batch sent, the hold counted, ``yielding()`` true);
    once the answers catch up it is adapted on."""
    channel = SharedMemoryChannel.create(1 << 20)
    behind = threading.Event()
    behind.set()
    q = AdaptQueue(capacity=64, batch_size=8, min_batch=8, max_wait=0.01)
    sup = Supervisor(WorkerSpec(BUILD, {"kind": "shm", "name": channel.name}, nice=0, idle=False), q, lambda: (0, {}), behind=behind.is_set)
    try:
        sup.set_gallery(gallery.embeddings.numpy())
        sup.start(wait=300)
        assert wait_for(sup.started.is_set)
        q.put("default", _arrays())
        assert wait_for(lambda: sup.counters["yields"] == 1)
        assert sup.yielding() and len(q) == 8 and not sup.inflight and sup.counters["batches_done"] == 0
        behind.clear()
        assert wait_for(lambda: sup.counters["batches_done"] == 1)
        assert not sup.yielding() and len(q) == 0 and channel.read().version == 1
    finally:
        sup.stop()
        channel.close()


def test_a_stop_skips_the_batches_still_queued_and_saves(tmp_path, gallery):
    """Before: a batch queued ahead of the stop message was adapted on first (minutes on a saturated machine, past the
    60 s the stop waits, then terminated unsaved). Now it is skipped, reported as such, and the state is saved."""
    channel = SharedMemoryChannel.create(1 << 20)
    tasks, results, stopping = queue.Queue(), queue.Queue(), threading.Event()
    checkpoint = tmp_path / "tenants.safetensors"
    spec = WorkerSpec(BUILD, {"kind": "shm", "name": channel.name}, checkpoint=str(checkpoint), nice=0, idle=False)  # (this process)
    try:
        tasks.put(("gallery", gallery.embeddings.numpy()))
        tasks.put(("adapt", 7, "default", _arrays(1)))
        stopping.set()
        tasks.put(("stop",))
        worker_main(spec, tasks, results, stopping)
        replies = [results.get_nowait() for _ in range(results.qsize())]
        assert replies[0][0] == "started" and replies[1] == ("done", 7, "default", 0, SKIPPED, None)
        assert channel.read().version == 0  # nothing adapted on
        saved = TenantAdapters(BUILD(), 8)
        saved.load(str(checkpoint))  # saved on the way out
        assert saved.version == 0
    finally:
        channel.close()


def test_a_stop_under_real_cpu_load_ends_the_worker_by_its_own_exit_and_saves(tmp_path, gallery):
    """Item 4 under load: a busy process per core holds the machine while batches are queued for a real adapting
    process, which runs under SCHED_IDLE (the default) and so gets next to no CPU; ``stop()`` takes it out of that
    policy and ends it by its own exit (exit code 0: not terminated after the timeout), the batches it had not started
    are not adapted on, and the state it saved holds the batches it reported done."""
    busy: list[subprocess.Popen] = []
    channel = SharedMemoryChannel.create(1 << 20)
    checkpoint = tmp_path / "tenants.safetensors"
    q = AdaptQueue(capacity=1024, batch_size=8, min_batch=8, max_wait=0.01)
    sup = Supervisor(WorkerSpec(BUILD, {"kind": "shm", "name": channel.name}, checkpoint=str(checkpoint), nice=0), q, lambda: (0, {}))
    try:
        sup.set_gallery(gallery.embeddings.numpy())
        sup.start(wait=300)
        assert wait_for(sup.started.is_set, timeout=300)
        assert wait_for(lambda: os.sched_getscheduler(sup.proc.pid) == os.SCHED_IDLE)  # once started
        for i in range(100):  # a hundred batches of 8 queries
            q.put("default", _arrays(i % 16))
        assert wait_for(lambda: sup.counters["batches_done"] >= 1, timeout=300)
        busy += [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(os.cpu_count() or 1)]
        sup.stop(timeout=120)
        assert sup.proc.exitcode == 0  # (-15 when terminated)
        done = sup.counters["batches_done"]
        assert done < 100 and done + sup.counters["skipped_at_stop"] + len(q) // 8 <= 100
        saved = TenantAdapters(BUILD(), 8)
        saved.load(str(checkpoint))
        assert saved.version == channel.read().version == done
    finally:
        for proc in busy:
            proc.kill()
            proc.wait()
        channel.close()


def test_the_service_refuses_a_bad_adapt_yield_in_one_line():
    from hf_tta.service.service import ServiceConfig

    for bad in (-1, 1.5, "2"):
        with pytest.raises(ValueError, match="adapt_yield=.*pass a number of searches in flight >= 0, or None"):
            ServiceConfig(BUILD, {}, [], adapt_yield=bad)
    assert ServiceConfig(BUILD, {}, [], adapt_yield=None).adapt_yield is None  # never holds


def test_set_idle_moves_every_thread_of_a_process_in_and_out_of_sched_idle():
    """:func:`set_idle` on a real process with two threads: both enter SCHED_IDLE, both leave it (what a stop does)."""
    from hf_tta.service.worker import set_idle

    child = subprocess.Popen([sys.executable, "-c", "import threading, time; threading.Thread(target=time.sleep, args=(60,)).start(); time.sleep(60)"])
    try:
        tasks = f"/proc/{child.pid}/task"
        assert wait_for(lambda: len(os.listdir(tasks)) == 2)
        assert set_idle(child.pid, True)
        assert {os.sched_getscheduler(int(t)) for t in os.listdir(tasks)} == {os.SCHED_IDLE}
        assert set_idle(child.pid, False)
        assert {os.sched_getscheduler(int(t)) for t in os.listdir(tasks)} == {os.SCHED_OTHER}
    finally:
        child.kill()
        child.wait()
    assert set_idle(child.pid, False)  # gone: nothing to take out of it
