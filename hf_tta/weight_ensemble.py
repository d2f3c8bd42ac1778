"""Weight ensembling with the source model after each update (ROID's, Marsden et al., WACV 2024).

``TTAConfig(weight_ensemble={"momentum": 0.99})``: after a batch's updates, every adapted parameter is pulled towards
its source value,

.. math::  \\theta \\leftarrow m\\,\\theta + (1 - m)\\,\\theta_{\\text{source}},

the exponential moving average of ROID's code (``classification/methods/roid.py``, ``forward_and_adapt``: after
``optimizer.step()``, ``ema_update_model(model_to_update=self.model, model_to_merge=self.src_model,
momentum=self.momentum_src)``, i.e. ``momentum * p + (1 - momentum) * p_src`` on the parameters that require grad;
``ROID.MOMENTUM_SRC = 0.99``). ROID takes one step per batch, so its pull follows each step; here it follows each
batch's ``steps`` updates (TCR: 3), once per batch, as the registration of protocol v4's default study says. It bounds how far a long stream
can carry the weights from the source (a stationary point of the pull is ``(1 - m)`` of the way back per batch) while
the optimiser's moments go on as they were. A batch that updated nothing (a skipped step, the safety layer's skip) is
not pulled: the pull follows the update, as in ROID.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from .config_features import WeightEnsembleConfig
from .policies.base import BatchPolicy


@torch.no_grad()
def ensemble_with_source(params: Mapping[str, torch.Tensor], source: Mapping[str, torch.Tensor], momentum: float) -> None:
    """In place, ``p <- momentum * p + (1 - momentum) * source[name]`` for every adapted parameter (one fused
    ``lerp_`` per tensor: ``p + (1 - m)(s - p)``)."""
    for name, p in params.items():
        p.lerp_(source[name].to(dtype=p.dtype, device=p.device), 1.0 - momentum)


class WeightEnsemble(BatchPolicy):
    """``TTAConfig.weight_ensemble`` as a batch policy (:mod:`hf_tta.policies`): after a batch whose steps updated the
    parameters and that the safety layer kept, :func:`ensemble_with_source` towards the wrapper's source state (before
    the safety layer's last-good snapshot is refreshed, so a later rollback returns to the pulled weights)."""

    name = "weight_ensemble"

    def __init__(self, config: WeightEnsembleConfig):
        self.config = config

    def after(self, ctx: Any, decision: Any) -> None:
        if ctx.result is not None and ctx.result.num_updates and decision.action is None:
            ensemble_with_source(ctx.params, ctx.source_state.params, self.config.momentum)
