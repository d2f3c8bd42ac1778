"""Source-anchored answers' settings (:mod:`hf_tta.source_anchor`), a feature of :class:`~hf_tta.TTAConfig` grouped
as :mod:`hf_tta.config_features` groups the others (kept in a module of its own so that each stays under 500 lines).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from .configuration_utils import ConfigMixin, check_choice, check_field_types, check_positive

#: Where ``SourceAnchorConfig.source_confidence`` keeps the source's scores: the mixed batches only, or every batch the
#: anchor answers (the adapted model's alone too).
SOURCE_CONFIDENCE_SCOPES = ("mix", "all")


@dataclass
class SourceAnchorConfig(ConfigMixin):
    """Source-anchored answers (:mod:`hf_tta.source_anchor`). They decide who answers, not what an adapted state
    means, so a checkpoint loads across their settings.

    Example:
        >>> SourceAnchorConfig.from_dict({"margin": 0.02}).momentum
        0.8
    """

    loads_across_checkpoints: ClassVar[bool] = True

    margin: float = field(
        default=0.01,
        metadata={"help": "The adapted model answers while the evidence (a moving average of its batch-mean top-1 "
                  "softmax probability minus the source model's) exceeds this; otherwise the source answers."},
    )
    momentum: float = field(
        default=0.8, metadata={"help": "m in e <- m e + (1 - m) d_t, the evidence's moving average over batches (0: the batch alone)."}
    )
    temperature: float = field(
        default=0.01, metadata={"help": "T of softmax(cos / T) over the gallery (CLIP's logit scale 100 = 1 / 0.01)."}
    )
    ensemble_weight: float = field(
        default=0.0,
        metadata={"help": "While the evidence is at or below the margin, the answer's scores are (1 - w) s_source + "
                  "w s_adapted (0: the source answers alone)."},
    )
    source_confidence: float | None = field(default=None, metadata={
        "help": "With the mix: a query whose source top-1 softmax probability (at T) is at least this keeps the "
                "source's scores in it (None: every query is mixed)."})
    mix_agreement: list[float] | None = field(default=None, metadata={
        "help": "With the mix: [low, high]; the mix answers a batch only while the share of its queries whose top-1 "
                "item the two models share is within it, else the source alone (None: always)."})
    source_confidence_scope: str = field(default="mix", metadata={
        "help": "Where `source_confidence` keeps the source's scores: 'mix' (the mixed batches only) or 'all' (also "
                "the batches the adapted model answers alone)."})
    adapted_agreement: float | None = field(default=None, metadata={
        "help": "The adapted model answers a batch alone only while the share of its queries whose top-1 item the two "
                "models share is at most this; above it the source answers (None: whenever the evidence says so)."})

    def __post_init__(self):
        check_field_types(self)
        check_positive("temperature", self.temperature, owner="SourceAnchorConfig")
        if self.source_confidence is not None and not (self.ensemble_weight > 0 and 0.0 < self.source_confidence <= 1.0):
            raise ValueError("SourceAnchorConfig `source_confidence` must be in (0, 1] and needs ensemble_weight > 0 (it "
                             "chooses which queries keep the source's scores in the mix); got source_confidence="
                             f"{self.source_confidence}, ensemble_weight={self.ensemble_weight}.")
        check_choice("source_confidence_scope", self.source_confidence_scope, SOURCE_CONFIDENCE_SCOPES,
                     owner="SourceAnchorConfig")
        if self.source_confidence_scope != "mix" and self.source_confidence is None:
            raise ValueError("SourceAnchorConfig `source_confidence_scope` needs `source_confidence` (the threshold it "
                             f"applies); got source_confidence_scope={self.source_confidence_scope!r} without it.")
        a = self.adapted_agreement
        if a is not None and not (isinstance(a, (int, float)) and not isinstance(a, bool) and 0.0 <= a < 1.0):
            raise ValueError("SourceAnchorConfig `adapted_agreement` must be a number in [0, 1) (1 would never hand a "
                             f"batch back to the source); got adapted_agreement={a!r}.")
        band = self.mix_agreement
        if band is not None and not (self.ensemble_weight > 0 and len(band) == 2 and all(
                isinstance(x, (int, float)) and not isinstance(x, bool) for x in band) and 0.0 <= band[0] <= band[1] <= 1.0):
            raise ValueError("SourceAnchorConfig `mix_agreement` must be [low, high] with 0 <= low <= high <= 1 and needs "
                             f"ensemble_weight > 0 (it chooses which batches get the mix); got mix_agreement={band}, "
                             f"ensemble_weight={self.ensemble_weight}.")
        if not 0.0 <= self.ensemble_weight < 1.0:
            raise ValueError(f"SourceAnchorConfig `ensemble_weight` must be in [0, 1) (1 would be the adapted answer "
                             f"alone, i.e. no anchor); got {self.ensemble_weight}.")
        if not 0.0 <= self.momentum < 1.0:
            raise ValueError(f"SourceAnchorConfig `momentum` must be in [0, 1) (1 would never move); got {self.momentum}.")
        if not -1.0 < self.margin < 1.0:
            raise ValueError(f"SourceAnchorConfig `margin` must be in (-1, 1) (a difference of probabilities); got {self.margin}.")
