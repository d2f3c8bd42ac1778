"""NNN: Nearest Neighbor Normalization (Chowdhury, Wang, Shenoy, Kiela, Schwettmann, Thrush, EMNLP 2024,
https://arxiv.org/abs/2410.24114).

Code: github.com/multimodal-interpretability/nnn (HEAD cea80de). Training-free: scores only. Each gallery item ``g``
gets a bias, the mean of its ``k`` highest scores against a bank of reference queries ``R``, and a query's score is
shifted by ``alpha`` times that bias (the paper's bias score and corrected score):

    b(g)      = (1/k) sum_{r in top-k_R s(r, g)} s(r, g)          nnn/nnn_retriever.py L28-42 (compute_alignment_means:
                                                                   einsum, torch.topk(..., alternate_ks, dim=1), mean)
    s'(q, g)  = s(q, g) - alpha * b(g)                             nnn/nnn_retriever.py L61-69 (retrieve:
                                                                   einsum(...) - alternate_weight * alignment_means.T)

A hub (an item close to many queries) gets a large bias and is pushed down for every query. Defaults ``k = 128``,
``alpha = 0.75``: the authors' README ("in general alternate_ks=128 and alternate_weight=0.75 works pretty well") and
their end-to-end example (examples/nnn_clip_flickr_30k.py L16-17); the ``NNNRanker`` constructor's own defaults are
``alternate_ks=256``, ``alternate_weight=0.5`` (nnn/nnn_ranker.py L13, L15), available as config values.

**The reference queries** (:mod:`hf_tta.query_bank`): the paper's are the training split's captions; here by default
the last ``bank_size`` (4096) queries of the stream, each batch scored against the queries before it and then pushed,
or a user-supplied ``reference_bank``. The reference code's ``torch.topk`` needs ``k`` reference queries; until the
stream's bank holds ``k`` the scores pass through unchanged (``TTAOutput.logs["nnn_active"] = 0``).

**Galleries.** Dense: the bias of every item, from the bank's scores in column chunks (one ``M x N`` product per batch,
never held whole). With a top-k backend the bias of the batch's candidates only, and the candidates re-ranked by ``s'``:
an item outside a query's top-k whose bias is much lower could rank inside under ``s'`` and is not found, so the result
is approximate (the authors' Faiss retriever instead indexes ``[g, b(g)]`` against ``[q, -alpha]``, which needs the
bias of every item at index time). A multi-vector gallery (BLIP-2 images) is scored as the model scores it (the max
over each item's vectors); multi-vector queries are refused (the bank holds single vectors).

Compose with any objective through ``TTAConfig(score_transform="nnn", score_transform_config={...})``; standalone,
``TTAConfig(objective="nnn")`` corrects the source model's scores.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..configuration_utils import check_positive, check_positive_int
from ..query_bank import QueryBankConfig, column_chunks, current_bank, gallery_rows, init_bank, push
from .base import LossOutput, Objective, ObjectiveInputs, ObjectiveState, config_field, register_objective


@dataclass
class NNNConfig(QueryBankConfig):
    k: int = config_field(128, "Reference queries per gallery item in its bias (alternate_ks; README and example: 128).")
    alpha: float = config_field(0.75, "Weight of the bias subtracted from every score (alternate_weight; README and example: 0.75).")

    def __post_init__(self):
        super().__post_init__()
        check_positive_int("k", self.k)
        check_positive("alpha", self.alpha, allow_zero=True)
        if self.reference_bank is None and self.k > self.bank_size:
            raise ValueError(f"NNN averages k={self.k} reference queries per item: `bank_size` must be >= k, got {self.bank_size}.")


def nnn_bias(bank: torch.Tensor, rows: torch.Tensor, k: int) -> torch.Tensor:
    """``b(g)``: the mean of each gallery row's ``k`` highest scores against the bank ``(M, D)``, ``M >= k``
    (nnn_retriever.py L28-42), computed in column chunks. ``(C,)`` float32."""
    return torch.cat([scores.topk(k, dim=0).values.mean(dim=0) for _, scores in column_chunks(bank, rows)])


def nnn_scores(scores: torch.Tensor, bias: torch.Tensor, alpha: float) -> torch.Tensor:
    """``s(q, g) - alpha * b(g)`` (nnn_retriever.py L64-69)."""
    return scores - alpha * bias.to(scores)[None, :]


@register_objective("nnn", NNNConfig)
class NearestNeighborNormalization(Objective):
    """Training-free re-scoring with a per-item bias from the reference queries (nnn_retriever.py L28-42, L61-69)."""

    gallery_access = "topk"  # the bias of the batch's candidates only (approximate re-ranking with a top-k backend)
    requires_grad = False
    multi_vector_queries = False  # the bank holds single-vector queries

    def init_state(self, device="cpu") -> ObjectiveState:
        state = init_bank(self.config, device)
        if self.config.reference_bank is not None and state["bank"].shape[0] < self.config.k:
            raise ValueError(f"`reference_bank` holds {state['bank'].shape[0]} queries; NNN averages k={self.config.k}: "
                             "give more reference queries or a smaller k.")
        return state

    def __call__(self, inputs: ObjectiveInputs, state: ObjectiveState) -> LossOutput:
        scores = inputs.scores.detach().float()
        bank = current_bank(inputs, state)
        active = bank.shape[0] >= self.config.k
        if active:
            scores = nnn_scores(scores, nnn_bias(bank, gallery_rows(inputs), self.config.k), self.config.alpha)
        push(self.config, inputs, state)
        return LossOutput(loss=None, n_selected=inputs.scores.shape[0], scores=scores,
                          logs={"nnn_active": float(active), "nnn_bank": float(bank.shape[0])})
