"""A tokenizer under which distinct captions collide is refused (hf_tta.models.text_processor), by the function, by
benchmark loading (HubTask) and by ``hf-tta run`` on a checkpoint folder saved without its tokenizer files."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from hf_tta.models.text_processor import SAMPLE_TEXTS, check_text_processor, check_tokenizer
from tiny_models import make_model

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def folder_without_tokenizer(tmp_path_factory):
    """A CLIP checkpoint saved with its image processor only, as a user who forgot the tokenizer would."""
    from transformers import CLIPImageProcessor

    folder = tmp_path_factory.mktemp("clip_no_tokenizer")
    make_model("clip").save_pretrained(folder)
    CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def word_tokenizer():
    """A real BertTokenizer over a small word vocabulary (no download)."""
    from transformers import BertTokenizer

    words = sorted({w for t in SAMPLE_TEXTS for w in t.split()} | {"cat", "sat"})
    tokens = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *words]
    return BertTokenizer(vocab={t: i for i, t in enumerate(tokens)})


def test_the_folders_tokenizer_collides_and_is_refused(folder_without_tokenizer):
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(folder_without_tokenizer)
    ids = processor.tokenizer(list(SAMPLE_TEXTS[:2]))["input_ids"]
    assert set(ids[0]) | set(ids[1]) <= set(processor.tokenizer.all_special_ids)  # the silent garbage: no content
    with pytest.raises(ValueError, match=r"maps distinct captions .* same ids.*processor.save_pretrained"):
        check_tokenizer(processor.tokenizer)
    with pytest.raises(ValueError, match="clip_no_tokenizer"):
        check_text_processor(processor, source=str(folder_without_tokenizer))


def test_a_working_tokenizer_passes_and_unknown_words_collide(word_tokenizer):
    check_tokenizer(word_tokenizer)
    check_tokenizer(word_tokenizer, ["a cat sat", "a dog sat"])
    assert check_text_processor({"text": word_tokenizer, "audio": object()}) is True
    with pytest.raises(ValueError, match="'zebra quokka' and 'walrus okapi'"):  # all [UNK]: same content ids
        check_tokenizer(word_tokenizer, ["zebra quokka", "walrus okapi"])


def test_no_tokenizer_to_check(word_tokenizer):
    assert check_text_processor(lambda **kw: kw) is False  # a stand-in callable: nothing to check
    with pytest.raises(TypeError, match="Hugging Face tokenizer"):
        check_tokenizer(object())
    with pytest.raises(ValueError, match="two distinct"):
        check_tokenizer(word_tokenizer, ["same", "same"])


def test_benchmark_loading_refuses_it(folder_without_tokenizer, tmp_path):
    from cli_folders import save_benchmark
    from hf_tta.benchmarks.hub_task import HubTask

    with pytest.raises(ValueError, match="same ids"):
        HubTask(str(folder_without_tokenizer), save_benchmark(tmp_path / "data"))


def test_cli_run_exits_non_zero_with_one_line(folder_without_tokenizer, tmp_path):
    from cli_folders import save_benchmark

    dataset = save_benchmark(tmp_path / "data")  # the check probes the benchmark's own captions
    env = dict(os.environ, PYTHONPATH=str(REPO), HF_HUB_OFFLINE="1")
    out = subprocess.run(
        [sys.executable, "-m", "hf_tta.cli", "run", "--model", str(folder_without_tokenizer), "--dataset", str(dataset),
         "--objectives", "tent", "--output-dir", str(tmp_path / "out"), "--quiet"],
        capture_output=True, text=True, env=env, cwd=REPO, timeout=600,
    )
    assert out.returncode != 0
    lines = [ln for ln in out.stderr.splitlines() if ln.startswith("hf-tta:")]
    assert len(lines) == 1 and "same ids" in lines[0] and "processor.save_pretrained" in lines[0]
    assert not (tmp_path / "out" / "rows.jsonl").exists()


# ------------------------------------------------------------------------------------- the gallery's own captions (issue 36, item 10)
SYLLABLES = ["ka", "lo", "mi", "ru", "sen", "tor", "vex", "zil", "pra", "quo", "dro", "fen", "gul", "hy", "jas"]
DOMAIN_WORDS = [a + b for a in SYLLABLES for b in SYLLABLES if a != b][:195]  # a domain's vocabulary, no English


def _domain_captions(n: int = 12) -> list[list[str]]:
    """``n`` images with 2 distinct captions of 3-4 domain words each."""
    w = DOMAIN_WORDS
    return [[f"{w[3 * i]} {w[3 * i + 1]} {w[3 * i + 2]}", f"{w[3 * i + 2]} {w[90 + i]} {w[3 * i]} {w[120 + i]}"] for i in range(n)]


@pytest.fixture(scope="module")
def domain_tokenizer():
    """A 200-token WordPiece tokenizer (``tokenizers``) over the domain's words only: every English word is [UNK]."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors
    from transformers import BertTokenizerFast

    vocab = {t: i for i, t in enumerate(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *DOMAIN_WORDS])}
    tok = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.post_processor = processors.TemplateProcessing(single="[CLS] $A [SEP]", special_tokens=[("[CLS]", 2), ("[SEP]", 3)])
    return BertTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]", cls_token="[CLS]",
                             sep_token="[SEP]", mask_token="[MASK]")


def _blip_processor(tokenizer):
    from transformers import BlipImageProcessor, BlipProcessor

    return BlipProcessor(image_processor=BlipImageProcessor(size={"height": 32, "width": 32}), tokenizer=tokenizer)


def test_a_domain_tokenizer_covering_the_gallerys_captions_is_accepted(domain_tokenizer, tmp_path):
    """Before: the check probed fixed English captions, which this tokenizer maps to [UNK]s, and refused it."""
    from cli_folders import save_benchmark
    from hf_tta.benchmarks.hub_task import HubTask

    assert len(domain_tokenizer) == 200
    with pytest.raises(ValueError, match="same ids"):  # the fixed English probe collides: what the old check saw
        check_tokenizer(domain_tokenizer)
    captions = _domain_captions()
    check_tokenizer(domain_tokenizer, [c for caps in captions for c in caps])
    dataset = save_benchmark(tmp_path / "domain", captions=captions)
    task = HubTask(make_model("blip"), dataset, processor=_blip_processor(domain_tokenizer))
    assert task.caption_probe() == [c for caps in captions for c in caps]


def test_distinct_captions_of_this_gallery_colliding_are_refused_in_one_line(domain_tokenizer, tmp_path):
    from cli_folders import save_benchmark
    from hf_tta.benchmarks.hub_task import HubTask

    captions = _domain_captions()
    captions[5][1] = "a histology slide"  # English: three [UNK]s ...
    captions[9][0] = "the tumour margin"  # ... as here
    dataset = save_benchmark(tmp_path / "mixed", captions=captions)
    with pytest.raises(ValueError, match="'a histology slide' and 'the tumour margin' to the same ids") as err:
        HubTask(make_model("blip"), dataset, processor=_blip_processor(domain_tokenizer))
    assert "\n" not in str(err.value) and "BlipForImageTextRetrieval" in str(err.value)


def test_captions_differing_only_in_case_or_spacing_are_not_distinct(word_tokenizer):
    """An uncased tokenizer folds them: not a collision (before: 'A dog sat' and 'a dog sat' were refused)."""
    check_tokenizer(word_tokenizer, ["A dog sat", "a  dog sat", "a cat sat"])
