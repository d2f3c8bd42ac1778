"""Load a built or published benchmark config as retrieval queries + gallery + relevance, ready for ``TTAWrapper``:
the one loading module of the image-text (COCO-C / Flickr-C) and audio-video (AudioSet-O / -D, VGGSound) benchmarks.

Example (with a CLIP processor and a ``TTAWrapper`` ``tta``)::

    split = load_retrieval_split("me/coco-c", "image-gaussian_noise-5")       # image→text
    gallery = tta.encode_gallery(split.gallery_inputs(processor, batch_size=256))
    scores = tta.adapt_stream(list(split.query_inputs(processor, batch_size=64)), gallery)
    print(split.evaluate(scores))                                              # R@1/5/10, medr, mAP

    av = load_av_retrieval("me/audioset-o", "video_noise_blur", "video->audio")  # the same interface

One lazy column (:class:`LazyItems`), one config loader (:func:`load_config`) and one processor call
(:func:`to_model_inputs`) serve both.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Sequence

import numpy as np

from ..corruptions.audio_io import decode_wav, resample
from .base import CLEAN, SPLIT, is_built
from .clips import frames_to_array
from .specs import parse_config_name, parse_direction


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


def _to_rgb(image):
    return image.convert("RGB")


class LazyImages(LazyItems):
    """The ``image`` column of a dataset, decoded (as RGB PIL images) only when indexed."""

    def __init__(self, dataset):
        super().__init__(dataset, "image", _to_rgb)


def to_model_inputs(items: Sequence, modality: str, processor, sampling_rate: int | None = None, **kwargs) -> dict:
    """Model inputs for a slice of raw items, with a Hugging Face processor.

    - image: ``processor(images=items)``;
    - text: ``processor(text=items, padding=True, truncation=True)``;
    - audio: a feature extractor (``ClapFeatureExtractor``) or a processor taking ``audio=`` (``ClapProcessor``);
    - video: a processor taking ``videos=`` (``XCLIPProcessor``) gives ``(B, T, C, H, W)``; an image processor
      (``CLIPImageProcessor``, for :class:`~hf_tta.models.CLIPVideoAdapter`) is applied to all frames, and clips with
      fewer frames are padded by repeating their last frame, with ``frame_mask`` marking the real ones.
    """
    items = list(items)
    if modality == "image":
        return dict(processor(images=items, return_tensors="pt", **kwargs))
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


@dataclass
class RetrievalSplit:
    """Queries, gallery and the relevance lists of one benchmark config.

    ``task`` is ``"i2t"`` (image queries, caption gallery) or ``"t2i"`` (caption queries, image gallery).
    ``relevant[i]`` lists the gallery positions relevant to query ``i`` (5 captions per image for i2t, the image
    of the caption for t2i; with a ``group`` column, every caption / image of the query's group: Fashion-Gen's
    products, the ReID sets' persons): pass it to :func:`hf_tta.metrics.retrieval_metrics`.
    """

    task: str
    config: str
    queries: Sequence
    gallery: Sequence
    relevant: list[list[int]]
    query_ids: list[int]
    gallery_ids: list[int]
    query_corruptions: list[tuple[str, int]] = field(default_factory=list)
    #: Each query's domain where the build records one (``domain`` column: Fashion-Gen categories, Nocaps domains).
    query_domains: list[str] | None = None
    #: The audio rate of audio queries/galleries (``None`` for the other modalities).
    sampling_rate: int | None = None

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
            yield to_model_inputs(batch, self.query_modality, processor, self.sampling_rate, **processor_kwargs)

    def gallery_inputs(self, processor, batch_size: int = 256, **processor_kwargs) -> list[dict]:
        """Gallery batches through a processor: a list of dicts for ``TTAWrapper.encode_gallery``."""
        return [
            to_model_inputs(b, self.gallery_modality, processor, self.sampling_rate, **processor_kwargs)
            for b in self.gallery_batches(batch_size)
        ]

    def evaluate(self, scores, ks=(1, 5, 10)) -> dict[str, float]:
        """R@K (%), median/mean rank and mAP (%) of a ``(queries, gallery)`` score matrix."""
        from ...metrics import retrieval_metrics

        return retrieval_metrics(scores, self.relevant, ks=ks)


@dataclass
class AVRetrievalSplit(RetrievalSplit):
    """Queries, gallery and relevance of one direction of one audio-video config: the image benchmarks'
    :class:`~hf_tta.data.builders.RetrievalSplit` (``query_inputs``, ``gallery_inputs``, ``evaluate``) with
    ``task = "<query>-><gallery>"``.

    ``queries``/``gallery`` hold raw items, decoded lazily: texts (``str``), waveforms (1-D float32 at
    ``sampling_rate``) or videos (``(T, H, W, 3)`` uint8). ``relevant[i]`` lists the gallery positions relevant to
    query ``i``; ``query_corruptions[i]`` the corruption of each segment of query ``i``.
    """

    @property
    def query_modality(self) -> str:
        return self.task.split("->")[0]

    @property
    def gallery_modality(self) -> str:
        return self.task.split("->")[1]


def load_config(source: Any, config: str, split: str = SPLIT, **load_kwargs):
    """One config as a ``Dataset`` from a builder output folder, a local Hub-layout folder, a Hub repo id, a
    :class:`~hf_tta.data.builders.BenchmarkBuilder` or a mapping ``{config: Dataset | DatasetDict}``."""
    parse_config_name(config)
    return _load_any(source, config, split, **load_kwargs)


def load_any_config(source: Any, config: str, split: str = SPLIT, **load_kwargs):
    """:func:`load_config` for any config name (composed and audio-video builds have their own)."""
    return _load_any(source, config, split, **load_kwargs)


def _load_any(source: Any, config: str, split: str = SPLIT, **load_kwargs):
    """:func:`load_config` without checking ``config`` against the COCO-C / Flickr-C names."""
    from ...extras import require

    require("datasets", "Loading a benchmark")
    from datasets import DatasetDict, load_dataset, load_from_disk

    if hasattr(source, "load") and hasattr(source, "config_dir"):  # a BenchmarkBuilder
        return source.load(config)
    if isinstance(source, Mapping):
        if config not in source:
            raise KeyError(f"Config {config!r} is not in the given mapping (has {sorted(source)[:8]}...).")
        ds = source[config]
        return ds[split] if isinstance(ds, DatasetDict) else ds
    if isinstance(source, (str, os.PathLike)) and Path(source).is_dir():
        folder = Path(source)
        if is_built(folder / config):
            ds = load_from_disk(str(folder / config))
            return ds[split] if isinstance(ds, DatasetDict) else ds
        if (folder / "README.md").is_file():
            return load_dataset(str(folder), config, split=split, **load_kwargs)
        raise FileNotFoundError(f"{folder} has neither a built config {config!r} nor a README.md with configs.")
    text = str(source)
    path = Path(text).expanduser()
    if text.startswith(("/", ".", "~")) or "/" not in text.strip("/") or Path(path.parts[0]).is_dir():
        # a path, a bare name or a/b under a folder here: a missing folder, not a Hub repo that "couldn't be reached"
        raise FileNotFoundError(f"The folder {path.absolute()} does not exist; pass a built benchmark folder or a Hub "
                                "dataset id (owner/name).")
    return load_dataset(text, config, split=split, **load_kwargs)


def built_spec(source: Any):
    """The :class:`~.specs.BenchmarkSpec` of a benchmark: from a build folder's ``build_info.json``, or the ``hf_tta``
    block of a published card (a Hub id or a local Hub-layout folder: name, baseline tau, directions over the
    registered spec or a default one). ``None`` where neither is found (mappings, audio-video builds, offline)."""
    import json

    from .base import BUILD_INFO
    from .specs import IMAGE_TEXT_BENCHMARKS, BenchmarkSpec, benchmark_spec

    if not isinstance(source, (str, os.PathLike)):
        return None
    if (Path(source) / BUILD_INFO).is_file():
        params = json.loads((Path(source) / BUILD_INFO).read_text(encoding="utf-8")).get("params", {})
        try:
            return benchmark_spec(params.get("spec") or params.get("benchmark"))
        except (ValueError, TypeError):
            return None
    block = _card_block(source)
    if not isinstance(block, dict) or "benchmark" not in block:
        return None
    base = IMAGE_TEXT_BENCHMARKS.get(block["benchmark"]) or BenchmarkSpec(
        str(block["benchmark"]), str(block["benchmark"]), "", "", 0, 0, "", "", "other", "")
    from dataclasses import replace

    return replace(base, baseline_tau=float(block.get("baseline_tau", base.baseline_tau)),
                   directions=tuple(block.get("directions", base.directions)))


def _card_block(source) -> dict | None:
    """The ``hf_tta`` block of a dataset card (local Hub-layout folder or Hub id); ``None`` when unreadable."""
    try:
        from huggingface_hub import DatasetCard

        local = Path(source) / "README.md"
        card = DatasetCard.load(local) if local.is_file() else DatasetCard.load(str(source), repo_type="dataset")
        return card.data.to_dict().get("hf_tta")
    except Exception:  # offline, no such repo, no card: the papers' default temperature applies
        return None


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
    groups = cols.get("group")  # items of one group (a product, a person) share their captions
    if task == "i2t":
        gallery, gallery_ids, relevant = [], [], []
        for caps, ids in zip(cols["captions"], cols["caption_ids"]):
            relevant.append(list(range(len(gallery), len(gallery) + len(caps))))
            gallery.extend(caps)
            gallery_ids.extend(ids)
        if groups is not None:
            by_group: dict[str, list[int]] = {}
            for g, rel in zip(groups, relevant):
                by_group.setdefault(g, []).extend(rel)
            relevant = [by_group[g] for g in groups]
        corr = list(zip(cols["corruption"], cols["severity"]))
        return RetrievalSplit(task, config, LazyImages(ds), gallery, relevant, list(cols["image_id"]), gallery_ids, corr,
                              query_domains=list(cols["domain"]) if "domain" in cols else None)
    gallery_ds = load_config(source, gallery_config, split, **load_kwargs)
    gallery_cols = gallery_ds.select_columns([c for c in ("image_id", "group") if c in gallery_ds.column_names])[:]
    gallery_ids = list(gallery_cols["image_id"])
    pos = {iid: k for k, iid in enumerate(gallery_ids)}
    members: dict[str, list[int]] = {}
    if groups is not None:
        if "group" not in gallery_cols:
            raise ValueError(f"{config!r} has a 'group' column but the gallery config {gallery_config!r} has none: build them together.")
        for k, g in enumerate(gallery_cols["group"]):
            members.setdefault(g, []).append(k)
    queries, query_ids, relevant, corr, domains = [], [], [], [], []
    has_lists = "clean_captions" in cols  # a text config; `clean` has scalar corruption columns
    for r, (iid, caps, ids) in enumerate(zip(cols["image_id"], cols["captions"], cols["caption_ids"])):
        if iid not in pos:
            raise ValueError(f"Image {iid} of {config!r} is not in the gallery config {gallery_config!r}.")
        names = cols["corruption"][r] if has_lists else [cols["corruption"][r]] * len(caps)
        sevs = cols["severity"][r] if has_lists else [cols["severity"][r]] * len(caps)
        for cap, sid, n, s in zip(caps, ids, names, sevs):
            queries.append(cap)
            query_ids.append(sid)
            relevant.append(members[groups[r]] if groups is not None else [pos[iid]])
            corr.append((n, s))
            domains.append(cols["domain"][r] if "domain" in cols else None)
    return RetrievalSplit(task, config, queries, LazyImages(gallery_ds), relevant, query_ids, gallery_ids, corr,
                          query_domains=domains if "domain" in cols else None)


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
    split: str = SPLIT,
) -> AVRetrievalSplit:
    """Queries, gallery and relevance for one direction of one config.

    Args:
        source: a Hub repo id, a :func:`~hf_tta.data.builders.av_builder.save_av_benchmark` folder, or the mapping :func:`~hf_tta.data.builders.av_builder.build_av_benchmark` returns.
        config: ``"clean"`` or a corruption config. A corruption config corrupts one modality, which must be the
            direction's query modality (the gallery always comes from ``clean``).
        direction: one of :data:`~hf_tta.data.builders.specs.AV_MODALITY_PAIRS` (``"video->audio"``, ``"text->audio"``, ...). Text sides hold the
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
    clean = _load_any(source, CLEAN, split)
    qsource = clean if config == CLEAN else _load_any(source, config, split)
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


__all__ = [
    "AVRetrievalSplit",
    "built_spec",
    "load_any_config",
    "LazyImages",
    "LazyItems",
    "RetrievalSplit",
    "load_av_retrieval",
    "load_config",
    "load_retrieval_split",
    "to_model_inputs",
]
