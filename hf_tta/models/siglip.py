"""SiglipModel (SigLIP and SigLIP-2 style dual encoders with attention-pooling heads)."""

from __future__ import annotations

import torch

from .base import ModelAdapter, pooled, register_adapter


@register_adapter
class SiglipAdapter(ModelAdapter):
    architectures = ("SiglipModel",)
    towers = {"image": ("vision_model",), "text": ("text_model",)}
    # Not in the papers; CLIP-family contrastive models use TCR's CLIP rates.
    default_lr = {"image": 3e-4, "text": 3e-4}
    processors = {"image": "SiglipProcessor / SiglipImageProcessor", "text": "SiglipProcessor / AutoTokenizer"}
    fixed_image_size = True  # ViT-style tower: its position embeddings fix H x W (vision_config.image_size)

    def _embed(self, modality: str, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        if modality == "image":
            out = pooled(self.model.get_image_features(**inputs))
            if out is None:
                raise ValueError("This SigLIP vision tower has no head (vision_use_head=False): it gives no embedding.")
            return out
        return pooled(self.model.get_text_features(**inputs))
