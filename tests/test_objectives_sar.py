"""SAR (hf_tta/objectives/sar.py): SAM by hand, the two passes and model recovery, both selections on a fixed batch.
``selection="tcr_port"`` follows TCR's models/tta_baselines/sar.py (line numbers in the comments)."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from hf_tta import TTAConfig, TTAWrapper
from hf_tta.objectives import LossOutput, build_objective
from hf_tta.objectives.sar import SAM, SAR
from objective_helpers import entropy_two, fixed_batch, fixed_inputs, lowest, score_inputs
from tiny_models import batch, make_model


# ------------------------------------------------------------------------------------------------------------------ SAM
def test_sam_step_by_hand():
    """L = 1/2 ||w||^2: SAM steps with the gradient at w + rho w/||w||, then restores w before the base step."""
    w = torch.nn.Parameter(torch.tensor([3.0, 4.0]))
    opt = SAM([w], torch.optim.SGD, rho=0.5, lr=0.1)
    loss = 0.5 * (w**2).sum()
    loss.backward()

    def closure():
        opt.zero_grad()
        out = 0.5 * (w**2).sum()
        out.backward()
        return out

    opt.step(closure)
    perturbed = torch.tensor([3.0, 4.0]) * (1 + 0.5 / 5)
    assert torch.allclose(w.detach(), torch.tensor([3.0, 4.0]) - 0.1 * perturbed)
    assert opt.state_dict()["param_groups"][0]["rho"] == 0.5


@pytest.mark.parametrize("restore_without_grad", [True, False])
def test_sam_closure_without_gradient(restore_without_grad):
    """A closure that back-propagates nothing (its pass selected nothing). SAR's code (``True``): theta restored, then a
    zero-gradient AdamW step (no weight decay here: theta unchanged, one step counted). TCR's port (``False``,
    sar.py:181-185 with gradients set to None): theta stays at theta + rho g/||g|| = (3, 4) + 0.5 (3, 4)/5 = (3.3, 4.4)
    and AdamW never steps."""
    w = torch.nn.Parameter(torch.tensor([3.0, 4.0], dtype=torch.float64))
    opt = SAM([w], torch.optim.AdamW, rho=0.5, restore_without_grad=restore_without_grad, lr=0.1, weight_decay=0.0)
    (0.5 * (w**2).sum()).backward()

    def closure():
        opt.zero_grad(set_to_none=True)
        return torch.tensor(float("nan"))

    opt.step(closure)
    if restore_without_grad:
        assert w.detach().tolist() == [3.0, 4.0] and opt.state[w]["step"].item() == 1
    else:
        assert w.detach().tolist() == pytest.approx([3.3, 4.4], abs=1e-12) and not opt.state  # rho / (||g|| + 1e-12)


# ------------------------------------------------------------------------------------------------------------ selection
def test_sar_keeps_25_of_64_by_the_kth_smallest():
    scores, ent = fixed_batch()
    sar = build_objective("sar", {"tau": 1.0})
    out = sar(fixed_inputs(scores), sar.init_state())
    assert out.n_selected == 25 == int(0.4 * 64)  # the k-th smallest entropy and below
    kept = set(sar.first_pass_selection.nonzero().flatten().tolist())
    assert kept == lowest(ent, 25) == set(range(39, 64))
    assert out.loss.item() == pytest.approx(sum(ent[i] for i in kept) / 25, abs=1e-12)
    # the interpolated 0.4-quantile with a strict '<' (what we did before) keeps one more
    assert int((torch.tensor(ent) < torch.quantile(torch.tensor(ent), 0.4)).sum()) == 26
    # paper: E < 0.4 ln 3
    sar = build_objective("sar", {"tau": 1.0, "selection": "paper"})
    out = sar(fixed_inputs(scores), sar.init_state())
    assert out.n_selected == sum(e < 0.4 * math.log(3) for e in ent)


def test_sar_second_pass_reuses_first_filter():
    sar = build_objective("sar", {"tau": 1.0, "selection": "paper", "margin_e0": 0.9})
    state = sar.init_state()
    first = torch.tensor([[5.0, 0.0], [0.0, 0.0], [0.0, 5.0]])  # E: low, ln 2 (not < 0.9 ln 2), low
    out1 = sar(score_inputs(first), state)
    assert out1.n_selected == 2
    second = torch.tensor([[5.0, 0.0], [9.0, 0.0], [0.1, 0.0]])  # row 1 not selected in pass 1; row 2 now uncertain
    out2 = sar(score_inputs(second, in_closure=True), state)
    assert out2.n_selected == 1 and out2.loss.item() == pytest.approx(entropy_two(5), abs=1e-6)


# ---------------------------------------------------------------------------------------------------- empty second pass
@pytest.mark.parametrize(
    "selection,ema,expected,recovers",
    [
        ("tcr_port", None, 0.0, True),  # the first EMA is the 0.0 itself (sar.py:16-17): recovery at once
        ("tcr_port", 0.5, 0.45, False),  # 0.9 * 0.5 + 0.1 * 0.0 = 0.45 >= 0.2
        ("tcr_port", 0.2, 0.18, True),  # 0.9 * 0.2 = 0.18 < 0.2 (sar.py:125-128)
        ("paper", 0.5, None, False),  # SAR: a NaN second loss never enters the EMA
        ("paper", None, None, False),
    ],
)
def test_sar_empty_second_pass_feeds_zero_to_the_ema_in_the_port(selection, ema, expected, recovers):
    """TCR's port sets loss_second = torch.tensor(0.0) when pass 2 keeps nothing (sar.py:113) and feeds it to the EMA
    (sar.py:117-118)."""
    scores, _ = fixed_batch()
    perturbed = torch.zeros_like(scores)  # at the perturbed point every query is maximally uncertain: pass 2 is empty
    sar = build_objective("sar", {"tau": 1.0, "selection": selection, "margin_e0": 0.4})
    state = sar.init_state()
    if ema is not None:
        state["ema"] = torch.tensor(ema, dtype=torch.float64)
    first = sar(fixed_inputs(scores), state)
    second = sar(fixed_inputs(perturbed, in_closure=True), state)
    assert first.n_selected > 0 and second.n_selected == 0
    output = LossOutput(loss=None, n_selected=0)
    recovered = sar.on_step_end(fixed_inputs(scores), output, state)
    assert recovered == recovers
    if selection == "paper":  # the EMA did not move
        assert "ema" not in output.logs and state["ema"].tolist() == ([] if ema is None else ema)
    else:
        assert output.logs["ema"].item() == pytest.approx(expected, abs=1e-15)
        assert state["ema"].numel() == 0 if recovers else state["ema"].item() == pytest.approx(expected, abs=1e-15)


def _empty_second_pass(monkeypatch) -> list[int]:
    """Every SAM pass of SAR sees all-zero scores (entropy ln N, above every pass-1 threshold): pass 2 selects nothing
    through SAR's own rule. Returns the n_selected of each pass 2."""
    seen: list[int] = []
    original = SAR.__call__

    def call(self, inputs, state):
        if inputs.in_closure:
            inputs = dataclasses.replace(inputs, scores=torch.zeros_like(inputs.scores))
            out = original(self, inputs, state)
            seen.append(out.n_selected)
            return out
        return original(self, inputs, state)

    monkeypatch.setattr(SAR, "__call__", call)
    return seen


def test_sar_port_empty_second_pass_recovers_at_once(monkeypatch):
    """The first step's EMA is 0.0 < 0.2: recovery fires at once and the source parameters come back."""
    seen = _empty_second_pass(monkeypatch)
    tta = TTAWrapper(make_model("clip"), TTAConfig(objective="sar", query_modality="image", steps=1))
    g = tta.encode_gallery(batch("text", 10, seed=1))
    out = tta.adapt_step(batch("image", 6, seed=2), g)
    assert seen == [0] and out.num_updates == 1
    assert out.logs["ema"] == 0.0 and out.logs["recovered"] == 1.0 and tta.state["ema"].numel() == 0
    assert all(torch.equal(p, tta.source_parameters()[n]) for n, p in tta.params.items())


def test_sar_port_empty_second_pass_leaves_parameters_perturbed(monkeypatch):
    """With an EMA of 5 the 0.0 gives 4.5 (no recovery); the parameters stay at theta + rho g/||g||, at distance
    exactly rho = 0.05 from the source, and AdamW never stepped."""
    seen = _empty_second_pass(monkeypatch)
    tta = TTAWrapper(make_model("clip"), TTAConfig(objective="sar", query_modality="image", steps=1))
    g = tta.encode_gallery(batch("text", 10, seed=1))
    tta.state["ema"] = torch.tensor(5.0)
    out = tta.adapt_step(batch("image", 6, seed=2), g)
    assert seen == [0] and "recovered" not in out.logs
    assert tta.state["ema"].item() == pytest.approx(4.5, abs=1e-6)
    dist = torch.cat([(p.detach() - tta.source_parameters()[n]).flatten() for n, p in tta.params.items()]).norm()
    assert dist.item() == pytest.approx(0.05, rel=1e-4)
    assert not tta.optimizer.state  # no base step


# -------------------------------------------------------------------------------------------------- through the wrapper
def test_sar_two_passes_and_recovery(monkeypatch):
    cfg = TTAConfig(objective="sar", query_modality="image", steps=2, objective_config={"selection": "paper", "margin_e0": 1.0})
    tta = TTAWrapper(make_model("clip"), cfg)
    g = tta.encode_gallery(batch("text", 10, seed=1))
    calls = []
    original = type(tta.objective).__call__

    def spy(self, inputs, state):
        out = original(self, inputs, state)
        calls.append((inputs.step, inputs.in_closure, out.n_selected))
        return out

    monkeypatch.setattr(type(tta.objective), "__call__", spy)
    out = tta.adapt_step(batch("image", 6, seed=2), g)
    assert [c[:2] for c in calls] == [(0, False), (0, True), (1, False), (1, True)]
    assert all(c[2] > 0 for c in calls) and out.num_updates == 2 and tta.state["ema"].numel() == 1
    assert not all(torch.equal(p, tta.source_parameters()[n]) for n, p in tta.params.items())
    # recovery: any EMA is below an infinite constant, so the source parameters come back and the EMA restarts
    tta.objective.config.reset_constant = float("inf")
    out = tta.adapt_step(batch("image", 6, seed=3), g)
    assert out.logs.get("recovered") == 1.0 and tta.state["ema"].numel() == 0
    assert all(torch.equal(p, tta.source_parameters()[n]) for n, p in tta.params.items())
