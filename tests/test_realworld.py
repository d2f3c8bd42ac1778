"""The real-world query-gallery shift sets (issue 28, item 2) from fixtures written in their raw formats: Nocaps
(``nocaps_val_4500_captions.json``), Fashion-Gen (the HDF5 file, via h5py) and Fashion-Gen-D, CUHK-PEDES (IRRA's
``reid_raw.json``) and ICFG-PEDES (``ICFG-PEDES.json``); baseline temperatures, group relevance, bad raw input,
the dataset card on the fake Hub, ``hf-tta run --dataset`` with a tiny CLIP, and the IRRA recipe."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from fake_hub import fake_hub  # noqa: F401  (fixture)
from hf_tta import cli
from hf_tta.data.builders import load_retrieval_split, push_benchmark
from hf_tta.data.builders.loading import built_spec
from hf_tta.data.builders.realworld import (
    interleave_domains,
    read_fashion_gen,
    read_nocaps,
    read_pedes,
    realworld_builder,
)
from test_pairs import clip_folder

h5py = pytest.importorskip("h5py")
RNG = np.random.default_rng(0)


def _image(path: Path, size=(24, 40)):
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(RNG.integers(0, 256, (*size, 3), dtype=np.uint8)).save(path)


def write_nocaps(root: Path) -> Path:
    domains = ["in-domain", "near-domain", "out-domain", "out-domain", "near-domain", "out-domain"]
    images, anns = [], []
    for i, d in enumerate(domains):
        fn = f"{i:016x}.jpg"
        _image(root / "val" / fn)
        images.append({"id": i, "file_name": fn, "open_images_id": f"{i:016x}", "height": 24, "width": 40, "domain": d,
                       "coco_url": f"https://example/{fn}"})
        anns += [{"image_id": i, "id": 10 * i + k, "caption": f"photo {i} caption {k}"} for k in range(3)]
    path = root / "nocaps_val_4500_captions.json"
    path.write_text(json.dumps({"licenses": [], "info": {}, "images": images, "annotations": anns}))
    return path


def write_fashion_gen(path: Path, fields=("input_image", "input_description", "input_productID", "input_category")) -> Path:
    pids = [7, 7, 7, 9, 11, 11, 12]
    cats = ["SHIRTS", "SHIRTS", "SHIRTS", "SKIRTS", "TOPS", "TOPS", "SKIRTS"]
    with h5py.File(path, "w") as f:
        data = {
            "input_image": RNG.integers(0, 256, (7, 32, 32, 3), dtype=np.uint8),
            "input_description": np.array([[f"description of product {p} \xe9".encode("latin-1")] for p in pids], dtype="S64"),
            "input_productID": np.array([[p] for p in pids], dtype=np.int64),
            "input_category": np.array([[c.encode()] for c in cats], dtype="S16"),
            "input_name": np.array([[b"name"]] * 7, dtype="S16"),
        }
        for k, v in data.items():
            if k in fields or k == "input_name":
                f.create_dataset(k, data=v)
    return path


# every word of the captions written below, for the tokenizer of clip_folder (the tokenizer check probes them)
CAPTION_WORDS = (" ".join(map(str, range(16))) + " a person in red coat walking description of product photo caption \xe9",)


def write_pedes(root: Path, name: str = "reid_raw.json", splits=("train", "test", "test", "test", "val", "test")) -> Path:
    entries = []
    for i, split in enumerate(splits):
        fp = f"CUHK01/{i:07d}.png"
        _image(root / "imgs" / fp, size=(48, 16))
        entries.append({"split": split, "captions": [f"a person {i} in a red coat", f"person {i} walking"], "file_path": fp,
                        "processed_tokens": [["a"], ["b"]], "id": 100 + i // 2})
    path = root / name
    path.write_text(json.dumps(entries))
    return path


def test_nocaps_domains_and_bad_files(tmp_path):
    path = write_nocaps(tmp_path)
    out = read_nocaps(path, "out")
    assert [it.image_id for it in out] == [2, 3, 5] and out[0].captions == [f"photo 2 caption {k}" for k in range(3)]
    assert out[0].caption_ids == [20, 21, 22] and {it.domain for it in out} == {"out-domain"}
    with pytest.raises(ValueError, match="Unknown nocaps domain 'far'"):
        read_nocaps(path, "far")
    test_info = tmp_path / "nocaps_test_image_info.json"  # the test split: images only, no public captions
    test_info.write_text(json.dumps({"images": [{"id": 0, "file_name": "a.jpg", "domain": "in-domain"}]}))
    with pytest.raises(ValueError, match="nocaps_test_image_info.json has no 'annotations'.*pass nocaps_val_4500_captions.json"):
        read_nocaps(test_info, "in")


def test_nocaps_build_card_and_tau(tmp_path, fake_hub):  # noqa: F811
    from huggingface_hub import DatasetCard

    builder = realworld_builder("nocaps-near", write_nocaps(tmp_path), tmp_path / "out", images_root=tmp_path / "val", show_progress=False)
    ds = builder.build(["clean"])["clean"]
    assert ds["image_id"] == [1, 4] and ds["domain"] == ["near-domain"] * 2 and len(ds[0]["captions"]) == 3
    assert built_spec(tmp_path / "out").baseline_tau == 0.01
    push_benchmark(builder.output_dir, "me/nocaps-near", api=fake_hub.api(), show_progress=False)
    card = DatasetCard.load(fake_hub.repo_dir("me/nocaps-near") / "README.md")
    assert card.data.license == "cc-by-2.0" and "Open Images" in card.text and "`domain` is `near-domain`" in card.text
    assert "agrawal2019nocaps" in card.text


def test_published_fashion_gen_keeps_its_tau_for_hf_tta_run(tmp_path, fake_hub):  # noqa: F811
    builder = realworld_builder("fashion-gen", write_fashion_gen(tmp_path / "fg.h5"), tmp_path / "out", show_progress=False)
    builder.build(["clean"])
    push_benchmark(builder.output_dir, "me/fashion-gen", api=fake_hub.api(), show_progress=False)
    spec = built_spec(fake_hub.repo_dir("me/fashion-gen"))  # the Hub layout: read from the card's hf_tta block
    assert spec.name == "fashion-gen" and spec.baseline_tau == 0.001 and spec.pretty_name.startswith("Fashion-Gen")
    assert built_spec(tmp_path / "nothing-here") is None


def test_nocaps_missing_image_names_the_file(tmp_path):
    path = write_nocaps(tmp_path)
    (tmp_path / "val" / f"{4:016x}.jpg").unlink()
    builder = realworld_builder("nocaps-near", path, tmp_path / "out", images_root=tmp_path / "val", show_progress=False)
    with pytest.raises(FileNotFoundError, match=f"{4:016x}.jpg.*on_missing='skip'"):
        builder.build(["clean"])
    assert builder.built_configs() == []


def test_fashion_gen_groups_products_and_shares_captions(tmp_path):
    h5 = write_fashion_gen(tmp_path / "fashiongen_256_256_validation.h5")
    items = read_fashion_gen(h5, tmp_path / "imgs")
    assert [it.group for it in items] == ["7", "7", "7", "9", "11", "11", "12"]
    assert [len(it.captions) for it in items] == [1, 0, 0, 1, 1, 0, 1]  # one description per product
    assert items[0].captions == ["description of product 7 \xe9"] and items[0].domain == "SHIRTS"
    assert np.array_equal(np.asarray(Image.open(tmp_path / "imgs" / "000002.png")), h5py.File(h5)["input_image"][2])

    builder = realworld_builder("fashion-gen", h5, tmp_path / "out", show_progress=False)
    builder.build(["clean"])
    assert built_spec(tmp_path / "out").baseline_tau == 0.001
    i2t = load_retrieval_split(builder.output_dir, "clean", task="i2t")
    assert len(i2t.gallery) == 4 and i2t.relevant[:3] == [[0], [0], [0]] and i2t.relevant[5] == [2]
    t2i = load_retrieval_split(builder.output_dir, "clean", task="t2i")
    assert t2i.queries[0] == "description of product 7 \xe9" and t2i.relevant == [[0, 1, 2], [3], [4, 5], [6]]


def test_fashion_gen_d_interleaves_categories(tmp_path):
    h5 = write_fashion_gen(tmp_path / "fg.h5")
    ds = realworld_builder("fashion-gen-d", h5, tmp_path / "out", show_progress=False).build(["clean"])["clean"]
    assert ds["domain"] == ["SHIRTS", "SKIRTS", "TOPS", "SHIRTS", "SKIRTS", "TOPS", "SHIRTS"]
    assert ds["image_id"] == [0, 3, 4, 1, 6, 5, 2]  # each category keeps its own order
    assert [it.image_id for it in interleave_domains(read_fashion_gen(h5, tmp_path / "i"))] == ds["image_id"]


def test_fashion_gen_without_its_fields_is_one_line(tmp_path):
    h5 = write_fashion_gen(tmp_path / "other.h5", fields=("input_image", "input_description"))
    with pytest.raises(ValueError, match=r"other.h5 lacks the fields \['input_productID', 'input_category'\]"):
        read_fashion_gen(h5, tmp_path / "imgs")


@pytest.mark.parametrize("benchmark, name", [("cuhk-pedes", "reid_raw.json"), ("icfg-pedes", "ICFG-PEDES.json")])
def test_pedes_test_split_groups_by_person(tmp_path, benchmark, name):
    path = write_pedes(tmp_path, name)
    items = read_pedes(path)
    assert [it.source_id for it in items] == [f"CUHK01/{i:07d}.png" for i in (1, 2, 3, 5)]
    assert [it.group for it in items] == ["100", "101", "101", "102"]
    builder = realworld_builder(benchmark, path, tmp_path / "out", show_progress=False)  # images under ./imgs
    builder.build(["clean"])
    spec = built_spec(tmp_path / "out")
    assert spec.baseline_tau == 1e-4 and spec.directions == ("t2i",)
    t2i = load_retrieval_split(builder.output_dir, "clean", task="t2i")
    assert len(t2i.queries) == 8 and t2i.relevant[2] == [1, 2] and t2i.relevant[0] == [0]


def test_pedes_file_of_another_split_is_one_line(tmp_path, capsys):
    path = write_pedes(tmp_path, splits=("train", "train"))
    with pytest.raises(ValueError, match=r"reid_raw.json has no 'test' entry \(its splits: \['train'\]\)"):
        read_pedes(path)
    assert cli.main(["build", "--cuhk-pedes", str(path), "--output-dir", str(tmp_path / "o")]) == 2
    assert "has no 'test' entry" in capsys.readouterr().err and not (tmp_path / "o" / "clean").exists()


def test_hf_tta_build_and_run_a_reid_set_with_its_tau(tmp_path, capsys):
    path = write_pedes(tmp_path / "raw")
    out = tmp_path / "cuhk"
    assert cli.main(["build", "--cuhk-pedes", str(path), "--output-dir", str(out), "--quiet"]) == 0
    assert "--direction t2i --clean" in capsys.readouterr().out
    model = clip_folder(tmp_path / "clip", CAPTION_WORDS)
    res = tmp_path / "res"
    code = cli.main(["run", "--model", str(model), "--dataset", str(out), "--direction", "t2i", "--clean", "--objectives", "tent",
                     "--steps", "1", "--batch-size", "4", "--quiet", "--threads", "1", "--no-plots", "--output-dir", str(res)])
    printed = capsys.readouterr().out
    assert code == 0
    assert "cuhk-pedes: baselines tent" in printed and "tau = 0.0001" in printed and "streams left out" in printed
    results = json.loads((res / "results.json").read_text())
    assert results["meta"]["notes"]["baseline_tau"]["tau"] == 1e-4
    rows = [r for r in results["rows"] if r["objective"] == "tent"]
    assert len(rows) == 1 and rows[0]["shift"] == "clean" and rows[0]["num_queries"] == 8 and rows[0]["gallery_size"] == 4


def test_reid_irra_recipe_runs_clip_through_the_dual_encoder_adapter(tmp_path, capsys):
    path = write_pedes(tmp_path / "raw", "ICFG-PEDES.json")
    realworld_builder("icfg-pedes", path, tmp_path / "icfg", show_progress=False).build(["clean"])
    spec = importlib.util.spec_from_file_location("reid_irra", Path(__file__).resolve().parents[1] / "recipes" / "reid_irra.py")
    recipe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(recipe)
    model = clip_folder(tmp_path / "clip", CAPTION_WORDS)
    code = recipe.main(["--model", str(model), "--dataset", str(tmp_path / "icfg"), "--name", "CUHK2ICFG", "--objectives", "tent",
                        "--steps", "1", "--batch-size", "4", "--output-dir", str(tmp_path / "res")])
    assert code == 0
    rows = json.loads((tmp_path / "res" / "results.json").read_text())["rows"]
    assert {r["objective"] for r in rows} == {"source", "tent"} and all(r["direction"] == "t2i" for r in rows)
    assert recipe.main(["--model", str(model), "--dataset", str(tmp_path / "raw")]) == 2


def test_fashion_gen_d_runs_rest_with_gradient_decoupling_and_key_rows_by_category(tmp_path, capsys):
    out = tmp_path / "fgd"
    assert cli.main(["build", "--fashion-gen", str(write_fashion_gen(tmp_path / "fg.h5")), "--diverse-stream", "--output-dir", str(out), "--quiet"]) == 0
    model = clip_folder(tmp_path / "clip", CAPTION_WORDS)
    res = tmp_path / "res"
    code = cli.main(["run", "--model", str(model), "--dataset", str(out), "--direction", "i2t", "--clean", "--objectives", "rest,tent+key",
                     "--steps", "1", "--batch-size", "4", "--quiet", "--threads", "1", "--no-plots", "--output-dir", str(res)])
    printed = capsys.readouterr()
    assert code == 0, printed.err
    assert "fashion-gen-d: rest runs with gradient decoupling" in printed.out and "tau = 0.001" in printed.out
    rows = {r["objective"]: r for r in json.loads((res / "results.json").read_text())["rows"]}
    assert rows["rest"]["gradient_decoupling"] is True and "error" not in rows["tent+key"]
    assert rows["tent+key"]["domains"] == 3  # one adapter per category: SHIRTS, SKIRTS, TOPS
