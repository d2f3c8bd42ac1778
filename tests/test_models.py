"""Model adapters (hf_tta.models): the default adapted LayerNorms are exactly those the query forward runs, and
BLIP-2's config trap is refused when the model is wrapped."""

from __future__ import annotations

import pytest
import torch

from hf_tta import TTAConfig, TTAWrapper
from hf_tta.models import get_adapter
from tiny_av_models import clap_audio_batch, tiny_clap, tiny_xclip, video_batch
from tiny_models import TINY_MODELS, TXT, VIS, batch, make_model

CASES = [(name, modality) for name in sorted(TINY_MODELS) for modality in ("image", "text")]
CASES += [("clap", "audio"), ("clap", "text"), ("xclip", "video"), ("xclip", "text")]


def _model_and_inputs(name: str, modality: str):
    if name == "clap":
        return tiny_clap(), clap_audio_batch(3) if modality == "audio" else batch("text", 3)
    if name == "xclip":
        return tiny_xclip(), video_batch(3) if modality == "video" else batch("text", 3)
    return make_model(name), batch(modality, 3)


@pytest.mark.parametrize("name,modality", CASES)
def test_every_selected_norm_runs_in_the_query_forward(name, modality):
    model, inputs = _model_and_inputs(name, modality)
    adapter = get_adapter(model)
    selected = adapter.norm_layer_names(modality)
    assert selected
    modules = dict(model.named_modules())
    ran: set[str] = set()
    hooks = [modules[n].register_forward_hook(lambda *_, n=n: ran.add(n)) for n in selected]
    with torch.no_grad():
        adapter.embed(modality, inputs)
    for h in hooks:
        h.remove()
    assert [n for n in selected if n not in ran] == []


@pytest.mark.parametrize(
    "name,modality,dropped",
    [
        ("blip", "text", "text_encoder.encoder.layer.0.crossattention.output.LayerNorm"),
        ("blip2", "image", "qformer.encoder.layer.0.output.LayerNorm"),
        ("blip2", "text", "qformer.encoder.layer.1.output_query.LayerNorm"),
        ("blip2", "text", "qformer.encoder.layer.0.crossattention.output.LayerNorm"),
    ],
)
def test_unused_norms_are_not_adapted_but_used_ones_are(name, modality, dropped):
    model = make_model(name)
    assert dropped in dict(model.named_modules())
    tta = TTAWrapper(model, TTAConfig(objective="tent", query_modality=modality, steps=1))
    assert dropped not in tta.target_modules
    kept = {"blip": "text_encoder.encoder.layer.0.output.LayerNorm", "blip2": "qformer.layernorm"}[name]
    assert kept in tta.target_modules


def _blip2(use_text_input: bool | None):
    from transformers import Blip2Config, Blip2ForImageTextRetrieval

    qformer = dict(TXT, pad_token_id=1) | ({} if use_text_input is None else {"use_qformer_text_input": use_text_input})
    torch.manual_seed(0)
    return Blip2ForImageTextRetrieval(
        Blip2Config(vision_config=VIS, num_query_tokens=4, image_text_hidden_size=16, qformer_config=qformer)
    ).eval()


@pytest.mark.parametrize("use_text_input", [None, False])
@pytest.mark.parametrize("query", ["image", "text"])
def test_blip2_without_qformer_text_input_is_refused_at_wrap_time(use_text_input, query):
    with pytest.raises(ValueError, match="use_qformer_text_input=True"):
        TTAWrapper(_blip2(use_text_input), TTAConfig(query_modality=query))


def test_blip2_with_qformer_text_input_wraps_and_embeds_text():
    tta = TTAWrapper(_blip2(True), TTAConfig(steps=1))
    assert tta.encode_gallery(batch("text", 4), show_progress=False).embeddings.shape[0] == 4
