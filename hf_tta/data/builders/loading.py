"""Load a built or published benchmark config as retrieval queries + gallery + relevance, ready for ``TTAWrapper``.

Example (with a CLIP processor and a ``TTAWrapper`` ``tta``)::

    split = load_retrieval_split("me/coco-c", "image-gaussian_noise-5")       # image→text
    gallery = tta.encode_gallery(split.gallery_inputs(processor, batch_size=256))
    scores = tta.adapt_stream(list(split.query_inputs(processor, batch_size=64)), gallery)
    print(split.evaluate(scores))                                              # R@1/5/10, medr, mAP
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence

from .benchmark import CLEAN, SPLIT, parse_config_name


class LazyImages(Sequence):
    """The ``image`` column of a dataset, decoded (as RGB PIL images) only when indexed."""

    def __init__(self, dataset):
        self._ds = dataset.select_columns(["image"])

    def __len__(self) -> int:
        return len(self._ds)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [im.convert("RGB") for im in self._ds[i]["image"]]
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(i)
        return self._ds[int(i)]["image"].convert("RGB")


def _call_processor(processor, batch: list, modality: str, **kwargs) -> dict:
    if modality == "image":
        out = processor(images=batch, return_tensors="pt", **kwargs)
    else:
        out = processor(text=batch, return_tensors="pt", **{"padding": True, "truncation": True, **kwargs})
    return dict(out)


@dataclass
class RetrievalSplit:
    """Queries, gallery and the relevance lists of one benchmark config.

    ``task`` is ``"i2t"`` (image queries, caption gallery) or ``"t2i"`` (caption queries, image gallery).
    ``relevant[i]`` lists the gallery positions relevant to query ``i`` (5 captions per image for i2t, the image
    of the caption for t2i): pass it to :func:`hf_tta.metrics.retrieval_metrics`.
    """

    task: str
    config: str
    queries: Sequence
    gallery: Sequence
    relevant: list[list[int]]
    query_ids: list[int]
    gallery_ids: list[int]
    query_corruptions: list[tuple[str, int]] = field(default_factory=list)

    @property
    def query_modality(self) -> str:
        return "image" if self.task == "i2t" else "text"

    @property
    def gallery_modality(self) -> str:
        return "text" if self.task == "i2t" else "image"

    def __len__(self) -> int:
        return len(self.queries)

    @staticmethod
    def _batches(items: Sequence, batch_size: int) -> Iterator[list]:
        for start in range(0, len(items), batch_size):
            yield list(items[start : start + batch_size])

    def query_batches(self, batch_size: int = 64) -> Iterator[list]:
        """Raw query batches (PIL images or strings), in order."""
        return self._batches(self.queries, batch_size)

    def gallery_batches(self, batch_size: int = 256) -> Iterator[list]:
        return self._batches(self.gallery, batch_size)

    def query_inputs(self, processor, batch_size: int = 64, **processor_kwargs) -> Iterator[dict]:
        """Query batches through a Hugging Face processor: dicts of tensors for ``TTAWrapper.adapt_step``."""
        for batch in self.query_batches(batch_size):
            yield _call_processor(processor, batch, self.query_modality, **processor_kwargs)

    def gallery_inputs(self, processor, batch_size: int = 256, **processor_kwargs) -> list[dict]:
        """Gallery batches through a processor: a list of dicts for ``TTAWrapper.encode_gallery``."""
        return [
            _call_processor(processor, b, self.gallery_modality, **processor_kwargs)
            for b in self.gallery_batches(batch_size)
        ]

    def evaluate(self, scores, ks=(1, 5, 10)) -> dict[str, float]:
        """R@K (%), median/mean rank and mAP (%) of a ``(queries, gallery)`` score matrix."""
        from ...metrics import retrieval_metrics

        return retrieval_metrics(scores, self.relevant, ks=ks)


def load_config(source: Any, config: str, split: str = SPLIT, **load_kwargs):
    """One config as a ``Dataset`` from a builder output folder, a local Hub-layout folder, a Hub repo id, a
    :class:`~hf_tta.data.builders.BenchmarkBuilder` or a mapping ``{config: Dataset | DatasetDict}``."""
    from datasets import DatasetDict, load_dataset, load_from_disk

    parse_config_name(config)
    if hasattr(source, "load") and hasattr(source, "config_dir"):  # a BenchmarkBuilder
        return source.load(config)
    if isinstance(source, Mapping):
        if config not in source:
            raise KeyError(f"Config {config!r} is not in the given mapping (has {sorted(source)[:8]}...).")
        ds = source[config]
        return ds[split] if isinstance(ds, DatasetDict) else ds
    if isinstance(source, (str, os.PathLike)) and Path(source).is_dir():
        folder = Path(source)
        if (folder / config / "dataset_info.json").is_file():
            ds = load_from_disk(str(folder / config))
            return ds[split] if isinstance(ds, DatasetDict) else ds
        if (folder / "README.md").is_file():
            return load_dataset(str(folder), config, split=split, **load_kwargs)
        raise FileNotFoundError(f"{folder} has neither a built config {config!r} nor a README.md with configs.")
    return load_dataset(str(source), config, split=split, **load_kwargs)


def load_retrieval_split(
    source: Any,
    config: str,
    task: str | None = None,
    split: str = SPLIT,
    gallery_config: str = CLEAN,
    **load_kwargs,
) -> RetrievalSplit:
    """Queries, gallery and relevance of ``config``.

    Args:
        source: see :func:`load_config`.
        config: ``image-*`` configs give image→text (``task="i2t"``), ``text-*`` configs text→image; ``clean``
            needs ``task``.
        gallery_config: where the gallery images of text→image come from (``clean``).
    """
    spec = parse_config_name(config)
    if task is None:
        if spec.modality is None:
            raise ValueError("The clean config serves both directions: pass task='i2t' or task='t2i'.")
        task = "i2t" if spec.modality == "image" else "t2i"
    if task not in ("i2t", "t2i"):
        raise ValueError(f"task must be 'i2t' or 't2i'; got {task!r}.")
    if (task == "i2t" and spec.modality == "text") or (task == "t2i" and spec.modality == "image"):
        raise ValueError(f"{config!r} corrupts the {spec.modality} modality: its queries are {spec.modality} ({'i2t' if spec.modality == 'image' else 't2i'}).")
    ds = load_config(source, config, split, **load_kwargs)
    meta = ds.remove_columns([c for c in ("image",) if c in ds.column_names])
    cols = meta[:]
    if task == "i2t":
        gallery, gallery_ids, relevant = [], [], []
        for caps, ids in zip(cols["captions"], cols["caption_ids"]):
            relevant.append(list(range(len(gallery), len(gallery) + len(caps))))
            gallery.extend(caps)
            gallery_ids.extend(ids)
        corr = list(zip(cols["corruption"], cols["severity"]))
        return RetrievalSplit(task, config, LazyImages(ds), gallery, relevant, list(cols["image_id"]), gallery_ids, corr)
    gallery_ds = load_config(source, gallery_config, split, **load_kwargs)
    gallery_ids = list(gallery_ds.select_columns(["image_id"])[:]["image_id"])
    pos = {iid: k for k, iid in enumerate(gallery_ids)}
    queries, query_ids, relevant, corr = [], [], [], []
    has_lists = "clean_captions" in cols  # a text config; `clean` has scalar corruption columns
    for r, (iid, caps, ids) in enumerate(zip(cols["image_id"], cols["captions"], cols["caption_ids"])):
        if iid not in pos:
            raise ValueError(f"Image {iid} of {config!r} is not in the gallery config {gallery_config!r}.")
        names = cols["corruption"][r] if has_lists else [cols["corruption"][r]] * len(caps)
        sevs = cols["severity"][r] if has_lists else [cols["severity"][r]] * len(caps)
        for cap, sid, n, s in zip(caps, ids, names, sevs):
            queries.append(cap)
            query_ids.append(sid)
            relevant.append([pos[iid]])
            corr.append((n, s))
    return RetrievalSplit(task, config, queries, LazyImages(gallery_ds), relevant, query_ids, gallery_ids, corr)
