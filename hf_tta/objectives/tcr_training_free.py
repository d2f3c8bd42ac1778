"""Training-free TCR ("Ours (untrain)", TCR App. C, Alg. 2; Li et al., ICLR 2025).

No parameter changes: per batch, candidates by nearest neighbour, the same source-like queue as TCR, then the
query embeddings are spread around their centre (Eq. 12, lambda_scale = 2) and shifted towards the candidates'
centre so that the batch gap matches the estimated source gap (Eq. 13; the code's lambda_offset is
1 - Delta_S / Delta_T with Delta_T measured before scaling), re-normalised, and scored against the whole gallery.

For multi-vector query embeddings (BLIP-2 images) the transformed single-vector view is what gets scored.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..configuration_utils import check_positive
from .base import LossOutput, Objective, ObjectiveInputs, ObjectiveState, config_field, register_objective
from .tcr import TCRConfig, init_queue_state, maybe_update_queue, modality_gap, queue_constraints, refine


@dataclass
class TCRTrainingFreeConfig(TCRConfig):
    lambda_scale: float = config_field(2.0, "Scale of the queries around their centre (Eq. 12; App. C: 2).")

    def __post_init__(self):
        super().__post_init__()
        check_positive("lambda_scale", self.lambda_scale)


def rectify_queries(zq: torch.Tensor, zg: torch.Tensor, delta_s: torch.Tensor, lambda_scale: float) -> torch.Tensor:
    """Eq. 12 then Eq. 13 with lambda_offset = 1 - Delta_S/Delta_T, then L2 normalisation."""
    centre = zq.mean(0)
    delta_t = modality_gap(zq, zg)
    shift = zg.mean(0) - centre
    scaled = centre + lambda_scale * (zq - centre)
    offset = (1 - delta_s / delta_t.clamp(min=1e-12)) * shift
    return F.normalize(scaled + offset, dim=1)


@register_objective("tcr_training_free", TCRTrainingFreeConfig)
class TCRTrainingFree(Objective):
    requires_grad = False

    def init_state(self, device="cpu") -> ObjectiveState:
        return init_queue_state(device)

    def __call__(self, inputs: ObjectiveInputs, state: ObjectiveState) -> LossOutput:
        c = self.config
        _, zg, logits = refine(inputs, c.tau)
        maybe_update_queue(c, inputs, state, zg, logits)
        if state["queue_si"].numel() == 0:
            return LossOutput(loss=None, n_selected=0)
        delta_s, _ = queue_constraints(state)
        zq = rectify_queries(inputs.query_emb, zg, delta_s, c.lambda_scale)
        scores = zq @ inputs.gallery_emb.T
        return LossOutput(loss=None, n_selected=zq.shape[0], scores=scores, logs={"delta_s": delta_s})
