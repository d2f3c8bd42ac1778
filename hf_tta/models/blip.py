"""BlipForImageTextRetrieval: the ITC (contrastive) embeddings, as in TCR (no ITM re-ranking)."""

from __future__ import annotations

import torch

from .base import ModelAdapter, register_adapter


@register_adapter
class BlipAdapter(ModelAdapter):
    architectures = ("BlipForImageTextRetrieval",)
    towers = {"image": ("vision_model", "vision_proj"), "text": ("text_encoder", "text_proj")}
    # TCR App. B.2: 3e-4 for image queries, 3e-5 for text queries with BLIP.
    default_lr = {"image": 3e-4, "text": 3e-5}
    # the ITC text embedding runs no cross-attention (no encoder_hidden_states): its LayerNorms never run
    unused_norms = {"text": (r"text_encoder\.encoder\.layer\.\d+\.crossattention\..*",)}
    processors = {"image": "BlipProcessor / BlipImageProcessor", "text": "BlipProcessor / BertTokenizer"}
    fixed_image_size = True  # ViT-style tower: its position embeddings fix H x W (vision_config.image_size)

    def _embed(self, modality: str, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        m = self.model
        if modality == "image":
            hidden = m.vision_model(pixel_values=inputs["pixel_values"]).last_hidden_state
            return m.vision_proj(hidden[:, 0])
        # Without encoder_hidden_states the BLIP text encoder is unimodal (the ITC text embedding).
        hidden = m.text_encoder(**inputs).last_hidden_state
        return m.text_proj(hidden[:, 0])
