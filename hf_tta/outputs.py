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


def float_logs(logs: Mapping[str, Any]) -> dict[str, float]:
    """Objectives may log detached 0-d tensors; convert once, for the reported step (no device sync per step)."""
    return {k: float(v) for k, v in logs.items()}
