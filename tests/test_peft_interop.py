"""PEFT in and out (hf_tta.models.peft_interop): export the adapted state as a PEFT adapter folder, adapt a model that
is already a LoRA PeftModel, and merge_and_unload."""

from __future__ import annotations

import logging

import torch
from peft import LoraConfig, PeftModel, get_peft_model

from hf_tta import TTAConfig, TTAWrapper, get_adapter
from tiny_models import batch, make_model


@torch.no_grad()
def _embed(model, x) -> torch.Tensor:
    """The L2-normalised image embeddings of a plain or PEFT model, through the library's own CLIP adapter."""
    return get_adapter(model.get_base_model() if isinstance(model, PeftModel) else model).encode("image", dict(x))


def _adapted():
    tta = TTAWrapper(make_model("clip"), TTAConfig(objective="tcr", query_modality="image", lr=1e-2))
    g = tta.encode_gallery(batch("text", 12, seed=1))
    for i in range(2):
        tta.adapt_step(batch("image", 8, seed=10 + i), g)
    return tta, g


def test_exported_adapter_loads_into_the_source_model_with_the_same_embeddings(tmp_path):
    tta, g = _adapted()
    x = batch("image", 6, seed=50)
    adapted_emb, _ = tta.embed_and_score(x, g)
    tta.export_peft_adapter(tmp_path / "adapter")
    loaded = PeftModel.from_pretrained(make_model("clip"), tmp_path / "adapter").eval()
    assert torch.allclose(_embed(loaded, x), adapted_emb, atol=1e-6)
    assert not torch.allclose(_embed(make_model("clip"), x), adapted_emb, atol=1e-4)  # it did adapt


def test_a_lora_peftmodel_is_merged_and_adapted_on_top(caplog):
    base = make_model("clip")
    lora = get_peft_model(base, LoraConfig(r=2, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    x, captions = batch("image", 8, seed=3), batch("text", 12, seed=1)
    expected = _embed(lora, x)
    with caplog.at_level(logging.WARNING, logger="hf_tta"):
        tta = TTAWrapper(lora, TTAConfig(objective="tcr", query_modality="image"))
    assert any("merge_and_unload" in r.getMessage() for r in caplog.records)
    g = tta.encode_gallery(captions)
    with tta.disabled():
        emb, _ = tta.embed_and_score(x, g)
    assert torch.allclose(emb, expected, atol=1e-5)  # the source model is the LoRA-tuned one
    assert tta.adapt_step(x, g).num_updates > 0


def test_merge_and_unload_gives_a_plain_model_that_embeds_as_the_wrapper():
    tta, g = _adapted()
    x = batch("image", 6, seed=51)
    adapted_emb, _ = tta.embed_and_score(x, g)
    merged = tta.merge_and_unload()
    assert not isinstance(merged, PeftModel) and type(merged).__name__ == "CLIPModel"
    assert torch.allclose(_embed(merged, x), adapted_emb, atol=1e-6)
