"""Tiny Hugging Face models built from configs (the way transformers tests itself): no weights are downloaded,
and the code paths are those a ``from_pretrained`` model takes."""

from __future__ import annotations

import torch

TXT = dict(vocab_size=99, hidden_size=32, intermediate_size=37, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=64)
VIS = dict(image_size=32, patch_size=8, hidden_size=32, intermediate_size=37, num_hidden_layers=2, num_attention_heads=4)
IDS = dict(bos_token_id=0, eos_token_id=2, pad_token_id=1)


def tiny_clip():
    from transformers import CLIPConfig, CLIPModel

    return CLIPModel(CLIPConfig(text_config={**TXT, **IDS}, vision_config=VIS, projection_dim=16))


def tiny_siglip():
    from transformers import SiglipConfig, SiglipModel

    return SiglipModel(SiglipConfig(text_config={**TXT, **IDS, "projection_size": 32}, vision_config=VIS))


def tiny_blip():
    from transformers import BlipConfig, BlipForImageTextRetrieval

    text = dict(TXT, encoder_hidden_size=32, bos_token_id=0, sep_token_id=2, pad_token_id=1)
    # BlipVisionConfig's initializer_range defaults to 1e-10, which the current transformers honours: a tiny random ViT then
    # embeds every image alike (every gallery item ties and a text query's entropy has no gradient)
    vision = dict(VIS, initializer_range=0.02)
    return BlipForImageTextRetrieval(BlipConfig(text_config=text, vision_config=vision, image_text_hidden_size=16))


def tiny_blip2():
    from transformers import Blip2Config, Blip2ForImageTextRetrieval

    cfg = Blip2Config(
        vision_config=VIS, num_query_tokens=4, image_text_hidden_size=16,
        qformer_config=dict(TXT, use_qformer_text_input=True, pad_token_id=1),
    )
    return Blip2ForImageTextRetrieval(cfg)


def blip2_model(seed: int = 0):
    """The tiny BLIP-2 (Q-Former text input) with its ViT re-initialised at std 0.02: BLIP-2's vision config initialises
    at 1e-10, which makes a tiny random ViT's output all but independent of the image (every gallery item ties)."""
    model = make_model("blip2", seed)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for mod in model.vision_model.modules():
            if isinstance(mod, (torch.nn.Linear, torch.nn.Conv2d)):
                mod.weight.copy_(torch.randn(mod.weight.shape, generator=gen) * 0.02)
        pos = model.vision_model.embeddings.position_embedding
        pos.copy_(torch.randn(pos.shape, generator=gen) * 0.02)
    return model


def tiny_vtde():
    from transformers import BertConfig, VisionTextDualEncoderConfig, VisionTextDualEncoderModel, ViTConfig

    cfg = VisionTextDualEncoderConfig.from_vision_text_configs(ViTConfig(**VIS), BertConfig(**TXT), projection_dim=16)
    return VisionTextDualEncoderModel(cfg)


TINY_MODELS = {
    "clip": tiny_clip,
    "siglip": tiny_siglip,
    "blip": tiny_blip,
    "blip2": tiny_blip2,
    "vtde": tiny_vtde,
}


def make_model(name: str, seed: int = 0):
    torch.manual_seed(seed)
    return TINY_MODELS[name]().eval()


def image_batch(n: int, seed: int = 0, size: int = 32) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"pixel_values": torch.randn(n, 3, size, size, generator=g)}


def text_batch(n: int, seed: int = 0, length: int = 7) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 99, (n, length), generator=g)
    ids[:, 0] = 0  # bos
    ids[:, -1] = 2  # eos (CLIP pools at the eos/argmax position)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def batch(modality: str, n: int, seed: int = 0) -> dict[str, torch.Tensor]:
    return image_batch(n, seed) if modality == "image" else text_batch(n, seed)
