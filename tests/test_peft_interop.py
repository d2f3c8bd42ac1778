"""PEFT in and out (hf_tta.models.peft_interop): export the adapted state as a PEFT adapter folder, adapt a model that
is already a LoRA PeftModel, and merge_and_unload."""

from __future__ import annotations

import logging

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model

from hf_tta import RunConfig, TTAConfig, TTAWrapper, TuningConfig, get_adapter
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


# ------------------------------------------------------------------------------------- the wrapped model saves (issue 36, item 1)
def _state(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_layernorm_tuning_keeps_the_models_modules_and_keys_and_save_pretrained_reloads_it_exactly(tmp_path):
    """Before: wrapping turned 12 LayerNorm tensors into 24 PEFT keys, and CLIPModel.from_pretrained of the user's
    model.save_pretrained() reported UNEXPECTED/MISSING keys and re-initialised them."""
    from transformers import CLIPModel

    source = make_model("clip")
    model = make_model("clip")
    tta = TTAWrapper(model, TTAConfig(objective="tcr", query_modality="image", lr=1e-2))
    assert [(n, type(m)) for n, m in model.named_modules()] == [(n, type(m)) for n, m in source.named_modules()]
    assert list(model.state_dict()) == list(source.state_dict())
    assert set(tta.params) <= set(model.state_dict())  # the adapted tensors are the model's own
    g = tta.encode_gallery(batch("text", 12, seed=1))
    for i in range(2):
        tta.adapt_step(batch("image", 8, seed=10 + i), g)
    adapted = _state(model)
    assert any(not torch.equal(adapted[n], source.state_dict()[n]) for n in tta.params)
    assert all(torch.equal(adapted[n], v) for n, v in source.state_dict().items() if n not in tta.params)
    model.save_pretrained(tmp_path / "hf")
    reloaded, info = CLIPModel.from_pretrained(tmp_path / "hf", output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys"))
    assert all(torch.equal(v, adapted[k]) for k, v in reloaded.state_dict().items()) and reloaded.state_dict().keys() == adapted.keys()
    x = batch("image", 6, seed=50)
    assert torch.equal(_embed(reloaded.eval(), x), tta.embed_and_score(x, g)[0])
    with tta.disabled():  # the source values live in the wrapper
        assert torch.equal(tta.embed_and_score(x, g)[0], _embed(source, x))
    assert all(torch.equal(p, adapted[n]) for n, p in tta.params.items())  # disabled() put the adapted values back
    tta.reset()
    assert all(torch.equal(v, source.state_dict()[k]) for k, v in model.state_dict().items())


def test_layernorm_tuning_is_plain_optimisation_of_the_models_own_layernorms():
    """The adapted LayerNorms equal a reference that optimises a plain model's LayerNorm parameters directly with the
    same optimiser (AdamW, TTAConfig's lr and weight decay) on Tent's loss (mean entropy of softmax(scores / tau))."""
    lr, tau = 1e-2, 0.01
    tta = TTAWrapper(make_model("clip"), TTAConfig(objective="tent", query_modality="image", lr=lr, steps=2, run=RunConfig(fast_step=False),
                                                   objective_config={"tau": tau}))
    texts, queries = batch("text", 12, seed=1), [batch("image", 8, seed=10 + i) for i in range(3)]
    g = tta.encode_gallery(texts)
    for x in queries:
        tta.adapt_step(x, g)
    ref = make_model("clip").eval().requires_grad_(False)
    adapter = get_adapter(ref)
    names = adapter.norm_layer_names("image")
    params = {f"{n}.{k}": p.requires_grad_(True) for n in names for k, p in ref.get_submodule(n).named_parameters()}
    opt = torch.optim.AdamW(list(params.values()), lr=lr, weight_decay=tta.config.weight_decay)
    with torch.no_grad():
        gallery = adapter.encode("text", dict(texts))
    for x in queries:
        for _ in range(2):
            logp = (adapter.encode("image", dict(x)) @ gallery.T / tau).log_softmax(-1)
            loss = -(logp.exp() * logp).sum(-1).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    assert set(tta.params) == set(params)
    for n, p in params.items():
        torch.testing.assert_close(tta.params[n].detach(), p.detach(), rtol=0, atol=1e-6)
    assert any(not torch.equal(p, make_model("clip").get_parameter(n)) for n, p in params.items())


@pytest.mark.parametrize("tuning", ["ln", "lora"])
def test_disabled_works_after_merge_and_unload_and_export(tuning, tmp_path):
    """Before: after merge_and_unload, `with tta.disabled():` raised PEFT's "No adapter layers found in the model"."""
    cfg = {"tuning": TuningConfig(method="lora", target_modules=".*vision_model.*mlp.fc[12]")} if tuning == "lora" else {}
    tta = TTAWrapper(make_model("clip"), TTAConfig(objective="tcr", query_modality="image", lr=1e-2, **cfg))
    g = tta.encode_gallery(batch("text", 12, seed=1))
    for i in range(2):
        tta.adapt_step(batch("image", 8, seed=10 + i), g)
    x = batch("image", 6, seed=52)
    adapted_emb = tta.embed_and_score(x, g)[0]
    source_emb = _embed(make_model("clip"), x)
    merged = tta.merge_and_unload()
    assert type(merged).__name__ == "CLIPModel" and not isinstance(merged, PeftModel)
    assert list(merged.state_dict()) == list(make_model("clip").state_dict())
    assert torch.allclose(_embed(merged, x), adapted_emb, atol=1e-6)
    tta.export_peft_adapter(tmp_path / "adapter")
    with tta.disabled():
        assert torch.allclose(tta.embed_and_score(x, g)[0], source_emb, atol=1e-6)
    assert torch.equal(tta.embed_and_score(x, g)[0], adapted_emb)  # and the wrapper goes on
    assert tta.adapt_step(batch("image", 8, seed=12), g).num_updates > 0
    loaded = PeftModel.from_pretrained(make_model("clip"), tmp_path / "adapter").eval()
    assert torch.allclose(_embed(loaded, x), adapted_emb, atol=1e-6)
