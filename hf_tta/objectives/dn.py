"""DN: test-time Distribution Normalization (Zhou, Ren, Li, Zabih, Lim, NeurIPS 2023, https://arxiv.org/abs/2302.11084).

Code: github.com/fengyuli-dev/distribution-normalization (HEAD be4bdb6). Training-free: no parameter changes, scores
only. With ``mu_q`` and ``mu_g`` the mean query and gallery embeddings of the test distribution, the first-order
approximation of InfoNCE scores a pair with

    s_DN(q, g) = (z_q - lambda mu_q) . (z_g - lambda mu_g)
               = s(q, g) - lambda z_q.mu_g - lambda mu_q.z_g + lambda^2 mu_q.mu_g

lambda = 0.25 by default: the authors' code (``lam=0.25``) and every DN number they report use it, and where paper and
code disagree this library follows the code; lambda = 1/2 is the theory's value (the first-order optimum of the paper's
derivation), available as ``lam=0.5``. The expanded form
is what is computed, so it applies to any score matrix (also the max-over-vectors scores of BLIP-2 images, with the
single-vector view of the query) and to scores another objective produced.

Means (choices, all configurable):
  * gallery: the mean of ``num_samples`` (100, as DN*) random items of the cached gallery, drawn once with the wrapper's
    seeded RNG (``gallery_mean="samples"``), or of the whole gallery (``"all"``: the transductive "DN" of the paper);
  * queries: the mean of the first ``num_samples`` queries of the stream (``query_mean="samples"``; the current batch
    counts, so the first batch is already normalised), or a running mean over every query seen so far (``"running"``).
    To estimate it from held-out unlabelled queries instead, stream them through ``adapt_step`` first (DN changes
    nothing else).
  * ``renormalize``: the retrieval code does not re-normalise after subtracting (default); its zero-shot code does.

With a top-k gallery backend (``gallery_access="stats"``): the gallery mean is the backend's (``"all"``: computed once
in one streamed pass, :meth:`~hf_tta.gallery.GalleryBackend.statistics`; ``"samples"``: the same seeded draw of items,
gathered from the backend, so both equal the dense path's). Without ``renormalize`` DN ranks the items of query q by
``(z_q - lam mu_q) . z_g`` (the other terms are constant per query), so the backend also searches these shifted
queries (:meth:`DistributionNormalization.search_vectors`) and the re-ranked top-k is exact on an exact backend; with
``renormalize``, or a multi-vector gallery (its items ranked by ``max_t z_q . z_g,t - lam mu_q . single(z_g)``, which no
single search reproduces), the re-ranking is over those candidates, approximate.

Compose with any objective through ``TTAConfig(score_transform="dn", score_transform_config={...})``: the adapted
model's scores are normalised and DN's state is saved, loaded and reset with the wrapper's. Standalone,
``TTAConfig(objective="dn")`` normalises the source model's scores.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..configuration_utils import check_choice, check_positive
from .base import (
    LossOutput,
    Objective,
    ObjectiveConfig,
    ObjectiveInputs,
    ObjectiveState,
    config_field,
    register_objective,
    same_fingerprint,
)

QUERY_MEANS = ("samples", "running")
GALLERY_MEANS = ("samples", "all")


@dataclass
class DNConfig(ObjectiveConfig):
    lam: float = config_field(0.25, "lambda of (z_q - lambda mu_q).(z_g - lambda mu_g): 0.25 = the authors' code and reported numbers (default); 0.5 = the theory.")
    num_samples: int = config_field(100, "Unlabelled samples per modality for the means (DN*: 100).")
    query_mean: str = config_field("samples", "'samples' = mean of the first num_samples queries; 'running' = of all queries so far.")
    gallery_mean: str = config_field("samples", "'samples' = mean of num_samples random gallery items; 'all' = of the whole gallery.")
    renormalize: bool = config_field(False, "L2-normalise both sides after the subtraction (the authors' zero-shot code); retrieval: no.")

    def __post_init__(self):
        super().__post_init__()
        check_positive("lam", self.lam, allow_zero=True)
        check_positive("num_samples", self.num_samples)
        check_choice("query_mean", self.query_mean, QUERY_MEANS)
        check_choice("gallery_mean", self.gallery_mean, GALLERY_MEANS)


def dn_scores(
    scores: torch.Tensor, zq: torch.Tensor, zg: torch.Tensor, mu_q: torch.Tensor, mu_g: torch.Tensor, lam: float,
    renormalize: bool = False,
) -> torch.Tensor:
    """``(z_q - lam mu_q).(z_g - lam mu_g)`` expanded around the given ``scores`` (``= z_q . z_g`` for single vectors);
    with ``renormalize`` divided by ``||z_q - lam mu_q|| ||z_g - lam mu_g||``."""
    out = scores - lam * (zq @ mu_g)[:, None] - lam * (zg @ mu_q)[None, :] + lam**2 * (mu_q @ mu_g)
    if renormalize:
        out = out / ((zq - lam * mu_q).norm(dim=1)[:, None] * (zg - lam * mu_g).norm(dim=1)[None, :]).clamp(min=1e-12)
    return out


@register_objective("dn", DNConfig)
class DistributionNormalization(Objective):
    """Training-free re-scoring with mean-centred embeddings (DN Eq. S_(1))."""

    gallery_access = "stats"  # the gallery mean: computed once per backend (or a seeded sample gathered from it)
    requires_grad = False

    def init_state(self, device="cpu") -> ObjectiveState:
        return {
            "query_sum": torch.zeros(0, device=device),
            "query_count": torch.zeros((), dtype=torch.long, device=device),
            "gallery_mean": torch.zeros(0, device=device),
            "gallery_fingerprint": torch.zeros(0, dtype=torch.float64, device=device),
        }

    def _gallery_mean(self, inputs: ObjectiveInputs, state: ObjectiveState) -> torch.Tensor:
        zg = inputs.gallery_emb.detach().float()
        key = inputs.gallery_key()
        if not same_fingerprint(state, "gallery_fingerprint", key):
            n = inputs.num_items
            backend = inputs.backend
            if self.config.gallery_mean == "all" or self.config.num_samples >= n:
                mean = zg.mean(0) if backend is None else backend.statistics().mean.to(zg.device)
            else:
                gen = inputs.generator if inputs.generator is not None else torch.Generator().manual_seed(0)
                idx = torch.randperm(n, generator=gen)[: self.config.num_samples].to(zg.device)
                rows = zg[idx] if backend is None else backend.gather_single(idx).to(zg.device, torch.float32)
                mean = rows.mean(0)
            state["gallery_mean"] = mean
            state["gallery_fingerprint"] = key
        return state["gallery_mean"]

    def on_gallery_change(self, change, state: ObjectiveState) -> None:
        """The gallery mean is recomputed at the next step (of the whole new gallery, or a new seeded sample); the
        query mean is of the queries and stays."""
        state["gallery_mean"] = state["gallery_mean"][:0]
        state["gallery_fingerprint"] = state["gallery_fingerprint"][:0]

    def _next_query_sum(self, zq: torch.Tensor, state: ObjectiveState) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(query_sum, query_count)`` after this batch, or ``None`` when the batch does not count."""
        count = int(state["query_count"])
        total = state["query_sum"] if state["query_sum"].numel() else torch.zeros(zq.shape[1], device=zq.device)
        take = zq.shape[0] if self.config.query_mean == "running" else max(0, self.config.num_samples - count)
        if take <= 0:
            return None
        rows = zq[:take]
        return total + rows.sum(0), state["query_count"] + rows.shape[0]

    def _query_mean(self, inputs: ObjectiveInputs, state: ObjectiveState) -> torch.Tensor:
        nxt = self._next_query_sum(inputs.query_emb.detach().float(), state)
        if nxt is not None:
            state["query_sum"], state["query_count"] = nxt
        return state["query_sum"] / state["query_count"].clamp(min=1)

    def search_vectors(self, query_emb: torch.Tensor, state: ObjectiveState) -> torch.Tensor | None:
        """The shifted queries ``z_q - lam mu_q`` (with ``mu_q`` as :meth:`__call__` will compute it for this batch):
        their inner products with the gallery rank it as DN does (without ``renormalize``)."""
        if query_emb.dim() != 2 or self.config.lam == 0:
            return None
        nxt = self._next_query_sum(query_emb, state)
        total, count = nxt if nxt is not None else (state["query_sum"], state["query_count"])
        if not total.numel():
            return None
        return query_emb - self.config.lam * (total / count.clamp(min=1))

    def __call__(self, inputs: ObjectiveInputs, state: ObjectiveState) -> LossOutput:
        mu_g = self._gallery_mean(inputs, state)
        mu_q = self._query_mean(inputs, state)
        scores = dn_scores(
            inputs.scores.detach().float(), inputs.query_emb.detach().float(), inputs.gallery_emb.detach().float(),
            mu_q, mu_g, self.config.lam, self.config.renormalize,
        )
        return LossOutput(
            loss=None, n_selected=inputs.scores.shape[0], scores=scores,
            logs={"dn_query_count": state["query_count"]},
        )
