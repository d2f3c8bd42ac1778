"""``TTAOutput``: what one :meth:`~hf_tta.TTAWrapper.adapt_step` returns."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

import torch

from .gallery.base import TopKScores


@dataclass
class TTAOutput:
    """Result of one :meth:`TTAWrapper.adapt_step`.

    Args:
        scores (`torch.Tensor` of shape `(B, N)`): the queries' scores against the whole gallery, from the forward
            of the last step (as TCR's reference code reports them); ``None`` with a top-k gallery backend.
        loss (`float`, *optional*): the last step's loss (``None`` for training-free objectives).
        num_updates (`int`): parameter updates made on this batch.
        n_selected (`int`): queries that contributed to the last step's loss.
        skipped (`list[str]`): why steps were skipped (nothing selected, non-finite loss or gradient).
        logs (`dict`): the objective's diagnostics of the last step.
        topk (`TopKScores`, *optional*): with a top-k gallery backend (``hf_tta.gallery``), each query's ``k`` best
            items (scores and global gallery indices, best first) from the last step's forward, instead of ``scores``.
        safety_action (`str`, *optional*): with ``TTAConfig.safety``, what the safety layer did on this batch:
            ``"skip_degenerate"`` (not adapted on), ``"rollback"`` (to the last-good snapshot), ``"reset"`` (to the
            source model), or ``None`` (kept). On a flagged batch the scores are the source model's.
        safety_logs (`dict`): the safety layer's label-free signals for this batch (see ``hf_tta.safety``).
    """

    scores: torch.Tensor | None
    loss: float | None
    num_updates: int
    n_selected: int
    skipped: list[str] = field(default_factory=list)
    logs: dict[str, float] = field(default_factory=dict)
    topk: TopKScores | None = None
    safety_action: str | None = None
    safety_logs: dict[str, float] = field(default_factory=dict)


@dataclass
class PassCounts:
    """Queries passed through the query tower, a meter of compute (``TTAWrapper.passes``, since the last ``reset()``).

    ``forward`` counts every query the wrapper's forward embeds: the steps' forwards with grad, the no-grad views (a
    before-update answer, an update budget's skipped batch, the entropy trigger), the source model's (the safety
    layer, gradient decoupling), any re-encoding an objective asks for, and ``answer`` / ``embed_and_score``; ``backward`` counts every query in a
    backward pass (gradient decoupling's second gradient, SAM's second pass, each once more). The gallery's encoding
    is not counted (it is encoded once), nor the router's feature forward (:mod:`hf_tta.router`). A
    :class:`~hf_tta.DistributedTTAWrapper` counts the global batch. Divided by the queries answered, they give the
    passes per query: TCR's 3 steps cost 3 + 3, a batch an update budget skips costs 1 + 0.

    Example:
        >>> c = PassCounts(forward=8, backward=6)
        >>> c.since(PassCounts(forward=2, backward=0)), c.per_query(2)
        (PassCounts(forward=6, backward=6), (4.0, 3.0))
    """

    forward: int = 0
    backward: int = 0

    def since(self, earlier: "PassCounts") -> "PassCounts":
        """The passes run after ``earlier`` (a copy taken then)."""
        return PassCounts(self.forward - earlier.forward, self.backward - earlier.backward)

    def per_query(self, queries: int) -> tuple[float, float]:
        """``(forward, backward)`` passes per query over ``queries`` queries answered."""
        if queries <= 0:
            raise ValueError(f"per_query needs the number of queries answered (> 0), got {queries!r}.")
        return self.forward / queries, self.backward / queries

    def copy(self) -> "PassCounts":
        return PassCounts(self.forward, self.backward)

    def clear(self) -> None:
        self.forward = self.backward = 0


def float_logs(logs: Mapping[str, Any]) -> dict[str, float]:
    """Objectives may log detached 0-d tensors; convert once, for the reported step (no device sync per step)."""
    return {k: float(v) for k, v in logs.items()}
