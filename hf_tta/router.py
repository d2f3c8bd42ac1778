"""The unsupervised domain router of the per-domain adapters: label-free query features grouped online into domains.

:class:`~hf_tta.routing.RoutedTTAWrapper` keeps one adapted state per query domain; when the user passes no domain key,
:class:`DomainRouter` decides each query's domain from cheap label-free statistics of the query computed by the
*source* model (:meth:`~hf_tta.routing.RoutedTTAWrapper.router_features` runs the model; this module holds the
statistics and the clustering):

* ``features="style"``: per query, the channel-wise mean and log std of the input of the query tower's first
  normalisation layer (tokens, patches or frames averaged; text padding masked by ``attention_mask``), i.e.
  instance-norm statistics as in AdaIN (:func:`style_statistics`): they describe the corruption or style of the input
  more than its content (the log makes a corruption's multiplicative effect on the spread an additive shift). The
  source forward stops at that layer (a pre-hook ends it), so it costs about the tower's embedding layer;
* ``features="embedding"``: the source model's query embedding (one full no-grad forward of the query tower).

Each domain keeps a running mean and diagonal variance of the features; a query goes to the nearest domain by the
mean squared z-score over the features, and queries farther than ``new_domain_threshold`` from every domain open a
new domain (starting from the source model) when at least ``min_domain_batch`` of them in a batch fit together, up to
``max_domains``; otherwise they go to the nearest domain. The router has no randomness: the same stream in the same
order gives the same domains. How well it separates shifts depends on the model and the shifts: on the emoji
benchmark's source model, shifts that look alike after its 2.5x downsampling (Gaussian noise and clean, defocus blur
and snow) share a domain and contrast gets its own (see ``model_cards/architecture.md``, "Per-domain adapters").

:class:`RoutingConfig` configures both the router and the per-domain adapters of :mod:`hf_tta.routing`.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch
from torch import nn

from .configuration_utils import ConfigMixin, check_choice, check_field_types, check_positive, check_positive_int
from .models.base import ModelAdapter

FEATURES = ("style", "embedding")
ROUTER_PREFIX = "auto:"  # keys of the domains the router opens: "auto:0", "auto:1", ...
DomainKey = str | int
_TINY = 1e-12
_LOCAL_SET = 8  # the seed and its nearest pending queries, for the prior spread of a new domain
_PRIOR_WEIGHT = 4.0  # pseudo-observations of the prior variance in a new domain's variance


# ---------------------------------------------------------------------------------------------------- config
@dataclass
class RoutingConfig(ConfigMixin):
    """Configuration of the per-domain adapters of a :class:`~hf_tta.routing.RoutedTTAWrapper` and of its
    :class:`DomainRouter`.

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
        check_field_types(self)
        check_positive_int("max_domains", self.max_domains)
        check_positive("new_domain_threshold", self.new_domain_threshold)
        check_choice("features", self.features, FEATURES)
        if not 0.0 <= self.momentum < 1.0:
            raise ValueError(f"`momentum` must be in [0, 1), got {self.momentum!r}.")
        check_positive("var_floor", self.var_floor, allow_zero=True)
        check_positive_int("min_domain_batch", self.min_domain_batch)


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


# ---------------------------------------------------------------------------------------------------- features
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


# ---------------------------------------------------------------------------------------------------- which domain
def parse_domain_keys(domain: Any, n: int) -> tuple[list[DomainKey], torch.Tensor]:
    """The distinct user keys of a batch of ``n`` queries (first-occurrence order) and each query's index into them:
    ``domain`` is one str/int key for the batch, a sequence of one key per query, or a 0-/1-D integer tensor."""
    if isinstance(domain, torch.Tensor):
        if domain.is_floating_point() or domain.is_complex() or domain.dtype == torch.bool or domain.dim() > 1:
            raise ValueError("A tensor `domain` must hold integer keys, one for the batch or one per query (1-D).")
        domain = domain.item() if domain.dim() == 0 else domain.tolist()
    if _is_key_type(type(domain)):
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
    for key in keys:
        if isinstance(key, str) and key.startswith(ROUTER_PREFIX):
            raise ValueError(f"Domain key {key!r}: keys starting with {ROUTER_PREFIX!r} name the router's domains; pick another key.")
    return keys, inverse


def _is_key_type(t: type) -> bool:
    return t is not bool and (issubclass(t, str) or issubclass(t, numbers.Integral))


def _plain_key(value: Any) -> DomainKey:
    return str(value) if isinstance(value, str) else int(value)


class _FeaturesCaptured(Exception):
    """Raised by the pre-hook to end the source forward once the features are captured."""


class QueryFeatures:
    """The router's ``(B, F)`` features of a batch of checked query inputs (float64, CPU): the style statistics of the
    input of the query tower's first normalisation layer that runs (the forward stops there), or the embedding.
    Call it with the adapters disabled: the features are the source model's."""

    def __init__(self, adapter: ModelAdapter, modality: str, features: str):
        self.adapter, self.modality, self.features = adapter, modality, features
        self._modules: list[nn.Module] | None = None

    def _hooked(self) -> list[nn.Module]:
        """Every normalisation layer of the query tower."""
        if self._modules is None:
            names = self.adapter.norm_layer_names(self.modality)
            if not names:
                raise ValueError(
                    f"features='style' needs a normalisation layer in the {self.modality} tower: use "
                    "RoutingConfig(features='embedding')."
                )
            self._modules = [self.adapter.model.get_submodule(n) for n in names]
        return self._modules

    @torch.no_grad()
    def __call__(self, queries: Mapping[str, torch.Tensor]) -> torch.Tensor:
        n = next(v for v in queries.values() if isinstance(v, torch.Tensor)).shape[0]
        if self.features == "embedding":
            emb = self.adapter.single_vector(self.adapter.encode(self.modality, dict(queries)))
            return emb.detach().to("cpu", torch.float64)
        captured: list[tuple[torch.Tensor, nn.Module]] = []

        def hook(module, args, kwargs):
            x = args[0] if args else next(v for v in kwargs.values() if isinstance(v, torch.Tensor))
            captured.append((x.detach(), module))
            raise _FeaturesCaptured  # the rest of the forward is not needed

        handles = [m.register_forward_pre_hook(hook, with_kwargs=True) for m in self._hooked()]
        try:
            self.adapter.encode(self.modality, dict(queries))
        except _FeaturesCaptured:
            pass
        finally:
            for h in handles:
                h.remove()
        if not captured:
            raise RuntimeError("No normalisation layer of the query tower ran: use RoutingConfig(features='embedding').")
        x, base = captured[0]
        return style_statistics(x, base, n, queries.get("attention_mask"))
