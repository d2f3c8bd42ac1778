"""hf_tta: test-time adaptation for cross-modal retrieval under query shift, for Hugging Face dual encoders.

The public names below are imported on first use (PEP 562 ``__getattr__``, as ``transformers`` does), so that
``import hf_tta`` and ``hf-tta --help`` do not pay for torch, transformers and the model code until something needs
them; ``from hf_tta import TTAWrapper`` imports what that name needs.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from . import logging  # noqa: F401  (hf_tta.logging.set_verbosity_*; first: configures the hf_tta logger)
from .version import __version__

# public name -> the submodule that defines it
_LAZY = {
    "ConsistencyConfig": "config",
    "GradientDecouplingConfig": "config",
    "RunConfig": "config",
    "SafetyConfig": "config",
    "TTAConfig": "config",
    "TuningConfig": "config",
    "DistributedTTAWrapper": "distributed",
    "init_distributed": "distributed",
    "ChunkedGallery": "gallery",
    "FaissGallery": "gallery",
    "GalleryBackend": "gallery",
    "ShardedGallery": "gallery",
    "TopKScores": "gallery",
    "GalleryCache": "gallery.cache",
    "retrieval_metrics": "metrics",
    "topk_retrieval_metrics": "metrics",
    "DualEncoderAdapter": "models",
    "ModelAdapter": "models",
    "get_adapter": "models",
    "register_adapter": "models",
    "supported_architectures": "models",
    "ClapAdapter": "models.clap",
    "CLIPVideoAdapter": "models.clip_video",
    "XCLIPAdapter": "models.xclip",
    "LossOutput": "objectives",
    "Objective": "objectives",
    "ObjectiveConfig": "objectives",
    "ObjectiveInputs": "objectives",
    "available_objectives": "objectives",
    "register_objective": "objectives",
    "PassCounts": "outputs",
    "TTAOutput": "outputs",
    "DomainRouter": "router",
    "RoutingConfig": "router",
    "RoutedTTAWrapper": "routing",
    "TTAWrapper": "wrapper",
    "UpdateBudgetConfig": "update_budget",
    "LRSearchConfig": "lr_search",
}

__all__ = [
    "CLIPVideoAdapter",
    "ChunkedGallery",
    "ClapAdapter",
    "ConsistencyConfig",
    "DistributedTTAWrapper",
    "DomainRouter",
    "DualEncoderAdapter",
    "FaissGallery",
    "GalleryBackend",
    "GalleryCache",
    "GradientDecouplingConfig",
    "LRSearchConfig",
    "LossOutput",
    "ModelAdapter",
    "Objective",
    "ObjectiveConfig",
    "ObjectiveInputs",
    "PassCounts",
    "RoutedTTAWrapper",
    "RoutingConfig",
    "RunConfig",
    "SafetyConfig",
    "ShardedGallery",
    "TTAConfig",
    "TTAOutput",
    "TTAWrapper",
    "TopKScores",
    "TuningConfig",
    "UpdateBudgetConfig",
    "XCLIPAdapter",
    "available_objectives",
    "get_adapter",
    "init_distributed",
    "register_adapter",
    "register_objective",
    "retrieval_metrics",
    "supported_architectures",
    "topk_retrieval_metrics",
    "__version__",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'hf_tta' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value  # looked up once
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


if TYPE_CHECKING:  # what type checkers and IDEs see
    from .config import ConsistencyConfig, GradientDecouplingConfig, RunConfig, SafetyConfig, TTAConfig, TuningConfig
    from .distributed import DistributedTTAWrapper, init_distributed
    from .gallery import ChunkedGallery, FaissGallery, GalleryBackend, ShardedGallery, TopKScores
    from .gallery.cache import GalleryCache
    from .lr_search import LRSearchConfig
    from .metrics import retrieval_metrics, topk_retrieval_metrics
    from .models import DualEncoderAdapter, ModelAdapter, get_adapter, register_adapter, supported_architectures
    from .models.clap import ClapAdapter
    from .models.clip_video import CLIPVideoAdapter
    from .models.xclip import XCLIPAdapter
    from .objectives import (
        LossOutput,
        Objective,
        ObjectiveConfig,
        ObjectiveInputs,
        available_objectives,
        register_objective,
    )
    from .outputs import PassCounts, TTAOutput
    from .router import DomainRouter, RoutingConfig
    from .routing import RoutedTTAWrapper
    from .update_budget import UpdateBudgetConfig
    from .wrapper import TTAWrapper
