"""The online lr rule (hf_tta/lr_online.py, LRSearchConfig(online="hypergradient"), selector (c) of issue 37): the
multiplicative hypergradient rule by hand, the same rule on a real model's gradients and steps, no extra pass, alone and
after the probe, save/resume, reset, the safety layer's rollback and reset, a non-finite loss, the config's refusals and
the command line's spelling."""

from __future__ import annotations

import doctest
import math
import re

import pytest
import torch

import hf_tta.lr_online
from hf_tta import LRSearchConfig, TTAConfig, TTAWrapper, cli
from hf_tta.lr_online import hypergradient_lr
from hf_tta.state import ALL, ROLLBACK, AdapterState
from support import check_resume, dense_gallery, image_stream
from tiny_models import batch, make_model

STREAM = [batch("image", 8, seed=70 + i) for i in range(6)]
LRS = [1e-3, 1e-2, 1e-1]
ONLINE = {"online": "hypergradient", "hypergradient_rate": 0.5}  # large enough to see the lr move in a few steps


def _online(steps: int = 2, lr: float | None = 1e-2, **search) -> tuple[TTAWrapper, object]:
    extra = {k: search.pop(k) for k in ("run",) if k in search}
    cfg = TTAConfig(objective="tcr", query_modality="image", steps=steps, lr=lr,
                    lr_search=LRSearchConfig(**{"candidates": LRS, "probe_batches": 0, **ONLINE, **search}), **extra)
    tta = TTAWrapper(make_model("clip"), cfg)
    return tta, tta.encode_gallery(batch("text", 20, seed=1))


# ------------------------------------------------------------------------------------- the rule by hand
def test_the_rule_by_hand_over_two_steps_and_its_clamp():
    rate, low, high = 0.1, 1e-4, 1e-2
    # step 1: the new gradient (3, 4) against the last step (-3, -4): still descending, cos = -1, the lr grows by 10 %
    lr, cos = hypergradient_lr(1e-3, torch.tensor([3.0, 4.0]), torch.tensor([-3.0, -4.0]), rate, low, high)
    assert cos == -1.0 and lr == pytest.approx(1.1e-3, rel=1e-15)
    # step 2: the gradient (1, 1) against the last step (2, 0): 45 degrees of overshoot, cos = 1/sqrt(2), it shrinks
    lr, cos = hypergradient_lr(lr, torch.tensor([1.0, 1.0]), torch.tensor([2.0, 0.0]), rate, low, high)
    assert cos == pytest.approx(1 / math.sqrt(2), rel=1e-15)
    assert lr == pytest.approx(1.1e-3 * (1 - 0.1 / math.sqrt(2)), rel=1e-15)
    # the clamp: 9.5e-3 * 1.1 = 1.045e-2 stops at the highest candidate, 1.05e-4 * 0.9 = 9.45e-5 at the lowest
    assert hypergradient_lr(9.5e-3, torch.tensor([1.0]), torch.tensor([-1.0]), rate, low, high)[0] == high
    assert hypergradient_lr(1.05e-4, torch.tensor([1.0]), torch.tensor([1.0]), rate, low, high)[0] == low
    # orthogonal, or no direction (a zero step or gradient): the lr stays
    assert hypergradient_lr(1e-3, torch.tensor([1.0, 0.0]), torch.tensor([0.0, 5.0]), rate, low, high) == (1e-3, 0.0)
    assert hypergradient_lr(1e-3, torch.tensor([1.0, 0.0]), torch.zeros(2), rate, low, high) == (1e-3, 0.0)


def test_the_modules_examples_run():
    result = doctest.testmod(hf_tta.lr_online)
    assert result.attempted and not result.failed


def test_on_a_real_model_the_lr_follows_the_rule_on_the_gradients_and_steps_it_saw(caplog):
    """One step per batch: ``u`` after batch 0 is the parameters' change; on batch 1 the rule reads the gradient at
    its start (the gradient a fixed-lr twin computes there, read by a hook on the twin's parameters) and moves the lr
    by the equation; batch 0 had no last step, so it ran at the start lr (the candidate nearest the base lr)."""
    tta, g = _online(steps=1, lr=5e-3)  # nearest 5e-3 on the log scale: 1e-2
    twin = TTAWrapper(make_model("clip"), TTAConfig(objective="tcr", query_modality="image", steps=1, lr=1e-2))
    before = {n: p.detach().clone() for n, p in tta.named_optimized_parameters()}
    tta.adapt_step(STREAM[0], g)
    twin.adapt_step(STREAM[0], twin.encode_gallery(batch("text", 20, seed=1)))
    assert tta.lr_search.chosen == tta.lr_search.lr == 1e-2 and tta.optimizer.param_groups[0]["lr"] == 1e-2
    change = torch.cat([(p.detach() - before[n]).reshape(-1) for n, p in tta.named_optimized_parameters()])
    assert torch.equal(tta.selector_state["online.u"], change) and change.norm() > 0
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(tta.named_optimized_parameters(), twin.named_optimized_parameters()))
    grads = {}
    hooks = [p.register_hook(lambda gr, n=n: grads.__setitem__(n, gr.clone())) for n, p in twin.named_optimized_parameters()]
    twin.adapt_step(STREAM[1], twin.encode_gallery(batch("text", 20, seed=1)))
    for h in hooks:
        h.remove()
    grad = torch.cat([grads[n].reshape(-1) for n, _ in twin.named_optimized_parameters()])
    cos = float(grad.double() @ change.double()) / float(grad.double().norm() * change.double().norm())
    with caplog.at_level("DEBUG", logger="hf_tta.lr_online"):
        out = tta.adapt_step(STREAM[1], g)
    want = min(max(1e-2 * (1 - 0.5 * cos), LRS[0]), LRS[-1])
    assert tta.lr_search.lr == pytest.approx(want, rel=1e-9) and tta.optimizer.param_groups[0]["lr"] == tta.lr_search.lr
    assert out.logs["lr_search.cos"] == pytest.approx(cos, rel=1e-9) and out.logs["lr_search.lr"] == tta.lr_search.lr
    assert "lr_search: hypergradient: cos(g, u)" in caplog.text
    trace = tta.lr_search.trace
    assert trace["updates"] == 1 and trace["lr_min"] == min(1e-2, want) and trace["lr_max"] == max(1e-2, want)


# ------------------------------------------------------------------------------------- on the stream
@pytest.mark.parametrize("probe_batches", [0, 2], ids=["alone", "after_the_probe"])
def test_the_lr_moves_at_no_extra_pass(probe_batches):
    tta, g = _online(probe_batches=probe_batches)
    if probe_batches:  # the same probe, then a fixed lr
        fixed, g2 = _online(probe_batches=probe_batches, online=None, hypergradient_rate=None)
    else:  # no search at all, at the rule's start lr
        fixed = TTAWrapper(make_model("clip"), TTAConfig(objective="tcr", query_modality="image", steps=2, lr=1e-2))
        g2 = fixed.encode_gallery(batch("text", 20, seed=1))
    lrs = []
    for x in STREAM:
        out = tta.adapt_step(x, g)
        fixed.adapt_step(x, g2)
        lrs.append(tta.lr_search.lr)
        assert tta.passes == fixed.passes  # the rule reads the step's gradient: no pass of its own
    start = tta.lr_search.chosen
    assert start == (1e-2 if probe_batches == 0 else fixed.lr_search.chosen)  # alone: the candidate nearest the base lr
    moved = [lr for lr in lrs if lr is not None]
    assert len(set(moved)) > 2 and all(LRS[0] <= lr <= LRS[-1] for lr in moved)
    trace = tta.lr_search.trace
    assert trace["lr"] == moved[-1]  # the range covers every step's lr, the batches' last ones among them
    assert LRS[0] <= trace["lr_min"] <= min(moved + [start]) and max(moved + [start]) <= trace["lr_max"] <= LRS[-1]
    assert trace["updates"] == 2 * (len(STREAM) - probe_batches) - 1  # every step but the first has a last step
    assert out.logs["lr_search.lr"] == moved[-1] and not tta.fast_path_active


def test_with_fast_step_the_probe_takes_the_fast_path_and_the_served_steps_the_checked_loop():
    """The rule sets the lr on the host at every step: the served stream leaves the one-sync fast path (fused AdamW)."""
    tta, g = _online(run={"fast_step": True}, probe_batches=2)
    assert tta.fast_path_active  # the probe's shadows keep their fixed lrs
    for x in STREAM[:2]:
        tta.adapt_step(x, g)
    assert not tta.fast_path_active and tta.optimizer.param_groups[0]["fused"]
    for x in STREAM[2:4]:
        tta.adapt_step(x, g)
    assert tta.lr_search.trace["updates"] == 3 and tta.lr_search.lr != tta.lr_search.chosen  # every step but the first


@pytest.mark.parametrize("probe_batches, cut", [(0, 2), (2, 1), (2, 3)], ids=["alone", "mid_probe", "after_commit"])
def test_save_resume_equals_uninterrupted(probe_batches, cut, tmp_path):
    check_resume(lambda: _online(probe_batches=probe_batches), STREAM[:5], cut=cut, folder=tmp_path / "ckpt")


@pytest.mark.parametrize("objective, extra", [("sar", {}), ("cliptta", {}), ("rest", {"gradient_decoupling": True})],
                         ids=["sar", "cliptta", "rest+gd"])
def test_other_objectives_move_the_lr_and_resume(objective, extra, tmp_path):
    """SAR (SAM's second pass inside the step: the step's change is SAM's), ClipTTA (an extra optimised tensor, alpha,
    in the flattened vectors), REST with gradient decoupling (the projected gradient, W_d on the step size)."""
    def make():
        cfg = TTAConfig(objective=objective, query_modality="image", steps=2, lr=1e-2, **extra,
                        lr_search=LRSearchConfig(candidates=LRS, probe_batches=0, **ONLINE))
        tta = TTAWrapper(make_model("clip"), cfg)
        return tta, tta.encode_gallery(batch("text", 20, seed=1))

    check_resume(make, STREAM[:3], cut=1, folder=tmp_path / "ckpt")
    tta, g = make()
    for x in STREAM[:3]:
        tta.adapt_step(x, g)
    assert tta.lr_search.trace["updates"] >= 1 and tta.lr_search.lr != 1e-2


def test_reset_returns_to_the_source_and_clears_the_rule():
    tta, g = _online()
    source = AdapterState.capture(_online()[0], ALL)  # a wrapper that never adapted
    first = [tta.adapt_step(x, g) for x in STREAM[:3]]
    assert "online.u" in tta.selector_state and tta.lr_search.lr != 1e-2
    tta.reset()
    assert AdapterState.capture(tta, ALL).equals(source) and tta.selector_state == {}
    assert tta.lr_search.lr is None and tta.lr_search.trace["updates"] == 0
    again = [tta.adapt_step(x, g) for x in STREAM[:3]]
    assert all(torch.equal(a.scores, b.scores) and a.logs == b.logs for a, b in zip(first, again))


# ------------------------------------------------------------------------------------- the safety layer, garbage in
def _harmful(push, harm, mode="shift", **search):
    """test_safety's harmful setting (lr 0.5 moves the top-1 on the harm batches; elsewhere a zero-gradient step whose
    decoupled weight decay still moves the parameters, so the rule has a last step), the rule alone."""
    safety = {"min_agreement": 0.5, "collapse_ratio": 0.0} if mode == "shift" else {}
    cfg = TTAConfig(objective=push, objective_config={"mode": mode, "harm_batches": harm}, lr=0.5, safety=safety,
                    lr_search=LRSearchConfig(**{"candidates": [0.25, 0.5, 1.0], "probe_batches": 0, **ONLINE, **search}))
    return TTAWrapper(make_model("clip"), cfg), dense_gallery()


HARM_STREAM = image_stream(6)


def test_a_rollback_restores_the_rules_state_bit_exactly(push, caplog):
    tta, g = _harmful(push, harm=[2])
    for x in HARM_STREAM[:2]:
        tta.adapt_step(x, g)
    snapshot = AdapterState.capture(tta, ROLLBACK)
    assert "online.u" in snapshot.selector and tta.safety.last_good.equals(snapshot)
    with caplog.at_level("DEBUG", logger="hf_tta.lr_online"):
        out = tta.adapt_step(HARM_STREAM[2], g)  # harmful: the rule moves the lr on its steps, then the batch is undone
    assert "lr_search: hypergradient" in caplog.text
    assert out.safety_action == "rollback" and AdapterState.capture(tta, ROLLBACK).equals(snapshot)
    tta.adapt_step(HARM_STREAM[3], g)
    assert tta.optimizer.param_groups[0]["lr"] == tta.lr_search.lr


def test_the_backoff_scales_the_lr_the_rolled_back_batch_started_at(push, caplog):
    """Selectors (c) and (d) together: the rule's moves on the harmful batch are rolled back with it, then the back-off
    scales the lr that batch started at."""
    tta, g = _harmful(push, harm=[2], backoff=0.8)
    for x in HARM_STREAM[:2]:
        tta.adapt_step(x, g)
    start = tta.lr_search.lr
    with caplog.at_level("DEBUG", logger="hf_tta.lr_online"):
        assert tta.adapt_step(HARM_STREAM[2], g).safety_action == "rollback"
    moved = [float(m) for m in re.findall(r"lr [0-9.e-]+ -> ([0-9.e-]+)", caplog.text)]
    assert moved and moved[-1] != start  # the rule had moved the lr on the harmful batch
    assert tta.lr_search.lr == pytest.approx(start * 0.8, rel=1e-12) and tta.lr_search.lr > 0.25


def test_a_safety_reset_keeps_the_lr_and_drops_the_last_step(push):
    tta, g = _harmful(push, harm=[2], mode="collapse")
    for x in HARM_STREAM[:2]:
        tta.adapt_step(x, g)
    assert tta.adapt_step(HARM_STREAM[2], g).safety_action == "reset"
    lr = tta.lr_search.lr
    assert "online.u" not in tta.selector_state and lr is not None  # the parameters jumped back to the source
    tta.adapt_step(HARM_STREAM[3], g)  # its first step has no last step: the lr stays for it
    assert "online.u" in tta.selector_state


def test_save_resume_with_rollbacks_across_the_cut(push, tmp_path):
    check_resume(lambda: _harmful(push, harm=[1, 4]), HARM_STREAM, cut=3, folder=tmp_path / "ckpt")


def test_a_non_finite_loss_changes_nothing(push):
    cfg = TTAConfig(objective=push, objective_config={"mode": "nan", "harm_batches": [2]}, steps=2, lr=1e-2,
                    lr_search=LRSearchConfig(candidates=LRS, probe_batches=0, **ONLINE))
    tta = TTAWrapper(make_model("clip"), cfg)
    g = tta.encode_gallery(batch("text", 20, seed=1))
    for i, x in enumerate(STREAM[:4]):
        before, rng = AdapterState.capture(tta, ROLLBACK), tta.generator.get_state()
        out = tta.adapt_step(x, g)
        if i == 2:
            assert AdapterState.capture(tta, ROLLBACK).equals(before) and torch.equal(rng, tta.generator.get_state())
            assert out.num_updates == 0 and "online.u" in before.selector
        else:
            assert not AdapterState.capture(tta, ROLLBACK).equals(before)


# ------------------------------------------------------------------------------------- config
@pytest.mark.parametrize(
    "search, message",
    [
        ({"online": "adam"}, "LRSearchConfig `online` must be None or one of ['hypergradient'], got 'adam'"),
        ({"hypergradient_rate": 0.1}, "`hypergradient_rate` applies to online='hypergradient' only (here online=None)"),
        ({"online": "hypergradient", "hypergradient_rate": 1.0}, "`hypergradient_rate` must be in (0, 1)"),
        ({"online": "hypergradient", "hypergradient_rate": 0.0}, "`hypergradient_rate` must be in (0, 1)"),
        ({"online": "hypergradient", "hypergradient_rate": "0.1"}, "LRSearchConfig `hypergradient_rate` must be"),
        ({"probe_batches": 0}, "or 0 with `backoff` or `online` (no probe)"),
    ],
)
def test_bad_values_are_refused_in_one_line(search, message):
    with pytest.raises((TypeError, ValueError)) as info:
        TTAConfig(lr_search=search)
    assert message in str(info.value) and len(str(info.value).splitlines()) == 1, str(info.value)


def test_the_command_line_spelling_and_the_config_round_trip():
    args = cli.build_parser().parse_args(["run", "--lr_search", '{"online": "hypergradient", "probe_batches": 0}'])
    from hf_tta.cli.config_args import apply_config

    apply_config(args, ["i2t"])
    cfg = TTAConfig(objective="tcr", lr_search=args.lr_search)
    assert cfg.lr_search == LRSearchConfig(online="hypergradient", probe_batches=0) and cfg.lr_search.rate == 0.02
    assert TTAConfig.from_dict(cfg.to_dict()) == cfg
    bad = cli.main(["run", "--lr_search", '{"hypergradient_rate": 0.1}'])
    assert bad == 2
