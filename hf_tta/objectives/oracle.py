"""The supervised oracle: a ceiling for the label-free objectives, not a TTA method.

It adapts the same parameters on the same stream, batches, steps and optimiser as a TTA method, but with the true
labels: a cross-entropy over the whole gallery in which every relevant item counts as the target (a query may have
several true captions),

    L = -(1/B) sum_i log sum_{c in pos(i)} p(c | q_i),     p(. | q_i) = softmax(s_i / tau),

so with one relevant item it is the usual cross-entropy. What it reaches bounds what any label-free objective on
those parameters could reach on that stream (the benchmark's "oracle (LN)" and "oracle (all)" rows).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..configuration_utils import check_positive
from .base import (
    LossOutput,
    Objective,
    ObjectiveConfig,
    ObjectiveInputs,
    ObjectiveState,
    gallery_tau_field,
    register_objective,
)


@dataclass
class OracleConfig(ObjectiveConfig):
    tau: float = gallery_tau_field()

    def __post_init__(self):
        super().__post_init__()
        check_positive("tau", self.tau)


@register_objective("oracle", OracleConfig)
class Oracle(Objective):
    """``-log sum_{c in pos} softmax(s / tau)_c``: supervised; needs ``adapt_step(..., labels=...)``."""

    requires_labels = True

    def __call__(self, inputs: ObjectiveInputs, state: ObjectiveState) -> LossOutput:
        labels = inputs.labels
        if labels is None:
            raise ValueError("The 'oracle' objective is supervised: pass the true items with adapt_step(queries, gallery, labels=...).")
        if labels.shape != inputs.scores.shape:
            raise ValueError(f"labels must be a (queries, gallery) mask of shape {tuple(inputs.scores.shape)}; got {tuple(labels.shape)}.")
        labels = labels.to(device=inputs.scores.device, dtype=torch.bool)
        keep = labels.any(dim=1)
        if not keep.any():
            return LossOutput(loss=None, n_selected=0)
        logits = inputs.scores[keep] / self.config.tau
        positives = logits.masked_fill(~labels[keep], float("-inf")).logsumexp(dim=1)
        loss = (logits.logsumexp(dim=1) - positives).mean()
        return LossOutput(loss=loss, n_selected=int(keep.sum()), logits=inputs.scores / self.config.tau,
                          temperature=self.config.tau)
