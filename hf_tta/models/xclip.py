"""XCLIPModel (X-CLIP): video <-> text retrieval.

Videos are ``pixel_values`` of shape ``(B, T, C, H, W)`` with exactly ``config.vision_config.num_frames`` frames
(``XCLIPProcessor(videos=...)`` produces them). The video embedding is ``get_video_features``: per-frame CLIP
vision features, projected, then the multi-frame integration transformer (``mit``).

**What a cached text gallery means.** ``XCLIPModel.forward`` makes the text *video-conditioned*: it adds
``prompts_generator(text, video patch tokens)`` to each text embedding, so its ``logits_per_video`` pair every
video with its own version of every caption. ``get_text_features`` does not. hf_tta scores with the
unconditioned text embeddings (``get_text_features``), for both directions, because

- a gallery is encoded once by the source model and cached; a video-conditioned text gallery would have to be
  recomputed for every query video (B x N prompt-generator passes per batch);
- for text queries the "query embedding" would depend on each gallery video, which no dual-encoder TTA
  objective (centres, gaps, uniformity of the query embeddings) is defined for.

So the scores are X-CLIP's dual-encoder similarities, not ``forward``'s logits; the ``prompts_*`` modules are
used by neither tower and never adapted. Re-rank a short list with ``model(...)`` if you need the conditioned
scores.
"""

from __future__ import annotations

import dataclasses

import torch

from .base import ModelAdapter, pooled, register_adapter
from .inputs import InputSpec


@register_adapter
class XCLIPAdapter(ModelAdapter):
    architectures = ("XCLIPModel",)
    modalities = ("video", "text")
    input_names = {"video": ("pixel_values",), "text": ("input_ids", "attention_mask", "position_ids")}
    towers = {"video": ("vision_model", "visual_projection", "mit"), "text": ("text_model", "text_projection")}
    # CLIP-family contrastive model: TCR's CLIP rates.
    default_lr = {"video": 3e-4, "text": 3e-4}
    processors = {"video": "XCLIPProcessor / VideoMAEImageProcessor", "text": "XCLIPProcessor / CLIPTokenizer"}
    fixed_image_size = True  # ViT-style tower: its position embeddings fix H x W (vision_config.image_size)

    def input_specs(self, modality: str) -> dict[str, InputSpec]:
        specs = super().input_specs(modality)
        if modality == "video":  # X-CLIP's temporal modules are built for exactly num_frames frames
            frames = self.model.config.vision_config.num_frames
            spec = specs["pixel_values"]
            specs["pixel_values"] = dataclasses.replace(spec, sizes=((1, frames, f"vision_config.num_frames={frames}"),) + spec.sizes)
        return specs

    def _embed(self, modality: str, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        if modality == "video":  # shape checked by input_specs: (B, num_frames, C, H, W)
            return pooled(self.model.get_video_features(**inputs))
        return pooled(self.model.get_text_features(**inputs))
