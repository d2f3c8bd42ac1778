"""VisionTextDualEncoderModel: any pretrained vision model + any pretrained text model with projections."""

from __future__ import annotations

import torch

from .base import ModelAdapter, pooled, register_adapter


@register_adapter
class VisionTextDualEncoderAdapter(ModelAdapter):
    architectures = ("VisionTextDualEncoderModel",)
    towers = {"image": ("vision_model", "visual_projection"), "text": ("text_model", "text_projection")}
    # Text towers here are BERT-style encoders, like BLIP's: TCR's BLIP text rate (App. B.2).
    default_lr = {"image": 3e-4, "text": 3e-5}
    processors = {"image": "VisionTextDualEncoderProcessor / AutoImageProcessor", "text": "VisionTextDualEncoderProcessor / AutoTokenizer"}

    def _embed(self, modality: str, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        if modality == "image":
            return pooled(self.model.get_image_features(**inputs))
        return pooled(self.model.get_text_features(**inputs))
