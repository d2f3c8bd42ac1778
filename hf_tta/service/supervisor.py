"""The server's side of the adapting process: starts it (``spawn``), feeds it ready batches one at a time from the
:class:`~hf_tta.service.batcher.AdaptQueue`, collects its reports, restarts it when it dies, and relays admin commands.

One batch is in flight at a time, so the work owed to adaptation is bounded by the queue's capacity plus one batch.
**Adaptation yields to answering**: while ``behind()`` says the answer path is behind (more searches in flight than
the service's ``adapt_yield``), no batch is sent; the queue stays bounded (its oldest queries are dropped from
adaptation, counted), ``counters["yields"]`` counts the holds and :meth:`Supervisor.yielding` tells readiness that a
lagging state is a choice, not a stuck worker. On :meth:`Supervisor.stop` the worker skips any batch still queued for
it (it was answered; it is dropped from adaptation) and saves.
A worker that dies (killed, out of memory) is restarted from the last checkpoint (or the source state without a state
directory), its versions going on from the last published one, up to ``max_restarts`` times in ``restart_window``
seconds; past that it stays down, which readiness reports (503) and the log says, while answers go on from the last
published state.
"""

from __future__ import annotations

import collections
import itertools
import logging
import multiprocessing as mp
import queue as queue_mod
import threading
import time
from dataclasses import replace
from typing import Any, Callable

import numpy as np

from .batcher import AdaptQueue
from .worker import SKIPPED, WorkerSpec, set_idle, worker_main

logger = logging.getLogger(__name__)


class Supervisor:
    """See :mod:`hf_tta.service.supervisor`. ``last_version``: the newest version answers have seen (restarts go on
    from it)."""

    def __init__(self, spec: WorkerSpec, queue: AdaptQueue, last_version: Callable[[], tuple[int, dict[str, int]]], max_restarts: int = 3,
                 restart_window: float = 600.0, on_done: Callable[..., None] | None = None,
                 behind: Callable[[], bool] | None = None):
        self.spec, self.queue, self.last_version, self.behind = spec, queue, last_version, behind
        self.max_restarts, self.restart_window, self.on_done = max_restarts, restart_window, on_done
        self.ctx = mp.get_context("spawn")
        self.stopping = self.ctx.Event()  # set on stop: the worker skips the batches still queued for it
        self._yielding = False  # holding batches back: the answer path is behind
        self.proc: Any = None
        self.tasks: Any = None
        self.results: Any = None
        self.paused = False
        self.failed: str | None = None  # why the worker is down for good
        self.restarts: collections.deque = collections.deque()
        self.restart_count = 0
        self.started = threading.Event()
        self._inflight: tuple[int, float] | None = None
        self._ids = itertools.count(1)
        self._replies: dict[int, list] = {}
        self._late: dict[int, str] = {}  # commands whose caller stopped waiting: their replies are logged
        self._cv = threading.Condition()
        self._stop = threading.Event()
        self._gallery: np.ndarray | None = None
        self._threads: list[threading.Thread] = []
        self.counters: dict[str, Any] = {"batches_done": 0, "batch_errors": 0, "last_error": None, "yields": 0,
                                         "skipped_at_stop": 0}

    # ------------------------------------------------------------------------------------------ lifecycle
    def start(self, wait: float = 120.0) -> None:
        self._spawn(self.spec)
        for target, name in ((self._dispatch, "dispatch"), (self._listen, "listen"), (self._watch, "watch")):
            t = threading.Thread(target=target, name=f"hf_tta-service-{name}", daemon=True)
            t.start()
            self._threads.append(t)
        if not self.started.wait(wait):
            logger.warning("The adapting worker did not start within %.0f s; readiness says so until it does.", wait)

    def _spawn(self, spec: WorkerSpec) -> None:
        self.started.clear()
        self.tasks, self.results = self.ctx.Queue(), self.ctx.Queue()
        if self._gallery is not None:
            self.tasks.put(("gallery", self._gallery))
        self.proc = self.ctx.Process(target=worker_main, args=(spec, self.tasks, self.results, self.stopping), name="hf_tta-adapt", daemon=True)
        self.proc.start()
        with self._cv:
            self._inflight = None
            self._cv.notify_all()

    def alive(self) -> bool:
        return self.proc is not None and self.proc.is_alive()

    def stop(self, timeout: float = 60.0) -> None:
        """Ask the worker to save and exit; terminate it after ``timeout``."""
        self._stop.set()
        self.stopping.set()
        with self._cv:
            self._cv.notify_all()
        if self.alive():
            if self.spec.idle:  # the batch in progress and the save must not wait for an idle core
                set_idle(self.proc.pid, False)
            self.tasks.put(("stop",))
            self.proc.join(timeout)
            if self.proc.is_alive():
                logger.warning("The adapting worker did not stop in %.0f s: terminated.", timeout)
                self.proc.terminate()
                self.proc.join(5)
        for t in self._threads:
            t.join(2)
        for q in (self.tasks, self.results):
            if q is not None:
                q.close()
                q.cancel_join_thread()

    # ------------------------------------------------------------------------------------------ feeding
    def set_gallery(self, embeddings: np.ndarray) -> None:
        """The gallery the worker adapts against (sent again to a restarted worker)."""
        self._gallery = np.ascontiguousarray(embeddings)
        if self.tasks is not None:
            self.tasks.put(("gallery", self._gallery))

    def notify(self) -> None:
        """A query was queued: wake the dispatcher."""
        with self._cv:
            self._cv.notify()

    @property
    def inflight(self) -> bool:
        return self._inflight is not None

    def yielding(self) -> bool:
        """Whether adaptation is holding its batches back because the answer path is behind (see the module)."""
        return self._yielding

    def _behind(self) -> bool:
        if self.behind is None or not self.behind():
            self._yielding = False
            return False
        if not self._yielding:
            self._yielding = True
            self.counters["yields"] += 1
            logger.debug("Adaptation yields: the answer path is behind.")
        return True

    def _dispatch(self) -> None:
        while not self._stop.is_set():
            with self._cv:
                if self.paused or self._inflight is not None or not self.started.is_set():
                    self._cv.wait(0.1)
                    continue
            if self._behind():
                with self._cv:
                    self._cv.wait(0.02)
                continue
            batch = self.queue.take()
            if batch is None:
                with self._cv:
                    self._cv.wait(0.02)  # a batch can become ready by waiting (max_wait): poll at 50 Hz
                continue
            batch_id = next(self._ids)
            with self._cv:
                self._inflight = (batch_id, time.monotonic())
            self.tasks.put(("adapt", batch_id, batch.tenant, batch.arrays))

    def _listen(self) -> None:
        while not self._stop.is_set():
            try:
                msg = self.results.get(timeout=0.2)
            except (queue_mod.Empty, OSError, EOFError, ValueError):
                continue
            if msg[0] == "started":
                self.started.set()
            elif msg[0] == "done":
                _, batch_id, tenant, n, action, error = msg
                self.counters["batches_done" if action != SKIPPED else "skipped_at_stop"] += 1
                if error:
                    self.counters["batch_errors"] += 1
                    self.counters["last_error"] = error
                if self.on_done is not None:
                    self.on_done(tenant, n, action, error)
                with self._cv:
                    if self._inflight is not None and self._inflight[0] == batch_id:
                        self._inflight = None
                    self._cv.notify_all()
            elif msg[0] == "reply":
                with self._cv:
                    kind = self._late.pop(msg[1], None)
                    if kind is None:
                        self._replies[msg[1]] = [msg[2], msg[3]]
                    self._cv.notify_all()
                if kind is not None:  # accepted earlier with "runs after the batch in flight": it ran now
                    logger.info("Admin %r finished after its request returned: %s", kind, msg[3])

    def _watch(self) -> None:
        while not self._stop.wait(0.5):
            if self.failed or self.proc is None or self.proc.is_alive() or self._stop.is_set():
                continue
            code = self.proc.exitcode
            now = time.monotonic()
            while self.restarts and now - self.restarts[0] > self.restart_window:
                self.restarts.popleft()
            if len(self.restarts) >= self.max_restarts:
                self.failed = (f"the adapting worker died (exit code {code}) {len(self.restarts) + 1} times in "
                               f"{self.restart_window:.0f} s; not restarted: answers go on from version {self.last_version()[0]}")
                logger.error(self.failed)
                continue
            self.restarts.append(now)
            self.restart_count += 1
            logger.error("The adapting worker died (exit code %s); restarting it (restart %d).", code, self.restart_count)
            version, versions = self.last_version()
            self._spawn(replace(self.spec, start_version=version, start_versions=versions))

    # ------------------------------------------------------------------------------------------ admin
    def command(self, kind: str, *args: Any, timeout: float = 30.0) -> tuple[bool | None, str]:
        """Send an admin command to the worker and wait up to ``timeout`` s for its reply: ``(ok, message)``, or
        ``(None, message)`` when the worker is alive but still busy (a batch in flight on a saturated machine): the
        command is queued and *will* run after that batch (its reply is logged then), which the message says; a
        caller must not report it as refused."""
        if not self.alive() or not self.started.is_set():
            return False, "the adapting worker is not running: see /readyz"
        req = next(self._ids)
        self.tasks.put((kind, req, *args))
        deadline = time.monotonic() + timeout
        with self._cv:
            while req not in self._replies:
                left = deadline - time.monotonic()
                if not self.alive():
                    return False, f"the adapting worker died before answering {kind!r}: see /readyz"
                if left <= 0:
                    self._late[req] = kind
                    return None, (f"accepted: the adapting worker is busy with a batch, so {kind!r} is queued and runs "
                                  "after it (the state version goes up then; see /stats)")
                self._cv.wait(min(left, 0.2))
            ok, message = self._replies.pop(req)
        return ok, message

    def busy(self) -> bool:
        """Whether a batch is in flight or one is ready to go (what a drained service has neither of)."""
        return self.inflight or self.queue.ready(time.monotonic())


__all__ = ["Supervisor"]
