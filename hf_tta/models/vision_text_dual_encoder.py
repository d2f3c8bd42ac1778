"""VisionTextDualEncoderModel: any pretrained vision model + any pretrained text model with projections."""

from __future__ import annotations

import torch

from .base import ModelAdapter, pooled, register_adapter

#: Vision towers whose position embeddings fix the input H x W (a ConvNeXt or ResNet tower takes any size).
POSITIONAL_VISION_TYPES = frozenset({"vit", "deit", "clip_vision_model", "siglip_vision_model"})


@register_adapter
class VisionTextDualEncoderAdapter(ModelAdapter):
    architectures = ("VisionTextDualEncoderModel",)
    towers = {"image": ("vision_model", "visual_projection"), "text": ("text_model", "text_projection")}
    # Text towers here are BERT-style encoders, like BLIP's: TCR's BLIP text rate (App. B.2).
    default_lr = {"image": 3e-4, "text": 3e-5}
    processors = {"image": "VisionTextDualEncoderProcessor / AutoImageProcessor", "text": "VisionTextDualEncoderProcessor / AutoTokenizer"}

    @property
    def fixed_image_size(self) -> bool:  # type: ignore[override]  (depends on the vision tower)
        return getattr(getattr(self.model.config, "vision_config", None), "model_type", None) in POSITIONAL_VISION_TYPES

    def _embed(self, modality: str, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        if modality == "image":
            return pooled(self.model.get_image_features(**inputs))
        return pooled(self.model.get_text_features(**inputs))
