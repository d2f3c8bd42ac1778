"""`hf-tta run`'s adaptation options come from TTAConfig's fields (transformers' HfArgumentParser): every field is an
option, `--config` reads JSON/YAML, the values reach every row's config, and a bad value gets TTAConfig's own message."""

from __future__ import annotations

import contextlib
import dataclasses
import json

import pytest

from hf_tta import ConsistencyConfig, GradientDecouplingConfig, TTAConfig, TuningConfig, cli
from hf_tta.cli.config_args import autocast_from_accelerate, flat_fields
from hf_tta.config_flat import nest


def _run_parser():
    parser = cli.build_parser()
    return next(a for a in parser._subparsers._group_actions[0].choices.values() if a.prog.endswith(" run"))


def test_every_ttaconfig_setting_is_a_flat_option_in_both_spellings():
    """Every plain field and every field of a nested feature config is one flat option (``--lora_rank``, not
    ``--tuning.lora_rank``), with its field's help."""
    options = {s: a for a in _run_parser()._actions for s in a.option_strings}
    names = [name for name, *_ in flat_fields()]
    nested = {f.name for f in dataclasses.fields(TuningConfig)} | {"top_k", "weight_on", "fast_step", "scoring"}
    assert {"lora_rank", "consistency_top_k", "gd_per_tensor", "fast_step", "tuning", "anchor_weight"} <= set(names)
    assert not nested - {"lora_rank", "target_modules", "exclude_modules", "lr_multipliers", "anchor_weight", "fast_step", "scoring"} & set(names)
    for name, f, _, _ in flat_fields():
        spellings = {f"--{name}", f"--{name.replace('_', '-')}"}
        assert spellings <= set(options), name
        assert {options[s].dest for s in spellings} == {name}, name
        if name not in ("objective_config", "gradient_decoupling", "consistency_weight"):  # the grid's / the switch's own help
            assert f.metadata["help"].split(".")[0] in options[f"--{name}"].help, name
    assert "--config" in options and "--objectives" in options and "--batch-size" in options  # the grid's own stay


def _args(*argv):
    return cli.build_parser().parse_args(["run", *argv])


@pytest.fixture
def cfg_dir(tmp_path):
    """A config as the Python API saves it (tta_config.json) and the same fields as YAML."""
    TTAConfig(objective="tent", weight_decay=0.5, steps=2, reset_policy="episodic",
              gradient_decoupling=GradientDecouplingConfig(weight_on="gradient")).save_pretrained(tmp_path)
    (tmp_path / "cfg.yaml").write_text("weight_decay: 0.25\nsteps: 4\nsafety: {min_queries: 4}\nexclude_modules: [text_encoder]\n")
    return tmp_path


@pytest.mark.parametrize("source, expected", [
    ("json", {"weight_decay": 0.5, "steps": 5, "reset_policy": "episodic", "gd_weight_on": "gradient"}),
    ("yaml", {"weight_decay": 0.25, "steps": 5, "safety": {"min_queries": 4}, "exclude_modules": ["text_encoder"]}),
])
def test_config_file_then_command_line(cfg_dir, source, expected):
    from hf_tta.cli.config_args import apply_config

    path = cfg_dir / ("tta_config.json" if source == "json" else "cfg.yaml")
    args = _args("--config", str(path), "--steps", "5")  # the command line wins over the file
    overrides = apply_config(args, ["i2t"])
    for name, value in expected.items():
        assert getattr(args, name) == value, name
    assert args.lr is None and args.seed == 0  # untouched fields: TTAConfig's defaults
    assert "steps" not in overrides and overrides["weight_decay"] == expected["weight_decay"]
    if source == "json":  # the file's objective is the grid's one row, its nested gradient decoupling the grid's option
        assert args.objectives == "tent" and args.gradient_decoupling == "true" and args.gd_per_tensor is False


def test_options_reach_every_rows_config(tmp_path):
    pytest.importorskip("datasets", reason="needs the data extra")
    pytest.importorskip("PIL", reason="needs the data extra")
    from cli_folders import save_benchmark, save_retrieval_checkpoint
    from hf_tta.benchmarks import Condition, GridRunner

    model = save_retrieval_checkpoint("blip", tmp_path / "blip")
    dataset = save_benchmark(tmp_path / "coco-c")
    args = _args("--model", str(model), "--dataset", str(dataset), "--corruptions", "fog", "--objectives",
                 "tent,tcr+safe+dn,oracle_all,tent+gd,dn", "--weight_decay", "0.5", "--autocast_dtype", "bf16",
                 "--exclude_modules", "text_encoder", "--safety", '{"min_queries": 4}', "--gd_per_tensor",
                 "--consistency_weight", "0.5", "--consistency_top_k", "2", "--lr", "1e-3", "--seed", "3", "--quiet")
    jobs, _, task, settings = cli.prepare_run(args, show_progress=False)
    runner = GridRunner(task, settings)
    cond = Condition("i2t", "fog", 5)
    configs = {row: runner.row_config(row, cond, 3) for row in ("tent", "tcr+safe+dn", "oracle_all", "tent+gd", "dn")}
    for row, cfg in configs.items():
        assert (cfg.weight_decay, cfg.autocast_dtype, cfg.lr, cfg.seed) == (0.5, "bf16", 1e-3, 3), row
        assert cfg.safety is not None and cfg.safety["min_queries"] == 4, row  # --safety is the base of every row
        trains = row != "dn"  # the flat options reach the nested features of the rows that run them
        assert (cfg.tuning.exclude_modules == "text_encoder") == trains, row
        assert cfg.consistency == (ConsistencyConfig(weight=0.5, top_k=2) if trains else None), row
        assert cfg.gradient_decoupling == (GradientDecouplingConfig(per_tensor=True) if row == "tent+gd" else None), row
    assert configs["tent"].score_transform is None and configs["tcr+safe+dn"].score_transform == "dn"
    assert configs["tent"].tuning.target_modules is None and configs["oracle_all"].tuning.target_modules  # the row's own
    assert {j.seed for j in jobs} == {3}


@pytest.mark.parametrize("field, value", [
    ("weight_decay", "-1"), ("reset_policy", "sometimes"), ("gd_weight_on", "loss"), ("steps", "0"),
    ("gallery_batch_size", "0"), ("score_transform", "tent"), ("safety", '{"min_queries": 0}'),
    ("lr_search", '{"probe_batches": 1}'),
    ("lr_search", '{"online": "hypergradient", "hypergradient_rate": 2}'),
    ("lr_search", '{"serve": "best"}'),
])
def test_a_bad_value_gets_ttaconfigs_own_message(field, value, capsys):
    default = dict((name, d) for name, _, _, d in flat_fields())[field]
    parsed = json.loads(value) if value.startswith("{") else type(default or "")(value)
    with pytest.raises((TypeError, ValueError)) as api:  # the flat spelling through its one conversion
        TTAConfig(**nest({field: parsed, "gradient_decoupling": field.startswith("gd_")}))
    assert cli.main(["run", f"--{field.replace('_', '-')}", value]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and str(api.value).splitlines()[0] in err, err


@pytest.mark.parametrize("argv, message", [
    (("--lora_rank", "8"), "`lora_rank` applies to tuning='lora' only (here tuning='ln'): drop it or set tuning='lora'."),
    (("--tuning", "bias", "--lora_rank", "8"), "`lora_rank` applies to tuning='lora' only (here tuning='bias')"),
    (("--consistency_top_k", "3"), "`consistency_top_k` applies only with consistency on: set consistency_weight > 0"),
    (("--gd_per_tensor", "--gradient_decoupling", "false"), "--gd_per_tensor applies only with gradient decoupling on"),
    (("--tuning", "lora"), "`target_modules` is required with tuning='lora'"),
])
def test_an_option_whose_feature_is_off_is_refused(argv, message, capsys):
    assert cli.main(["run", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err, err


def test_config_files_nested_flat_or_misspelled(tmp_path, capsys):
    """--config takes the options' flat spelling, a nested tta_config.json and a flat one of hf_tta 0.1; a misspelled
    key is refused naming the closest."""
    from hf_tta.cli.config_args import apply_config

    cfg = TTAConfig(objective="tent", tuning=TuningConfig(method="lora", target_modules=".*fc1", lora_rank=8))
    cfg.save_pretrained(tmp_path)
    (tmp_path / "flat.yaml").write_text("tuning: lora\ntarget_modules: .*fc1\nlora_rank: 8\n")
    legacy = {"objective": "tent", "tuning": "lora", "target_modules": ".*fc1", "lora_rank": 8, "consistency_weight": 0.0,
              "consistency_top_k": 5, "gd_weight_on": "step_size", "fast_step": None, "hf_tta_version": "0.1.0"}
    (tmp_path / "legacy.json").write_text(json.dumps(legacy))
    for name in ("tta_config.json", "flat.yaml", "legacy.json"):
        args = _args("--config", str(tmp_path / name))
        with pytest.warns(FutureWarning) if name == "legacy.json" else contextlib.nullcontext():
            apply_config(args, ["i2t"])
        assert (args.tuning, args.target_modules, args.lora_rank) == ("lora", ".*fc1", 8), name
    (tmp_path / "typo.yaml").write_text("lora_rnak: 8\n")
    assert cli.main(["run", "--config", str(tmp_path / "typo.yaml")]) == 2
    assert "has no option 'lora_rnak': did you mean 'lora_rank'?" in capsys.readouterr().err


def test_grid_and_config_options_that_overlap(capsys):
    cases = {
        ("--objective", "tent", "--objectives", "tcr"): "give --objective (one row) or --objectives (several), not both",
        ("--query_modality", "text"): "--query_modality text disagrees with --direction i2t",
        ("--autocast_dtype", "fp16"): "use autocast_dtype='bf16'",
        ("--objectives", "tent,tcr", "--objective-config", '{"tau": 0.01}'): "the grid runs ['tent', 'tcr']; map each",
        ("--config", "missing.json"): "--config missing.json: no such file",
    }
    for argv, message in cases.items():
        assert cli.main(["run", *argv]) == 2, argv
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and message in err, (argv, err)


def test_objective_and_its_plain_config_make_one_row():
    from hf_tta.cli.config_args import apply_config
    from hf_tta.cli.plan import _gradient_decoupling, _objective_configs, resolve_grid

    args = _args("--objective", "tent", "--objective_config", '{"tau": 0.05}', "--gradient_decoupling", "true", "--no-style")
    apply_config(args, ["i2t"])
    jobs, _ = resolve_grid(args)
    rows = sorted({j.objective for j in jobs})
    assert rows == ["source", "tent"]
    assert _objective_configs(args.objective_config, rows) == {"tent": {"tau": 0.05}}
    assert _gradient_decoupling(args.gradient_decoupling, rows) == ("tent",)


@pytest.mark.parametrize("mode, expected", [("no", None), ("bf16", "bf16"), ("fp16", "names bf16"), ("fp8", "names bf16")])
def test_recipes_honour_accelerates_mixed_precision(mode, expected, monkeypatch):
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", mode)
    args = _args()
    if expected == "names bf16":
        with pytest.raises(cli.UsageError, match=rf"--mixed_precision {mode}: .*launch with --mixed_precision bf16"):
            autocast_from_accelerate(args)
    else:
        from hf_tta.cli.config_args import apply_config

        autocast_from_accelerate(args)
        assert apply_config(args, ["i2t"]).get("autocast_dtype") == expected  # reaches every row's config
        assert args.autocast_dtype == expected
