"""Gradient decoupling (hf_tta/gradient_decoupling.py, REST's Eq. 17): the projection, its application to parameter
gradients, W_d at the source, and W_d on the step size (issue 13, item 5), derived by hand."""

from __future__ import annotations

import math

import pytest
import torch

import hf_tta.gradient_decoupling as gradient_decoupling
from hf_tta import GradientDecouplingConfig, TTAConfig, TTAWrapper
from hf_tta.gradient_decoupling import (
    apply_gradient_decoupling,
    decouple,
    prediction_kl,
    scaled_step_size,
    source_logits,
)
from hf_tta.objectives import LossOutput
from tiny_models import batch, make_model


def test_gd_projection_never_conflicts_and_keeps_agreeing_gradients():
    gen = torch.Generator().manual_seed(0)
    for _ in range(200):
        g_d, g_r = torch.randn(7, generator=gen, dtype=torch.float64), torch.randn(7, generator=gen, dtype=torch.float64)
        w = float(torch.rand(1, generator=gen))
        out = decouple(g_d, g_r, w)
        assert torch.dot(out, g_r) >= -1e-12  # Theorem 2
        if torch.dot(g_d, g_r) >= 0:
            assert torch.allclose(out, w * g_d)
        else:
            assert torch.dot(out, g_r).abs() < 1e-10 and torch.allclose(out, w * (g_d - torch.dot(g_d, g_r) / g_r.dot(g_r) * g_r))


@pytest.mark.parametrize("weight_on", ["step_size", "gradient"])
@pytest.mark.parametrize("per_tensor", [False, True])
def test_gd_applied_to_parameter_gradients(per_tensor, weight_on):
    """The projection of Eq. 17 on the gradients; W_d multiplies them only with weight_on="gradient" (with the default
    "step_size" the wrapper scales the learning rate by the returned gd_weight instead)."""
    torch.manual_seed(1)
    a, b = torch.nn.Parameter(torch.randn(3)), torch.nn.Parameter(torch.randn(2, 3))
    feats = torch.randn(4, 3)
    scores = torch.tanh(feats * a) @ b.T  # (4 queries, 2 items)
    logits = scores / 0.1
    loss = -(logits.softmax(1) * logits.log_softmax(1)).sum(1).mean() + (a**2).sum()
    source = torch.randn(4, 2)
    out = LossOutput(loss=loss, n_selected=4, logits=logits, temperature=0.1)
    loss.backward(retain_graph=True)
    g_d = [a.grad.clone(), b.grad.clone()]
    kl = prediction_kl(source / 0.1, logits)
    g_r = torch.autograd.grad(kl, [a, b], retain_graph=True)
    w = math.exp(-kl.item())
    logs = apply_gradient_decoupling(out, {"a": a, "b": b}, lambda: source, per_tensor=per_tensor, weight_on=weight_on)
    assert logs["gd_kl"] == pytest.approx(kl.item(), rel=1e-6) and logs["gd_weight"] == pytest.approx(w, rel=1e-6)
    w = w if weight_on == "gradient" else 1.0
    if per_tensor:
        expected = [decouple(d.flatten(), r.flatten(), w).view_as(d) for d, r in zip(g_d, g_r)]
    else:
        flat = decouple(torch.cat([g.flatten() for g in g_d]), torch.cat([g.flatten() for g in g_r]), w)
        expected = [flat[:3], flat[3:].view(2, 3)]
    assert torch.allclose(a.grad, expected[0], atol=1e-6) and torch.allclose(b.grad, expected[1], atol=1e-6)
    flat_new = torch.cat([a.grad.flatten(), b.grad.flatten()])
    assert torch.dot(flat_new, torch.cat([g.flatten() for g in g_r])) >= -1e-6


def test_gd_source_logits_follow_candidates_and_logits_fn():
    src = torch.arange(12.0).view(3, 4)
    cand = torch.tensor([[1, 2], [0, 3], [3, 3]])
    out = LossOutput(loss=None, n_selected=3, logits=torch.zeros(3, 2), candidates=cand, temperature=0.5)
    assert torch.equal(source_logits(out, src), src.gather(1, cand) / 0.5)
    out.logits_fn = lambda s: s[:, :1] * 10
    assert torch.equal(source_logits(out, src), src[:, :1] * 10)


def test_gd_at_the_source_is_the_identity_and_logs_angle():
    """At the source parameters p̂ = p̂_S, so KL = 0, G_r = 0 and W_d = 1: the first update equals the one without GD."""
    runs = {}
    for gd in (False, True):
        tta = TTAWrapper(make_model("clip"), TTAConfig(objective="tent", query_modality="image", steps=1, gradient_decoupling=gd))
        g = tta.encode_gallery(batch("text", 12, seed=1))
        out = tta.adapt_step(batch("image", 5, seed=2), g)
        runs[gd] = ({n: p.detach().clone() for n, p in tta.params.items()}, out)
        if gd:
            assert out.logs["gd_kl"] == pytest.approx(0.0, abs=1e-6) and out.logs["gd_weight"] == pytest.approx(1.0)
            out2 = tta.adapt_step(batch("image", 5, seed=3), g)
            assert out2.logs["gd_kl"] > 0 and 0 < out2.logs["gd_weight"] < 1 and 0 <= out2.logs["gd_angle"] <= 180
    assert all(torch.allclose(runs[False][0][n], runs[True][0][n], atol=1e-7) for n in runs[False][0])


def test_gd_needs_logits_and_a_gradient_objective(monkeypatch):
    with pytest.raises(ValueError, match="training-free"):
        TTAConfig(objective="dn", gradient_decoupling=True)
    tta = TTAWrapper(make_model("clip"), TTAConfig(objective="tent", query_modality="image", gradient_decoupling=True))
    original = type(tta.objective).__call__

    def no_logits(self, inputs, state):
        out = original(self, inputs, state)
        out.logits = None
        return out

    monkeypatch.setattr(type(tta.objective), "__call__", no_logits)
    g = tta.encode_gallery(batch("text", 8, seed=1))
    with pytest.raises(ValueError, match="returned no `LossOutput.logits`"):
        tta.adapt_step(batch("image", 4, seed=2), g)


@pytest.mark.parametrize("objective", ["rest", "tcr", "cliptta", "titan"])
def test_gd_runs_with_candidate_objectives(objective):
    tta = TTAWrapper(make_model("clip"), TTAConfig(objective=objective, query_modality="text",
                                                   gradient_decoupling=GradientDecouplingConfig(per_tensor=objective == "tcr")))
    g = tta.encode_gallery(batch("image", 15, seed=1))
    outs = [tta.adapt_step(batch("text", 6, seed=5 + i), g) for i in range(2)]
    assert sum(o.num_updates for o in outs) > 0 and "gd_kl" in outs[-1].logs
    assert all(math.isfinite(o.logs["gd_kl"]) for o in outs if "gd_kl" in o.logs)  # absent when the last step skipped


# ------------------------------------------------------------------------------------------------------------ step size
def test_scaled_step_size_shrinks_the_first_adamw_step_by_hand():
    """AdamW's first step is -lr (wd w + g / (|g| + eps)) (bias-corrected m = g, v = g^2); W_d = 0.3 on the learning
    rate makes it exactly 0.3 times that, and the learning rate is restored afterwards."""
    lr, wd, eps = 1e-2, 1e-4, 1e-8
    w0 = torch.tensor([0.5, -1.0, 2.0], dtype=torch.float64)
    g = torch.tensor([1e-3, -4.0, 0.25], dtype=torch.float64)
    full = -lr * (wd * w0 + g / (g.abs() + eps))
    for factor, expected in ((None, full), (0.3, 0.3 * full), (torch.tensor(0.3, dtype=torch.float64), 0.3 * full)):
        w = torch.nn.Parameter(w0.clone())
        opt = torch.optim.AdamW([w], lr=lr, weight_decay=wd, eps=eps)
        w.grad = g.clone()
        with scaled_step_size(opt, factor):
            opt.step()
        assert torch.allclose(w.detach() - w0, expected, rtol=1e-9, atol=1e-15)
        assert opt.param_groups[0]["lr"] == lr
    # a weight on the gradient instead barely acts under AdamW: 0.3 g gives the same step up to eps
    w = torch.nn.Parameter(w0.clone())
    opt = torch.optim.AdamW([w], lr=lr, weight_decay=wd, eps=eps)
    w.grad = 0.3 * g
    opt.step()
    assert torch.allclose(w.detach() - w0, full, rtol=1e-4)


def _first_step_delta(monkeypatch, wd_value: float | None, weight_on: str = "step_size") -> dict[str, torch.Tensor]:
    """Parameter change of Tent's first step (1 step) through the wrapper; with ``wd_value`` gradient decoupling is on
    and its KL is pinned to -ln(wd_value), so W_d = wd_value. At the first step the model is the source model, so
    G_r = 0 and nothing is projected: W_d is the only difference."""
    if wd_value is not None:
        real = gradient_decoupling.prediction_kl
        monkeypatch.setattr(gradient_decoupling, "prediction_kl", lambda s, a: real(s, a) * 0 + (-math.log(wd_value)))
    gd = GradientDecouplingConfig(weight_on=weight_on) if wd_value is not None else None
    cfg = TTAConfig(objective="tent", query_modality="image", steps=1, lr=1e-3, gradient_decoupling=gd)
    tta = TTAWrapper(make_model("clip"), cfg)
    g = tta.encode_gallery(batch("text", 10, seed=1))
    out = tta.adapt_step(batch("image", 6, seed=2), g)
    assert out.num_updates == 1
    if wd_value is not None:
        assert out.logs["gd_weight"] == pytest.approx(wd_value) and out.logs["gd_projected"] == 0.0
    assert all(group["lr"] == 1e-3 for group in tta.optimizer.param_groups)  # restored after the step
    return {n: (p.detach() - tta.source_parameters()[n]) for n, p in tta.params.items()}


def test_gradient_decoupling_weight_scales_the_step(monkeypatch):
    plain = _first_step_delta(monkeypatch, None)
    w1 = _first_step_delta(monkeypatch, 1.0)
    w03 = _first_step_delta(monkeypatch, 0.3)
    flat = lambda d: torch.cat([v.flatten() for v in d.values()])  # noqa: E731
    # float32 parameters near 1: a step of ~1e-3 is known to ~1e-7 (a few ulps), hence the tolerances
    assert torch.allclose(flat(w1), flat(plain), rtol=0, atol=3e-7)
    assert torch.allclose(flat(w03), 0.3 * flat(w1), rtol=0, atol=3e-7)
    assert flat(w03).norm().item() == pytest.approx(0.3 * flat(w1).norm().item(), rel=1e-3)
    # the literal Eq. 17 (weight on the gradient) changes the AdamW step by far less
    literal = _first_step_delta(monkeypatch, 0.3, weight_on="gradient")
    assert flat(literal).norm().item() == pytest.approx(flat(w1).norm().item(), rel=0.05)


def test_gd_weight_on_is_validated():
    with pytest.raises(ValueError, match="GradientDecouplingConfig `weight_on`"):
        TTAConfig(gradient_decoupling={"weight_on": "lr"})
