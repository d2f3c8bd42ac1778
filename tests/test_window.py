"""The window of recent queries (``TTAConfig.window``, hf_tta/window.py): a micro-batch's batch statistics are those of
the batch and the window's rows, computed here by hand over all of them; gradients reach only the current queries;
window=0 is the per-batch path; the window is part of the adapted state (saved, reset, rolled back); the safety layer
judges a batch of 2 with a full window."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

from hf_tta import TTAConfig, TTAWrapper, window
from hf_tta.config import SafetyConfig
from hf_tta.objectives.base import ObjectiveInputs, build_objective, lowest_fraction
from hf_tta.objectives.tcr import init_queue_state
from hf_tta.safety import SafetyMonitor
from hf_tta.window import WindowView
from support import dense_gallery, image_stream
from tiny_models import make_model

D, N = 4, 10


def _unit(*shape, seed):
    return F.normalize(torch.randn(*shape, generator=torch.Generator().manual_seed(seed)), dim=-1)


def _window(rows: int, seed: int = 5, seen: int = 10_000, requires_grad: bool = False) -> WindowView:
    q = _unit(rows, D, seed=seed).requires_grad_(requires_grad)
    g = _unit(rows, D, seed=seed + 1).requires_grad_(requires_grad)
    ids = torch.arange(rows)
    return WindowView(q, g, ids, ids.clone(), seen=seen, size=rows)


def _inputs(zq, gallery, win, **kw) -> ObjectiveInputs:
    return ObjectiveInputs(query_emb=zq, gallery_emb=gallery, scores=zq @ gallery.T, window=win, **kw)


def _entropy(logits):
    logp = logits.log_softmax(dim=1)
    return -(logp.exp() * logp).sum(dim=1)


# ------------------------------------------------------------------------------------- TCR by hand
def test_tcr_batch_terms_over_the_batch_and_the_window_equal_the_terms_by_hand():
    gallery = _unit(N, D, seed=1)
    zq = _unit(2, D, seed=2).requires_grad_(True)
    win = _window(6, requires_grad=True)  # leaves with grad: the objective must not reach them
    state = init_queue_state("cpu")
    queue_q, queue_g = _unit(3, D, seed=7), _unit(3, D, seed=8)
    state.update(queue_si=torch.zeros(3), queue_q=queue_q, queue_g=queue_g, queue_entropy=torch.tensor([0.5, 1.5, 1.0]),
                 queue_updates=torch.tensor(10))  # the queue is frozen (and seen >= 640): no update this step
    out = build_objective("tcr")(_inputs(zq, gallery, win), state)

    # by hand, over the 8 rows: the 2 current queries and the 6 window rows (TCR Eq. 5, 9, 10, 11)
    nn = (zq.detach() @ gallery.T).argmax(dim=1)
    q_all = torch.cat([zq, win.query_emb.detach()])
    g_all = torch.cat([gallery[nn], win.candidate_emb.detach()])
    delta_s = (queue_q.mean(0) - queue_g.mean(0)).norm()
    e_max = 1.5
    ent = _entropy(q_all @ g_all.T / 0.02)
    weight = (1 - ent.detach() / (e_max + 1e-3)).clamp(min=0)
    keep = ent.detach() <= e_max
    l_na = (ent * weight)[keep].sum() / keep.sum()
    l_mu = torch.stack([torch.exp(-(q_all[i] - q_all.mean(0)).norm() / 10) for i in range(8)]).mean()
    l_mg = ((q_all.mean(0) - g_all.mean(0)).norm() - delta_s) ** 2
    for name, value in (("loss_na", l_na), ("loss_mu", l_mu), ("loss_mg", l_mg)):
        assert torch.allclose(out.logs[name], value.detach(), atol=1e-6), name
    assert int(out.n_selected) == int(keep.sum())
    # the same gradient as the hand loss for the current queries, none for the window rows
    (g_obj,) = torch.autograd.grad(out.loss, zq, retain_graph=True)
    (g_hand,) = torch.autograd.grad(l_na + l_mu + l_mg, zq)
    assert torch.allclose(g_obj, g_hand, atol=1e-5) and g_obj.abs().sum() > 0
    out.loss.backward()
    assert win.query_emb.grad is None and win.candidate_emb.grad is None
    # without the window the terms are the batch of 2's (as before): the window changed them
    alone = build_objective("tcr")(_inputs(zq, gallery, None), {k: v.clone() for k, v in state.items()})
    assert not torch.allclose(alone.logs["loss_mu"], out.logs["loss_mu"])


def test_tcr_queue_takes_the_current_rows_among_the_lowest_si_of_batch_and_window():
    gallery = _unit(N, D, seed=1)
    zq = _unit(2, D, seed=2)
    tcr = build_objective("tcr")
    for seen, expect_update in ((0, True), (639, True), (640, False)):
        state = init_queue_state("cpu")
        tcr(_inputs(zq, gallery, _window(8, seen=seen)), state)
        assert int(state["queue_updates"]) == int(expect_update)
        if not expect_update:
            continue
        # by hand: SI over the 10 rows (centres over them), the int(0.3 * 10) = 3 lowest, of which the current rows
        nn = (zq @ gallery.T).argmax(dim=1)
        w = _window(8, seen=seen)
        q_all, g_all = torch.cat([zq, w.query_emb]), torch.cat([gallery[nn], w.candidate_emb])
        si = 2 * (q_all - g_all).norm(dim=1) - ((q_all - q_all.mean(0)).norm(dim=1) + (g_all - g_all.mean(0)).norm(dim=1))
        lowest = si.argsort()[:3]
        current = sorted(i for i in lowest.tolist() if i < 2)
        assert torch.allclose(state["queue_si"].sort().values, si[current].sort().values)
        assert state["queue_q"].shape == (len(current), D)


# ------------------------------------------------------------------------------------- EATA, SAR, DeYO thresholds
def test_lowest_fraction_takes_the_window_entropies_into_the_threshold():
    e = torch.tensor([0.25, 0.1])
    context = torch.tensor([0.2, 0.3, 0.4, 0.6, 0.7, 0.8])
    mask, threshold = lowest_fraction(e, 0.4, context)  # k = int(0.4 * 8) = 3: 0.1, 0.2, 0.25
    assert float(threshold) == 0.25 and mask.tolist() == [True, True]
    mask, threshold = lowest_fraction(e, 0.4)  # the batch alone: k = max(1, int(0.8)) = 1
    assert float(threshold) == pytest.approx(0.1) and mask.tolist() == [False, True]


def _window_entropies(win, gallery, tau=1.0):
    return _entropy(win.query_emb @ gallery.T / tau)


@pytest.mark.parametrize("objective", ["sar", "eata"])
def test_sar_and_eata_tcr_port_threshold_is_over_the_batch_and_the_window(objective):
    gallery = _unit(N, D, seed=1)
    zq = _unit(2, D, seed=3).requires_grad_(True)
    win = _window(6)
    obj = build_objective(objective, {"tau": 1.0})  # entropies away from 0, so the threshold is a real comparison
    state = obj.init_state()
    out = obj(_inputs(zq, gallery, win), state)
    ent = _entropy(zq.detach() @ gallery.T)
    pool = torch.cat([ent, _window_entropies(win, gallery)])
    threshold = pool.sort().values[int(0.4 * 8) - 1]  # the k-th smallest, k = int(0.4 * 8) = 3
    selected = ent <= threshold
    if objective == "sar":
        assert torch.allclose(out.logs["entropy_margin"], threshold)
        assert int(out.logs["selected"]) == int(selected.sum())
    else:
        assert int(out.logs["reliable"]) == int(selected.sum())
    # the "paper" selection is per query with an absolute threshold: the window changes nothing
    paper = build_objective(objective, {"selection": "paper", "tau": 1.0})
    a = paper(_inputs(zq, gallery, win), paper.init_state())
    b = paper(_inputs(zq, gallery, None), paper.init_state())
    assert (a.loss is None and b.loss is None) or torch.equal(a.loss, b.loss)


def test_deyo_tcr_port_filter_and_e0_take_the_window_in():
    gallery = _unit(N, D, seed=1)
    zq = _unit(3, D, seed=4).requires_grad_(True)
    win = _window(7, seed=9)
    deyo = build_objective("deyo", {"tau": 1.0})
    out = deyo(_inputs(zq, gallery, win, query_modality="text", reencode=lambda t: None), {})
    ent = _entropy(zq.detach() @ gallery.T)
    w_ent = _window_entropies(win, gallery)
    pool = torch.cat([ent, w_ent]).sort().values
    e_k = pool[int(0.5 * 10) - 1]
    first = ent < e_k
    assert out.logs["entropy_selected"] == float(first.sum())
    if first.any():  # text queries in the port: PLPD = 0 > -1, every entropy-selected query trains
        survivors = torch.cat([ent[first], w_ent[w_ent < e_k]]).sort().values
        k = int(0.4 * survivors.numel())
        e_0 = survivors[k - 1] if k > 0 else torch.tensor(math.inf)
        assert torch.allclose(out.logs["e_0"], e_0)


# ------------------------------------------------------------------------------------- the safety layer
def _source_view(top1: list[int], win: WindowView | None) -> ObjectiveInputs:
    scores = F.one_hot(torch.tensor(top1), N).float()
    return ObjectiveInputs(query_emb=_unit(len(top1), D, seed=0), gallery_emb=_unit(N, D, seed=1), scores=scores, window=win)


def test_safety_judges_a_batch_of_two_with_a_full_window():
    monitor = SafetyMonitor(SafetyConfig())  # min_queries = 8
    assert monitor.before(_source_view([3, 3], None)).action is None and not monitor._judged  # 2 < 8: not judged
    ids = torch.full((6,), 3)
    degenerate = WindowView(torch.zeros(6, D), torch.zeros(6, D), ids, ids.clone(), seen=6, size=6)
    decision = monitor.before(_source_view([3, 3], degenerate))  # 8 rows, all item 3: diversity 0
    assert decision.action == "skip_degenerate" and monitor.logs["source_diversity"] == 0.0

    top1 = torch.tensor([0, 1, 2, 4, 5, 6])
    adapted = torch.tensor([0, 1, 2, 4, 7, 7])  # two window rows moved when they were adapted on
    diverse = WindowView(torch.zeros(6, D), torch.zeros(6, D), adapted, top1, seen=6, size=6)
    monitor = SafetyMonitor(SafetyConfig(min_agreement=0.0, max_agreement_drop=1.0))
    source = _source_view([8, 9], diverse)
    assert monitor.before(source).action is None
    assert monitor.logs["source_diversity"] == pytest.approx(7 / 7)  # 8 distinct of 8
    scores = F.one_hot(torch.tensor([8, 8]), N).float()  # now both current queries retrieve item 8
    monitor.after(dataclasses.replace(source, scores=scores), scores)
    # over the 8 rows: adapted top-1 {0, 1, 2, 4, 7, 8}: (6 - 1) / 7; agreement: 4 window rows + 1 current of 8
    assert monitor.logs["adapted_diversity"] == pytest.approx(5 / 7)
    assert monitor.logs["agreement"] == pytest.approx(5 / 8)
    # rows pushed without the safety layer (source top-1 unknown, -1) are left out
    unknown = WindowView(torch.zeros(6, D), torch.zeros(6, D), top1, torch.full((6,), -1), seen=6, size=6)
    monitor = SafetyMonitor(SafetyConfig())
    monitor.before(_source_view([3, 3], unknown))
    assert not monitor._judged


# ------------------------------------------------------------------------------------- the wrapper
def _tcr(win: int, **cfg) -> TTAWrapper:
    return TTAWrapper(make_model("clip"), TTAConfig(objective="tcr", query_modality="image", window=win, **cfg))


def test_record_keeps_the_last_rows_detached_and_counts_the_queries():
    tta, gallery = _tcr(5, safety={}), dense_gallery()
    stream = image_stream(4, size=2)
    for x in stream:
        tta.adapt_step(x, gallery)
    w = window.view(tta.state, 5)
    assert len(w) == 5 and w.seen == 8 and not w.query_emb.requires_grad
    assert torch.allclose(w.query_emb.norm(dim=1), torch.ones(5), atol=1e-5)
    assert torch.equal(w.candidate_emb, gallery.embeddings[w.top1])  # each row's top-1 item
    assert (w.source_top1 >= 0).all()  # the safety layer ran the source model
    # the last two rows are the last batch's: its source top-1 items
    with tta.disabled():
        src = tta.embed_and_score(stream[-1], gallery)[1].argmax(dim=1)
    assert torch.equal(w.source_top1[-2:], src)


def test_window_zero_is_the_per_batch_path():
    tta, gallery = _tcr(0), dense_gallery()
    default = TTAWrapper(make_model("clip"), TTAConfig(objective="tcr", query_modality="image"))
    for x in image_stream(3, size=4):
        assert torch.equal(tta.adapt_step(x, gallery).scores, default.adapt_step(x, gallery).scores)
    assert not any(k.startswith("window.") for k in tta.state) and window.view(tta.state, 0) is None


def test_the_window_changes_a_micro_batch_stream_and_reset_clears_it():
    gallery, stream = dense_gallery(), image_stream(6, size=2)
    off, on = _tcr(0), _tcr(6)
    outs = [(off.adapt_step(x, gallery).scores, on.adapt_step(x, gallery).scores) for x in stream]
    assert not torch.equal(outs[-1][0], outs[-1][1])
    assert window.view(on.state, 6).seen == 12
    on.reset()
    assert not any(k.startswith("window.") for k in on.state)
    assert torch.equal(on.adapt_step(stream[0], gallery).scores, outs[0][1])  # from the source again, bit for bit


def test_a_rollback_restores_the_window_of_the_last_good_state(push):
    cfg = TTAConfig(objective=push, objective_config={"mode": "shift", "harm_batches": [3]}, lr=0.5, window=6,
                    safety={"min_agreement": 0.8, "collapse_ratio": 0.0, "min_source_diversity": 0.0})
    tta, gallery, stream = TTAWrapper(make_model("clip"), cfg), dense_gallery(), image_stream(4, size=4)
    for x in stream[:3]:
        assert tta.adapt_step(x, gallery).safety_action is None
    before = {k: v.clone() for k, v in tta.state.items() if k.startswith("window.")}
    assert int(before["window.seen"]) == 12
    assert tta.adapt_step(stream[3], gallery).safety_action == "rollback"
    after = {k: v for k, v in tta.state.items() if k.startswith("window.")}
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)


def test_window_config_is_checked():
    for bad in (-1, 1.5, True):
        with pytest.raises((ValueError, TypeError), match="window"):
            TTAConfig(window=bad)
    with pytest.raises(ValueError, match="episodic"):
        TTAConfig(window=8, reset_policy="episodic")
    assert TTAConfig.from_dict(TTAConfig(window=8).to_dict()).window == 8
