"""EATA (hf_tta/objectives/eata.py): selection, weighting and the Fisher penalty, both selections on the fixed batch
of 64 (issue 13), and the redundancy filter over top-k candidates."""

from __future__ import annotations

import math

import pytest
import torch

from hf_tta import TTAConfig, TTAWrapper
from hf_tta.objectives import build_objective
from hf_tta.objectives.eata import eata_selection, update_model_probs
from objective_helpers import B, entropy_two, fixed_batch, fixed_inputs, lowest, score_inputs
from tiny_models import batch, make_model


def test_eata_selection_and_weighting():
    # paper semantics: reliable = E < 0.4 ln C
    logits = torch.tensor([[4.0, 0.0], [0.0, 0.0], [0.0, 4.0]], requires_grad=True)
    ent, reliable, selected, e0 = eata_selection(logits, torch.zeros(0), 0.4, d_margin=0.05, selection="paper")
    assert e0.item() == pytest.approx(0.4 * math.log(2))
    assert reliable.tolist() == [True, False, True] and selected.tolist() == reliable.tolist()
    # redundancy: the average prediction points at class 0, so the row predicting class 0 is redundant
    avg = torch.tensor([1.0, 0.0])
    _, _, selected, _ = eata_selection(logits, avg, 0.4, d_margin=0.5, selection="paper")
    assert selected.tolist() == [False, False, True]
    assert update_model_probs(torch.zeros(0), torch.tensor([[0.2, 0.8], [0.4, 0.6]])).tolist() == pytest.approx([0.3, 0.7])
    assert update_model_probs(avg, torch.tensor([[0.0, 1.0]])).tolist() == pytest.approx([0.9, 0.1])
    eata = build_objective("eata", {"tau": 1.0, "selection": "paper"})
    out = eata(score_inputs(logits), eata.init_state())
    e = entropy_two(4)
    assert out.n_selected == 2 and out.loss.item() == pytest.approx(e / math.exp(e - 0.4 * math.log(2)), abs=1e-6)
    # TCR port (default): k = int(0.4 * 3) = 1 lowest entropy and its ties (rows 0 and 2 tie), weight 1/exp(E - 0.40)
    eata = build_objective("eata", {"tau": 1.0})
    out = eata(score_inputs(logits), eata.init_state())
    assert out.n_selected == 2 and out.loss.item() == pytest.approx(e / math.exp(e - 0.4), abs=1e-6)


def test_eata_fisher_penalty():
    tta = TTAWrapper(make_model("clip"), TTAConfig(objective="eata", query_modality="image",
                                                   objective_config={"e_margin": 1.0, "d_margin": 1.01, "fisher_alpha": 2000.0}))
    g = tta.encode_gallery(batch("text", 10, seed=1))
    out = tta.adapt_step(batch("image", 6, seed=2), g)
    fisher = {k for k in tta.state if k.startswith("fisher.")}
    assert fisher == {f"fisher.{n}" for n in tta.params} and int(tta.state["fisher_updates"]) == 1
    assert out.logs["ewc"] > 0  # after the first update the parameters left theta_0
    tta.reset()
    assert not any(k.startswith("fisher.") for k in tta.state)


# -------------------------------------------------------------------------- TCR's port and the paper on the fixed batch
def test_eata_port_and_paper():
    scores, ent = fixed_batch()
    eata = build_objective("eata", {"tau": 1.0})
    out = eata(fixed_inputs(scores), eata.init_state())
    kept = lowest(ent, 25)
    assert out.n_selected == 25
    expected = sum(ent[i] / math.exp(ent[i] - 0.40) for i in kept) / 25  # weight 1/exp(E - 0.40), E_0 = 0.40 literally
    assert out.loss.item() == pytest.approx(expected, abs=1e-12)
    eata = build_objective("eata", {"tau": 1.0, "selection": "paper"})
    out = eata(fixed_inputs(scores), eata.init_state())
    e0 = 0.4 * math.log(3)
    kept = [i for i in range(B) if ent[i] < e0]
    assert out.n_selected == len(kept) and 0 < len(kept) < B
    assert out.loss.item() == pytest.approx(sum(ent[i] / math.exp(ent[i] - e0) for i in kept) / len(kept), abs=1e-12)


def test_selection_keeps_ties_at_the_threshold():
    scores = torch.tensor([[2.0, 0.0], [1.0, 0.0], [1.0, 0.0], [1.0, 0.0], [0.0, 0.0]], dtype=torch.float64)
    eata = build_objective("eata", {"tau": 1.0})  # k = int(0.4 * 5) = 2: the 2nd smallest entropy is tied 3 times
    assert eata(fixed_inputs(scores), eata.init_state()).n_selected == 4


# ----------------------------------------------------------------------------------------------------- top-k candidates
def test_eata_redundancy_over_candidates_is_the_dense_cosine():
    """The candidates' prediction is an N-vector that is zero outside them: its cosine with the dense average and the
    scattered update equal the dense computation on that N-vector."""
    gen = torch.Generator().manual_seed(0)
    cols = torch.tensor([1, 4, 5, 8])
    logits = torch.randn(6, 4, generator=gen) * 3
    avg = torch.rand(10, generator=gen).softmax(0)
    padded = torch.full((6, 10), -1e4).index_copy(1, cols, logits)  # probability exactly 0 outside the candidates
    kept = []
    for d in (0.1, 0.2, 0.3, 0.4, 0.6):
        got = eata_selection(logits, avg, 0.9, d, columns=cols)
        ref = eata_selection(padded, avg, 0.9, d)
        assert torch.equal(got[2], ref[2]) and torch.allclose(got[0], ref[0])
        kept.append(int(got[2].sum()))
    assert len(set(kept)) > 1, kept  # the threshold decided something
    new = logits.softmax(1)
    torch.testing.assert_close(
        update_model_probs(avg, new, 0.9, cols, 10), update_model_probs(avg, padded.softmax(1), 0.9), rtol=0, atol=1e-7
    )
