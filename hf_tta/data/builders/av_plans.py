"""How the audio-video queries are corrupted: the settings of a build (severity, SNR, seed, segments,
representatives, pools), each query's segment plan (REST's multi-distribution -O and diverse -D shifts), the
check for missing noise recordings, and applying a plan to a video or a waveform."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from ..corruptions.audio import (
    AUDIO_CORRUPTIONS,
    AUDIO_REPRESENTATIVES,
    ENVIRONMENTAL_NOISES,
    NoiseBank,
    corrupt_audio,
    signal_power,
    snr_of,
)
from ..corruptions.base import derive_seed
from ..corruptions.segments import Segment, apply_plan, diverse_shift_plan, multi_shift_plan
from ..corruptions.video import VIDEO_CORRUPTIONS, VIDEO_REPRESENTATIVES, corrupt_video
from .specs import AUDIOSET_D_CONFIGS, AUDIOSET_O_CONFIGS


@dataclass
class AVCorruptionSettings:
    """How the corruption configs are made (recorded in the dataset card).

    Args:
        seed: every draw (pairs, segments, noise) derives from it and the clip's position.
        video_severity: ImageNet-C severity of the video corruptions (REST: the maximum, 5).
        audio_snr_db: SNR of the audio corruptions in dB (default: severity 5 of AUDIO_SEVERITY_SNR_DB).
        num_segments: segments of a diverse-shift query (REST: "several"; ours: 3).
        video_representatives / audio_representatives: the subtype used for each category in the -O configs.
        video_pool / audio_pool: the subtypes a diverse-shift segment draws from (default: all of the modality).
    """

    seed: int = 0
    video_severity: int = 5
    audio_snr_db: float = field(default_factory=lambda: snr_of(severity=5))
    num_segments: int = 3
    video_representatives: dict[str, str] = field(default_factory=dict)
    audio_representatives: dict[str, str] = field(default_factory=dict)
    video_pool: tuple[str, ...] | None = None
    audio_pool: tuple[str, ...] | None = None

    def __post_init__(self):
        self.video_representatives = {**VIDEO_REPRESENTATIVES, **self.video_representatives}
        self.audio_representatives = {**AUDIO_REPRESENTATIVES, **self.audio_representatives}
        if self.num_segments < 1:
            raise ValueError("num_segments must be >= 1.")

    def video_pool_or_default(self) -> tuple[str, ...]:
        return tuple(self.video_pool or VIDEO_CORRUPTIONS)

    def audio_pool_or_default(self) -> tuple[str, ...]:
        return tuple(self.audio_pool or AUDIO_CORRUPTIONS)

    def corruptions_needed(self, config: str) -> tuple[str, ...]:
        """The subtypes a config can use."""
        if config in AUDIOSET_O_CONFIGS:
            modality, cats = AUDIOSET_O_CONFIGS[config]
            reps = self.video_representatives if modality == "video" else self.audio_representatives
            return tuple(reps[c] for c in cats)
        if config == "video_diverse":
            return self.video_pool_or_default()
        if config == "audio_diverse":
            return self.audio_pool_or_default()
        return ()

    def plan(self, config: str, length: int, index: int) -> list[Segment]:
        """The segments of query ``index`` (``length`` frames or samples) in ``config``."""
        modality = config.split("_", 1)[0]
        level = float(self.video_severity) if modality == "video" else float(self.audio_snr_db)
        if config in AUDIOSET_O_CONFIGS:
            return multi_shift_plan(length, [(n, level) for n in self.corruptions_needed(config)])
        if config in AUDIOSET_D_CONFIGS:
            pool = [(n, level) for n in self.corruptions_needed(config)]
            return diverse_shift_plan(length, pool, self.num_segments, derive_seed(self.seed, config), index)
        raise ValueError(f"{config!r} is not a corruption config.")


class MissingRecordingsError(ValueError):
    """Some requested audio corruptions need environmental-noise recordings that were not provided."""


def missing_recordings(configs: Sequence[str], settings: AVCorruptionSettings, noise_bank: NoiseBank | None) -> dict[str, list[str]]:
    """config -> the environmental noises it needs and ``noise_bank`` has no recording of."""
    out = {}
    for config in configs:
        need = [n for n in settings.corruptions_needed(config) if n in ENVIRONMENTAL_NOISES]
        lacking = [n for n in need if noise_bank is None or n not in noise_bank.recordings]
        if lacking:
            out[config] = lacking
    return out


def corrupt_video_query(frames: np.ndarray, plan: Sequence[Segment], seed: int) -> np.ndarray:
    """Apply a segment plan to a ``(T, H, W, 3)`` uint8 video (frame by frame within each segment)."""
    return apply_plan(frames, plan, lambda x, name, level, s: corrupt_video(x, name, int(level), seed=s), seed)


def corrupt_audio_query(
    waveform: np.ndarray, plan: Sequence[Segment], seed: int, noise_bank: NoiseBank | None = None, sampling_rate: int | None = None
) -> np.ndarray:
    """Apply a segment plan to a 1-D waveform; every segment's SNR is relative to the whole clean clip's power."""
    ref = float(signal_power(waveform))

    def corrupt(x, name, level, s):
        return corrupt_audio(
            x, name, snr_db=level, seed=s, noise_bank=noise_bank, sampling_rate=sampling_rate, reference_power=ref
        )

    return apply_plan(np.asarray(waveform, dtype=np.float32), plan, corrupt, seed)


__all__ = [
    "AVCorruptionSettings",
    "MissingRecordingsError",
    "corrupt_audio_query",
    "corrupt_video_query",
    "missing_recordings",
]
