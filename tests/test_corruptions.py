"""Corruption library: ImageNet-C constants, every image corruption x severity, the 15 text corruptions (the
sentence-level ones with a tiny seq2seq model built from a config), the similarity filter and the diverse mode."""

import numpy as np
import pytest
from PIL import Image

from hf_tta.data.corruptions import (
    ALL_IMAGE_CORRUPTION_CATEGORIES,
    ALL_IMAGE_CORRUPTIONS,
    CHAR_CORRUPTIONS,
    DEFAULT_IMAGE_POOL,
    IMAGE_CORRUPTION_CATEGORIES,
    IMAGE_CORRUPTION_CONSTANTS,
    IMAGE_CORRUPTIONS,
    IMAGE_SEVERITIES,
    MAX_TEXT_SEVERITY,
    REDRAWN_TEXT_CORRUPTIONS,
    SENTENCE_CORRUPTIONS,
    TEST_IMAGE_CORRUPTIONS,
    TEXT_CORRUPTIONS,
    VALIDATION_IMAGE_CORRUPTIONS,
    WORD_CORRUPTIONS,
    MissingResourceError,
    corrupt_image,
    corrupt_image_diverse,
    corrupt_images,
    corrupt_images_diverse,
    corrupt_text,
    corrupt_text_diverse,
    corrupt_texts,
    derive_seed,
    diverse_plan,
    draw_corruption,
    make_pool,
)
from hf_tta.data.corruptions import seq2seq as text_mod
from hf_tta.data.corruptions import wordnet as wordnet_mod

CAPTION = "A train traveling down tracks next to a brick building."
H, W = 40, 56  # small and not square


@pytest.fixture(scope="module")
def image():
    rng = np.random.default_rng(0)
    # smooth gradient + noise: every corruption (blur, jpeg, pixelate...) visibly changes it
    yy, xx = np.mgrid[0:H, 0:W]
    base = np.stack([xx * 4, yy * 5, (xx + yy) * 2], axis=-1).astype(np.float64)
    arr = np.clip(base + rng.normal(0, 20, base.shape), 0, 255).astype(np.uint8)
    return Image.fromarray(arr, "RGB")


# ------------------------------------------------------------------------------------------------ image
def test_image_corruption_list_is_the_benchmark_one():
    assert IMAGE_CORRUPTIONS == (
        "gaussian_noise", "shot_noise", "impulse_noise", "speckle_noise", "defocus_blur", "glass_blur", "motion_blur",
        "zoom_blur", "snow", "frost", "fog", "brightness", "contrast", "elastic_transform", "pixelate", "jpeg_compression",
    )
    assert IMAGE_SEVERITIES == (1, 2, 3, 4, 5)


def test_every_image_corruption_every_severity_changes_image_keeps_size_mode_and_is_deterministic(image):
    src = np.asarray(image)
    for name in IMAGE_CORRUPTIONS:
        for sev in IMAGE_SEVERITIES:
            out = corrupt_image(image, name, sev, seed=3)
            assert isinstance(out, Image.Image)
            assert out.size == image.size and out.mode == "RGB", (name, sev)
            arr = np.asarray(out)
            assert not np.array_equal(arr, src), f"{name}@{sev} left the image unchanged"
            again = np.asarray(corrupt_image(image, name, sev, seed=3))
            assert np.array_equal(arr, again), f"{name}@{sev} is not deterministic for a fixed seed"


@pytest.mark.parametrize("shape", [(33, 97), (97, 33), (64, 48)])
def test_image_corruptions_work_on_any_size_and_on_arrays(shape):
    arr = np.random.default_rng(1).integers(0, 256, (*shape, 3), dtype=np.uint8)
    for name in ("glass_blur", "fog", "frost", "snow", "zoom_blur", "pixelate", "motion_blur", "elastic_transform"):
        out = corrupt_image(arr, name, 5, seed=0)
        assert isinstance(out, np.ndarray) and out.shape == arr.shape and out.dtype == np.uint8, name


def test_grayscale_and_tiny_images_keep_mode_and_size():
    gray = Image.fromarray(np.random.default_rng(2).integers(0, 256, (40, 56), dtype=np.uint8), "L")
    out = corrupt_image(gray, "gaussian_noise", 2, seed=0)
    assert out.mode == "L" and out.size == gray.size
    tiny = Image.new("RGB", (3, 3), (100, 50, 20))
    assert corrupt_image(tiny, "pixelate", 5, seed=0).size == (3, 3)  # the package made a 0-pixel image here


def test_seed_controls_the_draw_and_the_global_rng_is_restored(image):
    a = np.asarray(corrupt_image(image, "gaussian_noise", 3, seed=1))
    b = np.asarray(corrupt_image(image, "gaussian_noise", 3, seed=2))
    assert not np.array_equal(a, b)
    np.random.seed(123)
    expected = np.random.rand()
    np.random.seed(123)
    corrupt_image(image, "shot_noise", 3, seed=9)
    assert np.random.rand() == expected


def test_batch_image_api_uses_per_item_seeds(image):
    outs = corrupt_images([image, image], "speckle_noise", 4, seed=5)
    assert np.array_equal(np.asarray(outs[1]), np.asarray(corrupt_image(image, "speckle_noise", 4, seed=derive_seed(5, 1))))
    assert not np.array_equal(np.asarray(outs[0]), np.asarray(outs[1]))


def test_imagenet_c_severity5_constants():
    """Digest 000_TCR §4.1: gaussian σ=0.38, shot c=3, impulse 0.27, speckle 0.6, contrast 0.05, brightness +0.5,
    pixelate 0.25 (re-computed here from the formulas with the same seed)."""
    rng = np.random.default_rng(7)
    arr = rng.integers(40, 216, (48, 64, 3), dtype=np.uint8)
    x = arr / 255.0
    seed = 11

    def noise(draw):
        np.random.seed(seed)
        return draw()

    expected = {
        "gaussian_noise": np.clip(x + noise(lambda: np.random.normal(size=x.shape, scale=0.38)), 0, 1) * 255,
        "shot_noise": np.clip(noise(lambda: np.random.poisson(x * 3)) / 3.0, 0, 1) * 255,
        "speckle_noise": np.clip(x + x * noise(lambda: np.random.normal(size=x.shape, scale=0.6)), 0, 1) * 255,
        "contrast": np.clip((x - x.mean(axis=(0, 1), keepdims=True)) * 0.05 + x.mean(axis=(0, 1), keepdims=True), 0, 1) * 255,
    }
    for name, exp in expected.items():
        assert np.array_equal(corrupt_image(arr, name, 5, seed=seed), np.uint8(exp)), name

    gray = np.full((40, 40, 3), 51, dtype=np.uint8)  # V = 0.2 -> 0.7
    assert abs(int(corrupt_image(gray, "brightness", 5, seed=0)[0, 0, 0]) - int(0.7 * 255)) <= 1

    mid = np.full((64, 64, 3), 128, dtype=np.uint8)
    changed = (corrupt_image(mid, "impulse_noise", 5, seed=0) != 128).mean()
    assert abs(changed - 0.27) < 0.02

    pil = Image.fromarray(arr)
    exp = pil.resize((16, 12), Image.BOX).resize((64, 48), Image.NEAREST)
    assert np.array_equal(np.asarray(corrupt_image(pil, "pixelate", 5, seed=0)), np.asarray(exp))


def test_imagenet_c_validation_and_test_corruptions_partition_the_library():
    """Hendrycks & Dietterich (2019) hold out speckle noise, Gaussian blur, spatter and saturate for choosing
    hyper-parameters; the other 15 are the test corruptions (protocol v3's report split)."""
    assert VALIDATION_IMAGE_CORRUPTIONS == ("speckle_noise", "gaussian_blur", "spatter", "saturate")
    assert len(TEST_IMAGE_CORRUPTIONS) == 15 and not set(TEST_IMAGE_CORRUPTIONS) & set(VALIDATION_IMAGE_CORRUPTIONS)
    assert set(ALL_IMAGE_CORRUPTIONS) == set(TEST_IMAGE_CORRUPTIONS) | set(VALIDATION_IMAGE_CORRUPTIONS)
    for name in ALL_IMAGE_CORRUPTIONS:  # every corruption has its family and its 5 severities' constants
        assert ALL_IMAGE_CORRUPTION_CATEGORIES[name] in ("noise", "blur", "weather", "digital")
        assert len(IMAGE_CORRUPTION_CONSTANTS[name]["values"]) == 5
    assert list(IMAGE_CORRUPTION_CATEGORIES) == list(IMAGE_CORRUPTIONS)  # COCO-C's 16 (REST Table A.1)


@pytest.mark.parametrize("name", ["gaussian_blur", "spatter", "saturate"])
def test_validation_corruptions_every_severity_change_image_keep_size_and_are_deterministic(image, name):
    src = np.asarray(image)
    for sev in IMAGE_SEVERITIES:
        out = corrupt_image(image, name, sev, seed=3)
        assert out.size == image.size and out.mode == "RGB"
        assert np.array_equal(np.asarray(out), np.asarray(corrupt_image(image, name, sev, seed=3)))
        assert not np.array_equal(np.asarray(out), src), (name, sev)


def test_validation_corruption_constants_recomputed_from_the_formulas():
    """ImageNet-C's Gaussian blur (σ = 1, 2, 3, 4, 6 pixels) and saturate (HSV saturation s·c0 + c1), recomputed
    with scikit-image from the recorded constants; spatter's water splashes only add (pale turquoise) light."""
    import skimage

    rng = np.random.default_rng(7)
    arr = rng.integers(40, 216, (48, 64, 3), dtype=np.uint8)
    x = arr / 255.0
    for sev, sigma in enumerate(IMAGE_CORRUPTION_CONSTANTS["gaussian_blur"]["values"], start=1):
        exp = np.clip(skimage.filters.gaussian(x, sigma=sigma, channel_axis=-1), 0, 1) * 255
        assert np.array_equal(corrupt_image(arr, "gaussian_blur", sev, seed=0), np.uint8(exp)), sev
    for sev, (c0, c1) in enumerate(IMAGE_CORRUPTION_CONSTANTS["saturate"]["values"], start=1):
        hsv = skimage.color.rgb2hsv(x)
        hsv[:, :, 1] = np.clip(hsv[:, :, 1] * c0 + c1, 0, 1)
        exp = np.clip(skimage.color.hsv2rgb(hsv), 0, 1) * 255
        assert np.array_equal(corrupt_image(arr, "saturate", sev, seed=0), np.uint8(exp)), sev
    dark = np.full((48, 64, 3), 30, dtype=np.uint8)
    for sev in (1, 2, 3):  # water (mud = 0): the image only brightens where a splash lands
        out = corrupt_image(dark, "spatter", sev, seed=1).astype(int)
        assert (out >= 30 - 1).all() and (out > 31).any(), sev
    assert [v[5] for v in IMAGE_CORRUPTION_CONSTANTS["spatter"]["values"]] == [0, 0, 0, 1, 1]


def test_image_errors_are_clear(image):
    with pytest.raises(ValueError, match="Unknown image corruption"):
        corrupt_image(image, "blurry", 1)
    with pytest.raises(ValueError, match="Severity"):
        corrupt_image(image, "fog", 6)
    with pytest.raises(TypeError, match="uint8"):
        corrupt_image(np.zeros((40, 40, 3), dtype=np.float32), "fog", 1)


# ------------------------------------------------------------------------------------------------ text
@pytest.fixture(scope="module")
def tiny_seq2seq(tmp_path_factory):
    """A tiny T5 built from a config with a word-level tokenizer built offline, saved as a checkpoint folder."""
    import torch
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers
    from tokenizers.processors import TemplateProcessing
    from transformers import PreTrainedTokenizerFast, T5Config, T5ForConditionalGeneration

    words = "a train traveling down tracks next to brick building . transfer casual formal active passive the of".split()
    vocab = {"<pad>": 0, "</s>": 1, "<unk>": 2}
    for w in words:
        vocab.setdefault(w, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.post_processor = TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", unk_token="<unk>")
    torch.manual_seed(0)
    cfg = T5Config(
        vocab_size=len(vocab), d_model=16, d_ff=32, num_layers=1, num_decoder_layers=1, num_heads=2, d_kv=8,
        pad_token_id=0, eos_token_id=1, decoder_start_token_id=0,
    )
    path = tmp_path_factory.mktemp("tiny_t5")
    T5ForConditionalGeneration(cfg).save_pretrained(path)
    fast.save_pretrained(path)
    yield str(path)
    text_mod.clear_text_model_cache()


def _text_kwargs(name, tiny):
    if name == "back_translation":
        return {"models": {name: (tiny, tiny)}, "generate_kwargs": {"min_new_tokens": 3, "max_new_tokens": 8, "suppress_tokens": [0, 2]}}
    if name in SENTENCE_CORRUPTIONS:
        return {"models": {name: tiny}, "generate_kwargs": {"min_new_tokens": 3, "max_new_tokens": 8, "suppress_tokens": [0, 2]}}
    return {}


def test_text_corruption_list():
    assert len(TEXT_CORRUPTIONS) == 15 and len(set(TEXT_CORRUPTIONS)) == 15
    assert TEXT_CORRUPTIONS == CHAR_CORRUPTIONS + WORD_CORRUPTIONS + SENTENCE_CORRUPTIONS
    assert {MAX_TEXT_SEVERITY[n] for n in CHAR_CORRUPTIONS + WORD_CORRUPTIONS} == {7}
    assert {MAX_TEXT_SEVERITY[n] for n in SENTENCE_CORRUPTIONS} == {1}


@pytest.mark.parametrize("name", [n for n in TEXT_CORRUPTIONS if n not in ("synonym_replacement", "random_insertion")])
def test_every_text_corruption_changes_text_keeps_a_string_and_is_deterministic(name, tiny_seq2seq):
    kw = _text_kwargs(name, tiny_seq2seq)
    sev = MAX_TEXT_SEVERITY[name]
    out = corrupt_text(CAPTION, name, sev, seed=0, **kw)
    assert isinstance(out, str) and out and out != CAPTION, (name, out)
    assert corrupt_text(CAPTION, name, sev, seed=0, **kw) == out


@pytest.mark.parametrize("name", ["synonym_replacement", "random_insertion"])
def test_wordnet_synonym_corruptions(name):
    """Needs WordNet: `apt-get install wordnet-base` (CI) or nltk's wordnet data. Fails (not skips) without it."""
    out = corrupt_text(CAPTION, name, 7, seed=0)
    assert isinstance(out, str) and out != CAPTION
    assert corrupt_text(CAPTION, name, 7, seed=0) == out
    if name == "random_insertion":
        assert len(out.split()) > len(CAPTION.split())


def test_the_first_wordnet_draw_of_a_process_equals_the_later_ones():
    """Importing nltk advances Python's global RNG: WordNet must load before the seeded block, or the first call of a
    process (a fresh builder worker) draws differently from the next one with the same seed."""
    import subprocess
    import sys

    code = (
        "from hf_tta.data.corruptions import corrupt_text\n"
        "t = 'a red train travelling down the tracks next to a brick building.'\n"
        "print(corrupt_text(t, 'synonym_replacement', 7, seed=3) == corrupt_text(t, 'synonym_replacement', 7, seed=3))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip().splitlines()[-1] == "True", out.stderr[-500:]


def test_seeded_restores_the_accelerator_rng_too(monkeypatch):
    """``torch.manual_seed`` inside ``seeded(torch_too=True)`` also re-seeds every CUDA device; the block must hand the
    user's CUDA RNG stream back where it was. Simulated: a one-GPU CUDA accelerator whose RNG state is a dict entry."""
    import torch

    from hf_tta.data.corruptions.base import seeded

    cuda_state = {0: torch.tensor([7, 7, 7], dtype=torch.uint8)}
    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda *a, **k: torch.device("cuda"))
    monkeypatch.setattr(torch.accelerator, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda device=0: cuda_state[int(device)].clone())
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda state, device=0: cuda_state.__setitem__(int(device), state))

    def manual_seed_all(seed):
        cuda_state[0] = torch.tensor([seed % 256] * 3, dtype=torch.uint8)

    monkeypatch.setattr(torch.cuda, "manual_seed_all", manual_seed_all)
    cpu_before = torch.get_rng_state()
    with seeded(5, torch_too=True):
        assert cuda_state[0].tolist() == [5, 5, 5]  # the block itself is seeded
        torch.rand(3)
    assert cuda_state[0].tolist() == [7, 7, 7]
    assert torch.equal(torch.get_rng_state(), cpu_before)


def test_missing_wordnet_names_what_to_install(monkeypatch, tmp_path):
    import nltk.data

    monkeypatch.setattr(wordnet_mod, "_WORDNET", None)
    monkeypatch.setattr(wordnet_mod, "WORDNET_SYSTEM_DIRS", (str(tmp_path / "nowhere"),))
    monkeypatch.delenv("HF_TTA_WORDNET", raising=False)
    monkeypatch.setattr(nltk.data, "path", [str(tmp_path / "no_nltk_data")])
    monkeypatch.setattr(nltk.data, "find", lambda *a, **k: (_ for _ in ()).throw(LookupError("no")))
    with pytest.raises(MissingResourceError, match="apt-get install wordnet-base"):
        corrupt_text(CAPTION, "synonym_replacement", 7, seed=0)
    with pytest.raises(MissingResourceError, match="not a WordNet dict folder"):
        corrupt_text(CAPTION, "synonym_replacement", 7, seed=0, wordnet=str(tmp_path))
    # the word-level corruptions without synonyms do not need WordNet
    assert corrupt_text(CAPTION, "random_swap", 7, seed=0) != CAPTION


def test_missing_seq2seq_model_says_what_is_missing(monkeypatch):
    monkeypatch.setattr(text_mod, "_TEXT_MODELS", {})
    with pytest.raises(MissingResourceError, match=r"formal.*models=\{'formal': path\}") as err:
        corrupt_text(CAPTION, "formal", 1, seed=0, models={"formal": "/nonexistent/styleformer"})
    assert "prithivida/informal_to_formal_styletransfer" in str(err.value)
    with pytest.raises(MissingResourceError, match="back_translation"):
        corrupt_text(CAPTION, "back_translation", 1, models={"back_translation": ("/nonexistent/en-de", "/nonexistent/de-en")})


def test_default_seq2seq_checkpoints_are_never_downloaded_implicitly(monkeypatch):
    """Offline by default: the benchmark's default checkpoints load only from the local cache; a checkpoint the user
    names (models=...) loads as from_pretrained does."""
    calls = []

    def record(spec, device=None, purpose="", local_files_only=False):
        calls.append((str(spec), local_files_only))
        raise MissingResourceError(f"{purpose}: not here")

    monkeypatch.setattr(text_mod, "_TEXT_MODELS", {})
    monkeypatch.setattr(text_mod, "_LOADED", {})
    monkeypatch.setattr(text_mod.Seq2SeqGenerator, "from_pretrained", staticmethod(record))
    with pytest.raises(MissingResourceError, match="loads only from your Hugging Face cache"):
        corrupt_text(CAPTION, "formal", 1, seed=0)
    with pytest.raises(MissingResourceError):
        corrupt_text(CAPTION, "formal", 1, seed=0, models={"formal": "me/my-styleformer"})
    assert calls == [("prithivida/informal_to_formal_styletransfer", True), ("me/my-styleformer", False)]


def test_registered_model_and_batched_sentence_corruption(tiny_seq2seq):
    text_mod.register_text_model("casual", tiny_seq2seq)
    try:
        outs = corrupt_texts([CAPTION, "a brick building"], "casual", 1, seed=1, generate_kwargs={"min_new_tokens": 2, "max_new_tokens": 6, "suppress_tokens": [0, 2]})
        assert len(outs) == 2 and all(isinstance(o, str) and o for o in outs)
        assert outs == corrupt_texts([CAPTION, "a brick building"], "casual", 1, seed=1, generate_kwargs={"min_new_tokens": 2, "max_new_tokens": 6, "suppress_tokens": [0, 2]})
    finally:
        text_mod.register_text_model("casual", None)


def test_text_severity_and_name_checks():
    with pytest.raises(ValueError, match="Severity"):
        corrupt_text(CAPTION, "ocr", 8)
    with pytest.raises(ValueError, match="Severity"):
        corrupt_text(CAPTION, "formal", 2)
    with pytest.raises(ValueError, match="Unknown text corruption"):
        corrupt_text(CAPTION, "typo", 1)


def test_severity_scales_the_char_rate():
    long = " ".join(["building"] * 40)
    changed = [sum(a != b for a, b in zip(long.split(), corrupt_text(long, "char_replace", s, seed=0).split())) for s in (1, 7)]
    assert changed[0] == 2 and changed[1] == 10  # int(0.05*s*40) words, capped by nlpaug's aug_word_max=10


def test_optional_similarity_filter_redraws_until_similar_enough():
    calls = []

    def score(a, b):
        return 1.0 - abs(len(a) - len(b)) / max(len(a), 1)

    def similarity(a, b):
        calls.append(b)
        return score(a, b)

    # impossible threshold: max_tries draws, the most similar kept
    out = corrupt_text(CAPTION, "random_deletion", 7, seed=0, similarity_fn=similarity, min_similarity=2.0, max_tries=6)
    assert len(calls) == 6 and out == max(calls, key=lambda c: score(CAPTION, c))
    calls.clear()
    # reachable threshold: stops at the first draw that passes
    first = corrupt_text(CAPTION, "random_deletion", 7, seed=0)
    assert corrupt_text(CAPTION, "random_deletion", 7, seed=0, similarity_fn=similarity, min_similarity=0.0) == first
    assert len(calls) == 1
    calls.clear()
    # character-level corruptions are not re-drawn (TCR's benchmark filters the word-level and style ones only)
    ocr = corrupt_text(CAPTION, "ocr", 7, seed=0, similarity_fn=similarity, min_similarity=2.0, max_tries=6)
    assert ocr == corrupt_text(CAPTION, "ocr", 7, seed=0) and calls == []
    assert "back_translation" not in REDRAWN_TEXT_CORRUPTIONS and "formal" in REDRAWN_TEXT_CORRUPTIONS
    assert set(WORD_CORRUPTIONS) <= REDRAWN_TEXT_CORRUPTIONS and not set(CHAR_CORRUPTIONS) & REDRAWN_TEXT_CORRUPTIONS


# ------------------------------------------------------------------------------------------------ diverse
def test_diverse_mode_draws_per_query_deterministically(image):
    plan = diverse_plan(200, seed=0, pool=DEFAULT_IMAGE_POOL)
    assert len({n for n, _ in plan}) >= 14  # each query draws its own corruption
    assert plan == diverse_plan(200, seed=0, pool=DEFAULT_IMAGE_POOL)
    assert plan != diverse_plan(200, seed=1, pool=DEFAULT_IMAGE_POOL)
    assert all(draw_corruption(DEFAULT_IMAGE_POOL, 0, i) == plan[i] for i in (0, 57, 199))

    # a query's result depends on (seed, index) only, not on the batch it is in
    batch, draws = corrupt_images_diverse([image] * 4, seed=3, start_index=10)
    for k in range(4):
        single, name, sev = corrupt_image_diverse(image, 10 + k, 3)
        assert (name, sev) == draws[k]
        assert np.array_equal(np.asarray(single), np.asarray(batch[k]))

    text, name, sev = corrupt_text_diverse(CAPTION, 5, 0, pool=make_pool("text", names=["ocr", "char_swap", "random_swap"]))
    assert isinstance(text, str) and text != CAPTION and sev == 7


def test_make_pool():
    assert make_pool("image", names=["fog"], severities="all") == tuple(("fog", s) for s in range(1, 6))
    assert make_pool("text", names=["ocr", "formal"], severities={"ocr": [6, 7], "formal": [1]}) == (
        ("ocr", 6), ("ocr", 7), ("formal", 1))
    assert len(make_pool("text")) == 15
    with pytest.raises(ValueError, match="no severity"):
        make_pool("text", names=["formal"], severities=[7])
    with pytest.raises(ValueError, match="Unknown image corruptions"):
        make_pool("image", names=["ocr"])
