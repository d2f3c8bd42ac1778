"""COCO-C / Flickr-C builders on a tiny Karpathy-layout fixture written to tmp_path: schema, counts and ids,
determinism, resuming, missing/corrupt sources, loading helpers, the dataset card, and one real ``push_to_hub``
against a local fake Hub, loaded back with ``load_dataset``."""

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image

from hf_tta.data.builders import (
    BenchmarkBuilder,
    card_text,
    config_name,
    default_configs,
    image_features,
    load_retrieval_split,
    parse_config_name,
    push_benchmark,
    text_features,
)
from hf_tta.data.builders.specs import COCO_C
from hf_tta.data.corruptions import IMAGE_CORRUPTIONS as IMAGE_NAMES
from hf_tta.metrics import retrieval_metrics

CAPTIONS = [
    "A train traveling down tracks next to a brick building.",
    "A dog runs across the green field.",
    "Two people ride bicycles on a city street.",
    "A plate of food with broccoli and rice.",
    "A cat sleeping on a red couch.",
    "A man holding an umbrella in the rain.",
]
TEXT_POOL = (("ocr", 7), ("char_swap", 7), ("random_swap", 7), ("insert_punctuation", 7))
CONFIGS = ["clean", "image-gaussian_noise-5", "image-fog-1", "image-diverse", "text-ocr-7", "text-random_deletion-7", "text-diverse"]


def write_karpathy(root: Path, kind: str = "coco", n: int = 4) -> Path:
    """n test images (image 0 has 6 captions), one train image; COCO layout uses filepath 'val2014'."""
    rng = np.random.default_rng(0)
    folder = root / "val2014" if kind == "coco" else root / "flickr30k-images"
    folder.mkdir(parents=True, exist_ok=True)
    images, sid = [], 100
    for i in range(n + 1):
        fn = f"COCO_val2014_{i:012d}.jpg" if kind == "coco" else f"{1000 + i}.jpg"
        Image.fromarray(rng.integers(0, 256, (36 + 4 * i, 48, 3), dtype=np.uint8)).save(folder / fn)
        k = 6 if i == 0 else 5
        sents = [{"raw": CAPTIONS[(i + j) % 6], "tokens": [], "sentid": sid + j, "imgid": 10 + i} for j in range(k)]
        sid += k
        entry = {"filename": fn, "split": "test" if i < n else "train", "imgid": 10 + i, "sentids": [s["sentid"] for s in sents], "sentences": sents}
        if kind == "coco":
            entry.update(filepath="val2014", cocoid=5000 + i)
        images.append(entry)
    path = root / ("dataset_coco.json" if kind == "coco" else "dataset_flickr30k.json")
    path.write_text(json.dumps({"images": images, "dataset": kind}))
    return path


def make_builder(root: Path, out: str = "out", kind: str = "coco", **kw) -> BenchmarkBuilder:
    json_path = root / ("dataset_coco.json" if kind == "coco" else "dataset_flickr30k.json")
    images_root = root if kind == "coco" else root / "flickr30k-images"
    kw.setdefault("text_pool", TEXT_POOL)
    return BenchmarkBuilder("coco-c" if kind == "coco" else "flickr-c", json_path, images_root, root / out, show_progress=False, **kw)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("coco")
    write_karpathy(root)
    builder = make_builder(root, seed=0)
    return root, builder, builder.build(CONFIGS)


def test_config_names():
    assert config_name("image", "gaussian_noise", 5) == "image-gaussian_noise-5"
    assert config_name(None) == "clean" and config_name("text", "diverse") == "text-diverse"
    assert parse_config_name("text-ocr-7").severity == 7
    for bad in ("image-gaussian_noise-6", "text-formal-2", "image-ocr-1", "fog_5", "data"):
        with pytest.raises(ValueError):
            parse_config_name(bad)
    full = default_configs()
    assert len(full) == 1 + 16 * 5 + 15 + 2 and full[0] == "clean"
    assert "text-ocr-7" in full and "text-formal-1" in full and "text-ocr-1" not in full
    assert len(default_configs(text_severity_mode="paper")) == 1 + 80 + 5 * 7 + 5 * 2 + 5 + 2


def test_schema_counts_and_stable_ids(built):
    _, builder, ds = built
    assert set(ds) == set(CONFIGS)
    for name, d in ds.items():
        assert len(d) == 4, name  # the train image is not in the test split
        assert d.features == (text_features() if name.startswith("text-") else image_features()), name
        assert d["image_id"] == [10, 11, 12, 13]
        assert d["source_id"] == ["5000", "5001", "5002", "5003"]
        assert [len(c) for c in d["caption_ids"]] == [5, 5, 5, 5]  # the 6th caption of image 10 is cut ...
    report = json.loads((builder.output_dir / "build_info.json").read_text())["source_report"]
    assert report["truncated_captions"] == 1 and report["images_with_extra_captions"] == 1  # ... and counted
    assert report["num_images"] == 4 and report["num_captions"] == 20 and report["problems"] == 0
    clean = ds["clean"]
    assert clean["caption_ids"][1] == [106, 107, 108, 109, 110]
    assert clean["captions"][0] == CAPTIONS[:5]
    # clean keeps the original bytes; corrupted images keep each image's size
    src = Path(builder.images_root) / "val2014" / clean["filename"][2]
    assert clean.with_format("arrow")["image"].to_pylist()[2]["bytes"] == src.read_bytes()
    for name in ("image-gaussian_noise-5", "image-fog-1", "image-diverse"):
        d = ds[name]
        for k in range(4):
            assert d[k]["image"].size == clean[k]["image"].size and d[k]["image"].mode == "RGB"
            assert not np.array_equal(np.asarray(d[k]["image"]), np.asarray(clean[k]["image"].convert("RGB")))
    assert ds["image-gaussian_noise-5"]["corruption"] == ["gaussian_noise"] * 4
    assert ds["image-gaussian_noise-5"]["severity"] == [5] * 4
    text = ds["text-ocr-7"]
    assert text["clean_captions"] == clean["captions"] and text["caption_ids"] == clean["caption_ids"]
    changed = [a != b for caps, cl in zip(text["captions"], text["clean_captions"]) for a, b in zip(caps, cl)]
    assert sum(changed) >= 18  # nlpaug's OcrAug may find nothing to replace in a rare draw
    assert text["corruption"][0] == ["ocr"] * 5 and text["severity"][0] == [7] * 5


def test_diverse_configs_draw_per_query(built):
    _, _, ds = built
    draws = [c for row in ds["text-diverse"]["corruption"] for c in row]
    assert len(draws) == 20 and len(set(draws)) >= 3 and set(draws) <= {n for n, _ in TEXT_POOL}
    assert len(set(ds["image-diverse"]["corruption"])) >= 2


def test_determinism_and_seed(built, tmp_path):
    root, _, ds = built
    again = make_builder(root, out=str(tmp_path / "again"), seed=0).build(["image-diverse", "text-diverse", "image-gaussian_noise-5"])
    other = make_builder(root, out=str(tmp_path / "other"), seed=1).build(["image-gaussian_noise-5", "text-diverse"])

    def image_bytes(d):
        return [r["bytes"] for r in d.with_format("arrow")["image"].to_pylist()]

    for name in ("image-diverse", "image-gaussian_noise-5"):
        assert image_bytes(again[name]) == image_bytes(ds[name]), name
        assert again[name]["corruption"] == ds[name]["corruption"]
    assert again["text-diverse"]["captions"] == ds["text-diverse"]["captions"]
    assert image_bytes(other["image-gaussian_noise-5"]) != image_bytes(ds["image-gaussian_noise-5"])
    assert other["text-diverse"]["captions"] != ds["text-diverse"]["captions"]


def test_resume_skips_complete_configs_and_refuses_other_settings(built, monkeypatch):
    root, builder, _ = built
    fresh = make_builder(root, seed=0)
    (fresh.output_dir / ".tmp-image-contrast-2").mkdir()  # leftovers of an interrupted build are ignored
    monkeypatch.setattr(BenchmarkBuilder, "build_config", lambda *a, **k: pytest.fail("rebuilt a complete config"))
    assert set(fresh.build(CONFIGS)) == set(CONFIGS)
    with pytest.raises(ValueError, match="other settings"):
        make_builder(root, seed=5).build(["image-contrast-2"])
    with pytest.raises(ValueError, match="other settings"):  # generate settings change the sentence-level configs
        make_builder(root, seed=0, generate_kwargs={"num_beams": 4}).build(["image-contrast-2"])


def test_missing_and_corrupt_sources_are_reported(tmp_path):
    write_karpathy(tmp_path, n=5)
    (tmp_path / "val2014" / "COCO_val2014_000000000001.jpg").unlink()
    (tmp_path / "val2014" / "COCO_val2014_000000000003.jpg").write_bytes(b"\xff\xd8\xff\xe0 not really a jpeg")
    with pytest.raises(FileNotFoundError, match=r"2 of 5 source images.*1 missing.*1 unreadable"):
        make_builder(tmp_path, seed=0).build(["clean"])
    builder = make_builder(tmp_path, out="skip", seed=0, on_missing="skip")
    ds = builder.build(["clean", "text-ocr-7"])
    assert ds["clean"]["image_id"] == [10, 12, 14] and ds["text-ocr-7"]["image_id"] == [10, 12, 14]
    report = json.loads((builder.output_dir / "build_info.json").read_text())["source_report"]
    assert len(report["missing"]) == 1 and len(report["unreadable"]) == 1 and report["problems"] == 2


def test_an_image_without_captions_and_an_unknown_benchmark_are_one_line_errors(tmp_path):
    path = write_karpathy(tmp_path, n=3)
    data = json.loads(path.read_text())
    data["images"][1]["sentences"] = []  # would be an i2t query with no relevant caption, failing only at evaluation
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=r"entry #1 \(COCO_val2014_000000000001.jpg\) has no sentences"):
        make_builder(tmp_path, seed=0).build(["clean"])
    with pytest.raises(ValueError, match="Unknown benchmark 'coco'; choose from coco-c, flickr-c"):
        BenchmarkBuilder("coco", path, tmp_path, tmp_path / "out")


def test_flickr_layout(tmp_path):
    write_karpathy(tmp_path, kind="flickr", n=2)
    ds = make_builder(tmp_path, kind="flickr", seed=0).build(["clean", "image-pixelate-5"])
    assert ds["clean"]["source_id"] == ["1000", "1001"] and ds["clean"]["filename"] == ["1000.jpg", "1001.jpg"]
    assert len(ds["image-pixelate-5"]) == 2


def test_loading_helpers_give_queries_gallery_and_relevance(built):
    _, builder, _ = built
    i2t = load_retrieval_split(builder.output_dir, "image-gaussian_noise-5")
    assert i2t.task == "i2t" and len(i2t.queries) == 4 and len(i2t.gallery) == 20
    assert i2t.relevant[1] == [5, 6, 7, 8, 9] and i2t.query_ids == [10, 11, 12, 13]
    assert isinstance(i2t.queries[0], Image.Image) and all(isinstance(g, str) for g in i2t.gallery)
    t2i = load_retrieval_split(builder, "text-ocr-7")
    assert t2i.task == "t2i" and len(t2i.queries) == 20 and len(t2i.gallery) == 4
    assert t2i.relevant[:6] == [[0]] * 5 + [[1]] and t2i.query_ids[:2] == [100, 101]
    assert t2i.gallery[0].mode == "RGB" and t2i.query_corruptions[0] == ("ocr", 7)
    with pytest.raises(ValueError, match="task"):
        load_retrieval_split(builder, "clean")
    assert load_retrieval_split(builder, "clean", task="t2i").queries[0] == CAPTIONS[0]

    # perfect scores give R@1 = 100 with the relevance lists
    scores = torch.zeros(len(t2i.queries), len(t2i.gallery))
    for q, rel in enumerate(t2i.relevant):
        scores[q, rel[0]] = 1.0
    assert t2i.evaluate(scores)["R@1"] == 100.0 == retrieval_metrics(scores, t2i.relevant)["R@1"]

    # through a processor: dict batches for TTAWrapper.encode_gallery / adapt_step
    def processor(images=None, text=None, return_tensors=None, **kw):
        if images is not None:
            return {"pixel_values": torch.stack([torch.from_numpy(np.asarray(im.resize((8, 8)), dtype=np.float32)) for im in images])}
        return {"input_ids": torch.ones(len(text), 3, dtype=torch.long), "attention_mask": torch.ones(len(text), 3, dtype=torch.long)}

    batches = list(i2t.query_inputs(processor, batch_size=3))
    assert [b["pixel_values"].shape[0] for b in batches] == [3, 1]
    assert sum(b["input_ids"].shape[0] for b in i2t.gallery_inputs(processor, batch_size=8)) == 20


def test_dataset_card_text(built):
    _, builder, _ = built
    info = json.loads((builder.output_dir / "build_info.json").read_text())
    text = card_text(COCO_C, "me/coco-c", info, CONFIGS)
    for needle in ("0.38", "0.05", "(0.6, 0.75)", "Karpathy", "CC BY 4.0", "@inproceedings{li2025tcr", "hendrycks2019",
                   "text-diverse", "image-gaussian_noise-5", "aug_word_p=0.05*s", "1 extra captions"):
        assert needle in text, needle


# ------------------------------------------------------------------------------------------------ fake Hub
def install_fake_hub(monkeypatch, root: Path):
    """A local stand-in for the Hub: ``HfApi`` in datasets' push code + ``HfFileSystem`` mapped to ``root``."""
    import datasets.arrow_dataset
    import datasets.dataset_dict
    from fsspec.implementations.local import LocalFileSystem
    from huggingface_hub import CommitOperationAdd, CommitOperationDelete
    from huggingface_hub.errors import EntryNotFoundError, RepositoryNotFoundError

    state = {"commits": 0}

    class FakeApi:
        def __init__(self, *args, **kwargs):
            pass

        def repo_info(self, repo_id, repo_type=None, revision=None, **kwargs):
            if not (root / repo_id).is_dir():
                raise RepositoryNotFoundError(f"{repo_id} not found", response=SimpleNamespace(status_code=404, headers={}, request=None))
            return SimpleNamespace(id=repo_id, sha=f"{state['commits']:040x}")

        def create_repo(self, repo_id, repo_type=None, private=None, exist_ok=False, **kwargs):
            (root / repo_id).mkdir(parents=True, exist_ok=True)
            return SimpleNamespace(repo_id=repo_id)

        def create_branch(self, *args, **kwargs):
            pass

        def preupload_lfs_files(self, repo_id, additions, **kwargs):
            for op in additions:  # datasets deletes the temp parquet after this call: keep the bytes
                if isinstance(op.path_or_fileobj, (str, Path)):
                    op.path_or_fileobj = Path(op.path_or_fileobj).read_bytes()

        def create_commit(self, repo_id, operations, **kwargs):
            for op in operations:
                target = root / repo_id / op.path_in_repo
                if isinstance(op, CommitOperationAdd):
                    data = op.path_or_fileobj
                    data = Path(data).read_bytes() if isinstance(data, (str, Path)) else data if isinstance(data, bytes) else data.read()
                    target.parent.mkdir(parents=True, exist_ok=True)
                    target.write_bytes(data)
                elif isinstance(op, CommitOperationDelete):
                    target.unlink()
            state["commits"] += 1
            return SimpleNamespace(oid=f"{state['commits']:040x}", commit_url="local", pr_url=None)

        def hf_hub_download(self, repo_id, filename, repo_type=None, revision=None, **kwargs):
            path = root / repo_id / filename
            if not path.is_file():
                raise EntryNotFoundError(filename)
            return str(path)

    class FakeHfFileSystem(LocalFileSystem):
        cachable = False

        def __init__(self, *args, endpoint=None, token=None, **kwargs):
            super().__init__()

        @classmethod
        def _strip_protocol(cls, path):
            path = str(path)
            if path.startswith("datasets/"):
                owner, name_rev, *rest = path[len("datasets/"):].split("/")
                return str(root / owner / name_rev.split("@")[0] / "/".join(rest)).rstrip("/")
            return super()._strip_protocol(path)

    monkeypatch.setattr(datasets.arrow_dataset, "HfApi", FakeApi)
    monkeypatch.setattr(datasets.dataset_dict, "HfApi", FakeApi)
    monkeypatch.setattr(datasets.arrow_dataset, "HfFileSystem", FakeHfFileSystem)
    return FakeApi(), state


def test_push_to_fake_hub_and_load_back(built, tmp_path, monkeypatch):
    from datasets import get_dataset_config_names, load_dataset
    from huggingface_hub import DatasetCard

    _, builder, ds = built
    hub_root = tmp_path / "hub"
    api, state = install_fake_hub(monkeypatch, hub_root)
    pushed = ["clean", "image-gaussian_noise-5", "text-ocr-7"]
    assert push_benchmark(builder.output_dir, "me/coco-c", configs=pushed, api=api, show_progress=False) == pushed
    repo = hub_root / "me" / "coco-c"
    assert (repo / "image-gaussian_noise-5" / "test-00000-of-00001.parquet").is_file()

    card = DatasetCard.load(repo / "README.md")
    assert [c["config_name"] for c in card.data.configs] == pushed
    assert card.data.license == "cc-by-4.0" and "test-time-adaptation" in card.data.tags
    assert "dataset_info" in card.data.to_dict() and "Image corruption constants" in card.text

    # resumable: configs already on the Hub are skipped; a new one is added and the card keeps all configs
    commits = state["commits"]
    assert push_benchmark(builder.output_dir, "me/coco-c", configs=pushed + ["text-diverse"], api=api, show_progress=False) == ["text-diverse"]
    assert state["commits"] == commits + 2  # one config + the card
    assert sorted(get_dataset_config_names(str(repo))) == sorted(pushed + ["text-diverse"])

    # load back from the published layout: images are embedded bytes (the build folder is not needed)
    back = load_dataset(str(repo), "image-gaussian_noise-5", split="test")
    assert back["image_id"] == ds["image-gaussian_noise-5"]["image_id"]
    assert np.array_equal(np.asarray(back[0]["image"]), np.asarray(ds["image-gaussian_noise-5"][0]["image"]))
    t2i = load_retrieval_split(str(repo), "text-ocr-7")
    assert t2i.queries == [c for caps in ds["text-ocr-7"]["captions"] for c in caps] and len(t2i.gallery) == 4


def test_recipe_cli(tmp_path, capsys):
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "recipes" / "build_benchmarks.py"
    spec = importlib.util.spec_from_file_location("build_benchmarks", path)
    recipe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(recipe)
    json_path = write_karpathy(tmp_path, n=3)
    common = ["--benchmark", "coco-c", "--karpathy-json", str(json_path), "--images-root", str(tmp_path), "--output-dir", str(tmp_path / "out"), "-q"]
    assert recipe.main(common + ["--list-configs"]) == 0
    listed = capsys.readouterr().out.split()
    assert len(listed) == 1 + 80 + 15 + 2 and listed[0] == "clean"
    assert recipe.main(common + ["--list-configs", "--no-text", "--image-severities", "5"]) == 0
    assert capsys.readouterr().out.split() == ["clean"] + [f"image-{n}-5" for n in IMAGE_NAMES] + ["image-diverse"]
    assert recipe.main(common + ["--configs", "clean", "image-contrast-5", "text-char_delete-3", "--limit", "2", "--seed", "4"]) == 0
    out = tmp_path / "out"
    assert sorted(p.name for p in out.iterdir() if not p.name.startswith(".") and p.is_dir()) == ["clean", "image-contrast-5", "text-char_delete-3"]
    assert json.loads((out / "build_info.json").read_text())["params"]["seed"] == 4
    with pytest.raises(SystemExit):
        recipe.main(common + ["--style-model", "bogus"])


def test_data_side_layout_imports_one_way_without_private_names():
    """hf_tta.data: no import cycle between its modules (lazy imports included), no private name imported from
    another module, and the public names of the package roots still import."""
    import ast

    import hf_tta.data as data_pkg

    root = Path(data_pkg.__file__).parent
    graph, private = {}, []
    for path in sorted(root.rglob("*.py")):
        module = ".".join(("hf_tta.data",) + path.relative_to(root).with_suffix("").parts).removesuffix(".__init__")
        package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
        deps = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.level:
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                target = f"{base}.{node.module}" if node.module else base
                if target.startswith("hf_tta.data"):
                    deps.add(target)
                    private += [f"{module}: {a.name} from {target}" for a in node.names if a.name.startswith("_") and a.name != "__version__"]
        graph[module] = deps
    assert not private

    def reach(start, seen):
        for d in graph.get(start, ()):
            if d not in seen:
                seen.add(d)
                reach(d, seen)
        return seen

    packages = {m for m in graph if (root / Path(*m.split(".")[2:]) / "__init__.py").is_file() or m == "hf_tta.data"}
    cycles = [m for m in graph if m not in packages and m in reach(m, set())]
    assert not cycles, cycles

    import hf_tta.data.builders as builders
    import hf_tta.data.corruptions as corruptions

    for pkg in (data_pkg, builders, corruptions):
        assert all(hasattr(pkg, name) for name in pkg.__all__)
