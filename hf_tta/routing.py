"""Per-domain adapters: one LN-tuning state per query domain, chosen by a user key or by an unsupervised router.

A mixed stream (several shifts interleaved, or several tenants behind one index) is not averaged into one set of
LayerNorms: :class:`RoutedTTAWrapper` keeps, per domain, the adapted parameter values, the optimiser state, the
objective's and score transform's state, the RNG and the batch counter, and swaps them into the model before it adapts
on that domain's queries, so that each domain evolves exactly as a :class:`~hf_tta.TTAWrapper` that saw only its own
queries. Each batch is split by domain: a key the user passes (``adapt_step(queries, gallery, domain=...)``), or else
:class:`DomainRouter`, an online clustering of cheap label-free statistics of the query computed by the *source* model:

* ``features="style"``: per query, the channel-wise mean and log std of the input of the query tower's first
  normalisation layer (tokens, patches or frames averaged; text padding masked by ``attention_mask``), i.e.
  instance-norm statistics as in AdaIN: they describe the corruption or style of the input more than its content (the
  log makes a corruption's multiplicative effect on the spread an additive shift). The source forward stops at that
  layer (a pre-hook ends it), so it costs about the tower's embedding layer;
* ``features="embedding"``: the source model's query embedding (one full no-grad forward of the query tower).

Each domain keeps a running mean and diagonal variance of the features; a query goes to the nearest domain by the
mean squared z-score over the features, and queries farther than ``new_domain_threshold`` from every domain open a
new domain (starting from the source model) when at least ``min_domain_batch`` of them in a batch fit together, up to
``max_domains``; otherwise they go to the nearest domain. The router has no randomness: the same stream in the same
order gives the same domains. How well it separates shifts depends on the model and the shifts: on the emoji
benchmark's source model, shifts that look alike after its 2.5x downsampling (Gaussian noise and clean, defocus blur
and snow) share a domain and contrast gets its own (see the README).

The safety layer (``TTAConfig.safety``, :mod:`hf_tta.safety`) composes: each domain has its own monitor (last-good
snapshot, agreement EMA, streaks, counts), swapped with the rest of its state, and judges that domain's sub-batch on
its own queries; a rollback or reset restores that domain only, and a flagged sub-batch's rows get the source model's
scores.

Build one with :func:`make_wrapper` (``routing=None`` gives a plain ``TTAWrapper``), which is how the benchmark
runner can construct rows with per-domain adapters.
"""

from __future__ import annotations

import dataclasses
import numbers
import os
import re
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import torch
from torch import nn

from . import checkpoint
from .config import TTAConfig
from .configuration_utils import ConfigMixin, check_choice, check_positive, check_positive_int
from .gallery.base import GalleryBackend, TopKScores
from .models.base import ModelAdapter
from .safety import SAFETY_ACTIONS, SafetyMonitor
from .version import __version__
from .wrapper import GalleryCache, TTAOutput, TTAWrapper

FEATURES = ("style", "embedding")
ROUTER_PREFIX = "auto:"  # keys of the domains the router opens: "auto:0", "auto:1", ...
_PEFT_SUFFIX = re.compile(r"\.(base_layer|ln_tuning_layers\.[^.]+)$")  # LN-tuning's inner copies of a norm layer
_TINY = 1e-12
_LOCAL_SET = 8  # the seed and its nearest pending queries, for the prior spread of a new domain
_PRIOR_WEIGHT = 4.0  # pseudo-observations of the prior variance in a new domain's variance
DomainKey = str | int


# ---------------------------------------------------------------------------------------------------- config
@dataclass
class RoutingConfig(ConfigMixin):
    """Configuration of the per-domain adapters of a :class:`RoutedTTAWrapper` and of its :class:`DomainRouter`.

    Example:
        >>> cfg = RoutingConfig(max_domains=4)
        >>> RoutingConfig.from_dict(cfg.to_dict()) == cfg
        True
    """

    config_file_name = "routing_config.json"

    max_domains: int = field(
        default=8, metadata={"help": "Most domains held at once (router-opened and user-keyed together)."}
    )
    new_domain_threshold: float = field(
        default=9.0,
        metadata={
            "help": "A query whose mean squared z-score (over the feature dimensions, each standardised by the domain's "
            "running variance) exceeds this for every domain fits none (9 = about 3 sigma per dimension): such "
            "queries open a new domain when at least `min_domain_batch` of them fit together."
        },
    )
    features: str = field(
        default="style",
        metadata={
            "help": "Router features, computed by the source model without grad: 'style' = channel-wise mean and log "
            "std of the input of the query tower's first normalisation layer (instance-norm statistics); 'embedding' = "
            "the source model's query embedding."
        },
    )
    momentum: float = field(
        default=0.995,
        metadata={
            "help": "Per-query decay of a domain's running mean and variance: the statistics are exact running means "
            "until a query's weight 1/count falls below 1 - momentum, then an exponential moving average."
        },
    )
    var_floor: float = field(
        default=0.01,
        metadata={"help": "Ridge added to a domain's variances, as a fraction of their mean (keeps z-scores finite)."},
    )
    min_domain_batch: int = field(
        default=4,
        metadata={
            "help": "A gradient objective adapts a domain only on a sub-batch of at least this many queries; a smaller "
            "one is scored by the domain's current model (and the score transform) without an update, since in-batch "
            "terms (TCR's refined prediction and uniformity) degenerate on 1-3 queries. The router opens a domain "
            "only for at least this many queries of a batch (or when it has none). 1 = always adapt."
        },
    )

    def __post_init__(self):
        check_positive_int("max_domains", self.max_domains)
        check_positive("new_domain_threshold", self.new_domain_threshold)
        check_choice("features", self.features, FEATURES)
        if not 0.0 <= self.momentum < 1.0:
            raise ValueError(f"`momentum` must be in [0, 1), got {self.momentum!r}.")
        check_positive("var_floor", self.var_floor, allow_zero=True)
        check_positive_int("min_domain_batch", self.min_domain_batch)


def _as_routing_config(routing: RoutingConfig | Mapping[str, Any] | None) -> RoutingConfig:
    if routing is None:
        return RoutingConfig()
    if isinstance(routing, RoutingConfig):
        return routing
    if isinstance(routing, Mapping):
        return RoutingConfig.from_dict(dict(routing))
    raise TypeError(f"`routing` must be a RoutingConfig, a dict of its fields or None, got {type(routing).__name__}.")


# ---------------------------------------------------------------------------------------------------- router
class DomainRouter:
    """Online clustering of per-query feature vectors into domains with running mean and diagonal variance.

    :meth:`route` assigns a ``(B, F)`` batch in one vectorised pass: each query goes to the nearest domain by the mean
    squared z-score ``mean_f (x_f - mu_kf)^2 / (var_kf + ridge_k)``. The queries within ``new_domain_threshold`` of no
    domain are grouped by a loop of at most ``max_domains`` passes (one per seed, not per query): the first pending
    query (batch order) seeds a group of the pending queries within the threshold of it, then of the group's mean and
    variance (a few passes, :meth:`_grow`); the seed's spread before the group can be measured comes from nearest
    neighbours (:meth:`_prior_var`), which stay within a style in a mixed batch. A group of at least
    ``min_domain_batch`` queries (any group while there is no domain) opens a domain; the other pending queries go to
    the nearest domain. Queries within the threshold of their domain update its statistics (a merge of the batch's
    moments with weight ``max(n / (count + n), 1 - momentum ** n)``); queries sent to the nearest domain without
    fitting it do not move it. No randomness: the result depends only on the stream. State: ``means``/``vars``
    ``(K, F)`` and ``counts`` ``(K,)``, float64.
    """

    def __init__(self, config: RoutingConfig | None = None):
        self.config = config if config is not None else RoutingConfig()
        self.means: torch.Tensor | None = None
        self.vars: torch.Tensor | None = None
        self.counts: torch.Tensor | None = None

    @property
    def num_domains(self) -> int:
        return 0 if self.means is None else self.means.shape[0]

    def reset(self) -> None:
        self.means = self.vars = self.counts = None

    def _ridge(self, var: torch.Tensor) -> torch.Tensor:
        return var + self.config.var_floor * var.mean(dim=-1, keepdim=True) + _TINY

    def distances(self, x: torch.Tensor) -> torch.Tensor:
        """``(B, K)`` mean squared z-scores of the queries ``x`` ``(B, F)`` to every domain."""
        x = x.to(torch.float64)
        if self.num_domains == 0:
            return x.new_empty(x.shape[0], 0)
        if x.shape[1] != self.means.shape[1]:
            raise ValueError(
                f"The router holds {self.means.shape[1]}-dimensional domain statistics but got {x.shape[1]} features: "
                "was it fed another model's features?"
            )
        return ((x[:, None, :] - self.means[None]) ** 2 / self._ridge(self.vars)[None]).mean(dim=-1)

    def _prior_var(self, xs: torch.Tensor, d2: torch.Tensor) -> torch.Tensor:
        """Within-domain variance ``(F,)`` expected around the seed ``xs[0]`` among the pending queries ``xs`` ``(P, F)``
        (``d2``: their squared distances in batch-standardised units, ``inf`` on the diagonal). Over the seed and its 7
        nearest pending queries, half the mean squared difference of each to its nearest one among them: nearest
        neighbours stay within a style in a mixed batch. With fewer than 4 pending queries (2 with no domain yet): the
        existing domains' mean variance, else a ``var_floor`` fraction of the seed's square."""
        p = xs.shape[0]
        if p >= 4 or (p >= 2 and self.num_domains == 0):
            near = d2[0].topk(min(p - 1, _LOCAL_SET - 1), largest=False).indices  # never the seed (inf)
            local = torch.cat([near.new_zeros(1), near])
            nn_idx = local[d2[local][:, local].argmin(dim=1)]
            return 0.5 * ((xs[local] - xs[nn_idx]) ** 2).mean(dim=0)
        if self.num_domains:
            return self.vars.mean(dim=0)
        return self.config.var_floor * xs[0] ** 2 + _TINY

    def _grow(self, xs: torch.Tensor, prior: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The domain seeded by ``xs[0]`` among the pending queries ``xs``: ``(members mask, mean, variance)``.

        Members are the queries within the threshold of the centre; from 4 members on, the centre and variance are
        re-estimated from them (the variance blended with ``prior`` as 4 pseudo-observations) and the membership
        recomputed, until it stops changing (at most 5 passes)."""
        thr = self.config.new_domain_threshold
        centre, var = xs[0], prior
        near = ((xs - centre) ** 2 / self._ridge(var)).mean(dim=1) <= thr
        for _ in range(5):
            n = int(near.sum())
            if n < 4:
                break
            members = xs[near]
            centre = members.mean(dim=0)
            var = ((n - 1) * members.var(dim=0) + _PRIOR_WEIGHT * prior) / (n - 1 + _PRIOR_WEIGHT)
            grown = ((xs - centre) ** 2 / self._ridge(var)).mean(dim=1) <= thr
            grown[0] = True  # the seed stays in the domain it opens
            if torch.equal(grown, near):
                break
            near = grown
        return near, xs[near].mean(dim=0), var

    def route(self, x: torch.Tensor, capacity: int | None = None, update: bool = True) -> tuple[torch.Tensor, int]:
        """Assign each query of ``x`` ``(B, F)`` to a domain; returns ``(assignment (B,) int64, domains opened)``.

        ``capacity`` caps the domains this call may open (default: up to ``max_domains``); with ``update=False``
        nothing is opened or updated and a query goes to its nearest domain (``-1`` when there is none).
        """
        cfg = self.config
        x = x.detach().to(device="cpu", dtype=torch.float64)
        b, k_old = x.shape[0], self.num_domains
        capacity = cfg.max_domains - k_old if capacity is None else capacity
        assign = torch.full((b,), -1, dtype=torch.long)
        within = torch.zeros(b, dtype=torch.bool)
        if k_old:
            best_d, best = self.distances(x).min(dim=1)
            within = best_d <= cfg.new_domain_threshold
            assign = torch.where(within, best, assign)
        opened = 0
        if update:
            pending = (assign < 0).nonzero().flatten()
            if pending.numel() and capacity > 0:
                xs = x[pending]
                a = xs / (xs.var(dim=0, unbiased=False) + _TINY).sqrt()
                sq = (a * a).sum(dim=1)
                d2 = (sq[:, None] + sq[None, :] - 2 * a @ a.T).fill_diagonal_(float("inf"))
                for _ in range(cfg.max_domains):  # at most this many seeds per batch, opened or not
                    if not xs.shape[0] or opened >= capacity:
                        break
                    near, mean, var = self._grow(xs, self._prior_var(xs, d2))
                    if int(near.sum()) >= cfg.min_domain_batch or self.num_domains == 0:
                        self._append(mean, var, int(near.sum()))
                        assign[pending[near]] = k_old + opened
                        opened += 1
                    keep = ~near  # a group too small to open a domain goes to the nearest one (below)
                    xs, pending, d2 = xs[keep], pending[keep], d2[keep][:, keep]
            self._update(x, assign, within, k_old)
        leftover = (assign < 0).nonzero().flatten()
        if leftover.numel() and self.num_domains:
            assign[leftover] = self.distances(x[leftover]).argmin(dim=1)
        return assign, opened

    def _append(self, mean: torch.Tensor, var: torch.Tensor, count: int) -> None:
        count_t = torch.tensor([float(count)], dtype=torch.float64)
        if self.means is None:
            self.means, self.vars, self.counts = mean[None].clone(), var[None].clone(), count_t
        else:
            self.means = torch.cat([self.means, mean[None]])
            self.vars = torch.cat([self.vars, var[None]])
            self.counts = torch.cat([self.counts, count_t])

    def _update(self, x: torch.Tensor, assign: torch.Tensor, within: torch.Tensor, k_old: int) -> None:
        """Merge the batch's moments of each existing domain (queries within the threshold only) into its statistics."""
        idx = within.nonzero().flatten()
        if not k_old or not idx.numel():
            return
        a, xs = assign[idx], x[idx]
        n = torch.bincount(a, minlength=k_old).to(torch.float64)
        mean_b = torch.zeros(k_old, x.shape[1], dtype=torch.float64).index_add_(0, a, xs) / n.clamp_min(1)[:, None]
        var_b = torch.zeros_like(mean_b).index_add_(0, a, (xs - mean_b[a]) ** 2) / n.clamp_min(1)[:, None]
        counts = self.counts[:k_old]
        w = torch.maximum(n / (counts + n).clamp_min(1), 1 - self.config.momentum**n)
        w = torch.where(n > 0, w, torch.zeros_like(w))[:, None]
        delta = mean_b - self.means[:k_old]
        self.means[:k_old] += w * delta
        self.vars[:k_old] = (1 - w) * self.vars[:k_old] + w * var_b + w * (1 - w) * delta**2
        self.counts[:k_old] = counts + n

    def state_tensors(self) -> dict[str, torch.Tensor]:
        if self.num_domains == 0:
            return {}
        return {"means": self.means, "vars": self.vars, "counts": self.counts}

    def load_state_tensors(self, tensors: Mapping[str, torch.Tensor]) -> None:
        if not tensors:
            self.reset()
            return
        self.means, self.vars, self.counts = (tensors[k].to("cpu", torch.float64).clone() for k in ("means", "vars", "counts"))


# ---------------------------------------------------------------------------------------------------- wrapper
@dataclass
class RoutedTTAOutput(TTAOutput):
    """:class:`~hf_tta.TTAOutput` of a routed batch, in the original query order.

    ``num_updates`` and ``n_selected`` are summed over the domains, ``loss`` is the query-weighted mean of the domains'
    losses, ``skipped``, ``logs`` and ``safety_logs`` carry each domain's entries prefixed by its key
    (``"auto:0/loss_na"``). With the safety layer, ``safety_action`` is the most severe action of the batch's domains
    (``"reset"`` > ``"rollback"`` > ``"skip_degenerate"``; ``None`` when no sub-batch was flagged) and
    ``safety_actions`` holds each domain's.

    Args:
        domains (`torch.Tensor` of shape `(B,)`): each query's domain id (an index into ``domain_keys``).
        domain_keys (`list`): the wrapper's domain keys after this batch (user keys, or ``"auto:<k>"`` for the
            domains the router opened).
        new_domains (`list`): the keys of the domains this batch opened.
        safety_actions (`dict`): with the safety layer, each of the batch's domains' action (key -> action or ``None``).
    """

    domains: torch.Tensor | None = None
    domain_keys: list[DomainKey] = field(default_factory=list)
    new_domains: list[DomainKey] = field(default_factory=list)
    safety_actions: dict[DomainKey, str | None] = field(default_factory=dict)


@dataclass
class _Domain:
    """One domain's adapted state while it is not in the model (``params``/``optimizer`` ``None`` = fresh)."""

    key: DomainKey
    params: list[torch.Tensor] | None
    optimizer: dict[str, Any] | None
    state: dict[str, torch.Tensor]
    transform_state: dict[str, torch.Tensor]
    generator: torch.Generator
    batch_index: int = 0
    safety: SafetyMonitor | None = None  # the domain's own safety monitor (TTAConfig.safety)


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

    def __init__(
        self,
        model: nn.Module | ModelAdapter,
        config: TTAConfig | None = None,
        routing: RoutingConfig | Mapping[str, Any] | None = None,
    ):
        super().__init__(model, config)
        self.routing = _as_routing_config(routing)
        self.router = DomainRouter(self.routing)
        self._domains: list[_Domain] = []
        self._slots: dict[DomainKey, int] = {}
        self._router_slots: list[int] = []  # router domain k -> slot
        self._live: _Domain | None = None  # the domain whose state is in the model (and whose stored copy may be stale)
        self._in_domain_step = False
        self._feature_modules: list[tuple[nn.Module, nn.Module]] | None = None

    # ------------------------------------------------------------------------------------------ domains
    @property
    def domain_keys(self) -> list[DomainKey]:
        """The domains' keys, by domain id (creation order)."""
        return [d.key for d in self._domains]

    @property
    def num_domains(self) -> int:
        return len(self._domains)

    def _new_domain(self, key: DomainKey) -> int:
        self._domains.append(
            _Domain(
                key=key, params=None, optimizer=None, state=self.objective.init_state(self.device),
                transform_state=self.score_transform.init_state(self.device) if self.score_transform else {},
                generator=torch.Generator().manual_seed(self.config.seed),
                safety=SafetyMonitor(self.safety.config) if self.safety is not None else None,
            )
        )
        self._slots[key] = len(self._domains) - 1
        return len(self._domains) - 1

    @torch.no_grad()
    def _activate(self, slot: int) -> None:
        """Put domain ``slot``'s state into the model (exact copies; no-op when it is already there)."""
        d = self._domains[slot]
        if self._live is d:
            return
        self._sync()
        if self.params:
            live = list(self.params.values())
            torch._foreach_copy_(live, d.params if d.params is not None else [self._source[n] for n in self.params])
        if self.optimizer is not None:
            if d.optimizer is None:
                self.optimizer = self._make_optimizer()
            else:  # the stored tensors become the optimiser's state (moments and steps are exact)
                self.optimizer.load_state_dict(d.optimizer)
        self.state, self.transform_state, self.generator, self.safety = d.state, d.transform_state, d.generator, d.safety
        self.batch_index = d.batch_index
        self._live = d

    @torch.no_grad()
    def _sync(self) -> None:
        """Store the live domain's state from the model (before another domain's state replaces it)."""
        d = self._live
        if d is None:
            return
        if self.params:
            d.params = [p.detach().clone() for p in self.params.values()]
        if self.optimizer is not None:
            d.optimizer = self.optimizer.state_dict()  # references; the next load_state_dict replaces, never writes them
        d.state, d.transform_state, d.generator, d.batch_index = self.state, self.transform_state, self.generator, self.batch_index
        d.safety = self.safety

    def domain_parameters(self, key: DomainKey) -> dict[str, torch.Tensor]:
        """Copies of domain ``key``'s adapted parameter values, by name."""
        if key not in self._slots:
            raise ValueError(f"No domain {key!r}: the domains are {self.domain_keys}.")
        self._sync()
        d = self._domains[self._slots[key]]
        values = d.params if d.params is not None else [self._source[n] for n in self.params]
        return {n: v.detach().clone() for n, v in zip(self.params, values)}

    @property
    def safety_counts(self) -> dict[str, int]:
        """How often the safety layer skipped, rolled back and reset since the last :meth:`reset`, summed over the
        domains (empty when off); :attr:`domain_safety_counts` has them per domain."""
        if self.safety is None:
            return {}
        return {a: sum(d.safety.counts[a] for d in self._domains) for a in SAFETY_ACTIONS}

    @property
    def domain_safety_counts(self) -> dict[DomainKey, dict[str, int]]:
        """Each domain's safety counts, by key (empty when the safety layer is off)."""
        return {d.key: dict(d.safety.counts) for d in self._domains if d.safety is not None}

    # ------------------------------------------------------------------------------------------ routing
    def _user_slots(self, domain: Any, n: int, create: bool) -> torch.Tensor:
        """Per-query domain ids ``(n,)`` for user keys (one for the batch, or one per query); ``-1`` = unknown key
        when ``create`` is false."""
        if isinstance(domain, torch.Tensor):
            if domain.is_floating_point() or domain.is_complex() or domain.dtype == torch.bool or domain.dim() > 1:
                raise ValueError("A tensor `domain` must hold integer keys, one for the batch or one per query (1-D).")
            domain = domain.item() if domain.dim() == 0 else domain.tolist()
        if _is_key(domain):
            keys, inverse = [_plain_key(domain)], torch.zeros(n, dtype=torch.long)
        elif isinstance(domain, Sequence) and not isinstance(domain, (str, bytes)):
            if len(domain) != n:
                raise ValueError(f"`domain` has {len(domain)} keys for {n} queries: pass one key per query, or one key for the batch.")
            bad = [t for t in set(map(type, domain)) if not _is_key_type(t)]
            if bad:
                raise ValueError(f"Domain keys must be str or int (hashable, JSON-serialisable), got {bad[0].__name__}.")
            first = dict.fromkeys(domain)  # unique keys in first-occurrence order (C-level, no Python loop)
            position = {k: i for i, k in enumerate(first)}
            keys = [_plain_key(k) for k in first]
            inverse = torch.tensor(list(map(position.__getitem__, domain)), dtype=torch.long)
        else:
            raise ValueError(
                f"`domain` must be a str or int key for the batch or a sequence of one key per query, got {type(domain).__name__}."
            )
        slots = []
        for key in keys:  # one per distinct key, not per query
            if isinstance(key, str) and key.startswith(ROUTER_PREFIX):
                raise ValueError(f"Domain key {key!r}: keys starting with {ROUTER_PREFIX!r} name the router's domains; pick another key.")
            if key in self._slots:
                slots.append(self._slots[key])
            elif not create:
                slots.append(-1)
            elif self.num_domains >= self.routing.max_domains:
                raise ValueError(
                    f"{self.num_domains} domains exist (RoutingConfig.max_domains={self.routing.max_domains}): raise "
                    f"max_domains to add domain {key!r}."
                )
            else:
                slots.append(self._new_domain(key))
        return torch.tensor(slots, dtype=torch.long)[inverse]

    def _feature_hooks(self) -> list[tuple[nn.Module, nn.Module]]:
        """(module to hook, the normalisation layer it runs) for every normalisation layer of the query tower."""
        if self._feature_modules is None:
            names = dict.fromkeys(_PEFT_SUFFIX.sub("", n) for n in self.adapter.norm_layer_names(self.query_modality))
            if not names:
                raise ValueError(
                    f"features='style' needs a normalisation layer in the {self.query_modality} tower: use "
                    "RoutingConfig(features='embedding')."
                )
            modules = [self.model.get_submodule(n) for n in names]
            self._feature_modules = [(m, getattr(m, "base_layer", m)) for m in modules]
        return self._feature_modules

    @torch.no_grad()
    def router_features(self, queries: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """The router's ``(B, F)`` features of checked query inputs, computed by the source model (float64, CPU)."""
        n = _rows(queries)
        with self.disabled():
            if self.routing.features == "embedding":
                emb = self.adapter.single_vector(self.adapter.encode(self.query_modality, dict(queries)))
                return emb.detach().to("cpu", torch.float64)
            captured: list[tuple[torch.Tensor, nn.Module]] = []

            def hook(module, args, kwargs):
                x = args[0] if args else next(v for v in kwargs.values() if isinstance(v, torch.Tensor))
                captured.append((x.detach(), base_of[module]))
                raise _FeaturesCaptured  # the rest of the forward is not needed

            base_of = dict(self._feature_hooks())
            handles = [m.register_forward_pre_hook(hook, with_kwargs=True) for m in base_of]
            try:
                self.adapter.encode(self.query_modality, dict(queries))
            except _FeaturesCaptured:
                pass
            finally:
                for h in handles:
                    h.remove()
        if not captured:
            raise RuntimeError("No normalisation layer of the query tower ran: use RoutingConfig(features='embedding').")
        x, base = captured[0]
        return style_statistics(x, base, n, queries.get("attention_mask"))

    def _route(self, queries: dict, domain: Any, update: bool) -> tuple[torch.Tensor, list[DomainKey]]:
        """Per-query domain ids (``-1``: no domain, only when not ``update``) and the keys of the domains opened."""
        n = _rows(queries)
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
        queries = self._check_inputs(queries, self.query_modality)
        return self._route(queries, domain, update=False)[0]

    # ------------------------------------------------------------------------------------------ the online step
    def adapt_step(
        self,
        queries: Mapping[str, torch.Tensor],
        gallery: GalleryCache | GalleryBackend | torch.Tensor,
        labels: Any = None,
        domain: Any = None,
    ) -> RoutedTTAOutput:
        """Adapt each domain on its queries of this batch and return their scores in the original order.

        ``domain``: a str/int key for the whole batch, a sequence (or 1-D integer tensor) of one key per query, or
        ``None`` to let the router decide per query. Each domain's sub-batch runs :meth:`TTAWrapper.adapt_step` with
        that domain's state in the model; a new domain starts from the source model.
        """
        if torch.is_inference_mode_enabled():
            raise RuntimeError(
                "adapt_step was called under torch.inference_mode(), which no enable_grad() can undo: "
                "call it outside inference_mode (torch.no_grad() is fine)."
            )
        gallery = self._check_gallery(gallery)
        queries = self._check_inputs(queries, self.query_modality)
        n = _rows(queries)
        if labels is not None:
            if isinstance(gallery, GalleryBackend):
                raise ValueError("labels need the dense GalleryCache: a top-k backend shows objectives only candidate items.")
        mask = self._label_mask(labels, n, gallery) if (labels is not None or self.objective.requires_labels) else None
        slots, new_keys = self._route(queries, domain, update=True)
        outputs: list[tuple[_Domain, torch.Tensor, TTAOutput]] = []
        for slot in torch.unique(slots).tolist():  # one pass per domain present, in domain order
            idx = (slots == slot).nonzero().flatten()
            whole = idx.numel() == n
            sub = queries if whole else {k: v.index_select(0, idx.to(v.device)) for k, v in queries.items()}
            sub_labels = None if mask is None else (mask if whole else mask.index_select(0, idx.to(mask.device)))
            self._activate(slot)
            self._in_domain_step = True
            try:
                if self.objective.requires_grad and idx.numel() < self.routing.min_domain_batch:
                    out = self._score_frozen(sub, gallery)
                else:
                    out = TTAWrapper.adapt_step(self, sub, gallery, labels=sub_labels)
            finally:
                self._in_domain_step = False
            outputs.append((self._domains[slot], idx, out))
        return self._assemble(outputs, slots, n, new_keys)

    def _score_frozen(self, queries: dict, gallery: GalleryCache | GalleryBackend) -> TTAOutput:
        """A sub-batch below ``min_domain_batch``: the domain's current model scores it, nothing is updated (the score
        transform, if any, still sees it)."""
        with torch.no_grad():
            inputs = self._inputs(queries, gallery, step=0)
            scores = self._transform_scores(inputs, inputs.scores.detach())
        out = TTAOutput(
            scores=scores, loss=None, num_updates=0, n_selected=0,
            skipped=[f"{_rows(queries)} queries < min_domain_batch={self.routing.min_domain_batch}: scored, not adapted"],
        )
        return self._topk_output(out, gallery) if isinstance(gallery, GalleryBackend) else out

    def _assemble(
        self, outputs: list[tuple[_Domain, torch.Tensor, TTAOutput]], slots: torch.Tensor, n: int, new_keys: list[DomainKey]
    ) -> RoutedTTAOutput:
        scores = topk = None
        first = outputs[0][2]
        if first.scores is not None:
            scores = first.scores.new_empty(n, first.scores.shape[1])
            for _, idx, out in outputs:
                scores.index_copy_(0, idx.to(scores.device), out.scores)
        else:
            k = min(out.topk.k for _, _, out in outputs)  # equal unless the gallery is smaller than the backend's k
            values = first.topk.values.new_empty(n, k)
            indices = first.topk.indices.new_empty(n, k)
            for _, idx, out in outputs:
                values.index_copy_(0, idx.to(values.device), out.topk.values[:, :k])
                indices.index_copy_(0, idx.to(indices.device), out.topk.indices[:, :k])
            topk = TopKScores(values, indices)
        with_loss = [(idx.numel(), out.loss) for _, idx, out in outputs if out.loss is not None]
        loss = sum(m * v for m, v in with_loss) / sum(m for m, _ in with_loss) if with_loss else None
        actions = {d.key: out.safety_action for d, _, out in outputs} if self.safety is not None else {}
        flagged = [a for a in reversed(SAFETY_ACTIONS) if a in actions.values()]  # the most severe first
        return RoutedTTAOutput(
            scores=scores,
            loss=loss,
            num_updates=sum(out.num_updates for _, _, out in outputs),
            n_selected=sum(int(out.n_selected) for _, _, out in outputs),
            skipped=[f"{d.key}: {s}" for d, _, out in outputs for s in out.skipped],
            logs={f"{d.key}/{name}": v for d, _, out in outputs for name, v in out.logs.items()},
            topk=topk,
            safety_action=flagged[0] if flagged else None,
            safety_logs={f"{d.key}/{name}": v for d, _, out in outputs for name, v in out.safety_logs.items()},
            safety_actions=actions,
            domains=slots,
            domain_keys=self.domain_keys,
            new_domains=new_keys,
        )

    @torch.no_grad()
    def embed_and_score(
        self, queries: Mapping[str, torch.Tensor], gallery: GalleryCache | torch.Tensor, domain: Any = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Score a batch without adapting, each query with its domain's current model (routed as
        :meth:`assign_domains`; a query with no domain yet is scored by the source model). Inside ``disabled()`` every
        query is scored by the source model."""
        gallery = self._check_gallery(gallery)
        if isinstance(gallery, GalleryBackend):
            raise TypeError(f"embed_and_score needs the dense GalleryCache; {type(gallery).__name__} answers gallery.search(...).")
        queries = self._check_inputs(queries, self.query_modality)
        n = _rows(queries)
        slots = self._route(queries, domain, update=False)[0]
        emb = scores = None
        for slot in torch.unique(slots).tolist():
            idx = (slots == slot).nonzero().flatten()
            sub = queries if idx.numel() == n else {k: v.index_select(0, idx.to(v.device)) for k, v in queries.items()}
            if slot < 0:
                with self.disabled():
                    q, s = self._embed_and_score(sub, gallery)
            else:
                self._activate(slot)
                q, s = self._embed_and_score(sub, gallery)
            if emb is None:
                emb, scores = q.new_empty(n, *q.shape[1:]), s.new_empty(n, *s.shape[1:])
            emb.index_copy_(0, idx.to(emb.device), q)
            scores.index_copy_(0, idx.to(scores.device), s)
        return emb, scores

    # ------------------------------------------------------------------------------------------ state
    def reset(self) -> None:
        """Drop every domain and the router's statistics and return exactly to the source model. (Inside a domain's
        sub-batch, ``reset_policy="episodic"`` resets that domain only.)"""
        if self._in_domain_step:
            TTAWrapper.reset(self)
            return
        self._live = None
        self.generator = torch.Generator()  # the dropped domains' generators and safety monitors stay theirs
        self.safety = SafetyMonitor(self.safety.config) if self.safety is not None else None
        TTAWrapper.reset(self)
        self._domains, self._slots, self._router_slots = [], {}, []
        self.router.reset()

    def save_pretrained(self, save_directory: str | os.PathLike) -> None:
        """Write every domain's state (tensors prefixed ``domain.<id>.``, laid out as :meth:`TTAWrapper.save_pretrained`
        lays out one wrapper's, its safety monitor included) and the router's statistics (``router.*``) as one atomic
        checkpoint folder; the routing config goes in ``tta_config.json`` under ``"routing"``."""
        self._sync()
        tensors: dict[str, torch.Tensor] = {}
        optimizers, safety = [], []
        for i, d in enumerate(self._domains):
            p = f"domain.{i}."
            values = d.params if d.params is not None else [self._source[n] for n in self.params]
            tensors.update({f"{p}param.{n}": v.detach() for n, v in zip(self.params, values)})
            optim_meta = None
            if self.optimizer is not None:
                sd = d.optimizer or {"state": {}, "param_groups": self.optimizer.state_dict()["param_groups"]}
                plain: dict[str, dict[str, Any]] = {}
                for pid, st in sd["state"].items():
                    for key, value in st.items():
                        if isinstance(value, torch.Tensor):
                            tensors[f"{p}optim.{pid}.{key}"] = value
                        else:
                            plain.setdefault(str(pid), {})[key] = value
                optim_meta = {"param_groups": sd["param_groups"], "plain_state": plain}
            optimizers.append(optim_meta)
            tensors.update({f"{p}objective.{k}": v for k, v in d.state.items()})
            tensors.update({f"{p}score_transform.{k}": v for k, v in d.transform_state.items()})
            tensors[f"{p}wrapper.batch_index"] = torch.tensor(d.batch_index)
            tensors[f"{p}wrapper.rng_state"] = d.generator.get_state()
            if d.safety is not None:  # laid out as TTAWrapper's: tensors under safety.*, metadata under "safety"
                part: dict[str, torch.Tensor] = {}
                part_meta: dict[str, Any] = {}
                d.safety.save_into(part, part_meta)
                tensors.update({f"{p}{k}": v for k, v in part.items()})
                safety.append(part_meta["safety"])
        tensors.update({f"router.{k}": v for k, v in self.router.state_tensors().items()})
        tensors = {k: v.detach().cpu().contiguous() for k, v in tensors.items()}
        meta: dict[str, Any] = {
            "param_names": None,  # a plain TTAWrapper refuses this checkpoint ("adapts other parameters")
            "fingerprint": self.fingerprint(),
            "hf_tta_version": __version__,
            "routed": {
                "param_names": list(self.params),
                "keys": self.domain_keys,
                "router_slots": self._router_slots,
                "optimizers": optimizers,
                "safety": safety if self.safety is not None else None,
                "routing": self.routing.to_dict(),
            },
        }
        config = {**self.resolved_config().to_dict(), "routing": self.routing.to_dict(), "hf_tta_version": __version__}
        checkpoint.write_checkpoint(save_directory, config, tensors, meta)

    def _load_checkpoint(self, ckpt: checkpoint.Checkpoint) -> None:
        meta = ckpt.metadata
        routed = meta.get("routed")
        if routed is None:
            raise ValueError("This checkpoint holds one adapter (saved by TTAWrapper): load it with TTAWrapper, not RoutedTTAWrapper.")
        if ckpt.fingerprint is not None:
            mismatch = checkpoint.fingerprint_mismatch(ckpt.fingerprint, self.fingerprint())
            if mismatch:
                raise ValueError(mismatch)
        if routed["param_names"] != list(self.params):
            raise ValueError("The checkpoint adapts other parameters than this wrapper: was it saved from another model or config?")
        saved = RoutingConfig.from_dict(routed["routing"])
        if saved != self.routing:
            raise ValueError(f"The checkpoint was routed with {saved}, this wrapper with {self.routing}: build it with the checkpoint's routing.")
        keys = routed["keys"]
        parts: list[dict[str, torch.Tensor]] = [{} for _ in keys]
        for name, value in ckpt.tensors.items():
            if name.startswith("domain."):
                i, rest = name[len("domain.") :].split(".", 1)
                parts[int(i)][rest] = value
        missing = [keys[i] for i, part in enumerate(parts) if "wrapper.rng_state" not in part]
        if missing:
            raise ValueError(f"The checkpoint lacks the state of domain(s) {missing[:3]}: it is incomplete.")
        # validated: now replace everything
        self._in_domain_step = False
        self.reset()
        for i, key in enumerate(keys):
            slot = self._new_domain(key)
            self._domains[slot].generator = self.generator = torch.Generator()
            self.safety = self._domains[slot].safety  # load_from fills this domain's monitor
            sub_meta = {"param_names": list(self.params), "optimizer": routed["optimizers"][i]}
            if routed.get("safety"):  # a checkpoint saved without the safety layer starts fresh monitors
                sub_meta["safety"] = routed["safety"][i]
            TTAWrapper._load_checkpoint(self, dataclasses.replace(ckpt, tensors=parts[i], metadata=sub_meta))
            self._live = self._domains[slot]
            self._sync()
        self._router_slots = list(routed["router_slots"])
        self.router.load_state_tensors({k[len("router.") :]: v for k, v in ckpt.tensors.items() if k.startswith("router.")})

    @classmethod
    def from_pretrained(
        cls,
        model: nn.Module | ModelAdapter,
        repo_id_or_path: str | os.PathLike,
        *,
        revision: str | None = None,
        token: str | None = None,
        api=None,
    ) -> "RoutedTTAWrapper":
        """Rebuild a routed wrapper around the *source* ``model`` from a checkpoint of :meth:`save_pretrained` (a local
        folder or a Hub repository), with the checkpoint's TTA and routing configs and every domain."""
        _, ckpt = cls._read_checkpoint_for(model, repo_id_or_path, revision=revision, token=token, api=api)
        config = dict(ckpt.config)
        routing = config.pop("routing", None)
        if routing is None:
            raise ValueError("This checkpoint holds one adapter (saved by TTAWrapper): load it with TTAWrapper.from_pretrained.")
        wrapper = cls(model, TTAConfig.from_dict(config), routing=RoutingConfig.from_dict(routing))
        wrapper._load_checkpoint(ckpt)
        return wrapper

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


class _FeaturesCaptured(Exception):
    """Raised by the router's pre-hook to end the source forward once the features are captured."""


def style_statistics(
    x: torch.Tensor, norm: nn.Module, batch: int, attention_mask: torch.Tensor | None = None
) -> torch.Tensor:
    """Per query, the channel-wise mean and std of ``x``, the input of the normalisation layer ``norm``: ``(B, 2C)``
    float64 on CPU. Channels are the last dimension (dimension 1 for batch, group and channels-first layer norms);
    every other position is averaged, rows beyond ``batch`` (frames of a video) are grouped by query, and
    ``attention_mask`` weights the tokens when its shape matches theirs."""
    if x.dim() > 2 and _channels_first(x, norm):
        x = x.movedim(1, -1)
    if x.shape[0] % batch:
        raise ValueError(f"The query tower's first normalisation layer saw {x.shape[0]} rows for {batch} queries.")
    tokens = x.shape[1] if x.dim() == 3 and x.shape[0] == batch else None
    x = x.to(torch.float64).reshape(batch, -1, x.shape[-1])
    if attention_mask is not None and tokens is not None and tuple(attention_mask.shape) == (batch, tokens):
        w = attention_mask.to(device=x.device, dtype=torch.float64)[..., None]
    else:
        w = torch.ones_like(x[..., :1])
    total = w.sum(dim=1).clamp_min(1)
    mean = (w * x).sum(dim=1) / total
    var = (w * (x - mean[:, None]) ** 2).sum(dim=1) / total
    return torch.cat([mean, 0.5 * var.clamp_min(_TINY).log()], dim=1).cpu()


def _channels_first(x: torch.Tensor, norm: nn.Module) -> bool:
    """Whether ``norm`` normalises dimension 1 of ``x``: batch and group norms, and channels-first layer norms
    (ConvNeXt's ``data_format="channels_first"``)."""
    if isinstance(norm, (nn.modules.batchnorm._BatchNorm, nn.GroupNorm)) or getattr(norm, "data_format", None) == "channels_first":
        return True
    shape = getattr(norm, "normalized_shape", None)
    return bool(shape) and x.shape[-1] != shape[-1] and x.shape[1] == shape[0]


def _rows(inputs: Mapping[str, Any]) -> int:
    """The batch size of checked inputs (every value a tensor with one row per query)."""
    return next(v for v in inputs.values() if isinstance(v, torch.Tensor)).shape[0]


def _is_key_type(t: type) -> bool:
    return t is not bool and (issubclass(t, str) or issubclass(t, numbers.Integral))


def _is_key(value: Any) -> bool:
    return _is_key_type(type(value))


def _plain_key(value: Any) -> DomainKey:
    return str(value) if isinstance(value, str) else int(value)


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
