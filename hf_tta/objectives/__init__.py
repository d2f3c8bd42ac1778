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
from . import tcr, tcr_training_free, tent  # noqa: F401  (registration by import)

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
