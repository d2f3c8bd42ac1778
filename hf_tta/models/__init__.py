"""Model adapters: one module per Hugging Face architecture, behind :class:`ModelAdapter`."""

from . import blip, blip2, blip2_composed, clap, clip, clip_video, siglip, vision_text_dual_encoder, xclip  # noqa: F401  (registration)
from .base import (
    ADAPTERS,
    MODALITIES,
    ModelAdapter,
    get_adapter,
    match_module_names,
    register_adapter,
    supported_architectures,
)
from .blip2_composed import Blip2ComposedAdapter
from .clap import ClapAdapter
from .clip_video import CLIPVideoAdapter, FrameMeanPoolingMixin
from .generic import DualEncoderAdapter
from .inputs import InputSpec
from .xclip import XCLIPAdapter

__all__ = [
    "ADAPTERS",
    "MODALITIES",
    "Blip2ComposedAdapter",
    "CLIPVideoAdapter",
    "ClapAdapter",
    "DualEncoderAdapter",
    "FrameMeanPoolingMixin",
    "InputSpec",
    "ModelAdapter",
    "XCLIPAdapter",
    "get_adapter",
    "match_module_names",
    "register_adapter",
    "supported_architectures",
]
