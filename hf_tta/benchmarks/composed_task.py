"""The composed image retrieval task of the benchmark runner: a BLIP-2 (``Blip2ForImageTextRetrieval``, through
:class:`~hf_tta.models.Blip2ComposedAdapter`) or any model whose adapter embeds ``composed`` queries, on FIQ-O/-D or
CIRR-O/-D built by :mod:`hf_tta.data.builders.composed` (direction ``c2i``: composed queries, target-image gallery).

A condition's shift names the query config: ``clean``, an -O config (``noise_char`` ... ``digital_sent``) or
``diverse``; the gallery is the ``gallery`` config. Rows carry REST's metrics besides R@1/5/10
(:meth:`ComposedTask.extra_metrics`: CIRR R@50 and Recall_subset@1/2/3 with the reference removed; FIQ R@50).
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from .grid import Condition
from .hub_task import HubTask
from .tasks import HeadSequence


class ComposedTask(HubTask):
    """See the module docstring; ``model``/``dataset``/``processor``/``limit``/``device`` as :class:`HubTask`."""

    name = "composed"

    def _config(self, cond: Condition) -> str:
        return cond.shift

    def caption_probe(self) -> None:  # composed queries hold modification texts, not captions: the fixed English ones
        return None

    def _load(self, config: str, direction: str):
        from ..data.builders.composed_hub import load_composed_split

        return load_composed_split(self.dataset, config)

    def queries(self, cond: Condition, seed: int | None = None):
        split = self._split(cond)
        n = len(split.queries) if self.limit is None else min(self.limit, len(split.queries))
        return HeadSequence(split.queries, n), [list(r) for r in split.relevant[:n]]

    def gallery_items(self, cond: Condition) -> Sequence:
        return self._split(Condition(cond.direction, "clean")).gallery

    def to_inputs(self, modality: str, raw: Sequence) -> dict[str, torch.Tensor]:
        from ..data.builders.composed_hub import composed_inputs

        if modality == "composed":
            return self._on_device(composed_inputs(raw, self.processor))
        return super().to_inputs(modality, raw)

    def extra_metrics(self, cond: Condition, scores: torch.Tensor) -> dict[str, Any]:
        """REST's columns of this stream (``scores`` rows are the first ``len(scores)`` queries)."""
        return {k: round(float(v), 4) for k, v in self._split(cond).evaluate(scores).items()}


def composed_dataset_configs(dataset) -> list[str]:
    """The query configs of a composed build folder (``gallery`` left out), in the builder's order."""
    from ..data.builders.base import built_configs
    from ..data.builders.composed import COMPOSED_CONFIGS

    built = set(built_configs(dataset))
    return [c for c in COMPOSED_CONFIGS if c in built and c != "gallery"]


__all__ = ["ComposedTask", "composed_dataset_configs"]
