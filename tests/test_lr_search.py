"""The learning-rate search (hf_tta/lr_search.py, TTAConfig.lr_search, issue 37): the choice rule by hand, each proxy
on small tensors, the probe against fixed-lr wrappers (its shadows are those wrappers, bit for bit), the served answer
and the counted cost, save/resume mid-probe, reset, the safety layer's rollback and reset, the back-off, a non-finite
batch, and the config's refusals."""

from __future__ import annotations

import json
import math

import pytest
import torch

from hf_tta import ChunkedGallery, LRSearchConfig, RoutedTTAWrapper, TTAConfig, TTAWrapper
from hf_tta.lr_search import choose, proxy_value
from hf_tta.lr_search_config import SERVES
from hf_tta.objectives.base import ObjectiveInputs
from hf_tta.state import ALL, ROLLBACK, AdapterState
from support import PassHooks, assert_bit_equal, check_resume, dense_gallery, image_stream, source_scores, state_of
from tiny_models import batch, make_model

STREAM = [batch("image", 8, seed=70 + i) for i in range(6)]
LRS = [1e-3, 1e-2, 1e-1]


def _wrapper(objective: str = "tcr", steps: int = 1, **search) -> tuple[TTAWrapper, object]:
    extra = {k: search.pop(k) for k in ("safety", "objective_config", "lr") if k in search}
    cfg = TTAConfig(objective=objective, query_modality="image", steps=steps,
                    lr_search=LRSearchConfig(**{"candidates": LRS, "probe_batches": 3, **search}), **extra)
    tta = TTAWrapper(make_model("clip"), cfg)
    return tta, tta.encode_gallery(batch("text", 20, seed=1))


# ------------------------------------------------------------------------------------- the rule by hand
@pytest.mark.parametrize(
    "proxy, values, valid, floor, want",
    [
        ("next_loss", [3.0, 2.0, 2.5], [True] * 3, 0.5, 1),  # lowest loss
        ("next_loss", [3.0, 2.0, 2.5], [True, False, True], 0.5, 2),  # the best diverged once: out
        ("gap", [0.4, 0.3, 0.9], [True] * 3, 0.5, 1),  # smallest gap
        ("uniformity", [0.4, 0.3, 0.9], [True] * 3, 0.5, 2),  # largest spread
        ("agreement", [1.0, 0.7, 0.3], [True] * 3, 0.5, 1),  # highest lr at or above the floor
        ("agreement", [1.0, 0.7, 0.3], [True] * 3, 0.3, 2),  # the floor itself counts
        ("agreement", [1.0, 0.7, 0.3], [True] * 3, 0.8, 0),
        ("agreement", [0.4, 0.45, 0.1], [True] * 3, 0.5, 1),  # none above: the most agreeing
        ("next_loss", [2.0, 2.0, 2.0], [True] * 3, 0.5, 1),  # ties: nearest the base lr (1e-2)
        ("next_loss", [1.0, 2.0, float("nan")], [True] * 3, 0.5, 0),
        ("next_loss", [1.0, 2.0, 3.0], [False] * 3, 0.5, 0),  # nothing valid: the lowest lr
    ],
)
def test_the_choice_rule_by_hand(proxy, values, valid, floor, want):
    assert choose(proxy, LRS, values, valid, base_lr=1e-2, floor=floor) == want


def test_ties_go_to_the_base_lr_then_the_lower():
    lrs = [1e-4, 3e-4, 1e-3, 3e-3]
    assert choose("gap", lrs, [1.0] * 4, [True] * 4, base_lr=3e-4) == 1
    assert choose("gap", [1e-4, 1e-2], [1.0, 1.0], [True] * 2, base_lr=1e-3) == 0  # equally far: the lower


def test_each_proxy_on_small_tensors():
    # two queries, three gallery items; the source's top-1 are items 0 and 2, the shadow's 0 and 1
    q = torch.tensor([[1.0, 0.0], [0.0, 1.0]], dtype=torch.float64)
    gallery = torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.6, 0.8]], dtype=torch.float64)
    shadow = ObjectiveInputs(query_emb=q, gallery_emb=gallery, scores=torch.tensor([[0.9, 0.1, 0.2], [0.1, 0.9, 0.8]]))
    source = ObjectiveInputs(query_emb=q, gallery_emb=gallery, scores=torch.tensor([[0.9, 0.1, 0.2], [0.1, 0.5, 0.8]]))
    assert float(proxy_value("agreement", shadow, None, source)) == 0.5
    # uniformity: mean distance to the centre (0.5, 0.5) = sqrt(0.5); gap: |(0.5, 0.5) - (1.6/3, 1.8/3)|
    assert float(proxy_value("uniformity", shadow, None, source)) == pytest.approx(math.sqrt(0.5), abs=1e-12)
    assert float(proxy_value("gap", shadow, None, source)) == pytest.approx(math.hypot(0.5 - 1.6 / 3, 0.5 - 0.6), abs=1e-12)
    assert float(proxy_value("next_loss", shadow, 1.25, source)) == 1.25
    assert math.isnan(float(proxy_value("next_loss", shadow, None, source)))
    # with a top-k backend the top-1 are compared as gallery ids, not columns
    ids = torch.tensor([7, 3, 5])
    moved = ObjectiveInputs(query_emb=q, gallery_emb=gallery, scores=shadow.scores[:, [1, 0, 2]], candidate_ids=ids[[1, 0, 2]])
    topk_source = ObjectiveInputs(query_emb=q, gallery_emb=gallery, scores=source.scores, candidate_ids=ids)
    assert float(proxy_value("agreement", moved, None, topk_source)) == 0.5


# ------------------------------------------------------------------------------------- the probe
def _fixed(lr: float, steps: int = 1) -> tuple[TTAWrapper, object]:
    tta = TTAWrapper(make_model("clip"), TTAConfig(objective="tcr", query_modality="image", steps=steps, lr=lr))
    return tta, tta.encode_gallery(batch("text", 20, seed=1))


def test_the_probe_chooses_what_fixed_lr_runs_say_and_becomes_that_run(caplog):
    """Each shadow is a fixed-lr wrapper: with one step per batch, its out.loss on batch i is the shadow's prequential
    loss there. The proxy's means over batches 1 and 2 decide; the committed state is the chosen run's, bit for bit."""
    losses, states, runs = {}, {}, {}
    for lr in LRS:
        runs[lr] = fixed, g2 = _fixed(lr)
        losses[lr] = [fixed.adapt_step(x, g2).loss for x in STREAM[:3]]
        states[lr] = state_of(fixed)
    means = [(losses[lr][1] + losses[lr][2]) / 2 for lr in LRS]
    want = LRS[min(range(3), key=lambda k: means[k])]
    assert len({round(m, 6) for m in means}) == 3  # the stream tells the lrs apart
    tta, g = _wrapper()
    with caplog.at_level("INFO", logger="hf_tta"):
        outs = [tta.adapt_step(x, g) for x in STREAM[:3]]
    assert f"lr_search: chose lr={want:.3g} by next_loss over 3 probe batches" in caplog.text
    assert [tta.lr_search.probed] == [3] and tta.lr_search.chosen == want and tta.lr_search.lr == want
    assert tta.lr_search.scores == pytest.approx(dict(zip(LRS, means)), rel=1e-6)
    every = tta.lr_search.all_scores  # every proxy is recorded; each proxy's choice is its rule on its scores
    assert every["next_loss"] == tta.lr_search.scores and all(0 <= v <= 1 for v in every["agreement"].values())
    for proxy, lr in tta.lr_search.choices.items():
        assert lr == LRS[choose(proxy, LRS, list(every[proxy].values()), [True] * 3, tta.lr, 0.5)], proxy
    for i in (1, 2):
        assert [outs[i].logs[f"lr_search.next_loss@{lr:.3g}"] for lr in LRS] == pytest.approx([losses[lr][i] for lr in LRS], rel=1e-6)
    mine = {k: v for k, v in state_of(tta).items() if not k.startswith("selector.")}
    assert mine.keys() == states[want].keys() and all(torch.equal(mine[k], states[want][k]) for k in mine)
    assert not any(k.startswith("selector.shadow.") for k in state_of(tta))  # the other shadows are dropped
    assert tta.optimizer.param_groups[0]["lr"] == want
    fixed, g2 = runs[want]
    for x in STREAM[3:5]:  # from the commit on, the stream is the fixed-lr stream at the chosen lr
        a, b = tta.adapt_step(x, g), fixed.adapt_step(x, g2)
        assert torch.equal(a.scores, b.scores) and a.loss == b.loss and a.num_updates == b.num_updates == 1


def test_on_the_fast_path_the_committed_state_is_the_fixed_lr_run():
    """The one-sync fast path (fused AdamW; the default on CUDA) inside the probe: the committed state is the fixed-lr
    fast run's at the chosen lr, bit for bit, whichever lr the proxy chose."""
    run = {"fast_step": True}
    cfg = TTAConfig(objective="tcr", query_modality="image", steps=2, run=run,
                    lr_search=LRSearchConfig(candidates=LRS[:2], probe_batches=2))
    tta = TTAWrapper(make_model("clip"), cfg)
    g = tta.encode_gallery(batch("text", 20, seed=1))
    assert tta.fast_path_active
    for x in STREAM[:2]:
        tta.adapt_step(x, g)
    fixed = TTAWrapper(make_model("clip"), TTAConfig(objective="tcr", query_modality="image", steps=2, run=run,
                                                      lr=tta.lr_search.chosen))
    for x in STREAM[:2]:
        fixed.adapt_step(x, g)
    mine = {k: v for k, v in state_of(tta).items() if not k.startswith("selector.")}
    theirs = state_of(fixed)
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)



def test_the_source_answers_the_probe_and_its_cost_is_counted():
    tta, g = _wrapper(steps=2)
    passes, spent = PassHooks(tta), [0, 0]
    for x in STREAM[:3]:
        expected = source_scores(tta, x, g)
        assert torch.equal(tta.answer(x, g).scores, expected)  # the served state during the probe is the source
        passes.forward = passes.backward = 0
        out = tta.adapt_step(x, g)
        spent = [spent[0] + passes.forward, spent[1] + passes.backward]
        assert torch.equal(out.scores, expected) and not out.scores.requires_grad
        assert out.num_updates == 0 and out.loss is None  # the served state did not adapt
    # per probe batch: 1 source forward (the answer) + K x S forwards with grad, K x S backwards
    k, s, queries = len(LRS), 2, 3 * 8
    assert spent == [3 * (1 + k * s), 3 * k * s]
    cost = tta.lr_search.cost
    assert cost["queries"] == queries and cost["forward_per_query"] == 1 + k * s
    assert cost["forward"] == spent[0] * 8 and cost["backward"] == spent[1] * 8 and cost["backward_per_query"] == k * s
    passes.forward = passes.backward = 0
    tta.adapt_step(STREAM[3], g)  # committed: a fixed-lr batch, the probe counts no more
    assert (passes.forward, passes.backward) == (s, s) and tta.lr_search.cost == cost


def test_a_topk_backend_is_answered_by_the_source_during_the_probe():
    tta, g = _wrapper(proxy="agreement")
    backend = ChunkedGallery(g.embeddings, "text", k=4)
    for x in STREAM[:3]:  # the probe
        expected = tta.answer(x, backend)
        out = tta.adapt_step(x, backend)
        assert torch.equal(out.topk.indices, expected.topk.indices) and torch.equal(out.topk.values, expected.topk.values)
    assert tta.lr_search.chosen in LRS and all(0 <= v <= 1 for v in tta.lr_search.scores.values())
    assert tta.adapt_step(STREAM[3], backend).num_updates >= 1  # committed: the served state adapts


@pytest.mark.parametrize("cut, serve", [(1, "source"), (4, "source"), (1, "leader")],
                         ids=["mid_probe", "after_commit", "mid_probe_leader"])
def test_save_resume_equals_uninterrupted(cut, serve, tmp_path):
    check_resume(lambda: _wrapper(proxy="agreement", steps=2, serve=serve), STREAM, cut=cut, folder=tmp_path / "ckpt")


@pytest.mark.parametrize("objective", ["sar", "cliptta", "eata"])
def test_other_objectives_probe_and_resume_mid_probe(objective, tmp_path, caplog):
    """SAR (SAM's second pass in the step), ClipTTA (an extra optimised tensor, a fresh forward after the update), EATA
    (on the tiny model its first step selects no query: no loss, so next_loss is never scored: the lowest lr, warned)."""
    def make():
        return _wrapper(objective, steps=1, candidates=LRS[:2], probe_batches=2)

    check_resume(make, STREAM[:3], cut=1, folder=tmp_path / "ckpt")
    tta, g = make()
    with caplog.at_level("WARNING", logger="hf_tta"):
        for x in STREAM[:2]:
            tta.adapt_step(x, g)
    assert tta.lr_search.chosen in LRS[:2] and tta.lr_search.choices["agreement"] in LRS[:2]
    if objective == "eata":
        assert tta.lr_search.choices["next_loss"] is None and tta.lr_search.chosen == LRS[0]
        assert "no candidate could be scored by next_loss" in caplog.text


@pytest.mark.parametrize("serve", SERVES)
def test_reset_returns_to_the_source_and_probes_again(serve):
    tta, g = _wrapper(serve=serve)
    source = AdapterState.capture(_wrapper()[0], ALL)  # a wrapper that never adapted
    first = [tta.adapt_step(x, g) for x in STREAM[:4]]
    assert tta.lr_search.chosen is not None
    tta.reset()
    assert AdapterState.capture(tta, ALL).equals(source) and tta.selector_state == {}
    assert tta.lr_search.probing and tta.lr_search.chosen is None and tta.lr_search.cost["queries"] == 0
    again = [tta.adapt_step(x, g) for x in STREAM[:4]]
    assert all(torch.equal(a.scores, b.scores) and a.logs == b.logs for a, b in zip(first, again))
    tta.adapt_step(STREAM[0], g)
    tta.reset()  # mid-probe too
    assert AdapterState.capture(tta, ALL).equals(source)


# ------------------------------------------------------------------------------------- serve="leader" (selector (b))
def _answer_of(out) -> tuple[torch.Tensor, ...]:
    return (out.scores,) if out.topk is None else (out.topk.indices, out.topk.values)


@pytest.mark.parametrize("backend", ["dense", "topk"])
def test_the_leader_answers_the_probe_with_its_view_before_adapting(backend):
    """serve="leader": batches 0 and 1 answer as the source (no score yet); batch i >= 2 answers with the shadow that
    leads by the mean next_loss over batches 1 .. i-1, worked out here from fixed-lr runs (the shadows are those runs,
    bit for bit), with that shadow's forward before adapting on batch i: a one-step fixed-lr run's reported answer."""
    def gallery_of(g):
        return ChunkedGallery(g.embeddings, "text", k=4) if backend == "topk" else g

    losses, answers = {}, {}
    for lr in LRS:
        fixed, g2 = _fixed(lr)
        outs = [fixed.adapt_step(x, gallery_of(g2)) for x in STREAM[:4]]
        losses[lr], answers[lr] = [o.loss for o in outs], [_answer_of(o) for o in outs]
    tta, g = _wrapper(probe_batches=4, serve="leader")
    g = gallery_of(g)
    for i, x in enumerate(STREAM[:4]):
        means = [sum(losses[lr][1:i]) / max(i - 1, 1) for lr in LRS]
        lead = LRS[min(range(3), key=lambda k: means[k])] if i >= 2 else None
        assert i < 2 or len({round(m, 6) for m in means}) == 3  # no tie: the lowest mean leads
        assert tta.lr_search.leader == lead and (lead is None or tta.lr_search.choices["next_loss"] == lead)
        source = _answer_of(tta.answer(x, g))  # the served state during the probe: the source
        out = tta.adapt_step(x, g)
        want = source if lead is None else answers[lead][i]
        assert all(torch.equal(a, b) for a, b in zip(_answer_of(out), want)), i
        assert lead is None or not torch.equal(_answer_of(out)[-1], source[-1])  # the leader has moved off the source
        assert out.logs["lr_search.served"] == (lead or 0.0) and out.num_updates == 0 and out.loss is None
    assert tta.lr_search.leader is None and tta.lr_search.chosen is not None  # committed: the served state answers


def test_serving_the_leader_changes_only_the_probes_answers():
    """Who serves does not change what adapts: after every batch both wrappers' whole states are equal bit for bit
    (the same lr is chosen, the selector's state included), as are the passes; only the answers to the probe batches
    from the third on differ, and from the commit on the streams are one."""
    runs = {serve: _wrapper(steps=2, serve=serve) for serve in SERVES}
    outs = {serve: [] for serve in SERVES}
    for x in STREAM:
        for serve, (tta, g) in runs.items():
            outs[serve].append(tta.adapt_step(x, g))
        (a, _), (b, _) = runs["source"], runs["leader"]
        assert AdapterState.capture(a, ALL).equals(AdapterState.capture(b, ALL)) and a.passes == b.passes
    assert a.lr_search.chosen == b.lr_search.chosen and a.lr_search.cost == b.lr_search.cost
    for i, (x, y) in enumerate(zip(outs["source"], outs["leader"])):
        assert torch.equal(x.scores, y.scores) == (i != 2), i  # batch 2: the last probe batch, the first scored
        assert x.logs == {k: v for k, v in y.logs.items() if k != "lr_search.served"}
        assert ("lr_search.served" in y.logs) == (i < 3)


# ------------------------------------------------------------------------------------- the safety layer
HARM_STREAM = image_stream(6)


def _harmful(push, harm, mode="shift", **search):
    """test_safety's harmful setting (lr 0.5 moves the top-1, 5.0 collapses them), the base lr among 3 candidates: the
    push objective's loss is 0 off its harm batches, so every proxy ties and the base lr is chosen."""
    safety, lr = ({"min_agreement": 0.5, "collapse_ratio": 0.0}, 0.5) if mode == "shift" else ({}, 5.0)
    cfg = TTAConfig(objective=push, objective_config={"mode": mode, "harm_batches": harm}, lr=lr, safety=safety,
                    lr_search=LRSearchConfig(**{"candidates": [lr / 2, lr, 2 * lr], "probe_batches": 2, **search}))
    return TTAWrapper(make_model("clip"), cfg), dense_gallery()


def test_a_rollback_restores_the_selector_state_bit_exactly(push):
    tta, g = _harmful(push, harm=[3])
    for x in HARM_STREAM[:3]:  # the probe (batches 0, 1), then a kept batch
        tta.adapt_step(x, g)
    snapshot = AdapterState.capture(tta, ROLLBACK)
    assert tta.safety.last_good.equals(snapshot) and "chosen" in snapshot.selector
    out = tta.adapt_step(HARM_STREAM[3], g)  # harmful: the top-1 moves away from the source's
    assert out.safety_action == "rollback" and AdapterState.capture(tta, ROLLBACK).equals(snapshot)


def test_the_backoff_compounds_over_rollbacks_and_nothing_else_moves(push):
    tta, g = _harmful(push, harm=[3, 4], backoff=0.8)  # 0.5 -> 0.4 -> 0.32, above the lowest candidate 0.25
    for x in HARM_STREAM[:3]:
        tta.adapt_step(x, g)
    chosen, snapshot = tta.lr_search.chosen, AdapterState.capture(tta, ROLLBACK)
    for i, x in zip((3, 4), HARM_STREAM[3:5]):
        assert tta.adapt_step(x, g).safety_action == "rollback"
        assert tta.lr_search.lr == pytest.approx(chosen * 0.8 ** (i - 2), rel=1e-12)
        now = AdapterState.capture(tta, ROLLBACK)
        assert now.selector.keys() == snapshot.selector.keys()
        assert all(torch.equal(v, snapshot.selector[k]) for k, v in now.selector.items() if k != "lr")
        assert now.only({"params", "optimizer", "objective"}).equals(snapshot.only({"params", "optimizer", "objective"}))
    tta.adapt_step(HARM_STREAM[5], g)
    assert tta.optimizer.param_groups[0]["lr"] == pytest.approx(chosen * 0.64, rel=1e-12)


@pytest.mark.parametrize("backoff", [None, 0.5])
def test_a_safety_reset_returns_to_the_source_and_keeps_the_choice(push, backoff):
    tta, g = _harmful(push, harm=[2], mode="collapse", backoff=backoff)
    source = {k: v for k, v in state_of(tta).items()}
    for x in HARM_STREAM[:2]:
        tta.adapt_step(x, g)
    chosen, selector = tta.lr_search.chosen, dict(tta.selector_state)
    assert tta.adapt_step(HARM_STREAM[2], g).safety_action == "reset"
    assert {k: v for k, v in state_of(tta).items() if not k.startswith("selector.")}.keys() == source.keys()
    assert all(torch.equal(v, source[k]) for k, v in state_of(tta).items() if not k.startswith("selector."))
    assert not tta.lr_search.probing and tta.lr_search.chosen == chosen  # no new probe
    assert tta.lr_search.lr == chosen * (backoff or 1.0) == max(tta.lr_search.lr, tta.lr_search.candidates[0])
    assert all(torch.equal(v, selector[k]) for k, v in tta.selector_state.items() if k != "lr")
    tta.adapt_step(HARM_STREAM[3], g)
    assert tta.optimizer.param_groups[0]["lr"] == tta.lr_search.lr


def test_the_backoff_alone_starts_high_and_halves_down_to_the_lowest_candidate(push):
    tta, g = _harmful(push, harm=[1, 2, 4, 5], backoff=0.5, probe_batches=0)
    lrs = []
    for x in HARM_STREAM:
        out = tta.adapt_step(x, g)
        assert out.num_updates == 3  # no probe: every batch adapts the served state
        lrs.append(tta.lr_search.lr)
    assert tta.lr_search.chosen == 1.0 and tta.lr_search.cost["queries"] == 0
    assert lrs[0] == 1.0 and lrs[1] == 0.5 and lrs[2] == 0.25 and min(lrs) == 0.25  # floored at the lowest candidate
    first, g = _harmful(push, harm=[0], backoff=0.5, probe_batches=0)  # rolled back to the snapshot before the start
    assert first.adapt_step(HARM_STREAM[0], g).safety_action == "rollback" and first.lr_search.lr == 0.5


def test_save_resume_with_rollbacks_across_the_cut(push, tmp_path):
    check_resume(lambda: _harmful(push, harm=[3, 5]), HARM_STREAM, cut=4, folder=tmp_path / "ckpt")


# ------------------------------------------------------------------------------------- garbage in
def test_a_non_finite_loss_changes_nothing(push):
    """Batches 1 (mid-probe: every candidate's loss is NaN) and 4 (after the commit) change nothing adapted, the
    selector's state (counters included) and the RNG included; the probe goes on with the next batches."""
    cfg = TTAConfig(objective=push, objective_config={"mode": "nan", "harm_batches": [1, 4]}, steps=1,
                    lr_search=LRSearchConfig(candidates=LRS, probe_batches=3))
    tta = TTAWrapper(make_model("clip"), cfg)
    g = tta.encode_gallery(batch("text", 20, seed=1))
    for i, x in enumerate(STREAM[:5]):
        before, rng = AdapterState.capture(tta, ROLLBACK), tta.generator.get_state()
        out = tta.adapt_step(x, g)
        if i in (1, 4):
            assert AdapterState.capture(tta, ROLLBACK).equals(before) and torch.equal(rng, tta.generator.get_state())
            assert out.num_updates == 0 and torch.isfinite(out.scores).all()
        else:
            assert not AdapterState.capture(tta, ROLLBACK).equals(before)
    assert tta.lr_search.probed == 3 and tta.lr_search.cost["queries"] == 3 * 8 and tta.lr_search.chosen is not None


def test_an_error_inside_the_probe_leaves_the_wrapper_as_it_was(push):
    cfg = TTAConfig(objective=push, objective_config={"mode": "raise", "harm_batches": [1]}, lr=0.5,
                    lr_search=LRSearchConfig(candidates=[0.25, 0.5], probe_batches=3))
    tta = TTAWrapper(make_model("clip"), cfg)
    g = tta.encode_gallery(batch("text", 20, seed=1))
    tta.adapt_step(STREAM[0], g)
    before, rng = AdapterState.capture(tta, ALL), tta.generator.get_state()
    with pytest.raises(RuntimeError, match="push: batch 1"):
        tta.adapt_step(STREAM[1], g)
    assert AdapterState.capture(tta, ALL).equals(before) and torch.equal(rng, tta.generator.get_state())


# ------------------------------------------------------------------------------------- config
@pytest.mark.parametrize(
    "search, message",
    [
        ({"candidates": [1e-3]}, "`candidates` must be at least 2 finite lrs > 0 in increasing order"),
        ({"candidates": [1e-3, 1e-4]}, "`candidates` must be at least 2 finite lrs > 0 in increasing order"),
        ({"candidates": [0.0, 1e-3]}, "`candidates` must be at least 2 finite lrs > 0"),
        ({"candidates": [True, 1e-3]}, "`candidates` must be at least 2 finite lrs > 0"),
        ({"candidates": [1e-3, float("inf")]}, "LRSearchConfig `candidates` must be"),
        ({"probe_batches": 1}, "`probe_batches` must be an integer >= 2"),
        ({"probe_batches": 0}, "or 0 with `backoff` or `online` (no probe)"),
        ({"probe_batches": 2.0}, "LRSearchConfig `probe_batches` must be int"),
        ({"proxy": "loss"}, "LRSearchConfig `proxy` must be one of ['next_loss', 'agreement', 'uniformity', 'gap']"),
        ({"agreement_floor": 0.8}, "`agreement_floor` applies to proxy='agreement' only (here proxy='next_loss')"),
        ({"proxy": "agreement", "agreement_floor": 0.0}, "`agreement_floor` must be in (0, 1]"),
        ({"backoff": 1.0}, "`backoff` must be in (0, 1)"),
        ({"serve": "best"}, "LRSearchConfig `serve` must be one of ['source', 'leader'], got 'best'"),
        ({"serve": "leader", "probe_batches": 0, "online": "hypergradient"}, "`serve` applies to the probe only"),
        ({"probes": 3}, "LRSearchConfig has no field 'probes'"),
    ],
)
def test_bad_values_are_refused_in_one_line(search, message):
    with pytest.raises((TypeError, ValueError)) as info:
        TTAConfig(lr_search=search)
    assert message in str(info.value) and len(str(info.value).splitlines()) == 1, str(info.value)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"objective": "dn", "lr_search": {}}, "'dn' is training-free: drop lr_search"),
        ({"lr_search": {}, "reset_policy": "episodic"}, "reset_policy='episodic' resets every batch"),
        ({"lr_search": {}, "update_budget": {"fraction": 0.5}}, "drop one of them"),
        ({"lr": "auto"}, "TTAConfig(lr='auto') was removed"),
        ({"lr_search": {"backoff": 0.5}}, "`backoff` acts on the safety layer's rollbacks: set safety={}"),
        ({"lr": "fast"}, "`lr` must be"),
        ({"candidates": [1e-3, 1e-2]}, "TTAConfig has no field 'candidates'"),  # off: its fields are not TTAConfig's
        ({"lr_search": 3}, "`lr_search` must be None, a LRSearchConfig or a dict of its fields"),
    ],
)
def test_refused_where_it_cannot_run(kwargs, message):
    with pytest.raises((TypeError, ValueError)) as info:
        TTAConfig.from_dict(kwargs)
    assert message in str(info.value) and len(str(info.value).splitlines()) == 1, str(info.value)


def test_an_empty_lr_search_is_the_defaults_and_the_config_round_trips():
    cfg = TTAConfig(lr_search={})
    assert cfg == TTAConfig(lr_search=LRSearchConfig()) and cfg.lr is None
    data = json.loads(json.dumps(cfg.to_dict()))
    assert TTAConfig.from_dict(data) == cfg and data["lr_search"]["probe_batches"] == 4
    custom = TTAConfig(lr_search=LRSearchConfig(candidates=(1e-4, 1e-3), proxy="agreement", agreement_floor=0.7))
    assert TTAConfig.from_dict(json.loads(json.dumps(custom.to_dict()))) == custom
    assert LRSearchConfig().resolved_candidates(3e-5) == [1e-5, 3e-5, 1e-4, 3e-4, 1e-3]
    assert LRSearchConfig(proxy="agreement").floor == 0.5


def test_wrappers_that_cannot_probe_refuse_before_touching_the_model():
    model = make_model("clip")
    with pytest.raises(ValueError, match="RoutedTTAWrapper does not run TTAConfig.lr_search"):
        RoutedTTAWrapper(model, TTAConfig(lr_search={}))
    TTAWrapper(model, TTAConfig(lr_search={}))  # the model was left as it was: it can be wrapped



def test_the_modules_examples_run():
    import doctest

    import hf_tta.lr_search_config

    result = doctest.testmod(hf_tta.lr_search_config)  # LRSearchConfig's (hf_tta.lr_search re-exports it)
    assert result.attempted and not result.failed


def test_shadows_applied_to_a_wrapper_without_an_lr_search_are_refused_and_change_nothing():
    """A mid-probe state (its shadows in the selector part) cannot go into a wrapper whose bank does not exist: one line,
    before any part of it is applied."""
    tta, g = _wrapper()
    tta.adapt_step(STREAM[0], g)
    mid = AdapterState.capture(tta, ALL)
    assert len(mid.shadows) == len(LRS)
    plain, g2 = _fixed(1e-2)
    plain.adapt_step(STREAM[0], g2)
    before = state_of(plain)
    with pytest.raises(ValueError, match="holds lr-search shadows and this wrapper runs no lr search"):
        mid.apply(plain)
    assert_bit_equal(state_of(plain), before)


def test_an_optimiser_with_non_tensor_state_is_refused_in_one_line_and_changes_nothing(monkeypatch):
    """The shadows are saved as tensors: an optimiser that keeps other state is refused on the first probe batch, and
    the failed batch is undone (the wrapper as it was)."""

    class Noting(torch.optim.AdamW):
        def step(self, closure=None):
            out = super().step(closure)
            for p in self.state:
                self.state[p]["note"] = "not a tensor"
            return out

    tta, g = _wrapper()
    make = tta.objective.make_optimizer
    monkeypatch.setattr(tta.objective, "make_optimizer", lambda *a, **k: Noting(make(*a, **k).param_groups))
    before = state_of(tta)
    with pytest.raises(ValueError, match="lr_search keeps optimiser states of tensors only .*drop lr_search"):
        tta.adapt_step(STREAM[0], g)
    assert_bit_equal(state_of(tta), before)
    assert tta.lr_search.probed == 0 and len(tta.selector_shadows) == 0
