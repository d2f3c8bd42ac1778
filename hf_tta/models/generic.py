"""A documented path for any ``nn.Module`` dual encoder: give one encode function per modality.

Example (a CAV-MAE-style audio-video model, or anything with two towers):

    >>> adapter = DualEncoderAdapter(
    ...     model,
    ...     encoders={"video": lambda m, x: m.encode_video(x["pixel_values"]),
    ...               "audio": lambda m, x: m.encode_audio(x["input_values"])},
    ...     towers={"video": ["video_encoder", "video_proj"], "audio": ["audio_encoder", "audio_proj"]},
    ...     input_names={"video": ["pixel_values"], "audio": ["input_values"]},
    ... )
    >>> tta = TTAWrapper(adapter, TTAConfig(objective="tcr", query_modality="video"))

Encode functions return projected embeddings ``(B, D)`` (or ``(B, Q, D)`` for a multi-vector modality); hf_tta
L2-normalises them. ``towers`` maps each modality to the module-name prefixes (as in ``named_modules()``) of its
tower: the default adapted parameters are the normalisation layers under the query modality's prefixes.
"""

from __future__ import annotations

import dataclasses
from typing import Iterable, Mapping

import torch
from torch import nn

from .base import EncodeFn, ModelAdapter
from .inputs import InputSpec


class DualEncoderAdapter(ModelAdapter):
    """Adapter for a custom dual encoder described by encode functions and tower prefixes.

    Args:
        model (`nn.Module`): the model; its parameters are what TTA adapts.
        encoders (`dict[str, Callable[[nn.Module, dict], torch.Tensor]]`): per modality, ``fn(model, inputs)``.
        towers (`dict[str, list[str]]`): per modality, module-name prefixes of its tower.
        input_names (`dict[str, list[str]]`, *optional*): accepted input keys per modality, required one first.
            Defaults to ``pixel_values`` for image/video, ``input_ids``/``attention_mask`` for text and
            ``input_values`` for audio.
        shared (`list[str]`, *optional*): prefixes of modules used by several towers.
        default_lr (`dict[str, float]`, *optional*): AdamW learning rate per query modality (default 3e-4).
        multi_vector (`list[str]`, *optional*): modalities whose encoder returns ``(B, Q, D)``.
        input_specs (`dict[str, dict[str, InputSpec]]`, *optional*): per modality, what each input must look like
            (:class:`~hf_tta.models.inputs.InputSpec`). Without it, only dtypes are checked (floating-point
            pixel/audio values, integer token ids): a custom model's layouts are its own.
    """

    _DEFAULT_INPUTS = {
        "image": ("pixel_values",),
        "video": ("pixel_values",),
        "text": ("input_ids", "attention_mask", "token_type_ids"),
        "audio": ("input_values", "attention_mask"),
    }

    def __init__(
        self,
        model: nn.Module,
        encoders: Mapping[str, EncodeFn],
        towers: Mapping[str, Iterable[str]],
        input_names: Mapping[str, Iterable[str]] | None = None,
        shared: Iterable[str] = (),
        default_lr: Mapping[str, float] | None = None,
        multi_vector: Iterable[str] = (),
        input_specs: Mapping[str, Mapping[str, InputSpec]] | None = None,
    ):
        super().__init__(model)
        if len(encoders) < 2:
            raise ValueError(f"A dual encoder needs encode functions for two modalities; got {sorted(encoders)}.")
        missing = set(encoders) - set(towers)
        if missing:
            raise ValueError(f"`towers` has no module prefixes for {sorted(missing)}.")
        self.encoders = dict(encoders)
        self.modalities = tuple(encoders)
        self.towers = {m: tuple(p) for m, p in towers.items()}
        names = dict(input_names or {})
        self.input_names = {
            m: tuple(names.get(m, self._DEFAULT_INPUTS.get(m, ("inputs",)))) for m in self.modalities
        }
        self.shared = tuple(shared)
        self.default_lr = {m: 3e-4 for m in self.modalities} | dict(default_lr or {})
        self.multi_vector = frozenset(multi_vector)
        self._specs = {m: dict(s) for m, s in (input_specs or {}).items()}

    def input_specs(self, modality: str) -> dict[str, InputSpec]:
        if modality in self._specs:
            return self._specs[modality]
        # the defaults' dtype kinds only: no config tells a custom model's layouts or vocabulary
        return {
            k: dataclasses.replace(s, layout=None, sizes=(), like=None, max_abs=None)  # a custom model's scale is its own
            for k, s in super().input_specs(modality).items()
        }

    def _embed(self, modality: str, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.encoders[modality](self.model, inputs)

    def describe(self) -> str:
        return f"DualEncoderAdapter({type(self.model).__name__}, modalities={list(self.modalities)})"
