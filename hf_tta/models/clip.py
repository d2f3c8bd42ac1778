"""CLIPModel (and models that expose CLIP's ``get_*_features`` API)."""

from __future__ import annotations

import torch

from .base import ModelAdapter, pooled, register_adapter


@register_adapter
class CLIPAdapter(ModelAdapter):
    architectures = ("CLIPModel",)
    towers = {"image": ("vision_model", "visual_projection"), "text": ("text_model", "text_projection")}
    # TCR's code adapts `model.transformer` for text queries, which leaves OpenAI CLIP's `ln_final`
    # (`text_model.final_layer_norm` here) out; the paper says "the LN layers of the query encoder". We follow
    # the code, as the reported numbers come from it.
    excluded_norms = {"text": ("text_model.final_layer_norm",)}
    # TCR App. B.2: 3e-4 for image queries; 3e-4 for text queries with CLIP (3e-5 is BLIP's).
    default_lr = {"image": 3e-4, "text": 3e-4}
    processors = {"image": "CLIPProcessor / CLIPImageProcessor", "text": "CLIPProcessor / CLIPTokenizer"}
    fixed_image_size = True  # ViT-style tower: its position embeddings fix H x W (vision_config.image_size)

    def _embed(self, modality: str, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        if modality == "image":
            return pooled(self.model.get_image_features(**inputs))
        return pooled(self.model.get_text_features(**inputs))
