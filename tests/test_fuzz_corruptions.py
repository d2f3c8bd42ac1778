"""Property-based tests (hypothesis) of the corruption functions on inputs a user may pass: images of 1x1 to 512x512
pixels in the modes L / RGB / RGBA / P / I;16 as NumPy arrays and PIL images, every image corruption x severity and
out-of-range severities; empty, whitespace-only, emoji, non-Latin and 10,000-word captions; zero-length, silent,
mono and stereo waveforms; videos of 0..3 frames.

Every example must return the documented type and shape, or raise a clear ``ValueError`` / ``TypeError``; the same
seed must give the same output; and no example may run longer than a hard time limit (``SIGALRM``), besides
hypothesis' own per-example deadline.

The examples are derandomised (the same ones every run, so CI is reproducible); set ``HF_TTA_FUZZ_RANDOM=1`` to
explore new ones.
"""

from __future__ import annotations

import contextlib
import os
import signal
from datetime import timedelta

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from PIL import Image

from hf_tta.data.corruptions import (
    CHAR_CORRUPTIONS,
    IMAGE_CORRUPTIONS,
    IMAGE_SEVERITIES,
    TEXT_SEVERITIES,
    WORD_CORRUPTIONS,
    MissingResourceError,
    corrupt_image,
    corrupt_text,
    corrupt_texts,
    load_wordnet,
)
from hf_tta.data.corruptions.audio import (
    AUDIO_CORRUPTIONS,
    AUDIO_SEVERITY_SNR_DB,
    NoiseBank,
    corrupt_audio,
    signal_power,
)
from hf_tta.data.corruptions.video import VIDEO_CORRUPTIONS, corrupt_video
from test_corruptions import tiny_seq2seq  # noqa: F401  (module-scoped fixture: a tiny T5 checkpoint)

pytest.importorskip("imagecorruptions", reason="the image corruptions need the `data` extra")

RANDOM = os.environ.get("HF_TTA_FUZZ_RANDOM") == "1"


@pytest.fixture(scope="module", autouse=True)
def compiled():
    """Glass blur is compiled by numba on its first call (seconds): do it before the timed examples."""
    corrupt_image(np.zeros((2, 2, 3), np.uint8), "glass_blur", 1, seed=0)


def fuzz(max_examples: int, deadline_s: float):
    """Hypothesis settings of one test: bounded, reproducible, nothing written to a database."""
    return settings(
        max_examples=max_examples,
        deadline=timedelta(seconds=deadline_s),
        derandomize=not RANDOM,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
        print_blob=True,
    )


@contextlib.contextmanager
def time_limit(seconds: float):
    """Fail the example with ``TimeoutError`` when its body runs longer than ``seconds`` (wall clock)."""

    def expired(signum, frame):
        raise TimeoutError(f"the example ran longer than {seconds} s")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


# ================================================================================================== images
MODES = ("L", "RGB", "RGBA", "P", "I;16")


def make_image(mode: str, h: int, w: int, as_numpy: bool, content_seed: int):
    """A ``h x w`` image of ``mode`` with random pixels, as a PIL image or as the array ``np.asarray`` gives."""
    rng = np.random.default_rng(content_seed)
    if mode == "I;16":
        arr = rng.integers(0, 65536, size=(h, w), dtype=np.uint16)
        return arr if as_numpy else Image.fromarray(arr)  # mode "I;16"
    rgb = Image.fromarray(rng.integers(0, 256, size=(h, w, 3), dtype=np.uint8), "RGB")
    img = rgb.convert(mode)
    return np.asarray(img).copy() if as_numpy else img


def expected_image_outcome(image) -> str | tuple:
    """What :func:`corrupt_image` documents for this input: an error class name, or the output's (type, shape/mode)."""
    if isinstance(image, np.ndarray):
        if image.dtype != np.uint8:
            return "TypeError"  # "A NumPy image must be uint8"
        if image.ndim == 2 or (image.ndim == 3 and image.shape[2] == 3):
            return ("ndarray", image.shape)
        return "ValueError"  # RGBA arrays: "must be HxWx3 (or HxW)"
    return ("PIL", image.size, "L" if image.mode == "L" else "RGB")


def check_image_call(image, name: str, severity: int, seed: int, limit_s: float) -> None:
    expected = expected_image_outcome(image)
    with time_limit(limit_s):
        if isinstance(expected, str):
            with pytest.raises(TypeError if expected == "TypeError" else ValueError, match="NumPy image must"):
                corrupt_image(image, name, severity, seed=seed)
            return
        out = corrupt_image(image, name, severity, seed=seed)
        again = corrupt_image(image, name, severity, seed=seed)
    if expected[0] == "ndarray":
        assert isinstance(out, np.ndarray) and out.dtype == np.uint8 and out.shape == expected[1]
        np.testing.assert_array_equal(out, again)
    else:
        assert isinstance(out, Image.Image) and out.size == expected[1] and out.mode == expected[2]
        assert out.tobytes() == again.tobytes()


@fuzz(max_examples=160, deadline_s=5)
@given(
    mode=st.sampled_from(MODES),
    h=st.integers(1, 40),
    w=st.integers(1, 40),
    as_numpy=st.booleans(),
    name=st.sampled_from(IMAGE_CORRUPTIONS),
    severity=st.sampled_from(IMAGE_SEVERITIES),
    seed=st.integers(0, 2**32 - 1),
    content_seed=st.integers(0, 2**16),
)
def test_corrupt_image_small_images_any_mode(mode, h, w, as_numpy, name, severity, seed, content_seed):
    check_image_call(make_image(mode, h, w, as_numpy, content_seed), name, severity, seed, limit_s=20)


@pytest.mark.parametrize("name", IMAGE_CORRUPTIONS)
def test_every_corruption_and_severity_on_a_1x1_and_a_thin_image(name):
    for severity in IMAGE_SEVERITIES:
        for h, w in ((1, 1), (1, 9), (9, 1)):
            check_image_call(make_image("RGB", h, w, True, 0), name, severity, seed=severity, limit_s=20)


@fuzz(max_examples=4, deadline_s=30)
@given(
    side=st.integers(256, 512),
    other=st.integers(1, 512),
    tall=st.booleans(),
    as_numpy=st.booleans(),
    name=st.sampled_from(IMAGE_CORRUPTIONS),
    severity=st.sampled_from(IMAGE_SEVERITIES),
)
@example(side=512, other=512, tall=True, as_numpy=False, name="zoom_blur", severity=5)  # the slowest, at full size
def test_corrupt_image_large_images(side, other, tall, as_numpy, name, severity):
    h, w = (side, other) if tall else (other, side)
    image = make_image("RGB", h, w, as_numpy, 1)
    with time_limit(60):
        out = corrupt_image(image, name, severity, seed=0)
    if as_numpy:
        assert out.shape == (h, w, 3) and out.dtype == np.uint8
    else:
        assert out.size == (w, h) and out.mode == "RGB"


BAD_SEVERITIES = st.one_of(
    st.integers().filter(lambda s: s not in IMAGE_SEVERITIES),
    st.floats(allow_nan=True),
    st.booleans(),
    st.text(max_size=3),
    st.none(),
)


@fuzz(max_examples=40, deadline_s=2)
@given(name=st.sampled_from(IMAGE_CORRUPTIONS), severity=BAD_SEVERITIES, as_numpy=st.booleans())
def test_out_of_range_image_severities_are_refused(name, severity, as_numpy):
    with time_limit(5), pytest.raises(ValueError, match=r"Severity of .* must be one of \[1, 2, 3, 4, 5\]"):
        corrupt_image(make_image("RGB", 4, 5, as_numpy, 0), name, severity, seed=0)


@pytest.mark.parametrize("shape", [(0, 0), (0, 5), (5, 0)])
def test_empty_images_are_refused_clearly(shape):
    h, w = shape
    with pytest.raises(ValueError, match="image is empty"):
        corrupt_image(np.zeros((h, w, 3), np.uint8), "fog", 1, seed=0)
    with pytest.raises(ValueError, match="image is empty"):
        corrupt_image(Image.new("RGB", (w, h)), "fog", 1, seed=0)


# ================================================================================================== text
WORDLESS = st.text(alphabet=" \t\n\r\u00a0\u2003\u3000", max_size=12)
EMOJI = st.text(alphabet=st.characters(min_codepoint=0x1F300, max_codepoint=0x1FAFF), min_size=1, max_size=20)
NON_LATIN = st.text(
    alphabet=st.sampled_from(list("東京タワーの夜景犬が走るДобрыйвечерمرحبابالعالمשלוםנשמהगाड़ीΑθήνα ")), min_size=1, max_size=40
)
CAPTIONS = st.one_of(
    st.just(""),
    WORDLESS,
    EMOJI,
    NON_LATIN,
    st.lists(st.one_of(EMOJI, NON_LATIN, st.sampled_from(["a", "dog", "runs", "on", "the", "beach."])), max_size=12).map(
        " ".join
    ),
    st.text(max_size=80),
)
HAS_WORDNET = True
try:
    load_wordnet()  # loads once here, so that the first example does not pay for it
except MissingResourceError:
    HAS_WORDNET = False
CHEAP_TEXT = tuple(n for n in CHAR_CORRUPTIONS + WORD_CORRUPTIONS if HAS_WORDNET or n not in ("synonym_replacement", "random_insertion"))


@fuzz(max_examples=150, deadline_s=5)
@given(text=CAPTIONS, name=st.sampled_from(CHEAP_TEXT), severity=st.integers(1, 7), seed=st.integers(0, 2**32 - 1))
def test_corrupt_text_on_any_caption(text, name, severity, seed):
    with time_limit(20):
        out = corrupt_text(text, name, severity, seed=seed)
        again = corrupt_text(text, name, severity, seed=seed)
    assert isinstance(out, str) and out == again
    if not text.strip():
        assert out == text  # nothing to corrupt: returned unchanged


VOCAB = np.array("a dog runs on the beach next to 東京 タワー Добрый вечер 😀 🎉 naïve café , . !".split())


@fuzz(max_examples=4, deadline_s=30)
@given(name=st.sampled_from(CHEAP_TEXT), severity=st.sampled_from([1, 7]), content_seed=st.integers(0, 2**16))
def test_corrupt_text_on_10000_words(name, severity, content_seed):
    text = " ".join(np.random.default_rng(content_seed).choice(VOCAB, 10_000))
    with time_limit(60):
        out = corrupt_text(text, name, severity, seed=1)
    assert isinstance(out, str) and out.strip()
    assert abs(len(out.split()) - 10_000) <= 0.5 * 10_000  # corrupted, not truncated or blown up


@fuzz(max_examples=60, deadline_s=2)
@given(
    name=st.sampled_from(CHAR_CORRUPTIONS + WORD_CORRUPTIONS),
    severity=st.one_of(st.integers().filter(lambda s: not 1 <= s <= 7), st.floats(), st.booleans(), st.text(max_size=2)),
)
def test_out_of_range_text_severities_are_refused(name, severity):
    with time_limit(5), pytest.raises(ValueError, match="must be one of"):
        corrupt_text("a dog runs on the beach", name, severity, seed=0)


@fuzz(max_examples=15, deadline_s=10)
@given(texts=st.lists(CAPTIONS, min_size=1, max_size=3), seed=st.integers(0, 2**32 - 1))
def test_sentence_corruption_on_any_caption(tiny_seq2seq, texts, seed):  # noqa: F811
    kwargs = {"models": {"casual": tiny_seq2seq}, "generate_kwargs": {"max_new_tokens": 4}}
    with time_limit(30):
        out = corrupt_texts(texts, "casual", TEXT_SEVERITIES["casual"][0], seed=seed, **kwargs)
        again = corrupt_texts(texts, "casual", 1, seed=seed, **kwargs)
    assert out == again and len(out) == len(texts) and all(isinstance(o, str) for o in out)
    assert all(o == t for o, t in zip(out, texts) if not t.strip())


# ================================================================================================== audio
def make_waveform(layout: str, n: int, kind: str, dtype, content_seed: int) -> np.ndarray:
    shape = {"mono": (n,), "stereo": (2, n), "batch": (3, n)}[layout]
    rng = np.random.default_rng(content_seed)
    x = {"silent": np.zeros(shape), "tone": np.sin(np.arange(n) * 0.3) * np.ones(shape), "noise": rng.normal(0, 0.3, shape)}[kind]
    return x.astype(dtype)


@pytest.fixture(scope="module")
def bank():
    rng = np.random.default_rng(7)
    return NoiseBank({n: rng.normal(0, 0.2, 997).astype(np.float32) for n in ("crowd", "traffic", "rain", "thunder", "wind")}, 8000)


@fuzz(max_examples=150, deadline_s=3)
@given(
    layout=st.sampled_from(["mono", "stereo", "batch"]),
    n=st.integers(0, 3000),
    kind=st.sampled_from(["silent", "tone", "noise"]),
    dtype=st.sampled_from([np.float32, np.float64]),
    name=st.sampled_from(AUDIO_CORRUPTIONS),
    level=st.one_of(st.sampled_from(sorted(AUDIO_SEVERITY_SNR_DB)), st.floats(-20, 20)),
    seed=st.integers(0, 2**32 - 1),
    content_seed=st.integers(0, 2**16),
)
def test_corrupt_audio_on_any_waveform(bank, layout, n, kind, dtype, name, level, seed, content_seed):
    x = make_waveform(layout, n, kind, dtype, content_seed)
    level_kw = {"severity": level} if isinstance(level, int) else {"snr_db": level}
    snr = AUDIO_SEVERITY_SNR_DB[level] if isinstance(level, int) else level
    with time_limit(10):
        if n == 0:
            with pytest.raises(ValueError, match="N > 0"):
                corrupt_audio(x, name, seed=seed, noise_bank=bank, **level_kw)
            return
        out = corrupt_audio(x, name, seed=seed, noise_bank=bank, sampling_rate=8000, **level_kw)
        again = corrupt_audio(x, name, seed=seed, noise_bank=bank, sampling_rate=8000, **level_kw)
    assert out.dtype == np.float32 and out.shape == x.shape
    np.testing.assert_array_equal(out, again)
    x2, out2 = x.reshape(-1, n), out.reshape(-1, n)
    p_signal = signal_power(x2)
    p_noise = signal_power(out2.astype(np.float64) - x2.astype(np.float32))
    loud = p_signal > 1e-8
    # SNR = 10 log10(P_signal / P_noise) per row; a silent row gets zero noise and stays silent.
    np.testing.assert_allclose(10 * np.log10(p_signal[loud] / p_noise[loud]), snr, atol=0.05)
    assert np.all(out2[p_signal == 0] == 0)


@fuzz(max_examples=60, deadline_s=2)
@given(
    name=st.sampled_from(AUDIO_CORRUPTIONS),
    severity=st.one_of(st.integers().filter(lambda s: s not in AUDIO_SEVERITY_SNR_DB), st.floats(), st.booleans()),
)
def test_out_of_range_audio_severities_are_refused(bank, name, severity):
    with time_limit(5), pytest.raises(ValueError, match="Audio severity must be one of"):
        corrupt_audio(np.ones(100, np.float32), name, severity, seed=0, noise_bank=bank)


@pytest.mark.parametrize(
    "waveform,kwargs,message",
    [
        (np.ones(100, np.int16), {"severity": 2}, "float samples"),
        (np.full(100, np.nan, np.float32), {"severity": 2}, "NaN or infinite"),
        (np.ones((2, 2, 100), np.float32), {"severity": 2}, r"\(N,\) or \(B, N\)"),
        (np.ones(100, np.float32), {"snr_db": float("inf")}, "finite number"),
        (np.ones(100, np.float32), {"severity": 2, "snr_db": 3.0}, "exactly one"),
    ],
)
def test_bad_waveforms_and_levels_are_refused_clearly(waveform, kwargs, message):
    with pytest.raises(ValueError, match=message):
        corrupt_audio(waveform, "gaussian_noise", seed=0, **kwargs)


# ================================================================================================== video
@fuzz(max_examples=60, deadline_s=5)
@given(
    t=st.integers(0, 3),
    h=st.integers(1, 12),
    w=st.integers(1, 12),
    name=st.sampled_from(VIDEO_CORRUPTIONS),
    severity=st.sampled_from(IMAGE_SEVERITIES),
    seed=st.integers(0, 2**32 - 1),
    silent=st.booleans(),
)
def test_corrupt_video_on_any_clip(t, h, w, name, severity, seed, silent):
    rng = np.random.default_rng(seed % 1000)
    frames = np.zeros((t, h, w, 3), np.uint8) if silent else rng.integers(0, 256, (t, h, w, 3), dtype=np.uint8)
    with time_limit(20):
        if t == 0:
            with pytest.raises(ValueError, match="no frames"):
                corrupt_video(frames, name, severity, seed=seed)
            return
        out = corrupt_video(frames, name, severity, seed=seed)
        again = corrupt_video(frames, name, severity, seed=seed)
    assert out.dtype == np.uint8 and out.shape == frames.shape
    np.testing.assert_array_equal(out, again)


@pytest.mark.parametrize(
    "frames,severity,message",
    [
        (np.zeros((2, 4, 4), np.uint8), 3, r"\(T, H, W, 3\) uint8"),
        (np.zeros((2, 4, 4, 3), np.float32), 3, r"\(T, H, W, 3\) uint8"),
        (np.zeros((2, 4, 4, 3), np.uint8), 2.7, "must be one of"),
        (np.zeros((2, 4, 4, 3), np.uint8), 6, "must be one of"),
        (np.zeros((2, 4, 4, 3), np.uint8), True, "must be one of"),
    ],
)
def test_bad_videos_and_severities_are_refused_clearly(frames, severity, message):
    with pytest.raises(ValueError, match=message):
        corrupt_video(frames, "contrast", severity, seed=0)
