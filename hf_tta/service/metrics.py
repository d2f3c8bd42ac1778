"""The service's Prometheus metrics (``prometheus-client``: the standard exposition format, one registry per app so
that several apps in one process, e.g. tests, do not collide). Gauges that describe the published state and the queue
are set when ``/metrics`` is scraped (:meth:`ServiceMetrics.collect_state`)."""

from __future__ import annotations

import time
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from .worker import SKIPPED

LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.035, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.0, 5.0, 10.0)


class ServiceMetrics:
    """Counters and histograms of one service (see :mod:`hf_tta.service.metrics`)."""

    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.requests = Counter("hf_tta_requests", "HTTP requests by endpoint and status", ["endpoint", "status"], registry=r)
        self.latency = Histogram("hf_tta_request_seconds", "Request latency by endpoint", ["endpoint"], buckets=LATENCY_BUCKETS, registry=r)
        self.answer_latency = Histogram("hf_tta_answer_seconds", "Search answer latency by tenant", ["tenant"], buckets=LATENCY_BUCKETS, registry=r)
        self.answered = Counter("hf_tta_queries_answered", "Queries answered by tenant", ["tenant"], registry=r)
        self.not_adapted = Counter("hf_tta_queries_not_adapted", "Queries answered but kept from adaptation, by reason", ["tenant", "reason"], registry=r)
        self.refused = Counter("hf_tta_inputs_refused", "Requests refused (4xx) by status", ["status"], registry=r)
        self.adapted_batches = Counter("hf_tta_adapted_batches", "Batches adapted on, by tenant", ["tenant"], registry=r)
        self.adapted_queries = Counter("hf_tta_adapted_queries", "Queries adapted on, by tenant", ["tenant"], registry=r)
        self.safety_actions = Counter("hf_tta_safety_actions", "Safety-layer actions on adapted batches", ["tenant", "action"], registry=r)
        self.batch_errors = Counter("hf_tta_batch_errors", "Batches the worker could not adapt on", ["tenant"], registry=r)
        self.dropped = Gauge("hf_tta_queue_dropped", "Queries dropped from adaptation (queue full), by tenant", ["tenant"], registry=r)
        self.queue_depth = Gauge("hf_tta_queue_depth", "Queries waiting for adaptation, by tenant", ["tenant"], registry=r)
        self.state_age = Gauge("hf_tta_state_age_seconds", "Age of the published state, by tenant", ["tenant"], registry=r)
        self.state_version = Gauge("hf_tta_state_version", "Published state version, by tenant", ["tenant"], registry=r)
        self.worker_up = Gauge("hf_tta_worker_up", "1 when the adapting worker is alive", registry=r)
        self.worker_restarts = Gauge("hf_tta_worker_restarts", "Times the adapting worker was restarted", registry=r)
        self.paused = Gauge("hf_tta_adaptation_paused", "1 while adaptation is paused", registry=r)
        self.yielding = Gauge("hf_tta_adaptation_yielding", "1 while adaptation holds its batches: the answer path is behind", registry=r)
        self.yields = Gauge("hf_tta_adaptation_yields", "Times adaptation began holding its batches for the answer path", registry=r)

    def on_done(self, tenant: str, n: int, action: str | None, error: str | None) -> None:
        """A batch came back from the worker (one skipped at stop was not adapted on: the supervisor counts it)."""
        if action == SKIPPED:
            return
        if error:
            self.batch_errors.labels(tenant).inc()
            return
        self.adapted_batches.labels(tenant).inc()
        self.adapted_queries.labels(tenant).inc(n)
        if action:
            self.safety_actions.labels(tenant, action).inc()

    def collect_state(self, service: Any) -> None:
        now = time.time()
        for tenant, current in service.answerer.states.items():
            self.state_age.labels(tenant).set(now - current.published)
            self.state_version.labels(tenant).set(current.version)
        for tenant, depth in service.queue.depth().items():
            self.queue_depth.labels(tenant).set(depth)
        for tenant, n in service.queue.dropped.items():
            self.dropped.labels(tenant).set(n)
        sup = service.supervisor
        self.worker_up.set(1 if sup is not None and sup.alive() else 0)
        self.worker_restarts.set(sup.restart_count if sup is not None else 0)
        self.paused.set(1 if sup is not None and sup.paused else 0)
        self.yielding.set(1 if sup is not None and sup.yielding() else 0)
        self.yields.set(sup.counters["yields"] if sup is not None else 0)

    def render(self) -> bytes:
        return generate_latest(self.registry)


__all__ = ["ServiceMetrics"]
