"""AudioSet-O / AudioSet-D (REST §3, Table IV) and VGGSound (AudioSet2VGG) from the user's local clips.

The test protocol is REST's: 3,000 video-audio pairs (1-to-1), the gallery clean, the queries corrupted.

- **AudioSet-O** (multi-distribution shift): a video query with ``k`` corruption categories is cut into ``k`` equal
  temporal segments, each gets the representative subtype of one category (configs ``video_noise_blur``,
  ``video_noise_digital``, ``video_blur_digital``, ``video_noise_blur_digital``: REST's AR columns N+B, N+D, B+D,
  N+B+D); an audio query gets Noise + Weather (``audio_noise_weather``: REST's VR column N+W).
- **AudioSet-D** (diverse shift): each of ``num_segments`` segments draws its own corruption at random from all
  subtypes (``video_diverse``, ``audio_diverse``).
- **VGGSound** (AudioSet2VGG, real-world shift): only the ``clean`` config; a model fine-tuned on AudioSet is
  evaluated on it.

Every benchmark has a ``clean`` config (``id``, ``video`` frames, ``audio`` WAV bytes, ``sampling_rate``,
``text``) that holds the galleries; a corruption config holds only ``id``, the corrupted modality and what was done
to each segment, so the clean data is stored once. :func:`load_av_retrieval` joins them into queries, gallery and
relevance for any of the six directions.

The code lives in one module per idea: :mod:`.specs` (configs, modality pairs), :mod:`.clips` (reading your clips),
:mod:`.av_plans` (how queries are corrupted), :mod:`.av_builder` (building), :mod:`.card` (the dataset card),
:mod:`.hub` (publishing) and :mod:`.loading` (queries, gallery and relevance). This module gathers their public
audio-video names under one import path, ``hf_tta.data.builders.audioset``.
"""

from __future__ import annotations

import warnings

from .av_builder import build_av_benchmark, save_av_benchmark
from .av_plans import (
    AVCorruptionSettings,
    MissingRecordingsError,
    corrupt_audio_query,
    corrupt_video_query,
    missing_recordings,
)
from .card import dataset_card
from .clips import (
    AVClip,
    ClipReport,
    frames_to_array,
    read_clip_audio,
    read_clip_list,
    read_frames,
    read_label_names,
    select_pairs,
)
from .hub import push_av_benchmark
from .loading import AVRetrievalSplit, LazyItems, load_av_retrieval, to_model_inputs
from .specs import AUDIOSET_D_CONFIGS, AUDIOSET_O_CONFIGS, AV_BENCHMARKS, AV_MODALITY_PAIRS, NUM_PAIRS, parse_direction

#: Former names, renamed so that no two modules define the same name (the grid runner has its own ``DIRECTIONS``).
_RENAMED = {"BENCHMARKS": "AV_BENCHMARKS", "DIRECTIONS": "AV_MODALITY_PAIRS"}


def __getattr__(name: str):
    if name in _RENAMED:
        new = _RENAMED[name]
        warnings.warn(f"hf_tta.data.builders.audioset.{name} is now {new}.", DeprecationWarning, stacklevel=2)
        return globals()[new]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "AUDIOSET_D_CONFIGS",
    "AUDIOSET_O_CONFIGS",
    "AVClip",
    "AVCorruptionSettings",
    "AVRetrievalSplit",
    "AV_BENCHMARKS",
    "AV_MODALITY_PAIRS",
    "ClipReport",
    "LazyItems",
    "MissingRecordingsError",
    "NUM_PAIRS",
    "build_av_benchmark",
    "corrupt_audio_query",
    "corrupt_video_query",
    "dataset_card",
    "frames_to_array",
    "load_av_retrieval",
    "missing_recordings",
    "parse_direction",
    "push_av_benchmark",
    "read_clip_audio",
    "read_clip_list",
    "read_frames",
    "read_label_names",
    "save_av_benchmark",
    "select_pairs",
    "to_model_inputs",
]
