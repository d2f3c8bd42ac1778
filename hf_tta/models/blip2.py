"""Blip2ForImageTextRetrieval: ITC through the Q-Former.

Images are *multi-vector*: the Q-Former's ``num_query_tokens`` outputs, each projected and normalised, and an
image-text score is the max over them (as ``forward(use_image_text_matching_head=False)`` computes it).

The Q-Former is **shared** by both modalities (text goes through the same layers with ``query_length=0``), so
adapting its LayerNorms moves the text side too. hf_tta encodes the gallery once, with the adapters disabled
(exactly the source model), and never re-encodes it, so the cached gallery stays the source gallery whatever the
queries adapt. The default adapted parameters therefore include the Q-Former's norms for both directions; to
keep the Q-Former frozen, pass ``tuning=TuningConfig(exclude_modules=["qformer"])`` in the :class:`~hf_tta.TTAConfig`.

Each Q-Former layer has two feed-forward blocks: ``intermediate_query``/``output_query`` for the query tokens (image
path) and ``intermediate``/``output`` for text tokens; text (``query_length=0``) runs no cross-attention. Only the
LayerNorms a direction's forward runs are selected (:attr:`Blip2Adapter.unused_norms`).

The text path needs ``qformer_config.use_qformer_text_input=True`` (the retrieval checkpoints set it;
``Blip2Config``'s default is ``False``, which builds Q-Former layers without the text feed-forward block): the
adapter refuses such a model when it is wrapped, naming the flag, instead of failing inside transformers.
"""

from __future__ import annotations

import dataclasses

import torch

from .base import ModelAdapter, register_adapter
from .inputs import InputSpec


@register_adapter
class Blip2Adapter(ModelAdapter):
    architectures = ("Blip2ForImageTextRetrieval",)
    towers = {
        "image": ("vision_model", "query_tokens", "vision_projection"),
        "text": ("embeddings", "text_projection"),
    }
    shared = ("qformer",)
    multi_vector = frozenset({"image"})
    # Not given by the papers for BLIP-2; BLIP's rates (TCR App. B.2).
    default_lr = {"image": 3e-4, "text": 3e-5}
    processors = {"image": "Blip2Processor / BlipImageProcessor", "text": "Blip2Processor (its Q-Former tokenizer)"}
    fixed_image_size = True  # ViT-style tower: its position embeddings fix H x W (vision_config.image_size)
    vocab_config = "qformer_config"
    _layer = r"qformer\.encoder\.layer\.\d+\."
    unused_norms = {
        "image": (_layer + r"output\..*",),  # the text tokens' feed-forward block
        "text": (_layer + r"(crossattention|output_query)\..*",),  # query_length=0: no image, no query tokens
    }

    def __init__(self, model):
        super().__init__(model)
        qformer = getattr(getattr(model, "config", None), "qformer_config", None)
        if qformer is not None and not getattr(qformer, "use_qformer_text_input", True):
            raise ValueError(
                f"{type(model).__name__} was built with qformer_config.use_qformer_text_input=False (Blip2Config's "
                "default), so its Q-Former cannot embed text: build it with qformer_config=dict(..., "
                "use_qformer_text_input=True), as the retrieval checkpoints (e.g. Salesforce/blip2-itm-vit-g) do."
            )

    def input_specs(self, modality: str) -> dict[str, InputSpec]:
        specs = super().input_specs(modality)
        token = self.model.config.image_token_index
        if modality == "text" and token is not None and specs["input_ids"].vocab_size is not None:
            # the processor prepends num_query_tokens image tokens (dropped before the Q-Former, as forward() does)
            vocab = max(specs["input_ids"].vocab_size, token + 1)
            specs["input_ids"] = dataclasses.replace(
                specs["input_ids"], vocab_size=vocab, vocab_source=f"qformer_config.vocab_size and image_token_index={token}"
            )
        return specs

    def _embed(self, modality: str, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        m = self.model
        if modality == "image":
            image_embeds = m.vision_model(pixel_values=inputs["pixel_values"]).last_hidden_state
            mask = torch.ones(image_embeds.shape[:-1], dtype=torch.long, device=image_embeds.device)
            query_tokens = m.query_tokens.expand(image_embeds.shape[0], -1, -1)
            out = m.qformer(query_embeds=query_tokens, encoder_hidden_states=image_embeds, encoder_attention_mask=mask)
            hidden = out.last_hidden_state.to(m.vision_projection.weight.dtype)
            return m.vision_projection(hidden)  # (B, Q, D)
        input_ids, attention_mask = inputs["input_ids"], inputs.get("attention_mask")
        if m.config.image_token_index is not None:  # processor-inserted image tokens, as forward() drops them
            input_ids = input_ids[:, m.config.num_query_tokens :]
            if attention_mask is not None:
                attention_mask = attention_mask[:, m.config.num_query_tokens :]
        out = m.qformer(query_embeds=m.embeddings(input_ids=input_ids), query_length=0, attention_mask=attention_mask)
        hidden = out.last_hidden_state.to(m.text_projection.weight.dtype)
        return m.text_projection(hidden[:, 0])
