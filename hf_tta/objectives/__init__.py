"""Objectives, one file each, registered by name (``hf_tta.available_objectives()``)."""

import importlib
import pkgutil

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

# Every module of this package is an objective that registers itself on import: adding one is adding a file.
for _module in sorted(m.name for m in pkgutil.iter_modules(__path__) if m.name != "base"):
    importlib.import_module(f"{__name__}.{_module}")

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
