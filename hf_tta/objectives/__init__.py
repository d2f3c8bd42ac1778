"""Objectives, one file each, registered by name (``hf_tta.available_objectives()``)."""

from .base import (
    OBJECTIVES,
    LossOutput,
    Objective,
    ObjectiveConfig,
    ObjectiveInputs,
    ObjectiveState,
    available_objectives,
    build_objective,
    get_objective_class,
    register_objective,
    softmax_entropy,
)
from . import (  # noqa: F401  (registration by import)
    cliptta,
    deyo,
    dn,
    eata,
    pl,
    read,
    rest,
    sar,
    shot,
    tcr,
    tcr_training_free,
    tent,
    titan,
)

__all__ = [
    "OBJECTIVES",
    "LossOutput",
    "Objective",
    "ObjectiveConfig",
    "ObjectiveInputs",
    "ObjectiveState",
    "available_objectives",
    "build_objective",
    "get_objective_class",
    "register_objective",
    "softmax_entropy",
]
