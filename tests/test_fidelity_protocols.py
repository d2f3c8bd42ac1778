"""Gradient decoupling's weight on the step size (issue 13, item 5) and ClipTTA's own protocol (item 7), derived by
hand."""

from __future__ import annotations

import math

import pytest
import torch

import hf_tta.gradient_decoupling as gd
from hf_tta import TTAConfig, TTAWrapper
from hf_tta.gradient_decoupling import scaled_step_size
from hf_tta.objectives import ObjectiveInputs, build_objective
from hf_tta.objectives.cliptta import marginal_entropy_regulariser, soft_contrastive_loss
from tiny_models import batch, make_model


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
        real = gd.prediction_kl
        monkeypatch.setattr(gd, "prediction_kl", lambda s, a: real(s, a) * 0 + (-math.log(wd_value)))
    cfg = TTAConfig(objective="tent", query_modality="image", steps=1, lr=1e-3, gradient_decoupling=wd_value is not None,
                    gd_weight_on=weight_on)
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
    with pytest.raises(ValueError, match="gd_weight_on"):
        TTAConfig(gradient_decoupling=True, gd_weight_on="lr")


# ----------------------------------------------------------------------------------------------- ClipTTA
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
