"""PL: pseudo-labelling (Lee, ICML-W 2013), one of REST's baselines (Li, Yang, Peng): cross-entropy of the whole-gallery
prediction (softmax at tau = 0.01, TCR App. B.2) against its own argmax, i.e. each query is pulled towards its current
top-1 gallery item. ``threshold`` > 0 keeps only queries whose top-1 probability reaches it (0 = all, the plain method).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.nn.functional as F

from ..configuration_utils import check_positive
from .base import (
    LossOutput,
    Objective,
    ObjectiveConfig,
    ObjectiveInputs,
    ObjectiveState,
    config_field,
    gallery_tau_field,
    register_objective,
)


@dataclass
class PLConfig(ObjectiveConfig):
    tau: float = gallery_tau_field()
    threshold: float = config_field(0.0, "Minimum top-1 probability for a query to contribute (0 = every query).")

    def __post_init__(self):
        super().__post_init__()
        check_positive("tau", self.tau)
        if not 0.0 <= self.threshold < 1.0:
            raise ValueError(f"`threshold` must be in [0, 1), got {self.threshold!r}.")


@register_objective("pl", PLConfig)
class PseudoLabel(Objective):
    """``CE(z^Q Z^G^T / tau, argmax)`` over the confident queries."""

    def __call__(self, inputs: ObjectiveInputs, state: ObjectiveState) -> LossOutput:
        logits = inputs.scores / self.config.tau
        prob, label = logits.detach().softmax(dim=1).max(dim=1)
        keep = prob >= self.config.threshold
        if not keep.any():
            return LossOutput(loss=None, n_selected=0)
        loss = F.cross_entropy(logits[keep], label[keep])
        return LossOutput(loss=loss, n_selected=int(keep.sum()), logits=logits, temperature=self.config.tau,
                          logs={"confidence": prob.mean()})
