"""Shared helpers of the objective tests (tests/test_objectives_*.py): objective inputs built from small tensors, the
closed-form fixed batch of the baseline-fidelity tests, and hand-computed entropies."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from hf_tta.objectives import ObjectiveInputs

# ----------------------------------------------------------------------------------------------- inputs from tensors


def entropy_two(d: float) -> float:
    """Entropy of softmax([d, 0]) by hand."""
    p = 1 / (1 + math.exp(-d))
    return -(p * math.log(p) + (1 - p) * math.log(1 - p))


def score_inputs(scores: torch.Tensor, zq=None, zg=None, **kw) -> ObjectiveInputs:
    """Inputs around a score matrix; embeddings (when not given) drawn from the global RNG, a seeded generator."""
    zq = zq if zq is not None else F.normalize(torch.randn(scores.shape[0], 4), dim=1)
    zg = zg if zg is not None else F.normalize(torch.randn(scores.shape[1], 4), dim=1)
    return ObjectiveInputs(query_emb=zq, gallery_emb=zg, scores=scores, generator=torch.Generator().manual_seed(0), **kw)


def embedding_inputs(zq: torch.Tensor, zg: torch.Tensor, step: int = 0, batch_index: int = 0) -> ObjectiveInputs:
    """Inputs of the embedding objectives (TCR, training-free TCR): scores = zq @ zg^T."""
    return ObjectiveInputs(query_emb=zq, gallery_emb=zg, scores=zq @ zg.T, step=step, batch_index=batch_index)


# ----------------------------------------------------------------------------------------------- the fidelity batch
B, C = 64, 3


def fixed_batch() -> tuple[torch.Tensor, list[float]]:
    """Row i scores ``[a_i, 0, 0]`` with ``a_i = 0.1 i`` (float64): entropies strictly decrease with i, in closed form."""
    a = [0.1 * i for i in range(B)]
    scores = torch.tensor([[x, 0.0, 0.0] for x in a], dtype=torch.float64)
    ent = []
    for x in a:
        z = math.exp(x) + 2
        p, q = math.exp(x) / z, 1 / z
        ent.append(-(p * math.log(p) + 2 * q * math.log(q)))
    return scores, ent


def fixed_p_max(i: int) -> float:
    """p(y_hat | x) of row i of :func:`fixed_batch` (tau = 1)."""
    a = 0.1 * i
    return math.exp(a) / (math.exp(a) + 2)


def fixed_inputs(scores: torch.Tensor, **kw) -> ObjectiveInputs:
    """Inputs around a fixed score matrix, constant embeddings of its dtype."""
    zq = F.normalize(torch.ones(scores.shape[0], 4, dtype=scores.dtype), dim=1)
    zg = F.normalize(torch.ones(scores.shape[1], 4, dtype=scores.dtype), dim=1)
    return ObjectiveInputs(query_emb=zq, gallery_emb=zg, scores=scores, generator=torch.Generator().manual_seed(0), **kw)


def lowest(ent: list[float], k: int) -> set[int]:
    """Indices of the k smallest values."""
    return set(sorted(range(len(ent)), key=lambda i: ent[i])[:k])
