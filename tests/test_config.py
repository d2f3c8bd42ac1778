"""hf_tta.config (with hf_tta.config_features and hf_tta.config_flat): TTAConfig's nested feature configs, their
refusals (a field whose feature is off, one rule for every objective, a misspelled key naming the closest field), JSON
round trips, the one conversion of the flat spelling (hf_tta 0.1 configs and keyword arguments) and a checkpoint's
config as given."""

from __future__ import annotations

import dataclasses
import json
import warnings

import pytest
import torch

from hf_tta import (
    ConsistencyConfig,
    GradientDecouplingConfig,
    RoutedTTAWrapper,
    RunConfig,
    SafetyConfig,
    TTAConfig,
    TTAWrapper,
    TuningConfig,
)
from hf_tta.checkpoint import CONFIG_FILE, read_checkpoint, write_checkpoint
from hf_tta.config_features import ShiftGateConfig, SourceAnchorConfig, WeightEnsembleConfig
from hf_tta.config_flat import FLAT_FIELDS, flatten, nest
from hf_tta.configuration_utils import ConfigMixin
from hf_tta.lr_search import LRSearchConfig
from hf_tta.objectives import available_objectives
from hf_tta.objectives.base import get_objective_class
from hf_tta.update_budget import UpdateBudgetConfig
from tiny_models import batch, make_model

MLP = ".*vision_model.*mlp.fc[12]"
#: A config of hf_tta 0.1 as its save_pretrained wrote it: flat, every field out, resolved.
FLAT_V01 = {
    "objective": "tcr", "objective_config": {"tau": 0.05}, "query_modality": "image", "gallery_modality": "text",
    "steps": 2, "lr": 3e-4, "weight_decay": 1e-4, "reset_policy": "never", "target_modules": MLP,
    "exclude_modules": None, "tuning": "lora", "lora_rank": 8, "lr_multipliers": {"lora_B": 0.5}, "anchor_weight": 0.1,
    "consistency_weight": 0.0, "consistency_top_k": 5, "consistency_temperature": 0.01, "gallery_batch_size": 128,
    "autocast_dtype": None, "gradient_checkpointing": False, "seed": 1, "fast_step": None, "gradient_decoupling": True,
    "gd_weight_on": "gradient", "gd_per_tensor": False, "score_transform": None, "score_transform_config": {},
    "scoring": "before_update", "window": 0, "safety": None, "hf_tta_version": "0.1.0",
}
NESTED_V01 = TTAConfig(
    objective="tcr", objective_config={"tau": 0.05}, gallery_modality="text", steps=2, lr=3e-4, seed=1,
    tuning=TuningConfig(method="lora", target_modules=MLP, lora_rank=8, lr_multipliers={"lora_B": 0.5}, anchor_weight=0.1),
    gradient_decoupling=GradientDecouplingConfig(weight_on="gradient"),
    run=RunConfig(gallery_batch_size=128, scoring="before_update"),
)


def test_top_level_fields_32_before_20_after_each_feature_a_config():
    fields = {f.name: f for f in dataclasses.fields(TTAConfig)}
    assert len(fields) == 23  # 32 flat fields before the features nested (30 at issue 35's review, + update_budget,
    flat = len(fields) - 4 + len(FLAT_FIELDS) + 1  # lr_search, shift_gate, weight_ensemble, source_anchor); the plain
    assert flat == 35  # fields, the flat names of 4 groups, gd's switch
    groups = {name: f.metadata["config_class"] for name, f in fields.items() if "config_class" in f.metadata}
    assert groups == {"tuning": TuningConfig, "gradient_decoupling": GradientDecouplingConfig, "consistency": ConsistencyConfig,
                      "safety": SafetyConfig, "update_budget": UpdateBudgetConfig, "lr_search": LRSearchConfig, "run": RunConfig,
                      "shift_gate": ShiftGateConfig, "weight_ensemble": WeightEnsembleConfig,
                      "source_anchor": SourceAnchorConfig}
    assert all(issubclass(c, ConfigMixin) for c in groups.values())
    assert {n for n, c in groups.items() if getattr(c, "loads_across_checkpoints", False)} == {"safety", "run", "shift_gate",
                                                                                               "source_anchor"}


# ------------------------------------------------------------------------------------- refusals
@pytest.mark.parametrize("make, message", [
    (lambda: TTAConfig(tuning=TuningConfig(lora_rank=8)), "`lora_rank` applies to method='lora' only (here method='ln')"),
    (lambda: TTAConfig(tuning={"method": "bias", "lora_rank": 8}), "`tuning`: TuningConfig `lora_rank` applies to method='lora'"),
    (lambda: TTAConfig(tuning={"method": "lora"}), "`target_modules` is required with method='lora'"),
    (lambda: TTAConfig(tuning={"method": "loraa"}), "TuningConfig `method` must be one of ['ln', 'bias', 'lora']"),
    (lambda: TTAConfig(tuning={"lr_multipliers": {"(": 0.5}}), "is not a regular expression"),
    (lambda: TTAConfig(tuning={"lr_multipliers": {"fc": 0.0}}), "TuningConfig `lr_multipliers['fc']` must be > 0"),
    (lambda: TTAConfig(tuning={"anchor_weight": -1.0}), "TuningConfig `anchor_weight` must be >= 0"),
    (lambda: TTAConfig(consistency={"weight": 0.0}), "ConsistencyConfig `weight` must be > 0"),
    (lambda: TTAConfig(consistency={"weight": 1.0, "top_k": 0}), "ConsistencyConfig `top_k` must be an integer >= 1"),
    (lambda: TTAConfig(consistency={"top_k": 3}), "missing 1 required positional argument: 'weight'"),
    (lambda: TTAConfig(gradient_decoupling={"weight_on": "lr"}), "GradientDecouplingConfig `weight_on` must be one of"),
    (lambda: TTAConfig(gradient_decoupling=1), "`gradient_decoupling` must be None, a GradientDecouplingConfig"),
    (lambda: TTAConfig(run={"scoring": "later"}), "RunConfig `scoring` must be one of"),
    (lambda: TTAConfig(run={"gallery_batch_size": 2.5}), "RunConfig `gallery_batch_size` must be int"),
    (lambda: TTAConfig(run=None), "`run` must be RunConfig"),
    (lambda: TTAConfig(tuning={"lora_rnk": 4}), "TuningConfig has no field 'lora_rnk': did you mean 'lora_rank'?"),
    (lambda: TTAConfig(safety={"min_agrement": 0.3}), "SafetyConfig has no field 'min_agrement': did you mean 'min_agreement'?"),
    (lambda: TTAConfig(objective="dn", tuning=TuningConfig(lr_multipliers={"nothing": 0.1})), "`tuning` is set but objective 'dn' is training-free"),
    (lambda: TTAConfig(objective="dn", consistency=ConsistencyConfig(weight=1.0)), "`consistency` is set but objective 'dn'"),
    (lambda: TTAConfig(objective="dn", gradient_decoupling=True), "`gradient_decoupling` is set but objective 'dn'"),
])
def test_a_bad_or_dependent_field_is_refused_in_one_line(make, message):
    with pytest.raises((TypeError, ValueError)) as info:
        make()
    assert message in str(info.value) and len(str(info.value).splitlines()) == 1, str(info.value)


def test_config_validation_names_the_fix():
    with pytest.raises(ValueError, match="Unknown objective 'tnet'"):
        TTAConfig(objective="tnet")
    with pytest.raises(ValueError, match="valid keys"):
        TTAConfig(objective="tcr", objective_config={"temperature": 0.1})
    with pytest.raises(ValueError, match="steps"):
        TTAConfig(steps=0)
    with pytest.raises(ValueError, match="tau"):
        TTAConfig(objective="tcr", objective_config={"tau": -1.0})


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"objective_config": {"tau": None}}, "tau"),  # None only where a field is optional
        ({"objective_config": {"tau": "0.01"}}, "tau"),  # a string named, not a bare '>' TypeError
        ({"objective_config": {"tau": float("nan")}}, "tau"),
        ({"objective_config": {"queue_size": 64.5}}, "queue_size"),
        ({"steps": True}, "steps"),  # bool is not an int here
        ({"lr": float("inf")}, "lr"),
        ({"run": {"gallery_batch_size": 2.5}}, "gallery_batch_size"),
        ({"seed": "x"}, "seed"),
        ({"gradient_decoupling": 1}, "gradient_decoupling"),
        ({"safety": {"max_rollbacks": 2.0}}, "max_rollbacks"),
    ],
)
def test_config_field_types_are_checked_and_named(kwargs, field):
    with pytest.raises(ValueError, match=f"`{field}` must be") as info:
        TTAConfig(objective="tcr", **kwargs)
    assert isinstance(info.value, TypeError)  # and a ValueError, like every other bad config value


def test_every_registered_config_checks_its_field_types():
    import dataclasses
    import typing

    from hf_tta.objectives import available_objectives
    from hf_tta.objectives.base import get_objective_class

    for name in available_objectives():
        cls = get_objective_class(name).config_class
        hints = typing.get_type_hints(cls)
        number = next(f.name for f in dataclasses.fields(cls) if hints[f.name] in (int, float))
        cls()  # the paper defaults pass
        with pytest.raises(TypeError, match=f"{cls.__name__} `{number}`"):
            cls(**{number: None})
        with pytest.raises(TypeError, match=f"`{number}`"):
            cls(**{number: True})


@pytest.mark.parametrize("objective", available_objectives())
def test_one_rule_for_every_objective(objective):
    """A feature that adapts parameters is refused by every training-free objective and validated the same way for
    every gradient objective (a bad regex is refused for each, a valid one accepted)."""
    trains = get_objective_class(objective).requires_grad
    features = {"tuning": TuningConfig(lr_multipliers={"nothing": 0.1}), "consistency": ConsistencyConfig(weight=1.0),
                "gradient_decoupling": GradientDecouplingConfig()}
    for name, value in features.items():
        if trains:
            assert getattr(TTAConfig(objective=objective, **{name: value}), name) == value
        else:
            with pytest.raises(ValueError, match=f"`{name}` is set but objective {objective!r} is training-free"):
                TTAConfig(objective=objective, **{name: value})
    with pytest.raises(ValueError, match="regular expression"):
        TTAConfig(objective=objective, tuning={"lr_multipliers": {"(": 0.1}})


@pytest.mark.parametrize("objective", ["dn", "tcr"])
def test_an_lr_multiplier_matching_nothing_is_refused_whatever_the_objective(objective):
    cfg = {"objective": objective, "tuning": TuningConfig(lr_multipliers={"nothing": 0.1})}
    with pytest.raises(ValueError, match="training-free|match no adapted parameter"):
        TTAWrapper(make_model("clip"), TTAConfig(**cfg))


# ------------------------------------------------------------------------------------- round trips
ROUND_TRIPS = {
    "default": TTAConfig(),
    "every-feature": NESTED_V01,
    "consistency-safety": TTAConfig(objective="eata", consistency=ConsistencyConfig(weight=2.0, top_k=3),
                                    safety={"min_agreement": 0.3}, run=RunConfig(fast_step=False)),
    "recommended": TTAConfig.recommended("text", lr=1e-4),
    "bias": TTAConfig(tuning=TuningConfig(method="bias")),
}


@pytest.mark.parametrize("name", sorted(ROUND_TRIPS))
def test_json_round_trip_keeps_nested_configs(name, tmp_path):
    cfg = ROUND_TRIPS[name]
    data = json.loads(cfg.to_json_string())
    assert isinstance(data["tuning"], dict) and isinstance(data["run"], dict)
    assert TTAConfig.from_dict(data) == cfg
    cfg.save_pretrained(tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a nested file loads without a deprecation warning
        loaded = TTAConfig.from_pretrained(tmp_path)
    assert loaded == cfg and isinstance(loaded.tuning, TuningConfig) and isinstance(loaded.run, RunConfig)
    assert type(loaded.consistency) is type(cfg.consistency) and type(loaded.gradient_decoupling) is type(cfg.gradient_decoupling)
    assert TTAConfig(**nest(flatten(cfg.to_dict()))) == cfg  # the command line's spelling of it


def test_shorthands_equal_the_nested_configs():
    assert TTAConfig(gradient_decoupling=True) == TTAConfig(gradient_decoupling=GradientDecouplingConfig())
    assert TTAConfig(gradient_decoupling=False).gradient_decoupling is None
    assert TTAConfig(tuning={"method": "bias"}) == TTAConfig(tuning=TuningConfig(method="bias"))
    assert TTAConfig(tuning={"method": "lora", "target_modules": MLP}).resolved().tuning.lora_rank == 4


# ------------------------------------------------------------------------------------- the flat spelling
def test_a_flat_config_of_v01_loads_through_the_one_conversion_with_one_warning(tmp_path):
    with pytest.warns(FutureWarning) as record:
        assert TTAConfig.from_dict(FLAT_V01) == NESTED_V01
    assert len(record) == 1 and len(str(record[0].message).splitlines()) == 1
    assert "deprecated" in str(record[0].message) and "TuningConfig" in str(record[0].message)
    (tmp_path / CONFIG_FILE).write_text(json.dumps(FLAT_V01))
    with pytest.warns(FutureWarning):
        assert TTAConfig.from_pretrained(tmp_path) == NESTED_V01
    # the features that were off: their old defaults written out are dropped, a changed value is refused
    off = {**FLAT_V01, "tuning": "ln", "target_modules": None, "gradient_decoupling": False, "lr_multipliers": {},
           "lora_rank": 4, "gd_weight_on": "step_size"}
    with pytest.warns(FutureWarning):
        cfg = TTAConfig.from_dict(off)
    assert cfg.tuning == TuningConfig(anchor_weight=0.1) and cfg.gradient_decoupling is None and cfg.consistency is None
    for key, value, message in [("lora_rank", 8, "`lora_rank` applies to tuning='lora' only"),
                                ("consistency_top_k", 3, "`consistency_top_k` applies only with consistency on"),
                                ("gd_per_tensor", True, "`gd_per_tensor` applies only with gradient decoupling on")]:
        with pytest.warns(FutureWarning), pytest.raises(ValueError, match=message):
            TTAConfig.from_dict({**off, key: value})


def test_flat_keyword_arguments_still_work_through_the_same_conversion():
    with pytest.warns(FutureWarning, match="flat keyword arguments spells TTAConfig's fields flat"):
        cfg = TTAConfig(objective="tcr", tuning="lora", target_modules=MLP, lora_rank=8, consistency_weight=1.0,
                        consistency_top_k=3, gradient_decoupling=True, gd_per_tensor=True, scoring="before_update")
    assert cfg == TTAConfig(objective="tcr", tuning=TuningConfig(method="lora", target_modules=MLP, lora_rank=8),
                            consistency=ConsistencyConfig(weight=1.0, top_k=3),
                            gradient_decoupling=GradientDecouplingConfig(per_tensor=True), run=RunConfig(scoring="before_update"))
    with pytest.warns(FutureWarning), pytest.raises(ValueError, match="`lora_rank` applies to tuning='lora' only"):
        TTAConfig(lora_rank=8)  # the kwargs are not an old file: nothing is dropped
    with pytest.warns(FutureWarning), pytest.raises(ValueError, match="given nested and as the flat fields"):
        TTAConfig(run=RunConfig(), fast_step=True)


@pytest.mark.parametrize("data, closest", [
    ({"lrr": 1e-3}, "lr"), ({"objectve": "tent"}, "objective"), ({"lora_rnk": 4, "tuning": "lora"}, "lora_rank"),
    ({"consistency": {"wieght": 1.0}}, "weight"), ({"run": {"fast_stpe": True}}, "fast_step"),
])
def test_a_misspelled_field_is_refused_naming_the_closest(data, closest, tmp_path):
    with pytest.raises(ValueError, match=f"did you mean {closest!r}") as info:
        TTAConfig.from_dict(data)
    assert len(str(info.value).splitlines()) == 1
    (tmp_path / CONFIG_FILE).write_text(json.dumps({**TTAConfig().to_dict(), **data}))
    with pytest.raises(ValueError, match=f"did you mean {closest!r}"):
        TTAConfig.from_pretrained(tmp_path)


# ------------------------------------------------------------------------------------- checkpoints
def _adapted(cfg: TTAConfig, n: int = 1) -> TTAWrapper:
    tta = TTAWrapper(make_model("clip"), cfg)
    g = tta.encode_gallery(batch("text", 10, seed=1))
    for i in range(n):
        tta.adapt_step(batch("image", 6, seed=10 + i), g)
    return tta


@pytest.mark.parametrize("cfg", [
    TTAConfig(objective="tcr", objective_config={"tau": 0.05}, safety={}),
    TTAConfig(objective="tent", tuning=TuningConfig(method="lora", target_modules=MLP), consistency={"weight": 1.0}),
], ids=["lr-none-safety-defaults", "lora-rank-left-out"])
def test_from_pretrained_config_equals_the_config_saved_from(cfg, tmp_path):
    tta = _adapted(cfg)
    tta.save_pretrained(tmp_path / "ckpt")
    saved = json.loads((tmp_path / "ckpt" / CONFIG_FILE).read_text())
    assert saved["lr"] == 3e-4 and saved["as_given"]["lr"] is None  # resolved for readers, as given for the round trip
    loaded = TTAWrapper.from_pretrained(make_model("clip"), tmp_path / "ckpt")
    assert loaded.config == cfg and loaded.config.lr is None and loaded.lr == tta.lr == 3e-4
    assert loaded.resolved_config() == tta.resolved_config()
    assert TTAConfig.from_pretrained(tmp_path / "ckpt") == cfg
    q = batch("image", 5, seed=99)
    g = tta.encode_gallery(batch("text", 10, seed=1))
    assert torch.equal(loaded.adapt_step(q, g).scores, tta.adapt_step(q, g).scores)


def test_a_routed_checkpoint_keeps_the_config_as_given(tmp_path):
    cfg = TTAConfig(objective="tent", safety={})
    tta = RoutedTTAWrapper(make_model("clip"), cfg)
    g = tta.encode_gallery(batch("text", 10, seed=1))
    tta.adapt_step(batch("image", 8, seed=3), g)
    tta.save_pretrained(tmp_path)
    loaded = RoutedTTAWrapper.from_pretrained(make_model("clip"), tmp_path)
    assert loaded.config == cfg and loaded.lr == tta.lr and loaded.domain_keys == tta.domain_keys


def test_a_checkpoint_loads_across_run_settings_not_across_tuning(tmp_path):
    _adapted(TTAConfig(objective="tent", run=RunConfig(scoring="before_update"))).save_pretrained(tmp_path)
    other_run = TTAWrapper(make_model("clip"), TTAConfig(objective="tent", run=RunConfig(gallery_batch_size=7), safety={}))
    other_run.load_state(tmp_path)
    assert other_run.batch_index == 1
    anchored = TTAWrapper(make_model("clip"), TTAConfig(objective="tent", tuning=TuningConfig(anchor_weight=1.0)))
    with pytest.raises(ValueError, match="another config .*tuning"):
        anchored.load_state(tmp_path)


def test_a_flat_checkpoint_of_v01_loads(tmp_path):
    """A checkpoint whose config (in tta_config.json and the state file) is flat, as hf_tta 0.1 saved it."""
    cfg = TTAConfig(objective="tcr", tuning=TuningConfig(anchor_weight=0.5), run=RunConfig(scoring="before_update"))
    tta = _adapted(cfg, 2)
    tta.save_pretrained(tmp_path / "new")
    ckpt = read_checkpoint(tmp_path / "new")
    resolved = {k: v for k, v in ckpt.config.items() if k != "as_given"}
    flat = {**flatten(resolved), "lora_rank": 4, "consistency_top_k": 5, "consistency_temperature": 0.01,
            "gd_weight_on": "step_size", "gd_per_tensor": False}
    write_checkpoint(tmp_path / "old", flat, ckpt.tensors, ckpt.metadata)
    with pytest.warns(FutureWarning, match="deprecated"):
        loaded = TTAWrapper.from_pretrained(make_model("clip"), tmp_path / "old")
    assert loaded.config == tta.resolved_config() and loaded.batch_index == 2
    assert all(torch.equal(loaded.params[n], p) for n, p in tta.params.items())


def test_the_config_modules_examples_run():
    import doctest

    import hf_tta.config
    import hf_tta.config_features

    for module in (hf_tta.config, hf_tta.config_features):
        result = doctest.testmod(module)
        assert result.attempted and not result.failed, module.__name__
