"""The optional features of a :class:`~hf_tta.TTAConfig`, each a dataclass of its own fields, grouped the way
``peft`` groups a tuner's fields in its ``LoraConfig``: what adapts (:class:`TuningConfig`), REST's gradient decoupling
(:class:`GradientDecouplingConfig`), the pull towards the source's predictions (:class:`ConsistencyConfig`), the safety
layer (:class:`SafetyConfig`), the update budget (:class:`UpdateBudgetConfig`), the shift gate (:class:`ShiftGateConfig`),
weight ensembling with the source (:class:`WeightEnsembleConfig`), source-anchored answers (:class:`SourceAnchorConfig`)
and how a wrapper runs (:class:`RunConfig`).

A feature is on when its config is present (``TTAConfig(consistency=ConsistencyConfig(weight=1.0))``), so a field of
a feature that is off cannot be set; within :class:`TuningConfig` the LoRA rank is refused unless the method is
``"lora"``. Configs whose classes set ``loads_across_checkpoints`` (:class:`RunConfig`, :class:`SafetyConfig`) say how
to run, not what the adapted state means: a checkpoint loads across them.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any, ClassVar, Mapping

from .config_anchor import SourceAnchorConfig  # noqa: F401  (re-exported: a feature config like the others)
from .configuration_utils import (
    ConfigMixin,
    check_choice,
    check_field_types,
    check_known_keys,
    check_positive,
    check_positive_int,
)

TUNINGS = ("ln", "bias", "lora")  # hf_tta.tuning
SCORING = ("after_update", "before_update")
GD_WEIGHT_ON = ("step_size", "gradient")
#: The shift gate's statistics (:class:`ShiftGateConfig`, :mod:`hf_tta.shift_gate`).
GATE_STATISTICS = ("per_query", "batch_mean")
#: The LoRA rank of ``TuningConfig(method="lora")`` when ``lora_rank`` is left out.
DEFAULT_LORA_RANK = 4


@dataclass
class TuningConfig(ConfigMixin):
    """What adapts and how (:mod:`hf_tta.tuning`). The defaults are the papers' choice: every parameter of the query
    tower's normalisation layers.

    Example:
        >>> TuningConfig(method="lora", target_modules=".*mlp.fc[12]", lora_rank=8).resolved_lora_rank
        8
        >>> TuningConfig(lora_rank=8)
        Traceback (most recent call last):
        ...
        ValueError: TuningConfig `lora_rank` applies to method='lora' only (here method='ln'): drop it or set method='lora'.
    """

    loads_across_checkpoints: ClassVar[bool] = False

    method: str = field(
        default="ln",
        metadata={
            "help": "How the selected modules adapt (hf_tta.tuning): 'ln' = all their parameters (PEFT LN tuning; the "
            "papers' choice on norm layers), 'bias' = their biases only (BitFit; default selection: every module of the "
            "query tower with a bias), 'lora' = a rank-`lora_rank` LoRA update of each selected Linear/Conv."
        },
    )
    target_modules: list[str] | str | None = field(
        default=None,
        metadata={
            "help": "Modules to adapt (PEFT semantics: a regex that full-matches, or a list of names/suffixes). "
            "None = the normalisation layers of the query tower."
        },
    )
    exclude_modules: list[str] | str | None = field(
        default=None, metadata={"help": "Modules never to adapt (same semantics as target_modules)."}
    )
    lora_rank: int | None = field(
        default=None,
        metadata={"help": f"LoRA rank r with method 'lora' (lora_alpha = r: scale 1; default {DEFAULT_LORA_RANK}); refused with another method."},
    )
    lr_multipliers: dict[str, float] = field(
        default_factory=dict,
        metadata={
            "help": "Per-group learning rates: {regex: factor}, searched in each adapted parameter's name, first match "
            "wins, others x1; e.g. {'pwconv': 0.1} moves the MLPs ten times slower than the norms."
        },
    )
    anchor_weight: float = field(
        default=0.0,
        metadata={
            "help": "L2-SP pull towards the source weights added to every step's loss: (anchor_weight / 2) * "
            "sum ||theta - theta_source||^2 (for LoRA: ||delta W||_F^2); 0 = off (the papers' methods)."
        },
    )

    def __post_init__(self):
        check_field_types(self)
        check_choice("method", self.method, TUNINGS, owner="TuningConfig")
        if self.lora_rank is not None:
            if self.method != "lora":
                raise ValueError(f"TuningConfig `lora_rank` applies to method='lora' only (here method={self.method!r}): "
                                 "drop it or set method='lora'.")
            check_positive_int("lora_rank", self.lora_rank, owner="TuningConfig")
        if self.method == "lora" and self.target_modules is None:
            raise ValueError("TuningConfig `target_modules` is required with method='lora': name the Linear/Conv layers "
                             "to adapt, e.g. target_modules='.*vision_model.*mlp.fc[12]'.")
        check_positive("anchor_weight", self.anchor_weight, allow_zero=True, owner="TuningConfig")
        for pattern, factor in self.lr_multipliers.items():
            if not isinstance(factor, (int, float)) or isinstance(factor, bool):
                raise TypeError(f"TuningConfig `lr_multipliers[{pattern!r}]` must be a number, got {factor!r}.")
            check_positive(f"lr_multipliers[{pattern!r}]", factor, owner="TuningConfig")
            try:
                re.compile(pattern)
            except re.error as err:
                raise ValueError(f"TuningConfig `lr_multipliers` key {pattern!r} is not a regular expression ({err}).") from None

    @property
    def resolved_lora_rank(self) -> int | None:
        """The LoRA rank in use (``lora_rank`` or :data:`DEFAULT_LORA_RANK`); ``None`` unless the method is LoRA."""
        if self.method != "lora":
            return None
        return self.lora_rank if self.lora_rank is not None else DEFAULT_LORA_RANK


@dataclass
class ConsistencyConfig(ConfigMixin):
    """Consistency with the source model's predictions, added to every step's loss: ``weight * mean KL(p_source ||
    p_adapted)`` over each query's ``top_k`` source top items at ``temperature``
    (:class:`hf_tta.tuning.SourceConsistency`). Present = on; ``TTAConfig(consistency=None)`` (default) = off, the
    papers' methods.

    Example:
        >>> ConsistencyConfig(weight=1.0).to_dict() == {"weight": 1.0, "top_k": 5, "temperature": 0.01}
        True
    """

    loads_across_checkpoints: ClassVar[bool] = False

    weight: float = field(metadata={"help": "Weight of the KL term (> 0)."})
    top_k: int = field(default=5, metadata={"help": "Source top-k items the consistency term compares."})
    temperature: float = field(
        default=0.01, metadata={"help": "Temperature of the consistency term's softmax over the top-k scores."}
    )

    def __post_init__(self):
        check_field_types(self)
        check_positive("weight", self.weight, owner="ConsistencyConfig")
        check_positive_int("top_k", self.top_k, owner="ConsistencyConfig")
        check_positive("temperature", self.temperature, owner="ConsistencyConfig")


@dataclass
class GradientDecouplingConfig(ConfigMixin):
    """REST's gradient decoupling (Eq. 15-17, :mod:`hf_tta.gradient_decoupling`) around any gradient objective: the
    gradient's component that conflicts with the gradient of KL(source prediction || adapted prediction) is removed
    and the update is scaled by exp(-KL). Present = on (``TTAConfig(gradient_decoupling=True)`` is short for
    ``GradientDecouplingConfig()``).

    Example:
        >>> GradientDecouplingConfig(weight_on="gradient").per_tensor
        False
    """

    loads_across_checkpoints: ClassVar[bool] = False

    weight_on: str = field(
        default="step_size",
        metadata={
            "help": "Where gradient decoupling's weight W_d = exp(-KL) acts: 'step_size' (default) multiplies the "
            "learning rate of that step by W_d, so the AdamW update shrinks by exactly W_d (AdamW ignores a constant "
            "scale on the gradient); 'gradient' multiplies the gradient (REST Eq. 17 literally, almost no effect "
            "under AdamW)."
        },
    )
    per_tensor: bool = field(
        default=False,
        metadata={
            "help": "Project each adapted tensor's gradient separately; default False = one flattened vector of all "
            "adapted parameters."
        },
    )

    def __post_init__(self):
        check_field_types(self)
        check_choice("weight_on", self.weight_on, GD_WEIGHT_ON, owner="GradientDecouplingConfig")


@dataclass
class RunConfig(ConfigMixin):
    """How a wrapper runs, not what its adapted state means: a checkpoint loads across these settings.

    Example:
        >>> RunConfig(scoring="before_update").gallery_batch_size
        256
    """

    loads_across_checkpoints: ClassVar[bool] = True

    gallery_batch_size: int = field(default=256, metadata={"help": "Chunk size when encoding the gallery (no grad)."})
    fast_step: bool | None = field(
        default=None,
        metadata={
            "help": "One host sync per adapt_step: fused AdamW, with steps that select nothing or are non-finite skipped "
            "on the device (a non-finite step rolls the batch back and replays it with per-step checks, so results "
            "equal the checked loop). None = on when the model is on CUDA; False = the per-step checked loop."
        },
    )
    scoring: str = field(
        default="after_update",
        metadata={
            "help": "Which model answers a batch: 'after_update' (the papers' protocol: the forward of the last step) "
            "or 'before_update' (one no-grad forward of the current model answers, then the batch is adapted on: "
            "the answer never waits for a backward pass; the parameter trajectory is the same). With a supervised "
            "objective ('oracle') 'before_update' is the prequential protocol: each batch is scored before its labels "
            "train the model."
        },
    )
    gradient_checkpointing: bool = field(
        default=False,
        metadata={
            "help": "Recompute the query tower's transformer layers in the backward pass (transformers' activation "
            "checkpointing): ViT-B/16 CLIP at batch 64 peaks at 2.5 GiB instead of 7.6 GiB on CPU "
            "(recipes/memory_peak.py), one extra forward per step, identical gradients."
        },
    )

    def __post_init__(self):
        check_field_types(self)
        check_positive_int("gallery_batch_size", self.gallery_batch_size, owner="RunConfig")
        check_choice("scoring", self.scoring, SCORING, owner="RunConfig")


@dataclass
class SafetyConfig(ConfigMixin):
    """Thresholds of the safety layer (see :mod:`hf_tta.safety` for the rule). Defaults are set a priori, before
    any tuning; every threshold can be switched off (the value given in its help).

    Example:
        >>> cfg = SafetyConfig(min_agreement=0.3)
        >>> SafetyConfig.from_dict(cfg.to_dict()) == cfg
        True
    """

    loads_across_checkpoints: ClassVar[bool] = True  # a checkpoint saved without it loads; the monitors start fresh

    min_queries: int = field(
        default=8, metadata={"help": "Batches with fewer queries are adapted on without judgement (noisy signals)."}
    )
    min_source_diversity: float = field(
        default=0.1,
        metadata={
            "help": "A batch whose source top-1 diversity ((distinct - 1) / (B - 1)) is below this is degenerate and "
            "not adapted on (any value > 0 flags a batch whose queries all retrieve one item). 0 disables."
        },
    )
    collapse_ratio: float = field(
        default=0.5,
        metadata={"help": "Adapted diversity < collapse_ratio x source diversity = collapse: reset. 0 disables."},
    )
    min_agreement: float = field(
        default=0.2, metadata={"help": "Adapted-vs-source top-1 agreement below this floor: rollback. 0 disables."}
    )
    max_agreement_drop: float = field(
        default=0.5,
        metadata={"help": "Agreement < (1 - max_agreement_drop) x its EMA over kept batches: rollback. 1 disables."},
    )
    agreement_ema_decay: float = field(
        default=0.9, metadata={"help": "Decay of the agreement's EMA (the first kept batch initialises it)."}
    )
    max_rollbacks: int = field(
        default=3, metadata={"help": "This many rollbacks in a row reset to the source model instead."}
    )
    snapshot_every: int = field(
        default=1, metadata={"help": "Refresh the last-good snapshot after this many kept batches in a row."}
    )
    entropy_temperature: float = field(
        default=0.01, metadata={"help": "Temperature of the logged refined-prediction entropy (a log, not a trigger)."}
    )

    def __post_init__(self):
        check_field_types(self)
        for name in ("min_queries", "max_rollbacks", "snapshot_every"):
            check_positive_int(name, getattr(self, name), owner="SafetyConfig")
        ranges = {
            "min_source_diversity": (0.0, 1.0, "[0, 1]", True),
            "collapse_ratio": (0.0, 1.0, "[0, 1]", True),
            "min_agreement": (0.0, 1.0, "[0, 1]", True),
            "max_agreement_drop": (0.0, 1.0, "(0, 1]", True),
            "agreement_ema_decay": (0.0, 1.0, "[0, 1)", False),
        }
        for name, (lo, hi, text, hi_ok) in ranges.items():
            value = getattr(self, name)
            ok = isinstance(value, (int, float)) and not isinstance(value, bool) and lo <= value <= hi
            ok = ok and (hi_ok or value < hi) and not (name == "max_agreement_drop" and value == 0)
            if not ok:
                raise ValueError(f"SafetyConfig `{name}` must be in {text}, got {value!r}.")
        if not isinstance(self.entropy_temperature, (int, float)) or not self.entropy_temperature > 0:
            raise ValueError(f"SafetyConfig `entropy_temperature` must be > 0, got {self.entropy_temperature!r}.")


def build_safety_config(value: SafetyConfig | Mapping[str, Any] | None) -> SafetyConfig | None:
    """``TTAConfig.safety`` (``None``, a dict of overrides or a :class:`SafetyConfig`) as a :class:`SafetyConfig`."""
    if value is None or isinstance(value, SafetyConfig):
        return value
    if not isinstance(value, Mapping):
        raise TypeError(f"`safety` must be None, a dict of SafetyConfig overrides or a SafetyConfig, got {value!r}.")
    check_known_keys(SafetyConfig, value, where="`safety`: ")
    return SafetyConfig(**value)


@dataclass
class ShiftGateConfig(ConfigMixin):
    """The shift gate (:mod:`hf_tta.shift_gate`). It decides which batches adapt, not what an adapted state means, so a
    checkpoint loads across its settings (the reference it saved comes with it).

    Example:
        >>> ShiftGateConfig.from_dict(ShiftGateConfig(threshold=3.0).to_dict()).threshold
        3.0
    """

    loads_across_checkpoints: ClassVar[bool] = True

    threshold: float = field(
        default=1.5,
        metadata={"help": "The gate opens (the batch adapts) when its mean squared z-score of the source model's style "
                  "statistics against the reference exceeds this (about 1 on reference-like batches)."},
    )
    statistic: str = field(
        default="per_query",
        metadata={"help": "'per_query': the batch's mean over queries of each query's mean squared z-score (how far each "
                  "query is from the reference); 'batch_mean': the mean over features of the squared z-score of the "
                  "batch's mean, (mean_i f_id - mu_d)^2 / (var_d / B), a two-sample test of the batch against the "
                  "reference (how sure it is that the batch as a whole moved). Both are about 1 on reference-like batches."},
    )
    min_reference: int = field(
        default=32, metadata={"help": "fit_shift_gate refuses fewer reference queries than this (a variance of few is noise)."}
    )

    def __post_init__(self):
        check_field_types(self)
        check_positive("threshold", self.threshold, owner="ShiftGateConfig")
        check_choice("statistic", self.statistic, GATE_STATISTICS)
        if self.min_reference < 2:
            raise ValueError(f"ShiftGateConfig `min_reference` must be at least 2 (a variance needs two queries); got {self.min_reference}.")


@dataclass
class WeightEnsembleConfig(ConfigMixin):
    """Weight ensembling with the source (:mod:`hf_tta.weight_ensemble`).

    Example:
        >>> WeightEnsembleConfig.from_dict({"momentum": 0.9}).momentum
        0.9
    """

    momentum: float = field(
        default=0.99, metadata={"help": "m in theta <- m theta + (1 - m) theta_source after each updated batch (ROID: 0.99)."}
    )

    def __post_init__(self):
        check_field_types(self)
        if not 0.0 <= self.momentum < 1.0:
            raise ValueError(f"WeightEnsembleConfig `momentum` must be in [0, 1) (1 would never pull); got {self.momentum}.")


def build_feature_config(name: str, cls: type, value: Any) -> Any:
    """``TTAConfig.<name>`` (``None``, a dict of ``cls``'s fields, or a ``cls``) as a ``cls`` or ``None``; an unknown
    key is refused in one line naming the closest field."""
    if value is None or isinstance(value, cls):
        return value
    if not isinstance(value, Mapping):
        raise TypeError(f"`{name}` must be None, a dict of {cls.__name__} fields or a {cls.__name__}, got {value!r}.")
    check_known_keys(cls, value, where=f"`{name}`: ")
    return cls(**value)


DEFAULT_TEMPERATURE = 0.01


@dataclass
class UpdateBudgetConfig(ConfigMixin):
    """Which batches are adapted on (see :mod:`hf_tta.update_budget`): set exactly one of ``fraction`` and
    ``entropy_threshold``.

    Example:
        >>> cfg = UpdateBudgetConfig(fraction=0.25)
        >>> [i for i in range(10) if cfg.adapts_on(i)]
        [0, 4, 8]
        >>> UpdateBudgetConfig.from_dict(cfg.to_dict()) == cfg
        True
    """

    fraction: float | None = field(
        default=None,
        metadata={"help": "Adapt on this share of the batches, in (0, 1], evenly spaced by the batch counter (batch 0 first)."},
    )
    entropy_threshold: float | None = field(
        default=None,
        metadata={
            "help": "Adapt only on batches whose mean normalised prediction entropy H(softmax(s / T)) / ln C, from "
            "the current model's one no-grad forward, exceeds this value in [0, 1)."
        },
    )
    entropy_temperature: float = field(
        default=DEFAULT_TEMPERATURE,
        metadata={"help": "T of the entropy trigger's softmax over the gallery (0.01: TCR's gallery softmax)."},
    )

    def __post_init__(self):
        check_field_types(self)
        if (self.fraction is None) == (self.entropy_threshold is None):
            raise ValueError(
                "UpdateBudgetConfig needs exactly one rule: `fraction` (a share of the batches) or `entropy_threshold` "
                f"(a label-free trigger); got fraction={self.fraction!r}, entropy_threshold={self.entropy_threshold!r}."
            )
        if self.fraction is not None and not 0.0 < self.fraction <= 1.0:
            raise ValueError(f"UpdateBudgetConfig `fraction` must be in (0, 1], got {self.fraction!r}.")
        if self.entropy_threshold is not None and not 0.0 <= self.entropy_threshold < 1.0:
            raise ValueError(f"UpdateBudgetConfig `entropy_threshold` must be in [0, 1), got {self.entropy_threshold!r}.")
        check_positive("entropy_temperature", self.entropy_temperature)
        if self.entropy_threshold is None and self.entropy_temperature != DEFAULT_TEMPERATURE:
            raise ValueError("UpdateBudgetConfig `entropy_temperature` applies to the entropy trigger: set "
                             "`entropy_threshold` or drop `entropy_temperature`.")

    def adapts_on(self, batch_index: int) -> bool:
        """The ``fraction`` rule: whether batch ``batch_index`` (0-based, since the last reset) is adapted on."""
        if self.fraction is None:
            raise ValueError("adapts_on is the fraction rule; this budget has an entropy trigger.")
        f = Fraction(self.fraction).limit_denominator(10**9)  # exact: 0.1 * 30 is not 3 in floating point
        return math.ceil((batch_index + 1) * f) > math.ceil(batch_index * f)


def build_update_budget_config(value: UpdateBudgetConfig | Mapping[str, Any] | None) -> UpdateBudgetConfig | None:
    """``TTAConfig.update_budget`` (``None``, a dict or an :class:`UpdateBudgetConfig`) as an :class:`UpdateBudgetConfig`."""
    if value is None or isinstance(value, UpdateBudgetConfig):
        return value
    if not isinstance(value, Mapping):
        raise TypeError(f"`update_budget` must be None, a dict of UpdateBudgetConfig fields or an UpdateBudgetConfig, got {value!r}.")
    known = {f.name for f in dataclasses.fields(UpdateBudgetConfig)}
    unknown = sorted(set(value) - known)
    if unknown:
        raise ValueError(f"`update_budget` has keys {unknown} that UpdateBudgetConfig does not define; valid keys: {sorted(known)}.")
    return UpdateBudgetConfig(**value)
