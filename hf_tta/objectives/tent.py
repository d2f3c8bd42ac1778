"""Tent: entropy minimisation (Wang et al., ICLR 2021, https://arxiv.org/abs/2006.10726), applied to retrieval
as in TCR's baselines (Li et al., ICLR 2025, Eq. 1-2): the "classifier" is the softmax of the query-gallery
cosine similarities over the whole gallery, divided by a temperature tau.

Upstream: github.com/DequanWang/tent; TCR's port: github.com/XLearning-SCU/2025-ICLR-TCR
(models/tta_baselines/tent.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..configuration_utils import check_positive
from .base import (
    LossOutput,
    Objective,
    ObjectiveConfig,
    ObjectiveInputs,
    ObjectiveState,
    config_field,
    register_objective,
    softmax_entropy,
)


@dataclass
class TentConfig(ObjectiveConfig):
    tau: float = config_field(
        0.01,
        "Softmax temperature over the gallery. TCR App. B.2 tunes it per dataset for the baselines: 0.01 on "
        "COCO-C/Flickr-C/COCO/Flickr/Nocaps, 0.001 on Fashion-Gen, 0.0001 on the ReID sets.",
    )

    def __post_init__(self):
        super().__post_init__()
        check_positive("tau", self.tau)


@register_objective("tent", TentConfig)
class Tent(Objective):
    """Mean entropy of ``softmax(z^Q (Z^G)^T / tau)`` over the whole gallery (TCR Eq. 1 with L_TTA = entropy)."""

    def __call__(self, inputs: ObjectiveInputs, state: ObjectiveState) -> LossOutput:
        logits = inputs.scores / self.config.tau
        ent = softmax_entropy(logits)
        return LossOutput(
            loss=ent.mean(),
            n_selected=ent.shape[0],
            logits=logits,
            temperature=self.config.tau,
            logs={"entropy": ent.detach().mean()},
        )
