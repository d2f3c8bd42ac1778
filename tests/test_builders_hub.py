"""Building and publishing COCO-C / Flickr-C as a user meets it: every missing text resource is named (the recipe
lists missing models as its own flags) and what can be built is built; a built folder is a dataset repository
layout that ``datasets.load_dataset(folder, config)`` reads; ``--push-to-hub --dry-run`` writes the exact commit
plan (checked against a real push to the local fake Hub)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from hf_tta.data.builders import push_benchmark
from hf_tta.data.corruptions import MissingResourceError
from test_builders import install_fake_hub, make_builder, write_karpathy

REPO = Path(__file__).resolve().parents[1]
README_MODEL_FLAGS = [
    "--style-model", "formal=prithivida/informal_to_formal_styletransfer",
    "--style-model", "casual=prithivida/formal_to_informal_styletransfer",
    "--style-model", "passive=prithivida/active_to_passive_styleformer",
    "--style-model", "active=prithivida/passive_to_active_styleformer",
    "--back-translation", "facebook/wmt19-en-de", "facebook/wmt19-de-en",
]
SENTENCE = ["text-formal-1", "text-casual-1", "text-passive-1", "text-active-1", "text-back_translation-1"]


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    root = tmp_path_factory.mktemp("coco")
    write_karpathy(root, n=3)
    builder = make_builder(root, seed=0)
    return root, builder, builder.build(["clean", "image-fog-3", "text-ocr-7"])


def test_built_folder_loads_with_datasets_load_dataset(small):
    from datasets import get_dataset_config_names, load_dataset

    _, builder, built = small
    folder = str(builder.output_dir)
    assert sorted(get_dataset_config_names(folder)) == ["clean", "image-fog-3", "text-ocr-7"]
    fog = load_dataset(folder, "image-fog-3", split="test")
    assert fog["image_id"] == built["image-fog-3"]["image_id"] and len(fog) == 3
    assert np.array_equal(np.asarray(fog[1]["image"]), np.asarray(built["image-fog-3"][1]["image"]))
    text = load_dataset(folder, "text-ocr-7")["test"]
    assert text["captions"] == built["text-ocr-7"]["captions"]
    assert load_dataset(folder, split="test")["image_id"] == built["clean"]["image_id"]  # clean is the default


def test_every_missing_resource_is_named_and_the_rest_is_built(tmp_path):
    write_karpathy(tmp_path, n=2)
    models = {n: str(tmp_path / f"no-{n}") for n in ("formal", "casual", "passive", "active")}
    models["back_translation"] = (str(tmp_path / "no-en-de"), str(tmp_path / "no-de-en"))
    configs = ["clean", "text-ocr-7", *SENTENCE]
    with pytest.raises(MissingResourceError, match=r"5 text corruptions lack.*active, back_translation, casual, formal, passive"):
        make_builder(tmp_path, out="a", text_models=models).build(configs)
    assert not (tmp_path / "a" / "clean").exists()  # stopped before any work
    builder = make_builder(tmp_path, out="b", text_models=models)
    built = builder.build(configs, skip_missing=True)
    assert sorted(built) == ["clean", "text-ocr-7"]
    assert builder.left_out == {c: [c.split("-")[1]] for c in SENTENCE}
    assert sorted(builder.missing_resources) == ["active", "back_translation", "casual", "formal", "passive"]


def test_recipe_lists_every_missing_model_as_cli_flags(tmp_path):
    json_path = write_karpathy(tmp_path, n=2)
    out = tmp_path / "out"
    cmd = [sys.executable, str(REPO / "recipes" / "build_benchmarks.py"), "--benchmark", "coco-c", "--karpathy-json",
           str(json_path), "--images-root", str(tmp_path), "--output-dir", str(out), "-q", *README_MODEL_FLAGS,
           "--configs", "clean", "text-ocr-7", *SENTENCE]
    env = dict(os.environ, PYTHONPATH=str(REPO), HF_HUB_OFFLINE="1")
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO, timeout=600)
    assert res.returncode == 1
    assert "Traceback" not in res.stderr and "models={" not in res.stderr  # no Python keyword form
    for flag in ("--style-model formal=prithivida/informal_to_formal_styletransfer",
                 "--style-model casual=prithivida/formal_to_informal_styletransfer",
                 "--style-model passive=prithivida/active_to_passive_styleformer",
                 "--style-model active=prithivida/passive_to_active_styleformer",
                 "--back-translation facebook/wmt19-en-de facebook/wmt19-de-en"):
        assert flag in res.stderr
    assert "5 configs not built" in res.stderr
    assert sorted(p.name for p in out.iterdir() if p.is_dir() and not p.name.startswith(".")) == ["clean", "text-ocr-7"]


def test_dry_run_writes_the_exact_commit_plan(small, tmp_path, monkeypatch):
    from huggingface_hub import DatasetCard

    _, builder, _ = small
    api, state = install_fake_hub(monkeypatch, tmp_path / "hub")
    configs = ["clean", "image-fog-3", "text-ocr-7"]
    kw = dict(configs=configs, api=api, show_progress=False, max_shard_size=3_000)
    assert push_benchmark(builder.output_dir, "me/bench", dry_run=True, **kw) == configs
    assert state["commits"] == 0 and not (tmp_path / "hub" / "me" / "bench").exists()  # nothing uploaded
    plan = json.loads((builder.output_dir / "push_plan.json").read_text())
    assert [c["commit_message"] for c in plan["commits"]] == [f"Add config {c}" for c in configs] + ["Update dataset card"]

    assert push_benchmark(builder.output_dir, "me/bench", **kw) == configs
    repo = tmp_path / "hub" / "me" / "bench"
    pushed = sorted(str(p.relative_to(repo)) for p in repo.rglob("*.parquet"))
    planned = sorted(f["path_in_repo"] for c in plan["commits"] for f in c["files"] if f["path_in_repo"].endswith(".parquet"))
    assert pushed == planned and len(planned) > len(configs)  # several shards: the shard count is planned exactly
    import pyarrow.parquet as pq

    rows = {f["path_in_repo"]: f["num_rows"] for c in plan["commits"] for f in c["files"] if "num_rows" in f}
    assert all(pq.read_metadata(repo / p).num_rows == n for p, n in rows.items())
    assert state["commits"] == len(plan["commits"])
    preview = DatasetCard.load(builder.output_dir / "push_plan.README.md")
    assert [c["config_name"] for c in preview.data.configs] == [c["config_name"] for c in DatasetCard.load(repo / "README.md").data.configs]


def test_dry_run_offline_plans_every_config(small, monkeypatch):
    _, builder, _ = small

    class Offline:
        def hf_hub_download(self, *args, **kwargs):
            raise OSError("offline")

    assert push_benchmark(builder.output_dir, "me/x", api=Offline(), show_progress=False, dry_run=True) == ["clean", "image-fog-3", "text-ocr-7"]
    plan = json.loads((builder.output_dir / "push_plan.json").read_text())
    assert plan["remote_state"].startswith("unreachable (OSError)")
    with pytest.raises(OSError):  # a real push does not guess
        push_benchmark(builder.output_dir, "me/x", api=Offline(), show_progress=False)
