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
    from hf_tta.benchmarks.tasks import HubTask

    with pytest.raises(ValueError, match="same ids"):
        HubTask(str(folder_without_tokenizer), tmp_path)


def test_cli_run_exits_non_zero_with_one_line(folder_without_tokenizer, tmp_path):
    dataset = tmp_path / "data"
    dataset.mkdir()
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
