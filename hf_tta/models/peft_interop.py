"""PEFT models in and out: a model that is already a ``PeftModel`` (e.g. LoRA-tuned) is adapted on top of its merged
weights; a wrapper's adapted state exports as a PEFT adapter folder (an LN-tuning adapter of the selected modules, or
the LoRA adapter) that ``PeftModel.from_pretrained`` loads, and a LoRA wrapper merges into a plain model. Both work on
a copy that shares every tensor adaptation does not change, so the wrapper goes on as it was (``disabled()`` too)."""

from __future__ import annotations

import copy
import logging
import os
import re
import sys
import warnings
from typing import TYPE_CHECKING, Any, Iterable

import torch
from torch import nn

if TYPE_CHECKING:
    from peft import PeftModel

logger = logging.getLogger(__name__)


def peft_layers(model: nn.Module, kind: str = "BaseTunerLayer") -> list[nn.Module]:
    """``model``'s PEFT tuner layers (``kind``: ``"BaseTunerLayer"`` or ``"LoraLayer"``). PEFT is imported only for
    LoRA (it costs seconds): a model can carry its layers only once something imported it, so without it: none."""
    if "peft" not in sys.modules:
        return []
    from peft.tuners.lora import LoraLayer
    from peft.tuners.tuners_utils import BaseTunerLayer

    cls = LoraLayer if kind == "LoraLayer" else BaseTunerLayer
    return [m for m in model.modules() if isinstance(m, cls)]


def unwrap_peft(model: nn.Module) -> nn.Module:
    """The model to adapt: a ``PeftModel``'s adapters merged into its base weights (``merge_and_unload``; logged, the
    base model's weights change in place as PEFT's own merge does), anything else as it is."""
    peft = sys.modules.get("peft")  # not imported: the model cannot be a PeftModel
    if peft is None or not isinstance(model, peft.PeftModel):
        return model
    names = list(getattr(model, "peft_config", {}) or {})
    logger.warning("The model is a PeftModel (adapters %s): merging them into the base weights (merge_and_unload) and "
                   "adapting on top of the merged model.", names)
    return model.merge_and_unload()


def light_copy(obj: Any, own: Iterable[torch.Tensor], model: nn.Module | None = None) -> Any:
    """A deep copy of ``obj`` (a model, or objects holding one: ``model``) that owns copies of the tensors in ``own``
    and shares every other parameter and buffer of ``model`` (so copying a large model costs only its module objects
    and ``own``)."""
    model = obj if model is None else model
    mine = {id(t) for t in own}
    shared = {id(t): t for t in (*model.parameters(), *model.buffers()) if id(t) not in mine}
    return copy.deepcopy(obj, memo=shared)


def merged_lora_copy(peft_model: PeftModel) -> nn.Module:
    """A plain transformers model with the LoRA updates merged into a copy of each adapted layer's weight; the wrapped
    model (its base weights and LoRA layers) is unchanged."""
    layers = peft_layers(peft_model)
    return light_copy(peft_model, [t for m in layers for t in (*m.parameters(), *m.buffers())]).merge_and_unload()


def export_peft_adapter(model: nn.Module, peft_model: PeftModel | None, modules: list[str], directory: str | os.PathLike) -> str:
    """Write the adapted state as a PEFT adapter folder (``adapter_config.json`` + ``adapter_model.safetensors``): a
    LoRA adapter (``tuning="lora"``), or an LN-tuning adapter holding ``modules`` (of ``model``, adapted in place:
    ``tuning="ln"`` or ``"bias"``) whole, built on a :func:`light_copy`; ``PeftModel.from_pretrained(source_model,
    directory)`` then embeds as the wrapper."""
    if peft_model is None and not modules:
        raise ValueError("This wrapper adapts nothing (a training-free objective): there is no PEFT adapter to export.")
    if peft_model is None:
        from peft import LNTuningConfig, get_peft_model

        own = [t for name in modules for t in model.get_submodule(name).parameters()]
        pattern = "^(" + "|".join(re.escape(n) for n in modules) + ")$"
        with warnings.catch_warnings():  # PEFT warns "Unsupported layer type LayerNorm": LN tuning is what we want
            warnings.filterwarnings("ignore", message="Unsupported layer type")
            warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing", category=FutureWarning)
            peft_model = get_peft_model(light_copy(model, own), LNTuningConfig(target_modules=pattern))
    peft_model.save_pretrained(str(directory))
    return str(directory)


class PeftExportMixin:
    """``export_peft_adapter`` and ``merge_and_unload`` for a wrapper with ``model``, ``peft_model`` (LoRA) and
    ``target_modules``."""

    model: nn.Module
    peft_model: PeftModel | None
    target_modules: list[str]

    def export_peft_adapter(self, directory: str | os.PathLike) -> str:
        """The adapted state as a PEFT adapter folder: ``PeftModel.from_pretrained(source_model, directory)``
        (LayerNorm tuning: an LN-tuning adapter of the adapted modules; LoRA: the LoRA adapter). The wrapper goes on."""
        return export_peft_adapter(self.model, self.peft_model, self.target_modules, directory)

    def merge_and_unload(self) -> nn.Module:
        """The adapted model as a plain transformers model: with LayerNorm/bias tuning the wrapped model itself (its
        own parameters hold the adapted values, and later steps change them), with LoRA a merged copy. The wrapper
        goes on either way."""
        return merged_lora_copy(self.peft_model) if self.peft_model is not None else self.model
