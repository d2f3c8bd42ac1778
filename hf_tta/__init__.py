"""hf_tta: test-time adaptation for cross-modal retrieval under query shift, for Hugging Face dual encoders."""

from . import logging  # noqa: F401  (hf_tta.logging.set_verbosity_*; first: configures the hf_tta logger)
from .config import (
    ConsistencyConfig,
    GradientDecouplingConfig,
    RunConfig,
    SafetyConfig,
    TTAConfig,
    TuningConfig,
)
from .distributed import DistributedTTAWrapper, init_distributed
from .gallery import ChunkedGallery, FaissGallery, GalleryBackend, ShardedGallery, TopKScores
from .gallery.cache import GalleryCache
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
from .outputs import TTAOutput
from .router import DomainRouter, RoutingConfig
from .routing import RoutedTTAWrapper
from .update_budget import UpdateBudgetConfig
from .version import __version__
from .wrapper import TTAWrapper

__all__ = [
    "CLIPVideoAdapter",
    "ChunkedGallery",
    "FaissGallery",
    "GalleryBackend",
    "ShardedGallery",
    "TopKScores",
    "ClapAdapter",
    "ConsistencyConfig",
    "DistributedTTAWrapper",
    "DomainRouter",
    "DualEncoderAdapter",
    "GalleryCache",
    "GradientDecouplingConfig",
    "LossOutput",
    "ModelAdapter",
    "Objective",
    "ObjectiveConfig",
    "ObjectiveInputs",
    "RoutedTTAWrapper",
    "RoutingConfig",
    "RunConfig",
    "SafetyConfig",
    "TTAConfig",
    "TTAOutput",
    "TTAWrapper",
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
