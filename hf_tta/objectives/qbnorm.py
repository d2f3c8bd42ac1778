"""QB-Norm with the Dynamic Inverted Softmax (Bogolin, Croitoru, Jin, Liu, Albanie, CVPR 2022,
https://arxiv.org/abs/2112.12777).

Code: github.com/ioanacroi/qb-norm (HEAD 76d4d90), ``dynamic_inverted_softmax.py``. Training-free: scores only. With
``p_b(g)`` the scores of the querybank's queries ``b`` against the gallery, the code (``qb_norm``, L20-32):

  1. the activation set ``A``: the gallery items among the top-``k`` of at least one querybank query
     (``get_retrieved_videos``, L7-11: ``argsort(-sims)[:, :k]``, ``unique``);
  2. the queries to normalise: those whose top-1 item (by their own scores) is in ``A``
     (``get_index_to_normalize``, L14-18: ``argsort(-sims)[:, 0]`` in ``A``);
  3. for those queries ``s'(q, g) = exp(beta s(q, g)) / sum_b exp(beta p_b(g))`` (L25-31: ``np.exp(... * beta)``,
     ``np.sum(train_test, axis=0)``, ``np.divide``); every other query keeps its raw scores ``s(q, g)``
     (L24: ``test_test_normalized = test_test`` is the unexponentiated matrix, whose other rows are not written).

Ranking is per query, so a row's mix of scales (exponentiated or raw) does not matter. Defaults ``beta = 20``, ``k = 1``:
the code's (L21-22 and the command line, L44-45); its README reports 20 for every model but CLIP2Video (1/1.99).

**The querybank** (:mod:`hf_tta.query_bank`): the paper's is the training split's captions; here by default the last
``bank_size`` (4096) queries of the stream, each batch normalised by the queries before it and then pushed, or a
user-supplied ``reference_bank``. An empty bank gives an empty ``A``, so nothing is normalised (the code's rule).

**Galleries.** Dense: ``A`` and the normalising sums from the bank's scores in column chunks (one ``M x N`` product per
batch, in float64 for the exponentials: ``exp(20)`` summed over 4096 queries). With a top-k backend ``A`` is exact (the
backend searches the bank's top-``k`` over the whole gallery) and each query's top-1 is exact on an exact backend (its
top-k are among the candidates); the normalising sums are of the candidates, which are re-ranked: an item outside a
query's top-k that normalisation would raise is not found, so the result is approximate. A multi-vector gallery
(BLIP-2 images) is scored as the model scores it; multi-vector queries are refused (the bank holds single vectors).

Compose with any objective through ``TTAConfig(score_transform="qbnorm", score_transform_config={...})``; standalone,
``TTAConfig(objective="qbnorm")`` normalises the source model's scores.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..configuration_utils import check_positive, check_positive_int
from ..query_bank import QueryBankConfig, column_chunks, current_bank, gallery_rows, init_bank, push
from .base import LossOutput, Objective, ObjectiveInputs, ObjectiveState, config_field, register_objective


@dataclass
class QBNormConfig(QueryBankConfig):
    beta: float = config_field(20.0, "Inverse temperature of the inverted softmax (the code's default and README: 20).")
    k: int = config_field(1, "Top-k items of each querybank query that form the activation set (the code's default: 1).")

    def __post_init__(self):
        super().__post_init__()
        check_positive("beta", self.beta)
        check_positive_int("k", self.k)


def dynamic_inverted_softmax(
    scores: torch.Tensor, log_norm: torch.Tensor, active: torch.Tensor, beta: float, columns: int | None = None
) -> torch.Tensor:
    """The Dynamic Inverted Softmax given the querybank's statistics (qb_norm, L20-32).

    Args:
        scores: ``(B, C)`` the queries' scores.
        log_norm: ``(C,)`` ``log sum_b exp(beta p_b(g))``, the log of L28's ``normalizing_sum`` (float64).
        active: ``(C,)`` bool, whether the column's item is in the activation set ``A`` (L23).
        beta: the inverse temperature (L22).
        columns: only the first ``columns`` columns are gallery items (a top-k backend's candidates; the rest, the
            objective's extras, are never a query's top-1); ``None``: all.
    Returns ``(B, C)`` in ``scores``' dtype: ``exp(beta s) / sum_b exp(beta p_b)`` for rows whose top-1 is in ``A``
    (L29-31; computed as ``exp(beta s - log_norm)`` in float64, which does not overflow), the raw scores elsewhere
    (L24)."""
    top1 = scores[:, :columns].argmax(dim=1)
    rows = active[top1]
    normalised = torch.exp(beta * scores.double() - log_norm[None, :]).to(scores.dtype)
    return torch.where(rows[:, None], normalised, scores)


def bank_statistics(
    bank: torch.Tensor, rows: torch.Tensor, beta: float, k: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(log_norm (C,), top values (M, k), top columns (M, k))`` of the bank's scores against the gallery ``rows``, in
    column chunks: the log normalising sums of L25/L28 and each bank query's top-``k`` columns (L7-9)."""
    logs, top_v, top_i = [], None, None
    for start, chunk in column_chunks(bank, rows):
        logs.append(torch.logsumexp(beta * chunk.double(), dim=0))
        v, i = chunk.topk(min(k, chunk.shape[1]), dim=1)
        if top_v is not None:
            v, i = torch.cat([top_v, v], dim=1), torch.cat([top_i, i + start], dim=1)
            v, pick = v.topk(min(k, v.shape[1]), dim=1)
            i = i.gather(1, pick)
        else:
            i = i + start
        top_v, top_i = v, i
    return torch.cat(logs), top_v, top_i


@register_objective("qbnorm", QBNormConfig)
class QueryBankNormalization(Objective):
    """Training-free re-scoring by the querybank's Dynamic Inverted Softmax (qb_norm, L20-32)."""

    gallery_access = "stats"  # the activation set: the bank's top-k over the whole gallery (a backend search)
    requires_grad = False
    multi_vector_queries = False  # the bank holds single-vector queries

    def init_state(self, device="cpu") -> ObjectiveState:
        return init_bank(self.config, device)

    def __call__(self, inputs: ObjectiveInputs, state: ObjectiveState) -> LossOutput:
        scores = inputs.scores.detach().float()
        bank = current_bank(inputs, state)
        normalised = torch.zeros(())
        if bank.shape[0]:
            cfg, ids = self.config, inputs.candidate_ids
            log_norm, _, top = bank_statistics(bank, gallery_rows(inputs), cfg.beta, cfg.k)
            if ids is None:  # dense: the columns are the gallery
                active = torch.zeros(scores.shape[1], dtype=torch.bool, device=scores.device)
                active[top.reshape(-1).to(scores.device)] = True
            else:  # top-k backend: A from the bank's search of the whole gallery; extras' columns are never in A
                found = inputs.backend.search(bank, cfg.k).indices
                active = torch.zeros(scores.shape[1], dtype=torch.bool, device=scores.device)
                active[: ids.numel()] = torch.isin(ids.to(scores.device), found.reshape(-1).to(scores.device))
            columns = None if ids is None else ids.numel()
            out = dynamic_inverted_softmax(scores, log_norm.to(scores.device), active, cfg.beta, columns)
            normalised = active[scores[:, :columns].argmax(dim=1)].float().mean()
            scores = out
        push(self.config, inputs, state)
        return LossOutput(loss=None, n_selected=inputs.scores.shape[0], scores=scores,
                          logs={"qbnorm_normalised": normalised, "qbnorm_bank": float(bank.shape[0])})
