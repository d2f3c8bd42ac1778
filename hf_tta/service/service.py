"""The service behind the HTTP app: the answering state, the live gallery, the adaptation queue and the adapting
process, and the operations on them (search, items, admin, health). :mod:`hf_tta.service.app` maps them to HTTP.

Topology (one machine): this process answers (no backward pass here) from the state the adapting process publishes
through shared memory (:mod:`hf_tta.service.channel`); the adapting process (:mod:`hf_tta.service.worker`) adapts on
the queued queries (:mod:`hf_tta.service.batcher`) and checkpoints. With ``store="redis://..."`` the state goes through
Redis instead, and answer replicas on other hosts (``adapt=False`` with the same store) read it too.
"""

from __future__ import annotations

import logging
import os
import re
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from ..gallery.live import LiveGallery
from ..wrapper import TTAWrapper
from .answerer import Answer, Answerer
from .batcher import AdaptQueue
from .codec import Snapshot, TenantState, encode
from .limits import Decoded, InputError, Limits, adaptable, decode_image, decode_text
from .metrics import ServiceMetrics
from .supervisor import Supervisor
from .tenants import DEFAULT_TENANT
from .worker import WorkerSpec, open_channel

logger = logging.getLogger(__name__)

CHECKPOINT_FILE, GALLERY_FILE = "tenants.safetensors", "gallery.safetensors"
TENANT_KEY = re.compile(r"^[A-Za-z0-9_.:-]{1,64}$")


def heartbeat_problem(now: float, heartbeat: float, timeout: float) -> str | None:
    """Readiness's word on the adapting worker's heartbeat (wall time of its last sign of life in the state store;
    0: none there, e.g. a Redis that restarted empty), or ``None`` when it is recent enough."""
    if heartbeat <= 0:
        return "the adapting worker has not reported to the state store yet (no heartbeat there)"
    if now - heartbeat > timeout:
        return f"the adapting worker has not reported for {now - heartbeat:.0f} s"
    return None

@dataclass
class ServiceConfig:
    """What the service is built from and how it behaves.

    ``build`` returns the :class:`~hf_tta.TTAWrapper` at its source state; it runs in this process and in the
    adapting one, so it must be picklable (a module-level function or a ``functools.partial`` of one). ``encode``
    maps a modality to a function of a list of PIL images or strings that returns the model's input dict (text padded
    to a fixed length, so that queued queries stack). ``gallery_items``: the starting gallery (ids 0..N-1).
    """

    build: Callable[[], TTAWrapper]
    encode: dict[str, Callable[[list], dict[str, torch.Tensor]]]
    gallery_items: Sequence[Any]
    state_dir: str | None = None
    tenants: bool = False
    max_tenants: int = 8
    adapt: bool = True
    batch_size: int = 32
    min_batch: int = 8
    max_wait: float = 1.0
    queue_capacity: int = 512
    checkpoint_every: float = 30.0
    worker_nice: int = 10
    worker_idle: bool = True  # the adapting process under SCHED_IDLE once started (Linux; hf_tta.service.worker.set_idle)
    worker_threads: int = 1
    max_state_lag: float = 120.0  # readiness fails when queued adaptation work waited longer than this (s)
    heartbeat_timeout: float = 15.0
    admin_timeout: float = 30.0  # an admin command still queued after this is answered 202 (accepted, runs later)
    adapt_yield: int | None = 2  # adaptation holds its batches while more searches than this are in flight (None: never)
    max_restarts: int = 3
    limits: Limits = field(default_factory=Limits)
    token: str | None = None
    search_needs_token: bool = False
    store: str | None = None  # "redis://host:port/db" (default: shared memory on this machine)
    store_key: str = "hf_tta"
    state_capacity_mb: float = 0.0  # shared-memory slot size (0: from the model's state size)
    poll: float = 0.01
    answer_threads: int = 4

    def __post_init__(self) -> None:
        if not isinstance(self.max_tenants, int) or self.max_tenants < 1:
            raise ValueError(f"max_tenants={self.max_tenants!r}: pass a positive integer.")
        if self.store is not None and not self.store.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError(f"store={self.store!r}: pass a redis:// URL (or leave it unset for shared memory).")
        if self.adapt_yield is not None and (not isinstance(self.adapt_yield, int) or self.adapt_yield < 0):
            raise ValueError(f"adapt_yield={self.adapt_yield!r}: pass a number of searches in flight >= 0, or None.")
        if not self.adapt and self.store is None:
            return
        AdaptQueue(self.queue_capacity, self.batch_size, self.min_batch, self.max_wait)  # validates those four


class Service:
    """See :mod:`hf_tta.service.service`."""

    def __init__(self, cfg: ServiceConfig):
        self.cfg = cfg
        self.metrics = ServiceMetrics()
        self.queue = AdaptQueue(cfg.queue_capacity, cfg.batch_size, cfg.min_batch, cfg.max_wait)
        self.answerer: Answerer | None = None
        self.supervisor: Supervisor | None = None
        self.gallery: LiveGallery | None = None
        self.channel: Any = None
        self.wrapper: TTAWrapper | None = None
        self.last_checkpoint: float | None = None
        self.started_at = time.time()
        self._items_lock = threading.Lock()
        self._save_lock = threading.Lock()
        self._tenants_lock = threading.Lock()
        self._accepted: set[str] = set()  # tenants with a query queued by this process (in flight ones count)
        self._answering = 0  # searches in flight (adaptation yields past cfg.adapt_yield)
        self._answering_lock = threading.Lock()
        self._stop = threading.Event()
        self._timer: threading.Thread | None = None

    @property
    def state_dir(self) -> Path | None:
        return Path(self.cfg.state_dir) if self.cfg.state_dir else None

    # ------------------------------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        cfg = self.cfg
        self._lock_state_dir()
        self.wrapper = cfg.build()
        if type(self.wrapper) is not TTAWrapper:
            raise TypeError(f"ServiceConfig.build must return a plain TTAWrapper (tenants are the service's), got {type(self.wrapper).__name__}.")
        self._start_gallery()
        self.channel = self._open_channel()
        self.answerer = Answerer(self.wrapper, self.channel, cfg.poll)
        if cfg.adapt:
            spec = WorkerSpec(
                cfg.build, self._channel_spec(), cfg.max_tenants,
                str(self.state_dir / CHECKPOINT_FILE) if self.state_dir else None,
                cfg.checkpoint_every, nice=cfg.worker_nice, idle=cfg.worker_idle, threads=cfg.worker_threads,
            )
            behind = None if cfg.adapt_yield is None else self.answer_path_behind
            self.supervisor = Supervisor(spec, self.queue, self._versions, cfg.max_restarts,
                                         on_done=self.metrics.on_done, behind=behind)
            self.supervisor.set_gallery(self.gallery.snapshot().cache.embeddings.numpy())
            self.supervisor.start()
        self.answerer.start()
        if self.state_dir is not None and cfg.checkpoint_every > 0:
            self._timer = threading.Thread(target=self._save_loop, name="hf_tta-service-save", daemon=True)
            self._timer.start()

    def _lock_state_dir(self) -> None:
        """One writer per state folder: an exclusive ``flock`` on ``<state_dir>/.lock`` for the service's life (the
        kernel drops it when the process dies, even by ``kill -9``); a second service on the folder is refused."""
        self._lock_fd = None
        if self.state_dir is None:
            return
        import fcntl

        self.state_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.state_dir / ".lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
            os.close(fd)
            raise RuntimeError(f"the state folder {self.state_dir} is in use by another hf_tta service (pid {holder}): "
                               "give each service its own --state-dir.") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        self._lock_fd = fd

    def _versions(self) -> tuple[int, dict[str, int]]:
        return self.answerer.version, {t: c.version for t, c in self.answerer.states.items()}

    def _start_gallery(self) -> None:
        gallery_file = self.state_dir / GALLERY_FILE if self.state_dir else None
        modality = self.wrapper.gallery_modality
        if gallery_file is not None and gallery_file.exists():
            from safetensors.torch import load_file

            saved = load_file(str(gallery_file))
            version = int(saved["version"]) if "version" in saved else 0  # saved before versions were kept: 0
            self.gallery = LiveGallery(saved["embeddings"], modality, ids=saved["ids"], version=version)
            logger.info("Resumed the gallery (%d items) from %s.", len(self.gallery), gallery_file)
        else:
            self.gallery = LiveGallery(self.encode_items(list(self.cfg.gallery_items)), modality)

    def _channel_spec(self) -> dict[str, Any]:
        if self.cfg.store is not None:
            return {"kind": "redis", "url": self.cfg.store, "key": self.cfg.store_key}
        return {"kind": "shm", "name": self.channel.name}

    def _open_channel(self) -> Any:
        if self.cfg.store is not None:
            return open_channel({"kind": "redis", "url": self.cfg.store, "key": self.cfg.store_key})
        if not self.cfg.adapt:
            return None
        from .channel import SharedMemoryChannel

        if self.cfg.state_capacity_mb > 0:
            capacity = int(self.cfg.state_capacity_mb * 2**20)
        else:  # one tenant's published state, times the tenants, with room for growing objective state
            one = len(encode(_source_snapshot(self.wrapper)))
            capacity = 2 * one * (self.cfg.max_tenants + 1) + 2**20
        return SharedMemoryChannel.create(capacity)

    def stop(self) -> None:
        """Stop adapting (the worker saves its state), save the gallery, release the channel."""
        self._stop.set()
        if self._timer is not None:
            self._timer.join(5)
        if self.supervisor is not None:
            self.supervisor.stop()
        if self.answerer is not None:
            self.answerer.stop()
        self.save_gallery()
        if self.channel is not None:
            self.channel.close()
        if getattr(self, "_lock_fd", None) is not None:  # the folder's lock goes last, after every write to it
            os.close(self._lock_fd)
            self._lock_fd = None

    def _save_loop(self) -> None:
        while not self._stop.wait(self.cfg.checkpoint_every):
            try:
                self.save_gallery()
            except Exception:  # noqa: BLE001 - a failed save is logged; the service goes on and retries next time
                logger.exception("Saving the gallery failed")

    def save_gallery(self) -> bool:
        """Write the gallery (embeddings, ids, version) to the state folder durably: a temporary file, fsync'd, renamed
        over the last one, the folder fsync'd; ``False`` without a state folder (nothing is durable then)."""
        if self.state_dir is None or self.gallery is None:
            return False
        from safetensors.torch import save_file

        with self._save_lock:  # the periodic save and the edits' saves share the temporary file
            self.state_dir.mkdir(parents=True, exist_ok=True)
            snap = self.gallery.snapshot()
            tmp = self.state_dir / f".{GALLERY_FILE}.tmp"
            save_file({"embeddings": snap.cache.embeddings.contiguous(), "ids": snap.ids.contiguous(),
                       "version": torch.tensor(snap.version, dtype=torch.int64)}, str(tmp))
            fd = os.open(tmp, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, self.state_dir / GALLERY_FILE)
            fd = os.open(self.state_dir, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        self.last_checkpoint = time.time()
        return True

    # ------------------------------------------------------------------------------------------ requests
    def encode_items(self, items: list) -> torch.Tensor:
        inputs = self.cfg.encode[self.wrapper.gallery_modality](items)
        return self.wrapper.encode_gallery(inputs, show_progress=False).embeddings

    def decode(self, modality: str, image: Any, text: Any, role: str) -> Decoded:
        given = {"image": image, "text": text}
        other = "text" if modality == "image" else "image"
        if given[modality] is None or given[other] is not None:
            raise InputError(f"send exactly one {modality!r} field: this service's {role} are {modality}s")
        if modality == "text":
            return decode_text(text, self.cfg.limits)
        return decode_image(image, self.cfg.limits)

    def tenant(self, header: str | None) -> str:
        if not self.cfg.tenants:
            if header is not None:
                raise InputError("X-Tenant given, but this service has no per-tenant adapters (start it with --tenants)")
            return DEFAULT_TENANT
        key = header if header is not None else DEFAULT_TENANT
        if not TENANT_KEY.match(key):
            raise InputError("X-Tenant must be 1-64 characters of letters, digits and _.:-")
        with self._tenants_lock:  # counted from the first query queued for it: queued, in flight or published
            known = self._accepted | set(self.answerer.states) | set(self.queue.depth())
        if key not in known and len(known) >= self.cfg.max_tenants:
            raise InputError(f"tenant limit reached ({self.cfg.max_tenants} tenants, counting {DEFAULT_TENANT!r} once a "
                             "request without X-Tenant used it): raise --max-tenants or reuse a tenant", 403)
        return key

    def answer_path_behind(self) -> bool:
        """Whether more searches than ``adapt_yield`` are in flight (adaptation then holds its batches back)."""
        return self.cfg.adapt_yield is not None and self._answering > self.cfg.adapt_yield

    def search(self, image: Any, text: Any, k: int, header: str | None) -> dict[str, Any]:
        """One query: answered now from the tenant's current state, queued for adaptation when it may be."""
        with self._answering_lock:
            self._answering += 1
        try:
            return self._search(image, text, k, header)
        finally:
            with self._answering_lock:
                self._answering -= 1

    def _search(self, image: Any, text: Any, k: int, header: str | None) -> dict[str, Any]:
        if not isinstance(k, int) or not 1 <= k <= self.cfg.limits.max_k:
            raise InputError(f"k must be an integer in [1, {self.cfg.limits.max_k}]", 422)
        tenant = self.tenant(header)
        decoded = self.decode(self.wrapper.query_modality, image, text, "queries")
        t0 = time.perf_counter()
        inputs = self.cfg.encode[self.wrapper.query_modality]([decoded.value])
        why_not = decoded.why_not or adaptable(inputs)
        answer: Answer = self.answerer.answer(inputs, self.gallery, k, tenant)
        queued = False
        if self.supervisor is not None and why_not is None:
            with self._tenants_lock:
                self._accepted.add(tenant)
            self.queue.put(tenant, {key: v.detach().cpu().numpy() for key, v in inputs.items()})
            self.supervisor.notify()
            queued = True
        elif why_not is not None:
            self.metrics.not_adapted.labels(tenant, why_not.split(" ")[0]).inc()
        self.metrics.answer_latency.labels(tenant).observe(time.perf_counter() - t0)
        self.metrics.answered.labels(tenant).inc()
        return {
            "ids": answer.ids[0].tolist(), "scores": [float(s) for s in answer.scores[0].tolist()],
            "version": answer.version, "state_age_s": answer.age, "gallery_version": answer.gallery_version,
            "tenant": tenant, "queued_for_adaptation": queued, "not_adapted": why_not,
        }

    def add_item(self, item_id: int, image: Any, text: Any) -> dict[str, Any]:
        decoded = self.decode(self.wrapper.gallery_modality, image, text, "items")
        with self._items_lock:
            if item_id in set(self.gallery.ids.tolist()):
                raise InputError(f"item {item_id} exists: DELETE it first", 409)
            emb = self.encode_items([decoded.value])  # the gallery tower never adapts: the source's
            self.gallery.add([item_id], emb)
            self._send_gallery()
            durable = self.save_gallery()  # before the 201: an acknowledged edit survives a crash
        return {"id": item_id, "gallery_size": len(self.gallery), "gallery_version": self.gallery.version, "durable": durable}

    def delete_item(self, item_id: int) -> dict[str, Any]:
        with self._items_lock:
            if item_id not in set(self.gallery.ids.tolist()):
                raise InputError(f"no item {item_id}", 404)
            if len(self.gallery) == 1:
                raise InputError("the gallery's last item cannot be removed", 409)
            self.gallery.remove([item_id])
            self._send_gallery()
            durable = self.save_gallery()
        return {"id": item_id, "gallery_size": len(self.gallery), "gallery_version": self.gallery.version, "durable": durable}

    def _send_gallery(self) -> None:
        if self.supervisor is not None:
            self.supervisor.set_gallery(self.gallery.snapshot().cache.embeddings.numpy())

    # ------------------------------------------------------------------------------------------ admin
    def admin(self, op: str, tenant: str | None = None) -> dict[str, Any]:
        sup = self.supervisor
        if sup is None:
            raise InputError("this service does not adapt (--no-adapt): nothing to pause, reset or roll back", 409)
        if op == "pause":
            sup.paused = True
            return {"paused": True, "queued": len(self.queue)}
        if op == "resume":
            sup.paused = False
            sup.notify()
            return {"paused": False, "queued": len(self.queue)}
        if op in ("reset", "rollback", "checkpoint"):
            if tenant is not None and not TENANT_KEY.match(tenant):
                raise InputError("tenant must be 1-64 characters of letters, digits and _.:-")
            args = () if op == "checkpoint" else ((tenant if op == "reset" else (tenant or DEFAULT_TENANT)),)
            before = self.answerer.version
            ok, message = sup.command(op, *args, timeout=self.cfg.admin_timeout)
            if ok is None:  # queued behind a slow batch: it will run (not a refusal)
                return {"ok": True, "accepted": True, "message": message, "version": self.answerer.version}
            if not ok:
                raise InputError(message, 409 if sup.alive() else 503)
            deadline = time.monotonic() + 60
            while op != "checkpoint" and self.answerer.version == before and time.monotonic() < deadline:
                time.sleep(self.cfg.poll)  # answers use the new state once this returns
            return {"ok": True, "message": message, "version": self.answerer.version}
        raise InputError(f"unknown admin operation {op!r}", 404)

    # ------------------------------------------------------------------------------------------ health
    def readiness(self) -> tuple[bool, dict[str, Any]]:
        """Whether to send traffic here, and why not."""
        problems: list[str] = []
        now = time.time()
        sup = self.supervisor
        if self.answerer is None:
            problems.append("starting")
        if sup is not None:
            if sup.failed:
                problems.append(sup.failed)
            elif not sup.alive():
                problems.append("the adapting worker is dead (restarting)")
            elif not sup.started.is_set():
                problems.append("the adapting worker is starting")
            elif self.answerer is not None and (late := heartbeat_problem(now, self.answerer.heartbeat, self.cfg.heartbeat_timeout)):
                problems.append(late)
            if not sup.paused and not sup.yielding():  # yielding to answers: a lagging state is the policy
                waits = self.queue.oldest_wait()
                depth = self.queue.depth()
                lagging = {t: w for t, w in waits.items() if w > self.cfg.max_state_lag and depth.get(t, 0) >= self.cfg.min_batch}
                if lagging:
                    problems.append(f"adaptation lags: queries of {sorted(lagging)} waited over {self.cfg.max_state_lag:.0f} s")
        if self.answerer is not None and self.answerer.store_error:
            problems.append(f"state store unreachable since {time.strftime('%H:%M:%S', time.gmtime(self.answerer.store_error_since))} UTC "
                            f"({self.answerer.store_error}); answering from version {self.answerer.version}")
        body = {"ready": not problems, "problems": problems, "version": self.answerer.version if self.answerer else 0,
                "state_age_s": {t: round(now - c.published, 3) for t, c in (self.answerer.states.items() if self.answerer else [])}}
        return not problems, body

    def health(self) -> dict[str, Any]:
        sup, ans = self.supervisor, self.answerer
        return {
            "adapt": self.cfg.adapt, "version": ans.version, "tenants": {t: c.version for t, c in ans.states.items()},
            "worker": {"alive": sup.alive() if sup else False, "paused": sup.paused if sup else False,
                       "restarts": sup.restart_count if sup else 0, "failed": sup.failed if sup else None,
                       "inflight": sup.inflight if sup else False, **(sup.counters if sup else {})},
            "queue": self.queue.stats(), "adapted": ans.counters, "safety_counts": ans.safety,
            "gallery_size": len(self.gallery), "gallery_version": self.gallery.version,
            "last_checkpoint": self.last_checkpoint, "store_error": ans.store_error, "drained": self.drained(),
        }

    def drained(self) -> bool:
        """Nothing ready to adapt and nothing in flight."""
        return self.supervisor is None or not self.supervisor.busy()


def _source_snapshot(wrapper: TTAWrapper) -> Snapshot:
    from ..state import AdapterState
    from .codec import PUBLISHED

    return Snapshot({DEFAULT_TENANT: TenantState(0, 0.0, AdapterState.capture(wrapper, PUBLISHED))}, {})


__all__ = ["Service", "ServiceConfig"]
