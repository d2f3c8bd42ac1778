"""``OnlineRetriever``: answer queries now, adapt on them later, swap the adapted weights in between answers.

Queries arrive one or a few at a time. :meth:`OnlineRetriever.search` answers them at once with one no-grad forward
of the *current* model (the wrapper's public :meth:`~hf_tta.TTAWrapper.answer`: what ``adapt_step`` with
``TTAConfig(scoring="before_update")`` answers, through the score transform, e.g. DN, whose state it reads and never
advances), and buffers them. The gallery is a dense :class:`~hf_tta.GalleryCache` (or tensor), a
:class:`~hf_tta.gallery.live.LiveGallery` (read through one :meth:`~hf_tta.gallery.live.LiveGallery.snapshot` per
answer) or any top-k :class:`~hf_tta.gallery.GalleryBackend` (chunked, FAISS; held at one version with
``backend.reading()`` for the whole answer, so a concurrent ``add`` / ``remove`` / ``replace`` waits; a sharded one in
``mode="sync"`` only, each process making the same searches, since its searches are collectives); the last two answer
with their external ids. When ``batch_size`` queries have arrived, or the oldest buffered query has waited
``max_wait`` seconds, the buffered batch is adapted on with the wrapper's ``adapt_step`` (per-domain for a
:class:`~hf_tta.routing.RoutedTTAWrapper`, one tenant key per query); with a score transform it adapts with
``scoring="before_update"``, so that DN's query mean advances on the batch's embeddings by the model that adapts on
it, as ``adapt_step`` with that setting does (the answers' copies of its state are dropped).

Consistency (no torn reads), by construction rather than by locking the answer path: the wrapper the user passed is
adapted only by the worker; after each adapted batch the worker publishes the state's served parts (an
:class:`~hf_tta.state.AdapterState` of :data:`~hf_tta.state.SERVED`: the adapted parameters, the objective's and score
transform's state, RNG and counter; not the optimiser or the safety snapshots) and swaps the reference in one
assignment. An answer reads the reference once and runs its whole forward on a *reader* that holds that state
(:mod:`hf_tta.readers`: a wrapper built by :meth:`~hf_tta.TTAWrapper.reader`, sharing every frozen tensor, made once
and reused across versions; the state is copied into an idle one), which nobody writes while the answer runs; so
every answer is the scores of exactly one published version (:attr:`SearchResult.version`), answering never waits for
a backward pass, and the adapting thread never waits for an answer. A routed wrapper publishes a reader of itself per
version (its domains' states and router are not served parts), used by one answer at a time (its own lock). Chosen over a
readers-writer lock on one model: that would make answers wait for the whole ``adapt_step`` (3 forward+backward
passes) or need a second copy anyway.

``mode="sync"`` (tests, benchmarks): no thread; the batch adapts inline in the ``search`` call that fills it, so a
stream searched in batches of ``batch_size`` gets exactly ``adapt_step``'s answers with
``TTAConfig(scoring="before_update")`` (its ``topk`` with a top-k backend, in external ids) and the same final state
(tests, with and without DN). Differences from ``adapt_step`` to know: a search of fewer queries than a batch is
answered as a batch of its own (DN's query mean then counts these queries, not the rest of the batch they are adapted
in, which have not arrived); a batch that the safety layer skips as degenerate was already answered by the current
model (``adapt_step`` would answer it with the source model); and where DN draws its gallery sample
(``gallery_mean="samples"`` on more than ``num_samples`` items: at the first batch and after a gallery change) with an
objective that draws from the wrapper's RNG while adapting (DeYO, ClipTTA, REST), ``adapt_step`` draws the sample after
the batch's draws, which its answer cannot wait for: that batch's answers use another sample (the state is the same).

Checkpoints: :meth:`OnlineRetriever.checkpoint` writes the wrapper's ``save_pretrained`` (atomic) between two adapted
batches; queries still buffered are not in it (logged). A restarted process resumes with
``TTAWrapper.from_pretrained(model, folder)`` and a new ``OnlineRetriever`` around it.

    >>> online = OnlineRetriever(tta, gallery, batch_size=64, max_wait=0.05)  # doctest: +SKIP
    >>> hits = online.search({"pixel_values": pixels}, k=10)  # doctest: +SKIP
    >>> hits.ids, hits.version  # doctest: +SKIP
    >>> online.close()  # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import torch

from .gallery.base import GalleryBackend
from .gallery.cache import GalleryCache
from .gallery.live import LiveGallery
from .gallery.sharded import ShardedGallery
from .readers import ReaderPool, frozen_copy
from .routing import RoutedTTAWrapper
from .state import AdapterState
from .wrapper import TTAWrapper

logger = logging.getLogger(__name__)

MODES = ("background", "sync")


@dataclass(frozen=True)
class Published:
    """One published state: ``version`` (0 = the state the retriever started from, +1 per adapted batch), its served
    parts (``state``, :mod:`hf_tta.readers`; ``None`` for a routed wrapper, published as a frozen ``wrapper`` copy with
    the ``lock`` its answers take), its ``fingerprint`` (sha256 of the adapted tensors, 16 hex digits) and the safety
    layer's counts when it was published. Answer with it through :meth:`OnlineRetriever.reading`."""

    version: int
    state: AdapterState | None
    fingerprint: str
    safety_counts: dict[str, int]
    wrapper: TTAWrapper | None = None
    lock: threading.Lock | None = None


@dataclass(frozen=True)
class SearchResult:
    """The answer to one :meth:`OnlineRetriever.search`: ``values`` and ``ids`` ``(B, k)`` (gallery positions, or a
    LiveGallery's or top-k backend's external ids), ``scores`` ``(B, N)`` (``None`` with a top-k backend), all after
    the score transform, against the gallery version ``gallery_version`` (``None``: a fixed gallery), and the published
    state ``version`` that answered."""

    values: torch.Tensor
    ids: torch.Tensor
    scores: torch.Tensor | None
    version: int
    gallery_version: int | None


def _digest(groups: list[tuple[str, Mapping[str, torch.Tensor]]]) -> str:
    h = hashlib.sha256()
    for prefix, tensors in groups:
        for name in sorted(tensors):
            h.update(f"{prefix}/{name}".encode())
            h.update(tensors[name].detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def state_fingerprint(wrapper: TTAWrapper) -> str:
    """A short sha256 of a wrapper's adapted tensors (for a routed one, every domain's too), to tell states apart in
    logs; equal to :func:`captured_fingerprint` of the state captured from a plain wrapper."""
    groups = [("", dict(wrapper.named_optimized_parameters()))]
    if isinstance(wrapper, RoutedTTAWrapper):
        groups += [(str(key), wrapper.domain_parameters(key)) for key in wrapper.domain_keys]
    return _digest(groups)


def captured_fingerprint(state: AdapterState) -> str:
    """:func:`state_fingerprint` of a captured :class:`~hf_tta.state.AdapterState` (its parameters)."""
    return _digest([("", dict(state.params))])


class OnlineRetriever:
    """An online front end for a :class:`~hf_tta.TTAWrapper` (see :mod:`hf_tta.serving`).

    Args:
        wrapper (`TTAWrapper`): the wrapper to adapt (a :class:`~hf_tta.routing.RoutedTTAWrapper` for tenants); only the
            retriever changes it from now on.
        gallery (`GalleryCache`, `torch.Tensor`, `LiveGallery` or `GalleryBackend`): what queries are searched in (a
            top-k backend answers at most its ``k`` items per query).
        batch_size (`int`): adapt when this many queries are buffered. Micro-batches of 1-8 answer sooner but their
            batch statistics (TCR's terms, the entropy thresholds, the safety signals) would be over those few queries:
            build the wrapper with ``TTAConfig(window=64 - batch_size)`` (:mod:`hf_tta.window`) so each micro-batch's
            statistics also cover the recent queries (gradients only through the buffered ones); the window is part of
            the adapted state, so it is published, checkpointed and kept per tenant with the rest.
        max_wait (`float`): or when the oldest buffered query has waited this many seconds (background mode).
        mode (`str`): ``"background"`` (a worker thread adapts) or ``"sync"`` (adapt inline; deterministic).
        adapt (`bool`): ``False`` answers only (the same answer path, nothing buffered): the non-adapting baseline.
        worker_nice (`int`): raise the adapting thread's nice value by this much (Linux; its OpenMP threads, created
            by it, inherit it), so that on a busy CPU answers are scheduled before backward passes. 0: leave it.
        on_publish (`callable`, *optional*): called with each new :class:`Published` state (in the adapting thread).
    """

    def __init__(
        self,
        wrapper: TTAWrapper,
        gallery: GalleryCache | torch.Tensor | LiveGallery | GalleryBackend,
        batch_size: int = 64,
        max_wait: float = 0.05,
        mode: str = "background",
        on_publish: Callable[[Published], None] | None = None,
        adapt: bool = True,
        worker_nice: int = 0,
    ):
        if not isinstance(wrapper, TTAWrapper):
            raise TypeError(f"OnlineRetriever needs a TTAWrapper, got {type(wrapper).__name__}.")
        if not isinstance(gallery, (GalleryCache, torch.Tensor, LiveGallery, GalleryBackend)):
            raise TypeError(
                f"OnlineRetriever searches a GalleryCache, an embedding tensor, a LiveGallery or a top-k GalleryBackend, "
                f"not {type(gallery).__name__}: for a changing gallery wrap its embeddings in hf_tta.gallery.LiveGallery."
            )
        if mode not in MODES:
            raise ValueError(f"mode={mode!r}: choose one of {MODES}.")
        if isinstance(gallery, ShardedGallery) and mode != "sync":
            raise ValueError("A ShardedGallery's searches are collectives that every process must issue in one order, which "
                             "concurrent answers and an adapting thread cannot keep: use mode='sync', the same searches on every process.")
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size={batch_size!r}: pass a positive integer.")
        if not max_wait > 0:
            raise ValueError(f"max_wait={max_wait!r}: pass a positive number of seconds.")
        if adapt and batch_size < 8 and not wrapper.config.window:
            logger.info("OnlineRetriever adapts on micro-batches of %d without a window: set TTAConfig(window=%d) for "
                        "full-batch statistics (hf_tta.window).", batch_size, 64 - batch_size)
        self.wrapper, self.gallery = wrapper, gallery
        self.batch_size, self.max_wait, self.mode = batch_size, float(max_wait), mode
        self.routed = isinstance(wrapper, RoutedTTAWrapper)
        self.on_publish, self.adapt, self.worker_nice = on_publish, bool(adapt), int(worker_nice)
        self._cond = threading.Condition()  # guards the buffer and the counters
        self._buffer: list[tuple[dict[str, torch.Tensor], list | None, float]] = []
        self._buffered = 0
        self._tenants: bool | None = None  # whether queries carry tenant keys (fixed by the first search)
        self._adapt_lock = threading.Lock()  # one adapt_step or checkpoint at a time
        self._stop = False
        self._adapting = False  # a batch is taken and being adapted on (stats())
        self.error: BaseException | None = None
        self.batches_adapted = self.queries_adapted = self.queries_answered = 0
        self.last_action: str | None = None
        self.last_skipped: list[str] = []
        self._readers = None if self.routed else ReaderPool(wrapper)  # (made before anything adapts the wrapper)
        self._published = self._publish(0)
        self._worker: threading.Thread | None = None
        if mode == "background" and self.adapt:
            self._worker = threading.Thread(target=self._run, name="hf_tta-online-adapt", daemon=True)
            self._worker.start()

    # ------------------------------------------------------------------------------------------ answering
    @property
    def published(self) -> Published:
        """The state answers use now."""
        return self._published

    def search(self, queries: Mapping[str, torch.Tensor], k: int = 10, tenant: Any = None) -> SearchResult:
        """Answer ``queries`` (a processor's output for one or a few queries) with the current model, then buffer them
        for adaptation. ``tenant``: a domain key for all of them, or one per query (a routed wrapper's ``domain``)."""
        if self._stop:  # closed: nothing would adapt on what it buffers
            raise ValueError("This OnlineRetriever is closed: build a new OnlineRetriever(wrapper, gallery, ...) to go on.")
        self._raise_worker_error()
        if not isinstance(k, int) or k < 1:
            raise ValueError(f"k={k!r}: pass a positive integer.")
        backend = self.gallery if isinstance(self.gallery, GalleryBackend) else None
        if backend is not None and k > backend.k:
            raise ValueError(f"k={k} is more than {type(backend).__name__}'s k={backend.k} (the items it searches per query): "
                             f"build the backend with k >= {k}.")
        queries, n = self._check_queries(queries)
        tenants = self._check_tenants(tenant, n)
        state = self._published  # one read: the whole answer uses this state
        snap = self.gallery.snapshot() if isinstance(self.gallery, LiveGallery) else None
        kwargs = {"domain": tenants} if self.routed else {}
        with self.reading(state) as reader:
            if backend is not None:
                with backend.reading():  # one version for the search, its ids and its number
                    top = reader.answer(queries, backend, **kwargs).topk
                    values, ids, gallery_version = top.values[:, :k], backend.to_ids(top.indices[:, :k]), backend.version
            else:
                scores = reader.answer(queries, snap.cache if snap is not None else self.gallery, **kwargs).scores
        if backend is not None:
            result = SearchResult(values, ids, None, state.version, gallery_version)
        elif snap is not None:
            result = SearchResult(*snap.topk_ids(scores, k), scores, state.version, snap.version)
        else:
            result = SearchResult(*scores.topk(min(k, scores.shape[-1]), dim=-1), scores, state.version, None)
        with self._cond:
            self.queries_answered += n
            if self._tenants is None:  # fixed by the first answered search
                self._tenants = tenants is not None
            if not self.adapt:
                return result
            self._buffer.append((queries, tenants, time.monotonic()))
            self._buffered += n
            self._cond.notify()
        if self.mode == "sync":
            while self._adapt_next(full=True):
                pass
        return result

    @contextlib.contextmanager
    def reading(self, published: Published | None = None) -> Any:
        """A wrapper that answers with ``published`` (default: the current state) for the ``with`` block: a reader of
        :mod:`hf_tta.readers` (a routed wrapper's published copy, under its lock). Nothing writes it meanwhile."""
        published = self._published if published is None else published
        if published.wrapper is not None:
            with published.lock:
                yield published.wrapper
        else:
            with self._readers.reading(published.state) as reader:
                yield reader

    def _check_queries(self, queries: Mapping[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], int]:
        if not isinstance(queries, Mapping) or not queries or not all(torch.is_tensor(v) for v in queries.values()):
            raise TypeError("search takes the processor's output: a non-empty dict of tensors (e.g. {'pixel_values': ...}).")
        queries = {key: v.detach() for key, v in queries.items()}
        sizes = {v.shape[0] if v.dim() else -1 for v in queries.values()}
        if len(sizes) != 1 or min(sizes) < 1:
            raise ValueError(f"Every query tensor needs the same leading batch size >= 1, got {sorted(sizes)}.")
        with self._cond:
            first = self._buffer[0][0] if self._buffer else None
        if first is not None:  # buffered queries are concatenated into one batch
            theirs = {key: tuple(v.shape[1:]) for key, v in first.items()}
            ours = {key: tuple(v.shape[1:]) for key, v in queries.items()}
            if theirs != ours:
                raise ValueError(
                    f"These queries have shapes {ours}, the buffered ones {theirs}: batched queries must share them "
                    "(tokenize text with padding='max_length')."
                )
        return queries, sizes.pop()

    def _check_tenants(self, tenant: Any, n: int) -> list | None:
        if tenant is not None and not self.routed:
            raise ValueError("tenant keys need per-domain adapters: wrap the model in hf_tta.routing.RoutedTTAWrapper.")
        if tenant is None:
            keys = None
        elif isinstance(tenant, (str, int)):
            keys = [tenant] * n
        else:
            keys = list(tenant)
            if len(keys) != n or not all(isinstance(t, (str, int)) for t in keys):
                raise ValueError(f"tenant: pass one str/int key, or one per query ({n}), got {tenant!r}.")
        if self._tenants is not None and self._tenants != (keys is not None):
            raise ValueError("Every search of one retriever passes a tenant, or none does (the router decides).")
        return keys

    # ------------------------------------------------------------------------------------------ adapting
    def _take(self, n: int) -> tuple[dict[str, torch.Tensor], list | None]:
        """Pop the ``n`` oldest buffered queries as one batch (splitting a search call's queries if needed)."""
        parts, keys, need = [], [], n
        with self._cond:
            while need:
                queries, tenants, t0 = self._buffer[0]
                m = next(iter(queries.values())).shape[0]
                if m <= need:
                    self._buffer.pop(0)
                    parts.append(queries)
                    keys += tenants or []
                    need -= m
                else:
                    parts.append({key: v[:need] for key, v in queries.items()})
                    self._buffer[0] = ({key: v[need:] for key, v in queries.items()}, tenants and tenants[need:], t0)
                    keys += (tenants or [])[:need]
                    need = 0
            self._buffered -= n
        batch = {key: torch.cat([p[key] for p in parts]) for key in parts[0]}
        return batch, (keys or None)

    def _adapt_next(self, full: bool) -> bool:
        """Adapt on the next ``batch_size`` buffered queries (``full=False``: or on fewer, all there are); returns
        whether a batch was adapted."""
        with self._adapt_lock:
            with self._cond:
                self._adapting = True
                n = self.batch_size if self._buffered >= self.batch_size else (0 if full else self._buffered)
            if not n:
                self._adapting = False
                return False
            try:
                queries, keys = self._take(n)
                out = self._adapt_batch(queries, keys)
                published = self._publish(self._published.version + 1)
                with self._cond:  # the counters and the state they describe change together (stats())
                    self._published = published
                    self.batches_adapted += 1
                    self.queries_adapted += n
                    self.last_action = getattr(out, "safety_action", None)
                    self.last_skipped = list(out.skipped or [])
            finally:
                self._adapting = False
        if self.on_publish is not None:
            self.on_publish(published)
        return True

    def _adapt_batch(self, queries: dict[str, torch.Tensor], keys: list | None) -> Any:
        gallery = self.gallery.snapshot().cache if isinstance(self.gallery, LiveGallery) else self.gallery
        kwargs: dict[str, Any] = {"domain": keys} if self.routed else {}
        if self.wrapper.score_transform is not None:  # its state advances on the view that answers before the update
            kwargs["scoring"] = "before_update"
        return self.wrapper.adapt_step(queries, gallery, **kwargs)

    def _publish(self, version: int) -> Published:
        counts = dict(self.wrapper.safety_counts)
        if self.routed:  # the domains' states and the router are not served parts: a reader built with all of them answers
            reader = frozen_copy(self.wrapper)
            return Published(version, None, state_fingerprint(reader), counts, reader, threading.Lock())
        state = ReaderPool.capture(self.wrapper)
        return Published(version, state, captured_fingerprint(state), counts)

    def _run(self) -> None:
        if self.worker_nice:
            try:  # per thread on Linux: the native thread id is a "process" for setpriority
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), os.getpriority(os.PRIO_PROCESS, 0) + self.worker_nice)
                logger.info("Adapting thread runs at nice +%d.", self.worker_nice)
            except (AttributeError, OSError) as err:
                logger.warning("Could not lower the adapting thread's priority (%s); it runs at the process's.", err)
        while True:
            with self._cond:
                while not self._stop:
                    if self._buffered >= self.batch_size:
                        break
                    if self._buffered:
                        left = self._buffer[0][2] + self.max_wait - time.monotonic()
                        if left <= 0:
                            break
                        self._cond.wait(left)
                    else:
                        self._cond.wait()
                if self._stop:
                    return
            try:
                self._adapt_next(full=False)
            except BaseException as exc:  # noqa: BLE001 - reported to the next caller, never swallowed
                logger.exception("OnlineRetriever: adapting a batch failed; searches will raise until close()")
                self.error = exc
                return

    def _raise_worker_error(self) -> None:
        if self.error is not None:
            raise RuntimeError(f"The adapting worker failed: {self.error!r} (see the log); create a new OnlineRetriever.") from self.error

    def flush(self) -> int:
        """Adapt on every buffered query now (batches of ``batch_size``, then the rest); returns the batches adapted."""
        self._raise_worker_error()
        done = 0
        while self._adapt_next(full=False):
            done += 1
        return done

    # ------------------------------------------------------------------------------------------ state
    def checkpoint(self, directory) -> int:
        """Write the adapted state with the wrapper's ``save_pretrained`` (atomic), between two adapted batches.
        Returns the number of buffered queries that are not in it (logged when any)."""
        with self._adapt_lock:
            self.wrapper.save_pretrained(directory)
            pending = self._buffered
        if pending:
            logger.info("Checkpoint %s written; %d buffered queries not yet adapted are not in it.", directory, pending)
        return pending

    def stats(self) -> dict[str, Any]:
        """Counters for a health endpoint: batches and queries adapted, answered and pending, the safety counts and last
        action of the published state, its version and fingerprint."""
        with self._cond:
            state = self._published
            out = {
                "mode": self.mode, "adapt": self.adapt, "batch_size": self.batch_size, "batches_adapted": self.batches_adapted,
                "queries_adapted": self.queries_adapted, "queries_answered": self.queries_answered,
                "pending": self._buffered, "adapting": self._adapting,
            }
        return {
            **out, "version": state.version, "fingerprint": state.fingerprint,
            "safety_counts": state.safety_counts, "last_action": self.last_action,
            "last_skipped": self.last_skipped, "worker_error": None if self.error is None else repr(self.error),
        }

    def close(self, flush: bool = False) -> None:
        """Stop the worker (after the batch it is adapting); with ``flush`` adapt what is buffered first."""
        if flush:
            self.flush()
        with self._cond:
            self._stop = True
            pending = self._buffered
            self._cond.notify_all()
        if self._worker is not None:
            self._worker.join()
        if pending and not flush:
            logger.info("OnlineRetriever closed with %d buffered queries not adapted on.", pending)

    def __enter__(self) -> OnlineRetriever:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


__all__: Sequence[str] = ["OnlineRetriever", "Published", "SearchResult", "captured_fingerprint", "frozen_copy", "state_fingerprint"]
