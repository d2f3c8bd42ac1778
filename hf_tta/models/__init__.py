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
from .checkpointing import disable_gradient_checkpointing, enable_gradient_checkpointing
from .clap import ClapAdapter
from .clip_video import CLIPVideoAdapter, FrameMeanPoolingMixin
from .generic import DualEncoderAdapter
from .inputs import InputSpec
from .text_processor import check_text_processor, check_tokenizer
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
    "check_text_processor",
    "check_tokenizer",
    "disable_gradient_checkpointing",
    "enable_gradient_checkpointing",
    "get_adapter",
    "match_module_names",
    "register_adapter",
    "supported_architectures",
]
