"""Reading the user's local audio-video clips for the AudioSet-O / AudioSet-D / VGGSound builders.

**Clip lists** (:func:`read_clip_list`): a CAV-MAE datafile (``{"data": [{"video_id", "wav", "video_path",
"labels"}]}``, frames at ``video_path/frame_{i}/video_id.jpg``, labels mapped to names with AudioSet's
``class_labels_indices.csv``) or a manifest (``.csv``, ``.jsonl`` or a ``.json`` list) with columns ``id``,
``audio``, ``video`` and ``text`` (or ``caption``/``label``). Audio: ``.wav`` and ``.npy`` with no dependency,
``.flac``/``.mp3``/``.ogg``/``.m4a`` and video files' audio tracks with PyAV (``pip install 'hf_tta[audio]'``).
Video: a folder of frame images, a ``(T, H, W, 3)`` uint8 ``.npy``, or with PyAV a video file (``.mp4``, ``.mkv``,
``.webm``, ``.avi``, ...). :func:`select_pairs` draws the test pairs.
"""

from __future__ import annotations

import csv
import json
import logging
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from ..corruptions.audio_io import read_audio
from ..corruptions.base import derive_seed
from .specs import NUM_PAIRS

logger = logging.getLogger(__name__)

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".webp")
VIDEO_FILE_EXTENSIONS = (".mp4", ".mkv", ".webm", ".avi", ".mov", ".m4v")


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
            if not _has_audio(c):
                report.missing_audio.append(c.id)
            if not _has_video(c):
                report.missing_video.append(c.id)
        bad = set(report.missing_audio) | set(report.missing_video)
        clips = [c for c in clips if c.id not in bad]
    logger.info("read_clip_list(%s): %s", path, report.summary())
    return clips, report


def _has_audio(clip: AVClip) -> bool:
    """An audio file, or (as :func:`read_clip_audio` reads it) a video file's own audio track."""
    if clip.audio:
        return Path(clip.audio).exists()
    return bool(clip.video) and Path(clip.video).suffix.lower() in VIDEO_FILE_EXTENSIONS and Path(clip.video).exists()


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
    """The clip's mono waveform at ``sampling_rate`` (from its audio file, or the audio track of its video file)."""
    path = clip.audio
    if path is None and clip.video and Path(clip.video).suffix.lower() in VIDEO_FILE_EXTENSIONS:
        path = clip.video  # the audio track of the video file
    if path is None:
        raise ValueError(f"Clip {clip.id!r} has no audio.")
    return read_audio(path, sampling_rate=sampling_rate, npy_sampling_rate=clip.sampling_rate)[0]


__all__ = [
    "AVClip",
    "ClipReport",
    "IMAGE_EXTENSIONS",
    "VIDEO_FILE_EXTENSIONS",
    "frames_to_array",
    "read_clip_audio",
    "read_clip_list",
    "read_frames",
    "read_label_names",
    "select_pairs",
]
