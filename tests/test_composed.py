"""Composed image retrieval (issue 28, item 1): the composed-query BLIP-2 adapter (every objective, dense and top-k
galleries, the adapted LayerNorms), REST's CIR metrics on hand-derived cases, FIQ-O/-D and CIRR-O/-D builders from
fixtures in the raw FashionIQ and CIRR formats, bad raw input, the fake Hub, and ``hf-tta build`` + ``hf-tta run
--dataset`` end to end with a tiny BLIP-2 (Q-Former text input) saved with its processor."""

from __future__ import annotations

import json
import string
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from fake_hub import fake_hub  # noqa: F401  (fixture)
from hf_tta import TTAConfig, TTAWrapper, available_objectives, cli
from hf_tta.data.builders.composed import O_CONFIGS, ComposedBuilder
from hf_tta.data.builders.composed_hub import load_composed_split, push_composed
from hf_tta.data.builders.composed_sources import fiq_text, read_cirr, read_fashioniq
from hf_tta.metrics.composed import cirr_metrics, composed_recall, fiq_metrics, recall_subset, target_ranks
from hf_tta.models import Blip2ComposedAdapter, get_adapter
from tiny_models import blip2_model as blip2
from tiny_models import image_batch, make_model, text_batch

pytest.importorskip("imagecorruptions", reason="the image corruptions need the `data` extra")
RNG = np.random.default_rng(0)
# offline text corruptions stand in for the representatives that need WordNet / seq2seq checkpoints here
TEXT_REPS = {"word": "random_swap", "sent": "insert_punctuation"}
TEXT_POOL = (("ocr", 7), ("char_swap", 7), ("random_swap", 7))


def composed_batch(n: int, seed: int = 0) -> dict[str, torch.Tensor]:
    return {**image_batch(n, seed), **text_batch(n, seed)}


# ------------------------------------------------------------------------------------------------ adapter
def test_composed_adapter_is_picked_and_embeds_fused_queries_against_multi_vector_targets():
    model = blip2()
    adapter = get_adapter(model, ("composed", "image"))
    assert isinstance(adapter, Blip2ComposedAdapter) and type(get_adapter(model)).__name__ == "Blip2Adapter"
    q = adapter.embed("composed", composed_batch(3))
    g = adapter.embed("image", image_batch(5, seed=1))
    assert q.shape == (3, 16) and g.shape == (5, 4, 16)
    assert torch.allclose(adapter.score(q, g), torch.einsum("bd,nqd->bnq", q, g).amax(-1))
    other_text = adapter.embed("composed", {**image_batch(3), **text_batch(3, seed=5)})
    other_image = adapter.embed("composed", {**image_batch(3, seed=7), **text_batch(3)})
    assert not torch.allclose(q, other_text) and not torch.allclose(q, other_image)  # both parts fuse
    with pytest.raises(ValueError, match="composed inputs need 'input_ids'"):
        adapter.embed("composed", image_batch(2))


def test_composed_default_parameters_are_the_layernorms_on_the_query_path_and_each_one_runs():
    adapter = get_adapter(blip2(), ("composed", "image"))
    norms = adapter.norm_layer_names("composed")
    assert any(n.startswith("vision_model") for n in norms) and any(n.startswith("qformer") for n in norms)
    assert "qformer.layernorm" in norms and all(isinstance(adapter.model.get_submodule(n), torch.nn.LayerNorm) for n in norms)
    assert not any("projection" in n for n in norms)
    model = adapter.model
    adapter.embed("composed", composed_batch(4)).pow(3).sum().backward()
    dead = [n for n in norms if model.get_submodule(n).weight.grad is None or not model.get_submodule(n).weight.grad.abs().sum() > 0]
    assert dead == []  # every selected LayerNorm is on the composed query's computation
    tta = TTAWrapper(blip2(), TTAConfig(objective="tent", query_modality="composed"))
    assert isinstance(tta.adapter, Blip2ComposedAdapter) and len(tta.params) == 2 * len(norms)
    assert all(any(k.startswith(n + ".") for k in tta.params) for n in norms)  # weight + bias of each, nothing else


def clip_sum_fusion():
    """The documented custom-CIR path: a CLIP4Cir-style sum fusion of CLIP's image and text features as a
    :class:`~hf_tta.DualEncoderAdapter` with a ``composed`` encoder (single-vector, so top-k galleries apply)."""
    from hf_tta import DualEncoderAdapter
    from hf_tta.models.base import pooled

    def composed(m, x):
        img = pooled(m.get_image_features(pixel_values=x["pixel_values"]))
        txt = pooled(m.get_text_features(input_ids=x["input_ids"], attention_mask=x.get("attention_mask")))
        return torch.nn.functional.normalize(img, dim=-1) + torch.nn.functional.normalize(txt, dim=-1)

    return DualEncoderAdapter(
        make_model("clip"), encoders={"composed": composed, "image": lambda m, x: pooled(m.get_image_features(pixel_values=x["pixel_values"]))},
        towers={"composed": ["vision_model", "visual_projection", "text_model", "text_projection"], "image": ["vision_model", "visual_projection"]},
        input_names={"composed": ["pixel_values", "input_ids", "attention_mask"]},
    )


@pytest.mark.parametrize("objective", [o for o in available_objectives() if o != "oracle"])
def test_composed_every_objective_adapts_dense_blip2_and_topk_custom(objective):
    from hf_tta.gallery import ChunkedGallery

    tta = TTAWrapper(blip2(), TTAConfig(objective=objective, query_modality="composed", steps=1))
    gallery = tta.encode_gallery([image_batch(12, seed=1)])
    out = tta.adapt_step(composed_batch(8), gallery)
    assert out.scores.shape == (8, 12) and torch.isfinite(out.scores).all()
    # BLIP-2's target images are multi-vector (12, Q, D): a top-k backend holds them too
    top_tta = TTAWrapper(blip2(), TTAConfig(objective=objective, query_modality="composed", steps=1))
    out_mv = top_tta.adapt_step(composed_batch(8), ChunkedGallery(gallery.embeddings, "image", k=5, chunk_size=8))
    assert out_mv.scores is None and out_mv.topk.indices.shape == (8, 5) and torch.isfinite(out_mv.topk.values).all()
    # a single-vector custom CIR model runs top-k
    custom = TTAWrapper(clip_sum_fusion(), TTAConfig(objective=objective, query_modality="composed", steps=1))
    dense = custom.encode_gallery([image_batch(12, seed=1)])
    top = ChunkedGallery(dense.embeddings, "image", k=5, chunk_size=4)
    out_k = custom.adapt_step(composed_batch(8), top)
    assert out_k.scores is None and out_k.topk.indices.shape == (8, 5) and torch.isfinite(out_k.topk.values).all()


@pytest.mark.parametrize("backend", ["chunked", "faiss_flat"])
def test_composed_tcr_on_multi_vector_topk_backends_equals_dense(backend):
    """c2i with BLIP-2: the targets' Q-Former tokens (N, Q, D) in a top-k backend give the dense run's top-k, loss and
    adapted parameters (TCR needs only each query's top-1)."""
    from hf_tta.gallery import ChunkedGallery, FaissGallery

    make = {
        "chunked": lambda e: ChunkedGallery(e, "image", k=6, chunk_size=9),
        "faiss_flat": lambda e: FaissGallery.build(e, "image", index="flat", k=6),
    }[backend]
    runs = []
    for topk in (False, True):
        tta = TTAWrapper(blip2(), TTAConfig(objective="tcr", query_modality="composed"))
        dense = tta.encode_gallery([image_batch(20, seed=1)])
        assert dense.embeddings.dim() == 3
        gallery = make(dense.embeddings) if topk else dense
        runs.append((tta, [tta.adapt_step(composed_batch(8, seed=3 + b), gallery) for b in range(2)]))
    (dense_tta, dense_outs), (tta, outs) = runs
    for a, b in zip(dense_outs, outs):
        v, i = a.scores.sort(dim=1, descending=True, stable=True)
        assert b.scores is None and torch.equal(b.topk.indices, i[:, :6])
        torch.testing.assert_close(b.topk.values, v[:, :6], rtol=0, atol=1e-6)
        assert b.loss == pytest.approx(a.loss, abs=1e-6)
    for name, p in tta.params.items():
        torch.testing.assert_close(p, dense_tta.params[name], rtol=0, atol=1e-6)


# ------------------------------------------------------------------------------------------------ metrics
def test_composed_metrics_by_hand():
    scores = torch.tensor([[0.9, 0.8, 0.1, 0.0], [0.2, 0.9, 0.9, 0.1], [0.0, 0.1, 0.2, 0.3]])
    targets = [1, 2, 0]
    assert target_ranks(scores, targets).tolist() == [1, 1, 3]  # tie at 0.9: the earlier item (1) ranks first
    assert composed_recall(scores, targets, (1, 2)) == {"R@1": 0.0, "R@2": pytest.approx(200 / 3), }
    # removing each reference: query 0's reference is item 0 -> its target ranks first
    assert target_ranks(scores, targets, exclude=[0, -1, 3]).tolist() == [0, 1, 2]
    # subsets: query 0 ranks {0, 1, 3} without its reference 0 -> target first; query 2 ranks {0, 2}: target 0 second
    sub = recall_subset(scores, targets, [[0, 1, 3], [1, 2], [3, 2, 0]], ks=(1, 2), exclude=[0, -1, 3])
    assert sub == {"Recall_subset@1": pytest.approx(100 / 3), "Recall_subset@2": 100.0}
    full = cirr_metrics(scores, targets, [0, -1, 3], [[0, 1, 3], [1, 2], [3, 2, 0]])
    assert full["R@1"] == pytest.approx(100 / 3) and full["avg"] == pytest.approx((full["R@5"] + full["Recall_subset@1"]) / 2)
    fiq = fiq_metrics({"dress": (scores, targets), "shirt": (scores[:1], [0])})
    assert fiq["dress/R@10"] == 100.0 and fiq["shirt/R@10"] == 100.0 and fiq["R@10"] == 100.0
    with pytest.raises(ValueError, match="target must be in its image set"):
        recall_subset(scores, targets, [[0], [1], [2]])


# ------------------------------------------------------------------------------------------------ raw files
def _img(path: Path):
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(RNG.integers(0, 256, (36, 30, 3), dtype=np.uint8)).save(path)


def write_fiq(root: Path, category: str = "dress", n_images: int = 6) -> Path:
    names = [f"B00{category[0].upper()}{i:05d}" for i in range(n_images)]
    for n in names:
        _img(root / "images" / f"{n}.png")
    caps = [{"candidate": names[i], "target": names[(i + 1) % n_images], "captions": [f"is darker{'.' if i % 2 else ''}", f"has more {c}"]}
            for i, c in zip(range(4), ["lace", "stripes", "buttons", "flowers"])]
    (root / "captions").mkdir(parents=True, exist_ok=True)
    (root / "image_splits").mkdir(parents=True, exist_ok=True)
    (root / "captions" / f"cap.{category}.val.json").write_text(json.dumps(caps))
    (root / "image_splits" / f"split.{category}.val.json").write_text(json.dumps(names))
    return root


def write_cirr(root: Path) -> Path:
    names = [f"dev-{i}-0-img{i % 2}" for i in range(7)]
    for n in names:
        _img(root / "dev" / f"{n}.png")
    entries = [{"pairid": 100 + i, "reference": names[i], "target_hard": names[i + 1], "target_soft": {names[i + 1]: 1.0},
                "caption": f"make it look like scene {i}", "img_set": {"id": i, "members": names[i : i + 6] if i < 2 else names[1:7]}}
               for i in range(3)]
    (root / "captions").mkdir(parents=True, exist_ok=True)
    (root / "image_splits").mkdir(parents=True, exist_ok=True)
    (root / "captions" / "cap.rc2.val.json").write_text(json.dumps(entries))
    (root / "image_splits" / "split.rc2.val.json").write_text(json.dumps({n: f"./dev/{n}.png" for n in names}))
    return root


def test_composed_readers_follow_the_raw_formats(tmp_path):
    fiq = read_fashioniq(write_fiq(tmp_path / "fiq"), "dress")
    assert len(fiq.queries) == 4 and len(fiq.gallery) == 6 and fiq.queries[0].text == "Is darker and has more lace"
    assert fiq_text(["is red.", "has long sleeves?"]) == "Is red and has long sleeves"
    cirr = read_cirr(write_cirr(tmp_path / "cirr"))
    assert [q.target for q in cirr.queries] == ["dev-1-0-img1", "dev-2-0-img0", "dev-3-0-img1"] and len(cirr.queries[0].members) == 6


@pytest.mark.parametrize("mistake, match", [
    ("category", "Unknown FashionIQ category 'skirt'; choose from dress, shirt, toptee"),
    ("test_split", r"cap.dress.val.json: no such file; .*found cap.dress.test.json"),
    ("other_split", r"target 'X1' of entry 0 is not in split.dress.val.json; the caption and split files are of different splits"),
    ("cirr_test", r"cap.rc2.val.json: entry 0 has no 'target_hard' \(test1's targets are hidden\)"),
])
def test_composed_bad_raw_input_is_one_line(tmp_path, mistake, match):
    root = write_fiq(tmp_path / "fiq")
    if mistake == "category":
        call = lambda: read_fashioniq(root, "skirt")  # noqa: E731
    elif mistake == "test_split":
        (root / "captions" / "cap.dress.val.json").rename(root / "captions" / "cap.dress.test.json")
        call = lambda: read_fashioniq(root, "dress")  # noqa: E731
    elif mistake == "other_split":
        (root / "captions" / "cap.dress.val.json").write_text(json.dumps([{"candidate": "X0", "target": "X1", "captions": ["a", "b"]}]))
        call = lambda: read_fashioniq(root, "dress")  # noqa: E731
    else:
        root = write_cirr(tmp_path / "cirr")
        path = root / "captions" / "cap.rc2.val.json"
        path.write_text(json.dumps([{k: v for k, v in e.items() if k != "target_hard"} for e in json.loads(path.read_text())]))
        call = lambda: read_cirr(root)  # noqa: E731
    with pytest.raises((ValueError, FileNotFoundError), match=match):
        call()


def test_composed_missing_image_builds_nothing_and_skip_counts_it(tmp_path):
    root = write_fiq(tmp_path / "fiq")
    (root / "images" / "B00D00002.png").unlink()  # the target of query 1 and the reference of query 2
    builder = ComposedBuilder("fashioniq", root, tmp_path / "out", category="dress", show_progress=False)
    with pytest.raises(FileNotFoundError, match=r"1 images of fiq-dress are missing .*B00D00002.*--on-missing skip"):
        builder.build(["gallery", "clean"])
    assert builder.built_configs() == []
    skip = ComposedBuilder("fashioniq", root, tmp_path / "out2", category="dress", on_missing="skip", show_progress=False)
    built = skip.build(["gallery", "clean"])
    assert len(built["gallery"]) == 5 and built["clean"]["query_id"] == [0, 3] and skip.report.missing == ["B00D00002"]


def test_composed_o_and_d_configs_corrupt_image_and_text(tmp_path):
    builder = ComposedBuilder("cirr", write_cirr(tmp_path / "cirr"), tmp_path / "out", seed=3, text_representatives=TEXT_REPS,
                              text_pool=TEXT_POOL, show_progress=False)
    assert len(O_CONFIGS) == 12 and O_CONFIGS[0] == "noise_char" and O_CONFIGS[-1] == "digital_sent"
    built = builder.build(["gallery", "clean", "noise_char", "digital_word", "diverse"])
    clean, nc, dw, div = (built[c] for c in ("clean", "noise_char", "digital_word", "diverse"))
    assert nc["image_corruption"] == ["gaussian_noise"] * 3 and nc["text_corruption"] == ["ocr"] * 3 and nc["image_severity"] == [5] * 3
    assert dw["image_corruption"] == ["contrast"] * 3 and dw["text_corruption"] == ["random_swap"] * 3
    assert nc["clean_text"] == clean["text"] and nc["text"] != clean["text"]
    assert not np.array_equal(np.asarray(nc[0]["image"]), np.asarray(clean[0]["image"]))
    assert set(div["text_corruption"]) <= {n for n, _ in TEXT_POOL}
    split = load_composed_split(builder.output_dir, "noise_char")
    assert split.targets == [1, 2, 3] and split.references == [0, 1, 2] and split.members[2] == [1, 2, 3, 4, 5, 6]
    assert split.queries[0]["text"] == nc[0]["text"]
    # determinism: the same seed gives the same bytes
    again = ComposedBuilder("cirr", write_cirr(tmp_path / "cirr"), tmp_path / "out-again", seed=3, text_representatives=TEXT_REPS,
                            show_progress=False).build(["noise_char"])["noise_char"]
    assert again["text"] == nc["text"]


def test_composed_push_to_fake_hub_with_card(tmp_path, fake_hub):  # noqa: F811
    from datasets import load_dataset
    from huggingface_hub import DatasetCard

    builder = ComposedBuilder("fashioniq", write_fiq(tmp_path / "fiq"), tmp_path / "out", category="dress", show_progress=False)
    builder.build(["gallery", "clean", "noise_char"])
    assert push_composed(builder.output_dir, "me/fiq-dress", api=fake_hub.api(), show_progress=False) == ["clean", "gallery", "noise_char"]
    repo = fake_hub.repo_dir("me/fiq-dress")
    card = DatasetCard.load(repo / "README.md")
    assert "gaussian_noise" in card.text and "R@10 and R@50" in card.text and "wu2021fashion" in card.text
    assert load_dataset(str(repo), "noise_char", split="test")["target"] == builder.build(["noise_char"])["noise_char"]["target"]
    assert load_composed_split(str(repo), "noise_char").targets == load_composed_split(builder.output_dir, "noise_char").targets


# ------------------------------------------------------------------------------------------------ CLI end to end
def _blip2_folder(root: Path) -> Path:
    from transformers import BertTokenizer, Blip2Processor, BlipImageProcessor

    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *string.ascii_lowercase, *[f"##{c}" for c in string.ascii_lowercase]]
    (root / "tok").mkdir(parents=True, exist_ok=True)
    (root / "tok" / "vocab.txt").write_text("\n".join(vocab))
    tok = BertTokenizer(str(root / "tok" / "vocab.txt"), model_max_length=24)
    proc = Blip2Processor(image_processor=BlipImageProcessor(size={"height": 32, "width": 32}), tokenizer=tok)
    blip2().save_pretrained(root / "blip2")
    proc.save_pretrained(root / "blip2")
    return root / "blip2"


def test_composed_hf_tta_build_then_run_dataset_end_to_end(tmp_path, capsys):
    root = write_cirr(tmp_path / "cirr")
    out = tmp_path / "built"
    assert cli.main(["build", "--cirr", str(root), "--output-dir", str(out), "--configs", "gallery,clean,noise_char", "--quiet"]) == 0
    assert "--direction c2i --batch-size 32" in capsys.readouterr().out
    model = _blip2_folder(tmp_path)
    res = tmp_path / "res"
    code = cli.main(["run", "--model", str(model), "--dataset", str(out), "--objectives", "tent,tcr", "--steps", "1", "--clean",
                     "--batch-size", "2", "--quiet", "--threads", "1", "--no-plots", "--output-dir", str(res)])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert "**Composed→image retrieval (composed queries) under query shift, R@1 (%): 1 corruption stream;" in captured.out
    assert "| Method | Clean | Noise*+Char 5 | Avg. |" in captured.out or "| Method | Clean | Noise*+Char | Avg. |" in captured.out
    rows = json.loads((res / "results.json").read_text())["rows"]
    assert not [r for r in rows if "error" in r]
    by = {(r["shift"], r["objective"]): r for r in rows}
    assert set(by) == {(s, o) for s in ("clean", "noise_char") for o in ("source", "tent", "tcr")}  # --clean: FIQ2CIRR-style rows
    r = by[("noise_char", "tent")]
    assert r["direction"] == "c2i" and r["num_queries"] == 3 and r["gallery_size"] == 7 and "Recall_subset@1" in r and "R@50" in r
    assert cli.main(["run", "--model", str(model), "--dataset", str(out), "--direction", "i2t"]) == 2
    assert "composed image retrieval build: run it with --direction c2i" in capsys.readouterr().err
    assert cli.main(["build", "--fashioniq", str(root), "--output-dir", str(tmp_path / "f")]) == 2
    assert "--fashioniq needs --category" in capsys.readouterr().err
    # the sentence representative (back-translation) needs seq2seq checkpoints: one line naming the fix, nothing built
    code = cli.main(["build", "--cirr", str(root), "--output-dir", str(tmp_path / "s"), "--configs", "gallery,noise_sent", "--quiet",
                     "--text-model", "back_translation=/nonexistent/en-de,/nonexistent/de-en"])
    err = capsys.readouterr().err
    assert code == 2 and "back_translation" in err and "--configs" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "s" / "gallery").exists()
