"""Model adapters: one module per Hugging Face architecture, behind :class:`ModelAdapter`."""

from .base import (
    ADAPTERS,
    MODALITIES,
    ModelAdapter,
    get_adapter,
    match_module_names,
    register_adapter,
    supported_architectures,
)
from . import blip, blip2, clip, siglip, vision_text_dual_encoder  # noqa: F401  (registration)
from .generic import DualEncoderAdapter

__all__ = [
    "ADAPTERS",
    "MODALITIES",
    "DualEncoderAdapter",
    "ModelAdapter",
    "get_adapter",
    "match_module_names",
    "register_adapter",
    "supported_architectures",
]
