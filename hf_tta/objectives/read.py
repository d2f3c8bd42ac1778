"""READ: REliable fusion and robust ADaptation (Yang et al., ICLR 2024, https://arxiv.org/abs/2310.04719), as TCR ran
it as a retrieval baseline (Li et al., ICLR 2025): the prediction is the softmax over the whole gallery at tau = 0.01,
and the loss is TCR's port of READ's objective (models/tta_baselines/read.py, after github.com/XLearning-SCU/2024-ICLR-READ):

    L = L_ra - L_bal
    L_ra  = mean_i p_i,max (1 - log p_i,max + log gamma),  gamma = e^-1   (confidence-aware robust loss)
    L_bal = H(softmax(sum_i p_i))                                         (balance: entropy of the summed predictions)

Note that with gamma = e^-1, L_ra = mean_i -p_max log p_max: it sharpens confident predictions (p_max > 1/e) and
flattens the others. READ's own parameters (the attention-based fusion layers) do not exist in a dual encoder, so the
query tower's LayerNorms are adapted, as in TCR's baselines.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

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
class READConfig(ObjectiveConfig):
    tau: float = gallery_tau_field()
    gamma: float = config_field(math.exp(-1), "gamma of the confidence-aware loss (READ: e^-1).")
    weight_bal: float = config_field(1.0, "Weight of the balance term (READ/TCR code: 1).")

    def __post_init__(self):
        super().__post_init__()
        check_positive("tau", self.tau)
        check_positive("gamma", self.gamma)
        check_positive("weight_bal", self.weight_bal, allow_zero=True)


def read_losses(logits: torch.Tensor, gamma: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(L_ra, L_bal)`` of READ for a ``(B, C)`` logit matrix."""
    p = logits.softmax(dim=-1)
    p_max = p.max(dim=-1).values
    l_ra = (p_max * (1 - p_max.log() + math.log(gamma))).mean()
    p_sum = p.sum(dim=-2)
    l_bal = -(p_sum.softmax(dim=0) * p_sum.log_softmax(dim=0)).sum()
    return l_ra, l_bal


@register_objective("read", READConfig)
class READ(Objective):
    """``L_ra - L_bal`` over the whole-gallery prediction."""

    def __call__(self, inputs: ObjectiveInputs, state: ObjectiveState) -> LossOutput:
        logits = inputs.scores / self.config.tau
        l_ra, l_bal = read_losses(logits, self.config.gamma)
        return LossOutput(
            loss=l_ra - self.config.weight_bal * l_bal,
            n_selected=logits.shape[0],
            logits=logits,
            temperature=self.config.tau,
            logs={"loss_ra": l_ra.detach(), "loss_bal": l_bal.detach()},
        )
