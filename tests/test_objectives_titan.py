"""TITAN (hf_tta/objectives/titan.py): rematching, the contrastive loss on pseudo-pairs, occlusion masks and the
confounder correction, by hand."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from hf_tta import TTAConfig, TTAWrapper
from hf_tta.objectives.titan import (
    confounder_correction,
    contrastive_pseudo_pair_loss,
    descending_ranks,
    occlusion_masks,
    rematch,
)
from tiny_models import batch, make_model


def test_titan_rematching_eq5():
    s = torch.tensor([[0.9, 0.8], [0.95, 0.1]])
    assert descending_ranks(s, 0).tolist() == [[1, 0], [0, 1]]
    # q0: M = [0 + 1, 1 + 0] -> a tie, broken by q0's own ranking (item 0); with alpha = 2 item 1 wins
    assert rematch(s, alpha=1.0).tolist() == [0, 0]
    assert rematch(s, alpha=2.0).tolist() == [1, 0]
    # other queries (a bank) take part in the query-side ranks: with q0 ranked 2nd for item 0 and 1st for item 1
    assert rematch(s[:1], alpha=1.0, extra_queries=s[1:]).tolist() == [0]


def test_titan_contrastive_loss_on_pseudo_pairs():
    s = torch.tensor([[0.3, 0.1, 0.9], [0.2, 0.0, 0.8], [0.1, 0.5, 0.2]])
    targets = torch.tensor([2, 2, 1])
    loss, cols = contrastive_pseudo_pair_loss(s, targets, tau=0.1, symmetric=True)
    assert cols.tolist() == [1, 2]
    logits = s[:, [1, 2]] / 0.1
    row = F.cross_entropy(logits, torch.tensor([1, 1, 0]))
    lq = logits.log_softmax(0)
    col = (-(lq[0, 1] + lq[1, 1]) / 2 - lq[2, 0]) / 2
    assert loss.item() == pytest.approx(0.5 * (row.item() + col.item()), abs=1e-6)


def test_titan_occlusion_masks_the_relied_upon_token():
    ids = torch.tensor([[0, 5, 6, 7, 2, 1], [0, 8, 9, 2, 1, 1]])
    am = torch.tensor([[1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 0, 0]])
    weight = torch.tensor([0.0, 0.1, 0.9, 0.2, 0.0, 0.0])  # position 2 carries the match

    def reencode(transform):
        q = transform({"input_ids": ids, "attention_mask": am})
        score = (q["attention_mask"].float() * weight).sum(1, keepdim=True)
        return None, torch.cat([score, torch.zeros_like(score)], 1)

    new, changed = occlusion_masks({"input_ids": ids, "attention_mask": am}, torch.tensor([0, 1]), torch.tensor([0, 0]), reencode, 1)
    assert new[0].tolist() == [1, 1, 0, 1, 1, 0] and new[1].tolist() == [1, 1, 0, 1, 0, 0]
    assert changed.tolist() == [True, True]


def test_titan_confounder_correction_and_file(tmp_path):
    torch.manual_seed(0)
    zq, zg, conf = F.normalize(torch.randn(2, 4), dim=1), F.normalize(torch.randn(5, 4), dim=1), torch.randn(3, 4)
    s = zq @ zg.T
    out = confounder_correction(s, zq, zg, conf, eta=2, weight=1.0)
    top = s.topk(2, dim=1).indices
    changed = (out != s)
    assert changed.sum(1).tolist() == [2, 2] and changed.gather(1, top).all()
    i, j = 0, int(top[0, 0])
    att = torch.softmax((zq[i] + zg[j]) @ conf.T / 2.0, dim=0)
    assert out[i, j].item() == pytest.approx((s[i, j] + zq[i] @ (att @ conf)).item(), abs=1e-6)
    path = tmp_path / "conf.safetensors"
    save_file({"confounders": torch.randn(3, 16)}, str(path))
    tta = TTAWrapper(make_model("clip"), TTAConfig(objective="titan", query_modality="text", objective_config={"confounders_file": str(path)}))
    g = tta.encode_gallery(batch("image", 10, seed=1))
    assert tta.adapt_step(batch("text", 6, seed=2), g).num_updates > 0
    tta.reset()
    assert "confounders" in tta.state  # the dictionary survives reset
