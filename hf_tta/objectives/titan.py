"""TITAN: test-time training via counterfactual generation and causal intervention (Li et al., ACM MM 2023), for
text-video retrieval; here for any query/gallery pair. No public code; everything below follows the paper text.

Per step, with B queries:
  1. Cross-modal rematching (Sec. 3.2.1, Eq. 5): R_v[i, j] is the rank of gallery item j for query i (0 = best) and
     R_q[i, j] the rank of query i for item j among the queries (the batch, plus the last ``query_bank_size`` queries of
     the stream when set); the pseudo-match of query i is argmin_j R_v + alpha R_q (alpha = 1; ties broken by R_v), a
     mutual-rank correction of hubness.
  2. Counterfactual generation (Sec. 3.2.2), text queries only: a gallery item is a hub once more than beta = 30 queries
     of the stream had it as their one-way top-1 (counts in the state). For each query of the batch whose top-1 is a
     hub, the word the match relies on most is masked and the counterfactual query is added to the pseudo-pairs, its
     match found by rematching. The paper picks over-frequent nouns/verbs/adjectives with a POS tagger and a frequency
     threshold theta it does not give; a Hugging Face text tower exposes neither POS tags nor (through the pooled
     embedding) its attention, so the over-attended word is measured by occlusion: each token strictly between the
     first and last valid position (never [CLS]/<bos> or [SEP]/<eos>, where towers pool) is removed in turn
     (``attention_mask`` = 0) and re-embedded without grad (``ObjectiveInputs.reencode``); the ``mask_words`` tokens whose
     removal lowers the similarity to the hub most are masked (removed) in the counterfactual. Image queries have no
     words: step 2 is skipped for them.
  3. Update: a symmetric contrastive (InfoNCE) loss over the pseudo-pairs (original and counterfactual queries vs the
     distinct pseudo-matched gallery items of the batch), tau = 0.01. The paper only says the model is fine-tuned on
     the pseudo-labels; the base model's contrastive loss is the natural choice.

With a top-k gallery backend (``gallery_access="per_item"``) the match counts stay a dense N-vector keyed by global
gallery index (the candidates' top-1 are scattered into it) and everything else runs on the batch's candidate set C.
R_q (a column of the batch's scores) is exact on C; R_v is each query's rank among C, which equals its global rank for
its own top-k items and is >= k for every other item, so the rematched pseudo-match is the dense one whenever
k > alpha (B - 1 + query_bank_size) (k = 100 with batches of 64; no other item can beat the top-1's
R_v + alpha R_q <= alpha (B - 1 + bank)). Counterfactual text queries are scored against C, not searched themselves.

Causal bias correction (Sec. 3.3) needs confounder dictionaries built from action/object detectors, and its learned
parts (the projections w1..w5, g, the MLP and the variational mutual-information estimator) are first trained on
labelled *source* pairs, which a test-time library does not have. It is therefore implemented only in its
parameter-free form, and only when the user supplies confounder embeddings (``confounders_file``: a safetensors file
with a ``"confounders"`` tensor ``(K, D)`` in the joint embedding space): with identity projections and the MLP a sum,
Eq. 9-11 give, for the top-``cbc_eta`` (10) candidates j of query i,
    s'_ij = s_ij + cbc_weight * q_i . E_ij,    E_ij = sum_k softmax_k((q_i + v_j) . c_k / sqrt(D)) c_k,
which re-ranks the candidates before rematching. The test-bias amplification (Eq. 13-14) exists only through its
mutual-information training signal and is left out.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..configuration_utils import check_positive
from .base import (
    LossOutput,
    Objective,
    ObjectiveConfig,
    ObjectiveInputs,
    ObjectiveState,
    adopt_fingerprint,
    config_field,
    mark_gallery_changed,
    register_objective,
)


@dataclass
class TITANConfig(ObjectiveConfig):
    tau: float = config_field(0.01, "Temperature of the contrastive loss on the pseudo-pairs.")
    alpha: float = config_field(1.0, "Weight of the reverse (gallery->query) rank in rematching (Eq. 5: 1).")
    hub_threshold: int = config_field(30, "beta: a gallery item matched by more than this many queries is a hub (paper: 30).")
    counterfactual: bool = config_field(True, "Counterfactual masking of hub-matched text queries.")
    mask_words: int = config_field(1, "Tokens masked in each counterfactual query (the most relied-upon ones).")
    query_bank_size: int = config_field(0, "Past queries (detached) also ranked in R_q; 0 = the batch only.")
    symmetric: bool = config_field(True, "Both directions of the InfoNCE loss (query->gallery and gallery->query).")
    confounders_file: str | None = config_field(None, "safetensors file with a 'confounders' (K, D) tensor: enables bias correction.")
    cbc_eta: int = config_field(10, "eta: candidates per query re-scored by the bias correction (paper: 10).")
    cbc_weight: float = config_field(1.0, "Weight of the confounder term in the corrected score.")

    def __post_init__(self):
        super().__post_init__()
        check_positive("tau", self.tau)
        check_positive("alpha", self.alpha, allow_zero=True)
        check_positive("hub_threshold", self.hub_threshold, allow_zero=True)
        check_positive("mask_words", self.mask_words)
        check_positive("query_bank_size", self.query_bank_size, allow_zero=True)
        check_positive("cbc_eta", self.cbc_eta)
        check_positive("cbc_weight", self.cbc_weight, allow_zero=True)


# ----------------------------------------------------------------------------------------------- equations
def descending_ranks(scores: torch.Tensor, dim: int) -> torch.Tensor:
    """Rank (0 = highest score) of every entry along ``dim``; ties in index order."""
    order = scores.argsort(dim=dim, descending=True, stable=True)
    ranks = torch.empty_like(order)
    src = torch.arange(scores.shape[dim], device=scores.device)
    shape = [1] * scores.dim()
    shape[dim] = -1
    return ranks.scatter_(dim, order, src.view(shape).expand_as(order))


def rematch(scores: torch.Tensor, alpha: float = 1.0, extra_queries: torch.Tensor | None = None) -> torch.Tensor:
    """Eq. 5: ``argmin_j R_v[i, j] + alpha R_q[i, j]`` for each row of ``scores`` (ties: the better R_v).
    ``extra_queries`` ``(M, N)`` are scores of other queries that take part in R_q only."""
    s = scores.detach()
    r_v = descending_ranks(s, dim=1)
    pool = s if extra_queries is None or extra_queries.numel() == 0 else torch.cat([s, extra_queries.to(s)])
    r_q = descending_ranks(pool, dim=0)[: s.shape[0]]
    degree = r_v.double() + alpha * r_q.double()
    key = degree * (s.shape[1] + 1) + r_v.double()
    return key.argmin(dim=1)


def contrastive_pseudo_pair_loss(scores: torch.Tensor, targets: torch.Tensor, tau: float, symmetric: bool = True):
    """InfoNCE over the distinct pseudo-matched items: rows = queries, columns = ``unique(targets)``. The
    gallery->query direction averages, for each item, the log-probabilities of the queries matched to it.
    Returns ``(loss, columns)``."""
    cols, target_col = torch.unique(targets, return_inverse=True)
    logits = scores[:, cols] / tau
    loss = F.cross_entropy(logits, target_col)
    if symmetric:
        log_q = logits.log_softmax(dim=0)  # each item's distribution over the queries
        member = F.one_hot(target_col, cols.numel()).to(logits.dtype)  # (R, U)
        col_loss = -(log_q * member).sum(0) / member.sum(0)
        loss = 0.5 * (loss + col_loss.mean())
    return loss, cols


def confounder_correction(scores, zq, zg, confounders, eta, weight):
    """Parameter-free backdoor adjustment of the top-``eta`` scores of each query (see the module docstring)."""
    s = scores.clone()
    eta = min(eta, s.shape[1])
    top = scores.detach().topk(eta, dim=1).indices  # (B, eta)
    v = zg[top]  # (B, eta, D)
    c = confounders.to(zq)
    att = torch.softmax((zq[:, None, :] + v) @ c.T / math.sqrt(zq.shape[1]), dim=-1)  # (B, eta, K)
    expectation = att @ c  # (B, eta, D)
    bonus = weight * (zq[:, None, :] * expectation).sum(-1)
    return s.scatter_add(1, top, bonus)


def occlusion_masks(
    inputs: dict, rows: torch.Tensor, targets: torch.Tensor, reencode, mask_words: int
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Counterfactual attention masks of ``rows``: their ``mask_words`` most relied-upon inner tokens removed
    (attention_mask 0), measured by the drop of the similarity to ``targets`` when each inner token alone is removed.
    Returns ``(attention_mask (R, L), changed (R,))``; rows with fewer than two inner tokens are left unchanged."""
    ids = inputs["input_ids"][rows.to(inputs["input_ids"].device)]
    mask = inputs.get("attention_mask")
    mask = mask[rows.to(mask.device)] if mask is not None else torch.ones_like(ids)
    variants, owners, positions = [], [], []
    for r in range(ids.shape[0]):
        valid = mask[r].nonzero().flatten()
        for pos in valid[1:-1].tolist():
            m = mask[r].clone()
            m[pos] = 0
            variants.append(m)
            owners.append(r)
            positions.append(pos)
    if not variants:
        return None
    owners_t = torch.tensor(owners)
    occluded = torch.stack(variants)

    def occlude(q: dict) -> dict:
        out = {k: v[rows.to(v.device)][owners_t.to(v.device)] for k, v in q.items() if isinstance(v, torch.Tensor)}
        out["attention_mask"] = occluded.to(ids.device)
        return out

    with torch.no_grad():
        _, occ_scores = reencode(occlude)
        _, base_scores = reencode(lambda q: {k: v[rows.to(v.device)] for k, v in q.items() if isinstance(v, torch.Tensor)})
    tgt = targets.to(occ_scores.device)
    owners_d, tgt_o = owners_t.to(occ_scores.device), tgt[owners_t.to(tgt.device)]
    drop = (base_scores[owners_d, tgt_o] - occ_scores[torch.arange(len(owners), device=occ_scores.device), tgt_o]).cpu()
    new_mask = mask.clone()
    changed = torch.zeros(ids.shape[0], dtype=torch.bool)
    pos_t = torch.tensor(positions)
    for r in range(ids.shape[0]):
        mine = (owners_t == r).nonzero().flatten()
        if mine.numel() < 2:  # keep at least one inner token
            continue
        worst = mine[drop[mine].argsort(descending=True, stable=True)[: min(mask_words, mine.numel() - 1)]]
        new_mask[r, pos_t[worst].to(new_mask.device)] = 0
        changed[r] = True
    return new_mask, changed


# ----------------------------------------------------------------------------------------------- objective
@register_objective("titan", TITANConfig)
class TITAN(Objective):
    """Rematched pseudo-pairs (+ counterfactual text queries) fitted with a contrastive loss."""

    gallery_access = "per_item"  # per-item match counts (hubs): an N-vector keyed by global gallery index

    def init_state(self, device="cpu") -> ObjectiveState:
        state = {
            "match_counts": torch.zeros(0, dtype=torch.long, device=device),
            "gallery_fingerprint": torch.zeros(0, dtype=torch.float64, device=device),
            "query_bank": torch.zeros(0, device=device),
        }
        if self.config.confounders_file:
            from safetensors.torch import load_file

            tensors = load_file(self.config.confounders_file, device=str(device))
            if "confounders" not in tensors:
                raise ValueError(f"{self.config.confounders_file!r} has no 'confounders' tensor (keys: {sorted(tensors)}).")
            state["confounders"] = tensors["confounders"].float()
        return state

    def on_gallery_change(self, change, state: ObjectiveState) -> None:
        """Match counts follow their items: removed items' counts go, added items start at 0, and a replaced item
        starts again at 0 (it is another item now); the past queries (the bank) stay."""
        counts = state["match_counts"]
        if counts.numel() == 0:
            return
        counts = change.remap_vector(counts)
        if change.kind == "replace":
            counts = counts.index_fill(0, change.positions.to(counts.device), 0)
        state["match_counts"] = counts
        mark_gallery_changed(state, "gallery_fingerprint", change.new_size)

    def __call__(self, inputs: ObjectiveInputs, state: ObjectiveState) -> LossOutput:
        c = self.config
        scores, zq, zg = inputs.scores, inputs.query_emb, inputs.gallery_emb
        key = inputs.gallery_key()
        if not adopt_fingerprint(state, "gallery_fingerprint", key, inputs.num_items):  # a new gallery: start again
            state["match_counts"] = torch.zeros(inputs.num_items, dtype=torch.long, device=zg.device)
            state["query_bank"] = state["query_bank"][:0]
            state["gallery_fingerprint"] = key
        ranked = scores
        if "confounders" in state:
            ranked = confounder_correction(scores.detach(), zq.detach(), zg, state["confounders"], c.cbc_eta, c.cbc_weight)
        bank = state["query_bank"]
        bank_scores = bank @ zg.T if bank.numel() else None
        top1 = ranked.detach().argmax(dim=1)
        top1_item = inputs.global_ids(top1)  # gallery index (a top-k backend's columns are its candidates)
        if inputs.step == 0 and not inputs.in_closure:
            counts = state["match_counts"]
            state["match_counts"] = counts.index_add(0, top1_item.to(counts.device), torch.ones_like(top1_item).to(counts))
        rows_scores, n_cf = scores, 0
        hubs = state["match_counts"][top1_item.to(state["match_counts"].device)] > c.hub_threshold
        if (
            c.counterfactual and inputs.query_modality == "text" and hubs.any() and inputs.reencode is not None
            and inputs.queries is not None and "input_ids" in inputs.queries
        ):
            rows = hubs.nonzero().flatten()
            edit = occlusion_masks(dict(inputs.queries), rows, top1[rows], inputs.reencode, c.mask_words)
            if edit is not None and edit[1].any():
                keep = edit[1].nonzero().flatten()
                rows, cf_mask = rows[keep.to(rows.device)], edit[0][keep.to(edit[0].device)]

                def counterfactual(q: dict) -> dict:
                    out = {k: v[rows.to(v.device)] for k, v in q.items() if isinstance(v, torch.Tensor)}
                    out["attention_mask"] = cf_mask
                    return out

                _, cf_scores = inputs.reencode(counterfactual)
                rows_scores = torch.cat([scores, cf_scores])
                n_cf = rows.numel()
        ranked_rows = ranked if n_cf == 0 else torch.cat([ranked, rows_scores[-n_cf:].detach()])
        targets = rematch(ranked_rows, c.alpha, bank_scores)
        loss, cols = contrastive_pseudo_pair_loss(rows_scores, targets, c.tau, c.symmetric)
        if c.query_bank_size and inputs.step == 0 and not inputs.in_closure:
            state["query_bank"] = torch.cat([bank.reshape(-1, zq.shape[1]), zq.detach()])[-c.query_bank_size :]
        b = scores.shape[0]
        return LossOutput(
            loss=loss,
            n_selected=rows_scores.shape[0],
            logits=scores[:, cols] / c.tau,
            candidates=cols[None, :].expand(b, -1),
            temperature=c.tau,
            logs={
                "rematched": (targets[:b] != top1).float().mean(),
                "counterfactuals": n_cf,
                "hubs": (state["match_counts"] > c.hub_threshold).sum(),
            },
        )
