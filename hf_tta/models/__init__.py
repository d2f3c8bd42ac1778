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
from . import blip, blip2, clap, clip, clip_video, siglip, vision_text_dual_encoder, xclip  # noqa: F401  (registration)
from .clap import ClapAdapter
from .clip_video import CLIPVideoAdapter, FrameMeanPoolingMixin
from .xclip import XCLIPAdapter
from .generic import DualEncoderAdapter

__all__ = [
    "ADAPTERS",
    "MODALITIES",
    "CLIPVideoAdapter",
    "ClapAdapter",
    "DualEncoderAdapter",
    "FrameMeanPoolingMixin",
    "ModelAdapter",
    "XCLIPAdapter",
    "get_adapter",
    "match_module_names",
    "register_adapter",
    "supported_architectures",
]
