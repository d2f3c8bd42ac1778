"""Audio and video retrieval: CLAP, X-CLIP, CLIP over frames and a CAV-MAE-shaped custom dual encoder adapt through
TTAWrapper; the embeddings are normalised and reproduce the models' own features; only the query tower's
intended normalisation layers change."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hf_tta import TTAConfig, TTAWrapper, TuningConfig, get_adapter
from hf_tta.models import ClapAdapter, CLIPVideoAdapter, XCLIPAdapter
from tiny_av_models import (
    cav_mae_adapter,
    clap_audio_batch,
    tiny_cav_mae,
    tiny_clap,
    tiny_clip,
    tiny_xclip,
    video_batch,
)
from tiny_models import text_batch

BATCH, GALLERY = 6, 12


def fbank_batch(n: int, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"input_values": torch.randn(n, 32, 16, generator=g)}


def cav_video_batch(n: int, seed: int = 0) -> dict[str, torch.Tensor]:
    return video_batch(n, frames=3, seed=seed, size=16)


# name -> (build the wrapper's model or adapter, {modality: batch fn})
CASES = {
    "clap": (tiny_clap, {"audio": clap_audio_batch, "text": text_batch}),
    "xclip": (tiny_xclip, {"video": video_batch, "text": text_batch}),
    "clip_video": (tiny_clip, {"video": video_batch, "text": text_batch}),
    "cav_mae": (lambda: cav_mae_adapter(tiny_cav_mae()), {"video": cav_video_batch, "audio": fbank_batch}),
}
DIRECTIONS = [(name, q, g) for name, (_, fns) in CASES.items() for q in fns for g in fns if q != g]


def _snapshot(model) -> dict[str, torch.Tensor]:
    return {n: t.detach().clone() for n, t in [*model.named_parameters(), *model.named_buffers()]}


# ---------------------------------------------------------------------------------------------------- embeddings
def test_clap_embeddings_are_normalised_and_match_the_model():
    model = tiny_clap()
    adapter = get_adapter(model)
    assert isinstance(adapter, ClapAdapter)
    audio, text = clap_audio_batch(3), text_batch(3)
    za, zt = adapter.embed("audio", audio), adapter.embed("text", text)
    torch.testing.assert_close(za.norm(dim=-1), torch.ones(3))
    torch.testing.assert_close(zt.norm(dim=-1), torch.ones(3))
    with torch.no_grad():
        torch.testing.assert_close(za, model.get_audio_features(**audio).pooler_output)  # CLAP already normalises
        out = model(input_ids=text["input_ids"], attention_mask=text["attention_mask"], **audio)
    torch.testing.assert_close(zt @ za.T * model.logit_scale_t.exp(), out.logits_per_text, atol=1e-4, rtol=1e-4)


def test_xclip_uses_unconditioned_text_and_checks_frames():
    model = tiny_xclip()
    adapter = get_adapter(model)
    assert isinstance(adapter, XCLIPAdapter)
    video, text = video_batch(2), text_batch(3)
    zv, zt = adapter.embed("video", video), adapter.embed("text", text)
    torch.testing.assert_close(zv.norm(dim=-1), torch.ones(2))
    with torch.no_grad():
        torch.testing.assert_close(zv, F.normalize(model.get_video_features(**video).pooler_output, dim=-1))
        torch.testing.assert_close(zt, F.normalize(model.get_text_features(**text).pooler_output, dim=-1))
        out = model(input_ids=text["input_ids"], attention_mask=text["attention_mask"], **video)
    # forward() conditions each caption on the video (B_vid x B_txt x D); the cached gallery does not
    assert out.text_embeds.shape[:2] == (2, 3)
    assert "prompts_generator" not in {m.split(".")[0] for m in adapter.norm_layer_names("video")}
    with pytest.raises(ValueError, match="num_frames=4"):
        adapter.embed("video", video_batch(2, frames=3))


def test_clip_video_is_the_mean_of_normalised_frame_embeddings():
    model = tiny_clip()
    adapter = get_adapter(model, ["video"])
    assert isinstance(adapter, CLIPVideoAdapter)
    assert type(get_adapter(model)).__name__ == "CLIPAdapter"  # the default stays image-text
    video = video_batch(2, frames=3)
    with torch.no_grad():
        frames = F.normalize(model.get_image_features(pixel_values=video["pixel_values"].flatten(0, 1)).pooler_output, dim=-1)
    expected = F.normalize(frames.view(2, 3, -1).mean(dim=1), dim=-1)
    torch.testing.assert_close(adapter.embed("video", video), expected)
    # a padded frame with frame_mask = 0 does not count
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    masked = adapter.embed("video", {**video, "frame_mask": mask})
    torch.testing.assert_close(masked[0], F.normalize(frames.view(2, 3, -1)[0, :2].mean(dim=0), dim=-1))
    torch.testing.assert_close(masked[1], expected[1])


@pytest.mark.parametrize("query,gallery,adapter_cls", [("video", None, CLIPVideoAdapter), ("text", "video", CLIPVideoAdapter)])
def test_wrapper_picks_the_clip_video_variant(query, gallery, adapter_cls):
    tta = TTAWrapper(tiny_clip(), TTAConfig(objective="tent", query_modality=query, gallery_modality=gallery))
    assert isinstance(tta.adapter, adapter_cls)
    assert tta.gallery_modality == (gallery or "text")


# ---------------------------------------------------------------------------------------------------- adaptation
@pytest.mark.parametrize("objective", ["tcr", "tent"])
@pytest.mark.parametrize("name,query,gallery", DIRECTIONS, ids=lambda x: str(x))
def test_adaptation_touches_only_the_query_towers_norms(name, query, gallery, objective):
    build, fns = CASES[name]
    cfg = TTAConfig(objective=objective, query_modality=query, gallery_modality=gallery)
    expected = set(get_adapter(build(), [query, gallery]).norm_layer_names(query))  # before PEFT wraps the layers
    tta = TTAWrapper(build(), cfg)
    g = tta.encode_gallery(fns[gallery](GALLERY, seed=1))
    before = _snapshot(tta.model)
    outs = [tta.adapt_step(fns[query](BATCH, seed=10 + i), g) for i in range(2)]
    after = _snapshot(tta.model)
    assert all(o.scores.shape == (BATCH, GALLERY) and torch.isfinite(o.scores).all() for o in outs)
    assert sum(o.num_updates for o in outs) > 0, [o.skipped for o in outs]
    changed = {n for n in before if not torch.equal(before[n], after[n])}
    assert changed and changed <= set(tta.params)
    assert set(tta.target_modules) == expected
    modules = dict(tta.model.named_modules())
    for n in changed:
        layer = n.rsplit(".", 1)[0]
        assert layer in expected and query in tta.adapter.tower_of(layer)
        assert isinstance(modules[layer], torch.nn.LayerNorm)
    # the gallery is still the source model's
    with tta.disabled():
        fresh = tta.encode_gallery(fns[gallery](GALLERY, seed=1)).embeddings
    torch.testing.assert_close(g.embeddings, fresh)


def test_clap_batchnorm_is_left_alone_by_default_and_can_be_named():
    model = tiny_clap()
    bn = "audio_model.audio_encoder.batch_norm"
    adapter = get_adapter(model)
    assert bn not in adapter.norm_layer_names("audio")
    names = adapter.norm_layer_names("audio") + [bn]
    tta = TTAWrapper(model, TTAConfig(objective="tent", query_modality="audio", tuning=TuningConfig(target_modules=names)))
    g = tta.encode_gallery(text_batch(GALLERY, seed=1))
    stats = {k: v.clone() for k, v in tta.model.named_buffers() if "batch_norm" in k}
    tta.adapt_step(clap_audio_batch(BATCH), g)
    assert {f"{bn}.weight", f"{bn}.bias"} <= set(tta.params)
    # eval mode: running statistics are the source model's, never re-estimated on test batches
    for k, v in tta.model.named_buffers():
        if k in stats:
            assert torch.equal(v, stats[k]), k


def test_cav_mae_towers_split_the_shared_blocks_by_modality():
    adapter = cav_mae_adapter(tiny_cav_mae())
    video = set(adapter.norm_layer_names("video"))
    audio = set(adapter.norm_layer_names("audio"))
    assert {"blocks_u.0.norm1_v", "blocks_u.0.norm2_v", "norm_v", "blocks_v.0.norm1"} <= video
    assert not video & audio
    assert not {"blocks_u.0.norm1", "norm"} & (video | audio)  # the joint audio-visual norms serve neither tower
