"""TCR's equations (hf_tta/objectives/tcr.py; TCR, ICLR 2025, Eq. 4-11) on small tensors against values derived by hand."""

from __future__ import annotations

import math

import pytest
import torch

from hf_tta.objectives import build_objective, softmax_entropy
from hf_tta.objectives.tcr import (
    gap_loss,
    init_queue_state,
    noise_robust_entropy,
    queue_constraints,
    si_score,
    uniformity_loss,
    update_queue,
)
from objective_helpers import embedding_inputs

ZQ = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
ZG = torch.tensor([[1.0, 0.0], [1.0, 0.0]])
R = math.sqrt(0.5)  # distance of each query to the query centre (0.5, 0.5)


def test_si_score_eq6():
    # pair 0: 2*0 - (R + 0); pair 1: 2*sqrt(2) - (R + 0); candidates coincide with their centre
    expected = torch.tensor([-R, 2 * math.sqrt(2) - R])
    assert torch.allclose(si_score(ZQ, ZG), expected, atol=1e-6)


def test_uniformity_eq9():
    assert uniformity_loss(ZQ, t=10.0).item() == pytest.approx(math.exp(-R / 10), abs=1e-6)
    assert uniformity_loss(ZQ, t=1.0).item() == pytest.approx(math.exp(-R), abs=1e-6)


def test_gap_eq10():
    # centres (0.5, 0.5) and (1, 0): gap = sqrt(0.5)
    assert gap_loss(ZQ, ZG, torch.tensor(0.2)).item() == pytest.approx((R - 0.2) ** 2, abs=1e-6)


def test_noise_robust_entropy_eq11():
    e = torch.tensor([0.1, 0.5, 0.9], requires_grad=True)
    loss, mask = noise_robust_entropy(e, torch.tensor(0.5), eps=1e-3)
    w = [1 - 0.1 / 0.501, 1 - 0.5 / 0.501]  # the third is above E_m: weight 0 and excluded
    assert mask.tolist() == [True, True, False]
    assert loss.item() == pytest.approx((0.1 * w[0] + 0.5 * w[1]) / 2, abs=1e-7)
    loss.backward()  # the weight is detached: d loss / d E_i = w_i / |selected|
    assert torch.allclose(e.grad, torch.tensor([w[0] / 2, w[1] / 2, 0.0]), atol=1e-6)


def test_noise_robust_entropy_empty_selection_is_zero_not_nan():
    e = torch.tensor([0.9, 0.8], requires_grad=True)
    loss, mask = noise_robust_entropy(e, torch.tensor(0.1))
    assert not mask.any() and loss.item() == 0.0


def test_entropy_of_uniform_refined_prediction():
    logits = torch.zeros(3, 4)
    assert torch.allclose(softmax_entropy(logits), torch.full((3,), math.log(4)))


def test_queue_keeps_lowest_si_and_caps_at_size():
    torch.manual_seed(0)
    state = init_queue_state("cpu")
    all_si, all_q = [], []
    for _ in range(3):  # batches of 4, ratio 0.5 -> 2 pairs each, capacity 3
        zq = torch.nn.functional.normalize(torch.randn(4, 2), dim=1)
        zg = torch.nn.functional.normalize(torch.randn(4, 2), dim=1)
        logits = zq @ zg.T / 0.02
        si = si_score(zq, zg)
        low = si.argsort()[:2]
        all_si.append(si[low])
        all_q.append(zq[low])
        update_queue(state, zq, zg, logits, ratio=0.5, size=3)
    si = torch.cat(all_si)
    keep = si.argsort()[:3]
    assert torch.allclose(state["queue_si"], si[keep])
    assert torch.allclose(state["queue_q"], torch.cat(all_q)[keep])
    assert int(state["queue_updates"]) == 3


def test_queue_constraints_eq7_eq8():
    state = init_queue_state("cpu")
    state.update(queue_si=torch.tensor([0.0, 1.0]), queue_q=ZQ, queue_g=ZG, queue_entropy=torch.tensor([0.3, 0.7]))
    delta_s, e_m = queue_constraints(state)
    assert delta_s.item() == pytest.approx(R, abs=1e-6)
    assert e_m.item() == pytest.approx(0.7)


def test_tcr_loss_is_sum_of_terms_on_refined_prediction():
    torch.manual_seed(1)
    zq = torch.nn.functional.normalize(torch.randn(8, 4), dim=1).requires_grad_()
    gallery = torch.nn.functional.normalize(torch.randn(30, 4), dim=1)
    tcr = build_objective("tcr")
    state = tcr.init_state()
    out = tcr(embedding_inputs(zq, gallery), state)
    # by hand: candidates = argmax rows; refined logits = zq @ zg'^T / 0.02 (B x B)
    nn_idx = (zq @ gallery.T).argmax(1)
    zg = gallery[nn_idx]
    logits = zq @ zg.T / 0.02
    assert torch.allclose(out.logits, logits)
    k = int(0.3 * 8)  # = 2 source-like pairs enter the queue
    assert state["queue_si"].numel() == k
    low = si_score(zq.detach(), zg).argsort()[:k]
    p = logits.detach().softmax(1)
    ent = -(p * p.log()).sum(1)
    assert torch.allclose(state["queue_entropy"], ent[low], atol=1e-5)
    delta_s = (zq.detach()[low].mean(0) - zg[low].mean(0)).norm()
    e_m = ent[low].max()
    w = (1 - ent / (e_m + 1e-3)).clamp(min=0)
    sel = ent <= e_m
    l_na = (ent * w)[sel].mean()
    l_mu = torch.exp(-(zq.detach() - zq.detach().mean(0)).norm(dim=1) / 10).mean()
    l_mg = ((zq.detach().mean(0) - zg.mean(0)).norm() - delta_s) ** 2
    assert out.n_selected == int(sel.sum())
    assert out.loss.item() == pytest.approx((l_na + l_mu + l_mg).item(), abs=1e-5)
    assert float(out.logs["loss_na"]) == pytest.approx(l_na.item(), abs=1e-5)


def test_queue_updates_only_at_step0_of_first_10_batches():
    torch.manual_seed(2)
    tcr = build_objective("tcr")
    state = tcr.init_state()
    gallery = torch.nn.functional.normalize(torch.randn(30, 4), dim=1)
    for b in range(12):
        for step in range(3):
            zq = torch.nn.functional.normalize(torch.randn(10, 4), dim=1)
            tcr(embedding_inputs(zq, gallery, step=step, batch_index=b), state)
    assert int(state["queue_updates"]) == 10
    assert state["queue_si"].numel() == 30  # 10 batches x int(0.3 * 10) pairs, below the capacity of 64


def test_queue_capacity_is_the_configured_size_not_the_current_batch():
    """Authors' runs: B = 64, 19 pairs a batch, capacity 64. A short batch (8 queries, 2 pairs) among the first ten
    must not cut the queue to 8: it keeps the 64 lowest-SI pairs of all 83 seen."""
    g = torch.Generator().manual_seed(4)
    gallery = torch.nn.functional.normalize(torch.randn(50, 4, generator=g), dim=1)
    tcr = build_objective("tcr")
    assert tcr.config.queue_size == 64
    state = tcr.init_state()
    entered = []
    for b, size in enumerate([64, 64, 64, 8, 64]):
        zq = torch.nn.functional.normalize(torch.randn(size, 4, generator=g), dim=1)
        nn_idx = (zq @ gallery.T).argmax(1)
        si = si_score(zq, gallery[nn_idx])
        entered.append(si[si.argsort()[: int(0.3 * size)]])
        tcr(embedding_inputs(zq, gallery, step=0, batch_index=b), state)
        seen = torch.cat(entered)
        assert state["queue_si"].numel() == min(64, seen.numel())  # 19, 38, 57, 59 (the short batch), 64
        assert torch.allclose(state["queue_si"].sort().values, seen.sort().values[:64])


def test_queue_keeps_the_embeddings_dtype():
    g = torch.Generator().manual_seed(5)
    gallery = torch.nn.functional.normalize(torch.randn(20, 4, generator=g), dim=1).bfloat16()
    zq = torch.nn.functional.normalize(torch.randn(10, 4, generator=g), dim=1).bfloat16()
    tcr = build_objective("tcr")
    state = tcr.init_state()
    tcr(embedding_inputs(zq, gallery), state)
    assert {state[k].dtype for k in ("queue_si", "queue_q", "queue_g", "queue_entropy")} == {torch.bfloat16}
