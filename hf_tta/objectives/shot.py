"""SHOT: Source HypOthesis Transfer (Liang, Hu, Feng, ICML 2020, https://arxiv.org/abs/2002.08546), one of REST's
baselines, run online on each batch with the whole-gallery prediction (softmax at tau = 0.01, TCR App. B.2):

    L = mean_i H(p_i) - H(mean_i p_i) + beta * CE(logits, y_hat)           (information maximisation + pseudo-labels)

``y_hat`` is SHOT's self-supervised pseudo-label (upstream ``obtain_label``), computed on the batch: class centroids
c_k = sum_i p_ik f_i / sum_i p_ik of the features f = normalise([z^Q, 1]), each query labelled with its nearest
centroid (cosine) among the classes predicted in the batch, then one more round with the hard labels. SHOT computes it
over the whole target set once per epoch; online, the batch is all there is. beta = 0.3 (SHOT's ``cls_par``);
beta = 0 gives SHOT-IM.
"""

from __future__ import annotations

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
    config_field,
    gallery_tau_field,
    register_objective,
    softmax_entropy,
)


@dataclass
class SHOTConfig(ObjectiveConfig):
    tau: float = gallery_tau_field()
    beta: float = config_field(0.3, "Weight of the pseudo-label cross-entropy (SHOT cls_par: 0.3; 0 = SHOT-IM).")
    weight_im: float = config_field(1.0, "Weight of the information-maximisation term (SHOT ent_par: 1).")
    cluster_rounds: int = config_field(1, "Extra centroid rounds with hard labels after the soft initialisation (SHOT: 1).")

    def __post_init__(self):
        super().__post_init__()
        check_positive("tau", self.tau)
        check_positive("beta", self.beta, allow_zero=True)
        check_positive("weight_im", self.weight_im, allow_zero=True)
        check_positive("cluster_rounds", self.cluster_rounds, allow_zero=True)


@torch.no_grad()
def shot_pseudo_labels(features: torch.Tensor, probs: torch.Tensor, rounds: int = 1) -> torch.Tensor:
    """SHOT's ``obtain_label`` on one batch: nearest (cosine) prediction-weighted centroid among the predicted classes."""
    f = F.normalize(torch.cat([features.detach().float(), torch.ones(len(features), 1, device=features.device)], 1), dim=1)
    labelset = torch.unique(probs.argmax(dim=1))  # classes predicted at least once (SHOT: count > threshold = 0)
    aff = probs[:, labelset].float()  # (B, L)
    for r in range(rounds + 1):
        centres = F.normalize(aff.T @ f / (1e-8 + aff.sum(0)[:, None]), dim=1)
        pred = (f @ centres.T).argmax(dim=1)  # cosine distance = 1 - cos
        aff = F.one_hot(pred, len(labelset)).float()
    return labelset[pred]


@register_objective("shot", SHOTConfig)
class SHOT(Objective):
    """Information maximisation over the gallery plus SHOT's clustering pseudo-labels."""

    def __call__(self, inputs: ObjectiveInputs, state: ObjectiveState) -> LossOutput:
        c = self.config
        logits = inputs.scores / c.tau
        p = logits.softmax(dim=1)
        ent = softmax_entropy(logits).mean()
        p_mean = p.mean(0)
        div = -(p_mean * torch.log(p_mean + 1e-5)).sum()  # SHOT's epsilon
        loss = c.weight_im * (ent - div)
        logs = {"entropy": ent.detach(), "diversity": div.detach()}
        if c.beta > 0:
            y_hat = shot_pseudo_labels(inputs.query_emb, p.detach(), c.cluster_rounds)
            ce = F.cross_entropy(logits, y_hat)
            loss = loss + c.beta * ce
            logs["loss_pl"] = ce.detach()
        return LossOutput(loss=loss, n_selected=logits.shape[0], logits=logits, temperature=c.tau, logs=logs)
