"""``TTAConfig``: everything the wrapper needs to know, serialisable to ``tta_config.json``.

Its optional features are configs of their own (:mod:`hf_tta.config_features`, grouped as ``peft`` groups a tuner's
fields): ``tuning`` (:class:`TuningConfig`), ``gradient_decoupling`` (:class:`GradientDecouplingConfig` or ``None``),
``consistency`` (:class:`ConsistencyConfig` or ``None``), ``safety`` (:class:`SafetyConfig` overrides or ``None``) and
``run`` (:class:`RunConfig`: how to run, which a checkpoint loads across). The flat spelling of hf_tta 0.1 and of the
command line (``lora_rank=8``) converts in one place, :func:`hf_tta.config_flat.nest`.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
from dataclasses import dataclass, field
from typing import Any, Mapping

from .config_features import (
    DEFAULT_LORA_RANK,
    SCORING,
    TUNINGS,
    ConsistencyConfig,
    GradientDecouplingConfig,
    RunConfig,
    SafetyConfig,
    ShiftGateConfig,
    SourceAnchorConfig,
    TuningConfig,
    UpdateBudgetConfig,
    WeightEnsembleConfig,
    build_feature_config,
    build_safety_config,
    build_update_budget_config,
)
from .config_flat import FLAT_FIELDS, flat_keys, nest
from .configuration_utils import (
    ConfigMixin,
    ConfigTypeError,
    check_choice,
    check_field_types,
    check_known_keys,
    check_positive,
)
from .lr_search_config import LRSearchConfig
from .models.base import MODALITIES
from .objectives.base import ObjectiveConfig, get_objective_class
from .preset import recommended_fields

logger = logging.getLogger(__name__)

__all__ = [
    "TTAConfig", "TuningConfig", "GradientDecouplingConfig", "ConsistencyConfig", "SafetyConfig", "RunConfig",
    "LRSearchConfig", "ShiftGateConfig", "SourceAnchorConfig", "WeightEnsembleConfig", "build_safety_config", "DEFAULT_LORA_RANK", "SCORING", "TUNINGS", "AUTOCAST_DTYPES", "RESET_POLICIES",
]

AUTOCAST_DTYPES = ("bf16", "fp16")
RESET_POLICIES = ("never", "episodic")
#: The key of a checkpoint's ``tta_config.json`` that keeps the config as the user gave it (the rest is resolved).
AS_GIVEN = "as_given"


@dataclass
class TTAConfig(ConfigMixin):
    """Configuration of a :class:`~hf_tta.TTAWrapper`.

    Defaults follow TCR's reference code (Li et al., ICLR 2025): continual adaptation, 3 AdamW steps per batch,
    weight decay 1e-4, the learning rate of the query modality and architecture (3e-4 for image queries, 3e-5 for
    BLIP-style text queries, 3e-4 for CLIP text), LayerNorm affine parameters of the query tower only.

    Example:
        >>> cfg = TTAConfig(objective="tcr", query_modality="image", objective_config={"tau": 0.02},
        ...                 tuning=TuningConfig(method="lora", target_modules=".*mlp.fc[12]", lora_rank=8),
        ...                 consistency=ConsistencyConfig(weight=1.0))
        >>> TTAConfig.from_dict(cfg.to_dict()) == cfg
        True
        >>> cfg.to_dict()["tuning"]["lora_rank"], cfg.to_dict()["gradient_decoupling"]
        (8, None)
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
        default=None,
        metadata={"help": "AdamW learning rate; None = the papers' default for this model and query modality (to choose "
                          "it online without labels, set lr_search; 'auto' was removed by protocol v4, issue 48)."},
    )
    weight_decay: float = field(default=1e-4, metadata={"help": "AdamW weight decay (TCR code: 1e-4)."})
    reset_policy: str = field(
        default="never",
        metadata={"help": "'never' = continual adaptation over the stream (TCR); 'episodic' = reset after every batch."},
    )
    tuning: TuningConfig = field(
        default_factory=TuningConfig,
        metadata={
            "config_class": TuningConfig,
            "help": "What adapts and how (hf_tta.tuning): a TuningConfig (method 'ln' / 'bias' / 'lora', target_modules, "
            "exclude_modules, lora_rank, lr_multipliers, anchor_weight) or a dict of its fields. Default: every "
            "parameter of the query tower's normalisation layers; a training-free objective takes the default only.",
        },
    )
    gradient_decoupling: GradientDecouplingConfig | None = field(
        default=None,
        metadata={
            "config_class": GradientDecouplingConfig,
            "help": "REST's gradient decoupling (Eq. 15-17) around any gradient objective: a GradientDecouplingConfig "
            "(or a dict of its fields; True = its defaults) turns it on, None = off. The source prediction comes from "
            "the frozen source model over the objective's own candidates. REST uses it under diverse query shift.",
        },
    )
    consistency: ConsistencyConfig | None = field(
        default=None,
        metadata={
            "config_class": ConsistencyConfig,
            "help": "A pull towards the source model's predictions added to every step's loss (hf_tta.tuning."
            "SourceConsistency): a ConsistencyConfig (weight, top_k, temperature) or a dict of its fields turns it "
            "on; None = off (the papers' methods).",
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
            "config_class": SafetyConfig,
            "help": "The safety layer (hf_tta.safety): None = off (default: the papers' methods as published; "
            "TTAConfig.recommended turns it on); a dict of SafetyConfig "
            "overrides ({} = the defaults) or a SafetyConfig turns it on. It rolls back or resets adaptation that "
            "label-free signals flag and returns the source model's scores for flagged batches; around a "
            "training-free objective (dn) it keeps degenerate batches out of its state."
        },
    )

    autocast_dtype: str | None = field(
        default=None, metadata={"help": "Mixed precision for the query forward: 'bf16', 'fp16' or None (fp32)."}
    )
    seed: int = field(default=0, metadata={"help": "Seed of the wrapper's RNG (used by objectives that sample)."})
    update_budget: dict[str, Any] | None = field(
        default=None,
        metadata={
            "config_class": UpdateBudgetConfig,
            "help": "Adapt on some batches only, answer every batch (hf_tta.update_budget): None = every batch (the "
            "papers); {'fraction': f} = an evenly spaced share f of the batches; {'entropy_threshold': t} = only "
            "batches whose mean normalised prediction entropy exceeds t. A skipped batch costs one no-grad forward "
            "and changes nothing adapted.",
        },
    )
    shift_gate: dict[str, Any] | None = field(
        default=None,
        metadata={
            "config_class": ShiftGateConfig,
            "help": "The shift gate (hf_tta.shift_gate): None = off; a dict of ShiftGateConfig fields ({} = threshold 1.5) "
            "turns it on: a batch adapts, and the adapted model answers it, only while the source model's style "
            "statistics of its queries are off those of reference clean queries (tta.fit_shift_gate(queries)); "
            "otherwise the source model answers and nothing adapts.",
        },
    )
    weight_ensemble: dict[str, Any] | None = field(
        default=None,
        metadata={
            "config_class": WeightEnsembleConfig,
            "help": "Weight ensembling with the source after each updated batch (hf_tta.weight_ensemble, ROID's): None = "
            "off; {'momentum': m} (default 0.99) pulls every adapted parameter to m theta + (1 - m) theta_source.",
        },
    )
    source_anchor: dict[str, Any] | None = field(
        default=None,
        metadata={
            "config_class": SourceAnchorConfig,
            "help": "Source-anchored answers (hf_tta.source_anchor): None = off; {} turns them on: the adapted model "
            "answers while a moving average of its batch-mean top-1 probability minus the source's exceeds the margin.",
        },
    )
    lr_search: LRSearchConfig | None = field(
        default=None,
        metadata={
            "config_class": LRSearchConfig,
            "help": "Choose the lr online without labels (hf_tta.lr_search, issue 37): an LRSearchConfig (candidates, "
            "probe_batches, proxy, agreement_floor, backoff, online, hypergradient_rate) or a dict of its fields turns "
            "it on ({} = its defaults); the first probe_batches batches adapt one shadow per "
            "candidate lr while the source answers, then the proxy's best becomes the adapted state; online="
            "'hypergradient' then moves the lr at every step. None = off: the lr is fixed.",
        },
    )
    run: RunConfig = field(
        default_factory=RunConfig,
        metadata={
            "config_class": RunConfig,
            "help": "How the wrapper runs (a RunConfig or a dict of its fields: gallery_batch_size, fast_step, scoring, "
            "gradient_checkpointing); a checkpoint loads across these settings.",
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
        if isinstance(self.gradient_decoupling, bool):  # True: the defaults; False: off
            self.gradient_decoupling = GradientDecouplingConfig() if self.gradient_decoupling else None
        if isinstance(self.lr, str) and self.lr == "auto":  # removed by protocol v4's default study (issue 48)
            raise ValueError("TTAConfig(lr='auto') was removed: protocol v4 found a fixed lr better and safer than choosing "
                             "it online; use TTAConfig.recommended(...), or lr_search={} to probe.")
        for name in ("tuning", "gradient_decoupling", "consistency", "lr_search", "run"):
            setattr(self, name, _nested(name, getattr(self, name)))
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
        check_choice("reset_policy", self.reset_policy, RESET_POLICIES)
        check_choice("autocast_dtype", self.autocast_dtype, AUTOCAST_DTYPES, allow_none=True)
        if self.autocast_dtype == "fp16":
            raise ValueError(
                "`autocast_dtype='fp16'` needs a gradient scaler that TTAWrapper does not run (fp16 gradients of the "
                "adapted norms underflow); use autocast_dtype='bf16'."
            )
        # Validate the overrides now, not at the first batch.
        self.build_objective_config()
        if not get_objective_class(self.objective).requires_grad:  # one rule for every training-free objective
            for name, off in (("tuning", TuningConfig()), ("gradient_decoupling", None), ("consistency", None)):
                if getattr(self, name) != off:
                    raise ValueError(f"`{name}` is set but objective {self.objective!r} is training-free (it adapts no "
                                     f"parameters): leave {name} at its default or choose a gradient objective.")
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
        self._check_lr_search(budget)
        self._check_source_anchors()
        if budget is not None and budget.fraction is not None and self.reset_policy == "episodic":
            raise ValueError("`update_budget={'fraction': ...}` spaces updates by the batch counter, which "
                             "reset_policy='episodic' resets every batch: use {'entropy_threshold': ...} or reset_policy='never'.")

    def _check_source_anchors(self) -> None:
        """``shift_gate``, ``weight_ensemble`` and ``source_anchor`` (protocol v4's default study, issue 48) act on a
        gradient objective's updates over a continual stream, and not (yet) inside the lr search's probe."""
        for name, cls in (("shift_gate", ShiftGateConfig), ("weight_ensemble", WeightEnsembleConfig),
                          ("source_anchor", SourceAnchorConfig)):
            value = getattr(self, name)
            if isinstance(value, cls):
                setattr(self, name, value := value.to_dict())
            if build_feature_config(name, cls, value) is None:
                continue
            if not get_objective_class(self.objective).requires_grad:
                raise ValueError(f"`{name}` acts on adaptation; {self.objective!r} is training-free: drop {name}.")
            if self.lr_search is not None:
                raise ValueError(f"`{name}` does not run inside the lr search's probe: drop lr_search or {name}.")
        for name in ("weight_ensemble", "source_anchor"):  # (both act over a continual stream)
            if getattr(self, name) is not None and self.reset_policy == "episodic":
                raise ValueError(f"`{name}` acts over a continual stream; with reset_policy='episodic' every batch "
                                 f"starts from the source: drop {name} or set reset_policy='never'.")
        anchor = self.build_source_anchor_config()
        if anchor is not None and anchor.ensemble_weight > 0 and self.score_transform is not None:
            raise ValueError(f"`source_anchor` ensemble_weight > 0 mixes two models' scores, which score_transform "
                             f"{self.score_transform!r} would recompute from one model's embeddings: set "
                             "ensemble_weight=0 or score_transform=None.")

    def build_shift_gate_config(self) -> ShiftGateConfig | None:
        return build_feature_config("shift_gate", ShiftGateConfig, self.shift_gate)

    def build_weight_ensemble_config(self) -> WeightEnsembleConfig | None:
        return build_feature_config("weight_ensemble", WeightEnsembleConfig, self.weight_ensemble)

    def build_source_anchor_config(self) -> SourceAnchorConfig | None:
        return build_feature_config("source_anchor", SourceAnchorConfig, self.source_anchor)

    def _check_lr_search(self, budget: UpdateBudgetConfig | None) -> None:
        """``lr_search`` needs a gradient objective on a continual stream that adapts on every probe batch."""
        search = self.lr_search
        if search is None:
            return
        if not get_objective_class(self.objective).requires_grad:
            raise ValueError(f"`lr_search` chooses a learning rate; {self.objective!r} is training-free: drop lr_search.")
        if self.reset_policy == "episodic":
            raise ValueError("`lr_search` probes over a continual stream; reset_policy='episodic' resets every batch: "
                             "set reset_policy='never' or drop lr_search.")
        if budget is not None:
            raise ValueError("`lr_search` adapts every candidate on every probe batch; `update_budget` skips batches: "
                             "drop one of them.")
        if search.backoff is not None and self.safety is None:
            raise ValueError("LRSearchConfig `backoff` acts on the safety layer's rollbacks: set safety={} or drop backoff.")

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "TTAConfig":
        """The config of ``data``: :meth:`to_dict`'s output, a checkpoint's ``tta_config.json`` (the config as the user
        gave it, under ``"as_given"``: see :meth:`checkpoint_dict`) or a flat config of hf_tta 0.1 (converted by
        :func:`hf_tta.config_flat.nest`, with a deprecation warning). A key that is no field is refused in one line
        naming the closest field.

        Example:
            >>> TTAConfig.from_dict({"lrr": 1e-3})
            Traceback (most recent call last):
            ...
            ValueError: TTAConfig has no field 'lrr': did you mean 'lr'?
        """
        if not isinstance(data, Mapping):
            raise TypeError(f"TTAConfig.from_dict needs a dict of its fields, got {type(data).__name__}.")
        data = dict(data)
        data.pop("hf_tta_version", None)
        if AS_GIVEN in data:
            return cls._from_checkpoint(data.pop(AS_GIVEN), data)
        check_known_keys(cls, data, extra=FLAT_FIELDS)
        if flat_keys(data):
            data = nest(data, deprecated="This config (a tta_config.json written by hf_tta 0.1?)")
        return cls(**data)

    @classmethod
    def _from_checkpoint(cls, given: Mapping[str, Any], resolved: Mapping[str, Any]) -> "TTAConfig":
        """The config a checkpoint was saved from, unless this version resolves it differently (a default changed):
        then the saved resolved values, so that the checkpoint keeps its meaning (logged)."""
        saved, config = cls.from_dict(resolved), cls.from_dict(given)
        fill = {name: getattr(saved, name) for name in ("lr", "gallery_modality") if getattr(config, name) is None}
        now = config.resolved(**fill)
        if now == saved:
            return config
        diff = [f.name for f in dataclasses.fields(cls) if getattr(now, f.name) != getattr(saved, f.name)]
        logger.warning("The checkpoint's config resolves differently in this version of hf_tta (%s): using the values "
                       "it was saved with.", ", ".join(diff))
        return saved

    def checkpoint_dict(self, **values: Any) -> dict[str, Any]:
        """What a checkpoint's ``tta_config.json`` holds: :meth:`resolved` (with ``values``, e.g. the wrapper's ``lr``)
        and, under ``"as_given"``, this config as given, which :meth:`from_dict` returns (so ``from_pretrained(...)
        .config`` equals the config saved from)."""
        return {**self.resolved(**values).to_dict(), AS_GIVEN: self.to_dict()}

    @classmethod
    def recommended(cls, query_modality: str = "image", **overrides: Any) -> "TTAConfig":
        """The recommended default (:mod:`hf_tta.preset`), chosen by a registered rule on the benchmark's selection
        split: for image queries TCR at lr 3e-2 behind the shift gate with source-anchored answers and the
        degenerate-batch rule (protocol v4's sixth round; it needs ``tta.fit_shift_gate(clean_queries)``; the
        previous defaults are :data:`hf_tta.preset.REST_DN_IMAGE` and :data:`hf_tta.preset.GATED_TCR_IMAGE`); for
        text queries REST at lr 3e-4 with NNN on the scores and the degenerate-batch rule (protocol v4); for audio and video queries TCR, DN and the safety layer at the
        modality's default lr (protocol v2, unmeasured). ``overrides`` replace fields.

        Example:
            >>> cfg = TTAConfig.recommended("image")
            >>> (cfg.objective, cfg.lr, cfg.shift_gate["threshold"], cfg.source_anchor["margin"]) == ("tcr", 3e-2, 4.0, 0.01)
            True
            >>> TTAConfig.recommended("text").objective, TTAConfig.recommended("text").lr
            ('rest', 0.0003)
            >>> TTAConfig.from_dict(cfg.to_dict()) == cfg
            True
        """
        return cls(**{**recommended_fields(query_modality), "query_modality": query_modality, **overrides})

    def mismatch(self, saved: Mapping[str, Any], owner: str = "TTAWrapper") -> str | None:
        """A one-line error when a checkpoint's ``saved`` config differs from this one (both resolved, so a default
        written out on one side equals the same value on the other) in anything but the settings a checkpoint loads
        across (fields whose config class sets ``loads_across_checkpoints``: ``run``, ``safety``); ``None`` if they
        agree. ``owner`` names the class whose ``from_pretrained`` the message recommends."""
        across = {f.name for f in dataclasses.fields(self)
                  if getattr(f.metadata.get("config_class"), "loads_across_checkpoints", False)}

        def plain(config: TTAConfig) -> dict[str, Any]:
            data = json.loads(json.dumps(config.resolved().to_dict(), sort_keys=True))  # JSON's view: str keys, lists
            return {k: v for k, v in data.items() if k not in across}

        known = {f.name for f in dataclasses.fields(self)} | set(FLAT_FIELDS)
        ours = plain(self)
        theirs = plain(TTAConfig.from_dict({k: v for k, v in saved.items() if k in known}))
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
        transform's and the safety layer's full hyper-parameters, the LoRA rank in use, plus ``values`` (e.g. the
        wrapper's resolved ``lr`` and ``gallery_modality``). Saved checkpoints keep their meaning when a default
        changes."""
        transform, safety, budget = self.build_score_transform_config(), self.build_safety_config(), self.build_update_budget_config()
        return dataclasses.replace(
            self,
            objective_config=self.build_objective_config().to_dict(),
            score_transform_config=transform.to_dict() if transform is not None else {},
            safety=safety.to_dict() if safety is not None else None,
            update_budget=budget.to_dict() if budget is not None else None,
            tuning=dataclasses.replace(self.tuning, lora_rank=self.tuning.resolved_lora_rank),
            **values,
        )


_dataclass_init = TTAConfig.__init__


@functools.wraps(_dataclass_init)
def _init_accepting_flat_fields(self, *args: Any, **kwargs: Any) -> None:
    """TTAConfig's dataclass ``__init__``; deprecated flat keyword arguments (``lora_rank=8``) are nested first."""
    if flat_keys(kwargs):
        kwargs = nest(kwargs, deprecated="TTAConfig(...) with flat keyword arguments")
    _dataclass_init(self, *args, **kwargs)


TTAConfig.__init__ = _init_accepting_flat_fields  # type: ignore[method-assign]


def _nested(name: str, value: Any) -> Any:
    """A nested field's value as its config class (a dict of its fields is read by ``from_dict``, which refuses a key
    it does not define, naming the closest)."""
    config_class = TTAConfig.__dataclass_fields__[name].metadata["config_class"]
    if isinstance(value, Mapping):
        try:
            return config_class.from_dict(dict(value))
        except (TypeError, ValueError) as err:
            raise type(err)(f"`{name}`: {err}") from None
    if value is None or isinstance(value, config_class):
        return value
    optional = "None, " if name in ("gradient_decoupling", "consistency", "lr_search") else ""
    raise ConfigTypeError(f"`{name}` must be {optional}a {config_class.__name__} or a dict of its fields, got {value!r}.")


def _build(name: str, overrides: dict[str, Any], field_name: str) -> ObjectiveConfig:
    config_class = get_objective_class(name).config_class
    known = {f.name for f in dataclasses.fields(config_class)}
    unknown = sorted(set(overrides) - known)
    if unknown:
        raise ValueError(
            f"`{field_name}` has keys {unknown} that {config_class.__name__} does not define; valid keys: {sorted(known)}."
        )
    return config_class(**overrides)
