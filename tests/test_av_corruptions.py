"""Audio/video corruptions and REST's segment-wise multi-distribution / diverse shifts."""

from __future__ import annotations

import wave

import numpy as np
import pytest

from hf_tta.data.builders.audioset import corrupt_audio_query, corrupt_video_query
from hf_tta.data.corruptions.audio import AUDIO_SEVERITY_SNR_DB, NoiseBank, corrupt_audio, signal_power
from hf_tta.data.corruptions.audio_io import decode_wav, encode_wav, read_audio
from hf_tta.data.corruptions.base import derive_seed
from hf_tta.data.corruptions.segments import diverse_shift_plan, multi_shift_plan, segment_bounds
from tiny_av_models import frame_stacks, waveforms

SR = 8000


def snr(clean, noisy, ref=None):
    return 10 * np.log10((signal_power(clean) if ref is None else ref) / signal_power(noisy - clean))


def test_segment_bounds_cover_the_query_in_near_equal_spans():
    for length, k in [(10, 3), (4, 3), (16000, 2), (7, 7)]:
        b = segment_bounds(length, k)
        assert b[0][0] == 0 and b[-1][1] == length and len(b) == k
        assert all(s < e for s, e in b) and all(b[i][1] == b[i + 1][0] for i in range(k - 1))
        assert max(e - s for s, e in b) - min(e - s for s, e in b) <= 1
    with pytest.raises(ValueError, match="non-empty"):
        segment_bounds(2, 3)


def test_gaussian_noise_hits_the_requested_snr_per_row_vectorised():
    x = waveforms(4, 4000) * np.array([[1.0], [0.1], [2.0], [0.5]], dtype=np.float32)
    for db in (10.0, 0.0, -10.0):
        out = corrupt_audio(x, "gaussian_noise", snr_db=db, seed=1)
        np.testing.assert_allclose(snr(x, out), db, atol=1e-3)
    np.testing.assert_array_equal(corrupt_audio(x, "gaussian_noise", 3, seed=1), corrupt_audio(x, "gaussian_noise", 3, seed=1))
    assert not np.array_equal(corrupt_audio(x, "gaussian_noise", 3, seed=1), corrupt_audio(x, "gaussian_noise", 3, seed=2))
    np.testing.assert_allclose(snr(x, corrupt_audio(x, "gaussian_noise", 5, seed=0)), AUDIO_SEVERITY_SNR_DB[5], atol=1e-3)
    with pytest.raises(ValueError, match="exactly one"):
        corrupt_audio(x, "gaussian_noise", 3, snr_db=0)


def test_environmental_noise_needs_a_recording_and_loops_it(tmp_path):
    x = waveforms(2, 3000)
    with pytest.raises(ValueError, match="noise_bank"):
        corrupt_audio(x, "rain", snr_db=0, seed=0)
    (tmp_path / "rain.wav").write_bytes(encode_wav(np.sin(np.arange(500) / 5).astype(np.float32), SR))
    (tmp_path / "wind").mkdir()
    (tmp_path / "wind" / "notes.txt").write_text("not audio")  # only audio files are picked up
    bank = NoiseBank.from_directory(tmp_path, SR)
    assert bank.available == ("rain",)
    assert bank.missing() == ["crowd", "traffic", "thunder", "wind"]
    out = corrupt_audio(x, "rain", snr_db=5, seed=0, noise_bank=bank, sampling_rate=SR)
    np.testing.assert_allclose(snr(x, out), 5, atol=1e-3)
    residual = (out - x)[0]
    period = 500  # the 500-sample recording is looped over the 3000-sample clip
    np.testing.assert_allclose(residual[:2500], residual[period:3000], atol=1e-5)
    with pytest.raises(KeyError, match="wind"):
        corrupt_audio(x, "wind", snr_db=0, seed=0, noise_bank=bank)
    with pytest.raises(ValueError, match="Hz"):
        corrupt_audio(x, "rain", snr_db=0, noise_bank=bank, sampling_rate=16000)


def test_audio_segments_get_their_own_corruption_on_their_own_span():
    x = waveforms(1, 6000)[0]
    bank = NoiseBank({"wind": np.ones(100, dtype=np.float32)}, SR)  # a DC "recording": easy to recognise
    plan = multi_shift_plan(len(x), [("gaussian_noise", 0.0), ("wind", -5.0), ("gaussian_noise", 10.0)])
    assert [(s.start, s.end) for s in plan] == [(0, 2000), (2000, 4000), (4000, 6000)]
    out = corrupt_audio_query(x, plan, seed=7, noise_bank=bank, sampling_rate=SR)
    residual = out - x
    ref = signal_power(x)  # every segment's SNR is relative to the whole clean clip
    gauss0, wind, gauss2 = residual[:2000], residual[2000:4000], residual[4000:]
    assert np.std(wind) < 1e-6 < np.std(gauss0)  # DC wind only in segment 1
    assert abs(np.mean(gauss0)) < 0.1 * np.std(gauss0)
    for seg, db in ((gauss0, 0.0), (wind, -5.0), (gauss2, 10.0)):
        np.testing.assert_allclose(10 * np.log10(ref / signal_power(seg)), db, atol=1e-3)
    # segment i is exactly corrupt_audio on its span with the segment's derived seed
    expected = corrupt_audio(x[:2000], "gaussian_noise", snr_db=0, seed=derive_seed(7, "segment", 0), reference_power=ref)
    np.testing.assert_array_equal(out[:2000], expected)


def test_video_segments_get_their_own_corruption_on_their_own_frames():
    pytest.importorskip("imagecorruptions", reason="the video corruptions need the `data` extra")
    from hf_tta.data.corruptions.video import corrupt_video

    frames = frame_stacks(1, frames=6, size=32)[0]
    plan = multi_shift_plan(6, [("gaussian_noise", 5), ("contrast", 5), ("pixelate", 5)])
    out = corrupt_video_query(frames, plan, seed=3)
    assert out.shape == frames.shape and out.dtype == np.uint8
    for i, seg in enumerate(plan):
        span = slice(seg.start, seg.end)
        np.testing.assert_array_equal(out[span], corrupt_video(frames[span], seg.name, 5, seed=derive_seed(3, "segment", i)))
    # contrast at severity 5 flattens its frames (per-channel spatial spread); the noise segment does not
    def spread(v):
        return v.astype(float).std(axis=(1, 2)).mean()

    assert spread(out[2:4]) < 0.2 * spread(frames[2:4]) and spread(out[0:2]) > 0.5 * spread(frames[0:2])
    np.testing.assert_array_equal(out, corrupt_video_query(frames, plan, seed=3))
    assert not np.array_equal(out[:2], corrupt_video_query(frames, plan, seed=4)[:2])


def test_diverse_plan_depends_only_on_seed_and_index():
    pool = [(n, 5) for n in ("gaussian_noise", "contrast", "pixelate", "motion_blur")]
    plans = [diverse_shift_plan(12, pool, 3, seed=0, index=i) for i in range(20)]
    assert plans == [diverse_shift_plan(12, pool, 3, seed=0, index=i) for i in range(20)]
    assert all(len(p) == 3 and {s.name for s in p} <= {n for n, _ in pool} for p in plans)
    assert len({tuple(s.name for s in p) for p in plans}) > 5  # segments draw independently
    assert plans != [diverse_shift_plan(12, pool, 3, seed=1, index=i) for i in range(20)]


def test_wav_round_trip_and_pcm_reading(tmp_path):
    x = (waveforms(1, 800)[0] * 1.5).astype(np.float32)  # beyond [-1, 1] survives: float WAV
    y, rate = decode_wav(encode_wav(x, SR))
    assert rate == SR
    np.testing.assert_array_equal(x, y)
    pcm = (np.clip(x, -1, 1) * 32767).astype("<i2")
    path = tmp_path / "stereo.wav"
    with wave.open(str(path), "wb") as w:  # a stdlib PCM file, stereo: mixed down to mono
        w.setnchannels(2)
        w.setsampwidth(2)
        w.setframerate(SR)
        w.writeframes(np.stack([pcm, pcm], axis=1).tobytes())
    z, rate = read_audio(path)
    np.testing.assert_allclose(z, pcm / 32768.0, atol=1e-6)
    z16, rate16 = read_audio(path, sampling_rate=16000)
    assert rate16 == 16000 and abs(len(z16) - 2 * len(z)) <= 1
