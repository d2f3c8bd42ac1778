"""hf_tta/loop.py as a module: :class:`StepLoop` run directly on a tiny CLIP wrapper's adapted LayerNorms (the
wrapper is the :class:`~hf_tta.state.Adaptable` target; the batch's inputs are built here from public pieces).

Its ``steps`` are the objective's loss, ``backward`` and an optimiser step each, as a hand-written AdamW loop does; a
step with a non-finite loss changes nothing (parameters, moments, objective state: bit-exact); the fast path gives the
checked loop's result, also when it must replay a batch."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hf_tta import RunConfig, TTAConfig, TTAWrapper
from hf_tta.loop import StepLoop, grads_finite, skip_reason
from hf_tta.objectives import ObjectiveInputs
from hf_tta.objectives.base import LossOutput
from hf_tta.state import ALL, AdapterState
from tiny_models import batch, make_model

GALLERY = F.normalize(torch.randn(30, 16, generator=torch.Generator().manual_seed(5)), dim=1)


def _target(objective: str = "tcr", fast: bool = False) -> TTAWrapper:
    return TTAWrapper(make_model("clip"), TTAConfig(objective=objective, query_modality="image", lr=1e-2, run=RunConfig(fast_step=fast)))


def _make_inputs(tta: TTAWrapper, queries: dict, nan_steps: tuple[int, ...] = (), calls: list | None = None, nan_scores=False):
    """``make_inputs(step)``: the queries embedded at the current parameters (with grad), scored against GALLERY; the
    embeddings (``nan_scores``: the scores) are NaN at ``nan_steps``."""

    def make(step: int) -> ObjectiveInputs:
        if calls is not None:
            calls.append(step)
        q = tta.adapter.embed("image", queries)
        scores = q @ GALLERY.T
        if step in nan_steps and nan_scores:
            scores = scores * float("nan")
        elif step in nan_steps:  # finite scores (the queries are selected), NaN embeddings: TCR's loss is not finite
            q = q * float("nan")
        return ObjectiveInputs(query_emb=q, gallery_emb=GALLERY, scores=scores, step=step, generator=tta.generator)

    return make


def _no_recovery():
    raise AssertionError("no objective here asks for recovery")


def test_each_step_is_a_loss_a_backward_and_an_optimiser_step():
    x = batch("image", 8, seed=1)
    tta, ref = _target("tent"), _target("tent")
    calls: list[int] = []
    result = StepLoop(tta.objective, 3).run(tta, tta.params, _make_inputs(tta, x, calls=calls), _no_recovery)
    assert calls == [0, 1, 2] and result.num_updates == 3 and result.skipped == []
    # by hand: Tent's loss (mean entropy of the softmax at tau = 0.01) and AdamW, three times
    opt = torch.optim.AdamW(list(ref.params.values()), lr=1e-2, weight_decay=ref.config.weight_decay)
    for _ in range(3):
        logits = ref.adapter.embed("image", x) @ GALLERY.T / 0.01
        loss = -(logits.softmax(1) * logits.log_softmax(1)).sum(1).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert result.loss == pytest.approx(float(loss.detach()), rel=1e-5)
    for name, p in tta.params.items():
        torch.testing.assert_close(p, ref.params[name], rtol=0, atol=1e-6, msg=name)
    assert any(not torch.equal(p, tta.source_parameters()[n]) for n, p in tta.params.items())


@pytest.mark.parametrize("fast", [False, True])
def test_a_batch_of_non_finite_steps_changes_nothing(fast):
    """TCR (its state: the queue of the batch's candidates) after a first batch, then a batch whose every step has NaN
    embeddings: parameters, moments, step counts, objective state and RNG are bit-identical to before it."""
    tta = _target("tcr", fast=fast)
    loop = StepLoop(tta.objective, 3, fast=fast)
    loop.run(tta, tta.params, _make_inputs(tta, batch("image", 8, seed=3)), _no_recovery)
    before = AdapterState.capture(tta, ALL)
    assert before.optimizer.state and before.objective  # moments and queue to protect
    result = loop.run(tta, tta.params, _make_inputs(tta, batch("image", 8, seed=2), nan_steps=(0, 1, 2)), _no_recovery)
    assert result.num_updates == 0 and len(result.skipped) == 3 and result.skipped[0] == "step 0: non-finite loss"
    assert AdapterState.capture(tta, ALL).equals(before)


def test_a_nan_middle_step_equals_the_two_finite_steps():
    """Tent, NaN scores at step 1 of 3: steps 0 and 2 update, bit-equal (parameters, moments, step counts) to a run of
    two finite steps."""
    x = batch("image", 8, seed=2)
    a, b = _target("tent"), _target("tent")
    res = StepLoop(a.objective, 3).run(a, a.params, _make_inputs(a, x, nan_steps=(1,), nan_scores=True), _no_recovery)
    assert res.num_updates == 2 and res.skipped == ["step 1: non-finite loss"]
    StepLoop(b.objective, 2).run(b, b.params, _make_inputs(b, x), _no_recovery)
    assert AdapterState.capture(a, ALL).equals(AdapterState.capture(b, ALL))
    assert not AdapterState.capture(a, ALL).equals(AdapterState.capture(_target("tent"), ALL))


@pytest.mark.parametrize("nan_steps", [(), (2,)])
def test_the_fast_path_equals_the_checked_loop(nan_steps):
    """The one-sync path (fused AdamW, ``found_inf``) gives the checked loop's parameters, moments, step counts and
    objective state; with a non-finite step it restores the batch and the checked loop replays it."""
    x, y = batch("image", 8, seed=4), batch("image", 8, seed=6)
    runs = []
    for fast in (False, True):
        tta = _target("tcr", fast=fast)
        loop = StepLoop(tta.objective, 3, fast=fast)
        assert loop.fast_applies(tta.optimizer) == fast
        results = [loop.run(tta, tta.params, _make_inputs(tta, q, nan_steps), _no_recovery) for q in (x, y)]
        runs.append((tta, results))
    (checked, rc), (fast, rf) = runs
    for a, b in zip(rc, rf):
        assert a.num_updates == b.num_updates and a.skipped == b.skipped and a.n_selected == b.n_selected
        torch.testing.assert_close(a.scores, b.scores, rtol=0, atol=1e-5)
        # the first step's loss (lr_search's next_loss proxy): NaN where step 0 is non-finite, on both paths
        assert a.first_loss == pytest.approx(b.first_loss, abs=1e-6, nan_ok=True) and a.first_loss is not None
    assert sum(r.num_updates for r in rc) == 2 * (3 - len(nan_steps))
    for name, p in checked.params.items():
        torch.testing.assert_close(p, fast.params[name], rtol=0, atol=1e-5, msg=name)
        sc, sf = checked.optimizer.state[p], fast.optimizer.state[fast.params[name]]
        assert float(sc["step"]) == float(sf["step"])
        torch.testing.assert_close(sc["exp_avg"], sf["exp_avg"], rtol=0, atol=1e-5)
    assert checked.state.keys() == fast.state.keys()
    for key, value in checked.state.items():
        torch.testing.assert_close(value.float(), fast.state[key].float(), rtol=0, atol=1e-5, msg=key)


def test_the_skip_rule_and_the_gradient_check():
    loss = torch.tensor(1.0, requires_grad=True)
    assert skip_reason(LossOutput(loss=loss, n_selected=3)) is None
    assert skip_reason(LossOutput(loss=loss, n_selected=0)) == "no query selected"
    assert skip_reason(LossOutput(loss=None, n_selected=3)) == "non-finite loss"
    assert skip_reason(LossOutput(loss=torch.tensor(float("inf"), requires_grad=True), n_selected=3)) == "non-finite loss"
    assert skip_reason(LossOutput(loss=torch.tensor(1.0), n_selected=3)) == "loss does not depend on the adapted parameters"
    p, q = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(2))
    assert grads_finite([p, q])  # no gradients yet
    p.grad, q.grad = torch.ones(2), torch.tensor([1.0, float("nan")])
    assert grads_finite([p]) and not grads_finite([p, q])
