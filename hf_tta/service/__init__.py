"""A deployable retrieval service that adapts while it serves (see ``model_cards/serving.md``).

One module per idea: :mod:`~hf_tta.service.channel` (the lock-free shared-memory state channel),
:mod:`~hf_tta.service.redis_channel` (the same over Redis), :mod:`~hf_tta.service.codec` (the published state as
bytes), :mod:`~hf_tta.service.tenants` (per-tenant states in the adapting process), :mod:`~hf_tta.service.worker` (the
adapting process), :mod:`~hf_tta.service.batcher` (the bounded adaptation queue), :mod:`~hf_tta.service.supervisor`
(starting, feeding and restarting the worker), :mod:`~hf_tta.service.answerer` (the answering side),
:mod:`~hf_tta.service.limits` (input limits), :mod:`~hf_tta.service.auth` (bearer token),
:mod:`~hf_tta.service.metrics` (Prometheus), :mod:`~hf_tta.service.service` and :mod:`~hf_tta.service.app` (HTTP).
Nothing here is imported by ``import hf_tta``: the service's dependencies are the ``serve`` extra.
"""
