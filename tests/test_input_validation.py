"""Inputs checked at the boundary, per modality (issue 12, item 1): each refused case names the fix, and a refused
call leaves the adapted parameters, the optimiser state, the objective state, the counters and the RNG bit-identical
(and the caller's dict untouched)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hf_tta import DualEncoderAdapter, TTAConfig, TTAWrapper, TuningConfig
from hf_tta.models.inputs import FEATURES, InputSpec
from tiny_av_models import clap_audio_batch, tiny_clap, tiny_clip, tiny_xclip, video_batch
from tiny_models import TINY_MODELS, batch, make_model, text_batch

IMAGE_PROCESSOR = {
    "clip": "CLIPProcessor / CLIPImageProcessor",
    "siglip": "SiglipProcessor / SiglipImageProcessor",
    "blip": "BlipProcessor / BlipImageProcessor",
    "blip2": "Blip2Processor / BlipImageProcessor",
    "vtde": "VisionTextDualEncoderProcessor / AutoImageProcessor",
}
TEXT_VOCAB = {"clip": 99, "siglip": 99, "blip": 99, "blip2": 99, "vtde": 99}


def _image_cases(processor):
    px = batch("image", 3, seed=5)["pixel_values"]
    return {
        "uint8 pixels": ({"pixel_values": (px.clamp(-1, 1) * 127 + 128).to(torch.uint8)}, TypeError, processor),
        "int64 pixels": ({"pixel_values": px.long()}, TypeError, "not raw integer/bool"),
        "bool pixels": ({"pixel_values": px > 0}, TypeError, processor),
        "3-D pixels": ({"pixel_values": px[0]}, ValueError, r"shape \(B, C, H, W\).*unsqueeze\(0\)"),
        "5-D pixels": ({"pixel_values": px[None]}, ValueError, r"\(B, C, H, W\), 4 dimensions"),
        "1 channel": ({"pixel_values": px[:, :1]}, ValueError, r"size 1 on axis -3 \(C\).*expects 3 \(vision_config.num_channels=3\)"),
        "4 channels": ({"pixel_values": torch.cat([px, px[:, :1]], 1)}, ValueError, "expects 3"),
        "float 0..255 pixels": ({"pixel_values": px.clamp(-1, 1) * 127 + 128}, ValueError, f"raw 0..255 pixels.*{processor}"),
        "64x48 pixels": ({"pixel_values": torch.nn.functional.interpolate(px, size=(64, 48))}, ValueError,
                         rf"^image inputs are 64x48 images but the model expects 32x32 \(vision_config.image_size=32\): "
                         rf"preprocess them with the model's processor \({processor}\)"),
    }


def _text_cases(vocab, processor="Tokenizer"):
    t = text_batch(3, seed=5)
    ids, mask = t["input_ids"], t["attention_mask"]
    return {
        "float ids": ({"input_ids": ids.float(), "attention_mask": mask}, TypeError, "token ids must be integers"),
        "bool ids": ({"input_ids": ids > 50, "attention_mask": mask}, TypeError, "token ids must be integers"),
        "ids >= vocab": ({"input_ids": ids + vocab, "attention_mask": mask}, ValueError, f"vocabulary has {vocab} tokens"),
        "negative ids": ({"input_ids": ids - 200, "attention_mask": mask}, ValueError, r"ids in \[-"),
        "1-D ids": ({"input_ids": ids[0]}, ValueError, r"shape \(B, L\).*unsqueeze"),
        "mask shape": ({"input_ids": ids, "attention_mask": mask[:, :-1]}, ValueError, "the shape of 'input_ids'"),
    }


CASES = []  # (model key, query modality, case name, inputs, error, message pattern)
for name in sorted(TINY_MODELS):
    CASES += [(name, "image", c, *v) for c, v in _image_cases(IMAGE_PROCESSOR[name]).items()]
    CASES += [(name, "text", c, *v) for c, v in _text_cases(TEXT_VOCAB[name]).items()]

_px = clap_audio_batch(3, seed=5)["input_features"]
CASES += [
    ("clap", "audio", "int features", {"input_features": _px.long()}, TypeError, "ClapProcessor / ClapFeatureExtractor"),
    ("clap", "audio", "3-D features", {"input_features": _px[:, 0]}, ValueError, r"\(B, C, time, mel\)"),
    ("clap", "audio", "2 channels", {"input_features": _px.repeat(1, 2, 1, 1)}, ValueError, "patch_embed_input_channels=1"),
    ("clap", "audio", "wrong mel bins", {"input_features": _px[..., :8]}, ValueError, "num_mel_bins=16"),
]
CASES += [("clap", "text", c, *v) for c, v in _text_cases(99).items() if c in ("float ids", "ids >= vocab")]
_vid = video_batch(2, seed=5)["pixel_values"]
CASES += [
    ("xclip", "video", "uint8 video", {"pixel_values": _vid.to(torch.uint8)}, TypeError, "XCLIPProcessor / VideoMAEImageProcessor"),
    ("xclip", "video", "4-D video", {"pixel_values": _vid[:, 0]}, ValueError, r"\(B, T, C, H, W\)"),
    ("xclip", "video", "3 frames", {"pixel_values": _vid[:, :3]}, ValueError, "vision_config.num_frames=4"),
    ("xclip", "video", "1 channel", {"pixel_values": _vid[:, :, :1]}, ValueError, "vision_config.num_channels=3"),
    ("xclip", "video", "16x16 frames", {"pixel_values": _vid[..., :16, :16]}, ValueError, r"video inputs are 16x16 images but the model expects"),
    ("xclip", "video", "float 0..255 video", {"pixel_values": _vid.clamp(-1, 1) * 127 + 128}, ValueError, "raw 0..255 pixels"),
    ("clip_video", "video", "float 0..255 video", {"pixel_values": _vid.clamp(-1, 1) * 127 + 128}, ValueError, "raw 0..255"),
    ("clip_video", "video", "16x16 frames", {"pixel_values": _vid[..., :16, :16]}, ValueError, r"expects 32x32 .*CLIPImageProcessor"),
    ("clip_video", "video", "4-D video", {"pixel_values": _vid[:, 0]}, ValueError, r"\(B, T, C, H, W\)"),
    ("clip_video", "video", "int video", {"pixel_values": _vid.long()}, TypeError, "CLIPImageProcessor"),
    ("clip_video", "video", "frame_mask rank", {"pixel_values": _vid, "frame_mask": torch.ones(2)}, ValueError, r"\(B, T\)"),
]

GOOD = {
    "image": lambda: batch("image", 4, seed=2),
    "text": lambda: text_batch(4, seed=2),
    "audio": lambda: clap_audio_batch(4, seed=2),
    "video": lambda: video_batch(4, seed=2),
}
GALLERY = {"image": "text", "text": "image", "audio": "text", "video": "text"}


def _model(key):
    if key == "clap":
        return tiny_clap()
    if key == "xclip":
        return tiny_xclip()
    if key == "clip_video":
        return tiny_clip()
    return make_model(key)


def _gallery_inputs(modality):
    return {"image": batch("image", 6, seed=1), "text": text_batch(6, seed=1), "audio": clap_audio_batch(6, seed=1)}[modality]


_WRAPPERS: dict = {}


def _wrapper(key, query):
    """One adapted wrapper per (model, query modality), with non-trivial optimiser and objective state."""
    if (key, query) not in _WRAPPERS:
        tta = TTAWrapper(_model(key), TTAConfig(objective="tcr", query_modality=query, steps=1))
        g = tta.encode_gallery(_gallery_inputs(tta.gallery_modality))
        out = tta.adapt_step(GOOD[query](), g)
        assert out.num_updates == 1 and tta.optimizer.state and tta.state
        _WRAPPERS[key, query] = (tta, g)
    return _WRAPPERS[key, query]


def _snapshot(tta):
    opt = {id_: {k: v.clone() if torch.is_tensor(v) else v for k, v in st.items()} for id_, st in tta.optimizer.state_dict()["state"].items()}
    return (
        {n: p.detach().clone() for n, p in tta.params.items()},
        opt,
        {k: v.clone() for k, v in tta.state.items()},
        tta.batch_index,
        tta.generator.get_state().clone(),
    )


def _assert_bit_identical(before, after):
    params_b, opt_b, state_b, index_b, rng_b = before
    params_a, opt_a, state_a, index_a, rng_a = after
    assert params_a.keys() == params_b.keys() and all(torch.equal(params_a[n], params_b[n]) for n in params_b)
    assert opt_a.keys() == opt_b.keys()
    for pid in opt_b:
        for k, v in opt_b[pid].items():
            assert torch.equal(opt_a[pid][k], v) if torch.is_tensor(v) else opt_a[pid][k] == v
    assert state_a.keys() == state_b.keys() and all(torch.equal(state_a[k], state_b[k]) for k in state_b)
    assert index_a == index_b and torch.equal(rng_a, rng_b)


@pytest.mark.parametrize(
    "key,query,case,inputs,error,message", CASES, ids=[f"{c[0]}-{c[1]}-{c[2].replace(' ', '_')}" for c in CASES]
)
def test_refused_input_names_the_fix_and_changes_nothing(key, query, case, inputs, error, message):
    tta, g = _wrapper(key, query)
    before = _snapshot(tta)
    originals = {k: v.clone() for k, v in inputs.items()}
    with pytest.raises(error, match=message):
        tta.adapt_step(inputs, g)
    _assert_bit_identical(before, _snapshot(tta))
    assert all(torch.equal(inputs[k], originals[k]) and inputs[k].dtype == originals[k].dtype for k in originals)


@pytest.mark.parametrize("key,query,case,inputs,error,message", [c for c in CASES if c[0] == "clip"][:: 3])
def test_gallery_inputs_are_checked_the_same_way(key, query, case, inputs, error, message):
    """encode_gallery applies the gallery modality's specs (here: CLIP with the refused case as the gallery)."""
    tta = TTAWrapper(make_model("clip"), TTAConfig(query_modality=GALLERY[query]))
    with pytest.raises(error, match=message):
        tta.encode_gallery(inputs)


def test_the_adapter_embed_checks_too():
    adapter = _wrapper("clip", "image")[0].adapter
    with pytest.raises(TypeError, match="CLIPProcessor / CLIPImageProcessor"):
        adapter.embed("image", {"pixel_values": torch.zeros(2, 3, 32, 32, dtype=torch.uint8)})


def test_other_float_dtype_is_cast_once_to_the_models():
    """float64 pixels give exactly the float32 result (cast at the boundary); the caller's tensor keeps its dtype."""
    q = batch("image", 4, seed=2)
    q64 = {"pixel_values": q["pixel_values"].double()}
    runs = []
    for inputs in (q, q64):
        tta = TTAWrapper(make_model("clip"), TTAConfig(query_modality="image"))
        g = tta.encode_gallery(text_batch(6, seed=1))
        runs.append((tta.adapt_step(inputs, g).scores, {n: p.detach().clone() for n, p in tta.params.items()}))
    assert torch.equal(runs[0][0], runs[1][0])
    assert all(torch.equal(runs[0][1][n], runs[1][1][n]) for n in runs[0][1])
    assert q64["pixel_values"].dtype == torch.float64
    tta = TTAWrapper(make_model("clip").to(torch.bfloat16), TTAConfig(objective="dn", query_modality="image"))
    checked = tta.forward.check_inputs(q, "image")
    assert checked["pixel_values"].dtype == torch.bfloat16 and q["pixel_values"].dtype == torch.float32


def test_blip2_accepts_the_processors_image_tokens():
    """Blip2Processor prepends num_query_tokens image tokens whose id may lie past the Q-Former vocabulary."""
    model = make_model("blip2")
    model.config.image_token_index = 99
    tta = TTAWrapper(model, TTAConfig(objective="dn", query_modality="text"))
    t = text_batch(2, seed=3)
    prefix = torch.full((2, model.config.num_query_tokens), 99)
    ids = torch.cat([prefix, t["input_ids"]], 1)
    checked = tta.forward.check_inputs({"input_ids": ids, "attention_mask": torch.ones_like(ids)}, "text")
    assert torch.equal(checked["input_ids"], ids)
    with pytest.raises(ValueError, match="image_token_index=99"):
        tta.forward.check_inputs({"input_ids": ids + 1}, "text")


class _TwoTower(nn.Module):
    def __init__(self):
        super().__init__()
        self.img = nn.Sequential(nn.Linear(6, 8), nn.LayerNorm(8))
        self.txt = nn.Sequential(nn.Embedding(10, 8), nn.LayerNorm(8))


def _two_tower(**kwargs):
    torch.manual_seed(0)
    return DualEncoderAdapter(
        _TwoTower(),
        encoders={"image": lambda m, x: m.img(x["pixel_values"]), "text": lambda m, x: m.txt(x["input_ids"]).mean(1)},
        towers={"image": ["img"], "text": ["txt"]},
        **kwargs,
    )


def test_custom_dual_encoder_checks_dtypes_and_declared_specs():
    adapter = _two_tower()
    with pytest.raises(TypeError, match="not raw integer/bool"):
        adapter.check_inputs("image", {"pixel_values": torch.zeros(2, 6, dtype=torch.long)})
    with pytest.raises(TypeError, match="token ids must be integers"):
        adapter.check_inputs("text", {"input_ids": torch.zeros(2, 5)})
    assert adapter.check_inputs("image", {"pixel_values": torch.zeros(2, 6)})["pixel_values"].shape == (2, 6)  # any layout
    spec = InputSpec(FEATURES, layout=("B", "F"), sizes=((1, 6, "img.0.in_features=6"),), processor="my_featurizer")
    declared = _two_tower(input_specs={"image": {"pixel_values": spec}})
    with pytest.raises(ValueError, match=r"expects 6 \(img.0.in_features=6\).*my_featurizer"):
        declared.check_inputs("image", {"pixel_values": torch.zeros(2, 5)})


def test_input_spec_kind_is_validated():
    with pytest.raises(ValueError, match="kind must be one of"):
        InputSpec("pixels")


def test_gallery_tensors_are_checked_and_cast_once():
    tta = TTAWrapper(make_model("clip"), TTAConfig(query_modality="image"))
    g = tta.encode_gallery(text_batch(8, seed=1))
    q = batch("image", 4, seed=2)
    for bad, words in [
        (g.embeddings[0], "floating-point \\(N, D\\) or \\(N, Q, D\\)"),  # 1-D
        (g.embeddings.long(), "floating-point"),
        (g.embeddings.numpy(), "must be a GalleryCache"),
    ]:
        with pytest.raises((ValueError, TypeError), match=words):
            tta.adapt_step(q, bad)
    assert tta.batch_index == 0  # refused before anything ran
    half = g.embeddings.half()  # another float dtype: cast once to the model's, as query features are
    out = tta.adapt_step(q, half)
    held = tta.forward.check_gallery(half)  # the GalleryCache the step used
    assert out.scores.dtype == torch.float32 and held.embeddings.dtype == torch.float32
    tta.adapt_step(batch("image", 4, seed=3), half)
    assert tta.forward.check_gallery(half) is held  # the same tensor is wrapped and NaN-checked once, not per batch
    half.mul_(1.0)  # modified in place: wrapped again
    tta.adapt_step(batch("image", 4, seed=4), half)
    assert tta.forward.check_gallery(half) is not held


def test_a_model_already_wrapped_is_refused_in_one_line():
    model = make_model("clip")
    TTAWrapper(model, TTAConfig(query_modality="image"))
    flags = [p.requires_grad for p in model.parameters()]
    with pytest.raises(ValueError, match="already wrapped by a TTAWrapper") as err:
        TTAWrapper(model, TTAConfig(query_modality="image"))
    assert "\n" not in str(err.value) and len(str(err.value)) < 300
    assert [p.requires_grad for p in model.parameters()] == flags
    lora = make_model("clip")
    TTAWrapper(lora, TTAConfig(query_modality="image", tuning=TuningConfig(method="lora", target_modules=".*vision_model.*fc1")))
    with pytest.raises(ValueError, match="carries PEFT adapter layers"):
        TTAWrapper(lora, TTAConfig(query_modality="image"))
    import copy

    assert TTAWrapper(copy.deepcopy(model), TTAConfig(query_modality="image")).params  # a copy starts afresh


@pytest.mark.parametrize("processor_class", ["CLIPImageProcessor", "SiglipImageProcessor", "BlipImageProcessor", "ViTImageProcessor"])
def test_every_image_processors_output_passes_the_pixel_range_check(processor_class):
    """The other side of the 0..255 refusal: real processors' outputs (extreme images included) are never refused."""
    import numpy as np
    import transformers
    from PIL import Image

    from hf_tta.models.inputs import PIXEL_MAX_ABS

    rng = np.random.default_rng(0)
    arrays = [np.zeros((40, 40, 3), np.uint8), np.full((40, 40, 3), 255, np.uint8), rng.integers(0, 256, (40, 40, 3), dtype=np.uint8)]
    arrays.append(np.stack([np.full((40, 40), 255), np.zeros((40, 40)), np.full((40, 40), 255)], -1).astype(np.uint8))
    proc = getattr(transformers, processor_class)(size={"height": 32, "width": 32}, crop_size={"height": 32, "width": 32})
    px = proc(images=[Image.fromarray(a) for a in arrays], return_tensors="pt")["pixel_values"]
    assert 0.99 < px.abs().max() < PIXEL_MAX_ABS  # normalised: [-1, 1] (SigLIP, ViT) to about +-2.6
    tta, g = _wrapper("clip", "image")
    before = _snapshot(tta)
    checked = tta.adapter.check_inputs("image", {"pixel_values": px})
    assert torch.equal(checked["pixel_values"], px)
    _assert_bit_identical(before, _snapshot(tta))
    bad = px.clone()
    bad[0, 0, 0, 0] = float("inf")  # not a range problem: the wrapper's NaN/inf check names it
    assert torch.equal(tta.adapter.check_inputs("image", {"pixel_values": bad})["pixel_values"], bad)


@pytest.mark.parametrize("name", ["clip", "siglip"])
def test_wrong_image_size_names_the_checkpoints_processor_and_changes_nothing(name, tmp_path):
    """A checkpoint loaded by path: the refusal names the processor call of that path, in one line, before the
    tower's own error ("Input image size (64*64) doesn't match model (32*32)." without the processor)."""
    from transformers import AutoModel

    make_model(name).save_pretrained(tmp_path / name)
    tta = TTAWrapper(AutoModel.from_pretrained(tmp_path / name), TTAConfig(objective="tcr", query_modality="image"))
    g = tta.encode_gallery(_gallery_inputs("text"))
    tta.adapt_step(GOOD["image"](), g)
    before = _snapshot(tta)
    px = torch.nn.functional.interpolate(batch("image", 4, seed=3)["pixel_values"], size=(64, 64))
    with pytest.raises(ValueError) as err:
        tta.adapt_step({"pixel_values": px}, g)
    assert str(err.value) == (
        "image inputs are 64x64 images but the model expects 32x32 (vision_config.image_size=32): preprocess them with "
        f"the model's processor (AutoProcessor.from_pretrained({str(tmp_path / name)!r})), which resizes them.")
    _assert_bit_identical(before, _snapshot(tta))


def test_a_tower_that_takes_any_size_is_not_refused():
    """A ConvNeXt vision tower (the emoji source model's) has no position embeddings: any H x W runs."""
    from transformers import BertConfig, ConvNextConfig, VisionTextDualEncoderConfig, VisionTextDualEncoderModel

    vision = ConvNextConfig(num_channels=3, num_stages=2, hidden_sizes=[8, 16], depths=[1, 1], image_size=32, hidden_size=16)
    text = BertConfig(vocab_size=99, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=20)
    model = VisionTextDualEncoderModel(VisionTextDualEncoderConfig.from_vision_text_configs(vision, text, projection_dim=8))
    tta = TTAWrapper(model.eval(), TTAConfig(objective="tent", query_modality="image"))
    for side in (32, 48):
        assert tta.adapter.embed("image", {"pixel_values": torch.randn(2, 3, side, side)}).shape == (2, 8)
