"""DeYO (hf_tta/objectives/deyo.py): the shape-destroying views, PLPD, and both selections on small tensors against
values derived by hand. ``selection="tcr_port"`` follows the disassembly of TCR's compiled port
(models/tta_baselines/__pycache__/deyo.cpython-39.pyc, ``forward_and_adapt_deyo``; offsets in the comments)."""

from __future__ import annotations

import logging
import math

import pytest
import torch

from hf_tta import TTAConfig, TTAWrapper
from hf_tta.objectives import build_objective
from hf_tta.objectives.deyo import patch_shuffle, plpd, port_kth_smallest, token_shuffle
from objective_helpers import B, C, fixed_batch, fixed_inputs, fixed_p_max, lowest, score_inputs
from tiny_models import batch, make_model


def uniform_views(seen: dict | None = None):
    """A ``reencode`` whose views predict uniformly over the C items: PLPD = p_max - 1/C > 0 for every row."""

    def reencode(transform):
        rows = transform({"pixel_values": torch.zeros(B, 3, 8, 8)})["pixel_values"].shape[0]
        if seen is not None:
            seen["rows"] = rows
        return None, torch.zeros(rows, C, dtype=torch.float64)

    return reencode


def no_text_view(transform):
    raise AssertionError("the port re-encodes no text view")


def port_loss(ent: list[float], kept: list[int], plpd_of) -> tuple[float, float]:
    """The port's loss by hand (offsets 1308-1482): E_0 = the k'-th smallest entropy of the survivors, k' = int(0.4 n),
    loss = mean E (1/(exp(E - E_0) + 0.1) + exp(PLPD) + 0.1). Returns (loss, E_0)."""
    k = int(0.4 * len(kept))
    e_0 = sorted(ent[i] for i in kept)[k - 1] if k > 0 else math.inf
    total = sum(ent[i] * (1 / (math.exp(ent[i] - e_0) + 0.1) + math.exp(plpd_of(i)) + 0.1) for i in kept)
    return total / len(kept), e_0


# ------------------------------------------------------------------------------------------------------- views and PLPD
def test_deyo_patch_and_token_shuffle():
    x = torch.arange(2 * 1 * 4 * 4, dtype=torch.float32).view(2, 1, 4, 4)
    y = patch_shuffle(x, 2, torch.Generator().manual_seed(0))
    for i in range(2):
        blocks = lambda t: sorted(tuple(t[0, r:r + 2, c:c + 2].flatten().tolist()) for r in (0, 2) for c in (0, 2))
        assert blocks(x[i]) == blocks(y[i])  # the same 2x2 patches, moved
    assert not torch.equal(x, y) and torch.equal(y, patch_shuffle(x, 2, torch.Generator().manual_seed(0)))
    ids = torch.tensor([[0, 11, 12, 13, 14, 2, 1], [0, 21, 22, 2, 1, 1, 1]])
    am = (ids != 1).long()
    out = token_shuffle({"input_ids": ids, "attention_mask": am}, torch.Generator().manual_seed(3))
    assert torch.equal(out["attention_mask"], am)
    for r in range(2):
        n = int(am[r].sum())
        assert out["input_ids"][r, 0] == 0 and out["input_ids"][r, n - 1] == 2  # <bos>/<eos> stay
        assert sorted(out["input_ids"][r, 1:n - 1].tolist()) == sorted(ids[r, 1:n - 1].tolist())
        assert torch.equal(out["input_ids"][r, n:], ids[r, n:])
    assert not torch.equal(out["input_ids"][0], ids[0])


# ----------------------------------------------------------------------------------------------------------- paper mode
def test_deyo_plpd_filter_and_loss():
    scores = torch.tensor([[3.0, 0.0, 0.0], [0.0, 2.5, 0.0], [1.0, 1.0, 1.0]], requires_grad=True)
    view = torch.tensor([[0.0, 0.0, 0.0], [0.0, 2.5, 0.0]])  # views of rows 0 and 1 (row 2 is too uncertain)

    def reencode(transform):
        transform({"input_ids": torch.zeros(3, 5, dtype=torch.long)})
        return None, view

    deyo = build_objective("deyo", {"tau": 1.0, "selection": "paper", "deyo_margin": 0.9, "plpd_threshold": 0.2})
    out = deyo(score_inputs(scores, reencode=reencode, query_modality="text"), {})
    p0 = math.exp(3) / (math.exp(3) + 2)
    d = p0 - 1 / 3  # PLPD of row 0; row 1's view is unchanged (PLPD 0, filtered)
    assert plpd(torch.tensor([[p0, (1 - p0) / 2, (1 - p0) / 2]]), torch.full((1, 3), 1 / 3)).item() == pytest.approx(d, abs=1e-6)
    e = -(p0 * math.log(p0) + (1 - p0) * math.log((1 - p0) / 2))
    expected = e * (math.exp(-(e - 0.4 * math.log(3))) + math.exp(d))
    assert out.n_selected == 1 and out.loss.item() == pytest.approx(expected, abs=1e-5)


def test_deyo_paper_on_images():
    scores, ent = fixed_batch()
    deyo = build_objective("deyo", {"tau": 1.0, "selection": "paper", "plpd_threshold": 0.2})
    out = deyo(fixed_inputs(scores, reencode=uniform_views(), query_modality="image"), {})
    e0, total, n = 0.4 * math.log(3), 0.0, 0
    for i in range(B):
        d = fixed_p_max(i) - 1 / 3
        if ent[i] < 0.5 * math.log(3) and d > 0.2:
            total += ent[i] * (math.exp(-(ent[i] - e0)) + math.exp(d))
            n += 1
    assert out.n_selected == n and 0 < n < B
    assert out.loss.item() == pytest.approx(total / n, abs=1e-10)


# ----------------------------------------------------------------------------------------------------------- TCR's port
def test_deyo_port_entropy_filter_is_strict():
    """Offsets 82-122: k = int(0.5 * 64) = 32, E_k = topk(E, 32, largest=False)[-1], keep E < E_k: the query exactly at
    the threshold (row 32, the 32nd smallest) is dropped, 31 of 64 (a '<=' filter kept 32)."""
    scores, ent = fixed_batch()
    seen = {}
    deyo = build_objective("deyo", {"tau": 1.0})
    out = deyo(fixed_inputs(scores, reencode=uniform_views(seen), query_modality="image"), {})
    e_k = sorted(ent)[32 - 1]
    assert e_k == ent[32]
    kept = [i for i in range(B) if ent[i] < e_k]
    assert kept == list(range(33, 64)) and len(kept) == 31 == len(lowest(ent, 32)) - 1
    assert out.logs["entropy_selected"] == 31 and seen["rows"] == 31
    # ties at the threshold are all dropped: k = int(2.5) = 2, the 2nd smallest entropy is shared by rows 0-2, so only
    # row 3 (lower) is kept, where '<=' kept 4
    tied = torch.tensor([[1.0, 0.0, 0.0]] * 3 + [[2.0, 0.0, 0.0], [0.5, 0.0, 0.0]], dtype=torch.float64)
    out = deyo(fixed_inputs(tied, reencode=uniform_views(), query_modality="image"), {})
    assert out.logs["entropy_selected"] == 1 and out.n_selected == 1
    assert port_kth_smallest(torch.tensor([0.3, 0.1]), 0.4) is None  # k = int(0.8) = 0: nothing selected (offset 126)


def test_deyo_port_on_images():
    """Both filters pass 31 rows (uniform views: PLPD = p_max - 1/3 > 0); E_0 = the k'-th smallest of those 31,
    k' = int(0.4 * 31) = 12, i.e. row 52 (not row 39, the 25th smallest of the whole batch)."""
    scores, ent = fixed_batch()
    seen = {}
    deyo = build_objective("deyo", {"tau": 1.0})
    out = deyo(fixed_inputs(scores, reencode=uniform_views(seen), query_modality="image"), {})
    kept = list(range(33, 64))
    expected, e_0 = port_loss(ent, kept, lambda i: fixed_p_max(i) - 1 / 3)
    assert e_0 == ent[52] and e_0 != sorted(ent)[25 - 1]
    assert seen["rows"] == 31 and out.n_selected == 31
    assert out.logs["e_0"].item() == pytest.approx(e_0, abs=1e-12)
    assert out.loss.item() == pytest.approx(expected, abs=1e-10)
    # the image PLPD threshold is the configured one: 0.64 keeps only the rows with p_max - 1/3 > 0.64 (rows 43-63)
    deyo = build_objective("deyo", {"tau": 1.0, "plpd_threshold": 0.64})
    out = deyo(fixed_inputs(scores, reencode=uniform_views(), query_modality="image"), {})
    kept = [i for i in range(33, 64) if fixed_p_max(i) - 1 / 3 > 0.64]
    assert out.n_selected == len(kept) and kept == list(range(43, 64))
    assert out.loss.item() == pytest.approx(port_loss(ent, kept, lambda i: fixed_p_max(i) - 1 / 3)[0], abs=1e-10)


def test_deyo_port_trains_text_queries(caplog):
    """Offset 752: for text queries the port sets the PLPD threshold to -1 and re-encodes the queries themselves
    (PLPD = 0): every entropy-selected query trains (31 of 64), with PLPD weight exp(0) + 0.1 = 1.1."""
    scores, ent = fixed_batch()
    deyo = build_objective("deyo", {"tau": 1.0})
    with caplog.at_level(logging.INFO, logger="hf_tta.objectives.deyo"):
        out = deyo(fixed_inputs(scores, reencode=no_text_view, query_modality="text"), {})
    assert "PLPD threshold 0.0 replaced by -1.0" in caplog.text
    kept = list(range(33, 64))
    expected, e_0 = port_loss(ent, kept, lambda i: 0.0)
    assert out.n_selected == 31 and out.logs["plpd"].item() == 0.0
    assert out.logs["e_0"].item() == pytest.approx(e_0, abs=1e-12) and e_0 == ent[52]
    assert out.loss.item() == pytest.approx(expected, abs=1e-10)


def test_deyo_port_e0_is_infinite_without_a_quantile():
    """Offsets 1378-1398: k' = int(0.4 n) = 0 gives E_0 = +inf, so the entropy weight is 1/(0 + 0.1) = 10. Five rows:
    k = int(2.5) = 2, the one row below the 2nd smallest entropy survives."""
    scores, ent = fixed_batch()
    rows = scores[[0, 10, 20, 30, 40]]
    deyo = build_objective("deyo", {"tau": 1.0})
    out = deyo(fixed_inputs(rows, reencode=no_text_view, query_modality="text"), {})
    assert out.n_selected == 1 and math.isinf(out.logs["e_0"].item())
    assert out.loss.item() == pytest.approx(ent[40] * (10 + 1.1), abs=1e-12)


def test_deyo_port_adapts_on_text_through_the_wrapper():
    """TTAWrapper on text queries: DeYO's port now updates (it no longer equals the source model on text->image)."""
    tta = TTAWrapper(make_model("clip"), TTAConfig(objective="deyo", query_modality="text"))
    g = tta.encode_gallery(batch("image", 10, seed=1))
    q = batch("text", 6, seed=2)
    with torch.no_grad():
        source = tta.adapter.score(tta.adapter.embed("text", q), g.embeddings)
    out = tta.adapt_step(q, g)
    assert out.num_updates == tta.config.steps and not out.skipped
    assert out.n_selected == 2  # k = int(0.5 * 6) = 3, strictly below the 3rd smallest entropy
    assert not all(torch.equal(p, tta.source_parameters()[n]) for n, p in tta.params.items())
    assert not torch.allclose(out.scores, source, atol=1e-6)  # the last step's forward, after two updates


def test_deyo_port_gradient_flows_through_e0():
    """Offsets 1308-1482: E_0 = topk(entropys, k', largest=False)[0][-1] on the entropies carrying the graph, and the
    weight detaches only the per-query E. On the fixed batch (31 survivors, E_0 = E_52) the gradient of the loss with
    respect to the scores is, by hand (tau = 1, dE/ds_j = -p_j (log p_j + E)):
    row r: (1/n) w_r dE_r/ds_r, plus for r = 52 (1/n) sum_i E_i exp(E_i - E_0) / (exp(E_i - E_0) + 0.1)^2 dE_52/ds_52."""
    scores, ent = fixed_batch()
    scores.requires_grad_(True)
    deyo = build_objective("deyo", {"tau": 1.0})
    out = deyo(fixed_inputs(scores, reencode=uniform_views(), query_modality="image"), {})
    (grad,) = torch.autograd.grad(out.loss, scores)
    kept, e_0, n = list(range(33, 64)), ent[52], 31

    def d_entropy(i: int) -> list[float]:
        z = [0.1 * i, 0.0, 0.0]
        p = [math.exp(v) / sum(math.exp(u) for u in z) for v in z]
        return [-pj * (math.log(pj) + ent[i]) for pj in p]

    through_e0 = sum(ent[i] * math.exp(ent[i] - e_0) / (math.exp(ent[i] - e_0) + 0.1) ** 2 for i in kept) / n
    expected = torch.zeros(B, C, dtype=torch.float64)
    for i in kept:
        w = 1 / (math.exp(ent[i] - e_0) + 0.1) + math.exp(fixed_p_max(i) - 1 / 3) + 0.1
        expected[i] = torch.tensor(d_entropy(i), dtype=torch.float64) * w / n
    expected_detached = expected.clone()
    expected[52] += torch.tensor(d_entropy(52), dtype=torch.float64) * through_e0
    torch.testing.assert_close(grad, expected, rtol=0, atol=1e-12)
    # a detached E_0 (the paper's constant weights) gives another gradient: the test can tell them apart
    assert (grad - expected_detached).abs().max() > 1e-3
    torch.testing.assert_close(grad[:52], expected_detached[:52], rtol=0, atol=1e-12)
