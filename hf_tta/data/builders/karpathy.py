"""The Karpathy split files (``dataset_coco.json``, ``dataset_flickr30k.json``) and the user's local images.

Layout of a split file (Karpathy & Fei-Fei 2015)::

    {"images": [{"filename": "COCO_val2014_000000391895.jpg", "filepath": "val2014", "split": "test",
                 "imgid": 0, "cocoid": 391895, "sentids": [0, 1, ...],
                 "sentences": [{"raw": "A man ...", "tokens": [...], "sentid": 0, "imgid": 0}, ...]}, ...],
     "dataset": "coco"}

Flickr30K entries have no ``filepath``. Images are looked up as ``images_root/filepath/filename`` and then
``images_root/filename``.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterable, Sequence

from ...logging import tqdm


@dataclass
class KarpathyImage:
    """One image of a Karpathy split with its captions; ids are the Karpathy ``imgid`` and ``sentid`` values."""

    image_id: int
    source_id: str
    filename: str
    filepath: str
    split: str
    captions: list[str]
    caption_ids: list[int]
    path: str | None = None
    #: Items of one group are relevant to each other's captions (a product id, a person id); ``None``: the image alone.
    group: str | None = None
    #: The item's domain (a Nocaps domain, a Fashion-Gen category), recorded in a ``domain`` column.
    domain: str | None = None

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class SourceReport:
    """What was found on disk: nothing is dropped without being counted here."""

    split: str
    num_images: int = 0
    num_captions: int = 0
    missing: list[str] = field(default_factory=list)
    unreadable: list[str] = field(default_factory=list)
    truncated_captions: int = 0
    images_with_extra_captions: int = 0
    images_with_fewer_captions: int = 0
    expected_images: int | None = None

    @property
    def problems(self) -> int:
        return len(self.missing) + len(self.unreadable)

    def summary(self) -> str:
        parts = [f"{self.num_images} images, {self.num_captions} captions in split {self.split!r}"]
        if self.expected_images is not None and self.num_images != self.expected_images:
            parts.append(f"(the benchmark has {self.expected_images} images)")
        if self.missing:
            parts.append(f"{len(self.missing)} missing image files (e.g. {self.missing[:3]})")
        if self.unreadable:
            parts.append(f"{len(self.unreadable)} unreadable/corrupt image files (e.g. {self.unreadable[:3]})")
        if self.truncated_captions:
            parts.append(
                f"{self.truncated_captions} captions beyond the first per image left out "
                f"({self.images_with_extra_captions} images had more)"
            )
        if self.images_with_fewer_captions:
            parts.append(f"{self.images_with_fewer_captions} images have fewer captions than asked")
        return "; ".join(parts)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["problems"] = self.problems
        return d


def read_karpathy_json(path: str | os.PathLike) -> dict:
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    if not isinstance(data, dict) or not isinstance(data.get("images"), list):
        raise ValueError(f"{path} is not a Karpathy split file: expected a JSON object with an 'images' list.")
    return data


def karpathy_images(
    data: dict | str | os.PathLike,
    split: str | Sequence[str] = "test",
    captions_per_image: int | None = 5,
    report: SourceReport | None = None,
) -> list[KarpathyImage]:
    """The images of ``split`` (in file order) with their raw captions.

    Args:
        captions_per_image: keep the first N captions of each image (COCO has a few images with 6-7; the
            benchmark uses 5 per image). ``None`` keeps all. What is left out is counted in ``report``.
    """
    if not isinstance(data, dict):
        data = read_karpathy_json(data)
    splits = {split} if isinstance(split, str) else set(split)
    out = []
    for pos, entry in enumerate(data["images"]):
        if entry.get("split") not in splits:
            continue
        try:
            filename = entry["filename"]
            sentences = entry["sentences"]
        except KeyError as err:
            raise ValueError(f"Karpathy entry #{pos} lacks {err}: {str(entry)[:200]}") from err
        if not sentences:  # it would be a query with no relevant caption, which no metric can score
            raise ValueError(f"Karpathy entry #{pos} ({filename}) has no sentences: every image needs a caption; remove it from the split file.")
        image_id = int(entry.get("imgid", pos))
        raws = [str(s.get("raw", " ".join(s.get("tokens", [])))).strip() for s in sentences]
        ids = [int(s.get("sentid", image_id * 1000 + k)) for k, s in enumerate(sentences)]
        if captions_per_image is not None:
            if report is not None:
                if len(raws) > captions_per_image:
                    report.truncated_captions += len(raws) - captions_per_image
                    report.images_with_extra_captions += 1
                elif len(raws) < captions_per_image:
                    report.images_with_fewer_captions += 1
            raws, ids = raws[:captions_per_image], ids[:captions_per_image]
        source_id = str(entry["cocoid"]) if "cocoid" in entry else Path(filename).stem
        out.append(
            KarpathyImage(
                image_id=image_id,
                source_id=source_id,
                filename=filename,
                filepath=str(entry.get("filepath", "")),
                split=str(entry.get("split")),
                captions=raws,
                caption_ids=ids,
            )
        )
    ids = [im.image_id for im in out]
    if len(set(ids)) != len(ids):
        raise ValueError("The split file has duplicate 'imgid' values: ids would not be stable.")
    return out


def resolve_image_path(images_root: str | os.PathLike, image: KarpathyImage) -> Path | None:
    root = Path(images_root)
    candidates = [root / image.filepath / image.filename] if image.filepath else []
    candidates.append(root / image.filename)
    for c in candidates:
        if c.is_file():
            return c
    return None


def _readable(path: Path) -> bool:
    from PIL import Image

    try:
        with Image.open(path) as im:
            im.load()  # decodes fully: catches truncated files, not only bad headers
        return True
    except Exception:
        return False


#: Whether an image file decodes fully (public name for the other builders).
is_readable = _readable


def scan_sources(
    images: Iterable[KarpathyImage],
    images_root: str | os.PathLike,
    report: SourceReport,
    check_decode: bool = True,
    show_progress: bool = True,
) -> list[KarpathyImage]:
    """Resolve every image file; count missing and unreadable ones in ``report``. Returns the usable images."""
    images = list(images)
    ok = []
    for im in tqdm(images, desc="Checking source images", disable=not show_progress):
        path = resolve_image_path(images_root, im)
        if path is None:
            report.missing.append(os.path.join(im.filepath, im.filename))
            continue
        if check_decode and not _readable(path):
            report.unreadable.append(str(path))
            continue
        im.path = str(path)
        ok.append(im)
    report.num_images = len(ok)
    report.num_captions = sum(len(im.captions) for im in ok)
    return ok
