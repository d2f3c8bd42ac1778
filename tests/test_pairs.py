"""Any image-text set a user has (issue 28, item 3): pairs from JSONL, CSV or a folder with sidecar captions, built
into the COCO-C layout by ``hf-tta build --pairs``, run end to end by ``hf-tta run --dataset`` with a tiny CLIP saved
with its processor, group relevance, bad input, and ``push_to_hub`` against the fake Hub."""

from __future__ import annotations

import json
import string
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from fake_hub import fake_hub  # noqa: F401  (fixture)
from hf_tta import cli
from hf_tta.data.builders import load_retrieval_split, push_benchmark
from hf_tta.data.builders.pairs import pairs_builder, read_pairs

CAPS = ["a red dress with long sleeves", "a blue shirt on a hanger", "white sneakers on the floor",
        "a black leather jacket", "green trousers folded", "a yellow summer hat"]
CONFIGS = "clean,image-gaussian_noise-5,text-ocr-7"


def write_images(root: Path, n: int = 6) -> list[str]:
    rng = np.random.default_rng(0)
    (root / "imgs").mkdir(parents=True, exist_ok=True)
    names = []
    for i in range(n):
        name = f"imgs/{i:03d}.png"
        Image.fromarray(rng.integers(0, 256, (40, 40, 3), dtype=np.uint8)).save(root / name)
        names.append(name)
    return names


def write_jsonl(root: Path, groups: bool = True) -> Path:
    names = write_images(root)
    rows = []
    for i, name in enumerate(names):  # image 0 has two captions; images 2k, 2k+1 share a group
        rows.append({"image": name, "caption": CAPS[i], **({"group": f"p{i // 2}"} if groups else {})})
    rows.append({"image": names[0], "caption": "a red dress, front view", **({"group": "p0"} if groups else {})})
    path = root / "pairs.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def test_read_pairs_jsonl_csv_and_folder_agree(tmp_path):
    items = read_pairs(write_jsonl(tmp_path / "j"))
    assert [it.image_id for it in items] == list(range(6))
    assert items[0].captions == [CAPS[0], "a red dress, front view"] and items[0].caption_ids == [0, 6]
    assert [it.group for it in items] == ["p0", "p0", "p1", "p1", "p2", "p2"]

    names = write_images(tmp_path / "c")
    (tmp_path / "c" / "pairs.csv").write_text("image_path,text\n" + "".join(f"{n},\"{c}\"\n" for n, c in zip(names, CAPS)))
    csv_items = read_pairs(tmp_path / "c" / "pairs.csv")
    assert [it.captions for it in csv_items] == [[c] for c in CAPS] and all(it.group is None for it in csv_items)

    folder = tmp_path / "f"
    for name, cap in zip(write_images(folder), CAPS):
        (folder / name).with_suffix(".txt").write_text(f"{cap}\n\n{cap.upper()}\n")
    folder_items = read_pairs(folder)
    assert [it.captions for it in folder_items] == [[c, c.upper()] for c in CAPS]


@pytest.mark.parametrize(
    "content, message",
    [
        ('{"image": "imgs/000.png"}\n', "pairs.jsonl:1: no caption"),
        ('{"image": "imgs/000.png", "caption": "x", "group": "a"}\n{"image": "imgs/001.png", "caption": "y"}\n', "pairs.jsonl:2: some rows have a 'group'"),
        ('{"image": "imgs/000.png", "caption": "x", "group": "a"}\n{"image": "imgs/000.png", "caption": "y", "group": "b"}\n', "one image has one group"),
        ("not json\n", "pairs.jsonl:1: not a JSON object"),
    ],
)
def test_bad_rows_are_one_line_errors_naming_file_and_line(tmp_path, content, message):
    (tmp_path / "pairs.jsonl").write_text(content)
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace("'", ".")):
        read_pairs(tmp_path / "pairs.jsonl")


def test_folder_without_sidecar_names_the_image(tmp_path):
    write_images(tmp_path, 2)
    (tmp_path / "imgs" / "000.txt").write_text("a caption\n")
    with pytest.raises(ValueError, match=r"001\.png: no caption file 001\.txt"):
        read_pairs(tmp_path / "imgs")


def test_missing_image_builds_nothing_and_skip_counts_it(tmp_path):
    path = write_jsonl(tmp_path)
    (tmp_path / "imgs" / "003.png").unlink()
    builder = pairs_builder(path, tmp_path / "out", show_progress=False)
    with pytest.raises(FileNotFoundError, match=r"1 of 6 source images are unusable .*imgs/003\.png.*--on-missing skip"):
        builder.build(["clean"])
    assert builder.built_configs() == []
    skipping = pairs_builder(path, tmp_path / "out2", on_missing="skip", show_progress=False)
    ds = skipping.build(["clean"])["clean"]
    assert len(ds) == 5 and skipping.report.missing == ["imgs/003.png"]
    info = json.loads((tmp_path / "out2" / "build_info.json").read_text())
    assert info["source_report"]["missing"] == ["imgs/003.png"]


def test_a_pairs_build_resumes_and_adds_configs_with_the_same_settings_only(tmp_path):
    path, out = write_jsonl(tmp_path), tmp_path / "out"
    pairs_builder(path, out, show_progress=False).build(["clean"])
    again = pairs_builder(path, out, show_progress=False)  # before: refused, its spec's tuples against the record's lists
    again.build(["clean", "image-fog-5"])
    assert again.built_configs() == ["clean", "image-fog-5"]
    with pytest.raises(ValueError, match=r"other settings \{'seed': \(0, 1\)\}"):
        pairs_builder(path, out, seed=1, show_progress=False).build(["image-snow-2"])
    assert pairs_builder(path, out).built_configs() == ["clean", "image-fog-5"]


def test_groups_make_items_relevant_to_each_others_captions(tmp_path):
    builder = pairs_builder(write_jsonl(tmp_path), tmp_path / "out", show_progress=False, text_pool=(("ocr", 7),))
    builder.build(["clean", "text-ocr-7"])
    i2t = load_retrieval_split(builder.output_dir, "clean", task="i2t")
    # gallery: image 0's two captions (positions 0, 1), then one each; images 0 and 1 are group p0
    assert i2t.relevant[0] == [0, 1, 2] and i2t.relevant[1] == [0, 1, 2] and i2t.relevant[2] == [3, 4]
    t2i = load_retrieval_split(builder.output_dir, "text-ocr-7")
    assert len(t2i.queries) == 7 and t2i.relevant[0] == [0, 1] and t2i.relevant[-1] == [4, 5]
    assert t2i.queries[0] != CAPS[0]  # corrupted


def clip_folder(root: Path, texts: tuple[str, ...] = ()) -> Path:
    """A tiny CLIP saved with a word-level tokenizer that knows the words of CAPS and of ``texts`` (the benchmark's)."""
    from transformers import CLIPImageProcessor, CLIPProcessor

    from support import word_level_clip_tokenizer
    from tiny_models import make_model

    tok = word_level_clip_tokenizer([*CAPS, *texts])
    proc = CLIPProcessor(image_processor=CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}), tokenizer=tok)
    make_model("clip").save_pretrained(root)
    proc.save_pretrained(root)
    return root


def blip_folder(root: Path) -> Path:
    """A tiny BlipForImageTextRetrieval saved with its processor (loaded back as that class, not BlipModel)."""
    from transformers import BertTokenizer, BlipImageProcessor, BlipProcessor

    from tiny_models import make_model

    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *string.ascii_lowercase, *[f"##{c}" for c in string.ascii_lowercase]]
    root.mkdir(parents=True, exist_ok=True)
    (root / "vocab.txt").write_text("\n".join(vocab))
    proc = BlipProcessor(image_processor=BlipImageProcessor(size={"height": 32, "width": 32}),
                         tokenizer=BertTokenizer(str(root / "vocab.txt"), model_max_length=24))
    make_model("blip").save_pretrained(root)
    proc.save_pretrained(root)
    return root


@pytest.mark.parametrize("kind", ["clip", "blip"])
def test_hf_tta_build_pairs_then_run_dataset_end_to_end(tmp_path, capsys, kind):
    pairs = write_jsonl(tmp_path / "src")
    out = tmp_path / "built"
    configs = CONFIGS + ",image-snow-2"  # one stream of the default grid (at its own severity) and one off it
    assert cli.main(["build", "--pairs", str(pairs), "--output-dir", str(out), "--configs", configs, "--name", "shop", "--quiet"]) == 0
    printed = capsys.readouterr().out
    assert "built 4 configs of shop" in printed and f"--dataset {out}" in printed
    assert ("the default grid of `hf-tta run` also needs image-shot_noise-5, image-motion_blur-4, image-contrast-1: "
            "add them to --configs") in printed  # what to add to compare with the default grid
    assert sorted(p.name for p in out.iterdir() if p.is_dir() and not p.name.startswith(".")) == [
        "clean", "image-gaussian_noise-5", "image-snow-2", "text-ocr-7"]
    info = json.loads((out / "build_info.json").read_text())
    assert info["params"]["spec"]["name"] == "shop" and info["params"]["spec"]["baseline_tau"] == 0.01

    model = clip_folder(tmp_path / "clip") if kind == "clip" else blip_folder(tmp_path / "blip")
    res = tmp_path / "res"
    suggested = printed.split("run it with `hf-tta ")[1].split("`")[0].replace("<model>", str(model)).split()
    code = cli.main([*suggested, "--objectives", "tent", "--steps", "1", "--batch-size", "4", "--quiet", "--threads", "1",
                     "--no-plots", "--output-dir", str(res)])
    assert code == 0, capsys.readouterr().err
    rows = json.loads((res / "results.json").read_text())["rows"]
    assert not [r for r in rows if "error" in r]
    # the suggested command runs every stream that was built (not the emoji grid's streams it lacks)
    assert {(r["direction"], r["shift"], r["severity"]) for r in rows} == {
        ("i2t", "clean", None), ("i2t", "gaussian_noise", 5), ("i2t", "snow", 2), ("t2i", "clean", None), ("t2i", "ocr", 7)}
    by = {(r["direction"], r["shift"], r["objective"]): r for r in rows}
    assert by[("i2t", "gaussian_noise", "tent")]["num_queries"] == 6 and by[("i2t", "gaussian_noise", "tent")]["gallery_size"] == 7
    assert by[("t2i", "ocr", "tent")]["num_queries"] == 7 and by[("t2i", "ocr", "tent")]["gallery_size"] == 6


def test_pairs_build_by_default_what_the_default_grid_runs():
    from hf_tta.benchmarks.grid import DEFAULT_IMAGE_CONDITIONS
    from hf_tta.cli.build import default_image_text_configs

    configs, _ = default_image_text_configs()
    assert {f"image-{c}-{s}" for c, s in DEFAULT_IMAGE_CONDITIONS} <= set(configs)  # not severity 5 only
    assert len(configs) == len(set(configs)) and "image-motion_blur-4" in configs and "image-gaussian_noise-5" in configs


def test_build_cli_mistakes_are_one_line(tmp_path, capsys):
    assert cli.main(["build", "--output-dir", str(tmp_path / "o")]) == 2
    assert "name one source" in capsys.readouterr().err
    assert cli.main(["build", "--pairs", str(tmp_path / "nope.jsonl"), "--output-dir", str(tmp_path / "o")]) == 2
    assert "no such file or folder" in capsys.readouterr().err


def test_push_pairs_build_to_fake_hub_with_its_card(tmp_path, fake_hub):  # noqa: F811
    from datasets import load_dataset
    from huggingface_hub import DatasetCard

    builder = pairs_builder(write_jsonl(tmp_path), tmp_path / "out", show_progress=False)
    builder.build(["clean", "image-contrast-5"])
    assert push_benchmark(builder.output_dir, "me/shop-c", api=fake_hub.api(), show_progress=False) == ["clean", "image-contrast-5"]
    repo = fake_hub.repo_dir("me/shop-c")
    card = DatasetCard.load(repo / "README.md")
    assert "pairs" in card.text and "position in the pairs file" in card.text and "tau = 0.01" in card.text
    back = load_dataset(str(repo), "clean", split="test")
    assert back["group"] == ["p0", "p0", "p1", "p1", "p2", "p2"]
    assert card.data.to_dict()["hf_tta"] == {"benchmark": "pairs", "baseline_tau": 0.01, "directions": ["i2t", "t2i"]}
