"""Composed image retrieval with Blip2ForImageTextRetrieval (REST Table III / A.8: FIQ-O, CIRR-O; SPRC-style).

A *composed* query is a reference image plus a modification text, inputs ``{"pixel_values", "input_ids",
"attention_mask"}`` (``Blip2Processor(images=references, text=modifications)``). As BLIP-2's CIR heads (LAVIS
``blip2_qformer_cir``, SPRC) compute it, the Q-Former fuses them: the learned query tokens and the text tokens attend
to each other (one sequence, ``embeddings(input_ids, query_embeds=query_tokens)``, the path of
``forward(use_image_text_matching_head=True)``) and cross-attend to the reference image's ViT features; the fused
embedding is ``text_projection`` of the first text token's output (position ``num_query_tokens``). The gallery
(modality ``image``) is the target images' Q-Former query tokens through ``vision_projection``, multi-vector, so a
composed-target score is the max over the query tokens, as :class:`~hf_tta.models.blip2.Blip2Adapter` scores images.

Default adapted parameters (TCR/REST: "the normalisation layers of the query encoder"): every LayerNorm on the
composed query's path: the ViT's (reference image) and the Q-Former's (its input LayerNorm over the
query + text embeddings included). The gallery is encoded
once by the source model, so the shared ViT and Q-Former moving does not touch it.

``TTAWrapper(blip2, TTAConfig(query_modality="composed"))`` picks this adapter (:func:`get_adapter` with the
``composed`` modality); a custom CIR model takes the documented :class:`~hf_tta.DualEncoderAdapter` path with an
encode function for ``composed`` (``input_names={"composed": ["pixel_values", "input_ids", "attention_mask"]}``).
"""

from __future__ import annotations

import dataclasses

import torch

from .base import ModelAdapter, register_adapter
from .blip2 import Blip2Adapter
from .inputs import InputSpec


@register_adapter(default=False)
class Blip2ComposedAdapter(ModelAdapter):
    architectures = ("Blip2ForImageTextRetrieval",)
    modalities = ("composed", "image")
    input_names = {"composed": ("pixel_values", "input_ids", "attention_mask"), "image": ("pixel_values",)}
    towers = {
        "composed": ("vision_model", "query_tokens", "embeddings", "qformer", "text_projection"),
        "image": ("vision_model", "query_tokens", "qformer", "vision_projection"),
    }
    multi_vector = frozenset({"image"})
    # Not given by REST for BLIP-2. The fused embedding is the Q-Former's text output (text_projection of a text token),
    # so BLIP's text-query rate, 3e-5 (TCR App. B.2); the gallery side keeps BLIP's image rate.
    default_lr = {"composed": 3e-5, "image": 3e-4}
    processors = {"composed": "Blip2Processor(images=references, text=modifications)", "image": "Blip2Processor / BlipImageProcessor"}
    fixed_image_size = True  # ViT-style tower: its position embeddings fix H x W (vision_config.image_size)
    vocab_config = "qformer_config"

    def input_specs(self, modality: str) -> dict[str, InputSpec]:
        if modality == "image":
            return super().input_specs("image")
        self.check_modality(modality)
        text = Blip2Adapter(self.model).input_specs("text")  # the Q-Former vocabulary (+ processor image tokens)
        ids = dataclasses.replace(text["input_ids"], required=True)  # a composed query needs its modification text
        return {**ModelAdapter.input_specs(self, "image"), "input_ids": ids, "attention_mask": text["attention_mask"]}

    def norm_layer_names(self, modality: str) -> list[str]:
        """The tower's LayerNorms, less the last Q-Former layer's query-FFN norm for composed queries: the fused
        embedding is read at the first text token, so the last layer's query-token outputs never reach it."""
        names = super().norm_layer_names(modality)
        if modality != "composed":
            return names
        last = f"qformer.encoder.layer.{self.model.config.qformer_config.num_hidden_layers - 1}.output_query."
        return [n for n in names if not n.startswith(last)]

    def check_modality(self, modality: str) -> None:
        if modality not in self.modalities:
            raise ValueError(f"{type(self).__name__} embeds composed queries (reference image + modification text) and "
                             f"target images {list(self.modalities)}; got modality {modality!r}.")

    def _vision(self, pixel_values: torch.Tensor):
        image_embeds = self.model.vision_model(pixel_values=pixel_values).last_hidden_state
        mask = torch.ones(image_embeds.shape[:-1], dtype=torch.long, device=image_embeds.device)
        return image_embeds, mask, self.model.query_tokens.expand(image_embeds.shape[0], -1, -1)

    def _embed(self, modality: str, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        m = self.model
        image_embeds, image_mask, query_tokens = self._vision(inputs["pixel_values"])
        if modality == "image":
            out = m.qformer(query_embeds=query_tokens, encoder_hidden_states=image_embeds, encoder_attention_mask=image_mask)
            return m.vision_projection(out.last_hidden_state.to(m.vision_projection.weight.dtype))  # (B, Q, D)
        input_ids, attention_mask = inputs["input_ids"], inputs.get("attention_mask")
        nq = query_tokens.shape[1]
        if m.config.image_token_index is not None:  # processor-inserted image tokens, as forward() drops them
            input_ids = input_ids[:, m.config.num_query_tokens :]
            attention_mask = None if attention_mask is None else attention_mask[:, m.config.num_query_tokens :]
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        query_mask = torch.ones(query_tokens.shape[:-1], dtype=attention_mask.dtype, device=attention_mask.device)
        embeds = m.embeddings(input_ids=input_ids, query_embeds=query_tokens)
        out = m.qformer(query_embeds=embeds, query_length=nq, attention_mask=torch.cat([query_mask, attention_mask], dim=1),
                        encoder_hidden_states=image_embeds, encoder_attention_mask=image_mask)
        hidden = out.last_hidden_state.to(m.text_projection.weight.dtype)
        return m.text_projection(hidden[:, nq])  # the fused query: the first text token after the query tokens


__all__ = ["Blip2ComposedAdapter"]
