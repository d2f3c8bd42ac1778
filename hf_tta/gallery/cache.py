"""``GalleryCache``: the dense in-memory gallery, encoded once by the source model and never adapted."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


def single_vector(embeddings: torch.Tensor) -> torch.Tensor:
    """One vector per item: a multi-vector gallery ``(N, Q, D)`` becomes the normalised mean of its vectors (as
    :meth:`hf_tta.ModelAdapter.single_vector` does without scores)."""
    return embeddings if embeddings.dim() == 2 else F.normalize(embeddings.mean(dim=1), dim=-1)


@dataclass
class GalleryCache:
    """Gallery embeddings computed once by the source model (no grad) and never adapted.

    Args:
        embeddings (`torch.Tensor`): ``(N, D)``, or ``(N, Q, D)`` for a multi-vector modality; L2-normalised.
        modality (`str`): the gallery modality.
        encoder (`str`, *optional*): which model and tower encoded it (set by ``encode_gallery``); a wrapper refuses
            a gallery that another model encoded.
    """

    embeddings: torch.Tensor
    modality: str
    encoder: str | None = None
    single: torch.Tensor = field(init=False, repr=False)

    def __post_init__(self):
        if not isinstance(self.embeddings, torch.Tensor):
            raise TypeError(f"Gallery embeddings must be a tensor, got {type(self.embeddings).__name__}: use encode_gallery().")
        if self.embeddings.dim() not in (2, 3) or not self.embeddings.is_floating_point():
            raise ValueError(
                f"Gallery embeddings must be a floating-point (N, D) or (N, Q, D) tensor, got {self.embeddings.dtype} "
                f"of shape {tuple(self.embeddings.shape)}: use encode_gallery()."
            )
        if self.embeddings.is_inference():  # encoded under torch.inference_mode: a normal tensor autograd can use
            with torch.inference_mode(False):
                self.embeddings = self.embeddings.clone()
        self.embeddings = self.embeddings.detach()
        if not torch.isfinite(self.embeddings).all():  # checked once here, not at every step
            raise ValueError("The gallery embeddings contain NaN or inf values.")
        self.single = single_vector(self.embeddings)

    def __len__(self) -> int:
        return self.embeddings.shape[0]

    @property
    def dim(self) -> int:
        return self.embeddings.shape[-1]

    def to(self, device) -> "GalleryCache":
        return GalleryCache(self.embeddings.to(device), self.modality, self.encoder)
