"""ClipTTA (hf_tta/objectives/cliptta.py): Otsu's threshold, OCE, the soft contrastive loss and the regulariser, the
confident memory (ranked as the code ranks it), both protocols, on small tensors against values derived by hand."""

from __future__ import annotations

import math

import pytest
import torch

from hf_tta import TTAConfig, TTAWrapper
from hf_tta.objectives import ObjectiveInputs, build_objective
from hf_tta.objectives.cliptta import (
    ClipTTA,
    marginal_entropy_regulariser,
    oce_loss,
    otsu_threshold,
    soft_contrastive_loss,
)
from objective_helpers import entropy_two
from tiny_models import batch, make_model


def test_otsu_threshold_by_hand():
    # values {0,0,1,3,3}, 4 bins over [0,3]: centres .375 1.125 1.875 2.625, hist 2 1 0 2; between-class variances
    # 18.375, 24, 24 -> the first maximum, bin 1
    assert otsu_threshold(torch.tensor([0.0, 0.0, 1.0, 3.0, 3.0]), bins=4).item() == pytest.approx(1.125)
    # two point masses, 256 bins: every split between them is optimal, the first bin centre wins (skimage's result)
    assert otsu_threshold(torch.tensor([0.0, 0, 0, 1, 1, 1])).item() == pytest.approx(1 / 512)
    assert otsu_threshold(torch.tensor([2.0, 2.0])).item() == 2.0


def test_oce_loss_eq9():
    s = torch.tensor([0.0, 1.0])
    loss, w = oce_loss(s, torch.tensor(0.5), gamma=0.5)
    wi = 1 / (1 + math.exp(-1))  # sigmoid(+-1)
    mu_id, mu_ood = wi * 1 / (wi + 1 - wi), (1 - wi) * 1 / (1 - wi + wi)
    assert w.tolist() == pytest.approx([1 - wi, wi], abs=1e-6)
    assert loss.item() == pytest.approx(-((mu_id - mu_ood) ** 2), abs=1e-6)


def test_cliptta_soft_contrastive_and_regulariser():
    s = torch.tensor([[0.5, 0.1], [0.2, 0.4]])
    # pseudo-captions = items (0, 1): logits [[5, 1], [2, 4]]
    assert soft_contrastive_loss(s, 0.1).item() == pytest.approx((entropy_two(4) + entropy_two(2)) / 2, abs=1e-6)
    q0, q1 = 1 / (1 + math.exp(-4)), 1 / (1 + math.exp(2))
    q_bar = [(q0 + q1) / 2, 1 - (q0 + q1) / 2]
    assert marginal_entropy_regulariser(s, 0.1).item() == pytest.approx(sum(q * math.log(q) for q in q_bar), abs=1e-6)


def test_cliptta_memory_keep():
    labels, confs = torch.tensor([0, 0, 1, 0]), torch.tensor([0.9, 0.8, 0.7, 0.95])
    assert ClipTTA.memory_keep(labels, confs, shots=2, size=3).tolist() == [0, 2, 3]
    assert ClipTTA.memory_keep(labels, confs, shots=1, size=1).tolist() == [3]


def test_cliptta_open_set_and_memory_through_the_wrapper():
    cfg = TTAConfig(objective="cliptta", query_modality="text", steps=2,
                    objective_config={"open_set": True, "memory_shots": 2, "memory_size": 8})
    tta = TTAWrapper(make_model("clip"), cfg)
    g = tta.encode_gallery(batch("image", 10, seed=1))
    assert any(p is tta.objective.alpha for grp in tta.optimizer.param_groups for p in grp["params"])
    q = batch("text", 6, seed=2)
    with torch.no_grad(), tta.disabled():
        s = tta.adapter.score(tta.adapter.embed("text", q), g.embeddings)
    out = tta.adapt_step(q, g)
    assert out.num_updates == 2 and "loss_oce" in out.logs
    # alpha started at Otsu's threshold of the source scores and was then learned (AdamW moved it)
    otsu = otsu_threshold(s.log_softmax(1).max(1).values).item()
    assert tta.objective.alpha.item() != otsu and abs(tta.objective.alpha.item() - otsu) < 1e-2
    # text queries of another length join the memory (right-padded)
    longer = batch("text", 6, seed=3)
    longer = {k: torch.cat([v, v[:, -2:]], 1) for k, v in longer.items()}
    tta.adapt_step(longer, g)
    mem = tta.state["memory.input_ids"]
    assert mem.shape[1] == 9 and mem.shape[0] == tta.state["memory_label"].numel() <= 8
    assert tta.objective.ood_mask(out.scores).dtype == torch.bool


# ------------------------------------------------------------------------------------------------------------ protocols
def _cliptta_loss(protocol: str) -> tuple[float, torch.Tensor, torch.Tensor]:
    scores = torch.tensor([[0.9, 0.1, 0.0], [0.0, 0.8, 0.3], [0.2, 0.1, 0.7]], dtype=torch.float64)
    m_scores = torch.tensor([[0.6, 0.2, 0.1], [0.1, 0.5, 0.4], [0.3, 0.3, 0.2]], dtype=torch.float64)

    def reencode(transform):
        rows = transform({"pixel_values": torch.zeros(3, 3, 4, 4)})["pixel_values"].shape[0]
        return None, m_scores[:rows]

    obj = build_objective("cliptta", {"protocol": protocol, "tau": 0.1})
    inputs = ObjectiveInputs(
        query_emb=torch.eye(3, dtype=torch.float64), gallery_emb=torch.eye(3, dtype=torch.float64), scores=scores,
        generator=torch.Generator().manual_seed(0), reencode=reencode, queries={"pixel_values": torch.zeros(3, 3, 4, 4)},
    )
    out = obj(inputs, obj.init_state())
    assert obj.init_state()["memory_label"].numel() == 0 and out.logs["memory_size"] == 3  # 3 distinct pseudo-labels
    return out.loss.item(), scores, m_scores


def test_cliptta_protocols_by_hand():
    tau = 0.1
    loss, s, m = _cliptta_loss("tcr")
    reg, sc, sc_m = (marginal_entropy_regulariser(s, tau).item(), soft_contrastive_loss(s, tau).item(),
                     soft_contrastive_loss(m, tau).item())
    assert loss == pytest.approx(reg + 0.5 * (sc + sc_m), abs=1e-12)
    loss, _, _ = _cliptta_loss("cliptta")  # memory batch regularised too, memory terms added (ClipTTA's code)
    reg_m = marginal_entropy_regulariser(m, tau).item()
    assert loss == pytest.approx(reg + sc + sc_m + reg_m, abs=1e-12)
    # the regulariser by hand on the memory batch: sum_c qbar_c log qbar_c
    q = (m / tau).softmax(1).mean(0)
    assert reg_m == pytest.approx(sum(x * math.log(x) for x in q.tolist()), abs=1e-12)


@pytest.mark.parametrize("protocol", ["tcr", "cliptta"])
def test_cliptta_scores_after_the_last_update(protocol):
    tta = TTAWrapper(make_model("clip"), TTAConfig(objective="cliptta", query_modality="image", steps=2,
                                                   objective_config={"protocol": protocol}))
    g = tta.encode_gallery(batch("text", 10, seed=1))
    q = batch("image", 6, seed=2)
    out = tta.adapt_step(q, g)
    assert out.num_updates == 2
    with torch.no_grad():
        after = tta.adapter.score(tta.adapter.embed("image", q), g.embeddings)
    if protocol == "cliptta":
        assert torch.allclose(out.scores, after, atol=1e-6)  # a fresh forward of the adapted model
    else:
        assert not torch.allclose(out.scores, after, atol=1e-6)  # TCR: the last step's forward, before its update


# ----------------------------------------------------------------------------------------------------------- memory rank
def _max_softmax(row: list[float], scale: float) -> float:
    exps = [math.exp(scale * x) for x in row]
    return max(exps) / sum(exps)


def test_cliptta_memory_ranks_by_softmax_of_raw_cosines():
    """The code's CCM keeps, per pseudo-label, the ``num_shots`` queries of highest ``get_scores(logits)`` with
    ``score_type="max_prob"`` on the raw cosines x ``ood_logit_scale`` = 1 (ttavlm/methods/cliptta.py:96-100,
    abstract_model.py:475, 482-485; ccm.py:64-65), not the max softmax at tau = 0.01. One shot per item: queries 0 and 1
    both predict item 0; at temperature 1 query 0 is the more confident (its third cosine is far below), at tau = 0.01
    query 1 is (its gap to the runner-up is 0.1, query 0's 0.02). Queries 2 and 3 (item 1) rank alike at both."""
    rows = [[1.0, 0.98, -1.0], [0.2, 0.1, 0.1], [0.1, 0.5, 0.49], [-0.5, 0.3, 0.0]]
    raw = [_max_softmax(r, 1.0) for r in rows]
    sharp = [_max_softmax(r, 100.0) for r in rows]
    assert raw[0] > raw[1] and sharp[0] < sharp[1] and raw[3] > raw[2] and sharp[3] > sharp[2]
    kept_raw, kept_sharp = [0, 3], [1, 3]  # the rule above, by hand
    scores = torch.tensor(rows, dtype=torch.float64)
    pixels = torch.arange(4, dtype=torch.float64).view(4, 1, 1, 1).expand(4, 3, 2, 2).clone()  # query i is all i

    def reencode(transform):
        q = transform({"pixel_values": pixels})
        return None, scores[q["pixel_values"][:, 0, 0, 0].long()]

    obj = build_objective("cliptta", {"memory_shots": 1})
    assert obj.config.tau == 0.01
    state = obj.init_state()
    inputs = ObjectiveInputs(
        query_emb=torch.eye(4, 3, dtype=torch.float64), gallery_emb=torch.eye(3, dtype=torch.float64), scores=scores,
        generator=torch.Generator().manual_seed(0), reencode=reencode, queries={"pixel_values": pixels},
    )
    obj(inputs, state)
    stored = state["memory.pixel_values"][:, 0, 0, 0].long().tolist()
    assert stored == kept_raw != kept_sharp
    assert state["memory_label"].tolist() == [0, 1]
    assert state["memory_confidence"].tolist() == pytest.approx([raw[0], raw[3]], abs=1e-15)
