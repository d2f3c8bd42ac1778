"""Picklable builders of the service's wrapper and input encoders: the adapting process is spawned, so what builds
the model must be importable by name (``functools.partial`` of these functions pickles).

* :func:`build_wrapper`: ``TTAWrapper(model_factory(), config)``.
* :func:`load_config`: a :class:`~hf_tta.TTAConfig` from a JSON or YAML file (``--config``), refused in one line.
* :func:`pretrained_model` / :func:`pretrained_encoders`: a user's own dual-encoder checkpoint (a folder or Hub id,
  loaded as the class its config declares, and its ``AutoProcessor``; offline unless the environment says otherwise).
"""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path
from typing import Any, Callable

import torch

from ..config import TTAConfig
from ..wrapper import TTAWrapper


def build_wrapper(model_factory: Callable[[], torch.nn.Module], config: TTAConfig,
                  gate_reference: dict[str, torch.Tensor] | None = None,
                  gate_statistics: dict[str, torch.Tensor] | None = None) -> TTAWrapper:
    """The wrapper at its source state; with ``gate_reference`` (clean queries' model inputs) its shift gate fitted
    on them (:meth:`~hf_tta.TTAWrapper.fit_shift_gate`), or with ``gate_statistics`` (a fitted gate's
    ``state_tensors()``: a few kilobytes, what a spawned process is sent instead of the reference's inputs) given them."""
    wrapper = TTAWrapper(model_factory(), config)
    if gate_reference is not None:
        wrapper.fit_shift_gate(gate_reference)
    if gate_statistics is not None:
        wrapper.shift_gate.load_state_tensors(gate_statistics)
    return wrapper


def load_config(path: str | Path) -> TTAConfig:
    """A ``TTAConfig`` from a ``.json`` or ``.yaml``/``.yml`` file (its fields as a mapping)."""
    path = Path(path)
    text = path.read_text(encoding="utf-8")
    if path.suffix.lower() in (".yaml", ".yml"):
        import yaml

        data = yaml.safe_load(text)
    else:
        data = json.loads(text)
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a mapping of TTAConfig fields, got {type(data).__name__}")
    return TTAConfig.from_dict(data)


def pretrained_model(name_or_path: str) -> torch.nn.Module:
    """The checkpoint as the class its ``config.json`` declares when hf_tta adapts it (``BlipForImageTextRetrieval``,
    ...), else ``AutoModel`` (:func:`hf_tta.models.auto.load_dual_encoder`, as ``hf-tta run --model`` loads it), in
    eval mode."""
    from ..models.auto import load_dual_encoder

    return load_dual_encoder(name_or_path).eval()


def _images(processor: Any, images: list) -> dict[str, torch.Tensor]:
    return {"pixel_values": processor(images=images, return_tensors="pt")["pixel_values"]}


def _texts(processor: Any, max_length: int, texts: list) -> dict[str, torch.Tensor]:
    tok = getattr(processor, "tokenizer", processor)
    return dict(tok(list(texts), padding="max_length", truncation=True, max_length=max_length, return_tensors="pt"))


def pretrained_encoders(name_or_path: str, max_length: int = 64) -> dict[str, Callable[[list], dict[str, torch.Tensor]]]:
    """The input encoders of a checkpoint's processor: images to ``pixel_values``, text padded to ``max_length``."""
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(name_or_path)
    return {"image": partial(_images, processor), "text": partial(_texts, processor, max_length)}


__all__ = ["build_wrapper", "load_config", "pretrained_encoders", "pretrained_model"]
