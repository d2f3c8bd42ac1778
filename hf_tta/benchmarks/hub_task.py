"""The benchmark runner's tasks on the Hugging Face Hub's models and datasets (the emoji task and the task interface
are :mod:`hf_tta.benchmarks.tasks`).

* :class:`HubTask`: any Hugging Face dual encoder + a COCO-C/Flickr-C-style dataset built by
  :mod:`hf_tta.data.builders`;
* :class:`AVTask`: an audio/video model + an AudioSet-O / AudioSet-D / VGGSound benchmark built by
  :mod:`hf_tta.data.builders.audioset`.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from .grid import AV_DIRECTIONS, Condition
from .tasks import HeadSequence, Task


def image_text_config(cond: Condition) -> str:
    """The config of a COCO-C / Flickr-C benchmark that holds a condition's queries (``clean``, ``image-fog-5``,
    ``text-ocr-7``, ``image-diverse``, ...)."""
    prefix = "image" if cond.direction == "i2t" else "text"
    if cond.shift in ("clean", "degenerate"):  # degenerate: the runner feeds a constant prefix before the clean stream
        return "clean"
    if cond.shift == "diverse":
        return f"{prefix}-diverse"
    if cond.shift == "noto":
        raise ValueError("The 'noto' style shift exists only on the emoji benchmark.")
    return f"{prefix}-{cond.shift}-{cond.severity}"


class HubTask(Task):
    """Any Hugging Face dual encoder on a benchmark built by :mod:`hf_tta.data.builders` (COCO-C / Flickr-C
    layout: configs ``clean``, ``image-<name>-<s>``, ``text-<name>-<s>``, ``image-diverse``, ``text-diverse``).

    Args:
        model: a Hub id or a local folder (loaded as the class its config declares, e.g. ``BlipForImageTextRetrieval``,
            else ``AutoModel``; see :func:`hf_tta.models.auto.load_dual_encoder`; + ``AutoProcessor``), or a model
            instance.
        dataset: builder output folder, local Hub-layout folder or Hub dataset id.
        processor: the processor when ``model`` is an instance.
        limit: keep only the first ``limit`` queries of each stream.
    """

    name = "hub"

    def __init__(self, model, dataset, processor=None, limit: int | None = None, device: str = "cpu"):
        if isinstance(model, str):
            from transformers import AutoProcessor

            from ..models.auto import load_dual_encoder

            self.model_id = model
            processor = processor or AutoProcessor.from_pretrained(model)
            model = load_dual_encoder(model, dtype=torch.float32)
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
        from ..models.text_processor import check_text_processor, text_tokenizer

        if text_tokenizer(processor) is not None:  # distinct captions of this benchmark must not collide (silent zeros)
            check_text_processor(processor, self.caption_probe(), source=self.model_id)

    def caption_probe(self) -> Sequence[str] | None:
        """The captions the tokenizer check probes: the clean gallery's (``None``: a few fixed English captions)."""
        return self._split(Condition("i2t", "clean")).gallery

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "model": self.model_id, "model_class": type(self.model).__name__,
                "dataset": str(self.dataset), "limit": self.limit}

    def _config(self, cond: Condition) -> str:
        return image_text_config(cond)

    def _split(self, cond: Condition):
        config = self._config(cond)
        key = f"{cond.direction}:{config}"
        if key not in self._splits:
            self._splits[key] = self._load(config, cond.direction)
        return self._splits[key]

    def _load(self, config: str, direction: str):
        from ..data.builders.loading import load_retrieval_split

        return load_retrieval_split(self.dataset, config, task=direction)

    def queries(self, cond: Condition, seed: int | None = None):
        split = self._split(cond)  # a built benchmark's corruptions are fixed: the seed changes only the stream order
        n = len(split.queries) if self.limit is None else min(self.limit, len(split.queries))
        return HeadSequence(split.queries, n), [list(r) for r in split.relevant[:n]]

    def gallery_items(self, cond: Condition) -> Sequence:
        return self._split(Condition(cond.direction, "clean")).gallery

    def query_domains(self, cond: Condition, seed: int | None = None) -> list[str] | None:
        """The ``domain`` column of the build (Fashion-Gen's 48 categories, a Nocaps domain) for the ``+key`` rows;
        ``None`` where the build has none."""
        domains = getattr(self._split(cond), "query_domains", None)
        if domains is None:
            return None
        n = len(domains) if self.limit is None else min(self.limit, len(domains))
        return list(domains[:n])

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

    def caption_probe(self) -> None:  # the text side depends on the direction: the fixed English captions
        return None

    def _has(self, modality: str) -> bool:
        from collections.abc import Mapping

        return modality in self.processor if isinstance(self.processor, Mapping) else True

    def _processor(self, modality: str):
        from collections.abc import Mapping

        from ..models import get_adapter

        if isinstance(self.processor, Mapping):
            if modality not in self.processor:
                raise ValueError(f"No processor for {modality}: pass processor={{{modality!r}: ..., ...}}.")
            return self.processor[modality]
        # the adapter declares modalities prepared by another one's processor (CLIP over videos: frames are images)
        if get_adapter(self.model, [modality]).preprocess_as.get(modality) == "image":
            return getattr(self.processor, "image_processor", self.processor)
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
