"""REST: Robust adaptation with quEry ShifT (Li, Yang, Peng; the journal extension of TCR), Sec. III, Eq. 3-14.

Paper: "Toward Robust and Harmonious Adaptation for Cross-modal Retrieval". No public REST code; what REST shares with
TCR follows TCR's code (github.com/XLearning-SCU/2025-ICLR-TCR, de2e102), as in ``hf_tta.objectives.tcr``.

Per step, with B queries:
  * refined candidate set of query i (Eq. 4): its top-1 gallery neighbour (the pseudo-positive, column 0), the union of
    the top-K neighbours of the *other* queries of the batch ("sample negatives") and K k-means centroids of the gallery
    ("cluster negatives"); K = 10 for both. Refined prediction p̂_i = softmax(z_i^Q z^{G'}_i^T / tau), tau = 0.02 (Eq. 5);
  * the TCR queue of source-like pairs (Eq. 6-8) gives Delta_S and the entropy threshold E_B; E is the entropy of p̂;
  * L = L_U (Eq. 9) + L_G (Eq. 10) + L_REM (Eq. 12) + L_RHM (Eq. 14), all weights 1.

Choices where the paper is silent (each configurable):
  * Eq. 4 writes a union, so repeated gallery items in a row (the positive among the other queries' neighbours, or an
    item in the top-K of two queries) are counted once: their later copies are masked out of the softmax. Every row
    keeps the same width 1 + (B-1)K + K, so the rows stay one tensor.
  * k-means (spherical, cosine, k-means++ initialisation, at most ``kmeans_iters`` Lloyd iterations) runs once on the
    cached gallery, with the wrapper's seeded RNG, and is cached in the state (labels and per-cluster scales, tensors
    only; recomputed when the gallery changes, cleared by reset). A centroid's score is computed from the query's
    gallery scores: z.c_k = sum_{j in S_k} z.z_j / (|S_k| ||mean_k||), exactly the cosine with the normalised centroid
    for single-vector embeddings. That keeps the candidate logits a function of the score matrix, so gradient
    decoupling can form the source model's prediction over the very same candidates.
  * L_RHM (Eq. 14): H_i = -log c_ij + log c_ik with j the pseudo-positive and k the *hardest* negative, i.e. the
    highest-scoring other candidate of the refined set (sample or cluster negative; the paper's "corresponding hard
    negative"). The consistency c in [0, 1] is the cosine mapped affinely, c = (1 + cos) / 2 (``consistency="affine"``):
    it keeps the order of cosines, is defined for every cosine, and adds no temperature, so the hard-mining term does not
    simply duplicate the entropy term's 1/tau scale. ``"clamp"`` (max(cos, eps)) and ``"softmax"`` (the refined
    probabilities p̂, so H = (s_k - s_j) / tau) are the other readings. W and the query mask are those of L_REM.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..configuration_utils import check_choice, check_positive
from ..gallery.stats import blocked_spherical_kmeans, tensor_blocks
from .base import (
    LossOutput,
    Objective,
    ObjectiveInputs,
    ObjectiveState,
    config_field,
    gallery_fingerprint,
    register_objective,
    same_gallery,
    softmax_entropy,
)
from .tcr import (
    TCRConfig,
    gap_loss,
    init_queue_state,
    maybe_update_queue,
    noise_robust_entropy,
    queue_constraints,
    uniformity_loss,
)

MASKED_LOGIT = -1e9  # a masked candidate: probability exactly 0, finite everywhere (no 0 * inf)
CONSISTENCY_MAPS = ("affine", "clamp", "softmax")


@dataclass
class RESTConfig(TCRConfig):
    """REST's hyper-parameters. The inherited TCR fields keep their names: ``weight_mu`` weighs L_U, ``weight_mg`` L_G
    and ``weight_na`` L_REM; tau = 0.02, the queue (30% source-like pairs, first 10 batches) and t = 10 are TCR's."""

    num_neighbours: int = config_field(10, "K of Eq. 4: top-K neighbours of each other query of the batch (sample negatives).")
    num_clusters: int = config_field(10, "K of Eq. 4: k-means centroids of the gallery (cluster negatives).")
    kmeans_iters: int = config_field(50, "Maximum Lloyd iterations of the gallery k-means (stops earlier when stable).")
    consistency: str = config_field("affine", "Map of the cosine to c in [0,1] in L_RHM: 'affine' (1+cos)/2, 'clamp', 'softmax'.")
    weight_rhm: float = config_field(1.0, "Weight of L_RHM (Eq. 3: 1).")
    consistency_eps: float = config_field(1e-6, "Floor of c inside the logarithms of L_RHM.")

    def __post_init__(self):
        super().__post_init__()
        check_positive("num_neighbours", self.num_neighbours)
        check_positive("num_clusters", self.num_clusters, allow_zero=True)
        check_positive("kmeans_iters", self.kmeans_iters)
        check_positive("weight_rhm", self.weight_rhm, allow_zero=True)
        check_positive("consistency_eps", self.consistency_eps)
        check_choice("consistency", self.consistency, CONSISTENCY_MAPS)


# ----------------------------------------------------------------------------------------------- k-means
def spherical_kmeans(
    x: torch.Tensor, k: int, generator: torch.Generator | None = None, iters: int = 50
) -> tuple[torch.Tensor, torch.Tensor]:
    """Cosine k-means of the rows of ``x`` (assumed L2-normalised): k-means++ seeding with ``generator`` (CPU draws,
    so it is deterministic on any device), then Lloyd iterations until the assignment is stable. An empty cluster keeps
    its previous centre. Returns ``(centroids (k, D) normalised, labels (N,))``; ``k`` is capped at ``N``. Computed in
    blocks of ``hf_tta.gallery.stats.BLOCK_ROWS`` rows by the code a top-k backend's :meth:`~hf_tta.gallery.GalleryBackend.kmeans`
    runs, so both give the same result on the same vectors."""
    x = x.detach().float()
    gen = generator if generator is not None else torch.Generator().manual_seed(0)
    centroids, labels, _, _ = blocked_spherical_kmeans(tensor_blocks(x), x.shape[0], lambda i: x[i], k, gen, iters)
    return centroids, labels


def centroid_score_scale(x: torch.Tensor, labels: torch.Tensor, k: int) -> torch.Tensor:
    """``1 / (|S_k| ||mean_k||)``, so that ``scale_k * sum_{j in S_k} z.x_j`` is the cosine of ``z`` with the normalised
    centroid of cluster k (0 for an empty cluster)."""
    x = x.detach().float()
    counts = torch.bincount(labels, minlength=k).float()
    means = torch.zeros(k, x.shape[1], device=x.device).index_add_(0, labels, x) / counts.clamp(min=1)[:, None]
    norms = means.norm(dim=1)
    return torch.where(counts > 0, 1 / (counts * norms).clamp(min=1e-12), torch.zeros_like(norms))


def centroid_scores(scores: torch.Tensor, labels: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Scores ``(B, K)`` of the queries against the k-means centroids, from their gallery scores ``(B, N)``."""
    summed = torch.zeros(scores.shape[0], scale.shape[0], device=scores.device, dtype=scores.dtype)
    return summed.index_add(1, labels, scores) * scale.to(scores.dtype)


# ----------------------------------------------------------------------------------------------- candidates
def duplicate_mask(idx: torch.Tensor) -> torch.Tensor:
    """``True`` where an entry repeats one further left in its row (the first occurrence is kept)."""
    if idx.shape[1] < 2:
        return torch.zeros_like(idx, dtype=torch.bool)
    sorted_idx, order = idx.sort(dim=1, stable=True)
    dup_sorted = torch.zeros_like(sorted_idx, dtype=torch.bool)
    dup_sorted[:, 1:] = sorted_idx[:, 1:] == sorted_idx[:, :-1]
    return torch.zeros_like(dup_sorted).scatter(1, order, dup_sorted)


def candidate_indices(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Eq. 4 without the centroids: ``(idx (B, 1 + (B-1)k), repeated (B, 1 + (B-1)k))``. Row i holds its top-1 gallery
    item, then the top-k items of every other query in batch order; ``repeated`` marks the later copies of an item."""
    b = scores.shape[0]
    k = min(k, scores.shape[1])
    top = scores.detach().topk(k, dim=1).indices  # (B, k)
    others = ~torch.eye(b, dtype=torch.bool, device=scores.device).repeat_interleave(k, dim=1)  # (B, B*k)
    neg = top.reshape(1, -1).expand(b, -1)[others].view(b, (b - 1) * k)
    idx = torch.cat([top[:, :1], neg], dim=1)
    return idx, duplicate_mask(idx)


def make_logits_fn(idx, repeated, labels, scale, tau, centroid_columns: int | None = None):
    """``scores (B, N) -> refined logits (B, C)`` over the fixed candidate set (gallery columns, then centroids).
    ``centroid_columns``: the centroids' scores are the columns from this one on (a top-k backend's candidate view,
    where the centroids are scored as extra candidates) instead of being formed from ``labels`` and ``scale``."""

    def logits_fn(scores: torch.Tensor) -> torch.Tensor:
        sims = scores.gather(1, idx).masked_fill(repeated, 0.0)
        cent = _centroid_part(scores, labels, scale, centroid_columns)
        if cent is not None:
            sims = torch.cat([sims, cent], dim=1)
        mask = _full_mask(repeated, sims.shape[1])
        return (sims / tau).masked_fill(mask, MASKED_LOGIT)

    return logits_fn


def _centroid_part(scores, labels, scale, centroid_columns: int | None) -> torch.Tensor | None:
    if centroid_columns is not None:
        return scores[:, centroid_columns:] if scores.shape[1] > centroid_columns else None
    if labels is not None and labels.numel():
        return centroid_scores(scores, labels, scale)
    return None


def _full_mask(repeated: torch.Tensor, width: int) -> torch.Tensor:
    pad = width - repeated.shape[1]
    return F.pad(repeated, (0, pad), value=False) if pad else repeated


def candidate_similarities(
    scores, idx, repeated, labels, scale, centroid_columns: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Cosine similarities ``(B, C)`` of each query with its candidates and the validity mask (``True`` = masked)."""
    sims = scores.gather(1, idx)
    cent = _centroid_part(scores, labels, scale, centroid_columns)
    if cent is not None:
        sims = torch.cat([sims, cent], dim=1)
    return sims, _full_mask(repeated, sims.shape[1])


def hard_mining_loss(
    sims: torch.Tensor, logits: torch.Tensor, masked: torch.Tensor, consistency: str, eps: float
) -> torch.Tensor:
    """Eq. 14's per-query ``H_i = -log c_i,pos + log c_i,hard`` (column 0 is the positive; the hard negative is the
    highest-similarity unmasked other candidate)."""
    other = sims.detach().masked_fill(masked, float("-inf"))
    other[:, 0] = float("-inf")
    hard = other.argmax(dim=1)
    rows = torch.arange(sims.shape[0], device=sims.device)
    if consistency == "softmax":
        logp = logits.log_softmax(dim=1)
        return -logp[:, 0] + logp[rows, hard]
    if consistency == "affine":
        c = (1 + sims) / 2
    else:  # clamp
        c = sims
    c = c.clamp(min=eps)
    return -c[:, 0].log() + c[rows, hard].log()


# ----------------------------------------------------------------------------------------------- objective
@register_objective("rest", RESTConfig)
class REST(Objective):
    """``L = L_U + L_G + L_REM + L_RHM`` on the refined candidate sets of Eq. 4-5 (REST Eq. 3).

    With a top-k gallery backend the k-means runs once on the backend (:meth:`GalleryBackend.kmeans`, seeded with
    ``TTAConfig.seed``, cached and saved with it) and its centroids are scored as extra candidates; the top-1 and the
    other queries' top-K lie in the candidate set (the backend searches at least K per query), so REST is exact on an
    exact backend. The dense path draws its k-means seeding from the wrapper's RNG at first use: the same draws on a
    fresh stream (the same centroids), not after a gallery change mid-stream.
    """

    gallery_access = "stats"  # k-means centroids of the whole gallery (Eq. 4): computed once per backend

    def __init__(self, config=None):
        super().__init__(config)
        self.gallery_k = self.config.num_neighbours  # each query's top-K must be among the candidates

    def candidate_extras(self, backend, seed: int) -> torch.Tensor | None:
        k = self.config.num_clusters
        return backend.kmeans(k, self.config.kmeans_iters, seed).centroids if k else None

    def init_state(self, device="cpu") -> ObjectiveState:
        state = init_queue_state(device)
        state.update(
            kmeans_labels=torch.zeros(0, dtype=torch.long, device=device),
            kmeans_scale=torch.zeros(0, device=device),
            kmeans_fingerprint=torch.zeros(0, dtype=torch.float64, device=device),
        )
        return state

    def on_gallery_change(self, change, state: ObjectiveState) -> None:
        """The dense path's k-means (labels keyed by position) is dropped and recomputed at the next step; a top-k
        backend drops its own cached k-means when it changes."""
        state["kmeans_labels"] = state["kmeans_labels"][:0]
        state["kmeans_scale"] = state["kmeans_scale"][:0]
        state["kmeans_fingerprint"] = state["kmeans_fingerprint"][:0]

    def clusters(self, inputs: ObjectiveInputs, state: ObjectiveState) -> tuple[torch.Tensor, torch.Tensor]:
        """The cached gallery k-means (computed on first use and whenever the gallery changes)."""
        k = self.config.num_clusters
        if k and not same_gallery(state, "kmeans_fingerprint", inputs.gallery_emb):
            _, labels = spherical_kmeans(inputs.gallery_emb, k, inputs.generator, self.config.kmeans_iters)
            state["kmeans_labels"] = labels
            state["kmeans_scale"] = centroid_score_scale(inputs.gallery_emb, labels, min(k, inputs.gallery_emb.shape[0]))
            state["kmeans_fingerprint"] = gallery_fingerprint(inputs.gallery_emb)
        return state["kmeans_labels"], state["kmeans_scale"]

    def __call__(self, inputs: ObjectiveInputs, state: ObjectiveState) -> LossOutput:
        c = self.config
        if inputs.candidate_ids is None:
            labels, scale = self.clusters(inputs, state)
            n_cols = None
        else:  # a top-k backend: candidate columns, then the centroids (candidate_extras)
            labels = scale = None
            n_cols = inputs.candidate_ids.numel()
        idx, repeated = candidate_indices(inputs.scores[:, :n_cols], c.num_neighbours)
        logits_fn = make_logits_fn(idx, repeated, labels, scale, c.tau, n_cols)
        logits = logits_fn(inputs.scores)
        zg = inputs.gallery_emb[idx[:, 0]]  # pseudo-positives
        maybe_update_queue(c, inputs, state, zg, logits)
        if state["queue_si"].numel() == 0:
            return LossOutput(loss=None, n_selected=0, logs={"queue_size": 0.0})
        delta_s, e_max = queue_constraints(state)
        zq = inputs.query_emb
        entropy = softmax_entropy(logits)
        l_rem, mask = noise_robust_entropy(entropy, e_max, c.entropy_eps)
        weight = (1 - entropy.detach() / (e_max + c.entropy_eps)).clamp(min=0)
        sims, masked = candidate_similarities(inputs.scores, idx, repeated, labels, scale, n_cols)
        h = hard_mining_loss(sims, logits, masked, c.consistency, c.consistency_eps)
        l_rhm = (weight * h)[mask].mean() if mask.any() else (h * 0).sum()
        l_u = uniformity_loss(zq, c.uniformity_t)
        l_g = gap_loss(zq, zg, delta_s)
        loss = c.weight_mu * l_u + c.weight_mg * l_g + c.weight_na * l_rem + c.weight_rhm * l_rhm
        return LossOutput(
            loss=loss,
            n_selected=int(mask.sum()),
            logits=logits,
            logits_fn=logits_fn,
            temperature=c.tau,
            logs={
                "loss_u": l_u.detach(),
                "loss_g": l_g.detach(),
                "loss_rem": l_rem.detach(),
                "loss_rhm": l_rhm.detach(),
                "delta_s": delta_s,
                "entropy_threshold": e_max,
                "candidates": (~masked).sum(1).float().mean(),
            },
        )
