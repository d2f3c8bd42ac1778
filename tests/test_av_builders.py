"""AudioSet-O / AudioSet-D / VGGSound builders on a generated fixture of local clips: reading, the pair protocol,
configs, loading for the six directions, publishing through the fake Hub, and feeding TTAWrapper."""

from __future__ import annotations

import json
import wave

import numpy as np
import pytest
import torch

from fake_hub import fake_hub  # noqa: F401  (fixture)
from hf_tta import TTAConfig, TTAWrapper
from hf_tta.data.builders.audioset import (
    AUDIOSET_O_CONFIGS,
    AV_MODALITY_PAIRS,
    AVCorruptionSettings,
    MissingRecordingsError,
    build_av_benchmark,
    corrupt_video_query,
    dataset_card,
    frames_to_array,
    load_av_retrieval,
    push_av_benchmark,
    read_clip_list,
    read_frames,
    save_av_benchmark,
    select_pairs,
    to_model_inputs,
)
from hf_tta.data.corruptions.audio import NoiseBank
from hf_tta.data.corruptions.audio_io import decode_wav, encode_wav
from hf_tta.data.corruptions.base import derive_seed
from tiny_av_models import cav_mae_adapter, frame_stacks, tiny_cav_mae, waveforms

pytest.importorskip("imagecorruptions", reason="the video corruptions need the `data` extra")

SR, N, T = 8000, 6, 4
TEXTS = ["Dog, Bark", "Rain", "Dog, Bark", "Music", "Speech", "Engine"]


def _write_pcm(path, x):
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(SR)
        w.writeframes((np.clip(x, -1, 1) * 32767).astype("<i2").tobytes())


@pytest.fixture(scope="module")
def fixture(tmp_path_factory):
    """6 clips: frame folders (PNG) or .npy videos, 16-bit WAV audio, a JSONL manifest; wind.wav noise."""
    from PIL import Image

    root = tmp_path_factory.mktemp("clips")
    audio, video = waveforms(N, 4000, SR), frame_stacks(N, T, 32)
    rows = []
    for i in range(N):
        (root / f"c{i}").mkdir()
        if i % 2 == 0:
            (root / f"c{i}" / "frames").mkdir()
            for t in range(T):
                Image.fromarray(video[i, t]).save(root / f"c{i}" / "frames" / f"frame_{t}.png")
            vpath = f"c{i}/frames"
        else:
            np.save(root / f"c{i}" / "video.npy", video[i])
            vpath = f"c{i}/video.npy"
        _write_pcm(root / f"c{i}" / "audio.wav", audio[i])
        rows.append({"id": f"c{i}", "audio": f"c{i}/audio.wav", "video": vpath, "text": TEXTS[i]})
    rows.append({"id": "gone", "audio": "nowhere.wav", "video": "nowhere", "text": "x"})
    (root / "clips.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    (root / "noise").mkdir()
    (root / "noise" / "wind.wav").write_bytes(encode_wav(np.random.default_rng(0).standard_normal(1500).astype(np.float32), SR))
    clips, report = read_clip_list(root / "clips.jsonl")
    pairs = select_pairs(clips, num_pairs=5, seed=0)
    bank = NoiseBank.from_directory(root / "noise", SR)
    settings = AVCorruptionSettings(seed=0, num_segments=2)
    built = build_av_benchmark(
        pairs, "audioset-o", configs=["clean", "video_noise_blur_digital", "audio_noise_weather"],
        settings=settings, noise_bank=bank, sampling_rate=SR, cache_dir=str(root / "cache"),
    )
    return dict(root=root, clips=clips, report=report, pairs=pairs, bank=bank, settings=settings, built=built, audio=audio, video=video)


def test_clip_list_and_the_pair_protocol(fixture):
    assert fixture["report"].num_listed == N + 1 and fixture["report"].missing_audio == ["gone"]
    clips, pairs = fixture["clips"], fixture["pairs"]
    assert [c.id for c in clips] == [f"c{i}" for i in range(N)]
    assert len(pairs) == 5 and [c.id for c in pairs] == sorted(c.id for c in pairs)  # drawn, kept in list order
    assert [c.id for c in select_pairs(clips, num_pairs=5, seed=0)] == [c.id for c in pairs]
    assert [c.id for c in select_pairs(clips, ids=["c3", "c1"])] == ["c3", "c1"]
    assert len(select_pairs(clips, num_pairs=3000)) == N  # fewer clips than the protocol: all of them
    np.testing.assert_array_equal(frames_to_array(read_frames(clips[0])), fixture["video"][0])
    np.testing.assert_array_equal(frames_to_array(read_frames(clips[1], num_frames=2)), fixture["video"][1][[0, 3]])


def test_cav_mae_datafile_with_label_names(tmp_path, fixture):
    from PIL import Image

    for t in range(T):
        (tmp_path / f"frame_{t}").mkdir()
        Image.fromarray(fixture["video"][0, t]).save(tmp_path / f"frame_{t}" / "vid0.jpg")
    _write_pcm(tmp_path / "vid0.wav", fixture["audio"][0])
    (tmp_path / "labels.csv").write_text("index,mid,display_name\n0,/m/01,Dog\n1,/m/02,Bark\n")
    data = {"data": [{"video_id": "vid0", "wav": str(tmp_path / "vid0.wav"), "video_path": str(tmp_path), "labels": "/m/01,/m/02"}]}
    (tmp_path / "data.json").write_text(json.dumps(data))
    clips, report = read_clip_list(tmp_path / "data.json", label_csv=tmp_path / "labels.csv")
    assert report.usable == 1 and clips[0].text == "Dog, Bark"
    frames = read_frames(clips[0])
    assert len(frames) == T and getattr(frames[0], "encoded", None) is not None  # clean JPEGs are stored as they are


def test_a_video_file_without_an_audio_entry_gives_its_own_audio_track(tmp_path):
    (tmp_path / "a.mp4").write_bytes(b"not decoded by read_clip_list")
    (tmp_path / "clips.jsonl").write_text(json.dumps({"id": "x", "video": "a.mp4", "text": "a dog barks"}) + "\n")
    clips, report = read_clip_list(tmp_path / "clips.jsonl")
    assert report.usable == 1 and report.missing_audio == [] and clips[0].audio is None  # read_clip_audio uses the video
    (tmp_path / "clips.jsonl").write_text(json.dumps({"id": "y", "video": str(tmp_path), "text": "frames only"}) + "\n")
    clips, report = read_clip_list(tmp_path / "clips.jsonl")
    assert report.missing_audio == ["y"]  # a frame folder has no audio track


def test_configs_hold_the_corrupted_queries_and_the_clean_gallery(fixture):
    built, pairs, settings = fixture["built"], fixture["pairs"], fixture["settings"]
    clean = built["clean"]
    assert clean.column_names == ["id", "video", "audio", "sampling_rate", "text"]
    assert list(clean["id"]) == [c.id for c in pairs]
    row = built["video_noise_blur_digital"][1]
    assert row["id"] == pairs[1].id
    assert row["corruptions"] == ["gaussian_noise", "defocus_blur", "contrast"] and row["severity"] == [5, 5, 5]
    assert row["segments"] == [[0, 1], [1, 2], [2, 4]]
    # exactly the segment corruption of the clean frames, stored losslessly
    clean_frames = frames_to_array(clean[1]["video"])
    plan = settings.plan("video_noise_blur_digital", T, 1)
    expected = corrupt_video_query(clean_frames, plan, derive_seed(settings.seed, "video_noise_blur_digital", 1))
    np.testing.assert_array_equal(frames_to_array(row["video"]), expected)
    audio_row = built["audio_noise_weather"][2]
    assert audio_row["corruptions"] == ["gaussian_noise", "wind"] and audio_row["segments"] == [[0, 2000], [2000, 4000]]
    assert audio_row["snr_db"] == [settings.audio_snr_db] * 2
    clean_wav, rate = decode_wav(clean[2]["audio"])
    noisy, _ = decode_wav(audio_row["audio"])
    assert rate == SR and noisy.shape == clean_wav.shape and not np.allclose(noisy, clean_wav)


def test_missing_recordings_are_named(fixture):
    with pytest.raises(MissingRecordingsError, match=r"crowd.*rain.*thunder.*traffic") as err:
        build_av_benchmark(fixture["pairs"], "audioset-d", sampling_rate=SR, noise_bank=fixture["bank"])
    assert "audio_diverse" in str(err.value) and "'gaussian_noise', 'wind'" in str(err.value)
    with pytest.raises(MissingRecordingsError, match="wind"):
        build_av_benchmark(fixture["pairs"], configs=["audio_noise_weather"], sampling_rate=SR)
    # a pool of what can be made builds
    settings = AVCorruptionSettings(audio_pool=("gaussian_noise", "wind"), video_pool=("contrast", "pixelate"))
    built = build_av_benchmark(fixture["pairs"][:2], "audioset-d", settings=settings, sampling_rate=SR, noise_bank=fixture["bank"])
    assert sorted(built) == ["audio_diverse", "clean", "video_diverse"]
    assert set(built["video_diverse"][0]["corruptions"]) <= {"contrast", "pixelate"}


@pytest.mark.parametrize("direction", AV_MODALITY_PAIRS, ids=lambda d: f"{d[0]}->{d[1]}")
def test_loading_every_direction(fixture, direction):
    query, gallery = direction
    config = {"video": "video_noise_blur_digital", "audio": "audio_noise_weather"}.get(query, "clean")
    split = load_av_retrieval(fixture["built"], config, direction)
    texts = [TEXTS[int(c.id[1:])] for c in fixture["pairs"]]
    unique = list(dict.fromkeys(texts))
    assert split.query_modality == query and split.gallery_modality == gallery
    assert len(split.queries) == len(split.relevant) == (len(unique) if query == "text" else 5)
    assert len(split.gallery) == (len(unique) if gallery == "text" else 5)
    if "text" not in direction:
        assert split.relevant == [[i] for i in range(5)]
    elif query == "text":
        assert split.relevant[unique.index("Dog, Bark")] == [i for i, t in enumerate(texts) if t == "Dog, Bark"]
    for items, modality in ((split.queries, query), (split.gallery, gallery)):
        item = items[0]
        if modality == "video":
            assert item.shape == (T, 32, 32, 3) and item.dtype == np.uint8
        elif modality == "audio":
            assert item.shape == (4000,) and item.dtype == np.float32
        else:
            assert isinstance(item, str)
    if config != "clean":
        assert len(split.query_corruptions) == 5
    with pytest.raises(ValueError, match="corrupts"):
        load_av_retrieval(fixture["built"], "audio_noise_weather", "video->audio")


def test_push_to_hub_with_card_round_trips(fixture, fake_hub, tmp_path):  # noqa: F811
    built, settings = fixture["built"], fixture["settings"]
    card = dataset_card("audioset-o", list(built), settings, num_pairs=5, sampling_rate=SR)
    pushed = push_av_benchmark(built, "me/audioset-o", card, api=fake_hub.api())
    assert pushed[0] == "clean"
    repo = fake_hub.repo_dir("me/audioset-o")
    readme = (repo / "README.md").read_text()
    for config in built:
        assert f"config_name: {config}" in readme and (repo / config).is_dir()
    assert "# AudioSet-O" in readme and "test-time-adaptation" in readme and "license: other" in readme
    from datasets import get_dataset_config_names

    assert sorted(get_dataset_config_names(str(repo))) == sorted(built)
    split = load_av_retrieval(str(repo), "video_noise_blur_digital", "video->audio")
    local = load_av_retrieval(built, "video_noise_blur_digital", "video->audio")
    np.testing.assert_array_equal(split.queries[3], local.queries[3])
    np.testing.assert_array_equal(split.gallery[4], local.gallery[4])
    # save_to_disk round trip, and audio resampled on load (CLAP wants 48 kHz)
    save_av_benchmark(built, tmp_path / "saved")
    resampled = load_av_retrieval(tmp_path / "saved", "clean", "audio->text", sampling_rate=2 * SR)
    assert resampled.sampling_rate == 2 * SR and resampled.queries[0].shape == (8000,)


class FbankProcessor:
    """A stand-in audio processor for the CAV-MAE-shaped model: log power spectrogram resized to (32, 16)."""

    def __call__(self, audio, sampling_rate, return_tensors="pt"):
        x = torch.as_tensor(np.stack(audio))
        spec = torch.stft(x, n_fft=64, hop_length=32, window=torch.hann_window(64), return_complex=True).abs().log1p()
        spec = torch.nn.functional.interpolate(spec[:, None], size=(16, 32), mode="bilinear")[:, 0]
        return {"input_values": spec.transpose(1, 2)}


def test_loaded_split_adapts_through_the_wrapper(fixture):
    from transformers import CLIPImageProcessor

    frames = CLIPImageProcessor(size={"shortest_edge": 16}, crop_size={"height": 16, "width": 16})
    split = load_av_retrieval(fixture["built"], "video_noise_blur_digital", "video->audio")
    tta = TTAWrapper(cav_mae_adapter(tiny_cav_mae()), TTAConfig(objective="tcr", query_modality="video"))
    gallery = tta.encode_gallery(split.gallery_inputs(FbankProcessor(), batch_size=4))
    scores = tta.adapt_stream(list(split.query_inputs(frames, batch_size=5)), gallery, show_progress=False)
    assert scores.shape == (5, 5)
    metrics = split.evaluate(scores)
    assert 0 <= metrics["R@1"] <= 100
    # clips with fewer frames are padded with their last frame and masked (CLIPVideoAdapter's frame_mask)
    inputs = to_model_inputs([fixture["video"][0], fixture["video"][1][:2]], "video", frames)
    assert inputs["pixel_values"].shape == (2, T, 3, 16, 16)
    assert inputs["frame_mask"].tolist() == [[1, 1, 1, 1], [1, 1, 0, 0]]


def test_card_describes_the_construction(fixture):
    settings = AVCorruptionSettings(seed=3)
    card = dataset_card("audioset-o", ["clean", *AUDIOSET_O_CONFIGS], settings, num_pairs=3000, sampling_rate=16000)
    text = str(card)
    assert "3000 video-audio pairs" in text and "gaussian_noise + defocus_blur + contrast" in text
    assert "gaussian_noise + wind" in text and "Seed: 3" in text and "-10 dB SNR" in text



def test_video_files_decode_with_pyav(tmp_path):
    av = pytest.importorskip("av", reason="video files need the `audio` extra (PyAV)")
    from hf_tta.data.builders.audioset import AVClip, read_clip_audio

    path = tmp_path / "clip.mp4"
    with av.open(str(path), "w") as c:
        v = c.add_stream("mpeg4", rate=5)
        v.width, v.height, v.pix_fmt = 32, 32, "yuv420p"
        a = c.add_stream("aac", rate=16000, layout="mono")
        for i in range(6):
            for p in v.encode(av.VideoFrame.from_ndarray(np.full((32, 32, 3), 40 * i, np.uint8), format="rgb24")):
                c.mux(p)
        for p in v.encode():
            c.mux(p)
        tone = (0.3 * np.sin(np.arange(16000) / 16000 * 2 * np.pi * 440)).astype(np.float32)[None]
        frame = av.AudioFrame.from_ndarray(tone, format="flt", layout="mono")
        frame.sample_rate = 16000
        for p in a.encode(frame):
            c.mux(p)
        for p in a.encode():
            c.mux(p)
    clip = AVClip(id="x", video=str(path))  # no separate audio: the video's audio track
    frames = frames_to_array(read_frames(clip, num_frames=3, frame_size=16))
    assert frames.shape == (3, 16, 16, 3)
    assert frames[0].mean() < frames[1].mean() < frames[2].mean()  # uniformly sampled, in order
    wav = read_clip_audio(clip, sampling_rate=8000)
    assert abs(len(wav) - 8000) < 1200 and 0.1 < np.abs(wav).max() < 0.5  # 1 s at 8 kHz (codec padding aside)


def test_audio_queries_through_a_clap_feature_extractor(fixture):
    from transformers import ClapFeatureExtractor

    from tiny_av_models import tiny_clap
    from tiny_models import text_batch

    fe = ClapFeatureExtractor(feature_size=16, sampling_rate=SR, hop_length=128, max_length_s=1, fft_window_size=256,
                              truncation="rand_trunc", padding="repeatpad")
    split = load_av_retrieval(fixture["built"], "audio_noise_weather", "audio->text", sampling_rate=SR)
    tta = TTAWrapper(tiny_clap(), TTAConfig(objective="tent", query_modality="audio"))
    gallery = tta.encode_gallery(text_batch(len(split.gallery), seed=1))  # stands in for tokenised split.gallery
    batches = list(split.query_inputs(fe, batch_size=3))
    assert batches[0]["input_features"].shape[:2] == (3, 1)
    scores = tta.adapt_stream(batches, gallery, show_progress=False)
    assert scores.shape == (5, len(split.gallery)) and tta.batch_index == 2
