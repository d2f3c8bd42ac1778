"""Load a checkpoint (Hub id or folder) as the class hf_tta adapts: the retrieval class its config declares.

``AutoModel`` maps a BLIP checkpoint to ``BlipModel`` and a BLIP-2 one to ``Blip2Model``, which have no retrieval
(ITC) heads and no adapter here; the checkpoint's ``config.json`` names the class it was saved from
(``architectures``, e.g. ``BlipForImageTextRetrieval`` for ``Salesforce/blip-itm-base-coco``). :func:`load_dual_encoder`
loads the first declared class that hf_tta has an adapter for, and falls back to ``AutoModel`` (CLIP, SigLIP, CLAP,
X-CLIP, VisionTextDualEncoder declare their ``AutoModel`` class anyway).
"""

from __future__ import annotations

import logging

import torch

from .base import ADAPTERS, RETRIEVAL_CLASS, retrieval_class_name  # noqa: F401  (re-exported)

logger = logging.getLogger(__name__)

def load_dual_encoder(name_or_path: str, dtype: torch.dtype = torch.float32, **kwargs):
    """The model of a Hub id or folder as the class its config declares (``architectures``), when hf_tta adapts it;
    else ``AutoModel``. The choice is logged."""
    import transformers
    from transformers import AutoConfig, AutoModel

    config = AutoConfig.from_pretrained(name_or_path, **kwargs)
    for name in config.architectures or ():
        cls = getattr(transformers, name, None)
        if cls is not None and name in ADAPTERS:
            logger.info("Loading %s as %s (the class its config.json declares).", name_or_path, name)
            return cls.from_pretrained(name_or_path, dtype=dtype, **kwargs)
    model = AutoModel.from_pretrained(name_or_path, dtype=dtype, **kwargs)
    logger.info("Loading %s with AutoModel as %s (its config declares %s).", name_or_path, type(model).__name__,
                config.architectures)
    return model
