"""Gradient checkpointing of the query tower (hf_tta.models.checkpointing): under PEFT LN tuning and the wrapper's
eval mode, it really recomputes the layers in the backward pass and leaves the LayerNorm gradients unchanged."""

from __future__ import annotations

import pytest
import torch

from hf_tta import TTAConfig, TTAWrapper
from hf_tta.models.checkpointing import disable_gradient_checkpointing, enable_gradient_checkpointing
from tiny_models import TINY_MODELS, batch, make_model


def _grads(name: str, modality: str, checkpointing: bool):
    model = make_model(name)
    tta = TTAWrapper(model, TTAConfig(objective="tent", query_modality=modality, steps=1))
    layers = enable_gradient_checkpointing(tta.adapter, modality) if checkpointing else []
    other = "text" if modality == "image" else "image"
    with torch.no_grad():
        gallery = tta.adapter.embed(other, batch(other, 6, seed=1))
    modules = dict(model.named_modules())
    calls = []  # forwards of the checkpointed layers' children: recomputation runs them again in backward
    for layer in layers:
        child = next(iter(modules[layer].children()))
        child.register_forward_hook(lambda *_: calls.append(1))
    emb = tta.adapter.single_vector(tta.adapter.embed(modality, batch(modality, 5)))
    gallery = tta.adapter.single_vector(gallery)
    probs = (emb @ gallery.T / 0.05).softmax(-1)
    (-(probs * probs.log()).sum(-1).mean()).backward()
    grads = {n: p.grad.clone() for n, p in tta.params.items() if p.grad is not None}
    return grads, layers, len(calls), tta


@pytest.mark.parametrize("name", sorted(TINY_MODELS))
@pytest.mark.parametrize("modality", ["image", "text"])
def test_checkpointing_recomputes_and_keeps_layernorm_gradients(name, modality):
    off, _, _, _ = _grads(name, modality, False)
    on, layers, calls, tta = _grads(name, modality, True)
    assert layers, "no layer of the query tower is checkpointed"
    assert calls == 2 * len(layers), "the checkpointed layers were not recomputed in the backward pass"
    assert all(not m.training for n, m in tta.model.named_modules() if n not in layers)  # dropout stays off
    assert off.keys() == on.keys() and len(off) == len(tta.params)
    for n in off:
        torch.testing.assert_close(on[n], off[n], atol=1e-6, rtol=0)
    assert any(g.abs().max() > 0 for g in off.values())


@pytest.mark.parametrize("name", ["clip", "blip"])
def test_adapt_step_with_checkpointing_gives_the_same_parameters(name):
    """The wrapper's full step (TCR, 2 AdamW steps) with the query tower checkpointed, as TTAConfig's option would."""
    params = []
    for on in (False, True):
        tta = TTAWrapper(make_model(name), TTAConfig(objective="tcr", steps=2))
        if on:
            enable_gradient_checkpointing(tta.adapter, "image")
        gallery = tta.encode_gallery(batch("text", 12, seed=1), show_progress=False)
        out = tta.adapt_step(batch("image", 8), gallery)
        assert out.num_updates == 2
        params.append({n: p.detach().clone() for n, p in tta.params.items()})
    assert any(not torch.equal(p, TTAWrapper(make_model(name), TTAConfig(steps=1)).source_parameters()[n]) for n, p in params[0].items())
    for n in params[0]:
        torch.testing.assert_close(params[1][n], params[0][n], atol=1e-6, rtol=0)


def test_disable_restores_eval_mode():
    tta = TTAWrapper(make_model("clip"), TTAConfig(objective="tent", steps=1))
    enable_gradient_checkpointing(tta.adapter, "image")
    disable_gradient_checkpointing(tta.adapter)
    assert not any(m.training for m in tta.model.modules())


def test_custom_model_without_checkpoint_layers_is_refused():
    from hf_tta import DualEncoderAdapter

    model = torch.nn.ModuleDict({"a": torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4)), "b": torch.nn.Linear(4, 4)})
    adapter = DualEncoderAdapter(
        model, encoders={"image": lambda m, x: m["a"](x["pixel_values"]), "text": lambda m, x: m["b"](x["input_ids"].float())},
        towers={"image": ["a"], "text": ["b"]},
    )
    with pytest.raises(ValueError, match="gradient_checkpointing=False"):
        enable_gradient_checkpointing(adapter, "image")
