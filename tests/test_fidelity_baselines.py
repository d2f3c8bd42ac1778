"""EATA, SAR and DeYO as TCR's baseline ports ran them (the default ``selection="tcr_port"``) and as their papers define
them (``selection="paper"``), on a fixed batch of 64 queries whose entropies are known in closed form (issue 13, items
2 and 3): selection counts, weights and losses derived by hand."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from hf_tta import TTAConfig, TTAWrapper
from hf_tta.objectives import LossOutput, ObjectiveInputs, build_objective
from tiny_models import batch, make_model

B, C = 64, 3


def fixed_batch() -> tuple[torch.Tensor, list[float]]:
    """Row i scores ``[a_i, 0, 0]`` with ``a_i = 0.1 i``: entropies strictly decrease with i, in closed form."""
    a = [0.1 * i for i in range(B)]
    scores = torch.tensor([[x, 0.0, 0.0] for x in a], dtype=torch.float64)
    ent = []
    for x in a:
        z = math.exp(x) + 2
        p, q = math.exp(x) / z, 1 / z
        ent.append(-(p * math.log(p) + 2 * q * math.log(q)))
    return scores, ent


def inputs(scores: torch.Tensor, **kw) -> ObjectiveInputs:
    zq = F.normalize(torch.ones(scores.shape[0], 4, dtype=scores.dtype), dim=1)
    zg = F.normalize(torch.ones(scores.shape[1], 4, dtype=scores.dtype), dim=1)
    return ObjectiveInputs(query_emb=zq, gallery_emb=zg, scores=scores, generator=torch.Generator().manual_seed(0), **kw)


def lowest(ent: list[float], k: int) -> set[int]:
    return set(sorted(range(len(ent)), key=lambda i: ent[i])[:k])


def test_sar_keeps_25_of_64_by_the_kth_smallest():
    scores, ent = fixed_batch()
    sar = build_objective("sar", {"tau": 1.0})
    out = sar(inputs(scores), sar.init_state())
    assert out.n_selected == 25 == int(0.4 * 64)  # the k-th smallest entropy and below
    kept = set(sar._first_pass["selected"].nonzero().flatten().tolist())
    assert kept == lowest(ent, 25) == set(range(39, 64))
    assert out.loss.item() == pytest.approx(sum(ent[i] for i in kept) / 25, abs=1e-12)
    # the interpolated 0.4-quantile with a strict '<' (what we did before) keeps one more
    assert int((torch.tensor(ent) < torch.quantile(torch.tensor(ent), 0.4)).sum()) == 26
    # paper: E < 0.4 ln 3
    sar = build_objective("sar", {"tau": 1.0, "selection": "paper"})
    out = sar(inputs(scores), sar.init_state())
    assert out.n_selected == sum(e < 0.4 * math.log(3) for e in ent)


def test_sar_empty_second_pass_updates_the_ema_in_the_port_only():
    scores, ent = fixed_batch()
    perturbed = torch.zeros_like(scores)  # at the perturbed point every query is maximally uncertain: pass 2 is empty
    for selection, moves in (("tcr_port", True), ("paper", False)):
        sar = build_objective("sar", {"tau": 1.0, "selection": selection, "margin_e0": 0.4})
        state = sar.init_state()
        state["ema"] = torch.tensor(0.5, dtype=torch.float64)
        first = sar(inputs(scores), state)
        second = sar(inputs(perturbed, in_closure=True), state)
        assert first.n_selected > 0 and second.n_selected == 0
        recovered = sar.on_step_end(inputs(scores), LossOutput(loss=None, n_selected=0), state)
        if moves:  # EMA <- 0.9 * 0.5 + 0.1 * ln 3 (the mean pass-2 entropy of the pass-1 queries)
            assert state["ema"].item() == pytest.approx(0.9 * 0.5 + 0.1 * math.log(3), abs=1e-12) and not recovered
        else:
            assert state["ema"].item() == 0.5


def test_eata_port_and_paper():
    scores, ent = fixed_batch()
    eata = build_objective("eata", {"tau": 1.0})
    out = eata(inputs(scores), eata.init_state())
    kept = lowest(ent, 25)
    assert out.n_selected == 25
    expected = sum(ent[i] / math.exp(ent[i] - 0.40) for i in kept) / 25  # weight 1/exp(E - 0.40), E_0 = 0.40 literally
    assert out.loss.item() == pytest.approx(expected, abs=1e-12)
    eata = build_objective("eata", {"tau": 1.0, "selection": "paper"})
    out = eata(inputs(scores), eata.init_state())
    e0 = 0.4 * math.log(3)
    kept = [i for i in range(B) if ent[i] < e0]
    assert out.n_selected == len(kept) and 0 < len(kept) < B
    assert out.loss.item() == pytest.approx(sum(ent[i] / math.exp(ent[i] - e0) for i in kept) / len(kept), abs=1e-12)


def test_selection_keeps_ties_at_the_threshold():
    scores = torch.tensor([[2.0, 0.0], [1.0, 0.0], [1.0, 0.0], [1.0, 0.0], [0.0, 0.0]], dtype=torch.float64)
    eata = build_objective("eata", {"tau": 1.0})  # k = int(0.4 * 5) = 2: the 2nd smallest entropy is tied 3 times
    assert eata(inputs(scores), eata.init_state()).n_selected == 4


def test_deyo_port_on_images():
    scores, ent = fixed_batch()
    seen = {}

    def reencode(transform):
        seen["rows"] = transform({"pixel_values": torch.zeros(B, 3, 8, 8)})["pixel_values"].shape[0]
        return None, torch.zeros(seen["rows"], C, dtype=torch.float64)  # uniform views: PLPD = p_max - 1/3 > 0

    deyo = build_objective("deyo", {"tau": 1.0})
    out = deyo(inputs(scores, reencode=reencode, query_modality="image"), {})
    kept = lowest(ent, 32)  # lowest 50 %
    assert seen["rows"] == 32 and out.n_selected == 32
    q40 = sorted(ent)[25 - 1]  # the k-th smallest entropy, k = int(0.4 * 64) = 25
    total = 0.0
    for i in kept:
        a = 0.1 * i
        p = math.exp(a) / (math.exp(a) + 2)
        d = p - 1 / 3
        total += ent[i] * (1 / (math.exp(ent[i] - q40) + 0.1) + (math.exp(d) + 0.1))
    assert out.loss.item() == pytest.approx(total / 32, abs=1e-10)


def test_deyo_paper_on_images():
    scores, ent = fixed_batch()

    def reencode(transform):
        rows = transform({"pixel_values": torch.zeros(B, 3, 8, 8)})["pixel_values"].shape[0]
        return None, torch.zeros(rows, C, dtype=torch.float64)

    deyo = build_objective("deyo", {"tau": 1.0, "selection": "paper", "plpd_threshold": 0.2})
    out = deyo(inputs(scores, reencode=reencode, query_modality="image"), {})
    e0, total, n = 0.4 * math.log(3), 0.0, 0
    for i in range(B):
        a = 0.1 * i
        d = math.exp(a) / (math.exp(a) + 2) - 1 / 3
        if ent[i] < 0.5 * math.log(3) and d > 0.2:
            total += ent[i] * (math.exp(-(ent[i] - e0)) + math.exp(d))
            n += 1
    assert out.n_selected == n and 0 < n < B
    assert out.loss.item() == pytest.approx(total / n, abs=1e-10)


def test_deyo_port_leaves_text_queries_at_the_source():
    """No text augmentation in the port: x' = x, PLPD = 0, nothing passes PLPD > 0, so t2i equals the source model."""
    scores, _ = fixed_batch()
    deyo = build_objective("deyo", {"tau": 1.0})

    def reencode(transform):
        raise AssertionError("the port re-encodes no text view")

    out = deyo(inputs(scores, reencode=reencode, query_modality="text"), {})
    assert out.n_selected == 0 and out.loss is None
    tta = TTAWrapper(make_model("clip"), TTAConfig(objective="deyo", query_modality="text"))
    g = tta.encode_gallery(batch("image", 10, seed=1))
    q = batch("text", 6, seed=2)
    with torch.no_grad():
        source = tta.adapter.score(tta.adapter.embed("text", q), g.embeddings)
    out = tta.adapt_step(q, g)
    assert out.num_updates == 0 and out.skipped  # every step skipped: nothing passes the PLPD filter
    assert all(torch.equal(p, tta.source_parameters()[n]) for n, p in tta.params.items())
    assert torch.allclose(out.scores, source, atol=1e-6)
