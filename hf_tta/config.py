"""``TTAConfig``: everything the wrapper needs to know, serialisable to ``tta_config.json``."""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass, field
from typing import Any, Mapping

from .configuration_utils import ConfigMixin, check_choice, check_field_types, check_positive, check_positive_int
from .models.base import MODALITIES
from .objectives.base import ObjectiveConfig, get_objective_class
from .preset import RECOMMENDED
from .update_budget import UpdateBudgetConfig, build_update_budget_config

AUTOCAST_DTYPES = ("bf16", "fp16")
RESET_POLICIES = ("never", "episodic")
TUNINGS = ("ln", "bias", "lora")  # hf_tta.tuning
SCORING = ("after_update", "before_update")
#: Config fields that say how to run, not what the adapted state means: a checkpoint loads across them (a checkpoint
#: saved without the safety layer loads into a wrapper with it, whose monitors then start fresh).
RUN_ONLY_FIELDS = ("fast_step", "gallery_batch_size", "safety", "scoring", "gradient_checkpointing")


@dataclass
class SafetyConfig(ConfigMixin):
    """Thresholds of the safety layer (see :mod:`hf_tta.safety` for the rule). Defaults are set a priori, before
    any tuning; every threshold can be switched off (the value given in its help).

    Example:
        >>> cfg = SafetyConfig(min_agreement=0.3)
        >>> SafetyConfig.from_dict(cfg.to_dict()) == cfg
        True
    """

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
    known = {f.name for f in dataclasses.fields(SafetyConfig)}
    unknown = sorted(set(value) - known)
    if unknown:
        raise ValueError(f"`safety` has keys {unknown} that SafetyConfig does not define; valid keys: {sorted(known)}.")
    return SafetyConfig(**value)



@dataclass
class TTAConfig(ConfigMixin):
    """Configuration of a :class:`~hf_tta.TTAWrapper`.

    Defaults follow TCR's reference code (Li et al., ICLR 2025): continual adaptation, 3 AdamW steps per batch,
    weight decay 1e-4, the learning rate of the query modality and architecture (3e-4 for image queries, 3e-5 for
    BLIP-style text queries, 3e-4 for CLIP text), LayerNorm affine parameters of the query tower only.

    Example:
        >>> cfg = TTAConfig(objective="tcr", query_modality="image", objective_config={"tau": 0.02})
        >>> TTAConfig.from_dict(cfg.to_dict()) == cfg
        True
    """

    config_file_name = "tta_config.json"

    objective: str = field(default="tcr", metadata={"help": "Registered objective name (see hf_tta.available_objectives())."})
    objective_config: dict[str, Any] = field(
        default_factory=dict,
        metadata={"help": "Overrides of the objective's hyper-parameters (its dataclass config holds the paper defaults)."},
    )
    query_modality: str = field(default="image", metadata={"help": "Modality of the query stream: image, text, audio or video."})
    gallery_modality: str | None = field(
        default=None, metadata={"help": "Modality of the gallery; None = the model's other modality."}
    )
    steps: int = field(default=3, metadata={"help": "Gradient steps per incoming batch (TCR code: --tta_steps 3)."})
    lr: float | None = field(
        default=None, metadata={"help": "AdamW learning rate; None = the papers' default for this model and query modality."}
    )
    weight_decay: float = field(default=1e-4, metadata={"help": "AdamW weight decay (TCR code: 1e-4)."})
    reset_policy: str = field(
        default="never",
        metadata={"help": "'never' = continual adaptation over the stream (TCR); 'episodic' = reset after every batch."},
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
    tuning: str = field(
        default="ln",
        metadata={
            "help": "How the selected modules adapt (hf_tta.tuning): 'ln' = all their parameters (PEFT LN tuning; the "
            "papers' choice on norm layers), 'bias' = their biases only (BitFit; default selection: every module of the "
            "query tower with a bias), 'lora' = a rank-`lora_rank` LoRA update of each selected Linear/Conv."
        },
    )
    lora_rank: int = field(default=4, metadata={"help": "LoRA rank r with tuning='lora' (lora_alpha = r: scale 1)."})
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
    consistency_weight: float = field(
        default=0.0,
        metadata={
            "help": "Consistency with the source model's predictions added to every step's loss: consistency_weight * "
            "mean KL(p_source || p_adapted) over each query's `consistency_top_k` source top items at temperature "
            "`consistency_temperature` (hf_tta.tuning.SourceConsistency); 0 = off (the papers' methods)."
        },
    )
    consistency_top_k: int = field(default=5, metadata={"help": "Source top-k items the consistency term compares."})
    consistency_temperature: float = field(
        default=0.01, metadata={"help": "Temperature of the consistency term's softmax over the top-k scores."}
    )
    gallery_batch_size: int = field(default=256, metadata={"help": "Chunk size when encoding the gallery (no grad)."})
    autocast_dtype: str | None = field(
        default=None, metadata={"help": "Mixed precision for the query forward: 'bf16', 'fp16' or None (fp32)."}
    )
    gradient_checkpointing: bool = field(
        default=False,
        metadata={
            "help": "Recompute the query tower's transformer layers in the backward pass (transformers' activation "
            "checkpointing): ViT-B/16 CLIP at batch 64 peaks at 2.5 GiB instead of 7.6 GiB on CPU "
            "(recipes/memory_peak.py), one extra forward per step, identical gradients."
        },
    )
    seed: int = field(default=0, metadata={"help": "Seed of the wrapper's RNG (used by objectives that sample)."})
    fast_step: bool | None = field(
        default=None,
        metadata={
            "help": "One host sync per adapt_step: fused AdamW, with steps that select nothing or are non-finite skipped "
            "on the device (a non-finite step rolls the batch back and replays it with per-step checks, so results "
            "equal the checked loop). None = on when the model is on CUDA; False = the per-step checked loop."
        },
    )
    gradient_decoupling: bool = field(
        default=False,
        metadata={
            "help": "REST's gradient decoupling (Eq. 15-17) around any gradient objective: the gradient's component that "
            "conflicts with the gradient of KL(source prediction || adapted prediction) is removed and the update is "
            "scaled by exp(-KL). The source prediction comes from the frozen source model (PEFT disable-adapter) over "
            "the objective's own candidates. REST uses it under diverse query shift."
        },
    )
    gd_weight_on: str = field(
        default="step_size",
        metadata={
            "help": "Where gradient decoupling's weight W_d = exp(-KL) acts: 'step_size' (default) multiplies the "
            "learning rate of that step by W_d, so the AdamW update shrinks by exactly W_d (AdamW ignores a constant "
            "scale on the gradient); 'gradient' multiplies the gradient (REST Eq. 17 literally, almost no effect "
            "under AdamW)."
        },
    )
    gd_per_tensor: bool = field(
        default=False,
        metadata={
            "help": "Project each adapted tensor's gradient separately; default False = one flattened vector of all "
            "adapted parameters."
        },
    )
    score_transform: str | None = field(
        default=None,
        metadata={
            "help": "A training-free objective applied on top of the output scores of any objective: 'dn' "
            "(Distribution Normalization), 'nnn' (Nearest Neighbor Normalization) or 'qbnorm' (QB-Norm's Dynamic "
            "Inverted Softmax). It changes scoring only; its state is saved and reset with the wrapper's."
        },
    )
    score_transform_config: dict[str, Any] = field(
        default_factory=dict, metadata={"help": "Overrides of the score transform's hyper-parameters."}
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
    window: int = field(
        default=0,
        metadata={
            "help": "Recent queries whose detached embeddings join each batch's batch-level statistics (hf_tta.window): "
            "TCR's refined prediction, uniformity, gap and queue, the tcr_port entropy thresholds of EATA/SAR/DeYO and "
            "the safety layer's signals, so micro-batches of 1-8 queries get full-batch statistics while gradients flow "
            "only through the current queries (e.g. 64 - batch size). 0 = off: the papers' per-batch statistics."
        },
    )
    safety: dict[str, Any] | None = field(
        default=None,
        metadata={
            "help": "The safety layer (hf_tta.safety): None = off (default: the papers' methods as published; "
            "TTAConfig.recommended turns it on); a dict of SafetyConfig "
            "overrides ({} = the defaults) or a SafetyConfig turns it on. It rolls back or resets adaptation that "
            "label-free signals flag and returns the source model's scores for flagged batches; around a "
            "training-free objective (dn) it keeps degenerate batches out of its state."
        },
    )
    update_budget: dict[str, Any] | None = field(
        default=None,
        metadata={
            "help": "Adapt on some batches only, answer every batch (hf_tta.update_budget): None = every batch (the "
            "papers); {'fraction': f} = an evenly spaced share f of the batches; {'entropy_threshold': t} = only "
            "batches whose mean normalised prediction entropy exceeds t. A skipped batch costs one no-grad forward "
            "and changes nothing adapted."
        },
    )

    def __post_init__(self):
        get_objective_class(self.objective)  # raises with the list of available objectives
        if isinstance(self.objective_config, ObjectiveConfig):
            self.objective_config = self.objective_config.to_dict()
        if not isinstance(self.objective_config, dict):
            raise TypeError("`objective_config` must be a dict of hyper-parameter overrides or an ObjectiveConfig.")
        if isinstance(self.score_transform_config, ObjectiveConfig):
            self.score_transform_config = self.score_transform_config.to_dict()
        if isinstance(self.safety, SafetyConfig):
            self.safety = self.safety.to_dict()
        if isinstance(self.update_budget, UpdateBudgetConfig):
            self.update_budget = self.update_budget.to_dict()
        check_field_types(self)
        for name in ("query_modality", "gallery_modality"):
            value = getattr(self, name)
            if value is not None and value not in MODALITIES:
                raise ValueError(f"`{name}` must be one of {list(MODALITIES)}, got {value!r}.")
        if self.gallery_modality == self.query_modality:
            raise ValueError("`gallery_modality` must differ from `query_modality` (cross-modal retrieval).")
        if not isinstance(self.steps, int) or self.steps < 1:
            raise ValueError(f"`steps` must be an integer >= 1, got {self.steps!r}.")
        check_positive("lr", self.lr)
        check_positive("weight_decay", self.weight_decay, allow_zero=True)
        check_positive("gallery_batch_size", self.gallery_batch_size)
        check_choice("reset_policy", self.reset_policy, RESET_POLICIES)
        check_choice("tuning", self.tuning, TUNINGS)
        check_positive_int("lora_rank", self.lora_rank)
        check_positive("anchor_weight", self.anchor_weight, allow_zero=True)
        check_positive("consistency_weight", self.consistency_weight, allow_zero=True)
        check_positive_int("consistency_top_k", self.consistency_top_k)
        check_positive("consistency_temperature", self.consistency_temperature)
        if not isinstance(self.lr_multipliers, dict):
            raise TypeError("`lr_multipliers` must be a dict {regex: factor}, e.g. {'pwconv': 0.1}.")
        for pattern, factor in self.lr_multipliers.items():
            check_positive(f"lr_multipliers[{pattern!r}]", factor)
            try:
                re.compile(pattern)
            except re.error as err:
                raise ValueError(f"`lr_multipliers` key {pattern!r} is not a regular expression ({err}).") from None
        check_choice("scoring", self.scoring, SCORING)
        check_choice("gd_weight_on", self.gd_weight_on, ("step_size", "gradient"))
        check_choice("autocast_dtype", self.autocast_dtype, AUTOCAST_DTYPES, allow_none=True)
        if self.autocast_dtype == "fp16":
            raise ValueError(
                "`autocast_dtype='fp16'` needs a gradient scaler that TTAWrapper does not run (fp16 gradients of the "
                "adapted norms underflow); use autocast_dtype='bf16'."
            )
        if self.fast_step is not None and not isinstance(self.fast_step, bool):
            raise TypeError(f"`fast_step` must be True, False or None (auto: on for CUDA), got {self.fast_step!r}.")
        # Validate the overrides now, not at the first batch.
        self.build_objective_config()
        if self.gradient_decoupling and not get_objective_class(self.objective).requires_grad:
            raise ValueError(
                f"`gradient_decoupling=True` needs a gradient objective; {self.objective!r} is training-free."
            )
        if not isinstance(self.score_transform_config, dict):
            raise TypeError("`score_transform_config` must be a dict of hyper-parameter overrides or an ObjectiveConfig.")
        if self.score_transform is not None:
            if get_objective_class(self.score_transform).requires_grad:
                raise ValueError(
                    f"`score_transform` must be a training-free objective ('dn', 'nnn' or 'qbnorm'); {self.score_transform!r} "
                    "trains parameters: use it as `objective` instead."
                )
            self.build_score_transform_config()
        elif self.score_transform_config:
            raise ValueError("`score_transform_config` is set but `score_transform` is None.")
        build_safety_config(self.safety)  # a bad key or value fails now, not at the first batch
        if not isinstance(self.window, int) or isinstance(self.window, bool) or self.window < 0:
            raise ValueError(f"`window` must be an integer >= 0 (0 = off), got {self.window!r}.")
        if self.window and self.reset_policy == "episodic":
            raise ValueError("`window` keeps recent queries across batches; with reset_policy='episodic' it is cleared "
                             "after every batch: set window=0.")
        if self.safety is not None and self.reset_policy == "episodic":
            raise ValueError("`safety` protects a continual stream; with reset_policy='episodic' every batch starts from the source.")
        budget = build_update_budget_config(self.update_budget)
        if budget is not None and not get_objective_class(self.objective).requires_grad:
            raise ValueError(f"`update_budget` limits updates; {self.objective!r} is training-free: drop update_budget.")
        if budget is not None and budget.fraction is not None and self.reset_policy == "episodic":
            raise ValueError("`update_budget={'fraction': ...}` spaces updates by the batch counter, which "
                             "reset_policy='episodic' resets every batch: use {'entropy_threshold': ...} or reset_policy='never'.")

    @classmethod
    def recommended(cls, query_modality: str = "image", **overrides: Any) -> "TTAConfig":
        """The recommended preset (:mod:`hf_tta.preset`): TCR on the query tower's LayerNorms, DN on the scores and the
        safety layer, chosen on seed 0 of the benchmark's selection grid and reported on seeds 1 and 2. ``overrides``
        replace fields.

        Example:
            >>> cfg = TTAConfig.recommended("image")
            >>> (cfg.objective, cfg.score_transform, cfg.safety) == ("tcr", "dn", {})
            True
            >>> TTAConfig.from_dict(cfg.to_dict()) == cfg
            True
        """
        return cls(**{**RECOMMENDED, "query_modality": query_modality, **overrides})

    def mismatch(self, saved: Mapping[str, Any], owner: str = "TTAWrapper") -> str | None:
        """A one-line error when a checkpoint's ``saved`` config differs from this one (both resolved, so a default
        written out on one side equals the same value on the other) in anything but :data:`RUN_ONLY_FIELDS`; ``None``
        if they agree. ``owner`` names the class whose ``from_pretrained`` the message recommends."""

        def plain(config: TTAConfig) -> dict[str, Any]:
            data = json.loads(json.dumps(config.resolved().to_dict(), sort_keys=True))  # JSON's view: str keys, lists
            return {k: v for k, v in data.items() if k not in RUN_ONLY_FIELDS}

        ours = plain(self)
        theirs = plain(TTAConfig.from_dict({k: v for k, v in saved.items() if k in ours or k in RUN_ONLY_FIELDS}))
        diff = [f"{k}: {theirs[k]!r} there, {ours[k]!r} here" for k in sorted(ours) if theirs.get(k) != ours[k]]
        if not diff:
            return None
        return (
            f"The checkpoint was saved with another config ({'; '.join(diff[:3])}{'; ...' if len(diff) > 3 else ''}): "
            f"load it with {owner}.from_pretrained(model, path), which rebuilds the wrapper from the checkpoint's config."
        )

    def build_objective_config(self) -> ObjectiveConfig:
        return _build(self.objective, self.objective_config, "objective_config")

    def build_safety_config(self) -> SafetyConfig | None:
        return build_safety_config(self.safety)

    def build_update_budget_config(self) -> UpdateBudgetConfig | None:
        return build_update_budget_config(self.update_budget)

    def build_score_transform_config(self) -> ObjectiveConfig | None:
        if self.score_transform is None:
            return None
        return _build(self.score_transform, self.score_transform_config, "score_transform_config")

    def resolved(self, **values: Any) -> "TTAConfig":
        """This config with every default written out, as PEFT saves its configs: the objective's, the score
        transform's and the safety layer's full hyper-parameters, plus ``values`` (e.g. the wrapper's resolved ``lr`` and
        ``gallery_modality``). Saved checkpoints keep their meaning when a default changes."""
        transform, safety, budget = self.build_score_transform_config(), self.build_safety_config(), self.build_update_budget_config()
        return dataclasses.replace(
            self,
            objective_config=self.build_objective_config().to_dict(),
            score_transform_config=transform.to_dict() if transform is not None else {},
            safety=safety.to_dict() if safety is not None else None,
            update_budget=budget.to_dict() if budget is not None else None,
            **values,
        )


def _build(name: str, overrides: dict[str, Any], field_name: str) -> ObjectiveConfig:
    config_class = get_objective_class(name).config_class
    known = {f.name for f in dataclasses.fields(config_class)}
    unknown = sorted(set(overrides) - known)
    if unknown:
        raise ValueError(
            f"`{field_name}` has keys {unknown} that {config_class.__name__} does not define; valid keys: {sorted(known)}."
        )
    return config_class(**overrides)
