"""Any image-text set a user has as a query-shift benchmark: the COCO-C layout, corruptions, dataset card and Hub
publishing, built from

- a JSONL file, one object per row: ``{"image": "imgs/001.jpg", "caption": "a red dress", "group": "p17"}``
  (``image`` may also be named ``image_path``, ``file_name``, ``file`` or ``path``; ``caption`` may be ``text``;
  ``group`` is optional);
- a CSV file with a header naming the same columns;
- a folder of images (``.jpg``, ``.jpeg``, ``.png``, ``.webp``, ``.bmp``, searched recursively) each with a sidecar
  ``<stem>.txt`` holding its captions, one per non-empty line.

Rows naming the same image are one gallery item with several captions (RSICD, RSITMD: 5 per image). Items sharing a
``group`` (a product id, a person id) are relevant to each other's captions, as Fashion-Gen and the ReID sets are
scored. Image paths are relative to ``images_root`` (default: the folder of the pairs file). One command::

    hf-tta build --pairs pairs.jsonl --output-dir build/my-set --name my-set
    hf-tta run --model openai/clip-vit-base-patch16 --dataset build/my-set --direction both
"""

from __future__ import annotations

import csv
import json
import logging
import os
from pathlib import Path
from typing import Any, Iterable

from .benchmark import BenchmarkBuilder
from .karpathy import KarpathyImage, SourceReport
from .specs import BenchmarkSpec

logger = logging.getLogger(__name__)

IMAGE_KEYS = ("image", "image_path", "file_name", "file", "path")
CAPTION_KEYS = ("caption", "text")
IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".webp", ".bmp")


def _pick(row: dict, keys: tuple[str, ...], where: str, what: str) -> str:
    for k in keys:
        if k in row and row[k] not in (None, ""):
            return str(row[k])
    raise ValueError(f"{where}: no {what} (give one of the keys {list(keys)}); fix that row or remove it.")


def _rows_jsonl(path: Path) -> Iterable[tuple[str, dict]]:
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}:{n}: not a JSON object ({err.msg}); write one JSON object per line.") from None
            if not isinstance(row, dict):
                raise ValueError(f"{path}:{n}: not a JSON object; write one object per line like {{\"image\": ..., \"caption\": ...}}.")
            yield f"{path}:{n}", row


def _rows_csv(path: Path) -> Iterable[tuple[str, dict]]:
    with open(path, encoding="utf-8", newline="") as f:
        reader = csv.DictReader(f)
        header = reader.fieldnames or []
        if not any(k in header for k in IMAGE_KEYS) or not any(k in header for k in CAPTION_KEYS):
            raise ValueError(f"{path}: the header {header} lacks an image column ({'/'.join(IMAGE_KEYS)}) or a caption "
                             f"column ({'/'.join(CAPTION_KEYS)}); add a header line like 'image,caption,group'.")
        for n, row in enumerate(reader, 2):
            yield f"{path}:{n}", row


def _rows_folder(folder: Path) -> Iterable[tuple[str, dict]]:
    images = sorted(p for p in folder.rglob("*") if p.suffix.lower() in IMAGE_SUFFIXES and p.is_file())
    if not images:
        raise ValueError(f"{folder} has no images ({', '.join(IMAGE_SUFFIXES)}); pass a folder of images with .txt captions, or a .jsonl/.csv file.")
    for img in images:
        side = img.with_suffix(".txt")
        if not side.is_file():
            raise ValueError(f"{img}: no caption file {side.name}; write its captions there (one per line) or move the image out.")
        lines = [ln.strip() for ln in side.read_text(encoding="utf-8").splitlines() if ln.strip()]
        if not lines:
            raise ValueError(f"{side}: empty caption file; write at least one caption line.")
        for cap in lines:
            yield str(side), {"image": str(img.relative_to(folder)), "caption": cap}


def read_pairs(source: str | os.PathLike) -> list[KarpathyImage]:
    """The images of a pairs file or folder (in order of first appearance) with their captions and groups.

    ``image_id`` is the image's position, ``caption_ids`` count the captions in file order, ``source_id`` and
    ``filename`` are the image path as written. A row without an image or caption, an image with two groups, or a
    file with groups on some rows only is a ``ValueError`` naming the file and line.
    """
    source = Path(source)
    if source.is_dir():
        rows = _rows_folder(source)
    elif source.suffix.lower() in (".jsonl", ".json"):
        rows = _rows_jsonl(source)
    elif source.suffix.lower() in (".csv", ".tsv"):
        rows = _rows_csv(source)
    elif not source.exists():
        raise FileNotFoundError(f"{source}: no such file or folder; pass a .jsonl or .csv of (image, caption[, group]) rows or a folder of images with .txt captions.")
    else:
        raise ValueError(f"{source}: unknown pairs format {source.suffix!r}; use .jsonl, .csv or a folder of images with .txt captions.")
    items: dict[str, KarpathyImage] = {}
    has_group: set[bool] = set()
    n_caps = 0
    for where, row in rows:
        image = _pick(row, IMAGE_KEYS, where, "image path")
        caption = _pick(row, CAPTION_KEYS, where, "caption").strip()
        group = row.get("group")
        group = None if group in (None, "") else str(group)
        has_group.add(group is not None)
        if len(has_group) > 1:
            raise ValueError(f"{where}: some rows have a 'group' and others not; give every row a group or none.")
        item = items.get(image)
        if item is None:
            item = items[image] = KarpathyImage(len(items), image, image, "", "test", [], [], group=group)
        elif item.group != group:
            raise ValueError(f"{where}: image {image} is in group {item.group!r} on an earlier row and {group!r} here; one image has one group.")
        item.captions.append(caption)
        item.caption_ids.append(n_caps)
        n_caps += 1
    if not items:
        raise ValueError(f"{source}: no (image, caption) rows.")
    return list(items.values())


def pairs_spec(
    name: str,
    pretty_name: str | None = None,
    license_id: str = "other",
    image_license: str = "As the source images' licence (state it before publishing).",
    annotation_license: str = "As the source captions' licence (state it before publishing).",
    source_url: str = "",
    source_name: str | None = None,
    baseline_tau: float = 0.01,
) -> BenchmarkSpec:
    """The spec (card fields) of a user's set; state the licences before publishing it."""
    return BenchmarkSpec(
        name=name,
        pretty_name=pretty_name or f"{name} (query-shift image-text retrieval)",
        source_name=source_name or f"the user's image-text pairs '{name}'",
        split_file="",
        expected_images=0,
        expected_captions=0,
        image_license=image_license,
        annotation_license=annotation_license,
        license_id=license_id,
        source_url=source_url,
        baseline_tau=baseline_tau,
        ids_note="Ids are stable: `image_id` is the image's position in the pairs file (first appearance), `caption_ids` "
        "count the captions in file order, `source_id` and `filename` are the image path as written; `group` (when "
        "present) makes items of one group relevant to each other's captions.",
        split_license="Pairs file: written by the user.",
    )


class RecordsBuilder(BenchmarkBuilder):
    """A :class:`BenchmarkBuilder` whose images and captions come from a reader (``read(report)`` returns the
    :class:`~.karpathy.KarpathyImage` records) instead of a Karpathy split file; the spec is recorded in
    ``build_info.json`` so that :func:`~.hub.push_benchmark` and :func:`~hf_tta.data.builders.load_retrieval_split`
    need nothing else. ``source_params`` (what the reader read: files, domain, ...) joins the build parameters."""

    def __init__(self, spec: BenchmarkSpec, read, source: str | os.PathLike, images_root, output_dir, *,
                 source_params: dict[str, Any] | None = None, **kwargs):
        kwargs.setdefault("captions_per_image", None)
        super().__init__(spec, source, images_root, output_dir, **kwargs)
        self._read = read
        self.source_params = dict(source_params or {})

    def _source_images(self, report: SourceReport) -> list[KarpathyImage]:
        images = self._read(report)
        if self.captions_per_image is not None:
            for im in images:
                extra = len(im.captions) - self.captions_per_image
                if extra > 0:
                    report.truncated_captions += extra
                    report.images_with_extra_captions += 1
                    im.captions, im.caption_ids = im.captions[: self.captions_per_image], im.caption_ids[: self.captions_per_image]
        return images

    def _params(self) -> dict:
        return {**super()._params(), "spec": self.spec.to_dict(), "source": self.source_params}


def pairs_builder(pairs: str | os.PathLike, output_dir: str | os.PathLike, *, name: str | None = None,
                  images_root: str | os.PathLike | None = None, spec: BenchmarkSpec | None = None, **kwargs) -> RecordsBuilder:
    """A builder of a pairs file or folder (see the module docstring); ``kwargs`` go to :class:`BenchmarkBuilder`
    (``seed``, ``on_missing``, ``limit``, pools, text resources)."""
    pairs = Path(pairs)
    root = Path(images_root) if images_root is not None else (pairs if pairs.is_dir() else pairs.parent)
    spec = spec or pairs_spec(name or (pairs.stem if pairs.is_file() else pairs.name))

    def read(report: SourceReport) -> list[KarpathyImage]:
        return read_pairs(pairs)

    return RecordsBuilder(spec, read, pairs, root, output_dir, source_params={"pairs": pairs.name}, **kwargs)


__all__ = ["RecordsBuilder", "pairs_builder", "pairs_spec", "read_pairs"]
