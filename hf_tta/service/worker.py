"""The adapting process: takes batches of queries, adapts per tenant, publishes every new state to the channel,
checkpoints on an interval and on SIGTERM. Answers never run here, and backward passes never run anywhere else.

It is started with :mod:`multiprocessing`'s ``spawn`` (a fresh interpreter: no copy of the server's threads or locks,
the same on every OS) by :class:`hf_tta.service.supervisor.Supervisor`, which owns the queues. Messages in (tuples):
``("adapt", batch_id, tenant, {name: ndarray})``, ``("gallery", embeddings ndarray)``, ``("reset", req, tenant|None)``,
``("rollback", req, tenant)``, ``("checkpoint", req)``, ``("stop",)``. Messages out: ``("started", version)``,
``("done", batch_id, tenant, n, action, error)``, ``("reply", req, ok, message)``. A batch that fails is reported
(``error``) and the worker goes on; only the process dying stops adapting, which the supervisor sees.
"""

from __future__ import annotations

import logging
import os
import queue as queue_mod
import signal
import time
from dataclasses import dataclass
from typing import Any, Callable

logger = logging.getLogger(__name__)

#: The action a ``done`` reply names for a batch the worker skipped because it is stopping (answered, not adapted on).
SKIPPED = "skipped_at_stop"


@dataclass
class WorkerSpec:
    """What the adapting process is built from (picklable: ``build`` is a module-level callable or a partial of one
    that returns the :class:`~hf_tta.TTAWrapper` at its source state)."""

    build: Callable[[], Any]
    channel: dict[str, Any]  # {"kind": "shm", "name": ...} or {"kind": "redis", "url": ..., "key": ...}
    max_tenants: int = 8
    checkpoint: str | None = None  # the tenants' checkpoint file
    checkpoint_every: float = 30.0
    nice: int = 10
    idle: bool = True  # SCHED_IDLE once started (Linux, :func:`set_idle`): it runs only on a core answering leaves idle
    threads: int = 1
    start_version: int = 0  # publish versions above this (a restarted worker goes on from the last published)
    start_versions: dict[str, int] | None = None  # the tenants' last published versions (a restart goes on above them)


def open_channel(spec: dict[str, Any]) -> Any:
    """The channel a spec names (the writer's or a reader's end)."""
    if spec["kind"] == "shm":
        from .channel import SharedMemoryChannel

        return SharedMemoryChannel(spec["name"])
    if spec["kind"] == "redis":
        from .redis_channel import RedisChannel

        return RedisChannel(spec["url"], spec.get("key", "hf_tta"))
    raise ValueError(f"unknown channel kind {spec['kind']!r}: 'shm' or 'redis'")


class Worker:
    """The adapting loop's state and message handling (driven by :func:`worker_main`, or in-process by tests)."""

    def __init__(self, spec: WorkerSpec, channel: Any):
        from .tenants import TenantAdapters

        self.spec, self.channel = spec, channel
        self.adapters = TenantAdapters(spec.build(), spec.max_tenants)
        if spec.checkpoint and os.path.exists(spec.checkpoint):
            self.adapters.load(spec.checkpoint)
            logger.info("Worker resumed %d tenant(s) at version %d from %s.", len(self.adapters.tenants), self.adapters.version, spec.checkpoint)
        if spec.start_version:  # a restart: what was published after the checkpoint is lost; new versions say so
            self.adapters.version = max(self.adapters.version, spec.start_version) + 1
            for key, version in (spec.start_versions or {}).items():
                tenant = self.adapters.tenants.get(key) or self.adapters.activate(key)
                if tenant.version != version:
                    tenant.version = max(tenant.version, version) + 1
                    tenant.published = time.time()
        self.gallery = None
        self.dirty, self.last_save, self.unpublished = False, time.monotonic(), False

    def publish(self) -> bool:
        """Publish every tenant's state; a store that cannot be written is logged and retried at the next tick."""
        from .codec import encode

        try:
            self.channel.publish(self.adapters.version, encode(self.adapters.snapshot()))
        except Exception as err:  # noqa: BLE001 - a store down must not kill adaptation: retried by tick()
            if not self.unpublished:
                logger.error("Worker: publishing version %d failed (%s); retrying.", self.adapters.version, err)
            self.unpublished = True
            self.adapters.counters["publish_errors"] = self.adapters.counters.get("publish_errors", 0) + 1
            return False
        if self.unpublished:
            logger.info("Worker: published version %d again.", self.adapters.version)
        self.unpublished = False
        return True

    def handle(self, msg: tuple) -> tuple | None:
        """Handle one message; returns the reply to send (or ``None``)."""
        import numpy as np
        import torch

        kind = msg[0]
        if kind == "gallery":
            self.gallery = torch.from_numpy(np.ascontiguousarray(msg[1]))
            return None
        if kind == "adapt":
            _, batch_id, tenant, arrays = msg
            n = next(iter(arrays.values())).shape[0]
            try:
                if self.gallery is None:
                    raise RuntimeError("no gallery yet")
                queries = {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in arrays.items()}
                kwargs = {"scoring": "before_update"} if self.adapters.wrapper.score_transform is not None else {}
                out = self.adapters.adapt(tenant, queries, self.gallery, **kwargs)
            except Exception as err:  # noqa: BLE001 - one bad batch is reported, the worker goes on
                self.adapters.counters["errors"] += 1
                logger.warning("Worker: batch %s of tenant %r not adapted on: %s", batch_id, tenant, err)
                return ("done", batch_id, tenant, n, None, f"{type(err).__name__}: {err}".splitlines()[0])
            self.dirty = True
            self.publish()
            return ("done", batch_id, tenant, n, getattr(out, "safety_action", None), None)
        if kind in ("reset", "rollback"):
            _, req, tenant = msg
            try:
                if kind == "reset":
                    done = self.adapters.reset(tenant)
                    message = f"reset {len(done)} tenant(s) to the source model"
                else:
                    left = self.adapters.rollback(tenant)
                    message = f"tenant {tenant!r} rolled back one adapted batch ({left} earlier state(s) kept)"
            except (KeyError, LookupError) as err:
                return ("reply", req, False, str(err).strip("'\""))
            self.dirty = True
            self.publish()
            return ("reply", req, True, message)
        if kind == "checkpoint":
            self.save()
            return ("reply", msg[1], True, f"saved version {self.adapters.version}")
        raise ValueError(f"unknown message {kind!r}")

    def save(self) -> None:
        if self.spec.checkpoint:
            self.adapters.save(self.spec.checkpoint)
            logger.info("Worker checkpoint written (version %d) to %s.", self.adapters.version, self.spec.checkpoint)
        self.dirty, self.last_save = False, time.monotonic()

    def tick(self) -> None:
        """Heartbeat (or a retried publish, or a publish again when the store lost the state: a Redis that restarted
        empty), and the interval checkpoint when the state changed."""
        try:
            lost = not self.unpublished and self.channel.latest_version() != self.adapters.version
            if lost:
                logger.warning("Worker: the state store holds version %d, not %d (restarted empty?): publishing again.",
                               self.channel.latest_version(), self.adapters.version)
            if (not self.unpublished and not lost) or self.publish():
                self.channel.beat()
        except Exception:  # noqa: BLE001 - the store is down: publish() logs it and retries next tick
            self.unpublished = True
        if self.dirty and self.spec.checkpoint_every > 0 and time.monotonic() - self.last_save >= self.spec.checkpoint_every:
            self.save()


def lower_priority(nice: int) -> None:
    """The adapting process's nice value, raised by ``nice`` at its start (its build and first publish run so)."""
    if nice:
        try:
            os.nice(nice)
        except OSError as err:
            logger.warning("Could not lower the worker's priority (%s).", err)


def _threads(pid: int) -> list[int]:
    try:
        return [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        return [pid]


def set_idle(pid: int, idle: bool) -> bool:
    """Every thread of process ``pid`` into (``idle``) or out of the Linux ``SCHED_IDLE`` policy (sched(7)).

    Under ``SCHED_IDLE`` the adapting process runs only on a core no ordinary task wants, and an answer that wakes up
    preempts it at once (``nice`` only shortens its turns; the serving card compares the answers' latency under both).
    The worker enters it once it has started; the supervisor takes it out before a stop, so that the batch in progress
    and the save do not wait for an idle core. Leaving it needs ``CAP_SYS_NICE`` or an ``RLIMIT_NICE`` that allows the
    process's nice value: refused, the stop waits as long as the machine stays busy (logged). Returns whether every
    thread was set."""
    policy = os.SCHED_IDLE if idle else os.SCHED_OTHER
    try:
        for tid in _threads(pid):
            if (os.sched_getscheduler(tid) == os.SCHED_IDLE) != idle:
                os.sched_setscheduler(tid, policy, os.sched_param(0))
        return True
    except ProcessLookupError:  # gone (a thread, or the process)
        return not idle
    except (AttributeError, OSError) as err:  # not Linux, or refused
        logger.warning("Could not %s SCHED_IDLE for the adapting process (%s)%s.", "enter" if idle else "leave", err,
                       "" if idle else ": its stop waits for an idle core")
        return False


def worker_main(spec: WorkerSpec, tasks: Any, results: Any, stopping: Any = None) -> None:
    """The process's entry point (see :mod:`hf_tta.service.worker`). ``stopping`` (an event the supervisor sets on
    stop): a batch still queued then is skipped (replied ``done`` with action :data:`SKIPPED`), so a stop waits for at
    most the batch being adapted, then saves."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s [worker] %(levelname)s %(message)s")
    stop = {"flag": False}
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group: the server stops us in order
    signal.signal(signal.SIGTERM, lambda *_: stop.update(flag=True))
    lower_priority(spec.nice)
    import torch

    torch.set_num_threads(max(1, spec.threads))
    parent = os.getppid()  # the answering process: when it dies (even by kill -9) this process must not outlive it
    channel = open_channel(spec.channel)
    worker = Worker(spec, channel)
    worker.publish()
    results.put(("started", worker.adapters.version))
    if spec.idle and set_idle(os.getpid(), True):
        logger.info("The adapting process runs under SCHED_IDLE: it uses a core only when answering leaves one idle.")
    orphaned = False
    try:
        while not stop["flag"]:
            if os.getppid() != parent:  # re-parented: the answering process is gone; a restarted service owns the folder
                logger.warning("The answering process %d is gone: the adapting process exits without saving.", parent)
                orphaned = True
                break
            try:
                msg = tasks.get(timeout=0.25)
            except queue_mod.Empty:
                msg = None
            if msg is not None:
                if msg[0] == "stop":
                    break
                if msg[0] == "adapt" and stopping is not None and stopping.is_set():
                    logger.info("Worker: stopping; batch %s of tenant %r skipped (answered, not adapted on).", msg[1], msg[2])
                    results.put(("done", msg[1], msg[2], 0, SKIPPED, None))
                    continue
                reply = worker.handle(msg)
                if reply is not None:
                    results.put(reply)
            if os.getppid() != parent:  # it may have died during the batch: no interval checkpoint either
                orphaned = True
                logger.warning("The answering process %d is gone: the adapting process exits without saving.", parent)
                break
            worker.tick()
    finally:
        if not orphaned:  # an orphan never writes the state folder (a restarted service may be using it)
            worker.save()
        channel.close()


__all__ = ["SKIPPED", "Worker", "WorkerSpec", "open_channel", "worker_main"]
