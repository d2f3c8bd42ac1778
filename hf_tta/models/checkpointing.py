"""Gradient (activation) checkpointing of the query tower, with transformers' own mechanism.

TTA back-propagates through the whole query tower to reach its LayerNorms, so an adapt step keeps every layer's
activations: ViT-B/16 CLIP at batch 64 peaks at 7.6 GiB on CPU, 2.5 GiB with the vision tower checkpointed (one
TCR step; ``recipes/memory_peak.py``, which records the run). transformers' checkpointing
(``GradientCheckpointingLayer``) recomputes each layer in the backward pass instead (one more forward per step).

One subtlety makes the model's own switch a no-op under TTA: a ``GradientCheckpointingLayer`` checkpoints only when
``self.training`` is true, and :class:`~hf_tta.TTAWrapper` keeps the model in eval mode (no dropout). So
:func:`enable_gradient_checkpointing` turns the switch on through the model's API and then sets ``training`` on the
checkpointed *layers themselves only* (not recursively): their dropout/attention submodules stay in eval mode, so
the forward is unchanged and the gradients are those without checkpointing (``tests/test_checkpointing.py``).
Call it after anything that calls ``model.eval()`` (the wrapper's constructor does).
"""

from __future__ import annotations

import functools
import logging

from torch import nn
from torch.utils.checkpoint import checkpoint

from .base import ModelAdapter

logger = logging.getLogger(__name__)


def _checkpoint_layers(adapter: ModelAdapter, modality: str) -> list[tuple[str, nn.Module]]:
    from transformers.modeling_layers import GradientCheckpointingLayer

    return [
        (name, module)
        for name, module in adapter.model.named_modules()
        if isinstance(module, GradientCheckpointingLayer) and modality in adapter.tower_of(name)
    ]


def enable_gradient_checkpointing(adapter: ModelAdapter, modality: str) -> list[str]:
    """Checkpoint every transformer layer of ``modality``'s tower; returns their names.

    Uses ``activation_checkpointing_enable`` (``gradient_checkpointing_enable`` before transformers 5.x) of the
    tower's ``PreTrainedModel`` sub-models (e.g. ``CLIPModel.vision_model``), with ``use_reentrant=False`` (works
    with frozen inputs, as under PEFT LN tuning), else of the whole model. Raises ``ValueError`` when the tower has
    no checkpointable layer (e.g. a custom ``nn.Module`` dual encoder).
    """
    from transformers import PreTrainedModel

    adapter.check_modality(modality)
    layers = _checkpoint_layers(adapter, modality)
    if not layers:
        raise ValueError(
            f"gradient checkpointing: the {modality} tower of {type(adapter.model).__name__} has no transformers "
            "GradientCheckpointingLayer; set gradient_checkpointing=False."
        )
    tower_models = [
        m for n, m in adapter.model.named_modules()
        if n and isinstance(m, PreTrainedModel) and m.supports_gradient_checkpointing and adapter.tower_of(n) == {modality}
    ]
    for model in tower_models:  # e.g. CLIPModel.vision_model: the model's own switch
        enable = getattr(model, "activation_checkpointing_enable", None)
        if enable is not None:
            enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:  # transformers < 5.x
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    names = []
    for name, layer in layers:
        if not layer.gradient_checkpointing:
            # a tower without a checkpointable sub-model (BlipTextModel declares no support; BLIP-2's shared
            # Q-Former): the flags transformers' switch sets, on this tower's layers only
            layer.gradient_checkpointing = True
            layer._gradient_checkpointing_func = functools.partial(checkpoint, use_reentrant=False)
        layer.training = True  # this module only: its submodules (dropout) stay in eval mode
        names.append(name)
    logger.info("hf_tta: gradient checkpointing of %d %s-tower layers", len(names), modality)
    return names


def disable_gradient_checkpointing(adapter: ModelAdapter) -> None:
    """Undo :func:`enable_gradient_checkpointing` on every tower (layers back to eval mode)."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    for module in adapter.model.modules():
        if isinstance(module, GradientCheckpointingLayer):
            module.gradient_checkpointing = False
            module.training = False
