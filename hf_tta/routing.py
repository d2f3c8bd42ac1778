"""Per-domain adapters: one LN-tuning state per query domain, chosen by a user key or by an unsupervised router.

A mixed stream (several shifts interleaved, or several tenants behind one index) is not averaged into one set of
LayerNorms: :class:`RoutedTTAWrapper` keeps, per domain, the adapted parameter values, the optimiser state, the
objective's and score transform's state, the RNG and the batch counter, and swaps them into the model before it adapts
on that domain's queries, so that each domain evolves exactly as a :class:`~hf_tta.TTAWrapper` that saw only its own
queries. Each batch is split by domain: a key the user passes (``adapt_step(queries, gallery, domain=...)``), or else
:class:`~hf_tta.router.DomainRouter` (:mod:`hf_tta.router`), an online clustering of cheap label-free statistics of
the query computed by the *source* model (:meth:`RoutedTTAWrapper.router_features`): the style statistics of the
input of the query tower's first normalisation layer, or the source embedding. A new domain starts from the source
model. :class:`~hf_tta.router.RoutingConfig`, :class:`~hf_tta.router.DomainRouter` and
:func:`~hf_tta.router.style_statistics` are importable from here too.

The safety layer (``TTAConfig.safety``, :mod:`hf_tta.safety`) composes: each domain has its own monitor (last-good
snapshot, agreement EMA, streaks, counts), swapped with the rest of its state, and judges that domain's sub-batch on
its own queries; a rollback or reset restores that domain only, and a flagged sub-batch's rows get the source model's
scores.

Build one with :func:`make_wrapper` (``routing=None`` gives a plain ``TTAWrapper``), which is how the benchmark
runner can construct rows with per-domain adapters.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import torch
from torch import nn

from . import checkpoint
from .answering import answer_with
from .batch import Batch, batch_size, pinned
from .config import SCORING, TTAConfig
from .configuration_utils import check_choice
from .gallery.base import GalleryBackend
from .gallery.cache import GalleryCache
from .models.base import ModelAdapter
from .outputs import TTAOutput
from .routed_output import RoutedTTAOutput, assemble
from .router import (  # noqa: F401
    ROUTER_PREFIX,
    DomainKey,
    DomainRouter,
    QueryFeatures,
    RoutingConfig,
    parse_domain_keys,
    style_statistics,
)
from .safety import SAFETY_ACTIONS, NullSafetyMonitor, SafetyMonitor
from .slots import SlotBank
from .state import ALL, AdapterState
from .wrapper import TTAWrapper


def _as_routing_config(routing: RoutingConfig | Mapping[str, Any] | None) -> RoutingConfig:
    if routing is None:
        return RoutingConfig()
    if isinstance(routing, RoutingConfig):
        return routing
    if isinstance(routing, Mapping):
        return RoutingConfig.from_dict(dict(routing))
    raise TypeError(f"`routing` must be a RoutingConfig, a dict of its fields or None, got {type(routing).__name__}.")


# ---------------------------------------------------------------------------------------------------- wrapper
class RoutedTTAWrapper(TTAWrapper):
    """A :class:`~hf_tta.TTAWrapper` with one adapted state per query domain (see :mod:`hf_tta.routing`).

    A subclass rather than a holder of several wrappers: the model, its PEFT LN-tuning copies, the gallery checks, the
    objective and the adapt loop are shared; only the per-domain state (adapted parameter values, AdamW moments and
    steps, objective and score-transform state, RNG, batch counter, safety monitor) is swapped into the one model around
    each domain's sub-batch, by exact copies, so a domain's results are bit-identical to a wrapper that saw only its
    queries. With ``TTAConfig.safety`` each domain's monitor judges its sub-batch (of at least ``min_queries`` queries)
    and rolls back or resets that domain only; :attr:`safety_counts` sums the domains' counts and
    :attr:`domain_safety_counts` gives them per domain.

    Args:
        model: as for :class:`~hf_tta.TTAWrapper`.
        config (`TTAConfig`, *optional*): the adaptation, the same for every domain.
        routing (`RoutingConfig` or `dict`, *optional*): domains cap, router features and threshold.

    Example:
        >>> tta = RoutedTTAWrapper(model, TTAConfig(query_modality="image"), RoutingConfig(max_domains=4))  # doctest: +SKIP
        >>> out = tta.adapt_step({"pixel_values": pixels}, gallery)  # doctest: +SKIP
        >>> [tta.domain_keys[i] for i in out.domains.tolist()]  # doctest: +SKIP
    """

    runs_lr_search = False  # TTAConfig.lr_search probes one stream in one process

    def __init__(
        self,
        model: nn.Module | ModelAdapter,
        config: TTAConfig | None = None,
        routing: RoutingConfig | Mapping[str, Any] | None = None,
    ):
        super().__init__(model, config)
        self.routing = _as_routing_config(routing)
        self.router = DomainRouter(self.routing)
        #: the domains' states and monitors over the one model (hf_tta.slots; its active key is the loaded domain)
        self.bank = SlotBank(self, ALL, reuse_buffers=True)
        self._slots: dict[DomainKey, int] = {}  # key -> domain id (the bank's order)
        self._router_slots: list[int] = []  # router domain k -> domain id
        self._features = QueryFeatures(self.adapter, self.query_modality, self.routing.features)

    # ------------------------------------------------------------------------------------------ domains
    @property
    def domain_keys(self) -> list[DomainKey]:
        """The domains' keys, by domain id (creation order)."""
        return self.bank.keys

    @property
    def num_domains(self) -> int:
        return len(self.bank)

    def _new_domain(self, key: DomainKey) -> int:
        self.bank.add(key)
        self._slots[key] = len(self.bank) - 1
        return self._slots[key]

    def _activate(self, slot: int) -> None:
        """Put domain ``slot``'s state into the model (:meth:`hf_tta.slots.SlotBank.set_active`)."""
        self.bank.set_active(self.bank.keys[slot])

    def domain_parameters(self, key: DomainKey) -> dict[str, torch.Tensor]:
        """Copies of domain ``key``'s adapted parameter values, by name."""
        if key not in self._slots:
            raise ValueError(f"No domain {key!r}: the domains are {self.domain_keys}.")
        return {n: t for n, t in self.domain_state(key).params.items() if n in self.params}

    def domain_state(self, key: DomainKey) -> AdapterState:
        """An exact copy of domain ``key``'s :data:`~hf_tta.state.ALL` state (reading it changes nothing)."""
        if key not in self._slots:
            raise ValueError(f"No domain {key!r}: the domains are {self.domain_keys}.")
        return self.bank.state(key)

    def domain_monitor(self, key: DomainKey) -> SafetyMonitor | NullSafetyMonitor:
        """Domain ``key``'s safety monitor (a :class:`~hf_tta.safety.NullSafetyMonitor` when the safety layer is off)."""
        if key not in self._slots:
            raise ValueError(f"No domain {key!r}: the domains are {self.domain_keys}.")
        return self.bank.slot(key).safety

    @property
    def safety_counts(self) -> dict[str, int]:
        """How often the safety layer skipped, rolled back and reset since the last :meth:`reset`, summed over the
        domains (empty when off); :attr:`domain_safety_counts` has them per domain."""
        if not self.safety.active:
            return {}
        monitors = [self.bank.slot(key).safety for key in self.bank.keys]
        return {a: sum(m.counts[a] for m in monitors) for a in SAFETY_ACTIONS}

    @property
    def domain_safety_counts(self) -> dict[DomainKey, dict[str, int]]:
        """Each domain's safety counts, by key (empty when the safety layer is off)."""
        return {key: dict(m.counts) for key in self.bank.keys if (m := self.bank.slot(key).safety).active}

    @staticmethod
    def _per_domain(groups: torch.Tensor, batch: Batch, run: Callable[[int, Batch], Any]) -> list[tuple[int, torch.Tensor, Any]]:
        """The one per-domain loop: for each group present (in id order) its rows of ``batch`` (labels included) and
        ``run(group, sub_batch)``'s result."""
        outputs = []
        for group in torch.unique(groups).tolist():
            idx = (groups == group).nonzero().flatten()
            whole = idx.numel() == batch.size
            queries = batch.queries if whole else {k: v.index_select(0, idx.to(v.device)) for k, v in batch.queries.items()}
            labels = batch.labels if whole or batch.labels is None else batch.labels.index_select(0, idx.to(batch.labels.device))
            outputs.append((group, idx, run(group, Batch(queries, batch.gallery, labels, idx.numel()))))
        return outputs

    # ------------------------------------------------------------------------------------------ routing
    def _user_slots(self, domain: Any, n: int, create: bool) -> torch.Tensor:
        """Per-query domain ids ``(n,)`` for user keys (one for the batch, or one per query); ``-1`` = unknown key
        when ``create`` is false. Every key is checked before any domain is created: a refused call changes nothing."""
        keys, inverse = parse_domain_keys(domain, n)
        new = [key for key in keys if key not in self._slots]
        if create and self.num_domains + len(new) > self.routing.max_domains:
            raise ValueError(
                f"{self.num_domains} domains exist and this batch adds {len(new)} ({new[0]!r}, ...) "
                f"(RoutingConfig.max_domains={self.routing.max_domains}): raise max_domains."
            )
        slots = [self._slots[key] if key in self._slots else self._new_domain(key) if create else -1 for key in keys]
        return torch.tensor(slots, dtype=torch.long)[inverse]

    @torch.no_grad()
    def router_features(self, queries: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """The router's ``(B, F)`` features of checked query inputs, computed by the source model (float64, CPU)."""
        with self.disabled():
            return self._features(queries)

    def _route(self, queries: dict, domain: Any, update: bool) -> tuple[torch.Tensor, list[DomainKey]]:
        """Per-query domain ids (``-1``: no domain, only when not ``update``) and the keys of the domains opened."""
        n = batch_size(queries)
        if domain is not None:
            before = self.num_domains
            slots = self._user_slots(domain, n, create=update)
            return slots, self.domain_keys[before:]
        feats = self.router_features(queries)
        capacity = self.routing.max_domains - self.num_domains
        if update and self.router.num_domains == 0 and capacity <= 0:
            raise ValueError(
                f"User keys hold all {self.routing.max_domains} domains (RoutingConfig.max_domains): raise it or pass "
                "domain=... for these queries."
            )
        assign, opened = self.router.route(feats, capacity=capacity, update=update)
        new_keys = []
        for k in range(self.router.num_domains - opened, self.router.num_domains):
            new_keys.append(f"{ROUTER_PREFIX}{k}")
            self._router_slots.append(self._new_domain(new_keys[-1]))
        table = torch.tensor(self._router_slots + [-1], dtype=torch.long)  # -1 (no domain) indexes the last entry
        return table[assign], new_keys

    def assign_domains(self, queries: Mapping[str, torch.Tensor], domain: Any = None) -> torch.Tensor:
        """The domain id each query would go to now, without opening a domain or updating the router (``-1``: none
        yet, scored by the source model)."""
        queries = self.forward.check_inputs(queries, self.query_modality)
        return self._route(queries, domain, update=False)[0]

    # ------------------------------------------------------------------------------------------ the online step
    def adapt_step(
        self,
        queries: Mapping[str, torch.Tensor],
        gallery: GalleryCache | GalleryBackend | torch.Tensor,
        labels: Any = None,
        domain: Any = None,
        scoring: str | None = None,
    ) -> RoutedTTAOutput:
        """Adapt each domain on its queries of this batch and return their scores in the original order.

        ``domain``: a str/int key for the whole batch, a sequence (or 1-D integer tensor) of one key per query, or
        ``None`` to let the router decide per query. Each domain's sub-batch runs :meth:`TTAWrapper.adapt_step` with
        that domain's state in the model; a new domain starts from the source model. A live top-k backend stays at one
        version for the whole batch; the domains' position-keyed objective state is not remapped when it changes (the
        objectives see another gallery fingerprint and start their state again). ``scoring``: as for
        :meth:`TTAWrapper.adapt_step`.
        """
        check_choice("scoring", scoring, SCORING, allow_none=True)
        with pinned(gallery, self.forward.gallery_versions, []):
            return self._routed_step(queries, gallery, labels, domain, scoring)

    def _routed_step(
        self, queries: Mapping[str, torch.Tensor], gallery: Any, labels: Any, domain: Any, scoring: str | None = None
    ) -> RoutedTTAOutput:
        batch = self.prepare_batch(queries, gallery, labels)
        slots, new_keys = self._route(batch.queries, domain, update=True)

        def run(slot: int, sub: Batch) -> TTAOutput:  # the domain's state in the model, then one TTAWrapper step
            self._activate(slot)
            if self.objective.requires_grad and sub.size < self.routing.min_domain_batch:
                return self._score_frozen(sub)
            return self.step_batch(sub.queries, sub.gallery, sub.labels, scoring)

        keys = self.domain_keys
        outputs = [(keys[s], idx, out) for s, idx, out in self._per_domain(slots, batch, run)]
        return assemble(outputs, slots, batch.size, self.domain_keys, new_keys, self.safety.active)

    def _score_frozen(self, batch: Batch) -> TTAOutput:
        """A sub-batch below ``min_domain_batch``: the domain's current model scores it, nothing is updated (the score
        transform, if any, still sees it)."""
        with torch.no_grad():
            inputs = self.forward.inputs(Batch(batch.queries, batch.gallery, None, batch.size), step=0)
            out = self.forward.scored(batch, inputs, inputs.scores.detach())
        out.skipped = [f"{batch.size} queries < min_domain_batch={self.routing.min_domain_batch}: scored, not adapted"]
        return out

    @torch.no_grad()
    def answer(
        self, queries: Mapping[str, torch.Tensor], gallery: GalleryCache | GalleryBackend | torch.Tensor, domain: Any = None
    ) -> RoutedTTAOutput:
        """:meth:`TTAWrapper.answer` per domain: what :meth:`adapt_step` with ``scoring="before_update"`` answers, each
        query routed as :meth:`assign_domains` (``domains`` -1: a key with no domain yet, or the router's queries with
        none, answered as a new domain from the source state). A read: no domain's state changes and the loaded domain
        stays loaded (another domain's parameters are in the model only during its rows' forward)."""
        with pinned(gallery, dict(self.forward.gallery_versions), [], warn=False):
            batch = self.forward.answer_batch(queries, gallery)
            slots = self._route(batch.queries, domain, update=False)[0]
            keys, groups = parse_domain_keys(domain, batch.size) if domain is not None else (None, slots)
            firsts: dict[int, int] = {}

            def run(group: int, sub: Batch) -> TTAOutput:
                slot = firsts[group] = int(slots[(groups == group).nonzero()[0, 0]])
                small = self.objective.requires_grad and sub.size < self.routing.min_domain_batch  # _score_frozen's view
                with self.bank.computing_as(self.domain_keys[slot] if slot >= 0 else None) as state:
                    return answer_with(self.forward.reading(state), sub, step=0 if small else None)

            outputs = [(self.domain_keys[firsts[g]] if firsts[g] >= 0 else keys[g] if keys else "(new)", idx, out)
                       for g, idx, out in self._per_domain(groups, batch, run)]
            return assemble(outputs, slots, batch.size, self.domain_keys, [], self.safety.active)

    @torch.no_grad()
    def embed_and_score(
        self, queries: Mapping[str, torch.Tensor], gallery: GalleryCache | torch.Tensor, domain: Any = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Score a batch without adapting, each query with its domain's current model (routed as
        :meth:`assign_domains`; a query with no domain yet is scored by the source model); a read, as :meth:`answer`.
        Inside ``disabled()`` every query is scored by the source model."""
        gallery = self.forward.check_gallery(gallery)
        if isinstance(gallery, GalleryBackend):
            raise TypeError(f"embed_and_score needs the dense GalleryCache; for {type(gallery).__name__} use answer(...).")
        batch = self.forward.answer_batch(self.forward.check_inputs(queries, self.query_modality), gallery)
        slots = self._route(batch.queries, domain, update=False)[0]

        def run(slot: int, sub: Batch) -> tuple[torch.Tensor, torch.Tensor]:
            with self.disabled() if slot < 0 else self.bank.computing_as(self.domain_keys[slot]):
                return self.forward.embed_and_score(sub.queries, gallery)

        parts = self._per_domain(slots, batch, run)
        q0, s0 = parts[0][2]
        emb, scores = q0.new_empty(batch.size, *q0.shape[1:]), s0.new_empty(batch.size, *s0.shape[1:])
        for _, idx, (q, s) in parts:
            emb.index_copy_(0, idx.to(emb.device), q)
            scores.index_copy_(0, idx.to(scores.device), s)
        return emb, scores

    # ------------------------------------------------------------------------------------------ state
    def reset(self) -> None:
        """Drop every domain and the router's statistics and return exactly to the source model. (``reset_policy=
        "episodic"`` restores the loaded domain only: :meth:`~hf_tta.TTAWrapper.restore_source`.)"""
        self.bank.clear()  # the dropped domains keep their monitors; the wrapper gets a fresh one
        super().reset()
        self._slots, self._router_slots = {}, []
        self.router.reset()

    def checkpoint_payload(self) -> tuple[dict[str, Any], dict[str, torch.Tensor], dict[str, Any]]:
        """Every domain's :data:`~hf_tta.state.ALL` state and safety monitor under ``domain.<id>.`` (one wrapper's
        layout each) and the router's statistics (``router.*``); the routing config goes in ``tta_config.json`` under
        ``"routing"``."""
        self.bank.store()
        tensors: dict[str, torch.Tensor] = {}
        optimizers, safety = [], []
        for i, key in enumerate(self.bank.keys):
            d = self.bank.slot(key)
            part, part_meta = (d.state or self.source_state).to_tensors(f"domain.{i}.")
            tensors.update(part)
            optimizers.append(part_meta.get("optimizer"))
            safety_tensors, safety_meta = d.safety.state_tensors(f"domain.{i}.safety.")
            tensors.update(safety_tensors)
            safety.append(safety_meta)
        tensors.update({f"router.{k}": v for k, v in self.router.state_tensors().items()})
        meta: dict[str, Any] = {
            "param_names": None,  # a plain TTAWrapper refuses this checkpoint ("adapts other parameters")
            "routed": {
                "param_names": list(self.params),
                "keys": self.domain_keys,
                "router_slots": self._router_slots,
                "optimizers": optimizers,
                "safety": safety if self.safety.active else None,
                "routing": self.routing.to_dict(),
            },
        }
        config = self.config.checkpoint_dict(lr=self.lr, gallery_modality=self.gallery_modality)
        return {**config, "routing": self.routing.to_dict()}, tensors, meta

    def load_checkpoint(self, ckpt: checkpoint.Checkpoint) -> None:
        routed = ckpt.metadata.get("routed")
        if routed is None:
            raise ValueError("This checkpoint holds one adapter (saved by TTAWrapper): load it with TTAWrapper, not RoutedTTAWrapper.")
        self.check_checkpoint(ckpt, routed["param_names"])
        saved = RoutingConfig.from_dict(routed["routing"])
        if saved != self.routing:
            raise ValueError(f"The checkpoint was routed with {saved}, this wrapper with {self.routing}: build it with the checkpoint's routing.")
        keys = routed["keys"]
        missing = [key for i, key in enumerate(keys) if f"domain.{i}.wrapper.rng_state" not in ckpt.tensors]
        if missing:
            raise ValueError(f"The checkpoint lacks the state of domain(s) {missing[:3]}: it is incomplete.")
        tensors = {k: v.to(self.device) for k, v in ckpt.tensors.items()}
        names, on_cpu = [n for n, _ in self.named_optimized_parameters()], self.step_on_cpu()
        states = [
            AdapterState.from_tensors(tensors, {"optimizer": routed["optimizers"][i]}, ALL, names, f"domain.{i}.", step_on_cpu=on_cpu)
            for i in range(len(keys))
        ]
        # validated: now replace everything
        self.reset()
        for i, (key, state) in enumerate(zip(keys, states)):
            self._new_domain(key)
            self.bank.put(key, state)
            d = self.bank.slot(key)
            if routed.get("safety"):  # saved without the safety layer: fresh monitors
                d.safety.load_state_tensors(tensors, routed["safety"][i], names, on_cpu, prefix=f"domain.{i}.safety.")
        self._router_slots = list(routed["router_slots"])
        self.router.load_state_tensors({k[len("router.") :]: v for k, v in ckpt.tensors.items() if k.startswith("router.")})

    @classmethod
    def _init_kwargs(cls, config: dict[str, Any]) -> dict[str, Any]:
        routing = config.pop("routing", None)
        if routing is None:
            raise ValueError("This checkpoint holds one adapter (saved by TTAWrapper): load it with TTAWrapper.from_pretrained.")
        return {"config": TTAConfig.from_dict(config), "routing": RoutingConfig.from_dict(routing)}

    def merge_and_unload(self, domain: DomainKey | None = None) -> nn.Module:
        """The model with domain ``domain``'s adapted parameters merged in (``domain`` may be left out with one domain)."""
        if domain is None:
            if self.num_domains > 1:
                raise ValueError(f"Several domains are adapted ({self.domain_keys}): pass merge_and_unload(domain=...).")
            if self.num_domains == 1:
                self._activate(0)
        elif domain not in self._slots:
            raise ValueError(f"No domain {domain!r}: the domains are {self.domain_keys}.")
        else:
            self._activate(self._slots[domain])
        return super().merge_and_unload()

    def __repr__(self) -> str:
        return (
            f"RoutedTTAWrapper({self.adapter.describe()}, objective={self.config.objective!r}, "
            f"{self.query_modality}->{self.gallery_modality}, domains={self.domain_keys}, features={self.routing.features!r})"
        )


def make_wrapper(
    model: nn.Module | ModelAdapter,
    tta_config: TTAConfig | None = None,
    routing: RoutingConfig | Mapping[str, Any] | None = None,
) -> TTAWrapper:
    """A :class:`RoutedTTAWrapper` when ``routing`` is given (a config or a dict of its fields), else a plain
    :class:`~hf_tta.TTAWrapper`: the one constructor a benchmark row needs for either."""
    if routing is None:
        return TTAWrapper(model, tta_config)
    return RoutedTTAWrapper(model, tta_config, routing=routing)
