"""Video retrieval with an image-text model: the video embedding is the mean of its frames' embeddings.

This is CLIP4Clip's parameter-free "meanP" similarity (Luo et al., 2022), the base model TITAN adapts: every frame
goes through the image tower, each frame embedding is L2-normalised, the (masked) mean over frames is the video
embedding (hf_tta normalises it again).

``CLIPModel``'s default adapter is image <-> text; the video variant is registered next to it and is picked when the
query or gallery modality is ``"video"``::

    TTAWrapper(clip_model, TTAConfig(query_modality="video"))                         # video -> text
    TTAWrapper(clip_model, TTAConfig(query_modality="text", gallery_modality="video"))  # text -> video
    TTAWrapper(CLIPVideoAdapter(clip_model), config)                                  # explicitly

Videos are ``pixel_values`` of shape ``(B, T, C, H, W)`` (``CLIPImageProcessor`` on the flattened frames, then
reshaped), with an optional ``frame_mask`` ``(B, T)`` (1 = real frame, 0 = padding) for clips with fewer frames.
The adapted parameters of a video query are the LayerNorms of the image tower. :class:`FrameMeanPoolingMixin` gives
any image-text adapter the same video modality.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .base import register_adapter
from .clip import CLIPAdapter


class FrameMeanPoolingMixin:
    """Adds a ``"video"`` modality to an image-text adapter: mean of the normalised per-frame image embeddings."""

    preprocess_as = {"video": "image"}  # frames go through the model's image processor

    def _embed(self, modality: str, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        if modality != "video":
            return super()._embed(modality, inputs)
        pixel_values = inputs["pixel_values"]
        if pixel_values.dim() != 5:
            raise ValueError(f"Videos must be pixel_values of shape (B, T, C, H, W); got {tuple(pixel_values.shape)}.")
        b, t = pixel_values.shape[:2]
        frames = super()._embed("image", {"pixel_values": pixel_values.flatten(0, 1)})
        frames = F.normalize(frames.float(), dim=-1).view(b, t, -1)
        mask = inputs.get("frame_mask")
        if mask is None:
            return frames.mean(dim=1)
        if mask.shape != (b, t):
            raise ValueError(f"frame_mask must have shape (B, T) = {(b, t)}; got {tuple(mask.shape)}.")
        weights = mask.to(frames.dtype)
        if not bool((weights.sum(dim=1) > 0).all()):
            raise ValueError("Every video needs at least one unmasked frame.")
        return (frames * weights[..., None]).sum(dim=1) / weights.sum(dim=1, keepdim=True)


@register_adapter(default=False)
class CLIPVideoAdapter(FrameMeanPoolingMixin, CLIPAdapter):
    modalities = ("video", "text")
    input_names = {"video": ("pixel_values", "frame_mask"), "text": CLIPAdapter.input_names["text"]}
    towers = {"video": CLIPAdapter.towers["image"], "text": CLIPAdapter.towers["text"]}
    # TITAN/TCR use CLIP's image-query rate for video queries.
    default_lr = {"video": 3e-4, "text": 3e-4}
    processors = {"video": "CLIPImageProcessor (on the frames, reshaped to (B, T, C, H, W))", "text": CLIPAdapter.processors["text"]}
