"""The update budget (hf_tta/update_budget.py, TTAConfig.update_budget): the schedule, the entropy trigger, what a
skipped batch costs (one forward, no backward: counted by hooks) and changes (nothing adapted), save/resume of a
budgeted stream, and the refusals."""

from __future__ import annotations

import math

import pytest
import torch

from hf_tta import TTAConfig, TTAWrapper
from hf_tta.gallery import ChunkedGallery
from hf_tta.state import ALL, AdapterState
from hf_tta.update_budget import UpdateBudgetConfig, mean_normalised_entropy
from support import QUIET, PassHooks, check_resume, state_of
from tiny_models import batch, make_model

STREAM = [batch("image", 8, seed=50 + i) for i in range(5)]


def _wrapper(budget, **extra) -> tuple[TTAWrapper, object]:
    tta = TTAWrapper(make_model("clip"), TTAConfig(objective="tcr", query_modality="image", update_budget=budget, **extra))
    return tta, tta.encode_gallery(batch("text", 20, seed=1))


@pytest.mark.parametrize(
    "budget,match",
    [
        ({}, "exactly one rule"),
        ({"fraction": 0.5, "entropy_threshold": 0.5}, "exactly one rule"),
        ({"fraction": 0.0}, r"`fraction` must be in \(0, 1\]"),
        ({"fraction": 1.5}, r"`fraction` must be in \(0, 1\]"),
        ({"entropy_threshold": 1.0}, r"`entropy_threshold` must be in \[0, 1\)"),
        ({"fraction": 0.5, "entropy_temperature": 0.05}, "set `entropy_threshold` or drop `entropy_temperature`"),
        ({"fraction": True}, "`fraction` must be"),
        ({"every": 2}, "valid keys"),
    ],
)
def test_config_refusals(budget, match):
    with pytest.raises(ValueError, match=match):
        TTAConfig(update_budget=budget)


def test_refused_with_a_training_free_objective_or_an_episodic_fraction():
    with pytest.raises(ValueError, match="training-free: drop update_budget"):
        TTAConfig(objective="dn", update_budget={"fraction": 0.5})
    with pytest.raises(ValueError, match="reset_policy='episodic' resets every batch"):
        TTAConfig(update_budget={"fraction": 0.5}, reset_policy="episodic")
    cfg = TTAConfig(update_budget=UpdateBudgetConfig(entropy_threshold=0.3), reset_policy="episodic")
    assert TTAConfig.from_dict(cfg.to_dict()) == cfg and cfg.resolved().update_budget["entropy_temperature"] == 0.01


@pytest.mark.parametrize("fraction", [1.0, 0.5, 0.25, 0.1, 0.3])
def test_the_schedule_is_evenly_spaced_and_exact(fraction):
    """After n batches exactly ceil(n f) were adapted on, batch 0 first (exact also where f * n is not in floats)."""
    cfg = UpdateBudgetConfig(fraction=fraction)
    adapted = [i for i in range(200) if cfg.adapts_on(i)]
    assert adapted[0] == 0
    for n in range(1, 201):
        assert sum(1 for i in adapted if i < n) == math.ceil(round(n * fraction, 9))
    gaps = {b - a for a, b in zip(adapted, adapted[1:])}
    assert max(gaps) - min(gaps) <= 1


def test_a_skipped_batch_costs_one_forward_and_changes_nothing():
    tta, g = _wrapper({"fraction": 0.5}, score_transform="dn")
    count = PassHooks(tta)
    out = tta.adapt_step(STREAM[0], g)  # batch 0: adapted on
    assert out.num_updates == 3 and count.backward == 3 and not out.skipped
    before, rng = state_of(tta), tta.generator.get_state()
    optimizer_steps = {n: s["step"].clone() for n, s in zip(tta.params, tta.optimizer.state.values())}
    expected = tta.answer(STREAM[1], g)  # what the current model answers, without adapting
    count.forward = count.backward = 0
    out = tta.adapt_step(STREAM[1], g)  # batch 1: skipped
    assert (count.forward, count.backward) == (1, 0)
    assert out.num_updates == 0 and out.loss is None and out.skipped == [
        "update budget: batch 1 is outside fraction=0.5 (answered, not adapted)"
    ]
    assert torch.equal(out.scores, expected.scores)  # through DN, as every answer
    after = state_of(tta)
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    assert torch.equal(rng, tta.generator.get_state()) and tta.batch_index == 2
    assert all(torch.equal(optimizer_steps[n], s["step"]) for n, s in zip(tta.params, tta.optimizer.state.values()))
    assert int(tta.transform_state["query_count"]) == 16  # the answered batch entered DN's query mean
    count.forward = count.backward = 0
    assert tta.adapt_step(STREAM[2], g).num_updates == 3 and count.backward == 3  # batch 2: adapted on again


def test_the_entropy_trigger():
    always, g = _wrapper({"entropy_threshold": 0.0})
    never, _ = _wrapper({"entropy_threshold": 0.999999})
    count = PassHooks(never)
    assert always.adapt_step(STREAM[0], g).num_updates == 3
    out = never.adapt_step(STREAM[0], g)
    assert out.num_updates == 0 and count.backward == 0 and count.forward == 1
    value = out.logs["update_budget_entropy"]
    assert 0 < value < 1 and value == pytest.approx(float(mean_normalised_entropy(out.scores, 0.01)), abs=1e-12)
    assert out.skipped[0].startswith("update budget: mean normalised entropy")
    # by hand: one row [ln 2 * T, 0] of two items at T = 0.01: softmax (2/3, 1/3), entropy / ln 2
    p = torch.tensor([[0.01 * math.log(2), 0.0]], dtype=torch.float64)
    want = -(2 / 3 * math.log(2 / 3) + 1 / 3 * math.log(1 / 3)) / math.log(2)
    assert float(mean_normalised_entropy(p, 0.01)) == pytest.approx(want, abs=1e-12)


def test_episodic_trigger_keeps_the_counter_at_zero():
    tta, g = _wrapper({"entropy_threshold": 0.999999}, reset_policy="episodic")
    source = AdapterState.capture(tta, ALL)
    tta.adapt_step(STREAM[0], g)
    assert tta.batch_index == 0 and AdapterState.capture(tta, ALL).equals(source)


def test_safety_does_not_judge_a_skipped_batch():
    tta, g = _wrapper({"fraction": 0.5}, safety=QUIET)
    tta.adapt_step(STREAM[0], g)
    counts, snapshot = tta.safety_counts, tta.safety.last_good
    out = tta.adapt_step(STREAM[1], g)
    assert out.safety_action is None and out.safety_logs == {} and tta.safety_counts == counts
    assert tta.safety.last_good is snapshot


def test_a_skipped_batch_on_a_topk_backend():
    tta, g = _wrapper({"fraction": 0.5})
    backend = ChunkedGallery(g.embeddings, "text", k=4)
    tta.adapt_step(STREAM[0], backend)
    expected = tta.answer(STREAM[1], backend)
    out = tta.adapt_step(STREAM[1], backend)
    assert out.scores is None and out.num_updates == 0
    assert torch.equal(out.topk.indices, expected.topk.indices) and torch.equal(out.topk.values, expected.topk.values)


@pytest.mark.parametrize("budget", [{"fraction": 0.5}, {"entropy_threshold": 0.18}])
def test_save_resume_of_a_budgeted_stream_equals_uninterrupted(budget, tmp_path):
    tta, g = _wrapper(budget, score_transform="dn")
    assert [tta.adapt_step(q, g).num_updates for q in STREAM][2:] == [3, 0, 3]  # both kinds of batch around the cut
    check_resume(lambda: _wrapper(budget, score_transform="dn"), STREAM, cut=3, folder=tmp_path / "ckpt")


def test_each_routed_domain_keeps_its_own_schedule():
    from hf_tta import RoutedTTAWrapper

    tta = RoutedTTAWrapper(make_model("clip"), TTAConfig(objective="tcr", query_modality="image", update_budget={"fraction": 0.5}))
    g = tta.encode_gallery(batch("text", 20, seed=1))
    updates = [tta.adapt_step(q, g, domain=d).num_updates for q, d in zip(STREAM, "aabab")]
    assert updates == [3, 0, 3, 3, 0]  # a: batches 0, 1, 2 of its own; b: 0, 1


# ------------------------------------------------------------------------------------- the cost meter (TTAWrapper.passes)
@pytest.mark.parametrize(
    "extra,want",
    [
        # TCR's 3 steps on every batch: 3 forwards (with grad) and 3 backwards per query
        ({}, (3.0, 3.0)),
        # + the answer of the current model before the update (prequential scoring): 4 + 3
        ({"run": {"scoring": "before_update"}}, (4.0, 3.0)),
        # 25 % of 8 batches (0 and 4) adapted on: 2 x (3 + 3), the 6 others one forward: (6 + 6) / 8, 6 / 8
        ({"update_budget": {"fraction": 0.25}}, (1.5, 0.75)),
        ({"update_budget": {"fraction": 0.25}, "run": {"scoring": "before_update"}}, (1.75, 0.75)),
        # gradient decoupling: a source forward per batch (its scores are reused by the steps), two gradients a step
        ({"gradient_decoupling": True, "update_budget": {"fraction": 0.25}}, (1.75, 1.5)),
    ],
)
def test_passes_per_query_by_hand_and_by_hooks(extra, want):
    """``TTAWrapper.passes`` against the hand count and against hooks on the query tower (a forward hook per batch
    forward, a gradient hook per backward through an adapted tensor), 8 batches of 8 queries."""
    tta, g = _wrapper(extra.get("update_budget"), **{k: v for k, v in extra.items() if k != "update_budget"})
    count = PassHooks(tta)
    stream = [batch("image", 8, seed=60 + i) for i in range(8)]
    for q in stream:
        tta.adapt_step(q, g)
    assert tta.passes.per_query(64) == want
    assert (tta.passes.forward, tta.passes.backward) == (8 * count.forward, 8 * count.backward)
    tta.answer(stream[0], g)  # an answer is one forward, no backward
    assert tta.passes.forward == 8 * count.forward and tta.passes.backward == round(want[1] * 64)
    tta.reset()
    assert (tta.passes.forward, tta.passes.backward) == (0, 0)
