"""The robustness streams of the benchmark: shifts switching every few batches, and the degenerate constant prefix."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hf_tta.benchmarks import SOURCE, Condition, GridRunner, Job, RunSettings, build_grid
from hf_tta.benchmarks.grid import (
    ROBUSTNESS_SHIFTS,
    SWITCH_IMAGE_CORRUPTIONS,
    RowSpec,
    row_spec,
    stream_order,
    switch_segments,
)
from test_benchmark_runner import N, TinyTask
from tiny_models import make_model


def test_switch_segments_follow_the_stream_order():
    """Query at stream position p gets shift (p // every) % num_shifts; every shift gets its share."""
    n, every, k = 23, 3, 4
    segment = switch_segments(n, seed=5, num_shifts=k, every=every)
    order = stream_order(n, 5)
    assert [int(segment[q]) for q in order] == [(p // every) % k for p in range(n)]
    assert np.bincount(segment, minlength=k).tolist() == [6, 6, 6, 5]
    assert not np.array_equal(segment, switch_segments(n, seed=6, num_shifts=k, every=every))


def test_robustness_streams_join_the_grid_only_when_asked():
    plain = build_grid(["tcr"], ["i2t"], ["fog"], [5])
    assert not {j.condition.shift for j in plain} & set(ROBUSTNESS_SHIFTS)
    jobs = build_grid(["tcr"], ["i2t"], ["fog"], [5], switch=True, degenerate=True)
    assert {Condition("i2t", "switch"), Condition("i2t", "degenerate")} <= {j.condition for j in jobs}


def test_switch_stream_is_each_query_of_its_segments_shift():
    from hf_tta.benchmarks.tasks import EmojiTask

    task = EmojiTask(limit=12, render_factor=1.5)
    raw, relevant = task.queries(Condition("i2t", "switch"), seed=3)
    segment = switch_segments(12, 3, len(SWITCH_IMAGE_CORRUPTIONS), every=4)
    assert raw.shape[0] == 12 and relevant == task.queries(Condition("i2t", "clean"), 3)[1]
    # with 12 queries and segments of 128 every query is in the first segment: the first corruption's stream
    first = task.queries(Condition("i2t", SWITCH_IMAGE_CORRUPTIONS[0], 5), 3)[0]
    assert np.array_equal(raw, first)
    # and with short segments each query comes from its own segment's stream
    task.switch_every = 4
    task._cache.clear()
    raw = task.queries(Condition("i2t", "switch"), seed=3)[0]
    for i, k in enumerate(segment.tolist()):
        stream = task.queries(Condition("i2t", SWITCH_IMAGE_CORRUPTIONS[k], 5), 3)[0]
        assert np.array_equal(raw[i], stream[i])
    assert len(set(segment.tolist())) == 3  # 12 queries in segments of 4: three shifts used


def test_degenerate_stream_feeds_a_constant_prefix_and_scores_the_clean_part():
    runner = GridRunner(TinyTask(make_model("clip")), RunSettings(show_progress=False, batch_size=4, degenerate_batches=5, steps=2))
    cond = Condition("i2t", "degenerate")
    calls = []
    tta = runner._wrapper("tent", cond, 0)
    original = tta.adapt_step

    def spy(queries, gallery, labels=None):
        calls.append(queries["pixel_values"].clone())
        return original(queries, gallery, labels=labels)

    tta.adapt_step = spy
    row = runner.run(Job(cond, "tent", 0))
    assert "error" not in row, row.get("error")
    assert len(calls) == 5 + N // 4  # the prefix, then the clean stream in batches of 4
    prefix = torch.stack(calls[:5])
    assert torch.equal(prefix, prefix[:1].expand_as(prefix)) and torch.equal(prefix[0], prefix[0, :1].expand_as(prefix[0]))
    assert row["num_queries"] == N and len(row["hits"]) == N  # scored on the clean part only
    assert row["updates"] + row["skipped_steps"] == 2 * (5 + N // 4)
    # the source row of the degenerate stream is the clean stream's
    clean = runner.run(Job(Condition("i2t", "clean"), SOURCE, 0))
    source = runner.run(Job(cond, SOURCE, 0))
    assert source["hits"] == clean["hits"] and source["R@1"] == clean["R@1"]


def test_row_names_parse_their_options():
    from hf_tta.benchmarks.grid import RowSpec, row_objective, row_spec

    assert row_spec("tcr+gd+safe") == RowSpec("tcr", gd=True, safe=True)
    assert row_spec("tent+route") == RowSpec("tent", route=True)
    assert row_spec("oracle_all") == RowSpec("oracle", all_params=True) == row_spec("oracle+all")
    assert row_spec("tcr+dn+all+safe") == RowSpec("tcr", safe=True, all_params=True, score_transform="dn")
    assert row_objective("rest+gd") == ("rest", True)
    for bad in ("tcr+fast", "tcr+safe+safe", "oracle_all+all"):
        with pytest.raises(ValueError, match="options are"):
            row_spec(bad)
    # protocol v3: a row at its own learning rate
    assert row_spec("tcr+safe@3e-3") == RowSpec("tcr", safe=True, lr=3e-3) and row_spec("oracle_all@1e-2").lr == 1e-2
    for bad in ("tcr@", "tcr@fast", "tcr@-1e-3", "tcr@0", "tcr@inf", "tcr@nan"):
        with pytest.raises(ValueError, match="learning rate, a positive number"):
            row_spec(bad)


@pytest.mark.parametrize(
    ("row", "spec"),
    [
        ("tcr+nnn", RowSpec("tcr", score_transform="nnn")),
        ("rest+qbnorm", RowSpec("rest", score_transform="qbnorm")),
        ("tcr+dn", RowSpec("tcr", score_transform="dn")),
        ("nnn", RowSpec("nnn")),  # the transforms alone: training-free objectives on the source model
        ("qbnorm+safe", RowSpec("qbnorm", safe=True)),
        ("tcr+b25", RowSpec("tcr", budget=0.25)),
        ("rest+b10@1e-3", RowSpec("rest", budget=0.1, lr=1e-3)),
        ("tcr+b12.5+nnn+safe", RowSpec("tcr", safe=True, score_transform="nnn", budget=0.125)),
        ("tcr+b100", RowSpec("tcr", budget=1.0)),
        # image queries' preset (v4's sixth round), and at the row's own lr
        ("recommended", RowSpec("tcr", safe=True, gate=True, anchor=True, lr=3e-2, preset=True)),
        ("recommended@3e-4", RowSpec("tcr", safe=True, gate=True, anchor=True, lr=3e-4, preset=True)),  # the row's lr wins
    ],
)
def test_row_names_select_one_score_transform_and_an_update_budget(row, spec):
    assert row_spec(row) == spec and row_spec(row).row == row


@pytest.mark.parametrize(("modality", "spec"), [("image", RowSpec("tcr", safe=True, gate=True, anchor=True, lr=3e-2, preset=True)),
                                                 ("text", RowSpec("rest", safe=True, score_transform="nnn", lr=3e-4, preset=True)),
                                                 ("audio", RowSpec("tcr", safe=True, score_transform="dn", preset=True))])
def test_the_recommended_row_is_the_preset_of_the_query_modality(modality, spec):
    from hf_tta import TTAConfig

    assert row_spec("recommended", modality) == spec
    cfg = TTAConfig.recommended(modality)
    assert (cfg.objective, cfg.lr, cfg.score_transform) == (spec.objective, spec.lr, spec.score_transform)
    assert (cfg.shift_gate is not None, cfg.safety is not None, cfg.source_anchor is not None) == (spec.gate, spec.safe, spec.anchor)


@pytest.mark.parametrize(
    ("row", "match"),
    [
        ("tcr+dn+nnn", r"one score transform per row; got \+dn and \+nnn"),
        ("recommended+safe", "each at most once"),  # the image preset has +safe already
        ("dn+nnn", "dn is training-free"),
        ("qbnorm+b25", r"qbnorm is training-free .* \+b25 on a gradient objective"),
        ("tcr+b0", r"percent in \(0, 100\]"),
        ("tcr+b150", r"percent in \(0, 100\]"),
        ("tcr+b25+b50", "one update budget per row"),
        ("tcr+b25+b25", "each at most once"),
        ("tcr+bx", r"options are .*\+qbnorm and \+b<percent>"),
    ],
)
def test_row_names_refuse_two_transforms_and_bad_budgets_in_one_line(row, match):
    with pytest.raises(ValueError, match=match) as err:
        row_spec(row)
    assert "\n" not in str(err.value)


def test_a_row_at_its_own_lr_runs_at_it_and_the_others_at_the_grids():
    runner = GridRunner(TinyTask(make_model("clip")), RunSettings(show_progress=False, lr=1e-4))
    cond = Condition("i2t", "clean")
    assert runner.row_config("tcr@3e-3", cond, 0).lr == 3e-3 and runner.row_config("tcr", cond, 0).lr == 1e-4
    assert runner.row_config("oracle_all@1e-2", cond, 0).tuning.target_modules  # the options still apply


def test_safe_and_routed_rows_run_and_report_what_they_did():
    runner = GridRunner(TinyTask(make_model("clip")), RunSettings(show_progress=False, batch_size=12, degenerate_batches=3,
                                                                  safety={"min_queries": 4}))
    cond = Condition("i2t", "degenerate")
    safe = runner.run(Job(cond, "tent+safe", 0))
    assert "error" not in safe, safe.get("error")
    tta = runner._wrappers[("tent+safe", "i2t", False)]
    assert tta.config.safety == {"min_queries": 4} and safe["safety"] == tta.safety_counts
    # the constant prefix: every one of its batches is degenerate for the source model, so none is adapted on
    assert safe["safety"].get("skip_degenerate", 0) >= 3
    routed = runner.run(Job(Condition("i2t", "clean"), "tent+route", 0))
    assert "error" not in routed, routed.get("error")
    assert routed["domains"] >= 1 and type(runner._wrappers[("tent+route", "i2t", False)]).__name__ == "RoutedTTAWrapper"


def test_all_params_and_dn_rows_configure_the_wrapper():
    runner = GridRunner(TinyTask(make_model("clip")), RunSettings(show_progress=False, batch_size=12))
    noise = Condition("i2t", "gaussian_noise", 5)
    plain, wide = runner.row_config("tcr", noise, 0), runner.row_config("tcr+all+dn", noise, 0)
    assert plain.tuning.target_modules is None and plain.score_transform is None
    assert wide.tuning.target_modules == runner.row_config("oracle_all", noise, 0).tuning.target_modules and wide.score_transform == "dn"
    row = runner.run(Job(noise, "tcr+all+dn", 0))
    assert "error" not in row, row.get("error")
    n_ln, n_all = (sum(p.numel() for p in runner._wrapper(r, noise, 0).params.values()) for r in ("tcr", "tcr+all+dn"))
    assert n_all > n_ln > 0 and runner._wrapper("tcr+all+dn", noise, 0).score_transform is not None
    plain = runner.run(Job(Condition("i2t", "clean"), "tent", 0))
    assert "safety" not in plain and "domains" not in plain


class _ReferenceTask(TinyTask):
    """The tiny task with enough clean reference queries for the shift gate (its minimum is 32; the task has 12)."""

    def gate_reference(self, direction):
        return list(range(len(self.queries(None)[0]))) * 4


def test_recommended_row_runs_the_preset_of_tta_config():
    """The benchmark's ``recommended`` row is TTAConfig.recommended with the runner's stream settings, so the
    reported preset is exactly the one a user gets."""
    from hf_tta import TTAConfig
    from hf_tta.preset import RECOMMENDED_IMAGE_ROW, RECOMMENDED_TEXT_ROW

    runner = GridRunner(TinyTask(make_model("clip")), RunSettings(show_progress=False, batch_size=12))
    noise = Condition("i2t", "gaussian_noise", 5)
    got = runner.row_config("recommended", noise, 3)
    assert got == TTAConfig.recommended("image", gallery_modality="text", seed=3)
    # the preset's row spelling runs it with the run's --safety, gate and anchor settings set as the preset's
    # (RowSpec.preset makes the row `recommended` take its safety, gate, ensembling and anchor from the preset whatever
    # the run's)
    fields = TTAConfig.recommended("image")
    preset_run = GridRunner(TinyTask(make_model("clip")), RunSettings(show_progress=False, batch_size=12, config_overrides={
        "safety": fields.safety, "shift_gate": fields.shift_gate, "source_anchor": fields.source_anchor}))
    assert got == preset_run.row_config(RECOMMENDED_IMAGE_ROW, noise, 3) and (got.objective, got.lr) == ("tcr", 3e-2)
    assert got.shift_gate == fields.shift_gate and got.source_anchor == fields.source_anchor
    # spelled out in a run without those settings, the row's +gate and +anchor run at their own defaults: not the preset
    assert runner.row_config(RECOMMENDED_IMAGE_ROW, noise, 3) != got
    other = GridRunner(TinyTask(make_model("clip")), RunSettings(show_progress=False, batch_size=12, config_overrides={
        "safety": {"min_agreement": 0.9}, "shift_gate": {"threshold": 99.0}, "source_anchor": {"margin": 0.5}}))
    assert other.row_config("recommended", noise, 3) == got  # the run's settings do not reach the preset's row
    typo = Condition("t2i", "char_swap", 7)  # text queries: their own preset, at its own lr
    text = runner.row_config("recommended", typo, 3)
    text_run = GridRunner(TinyTask(make_model("clip")), RunSettings(show_progress=False, batch_size=12, config_overrides={
        "safety": TTAConfig.recommended("text").safety}))
    assert text == text_run.row_config(RECOMMENDED_TEXT_ROW, typo, 3) and (text.objective, text.lr) == ("rest", 3e-4)
    assert text == TTAConfig.recommended("text", gallery_modality="image", seed=3)
    assert TTAConfig.from_dict(got.to_dict()) == got
    gated = GridRunner(_ReferenceTask(make_model("clip")), RunSettings(show_progress=False, batch_size=12))
    row = gated.run(Job(noise, "recommended", 0))
    assert "error" not in row, row.get("error")
    assert row["objective"] == "recommended" and ("safety" in row) == (got.safety is not None)


# ------------------------------------------------------------------------------------- the +key rows (routing ceiling)
def test_query_domains_name_the_shift_each_query_was_corrupted_with():
    from hf_tta.benchmarks.emoji import query_images
    from hf_tta.benchmarks.source_model import input_side
    from hf_tta.benchmarks.tasks import EmojiTask
    from hf_tta.data.corruptions import corrupt_images_diverse, corrupt_texts_diverse, derive_seed

    task = EmojiTask(limit=12, render_factor=1.5)
    cond = Condition("i2t", "diverse")
    raw = task.queries(cond, seed=3)[0]
    # redo the stream by hand, keeping the names of the draws: it is the stream the runner scores
    clean = query_images(task.bench, "clean", input_side=input_side(task.model), factor=1.5)
    images, drawn = corrupt_images_diverse(list(clean), derive_seed(3, "emoji", "diverse", None), task._diverse_pool(cond))
    assert np.array_equal(np.stack(images), raw)
    domains = task.query_domains(cond, 3)
    assert domains == [name for name, _ in drawn] and len(set(domains)) > 3
    assert domains != task.query_domains(cond, 4)  # another seed draws other shifts

    t2i = Condition("t2i", "diverse")
    task.text_corruptions = ["char_swap", "random_deletion", "synonym_replacement"]
    texts, drawn = corrupt_texts_diverse(task.bench.captions, derive_seed(3, "emoji", "diverse", None), task._diverse_pool(t2i))
    assert task.queries(t2i, 3)[0] == texts and task.query_domains(t2i, 3) == [name for name, _ in drawn]

    task.switch_every = 4
    segment = switch_segments(12, 3, len(SWITCH_IMAGE_CORRUPTIONS), every=4)
    assert task.query_domains(Condition("i2t", "switch"), 3) == [SWITCH_IMAGE_CORRUPTIONS[k] for k in segment.tolist()]
    assert task.query_domains(Condition("i2t", "fog", 5), 3) == ["fog"] * 12
    assert task.query_domains(Condition("i2t", "degenerate"), 3) == ["clean"] * 12  # the scored part


def test_key_row_keeps_one_adapter_per_true_shift():
    from hf_tta.benchmarks.grid import RowSpec, row_spec
    from hf_tta.benchmarks.tasks import EmojiTask
    from hf_tta.routing import RoutedTTAWrapper

    assert row_spec("tcr+safe+key") == RowSpec("tcr", safe=True, key=True)
    with pytest.raises(ValueError, match="pick one"):
        row_spec("tcr+key+route")
    task = EmojiTask(limit=16, render_factor=1.5)
    task.switch_every = 4
    runner = GridRunner(task, RunSettings(show_progress=False, batch_size=8, steps=1, degenerate_batches=2))
    cond = Condition("i2t", "switch")
    row = runner.run(Job(cond, "tent+key", 0))
    assert "error" not in row, row.get("error")
    tta = runner._wrappers[("tent+key", "i2t", False)]
    assert isinstance(tta, RoutedTTAWrapper) and sorted(tta.domain_keys) == sorted(set(task.query_domains(cond, 0)))
    assert row["domains"] == len(set(task.query_domains(cond, 0))) > 1
    row = runner.run(Job(Condition("i2t", "degenerate"), "tent+key", 0))  # the prefix gets a domain of its own
    assert "error" not in row and sorted(tta.domain_keys) == ["clean", "constant"]
    # a task that does not record each query's shift: the row says how to go on instead of guessing
    tiny = GridRunner(TinyTask(make_model("clip")), RunSettings(show_progress=False, batch_size=4))
    assert "+route" in tiny.run(Job(Condition("i2t", "fog", 5), "tent+key", 0))["error"]


def test_stream_corruptions_set_the_diverse_and_switching_image_streams(tmp_path):
    """Protocol v4's selection split draws its diverse and switching image streams from ImageNet-C's validation
    corruptions only (``stream_corruptions``): every query's shift is one of them, each switching segment's queries
    are that corruption's own stream, and the cache keeps them apart from the benchmark's streams of the same names."""
    from hf_tta.benchmarks.tasks import EmojiTask
    from hf_tta.data.corruptions import VALIDATION_IMAGE_CORRUPTIONS

    plain = EmojiTask(limit=12, render_factor=1.5, cache_dir=tmp_path)
    task = EmojiTask(limit=12, render_factor=1.5, cache_dir=tmp_path, stream_corruptions=VALIDATION_IMAGE_CORRUPTIONS)
    diverse, switch = Condition("i2t", "diverse"), Condition("i2t", "switch")
    assert set(task.query_domains(diverse, 3)) <= set(VALIDATION_IMAGE_CORRUPTIONS) and len(set(task.query_domains(diverse, 3))) > 1
    assert not set(plain.query_domains(diverse, 3)) <= set(VALIDATION_IMAGE_CORRUPTIONS)
    for t in (task, plain):
        t.switch_every = 4
    segment = switch_segments(12, 3, 4, every=4)
    assert task.query_domains(switch, 3) == [VALIDATION_IMAGE_CORRUPTIONS[k] for k in segment.tolist()]
    raw = task.queries(switch, 3)[0]
    for i, k in enumerate(segment.tolist()):
        assert np.array_equal(raw[i], task.queries(Condition("i2t", VALIDATION_IMAGE_CORRUPTIONS[k], 5), 3)[0][i])
    assert task.cache_file(diverse, 3) != plain.cache_file(diverse, 3) and task.cache_file(switch, 3) != plain.cache_file(switch, 3)
    assert not np.array_equal(task.queries(diverse, 3)[0], plain.queries(diverse, 3)[0])
    again = EmojiTask(limit=12, render_factor=1.5, cache_dir=tmp_path, stream_corruptions=VALIDATION_IMAGE_CORRUPTIONS)
    assert np.array_equal(again.queries(diverse, 3)[0], task.queries(diverse, 3)[0])  # read back from its own cache file
    assert task.describe()["stream_corruptions"] == list(VALIDATION_IMAGE_CORRUPTIONS) and "stream_corruptions" not in plain.describe()
    with pytest.raises(ValueError, match="stream_corruptions must name image corruptions"):
        EmojiTask(limit=12, stream_corruptions=["spatter", "fgo"])


def test_a_cached_image_stream_made_by_another_recipe_is_made_again_and_said(tmp_path, caplog):
    """The stream cache records each image stream's recipe (its pool, its switching shifts): a file of this stream's
    name made by another recipe (a stale file: the COCO-C-16 diverse stream under the validation pool's name) is made
    again, with a warning, and rewritten; a file without a recipe (written before recipes were recorded) is read."""
    import shutil

    from safetensors import safe_open
    from safetensors.numpy import save_file

    from hf_tta.benchmarks.tasks import EmojiTask
    from hf_tta.data.corruptions import VALIDATION_IMAGE_CORRUPTIONS

    diverse = Condition("i2t", "diverse")
    plain = EmojiTask(limit=12, render_factor=1.5, cache_dir=tmp_path / "plain")
    fresh = EmojiTask(limit=12, render_factor=1.5, stream_corruptions=VALIDATION_IMAGE_CORRUPTIONS).queries(diverse, 3)[0]
    task = EmojiTask(limit=12, render_factor=1.5, cache_dir=tmp_path / "v", stream_corruptions=VALIDATION_IMAGE_CORRUPTIONS)
    stale = plain.queries(diverse, 3)[0]
    task.cache_file(diverse, 3).parent.mkdir(parents=True)
    shutil.copy(plain.cache_file(diverse, 3), task.cache_file(diverse, 3))  # another stream under this stream's name
    with caplog.at_level("WARNING", logger="hf_tta.benchmarks.tasks"):
        raw = task.queries(diverse, 3)[0]
    assert np.array_equal(raw, fresh) and not np.array_equal(raw, stale)
    assert "was made by another recipe" in caplog.text and '"speckle_noise", 5' in caplog.text
    with safe_open(str(task.cache_file(diverse, 3)), framework="np") as f:
        assert f.metadata()["recipe"] == task.stream_recipe(diverse, 3)  # rewritten with its own recipe
    # a file without a recipe is read as it is
    legacy = EmojiTask(limit=12, render_factor=1.5, cache_dir=tmp_path / "legacy", stream_corruptions=VALIDATION_IMAGE_CORRUPTIONS)
    legacy.cache_file(diverse, 3).parent.mkdir(parents=True)
    save_file({"images": np.ascontiguousarray(stale)}, str(legacy.cache_file(diverse, 3)))
    assert np.array_equal(legacy.queries(diverse, 3)[0], stale)
    # the switching stream's recipe names its shifts and segment length
    switch = Condition("i2t", "switch")
    before = task.stream_recipe(switch, 3)
    task.switch_every = 4
    assert task.stream_recipe(switch, 3) != before and '"every": 4' in task.stream_recipe(switch, 3)


def test_a_cached_text_stream_records_its_recipe_and_one_of_another_recipe_is_made_again(tmp_path, caplog):
    """The text stream cache (JSON) records the recipe as the image cache does: a switching stream cached with another
    segment length is made again, with a warning, and rewritten; a bare list (written before recipes) is read."""
    import json

    from hf_tta.benchmarks.tasks import EmojiTask

    switch = Condition("t2i", "switch")
    first = EmojiTask(limit=12, cache_dir=tmp_path)
    first.switch_every = 4
    by_four = first.queries(switch, 3)[0]
    path = first.cache_file(switch, 3)
    assert json.loads(path.read_text(encoding="utf-8")) == {"recipe": first.stream_recipe(switch, 3), "queries": list(by_four)}
    second = EmojiTask(limit=12, cache_dir=tmp_path)  # the default segment length: another recipe under the same name
    fresh = EmojiTask(limit=12).queries(switch, 3)[0]
    assert fresh != by_four
    with caplog.at_level("WARNING", logger="hf_tta.benchmarks.tasks"):
        assert second.queries(switch, 3)[0] == fresh
    assert "was made by another recipe" in caplog.text
    assert json.loads(path.read_text(encoding="utf-8"))["recipe"] == second.stream_recipe(switch, 3)
    path.write_text(json.dumps(list(by_four)), encoding="utf-8")  # a legacy file: read as it is
    assert EmojiTask(limit=12, cache_dir=tmp_path).queries(switch, 3)[0] == list(by_four)
