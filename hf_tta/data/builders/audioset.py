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

**Storage that round-trips without extra packages.** ``datasets``' ``Audio`` feature needs torchcodec even to
encode, and the torchcodec wheel on PyPI is built against CUDA torch (it fails to load with the CPU build); so
audio is stored as lossless 32-bit float mono **WAV bytes** in a ``Value("binary")`` column (decoded by
:func:`~hf_tta.data.corruptions.audio.decode_wav`; with torchcodec installed,
``ds.cast_column("audio", datasets.Audio())`` works too). Video is a ``List(Image())`` of frames: PNG for
corrupted frames (lossless), the source bytes for clean frames that were not resized.

**Reading your clips** (:func:`read_clip_list`): a CAV-MAE datafile (``{"data": [{"video_id", "wav",
"video_path", "labels"}]}``, frames at ``video_path/frame_{i}/video_id.jpg``, labels mapped to names with AudioSet's
``class_labels_indices.csv``) or a manifest (``.csv``, ``.jsonl`` or a ``.json`` list) with columns ``id``,
``audio``, ``video`` and ``text`` (or ``caption``/``label``). Audio: ``.wav`` and ``.npy`` with no dependency,
``.flac``/``.mp3``/``.ogg``/``.m4a`` and video files' audio tracks with PyAV (``pip install 'hf_tta[audio]'``).
Video: a folder of frame images, a ``(T, H, W, 3)`` uint8 ``.npy``, or with PyAV a video file (``.mp4``, ``.mkv``,
``.webm``, ``.avi``, ...).
"""

from __future__ import annotations

import csv
import json
import logging
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Sequence

import numpy as np

from ..corruptions._utils import derive_seed
from ..corruptions.audio import (
    AUDIO_CORRUPTIONS,
    AUDIO_REPRESENTATIVES,
    ENVIRONMENTAL_NOISES,
    NoiseBank,
    corrupt_audio,
    decode_wav,
    encode_wav,
    read_audio,
    resample,
    signal_power,
    snr_of,
)
from ..corruptions.segments import Segment, apply_plan, diverse_shift_plan, multi_shift_plan
from .loading import RetrievalSplit

logger = logging.getLogger(__name__)

NUM_PAIRS = 3000
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".webp")
VIDEO_FILE_EXTENSIONS = (".mp4", ".mkv", ".webm", ".avi", ".mov", ".m4v")

#: AudioSet-O: config -> (corrupted modality, corruption categories in segment order).
AUDIOSET_O_CONFIGS: dict[str, tuple[str, tuple[str, ...]]] = {
    "video_noise_blur": ("video", ("noise", "blur")),
    "video_noise_digital": ("video", ("noise", "digital")),
    "video_blur_digital": ("video", ("blur", "digital")),
    "video_noise_blur_digital": ("video", ("noise", "blur", "digital")),
    "audio_noise_weather": ("audio", ("noise", "weather")),
}
#: AudioSet-D: config -> corrupted modality (every segment draws from all subtypes).
AUDIOSET_D_CONFIGS: dict[str, str] = {"video_diverse": "video", "audio_diverse": "audio"}
BENCHMARKS: dict[str, tuple[str, ...]] = {
    "audioset-o": ("clean", *AUDIOSET_O_CONFIGS),
    "audioset-d": ("clean", *AUDIOSET_D_CONFIGS),
    "vggsound": ("clean",),
}
DIRECTIONS: tuple[tuple[str, str], ...] = (
    ("audio", "text"),
    ("text", "audio"),
    ("video", "text"),
    ("text", "video"),
    ("video", "audio"),
    ("audio", "video"),
)


# ====================================================================================================== clips
@dataclass
class AVClip:
    """One local clip: where its audio and frames are, and its text (caption or label names)."""

    id: str
    audio: str | None = None
    video: str | None = None
    text: str = ""
    sampling_rate: int | None = None  # only for .npy waveforms
    frame_pattern: str | None = None  # CAV-MAE: "<video_path>/frame_{i}/<video_id>.jpg"


@dataclass
class ClipReport:
    """What :func:`read_clip_list` found: nothing is dropped without being listed here."""

    num_listed: int = 0
    missing_audio: list[str] = field(default_factory=list)
    missing_video: list[str] = field(default_factory=list)

    @property
    def usable(self) -> int:
        return self.num_listed - len(set(self.missing_audio) | set(self.missing_video))

    def summary(self) -> str:
        return (
            f"{self.num_listed} clips listed, {self.usable} usable; {len(self.missing_audio)} without audio, "
            f"{len(self.missing_video)} without video"
            + (f" (e.g. {(self.missing_audio + self.missing_video)[:3]})" if self.missing_audio or self.missing_video else "")
        )


def read_label_names(label_csv: str | os.PathLike) -> dict[str, str]:
    """AudioSet/VGGSound ``class_labels_indices.csv`` (``index,mid,display_name``) as ``mid -> display_name``."""
    with open(label_csv, newline="", encoding="utf-8") as fh:
        return {row["mid"]: row["display_name"] for row in csv.DictReader(fh)}


def _labels_to_text(labels: str, names: Mapping[str, str] | None) -> str:
    parts = [p.strip() for p in str(labels).split(",") if p.strip()]
    return ", ".join(names.get(p, p) for p in parts) if names else ", ".join(parts)


def read_clip_list(
    source: str | os.PathLike,
    label_csv: str | os.PathLike | None = None,
    check_files: bool = True,
) -> tuple[list[AVClip], ClipReport]:
    """Read a CAV-MAE datafile or a manifest (see the module docstring) into clips.

    Relative paths are resolved against the list file's folder. With ``check_files`` clips whose audio or video is
    missing are dropped and listed in the report.
    """
    path = Path(source)
    base = path.parent
    names = read_label_names(label_csv) if label_csv else None
    suffix = path.suffix.lower()
    if suffix == ".csv":
        with open(path, newline="", encoding="utf-8") as fh:
            rows: list[dict[str, Any]] = list(csv.DictReader(fh))
    elif suffix == ".jsonl":
        rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    else:
        loaded = json.loads(path.read_text(encoding="utf-8"))
        rows = loaded["data"] if isinstance(loaded, dict) and "data" in loaded else loaded
    if not isinstance(rows, list):
        raise ValueError(f"{path} holds no list of clips.")

    def resolve(p: str | None) -> str | None:
        if not p:
            return None
        q = Path(os.path.expanduser(str(p)))
        return str(q if q.is_absolute() else base / q)

    clips = []
    for i, row in enumerate(rows):
        if "video_id" in row and "wav" in row:  # CAV-MAE datafile
            pattern = str(Path(resolve(row.get("video_path")) or base) / "frame_{i}" / f"{row['video_id']}.jpg")
            clips.append(
                AVClip(
                    id=str(row["video_id"]),
                    audio=resolve(row["wav"]),
                    text=_labels_to_text(row.get("labels", ""), names),
                    frame_pattern=pattern,
                )
            )
            continue
        text = row.get("text") or row.get("caption") or ""
        if not text and row.get("label") is not None:
            text = _labels_to_text(row["label"], names)
        if not text and row.get("labels") is not None:
            text = _labels_to_text(row["labels"], names)
        sr = row.get("sampling_rate")
        clips.append(
            AVClip(
                id=str(row.get("id", i)),
                audio=resolve(row.get("audio")),
                video=resolve(row.get("video")),
                text=str(text),
                sampling_rate=int(sr) if sr not in (None, "") else None,
            )
        )
    report = ClipReport(num_listed=len(clips))
    if len({c.id for c in clips}) != len(clips):
        raise ValueError(f"{path} lists the same clip id more than once.")
    if check_files:
        for c in clips:
            if not c.audio or not Path(c.audio).exists():
                report.missing_audio.append(c.id)
            if not _has_video(c):
                report.missing_video.append(c.id)
        bad = set(report.missing_audio) | set(report.missing_video)
        clips = [c for c in clips if c.id not in bad]
    logger.info("read_clip_list(%s): %s", path, report.summary())
    return clips, report


def _has_video(clip: AVClip) -> bool:
    if clip.frame_pattern:
        return Path(clip.frame_pattern.format(i=0)).exists()
    return bool(clip.video) and Path(clip.video).exists()


def select_pairs(
    clips: Sequence[AVClip], num_pairs: int = NUM_PAIRS, seed: int = 0, ids: Sequence[str] | str | os.PathLike | None = None
) -> list[AVClip]:
    """The test pairs: the clips named in ``ids`` (a list, or a file with one id per line), in that order; else
    ``num_pairs`` clips drawn without replacement with ``seed`` (kept in list order), or all when there are fewer."""
    if ids is not None:
        if isinstance(ids, (str, os.PathLike)):
            ids = [line.strip() for line in Path(ids).read_text(encoding="utf-8").splitlines() if line.strip()]
        by_id = {c.id: c for c in clips}
        missing = [i for i in ids if i not in by_id]
        if missing:
            raise ValueError(f"{len(missing)} requested ids have no usable clip, e.g. {missing[:3]}.")
        return [by_id[i] for i in ids]
    if len(clips) <= num_pairs:
        if len(clips) < num_pairs:
            logger.warning("Only %d usable clips: the benchmark has %d pairs instead of %d.", len(clips), len(clips), num_pairs)
        return list(clips)
    keep = np.sort(np.random.default_rng(derive_seed(seed, "select_pairs")).choice(len(clips), num_pairs, replace=False))
    return [clips[i] for i in keep]


# ------------------------------------------------------------------------------------------------ frames
def _natural_key(name: str) -> list:
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]


def _uniform_indices(total: int, num: int | None) -> np.ndarray:
    if num is None or num >= total:
        return np.arange(total)
    return np.linspace(0, total - 1, num).round().astype(int)


def _fit(img, frame_size: int | None):
    """Resize the short side to ``frame_size`` and centre-crop a square (PIL in, PIL out)."""
    if frame_size is None:
        return img
    from PIL import Image

    w, h = img.size
    scale = frame_size / min(w, h)
    img = img.resize((max(frame_size, round(w * scale)), max(frame_size, round(h * scale))), Image.BICUBIC)
    w, h = img.size
    left, top = (w - frame_size) // 2, (h - frame_size) // 2
    return img.crop((left, top, left + frame_size, top + frame_size))


def _decode_video_file(path: str) -> list:
    try:
        import av
    except ImportError as err:
        raise ImportError(f"Reading video files ({Path(path).suffix}) needs PyAV: pip install 'hf_tta[audio]'.") from err
    with av.open(path) as container:
        return [f.to_image() for f in container.decode(video=0)]


def read_frames(clip: AVClip, num_frames: int | None = None, frame_size: int | None = None) -> list:
    """The clip's frames as RGB PIL images (``num_frames`` sampled uniformly; optional resize + centre crop).

    Frames read from image files without resizing keep their encoded bytes on ``.encoded`` so the clean config
    stores them as they are.
    """
    from PIL import Image

    files: list[Path] | None = None
    if clip.frame_pattern:
        files = []
        while Path(clip.frame_pattern.format(i=len(files))).exists():
            files.append(Path(clip.frame_pattern.format(i=len(files))))
    elif clip.video and Path(clip.video).is_dir():
        files = sorted((p for p in Path(clip.video).iterdir() if p.suffix.lower() in IMAGE_EXTENSIONS), key=lambda p: _natural_key(p.name))
    if files is not None:
        if not files:
            raise ValueError(f"Clip {clip.id!r} has no frame images.")
        frames = []
        for i in _uniform_indices(len(files), num_frames):
            img = Image.open(files[i])
            img.load()
            if frame_size is None and img.mode == "RGB":
                img.encoded = files[i].read_bytes()  # type: ignore[attr-defined]
            frames.append(img.convert("RGB") if img.mode != "RGB" else img)
    elif clip.video and clip.video.lower().endswith(".npy"):
        arr = np.load(clip.video)
        if arr.dtype != np.uint8 or arr.ndim != 4 or arr.shape[-1] != 3:
            raise ValueError(f"{clip.video} must hold a (T, H, W, 3) uint8 array; got {arr.dtype} {arr.shape}.")
        frames = [Image.fromarray(arr[i]) for i in _uniform_indices(len(arr), num_frames)]
    elif clip.video and Path(clip.video).suffix.lower() in VIDEO_FILE_EXTENSIONS:
        decoded = _decode_video_file(clip.video)
        frames = [decoded[i] for i in _uniform_indices(len(decoded), num_frames)]
    else:
        raise ValueError(f"Clip {clip.id!r}: unsupported video {clip.video!r} (a frame folder, a .npy or a video file).")
    return [_fit(f, frame_size) for f in frames]


def frames_to_array(frames: Sequence) -> np.ndarray:
    """PIL frames (or decoded ``datasets`` images) as a ``(T, H, W, 3)`` uint8 array."""
    return np.stack([np.asarray(f.convert("RGB") if f.mode != "RGB" else f) for f in frames])


def read_clip_audio(clip: AVClip, sampling_rate: int) -> np.ndarray:
    path = clip.audio
    if path is None and clip.video and Path(clip.video).suffix.lower() in VIDEO_FILE_EXTENSIONS:
        path = clip.video  # the audio track of the video file
    if path is None:
        raise ValueError(f"Clip {clip.id!r} has no audio.")
    return read_audio(path, sampling_rate=sampling_rate, npy_sampling_rate=clip.sampling_rate)[0]


# ====================================================================================================== corruptions
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
        from ..corruptions.video import VIDEO_REPRESENTATIVES

        self.video_representatives = {**VIDEO_REPRESENTATIVES, **self.video_representatives}
        self.audio_representatives = {**AUDIO_REPRESENTATIVES, **self.audio_representatives}
        if self.num_segments < 1:
            raise ValueError("num_segments must be >= 1.")

    def video_pool_or_default(self) -> tuple[str, ...]:
        from ..corruptions.video import VIDEO_CORRUPTIONS

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
    from ..corruptions.video import corrupt_video

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


# ====================================================================================================== building
def _features(config: str):
    from datasets import Features, Image, List, Value

    if config == "clean":
        return Features(
            {
                "id": Value("string"),
                "video": List(Image()),
                "audio": Value("binary"),
                "sampling_rate": Value("int32"),
                "text": Value("string"),
            }
        )
    common = {"id": Value("string"), "corruptions": List(Value("string")), "segments": List(List(Value("int32")))}
    if config.startswith("video"):
        return Features({**common, "video": List(Image()), "severity": List(Value("int32"))})
    return Features({**common, "audio": Value("binary"), "sampling_rate": Value("int32"), "snr_db": List(Value("float32"))})


def _frame_cell(frame) -> dict:
    encoded = getattr(frame, "encoded", None)
    if encoded is not None:
        return {"bytes": encoded, "path": None}
    import io

    buf = io.BytesIO()
    frame.save(buf, format="PNG")
    return {"bytes": buf.getvalue(), "path": None}


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
        if config == "clean":
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
        benchmark: ``"audioset-o"``, ``"audioset-d"`` or ``"vggsound"`` (:data:`BENCHMARKS`); picks the configs.
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
    if benchmark not in BENCHMARKS:
        raise ValueError(f"benchmark must be one of {list(BENCHMARKS)}; got {benchmark!r}.")
    configs = tuple(configs or BENCHMARKS[benchmark])
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
            _generate, features=_features(config), gen_kwargs=kwargs, cache_dir=cache_dir, split="test"
        )
    return out


# ====================================================================================================== cards & hub
def dataset_card(
    benchmark: str,
    configs: Sequence[str],
    settings: AVCorruptionSettings,
    num_pairs: int,
    sampling_rate: int,
    source_description: str = "",
    license: str = "other",
) -> Any:
    """A dataset card describing the protocol, the configs and exactly how each was corrupted."""
    from huggingface_hub import DatasetCard, DatasetCardData

    from ..corruptions.video import VIDEO_CORRUPTION_CATEGORIES

    title = {"audioset-o": "AudioSet-O", "audioset-d": "AudioSet-D", "vggsound": "VGGSound (AudioSet2VGG)"}[benchmark]
    rows = []
    for c in configs:
        if c == "clean":
            rows.append("| `clean` | - | the clean pairs: galleries (and queries of the real-world shift) |")
        elif c in AUDIOSET_O_CONFIGS:
            modality, cats = AUDIOSET_O_CONFIGS[c]
            subtypes = " + ".join(settings.corruptions_needed(c))
            rows.append(f"| `{c}` | {modality} | {len(cats)} equal segments, in order: {subtypes} |")
        else:
            pool = ", ".join(settings.corruptions_needed(c))
            rows.append(f"| `{c}` | {c.split('_')[0]} | {settings.num_segments} equal segments, each drawn from: {pool} |")
    video_cats = sorted(set(VIDEO_CORRUPTION_CATEGORIES.values()))
    text = f"""# {title}

Query-shift benchmark for video-audio (and audio/video-text) retrieval, built with
`hf_tta.data.builders.audioset` (the hf_tta library) following REST (Li, Yang, Peng, "Toward Robust and
Harmonious Adaptation for Cross-modal Retrieval", §3, Table IV).

{source_description}

## Protocol

- {num_pairs} video-audio pairs (1-to-1), split `test`. Row *i* of every config is the same clip (`id`).
- The gallery is always clean (config `clean`); only queries are corrupted.
- Directions: video->audio (AR), audio->video (VR), and with the `text` column audio<->text and video<->text
  (texts are the clip's caption or label names; equal texts form one gallery item).
- R@1 is REST's metric.

| config | corrupted modality | construction |
|---|---|---|
{chr(10).join(rows)}

## Corruptions

- Video ({', '.join(video_cats)}): ImageNet-C functions (`imagecorruptions-imaug`) applied frame by frame at
  severity {settings.video_severity}; frame *t* of a segment is seeded from the segment's seed.
- Audio: noise mixed into the waveform at {settings.audio_snr_db:g} dB SNR relative to the whole clean clip's power;
  Gaussian noise, or a user-provided recording of crowd / traffic / rain / thunder / wind noise looped from a seeded
  offset.
- Multi-distribution shift (-O): *k* corruptions -> *k* equal temporal segments. Diverse shift (-D): each segment
  draws its corruption uniformly. Seed: {settings.seed}. Columns `corruptions`, `severity`/`snr_db` and `segments`
  ([start, end) in frames or samples) record what each query got.
- Representatives: video {settings.video_representatives}; audio {settings.audio_representatives}.

## Storage

- `video`: a list of frames (`Image`); `audio`: mono 32-bit float WAV bytes (`binary`) at {sampling_rate} Hz,
  decoded with `hf_tta.data.corruptions.audio.decode_wav` (or cast to `datasets.Audio()` where torchcodec works).
- Load queries, gallery and relevance with `hf_tta.data.builders.audioset.load_av_retrieval(repo_id, config, direction)`.

## License

The clips come from YouTube (AudioSet / VGGSound); their rights belong to their owners. Check that you may
redistribute them before making this dataset public.
"""
    data = DatasetCardData(license=license, task_categories=["audio-classification", "video-classification"],
                           tags=["hf_tta", "test-time-adaptation", "query-shift", "cross-modal-retrieval", benchmark],
                           pretty_name=title)
    return DatasetCard(f"---\n{data.to_yaml()}\n---\n{text}")


def push_av_benchmark(
    built: Mapping[str, Any],
    repo_id: str,
    card: Any = None,
    *,
    private: bool | None = True,
    token: str | None = None,
    api=None,
) -> list[str]:
    """Push every config of ``built`` (config -> ``Dataset``, e.g. from :func:`build_av_benchmark`) to ``repo_id``
    (split ``test``, ``clean`` the default config), then the card (:func:`dataset_card`), keeping the ``configs``
    and ``dataset_info`` metadata that ``push_to_hub`` wrote. Private by default: see the card's licence note.

    Args:
        api: an ``HfApi``-like object for the card (tests pass a fake Hub).

    Returns:
        The configs pushed.
    """
    from huggingface_hub import CommitOperationAdd, DatasetCard, DatasetCardData, HfApi

    from .hub import read_remote_card

    configs = sorted(built, key=lambda c: (c != "clean", c))
    for config in configs:
        built[config].push_to_hub(
            repo_id, config_name=config, split="test", set_default=True if config == "clean" else None,
            private=private, token=token, commit_message=f"Add config {config}",
        )
    if card is not None:
        api = api or HfApi(token=token)
        old = read_remote_card(repo_id, api)
        data = old.data.to_dict() if old is not None else {}
        data.update({k: v for k, v in card.data.to_dict().items() if v is not None})
        final = DatasetCard(f"---\n{DatasetCardData(**data).to_yaml()}\n---\n\n{card.text.lstrip()}")
        api.create_commit(
            repo_id,
            operations=[CommitOperationAdd(path_in_repo="README.md", path_or_fileobj=str(final).encode("utf-8"))],
            commit_message="Update dataset card",
            repo_type="dataset",
        )
    return configs


# ====================================================================================================== loading
class LazyItems(Sequence):
    """A column decoded on access (``items[i]``, ``items[a:b]``), so 3,000 videos are never all in memory."""

    def __init__(self, dataset, column: str, decode: Callable[[Any], Any]):
        self._ds, self.decode = dataset.select_columns([column]), decode
        self.column = column

    def __len__(self) -> int:
        return len(self._ds)

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self.decode(v) for v in self._ds[index][self.column]]
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError(index)
        return self.decode(self._ds[int(index)][self.column])


@dataclass
class AVRetrievalSplit(RetrievalSplit):
    """Queries, gallery and relevance of one direction of one audio-video config: the image benchmarks'
    :class:`~hf_tta.data.builders.RetrievalSplit` (``query_inputs``, ``gallery_inputs``, ``evaluate``) with
    ``task = "<query>-><gallery>"``.

    ``queries``/``gallery`` hold raw items, decoded lazily: texts (``str``), waveforms (1-D float32 at
    ``sampling_rate``) or videos (``(T, H, W, 3)`` uint8). ``relevant[i]`` lists the gallery positions relevant to
    query ``i``; ``query_corruptions[i]`` the corruption of each segment of query ``i``.
    """

    sampling_rate: int | None = None

    @property
    def query_modality(self) -> str:
        return self.task.split("->")[0]

    @property
    def gallery_modality(self) -> str:
        return self.task.split("->")[1]

    def query_inputs(self, processor, batch_size: int = 64, **processor_kwargs) -> Iterator[dict]:
        """Query batches through a processor (see :func:`to_model_inputs`), for ``TTAWrapper.adapt_step``."""
        for batch in self.query_batches(batch_size):
            yield to_model_inputs(batch, self.query_modality, processor, self.sampling_rate, **processor_kwargs)

    def gallery_inputs(self, processor, batch_size: int = 256, **processor_kwargs) -> list[dict]:
        """Gallery batches through a processor, for ``TTAWrapper.encode_gallery``."""
        return [
            to_model_inputs(b, self.gallery_modality, processor, self.sampling_rate, **processor_kwargs)
            for b in self.gallery_batches(batch_size)
        ]


def parse_direction(direction: str | Sequence[str]) -> tuple[str, str]:
    """``"video->audio"``, ``"video2audio"``, ``"video_to_audio"`` or ``("video", "audio")``."""
    if isinstance(direction, str):
        parts = re.split(r"\s*(?:->|2|_to_|→)\s*", direction.strip().lower())
    else:
        parts = list(direction)
    pair = tuple(parts)
    if pair not in DIRECTIONS:
        raise ValueError(f"Unknown direction {direction!r}; choose from {[f'{q}->{g}' for q, g in DIRECTIONS]}.")
    return pair  # type: ignore[return-value]


def save_av_benchmark(built: Mapping[str, Any], directory: str | os.PathLike) -> None:
    """``save_to_disk`` every config into ``directory/<config>`` (readable by :func:`load_av_retrieval`)."""
    for config, ds in built.items():
        ds.save_to_disk(str(Path(directory) / config))


def _load_config(source, config: str, split: str):
    if isinstance(source, Mapping):
        if config not in source:
            raise KeyError(f"Config {config!r} is not in the given mapping (has {sorted(source)}).")
        return source[config]
    from datasets import load_dataset, load_from_disk

    path = Path(str(source))
    if path.is_dir() and (path / config / "dataset_info.json").is_file():
        return load_from_disk(str(path / config))
    return load_dataset(str(source), config, split=split)


def _decode_audio(sampling_rate: int | None) -> Callable[[bytes], np.ndarray]:
    def decode(blob: bytes) -> np.ndarray:
        wav, rate = decode_wav(blob)
        return wav if sampling_rate is None or rate == sampling_rate else resample(wav, rate, sampling_rate)

    return decode


def load_av_retrieval(
    source: str | os.PathLike | Mapping[str, Any],
    config: str,
    direction: str | Sequence[str],
    *,
    sampling_rate: int | None = None,
    split: str = "test",
) -> AVRetrievalSplit:
    """Queries, gallery and relevance for one direction of one config.

    Args:
        source: a Hub repo id, a :func:`save_av_benchmark` folder, or the mapping :func:`build_av_benchmark` returns.
        config: ``"clean"`` or a corruption config. A corruption config corrupts one modality, which must be the
            direction's query modality (the gallery always comes from ``clean``).
        direction: one of :data:`DIRECTIONS` (``"video->audio"``, ``"text->audio"``, ...). Text sides hold the
            distinct texts; a text query is relevant to every clip with that text.
        sampling_rate: resample audio to this rate (CLAP: 48000); default the stored rate.
    """
    query, gallery = parse_direction(direction)
    corrupted = None if config == "clean" else config.split("_", 1)[0]
    if corrupted is not None and corrupted != query:
        raise ValueError(
            f"Config {config!r} corrupts {corrupted} queries; for {query}->{gallery} use 'clean' or one of the "
            f"{query}_* configs (the gallery is never corrupted)."
        )
    clean = _load_config(source, "clean", split)
    qsource = clean if config == "clean" else _load_config(source, config, split)
    meta = clean.select_columns(["id", "text", "sampling_rate"])[:]
    ids = list(meta["id"])
    if list(qsource.select_columns(["id"])[:]["id"]) != ids:
        raise ValueError(f"Config {config!r} and 'clean' list different clips: build them together.")
    rate = sampling_rate or (int(meta["sampling_rate"][0]) if ids else None)
    decoders = {"audio": _decode_audio(rate), "video": frames_to_array}
    positions = list(range(len(ids)))
    relevant = [[i] for i in positions]
    query_items: Sequence = LazyItems(qsource, query, decoders[query]) if query != "text" else []
    gallery_items: Sequence = LazyItems(clean, gallery, decoders[gallery]) if gallery != "text" else []
    query_ids, gallery_ids = ids, ids
    if "text" in (query, gallery):
        texts = list(meta["text"])
        if not all(texts):
            raise ValueError("Some clips have no text: text directions need a caption or label names for every clip.")
        unique = list(dict.fromkeys(texts))
        if gallery == "text":
            position = {t: k for k, t in enumerate(unique)}
            gallery_items, gallery_ids, relevant = unique, unique, [[position[t]] for t in texts]
        else:
            members: dict[str, list[int]] = {}
            for i, t in enumerate(texts):
                members.setdefault(t, []).append(i)
            query_items, query_ids, relevant = unique, unique, [members[t] for t in unique]
    corruptions = list(qsource.select_columns(["corruptions"])[:]["corruptions"]) if config != "clean" else []
    return AVRetrievalSplit(
        task=f"{query}->{gallery}",
        config=config,
        queries=query_items,
        gallery=gallery_items,
        relevant=relevant,
        query_ids=list(query_ids),
        gallery_ids=list(gallery_ids),
        query_corruptions=corruptions,
        sampling_rate=rate if "audio" in (query, gallery) else None,
    )


def to_model_inputs(items: Sequence, modality: str, processor, sampling_rate: int | None = None, **kwargs) -> dict:
    """Model inputs for a slice of raw items, with a Hugging Face processor.

    - text: ``processor(text=items, padding=True, truncation=True)``;
    - audio: a feature extractor (``ClapFeatureExtractor``) or a processor taking ``audio=`` (``ClapProcessor``);
    - video: a processor taking ``videos=`` (``XCLIPProcessor``) gives ``(B, T, C, H, W)``; an image processor
      (``CLIPImageProcessor``, for :class:`~hf_tta.models.CLIPVideoAdapter`) is applied to all frames, and clips with
      fewer frames are padded by repeating their last frame, with ``frame_mask`` marking the real ones.
    """
    items = list(items)
    if modality == "text":
        return dict(processor(text=items, return_tensors="pt", **{"padding": True, "truncation": True, **kwargs}))
    if modality == "audio":
        from transformers.feature_extraction_utils import FeatureExtractionMixin

        if isinstance(processor, FeatureExtractionMixin):
            return dict(processor(items, sampling_rate=sampling_rate, return_tensors="pt", **kwargs))
        return dict(processor(audio=items, sampling_rate=sampling_rate, return_tensors="pt", **kwargs))
    if modality != "video":
        raise ValueError(f"Unknown modality {modality!r}.")
    from transformers.image_processing_utils import BaseImageProcessor

    is_image_processor = isinstance(processor, BaseImageProcessor) and "videomae" not in type(processor).__name__.lower()
    if not is_image_processor:
        try:
            return dict(processor(videos=[list(v) for v in items], return_tensors="pt", **kwargs))
        except TypeError:
            return dict(processor([list(v) for v in items], return_tensors="pt", **kwargs))
    import torch

    lengths = [len(v) for v in items]
    t = max(lengths)
    frames = [f for v in items for f in list(v) + [v[-1]] * (t - len(v))]
    pixel_values = processor(images=frames, return_tensors="pt", **kwargs)["pixel_values"]
    out = {"pixel_values": pixel_values.view(len(items), t, *pixel_values.shape[1:])}
    if min(lengths) < t:
        out["frame_mask"] = (torch.arange(t)[None, :] < torch.tensor(lengths)[:, None]).long()
    return out


__all__ = [
    "AUDIOSET_D_CONFIGS",
    "AUDIOSET_O_CONFIGS",
    "AVClip",
    "AVCorruptionSettings",
    "AVRetrievalSplit",
    "BENCHMARKS",
    "ClipReport",
    "DIRECTIONS",
    "LazyItems",
    "MissingRecordingsError",
    "NUM_PAIRS",
    "build_av_benchmark",
    "corrupt_audio_query",
    "corrupt_video_query",
    "dataset_card",
    "load_av_retrieval",
    "missing_recordings",
    "parse_direction",
    "push_av_benchmark",
    "read_clip_list",
    "read_frames",
    "read_label_names",
    "save_av_benchmark",
    "select_pairs",
    "to_model_inputs",
]
