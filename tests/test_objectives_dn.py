"""DN (hf_tta/objectives/dn.py): the score formula, the means, the default lambda, and DN as a score transform on top
of another objective."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hf_tta import TTAConfig, TTAWrapper
from hf_tta.objectives import build_objective
from hf_tta.objectives.dn import dn_scores
from objective_helpers import score_inputs
from tiny_models import batch, make_model


def test_dn_score_formula():
    torch.manual_seed(0)
    zq, zg = F.normalize(torch.randn(3, 5), dim=1), F.normalize(torch.randn(4, 5), dim=1)
    mq, mg = torch.randn(5) * 0.3, torch.randn(5) * 0.3
    lam = 0.25
    direct = (zq - lam * mq) @ (zg - lam * mg).T
    assert torch.allclose(dn_scores(zq @ zg.T, zq, zg, mq, mg, lam), direct, atol=1e-6)
    cos = F.normalize(zq - lam * mq, dim=1) @ F.normalize(zg - lam * mg, dim=1).T
    assert torch.allclose(dn_scores(zq @ zg.T, zq, zg, mq, mg, lam, renormalize=True), cos, atol=1e-6)


def test_dn_means():
    torch.manual_seed(0)
    zg = F.normalize(torch.randn(10, 4), dim=1)
    q1, q2 = F.normalize(torch.randn(3, 4), dim=1), F.normalize(torch.randn(3, 4), dim=1)
    dn = build_objective("dn", {"num_samples": 4, "gallery_mean": "all", "lam": 0.5})
    st = dn.init_state()
    out1 = dn(score_inputs(q1 @ zg.T, q1, zg), st)
    assert torch.allclose(out1.scores, dn_scores(q1 @ zg.T, q1, zg, q1.mean(0), zg.mean(0), 0.5), atol=1e-6)
    dn(score_inputs(q2 @ zg.T, q2, zg), st)  # only the first 4 queries of the stream count
    assert torch.allclose(st["query_sum"] / st["query_count"], torch.cat([q1, q2[:1]]).mean(0), atol=1e-6)
    running = build_objective("dn", {"query_mean": "running", "num_samples": 4, "gallery_mean": "samples"})
    st = running.init_state()
    running(score_inputs(q1 @ zg.T, q1, zg), st)
    running(score_inputs(q2 @ zg.T, q2, zg), st)
    assert int(st["query_count"]) == 6
    idx = torch.randperm(10, generator=torch.Generator().manual_seed(0))[:4]  # the generator's first draw
    assert torch.allclose(st["gallery_mean"], zg[idx].mean(0), atol=1e-6)


def test_dn_default_lambda_is_the_authors_code():
    """lambda = 0.25 by default (authors' code and reported numbers); 0.5 (theory) is an option."""
    torch.manual_seed(1)
    zg = F.normalize(torch.randn(6, 4), dim=1)
    zq = F.normalize(torch.randn(3, 4), dim=1)
    dn = build_objective("dn", {"gallery_mean": "all"})
    assert dn.config.lam == 0.25
    mq, mg = zq.mean(0), zg.mean(0)
    out = dn(score_inputs(zq @ zg.T, zq, zg), dn.init_state())
    assert torch.allclose(out.scores, (zq - 0.25 * mq) @ (zg - 0.25 * mg).T, atol=1e-6)
    theory = build_objective("dn", {"gallery_mean": "all", "lam": 0.5})
    out = theory(score_inputs(zq @ zg.T, zq, zg), theory.init_state())
    assert torch.allclose(out.scores, (zq - 0.5 * mq) @ (zg - 0.5 * mg).T, atol=1e-6)


def test_dn_composes_on_top_of_an_objective():
    """steps=1: the output scores are the source forward's, so DN's result is computable from the source embeddings."""
    model = make_model("clip")
    tta = TTAWrapper(model, TTAConfig(objective="tent", query_modality="image", steps=1, score_transform="dn",
                                      score_transform_config={"gallery_mean": "all", "lam": 0.25}))
    g = tta.encode_gallery(batch("text", 12, seed=1))
    q = batch("image", 5, seed=2)
    with torch.no_grad(), tta.disabled():
        zq = tta.adapter.embed("image", q)
    out = tta.adapt_step(q, g)
    expected = dn_scores(zq @ g.embeddings.T, zq, g.embeddings, zq.mean(0), g.embeddings.mean(0), 0.25)
    assert torch.allclose(out.scores, expected, atol=1e-5) and out.num_updates == 1
    assert set(tta.transform_state) >= {"query_sum", "gallery_mean"}
    tta.reset()
    assert int(tta.transform_state["query_count"]) == 0


def test_score_transform_validation():
    with pytest.raises(ValueError, match="training-free"):
        TTAConfig(score_transform="tent")
    with pytest.raises(ValueError, match="score_transform` is None"):
        TTAConfig(score_transform_config={"lam": 0.3})
    with pytest.raises(ValueError, match="valid keys"):
        TTAConfig(score_transform="dn", score_transform_config={"lambda": 0.3})
