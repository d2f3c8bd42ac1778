"""TTAWrapper: parameter selection, gallery cache, reset, save/load/resume, bad input, skip rules."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from hf_tta import DualEncoderAdapter, GalleryCache, RunConfig, TTAConfig, TTAWrapper, TuningConfig, get_adapter
from hf_tta.objectives import softmax_entropy
from tiny_models import TINY_MODELS, batch, make_model


def _tta(model_name="clip", query="image", **cfg):
    return TTAWrapper(make_model(model_name), TTAConfig(query_modality=query, **cfg))


def _other(query):
    return "text" if query == "image" else "image"


# ------------------------------------------------------------------------------------- adapters
@pytest.mark.parametrize("model_name", sorted(TINY_MODELS))
@pytest.mark.parametrize("modality", ["image", "text"])
def test_embeddings_are_normalised_and_reproduce_forward_scores(model_name, modality):
    model = make_model(model_name)
    adapter = get_adapter(model)
    with torch.no_grad():
        img = adapter.embed("image", batch("image", 3))
        txt = adapter.embed("text", batch("text", 4))
        emb = img if modality == "image" else txt
        assert torch.allclose(emb.norm(dim=-1), torch.ones(emb.shape[:-1]), atol=1e-5)
        scores = adapter.score(img, txt)  # (3 images, 4 texts)
        if model_name == "clip" or model_name == "vtde" or model_name == "siglip":
            out = model(**batch("image", 3), **batch("text", 4))
            ref = out.logits_per_image
            if model_name == "siglip":
                ref = (ref - model.logit_bias) / model.logit_scale.exp()
            else:
                ref = ref / model.logit_scale.exp()
            assert torch.allclose(scores, ref, atol=1e-5)
        elif model_name == "blip":
            ref = model(**batch("image", 3), **batch("text", 4), use_itm_head=False).itm_score
            assert torch.allclose(scores, ref, atol=1e-5)
        else:  # blip2: image (B,Q,D), max over query tokens
            assert img.dim() == 3
            ref = model(**batch("image", 3), **batch("text", 4), use_image_text_matching_head=False).logits_per_image
            assert torch.allclose(scores, ref, atol=1e-5)


def test_default_targets_follow_tcr():
    clip_text = _tta("clip", "text").target_modules
    assert "text_model.final_layer_norm" not in clip_text  # TCR code: ln_final is not adapted
    assert all(n.startswith("text_model.") for n in clip_text)
    clip_img = _tta("clip", "image").target_modules
    assert "vision_model.pre_layrnorm" in clip_img and "vision_model.post_layernorm" in clip_img
    blip2_img = _tta("blip2", "image").target_modules
    assert any(n.startswith("qformer.") for n in blip2_img)  # the shared Q-Former is part of the image path
    no_q = _tta("blip2", "image", tuning=TuningConfig(exclude_modules=["qformer"])).target_modules
    assert no_q and not any(n.startswith("qformer") for n in no_q)


def test_targets_outside_query_tower_are_refused():
    with pytest.raises(ValueError, match="outside the image"):
        _tta("clip", "image", tuning=TuningConfig(target_modules=r"text_model\..*layer_norm1"))


def test_unsupported_model_lists_supported():
    with pytest.raises(ValueError, match="CLIPModel"):
        TTAWrapper(nn.Linear(2, 2))


def test_generic_dual_encoder_adapter():
    class TwoTower(nn.Module):
        def __init__(self):
            super().__init__()
            self.img = nn.Sequential(nn.Linear(6, 8), nn.LayerNorm(8), nn.Linear(8, 4))
            self.txt = nn.Sequential(nn.Embedding(10, 8), nn.LayerNorm(8))
            self.txt_proj = nn.Linear(8, 4)

    torch.manual_seed(0)
    model = TwoTower()
    adapter = DualEncoderAdapter(
        model,
        encoders={"image": lambda m, x: m.img(x["pixel_values"]), "text": lambda m, x: m.txt_proj(m.txt(x["input_ids"]).mean(1))},
        towers={"image": ["img"], "text": ["txt", "txt_proj"]},
    )
    tta = TTAWrapper(adapter, TTAConfig(objective="tent", query_modality="image"))
    assert tta.target_modules == ["img.1"]
    g = tta.encode_gallery({"input_ids": torch.randint(0, 10, (12, 5))})
    before = model.txt[1].weight.clone()
    out = tta.adapt_step({"pixel_values": torch.randn(4, 6)}, g)
    assert out.num_updates == 3 and out.scores.shape == (4, 12)
    assert torch.equal(model.txt[1].weight, before)


# ------------------------------------------------------------------------------------- loop
def test_scores_come_from_last_steps_forward():
    """With one step the output scores are the source model's (the update follows the forward)."""
    tta = _tta("clip", "image", steps=1)
    g = tta.encode_gallery(batch("text", 10, seed=1))
    q = batch("image", 5, seed=2)
    with torch.no_grad(), tta.disabled():
        source = tta.adapter.score(tta.adapter.embed("image", q), g.embeddings)
    out = tta.adapt_step(q, g)
    assert out.num_updates == 1
    assert torch.allclose(out.scores, source, atol=1e-6)
    assert not torch.allclose(tta.adapt_step(q, g).scores, source, atol=1e-6)  # now adapted


def test_tent_lowers_entropy_on_a_fixed_batch():
    tta = _tta("clip", "image", objective="tent", lr=1e-2)
    g = tta.encode_gallery(batch("text", 16, seed=1))
    q = batch("image", 8, seed=2)

    def entropy():
        with torch.no_grad():
            s = tta.adapter.score(tta.adapter.embed("image", q), g.embeddings)
        return softmax_entropy(s / 0.01).mean().item()

    start = entropy()
    for _ in range(3):
        tta.adapt_step(q, g)
    assert entropy() < start - 1e-3


def test_disabled_context_gives_source_outputs_after_adaptation():
    tta = _tta("blip2", "text")
    q = batch("text", 4, seed=2)
    with torch.no_grad():
        source = tta.adapter.embed("text", q)
    g = tta.encode_gallery(batch("image", 10, seed=1))
    for _ in range(2):
        tta.adapt_step(q, g)
    with torch.no_grad():
        assert not torch.allclose(tta.adapter.embed("text", q), source)
        with tta.disabled():
            assert torch.equal(tta.adapter.embed("text", q), source)


def test_episodic_resets_after_each_batch():
    tta = _tta("clip", "image", reset_policy="episodic")
    g = tta.encode_gallery(batch("text", 10, seed=1))
    out = tta.adapt_step(batch("image", 6, seed=2), g)
    assert out.num_updates > 0
    assert all(torch.equal(p, tta.source_parameters()[n]) for n, p in tta.params.items())
    assert tta.batch_index == 0


def test_non_finite_loss_updates_nothing(monkeypatch):
    tta = _tta("clip", "image")
    g = tta.encode_gallery(batch("text", 10, seed=1))
    tta.adapt_step(batch("image", 6, seed=2), g)  # fill the queue, move the params
    params = {n: p.clone() for n, p in tta.params.items()}
    state = {k: v.clone() for k, v in tta.state.items()}
    opt_state = {k: {kk: vv.clone() for kk, vv in v.items()} for k, v in tta.optimizer.state.items()}
    original = type(tta.objective).__call__

    def nan_loss(self, inputs, st):
        out = original(self, inputs, st)
        out.loss = out.loss * float("nan")
        return out

    monkeypatch.setattr(type(tta.objective), "__call__", nan_loss)
    out = tta.adapt_step(batch("image", 6, seed=3), g)
    assert out.num_updates == 0 and all("non-finite loss" in s for s in out.skipped)
    assert all(torch.equal(p, params[n]) for n, p in tta.params.items())
    assert all(torch.equal(tta.state[k], state[k]) for k in state)
    for k, v in tta.optimizer.state.items():
        assert all(torch.equal(vv, opt_state[k][kk]) for kk, vv in v.items())
    assert torch.isfinite(out.scores).all()


@pytest.mark.parametrize("fault", ["loss", "gradient"])
def test_a_non_finite_second_sam_pass_updates_nothing(monkeypatch, fault):
    """SAR's second pass runs inside the optimiser step: a NaN there must not reach the parameters, the Adam moments
    or SAR's EMA (before: the base step ran anyway and the EMA went NaN for good)."""
    tta = _tta("clip", "image", objective="sar")
    g = tta.encode_gallery(batch("text", 10, seed=1))
    tta.adapt_step(batch("image", 6, seed=2), g)  # EMA and moments exist
    params = {n: p.clone() for n, p in tta.params.items()}
    ema = tta.state["ema"].clone()
    opt_state = {k: {kk: vv.clone() for kk, vv in v.items()} for k, v in tta.optimizer.state.items()}
    original = type(tta.objective).__call__

    def nan_second_pass(self, inputs, st):
        out = original(self, inputs, st)
        if inputs.in_closure and out.loss is not None:
            if fault == "loss":
                out.loss = out.loss * float("nan")
                self._second_loss = out.loss.detach()
            else:  # a finite loss whose gradient is NaN: d sqrt(z^2)/dz at z = 0 is 0/0
                z = inputs.query_emb.sum() - inputs.query_emb.sum().detach()
                out.loss = out.loss + torch.sqrt(z * z)
        return out

    monkeypatch.setattr(type(tta.objective), "__call__", nan_second_pass)
    out = tta.adapt_step(batch("image", 6, seed=3), g)
    monkeypatch.undo()
    assert out.num_updates == 0 and len(out.skipped) == tta.config.steps
    assert all("second (SAM) pass" in s for s in out.skipped), out.skipped
    assert all(torch.equal(p, params[n]) for n, p in tta.params.items())
    assert torch.equal(tta.state["ema"], ema) and torch.isfinite(tta.state["ema"]).all()
    for k, v in tta.optimizer.state.items():
        assert all(torch.equal(vv, opt_state[k][kk]) for kk, vv in v.items())
    later = tta.adapt_step(batch("image", 6, seed=4), g)  # the stream goes on, finite
    assert later.num_updates > 0 and torch.isfinite(later.scores).all() and torch.isfinite(tta.state["ema"]).all()


# ------------------------------------------------------------------------------------- save / load / resume
def test_load_into_other_config_is_refused(tmp_path):
    a = _tta("clip", "image")
    a.save_pretrained(tmp_path)
    b = _tta("clip", "text")
    with pytest.raises(ValueError, match="other parameters"):
        b.load_state(tmp_path)


# ------------------------------------------------------------------------------------- bad input
@pytest.fixture(scope="module")
def clip_tta():
    tta = _tta("clip", "image")
    return tta, tta.encode_gallery(batch("text", 10, seed=1))


def test_wrong_modality(clip_tta):
    tta, g = clip_tta
    with pytest.raises(ValueError, match="pixel_values"):
        tta.adapt_step(batch("text", 4), g)
    with pytest.raises(ValueError, match="modalit"):
        TTAWrapper(make_model("clip"), TTAConfig(query_modality="audio"))


def test_gallery_mismatches(clip_tta):
    tta, g = clip_tta
    with pytest.raises(ValueError, match="dimension"):
        tta.adapt_step(batch("image", 4), torch.nn.functional.normalize(torch.randn(10, 7), dim=1))
    with pytest.raises(ValueError, match="holds image"):
        tta.adapt_step(batch("image", 4), GalleryCache(g.embeddings, "image"))
    with pytest.raises(ValueError, match="NaN"):
        tta.adapt_step(batch("image", 4), g.embeddings * float("nan"))


def test_empty_batch_non_finite_and_device(clip_tta):
    tta, g = clip_tta
    with pytest.raises(ValueError, match="Empty"):
        tta.adapt_step({"pixel_values": torch.zeros(0, 3, 32, 32)}, g)
    bad = batch("image", 2)
    bad["pixel_values"][0, 0, 0, 0] = float("inf")
    with pytest.raises(ValueError, match="NaN or inf"):
        tta.adapt_step(bad, g)
    with pytest.raises(ValueError, match="move it"):
        tta.adapt_step({"pixel_values": torch.zeros(2, 3, 32, 32, device="meta")}, g)
    with pytest.raises(TypeError, match="dict of tensors"):
        tta.adapt_step(torch.zeros(2, 3, 32, 32), g)


def test_inference_mode_is_refused(clip_tta):
    tta, g = clip_tta
    with torch.inference_mode():
        with pytest.raises(RuntimeError, match="inference_mode"):
            tta.adapt_step(batch("image", 2), g)
    with torch.no_grad():  # no_grad is fine: adapt_step enables grad itself
        assert tta.adapt_step(batch("image", 3), g).num_updates > 0


def test_recommended_preset_round_trips_and_builds_a_wrapper(tmp_path):
    from hf_tta.preset import RECOMMENDED_IMAGE, RECOMMENDED_TEXT

    cfg = TTAConfig.recommended("text", lr=1e-4)
    assert (cfg.objective, cfg.query_modality, cfg.lr) == (RECOMMENDED_TEXT["objective"], "text", 1e-4)
    assert cfg.safety == RECOMMENDED_TEXT.get("safety") and cfg == TTAConfig(**{**RECOMMENDED_TEXT, "query_modality": "text", "lr": 1e-4})
    cfg.save_pretrained(tmp_path)
    assert TTAConfig.from_pretrained(tmp_path) == cfg
    assert TTAConfig.recommended("image", safety={"min_agreement": 0.3}).safety == {"min_agreement": 0.3}
    tta = TTAWrapper(make_model("clip"), TTAConfig.recommended("image"))
    assert tta.safety.active == (RECOMMENDED_IMAGE.get("safety") is not None)
    gallery = tta.encode_gallery(batch("text", 10, seed=1))
    # the image default (protocol v4's sixth round) gates: before its reference the source answers, nothing adapts
    before = tta.adapt_step(batch("image", 8, seed=2), gallery)
    assert before.num_updates == 0 and before.logs["shift_gate_open"] == 0.0
    tta.fit_shift_gate(batch("image", 40, seed=5))
    out = tta.adapt_step(batch("image", 8, seed=2), gallery)
    assert torch.isfinite(out.scores).all() and "shift_gate_statistic" in out.logs
    tta.save_pretrained(tmp_path / "ckpt")
    loaded = TTAWrapper.from_pretrained(make_model("clip"), tmp_path / "ckpt")
    assert loaded.config == TTAConfig.recommended("image") and loaded.shift_gate.fitted  # the reference comes with it
    with pytest.raises(ValueError, match="query_modality"):
        TTAConfig.recommended("smell")


def test_autocast_bf16_runs_on_cpu():
    tta = _tta("clip", "image", autocast_dtype="bf16")
    g = tta.encode_gallery(batch("text", 10, seed=1))
    out = tta.adapt_step(batch("image", 6, seed=2), g)
    assert torch.isfinite(out.scores).all() and out.num_updates > 0


def test_adapt_stream_concatenates_rows():
    tta = _tta("clip", "text", objective="tent")
    g = tta.encode_gallery(batch("image", 9, seed=1))
    scores = tta.adapt_stream([batch("text", 4, seed=i) for i in range(3)], g, show_progress=False)
    assert scores.shape == (12, 9) and tta.batch_index == 3


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (run on the GPU machine)")
def test_cuda_adapt_step_and_device_check():
    tta = TTAWrapper(make_model("clip").cuda(), TTAConfig(query_modality="image", autocast_dtype="bf16"))
    g = tta.encode_gallery({k: v.cuda() for k, v in batch("text", 10, seed=1).items()})
    out = tta.adapt_step({k: v.cuda() for k, v in batch("image", 6).items()}, g)
    assert out.scores.is_cuda and out.num_updates == 3
    with pytest.raises(ValueError, match="move it"):
        tta.adapt_step(batch("image", 6), g)


# ------------------------------------------------------------------------------------- per-batch work
@pytest.mark.parametrize("objective", ["tcr", "sar"])
def test_source_scores_are_computed_once_per_batch(objective):
    """Gradient decoupling needs the frozen source model's scores at every step (and in SAR's closure): they do not
    change within a batch, so adapt_step computes them once (one source forward per batch, not one per step)."""
    tta = _tta("clip", "image", objective=objective, gradient_decoupling=True, steps=3)
    g = tta.encode_gallery(batch("text", 10, seed=1))
    entered = []
    disabled = tta.disabled

    def counting():
        entered.append(1)
        return disabled()

    tta.disabled = counting
    for i in range(2):
        out = tta.adapt_step(batch("image", 6, seed=2 + i), g)
        assert out.num_updates == 3 and len(entered) == i + 1


# ------------------------------------------------------------------------------------- scoring and memory options
@pytest.mark.parametrize("objective", ["tcr", "oracle"])
def test_before_update_scoring_keeps_the_trajectory_and_answers_with_the_model_before_the_batch(objective):
    """``scoring="before_update"``: the parameters follow exactly the trajectory of ``"after_update"``; each batch is
    answered by the model as it was before adapting on it (the source model for the first batch). With the supervised
    oracle this is the prequential protocol: a batch is scored before its labels train the model."""
    g_in, stream = batch("text", 12, seed=1), [batch("image", 6, seed=50 + i) for i in range(3)]
    labels = [[i % 12] for i in range(6)]
    kw = {"labels": labels} if objective == "oracle" else {}
    after = TTAWrapper(make_model("clip"), TTAConfig(objective=objective, query_modality="image"))
    before = TTAWrapper(make_model("clip"), TTAConfig(objective=objective, query_modality="image", run=RunConfig(scoring="before_update")))
    ga, gb = after.encode_gallery(g_in), before.encode_gallery(g_in)
    for i, x in enumerate(stream):
        answered_by = {n: p.detach().clone() for n, p in before.params.items()}
        with torch.no_grad():
            expected = before.embed_and_score(x, gb)[1]  # the current model, before this batch
        if i == 0:
            assert all(torch.equal(v, before.source_parameters()[n]) for n, v in answered_by.items())
        out_b, out_a = before.adapt_step(x, gb, **kw), after.adapt_step(x, ga, **kw)
        assert torch.equal(out_b.scores, expected)
        assert not torch.allclose(out_b.scores, out_a.scores)  # the papers' answer comes after the update
        assert out_b.num_updates == out_a.num_updates > 0
        assert all(torch.equal(before.params[n], after.params[n]) for n in after.params)


def test_gradient_checkpointing_gives_the_same_adaptation():
    g_in, stream = batch("text", 12, seed=1), [batch("image", 6, seed=60 + i) for i in range(2)]
    plain = TTAWrapper(make_model("clip"), TTAConfig(objective="tcr", query_modality="image"))
    ckpt = TTAWrapper(make_model("clip"), TTAConfig(objective="tcr", query_modality="image", run=RunConfig(gradient_checkpointing=True)))
    gp, gc = plain.encode_gallery(g_in), ckpt.encode_gallery(g_in)
    for x in stream:
        assert torch.allclose(plain.adapt_step(x, gp).scores, ckpt.adapt_step(x, gc).scores, atol=1e-6)
    assert all(torch.allclose(plain.params[n], ckpt.params[n], atol=1e-6) for n in plain.params)
    assert any(m.training for m in ckpt.model.modules())  # the query tower's layers are marked for checkpointing


def test_objective_state_follows_a_live_backend_between_steps():
    """TITAN's match counts and query bank are keyed by gallery position: after ``gallery.remove`` the wrapper brings
    them to the new version (the counts lose the removed item's entry, the bank stays) instead of starting again."""
    from hf_tta import ChunkedGallery
    from support import dense_gallery

    gallery = ChunkedGallery(dense_gallery(n=30).embeddings, "text", k=8)
    tta = TTAWrapper(make_model("clip"), TTAConfig(objective="titan", query_modality="image",
                                                    objective_config={"query_bank_size": 64, "hub_threshold": 0}))
    tta.adapt_step(batch("image", 8, seed=1), gallery)
    counts, bank = tta.state["match_counts"].clone(), tta.state["query_bank"].shape[0]
    assert counts.numel() == 30 and bank > 0
    gallery.remove([int(counts.argmax())])  # the most matched item goes
    tta.adapt_step(batch("image", 8, seed=2), gallery)
    assert tta.state["match_counts"].numel() == 29
    assert tta.state["query_bank"].shape[0] > bank  # kept and extended, not started again


def test_a_batch_too_small_for_batch_statistics_warns_once_naming_the_option(caplog):
    import hf_tta.batch as batching

    batching.warned_small_batches.discard("tcr")
    tta = _tta("clip", "image")
    g = tta.encode_gallery(batch("text", 10, seed=1))
    with caplog.at_level(logging.WARNING, logger="hf_tta"):
        tta.adapt_step(batch("image", 3, seed=2), g)
        tta.adapt_step(batch("image", 2, seed=3), g)
        tta.adapt_step(batch("image", 8, seed=4), g)
    small = [r for r in caplog.records if "batch statistics" in r.getMessage()]
    assert len(small) == 1 and "scoring='before_update'" in small[0].getMessage()


def test_a_gallery_encoded_by_another_model_of_the_same_size_is_refused():
    """Two checkpoints of one architecture embed into the same dimension: a gallery from the other is garbage here."""
    captions = batch("text", 10, seed=1)
    mine = TTAWrapper(make_model("clip"), TTAConfig(objective="tcr", query_modality="image"))
    torch.manual_seed(123)
    other_model = make_model("clip")
    with torch.no_grad():
        for name, p in other_model.named_parameters():
            if name.startswith("text_model.encoder.layers.0.mlp"):
                p.add_(0.1)  # another fine-tune of the text tower
    other = TTAWrapper(other_model, TTAConfig(objective="dn", query_modality="image"))
    foreign = other.encode_gallery(captions)
    before = {n: p.detach().clone() for n, p in mine.params.items()}
    with pytest.raises(ValueError, match="encoded by another model") as err:
        mine.adapt_step(batch("image", 8, seed=2), foreign)
    assert "\n" not in str(err.value) and all(torch.equal(p, before[n]) for n, p in mine.params.items())
    # the same source model behind another wrapper (another objective, PEFT or not) is the same encoder
    same = TTAWrapper(make_model("clip"), TTAConfig(objective="dn", query_modality="image")).encode_gallery(captions)
    assert mine.adapt_step(batch("image", 8, seed=2), same).num_updates > 0
    assert mine.adapt_step(batch("image", 8, seed=3), foreign.embeddings).num_updates > 0  # a raw tensor: the user's call
