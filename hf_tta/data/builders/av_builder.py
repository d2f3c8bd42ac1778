"""Build AudioSet-O / AudioSet-D (REST §3, Table IV) and VGGSound (AudioSet2VGG) from the selected clips.

Every benchmark has a ``clean`` config (``id``, ``video`` frames, ``audio`` WAV bytes, ``sampling_rate``, ``text``)
that holds the galleries; a corruption config holds only ``id``, the corrupted modality and what was done to each
segment, so the clean data is stored once.

**Storage that round-trips without extra packages.** ``datasets``' ``Audio`` feature needs torchcodec even to
encode, and the torchcodec wheel on PyPI is built against CUDA torch (it fails to load with the CPU build); so
audio is stored as lossless 32-bit float mono **WAV bytes** in a ``Value("binary")`` column (decoded by
:func:`~hf_tta.data.corruptions.audio_io.decode_wav`; with torchcodec installed,
``ds.cast_column("audio", datasets.Audio())`` works too). Video is a ``List(Image())`` of frames: PNG for
corrupted frames (lossless), the source bytes for clean frames that were not resized.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence

from ..corruptions.audio import AUDIO_CORRUPTIONS, NoiseBank
from ..corruptions.audio_io import encode_wav
from ..corruptions.base import derive_seed
from .av_plans import (
    AVCorruptionSettings,
    MissingRecordingsError,
    corrupt_audio_query,
    corrupt_video_query,
    missing_recordings,
)
from .base import CLEAN, SPLIT, encode_image
from .clips import AVClip, frames_to_array, read_clip_audio, read_frames
from .specs import AUDIOSET_D_CONFIGS, AUDIOSET_O_CONFIGS, AV_BENCHMARKS, av_features


def _frame_cell(frame) -> dict:
    encoded = getattr(frame, "encoded", None)
    if encoded is not None:
        return {"bytes": encoded, "path": None}
    return {"bytes": encode_image(frame, "PNG"), "path": None}


def _generate(
    config: str,
    items: Sequence[tuple[int, AVClip]],
    settings: AVCorruptionSettings,
    sampling_rate: int,
    num_frames: int | None,
    frame_size: int | None,
    noise_bank: NoiseBank | None,
) -> Iterator[dict]:
    """Rows of ``config``. ``items`` pairs each clip with its position: ``datasets`` shards list arguments of
    ``from_generator``, so a position counted here would restart in every shard (and change the seeds)."""
    from PIL import Image

    for index, clip in items:
        seed = derive_seed(settings.seed, config, index)
        if config == CLEAN:
            frames = read_frames(clip, num_frames, frame_size)
            wav = read_clip_audio(clip, sampling_rate)
            yield {
                "id": clip.id,
                "video": [_frame_cell(f) for f in frames],
                "audio": encode_wav(wav, sampling_rate),
                "sampling_rate": sampling_rate,
                "text": clip.text,
            }
        elif config.startswith("video"):
            frames = frames_to_array(read_frames(clip, num_frames, frame_size))
            plan = settings.plan(config, len(frames), index)
            out = corrupt_video_query(frames, plan, seed)
            yield {
                "id": clip.id,
                "video": [_frame_cell(Image.fromarray(f)) for f in out],
                "corruptions": [s.name for s in plan],
                "severity": [int(s.level) for s in plan],
                "segments": [[s.start, s.end] for s in plan],
            }
        else:
            wav = read_clip_audio(clip, sampling_rate)
            plan = settings.plan(config, len(wav), index)
            out = corrupt_audio_query(wav, plan, seed, noise_bank, sampling_rate)
            yield {
                "id": clip.id,
                "audio": encode_wav(out, sampling_rate),
                "sampling_rate": sampling_rate,
                "corruptions": [s.name for s in plan],
                "snr_db": [float(s.level) for s in plan],
                "segments": [[s.start, s.end] for s in plan],
            }


def build_av_benchmark(
    clips: Sequence[AVClip],
    benchmark: str = "audioset-o",
    configs: Sequence[str] | None = None,
    *,
    settings: AVCorruptionSettings | None = None,
    noise_bank: NoiseBank | None = None,
    sampling_rate: int = 16000,
    num_frames: int | None = None,
    frame_size: int | None = None,
    cache_dir: str | None = None,
) -> dict[str, Any]:
    """Build the configs of an audio-video benchmark from the selected pairs (:func:`select_pairs`).

    Args:
        clips: the test pairs, in order (row ``i`` of every config is clip ``i``).
        benchmark: ``"audioset-o"``, ``"audioset-d"`` or ``"vggsound"`` (:data:`AV_BENCHMARKS`); picks the configs.
        configs: build only these (``"clean"`` and/or names of :data:`AUDIOSET_O_CONFIGS` /
            :data:`AUDIOSET_D_CONFIGS`).
        settings: severities, SNR, seed, segments, representatives, pools.
        noise_bank: recordings of crowd / traffic / rain / thunder / wind noise (resampled to ``sampling_rate``).
        sampling_rate: audio rate stored (CAV-MAE: 16 kHz; CLAP resamples to 48 kHz at load time).
        num_frames: frames kept per clip (uniformly sampled); ``None`` keeps them all (CAV-MAE's layout has 10).
        frame_size: resize the short side and centre-crop to this size (ImageNet-C constants assume ~224 px);
            ``None`` keeps the frames as they are.

    Returns:
        config name -> ``datasets.Dataset`` (written to the datasets cache as it is generated, never all in memory).

    Raises:
        MissingRecordingsError: naming the configs and noise types that need a recording you did not provide.
    """
    from datasets import Dataset

    settings = settings or AVCorruptionSettings()
    if benchmark not in AV_BENCHMARKS:
        raise ValueError(f"benchmark must be one of {list(AV_BENCHMARKS)}; got {benchmark!r}.")
    configs = tuple(configs or AV_BENCHMARKS[benchmark])
    known = ("clean", *AUDIOSET_O_CONFIGS, *AUDIOSET_D_CONFIGS)
    unknown = [c for c in configs if c not in known]
    if unknown:
        raise ValueError(f"Unknown configs {unknown}; choose from {list(known)}.")
    if not clips:
        raise ValueError("No clips to build from.")
    if noise_bank is not None and noise_bank.sampling_rate != sampling_rate:
        raise ValueError(f"The noise bank is at {noise_bank.sampling_rate} Hz; the benchmark at {sampling_rate} Hz.")
    lacking = missing_recordings(configs, settings, noise_bank)
    if lacking:
        types = sorted({n for v in lacking.values() for n in v})
        raise MissingRecordingsError(
            f"Cannot make {types}: no recording provided (NoiseBank.from_directory looks for <name>.wav or a <name>/ "
            f"folder). Affected configs: {lacking}. With the recordings given, the audio corruptions that can be made "
            f"are {[n for n in AUDIO_CORRUPTIONS if n not in types]}: pass settings.audio_pool=... for audio_diverse, "
            "or leave those configs out."
        )
    out = {}
    for config in configs:
        kwargs = dict(
            config=config, items=list(enumerate(clips)), settings=settings, sampling_rate=sampling_rate,
            num_frames=num_frames, frame_size=frame_size, noise_bank=noise_bank,
        )
        out[config] = Dataset.from_generator(
            _generate, features=av_features(config), gen_kwargs=kwargs, cache_dir=cache_dir, split=SPLIT
        )
    return out



def save_av_benchmark(built: Mapping[str, Any], directory: str | os.PathLike) -> None:
    """``save_to_disk`` every config into ``directory/<config>`` (readable by :func:`load_av_retrieval`)."""
    for config, ds in built.items():
        ds.save_to_disk(str(Path(directory) / config))


__all__ = ["build_av_benchmark", "save_av_benchmark"]
