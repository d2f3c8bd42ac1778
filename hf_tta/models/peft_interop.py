"""PEFT models in and out: a model that is already a ``PeftModel`` (e.g. LoRA-tuned) is adapted on top of its merged
weights, and a wrapper's adapted state exports as a PEFT adapter folder (LN tuning) that ``PeftModel.from_pretrained``
loads."""

from __future__ import annotations

import logging
import os

from peft import PeftModel
from torch import nn

logger = logging.getLogger(__name__)


def unwrap_peft(model: nn.Module) -> nn.Module:
    """The model to adapt: a ``PeftModel``'s adapters merged into its base weights (``merge_and_unload``; logged, the
    base model's weights change in place as PEFT's own merge does), anything else as it is."""
    if not isinstance(model, PeftModel):
        return model
    names = list(getattr(model, "peft_config", {}) or {})
    logger.warning("The model is a PeftModel (adapters %s): merging them into the base weights (merge_and_unload) and "
                   "adapting on top of the merged model.", names)
    return model.merge_and_unload()


def export_peft_adapter(peft_model: PeftModel | None, directory: str | os.PathLike) -> str:
    """Write the adapted state as a PEFT adapter folder (``adapter_config.json`` + ``adapter_model.safetensors``): an
    LN-tuning adapter (``tuning="ln"`` or ``"bias"``: the selected modules whole) or a LoRA adapter (``"lora"``);
    ``PeftModel.from_pretrained(source_model, directory)`` then embeds as the wrapper."""
    if peft_model is None:
        raise ValueError("This wrapper adapts nothing (a training-free objective): there is no PEFT adapter to export.")
    peft_model.save_pretrained(str(directory))
    return str(directory)
