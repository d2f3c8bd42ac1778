"""The equations of REST, gradient decoupling, DN, ClipTTA, TITAN and the baselines (EATA, SAR, READ, DeYO, PL, SHOT)
on small tensors against values derived by hand, plus their wrapper-level behaviour (SAR's two passes, GD at the source,
DN on top of another objective, resume equals uninterrupted)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from hf_tta import TTAConfig, TTAWrapper
from hf_tta.gradient_decoupling import apply_gradient_decoupling, decouple, prediction_kl, source_logits
from hf_tta.objectives import LossOutput, ObjectiveInputs, build_objective, softmax_entropy
from hf_tta.objectives.cliptta import (
    ClipTTA,
    marginal_entropy_regulariser,
    oce_loss,
    otsu_threshold,
    soft_contrastive_loss,
)
from hf_tta.objectives.deyo import patch_shuffle, plpd, token_shuffle
from hf_tta.objectives.dn import dn_scores
from hf_tta.objectives.eata import eata_selection, update_model_probs
from hf_tta.objectives.read import read_losses
from hf_tta.objectives.rest import (
    MASKED_LOGIT,
    candidate_indices,
    centroid_score_scale,
    centroid_scores,
    hard_mining_loss,
    spherical_kmeans,
)
from hf_tta.objectives.sar import SAM
from hf_tta.objectives.shot import shot_pseudo_labels
from hf_tta.objectives.titan import (
    confounder_correction,
    contrastive_pseudo_pair_loss,
    descending_ranks,
    occlusion_masks,
    rematch,
)
from tiny_models import batch, make_model


def _entropy_two(d: float) -> float:
    """Entropy of softmax([d, 0]) by hand."""
    p = 1 / (1 + math.exp(-d))
    return -(p * math.log(p) + (1 - p) * math.log(1 - p))


def _inputs(scores, zq=None, zg=None, **kw) -> ObjectiveInputs:
    zq = zq if zq is not None else F.normalize(torch.randn(scores.shape[0], 4), dim=1)
    zg = zg if zg is not None else F.normalize(torch.randn(scores.shape[1], 4), dim=1)
    return ObjectiveInputs(query_emb=zq, gallery_emb=zg, scores=scores, generator=torch.Generator().manual_seed(0), **kw)


# =============================================================================================== REST
def test_rest_candidate_set_eq4():
    # 3 queries, 5 items, K = 2: top-2 of q0 = (0, 1), q1 = (1, 2), q2 = (0, 4)
    s = torch.tensor([[0.9, 0.8, 0.1, 0.0, 0.2], [0.1, 0.9, 0.8, 0.0, 0.2], [0.9, 0.1, 0.0, 0.2, 0.8]])
    idx, rep = candidate_indices(s, 2)
    assert idx.tolist() == [[0, 1, 2, 0, 4], [1, 0, 1, 0, 4], [0, 0, 1, 1, 2]]
    # a union: later copies (and copies of the positive) are masked, the positive never is
    assert rep.tolist() == [
        [False, False, False, True, False],
        [False, False, True, True, False],
        [False, True, False, True, False],
    ]


def test_rest_kmeans_and_centroid_scores():
    g = F.normalize(torch.tensor([[1.0, 0.1, 0], [1.0, -0.1, 0], [0, 1.0, 0.1], [0, 1.0, -0.1], [0.1, 0, 1.0]]), dim=1)
    centroids, labels = spherical_kmeans(g, 3, torch.Generator().manual_seed(0))
    assert labels[0] == labels[1] and labels[2] == labels[3] and len(set(labels.tolist())) == 3
    # centroid scores from the gallery scores equal the cosine with the normalised centroid
    q = F.normalize(torch.randn(4, 3), dim=1)
    scale = centroid_score_scale(g, labels, 3)
    assert torch.allclose(centroid_scores(q @ g.T, labels, scale), q @ centroids.T, atol=1e-6)
    # deterministic with the same generator
    assert torch.equal(spherical_kmeans(g, 3, torch.Generator().manual_seed(0))[1], labels)


def test_rest_hard_mining_eq14():
    sims = torch.tensor([[0.8, 0.6, 0.2], [0.5, 0.4, 0.45]], requires_grad=True)
    masked = torch.tensor([[False, False, False], [False, False, True]])
    h = hard_mining_loss(sims, sims / 0.02, masked, "affine", 1e-6)
    # row 0: hardest other = 0.6; row 1: 0.45 is masked, so 0.4
    expected = [-math.log(0.9) + math.log(0.8), -math.log(0.75) + math.log(0.7)]
    assert h.tolist() == pytest.approx(expected, abs=1e-6)
    hs = hard_mining_loss(sims, sims / 0.02, masked, "softmax", 1e-6)
    assert hs[0].item() == pytest.approx((0.6 - 0.8) / 0.02, abs=1e-4)  # log p_k - log p_j = (s_k - s_j) / tau


def test_rest_objective_state_logits_and_reset():
    torch.manual_seed(0)
    zq, zg = F.normalize(torch.randn(4, 8), dim=1), F.normalize(torch.randn(30, 8), dim=1)
    zq.requires_grad_(True)
    rest = build_objective("rest", {"num_neighbours": 3, "num_clusters": 4})
    state = rest.init_state()
    out = rest(_inputs(zq @ zg.T, zq, zg), state)
    assert out.logits.shape == (4, 1 + 3 * 3 + 4) and out.n_selected > 0 and torch.isfinite(out.loss)
    assert torch.equal(out.logits_fn(zq @ zg.T), out.logits)
    p = out.logits.softmax(1)
    assert (p[out.logits == MASKED_LOGIT] == 0).all() and torch.isfinite(softmax_entropy(out.logits)).all()
    assert all(isinstance(v, torch.Tensor) for v in state.values())
    labels = state["kmeans_labels"].clone()
    assert labels.shape == (30,)
    rest(_inputs(zq @ zg.T, zq, zg), state)  # cached: the same clustering
    assert torch.equal(state["kmeans_labels"], labels)
    zg2 = F.normalize(torch.randn(12, 8), dim=1)
    rest(_inputs(zq @ zg2.T, zq, zg2), state)  # a new gallery is clustered again
    assert state["kmeans_labels"].shape == (12,)
    out.loss.backward()
    assert zq.grad is not None and torch.isfinite(zq.grad).all()


# =============================================================================================== gradient decoupling
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
    tta = TTAWrapper(make_model("clip"), TTAConfig(objective=objective, query_modality="text", gradient_decoupling=True, gd_per_tensor=objective == "tcr"))
    g = tta.encode_gallery(batch("image", 15, seed=1))
    outs = [tta.adapt_step(batch("text", 6, seed=5 + i), g) for i in range(2)]
    assert sum(o.num_updates for o in outs) > 0 and "gd_kl" in outs[-1].logs
    assert all(math.isfinite(o.logs["gd_kl"]) for o in outs if "gd_kl" in o.logs)  # absent when the last step skipped


# =============================================================================================== DN
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
    out1 = dn(_inputs(q1 @ zg.T, q1, zg), st)
    assert torch.allclose(out1.scores, dn_scores(q1 @ zg.T, q1, zg, q1.mean(0), zg.mean(0), 0.5), atol=1e-6)
    dn(_inputs(q2 @ zg.T, q2, zg), st)  # only the first 4 queries of the stream count
    assert torch.allclose(st["query_sum"] / st["query_count"], torch.cat([q1, q2[:1]]).mean(0), atol=1e-6)
    running = build_objective("dn", {"query_mean": "running", "num_samples": 4, "gallery_mean": "samples"})
    st = running.init_state()
    running(_inputs(q1 @ zg.T, q1, zg), st)
    running(_inputs(q2 @ zg.T, q2, zg), st)
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
    out = dn(_inputs(zq @ zg.T, zq, zg), dn.init_state())
    assert torch.allclose(out.scores, (zq - 0.25 * mq) @ (zg - 0.25 * mg).T, atol=1e-6)
    theory = build_objective("dn", {"gallery_mean": "all", "lam": 0.5})
    out = theory(_inputs(zq @ zg.T, zq, zg), theory.init_state())
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


# =============================================================================================== ClipTTA
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
    assert soft_contrastive_loss(s, 0.1).item() == pytest.approx((_entropy_two(4) + _entropy_two(2)) / 2, abs=1e-6)
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


# =============================================================================================== TITAN
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


# =============================================================================================== EATA
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
    out = eata(_inputs(logits), eata.init_state())
    e = _entropy_two(4)
    assert out.n_selected == 2 and out.loss.item() == pytest.approx(e / math.exp(e - 0.4 * math.log(2)), abs=1e-6)
    # TCR port (default): k = int(0.4 * 3) = 1 lowest entropy and its ties (rows 0 and 2 tie), weight 1/exp(E - 0.40)
    eata = build_objective("eata", {"tau": 1.0})
    out = eata(_inputs(logits), eata.init_state())
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


# =============================================================================================== SAR
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


def test_sar_second_pass_reuses_first_filter():
    sar = build_objective("sar", {"tau": 1.0, "selection": "paper", "margin_e0": 0.9})
    state = sar.init_state()
    first = torch.tensor([[5.0, 0.0], [0.0, 0.0], [0.0, 5.0]])  # E: low, ln 2 (not < 0.9 ln 2), low
    out1 = sar(_inputs(first), state)
    assert out1.n_selected == 2
    second = torch.tensor([[5.0, 0.0], [9.0, 0.0], [0.1, 0.0]])  # row 1 not selected in pass 1; row 2 now uncertain
    out2 = sar(_inputs(second, in_closure=True), state)
    assert out2.n_selected == 1 and out2.loss.item() == pytest.approx(_entropy_two(5), abs=1e-6)


# =============================================================================================== READ, DeYO, PL, SHOT
def test_read_losses():
    logits = torch.tensor([[2.0, 0.0], [0.0, 1.0]])
    p = logits.softmax(1)
    pm = p.max(1).values
    l_ra, l_bal = read_losses(logits, math.exp(-1))
    assert l_ra.item() == pytest.approx((-(pm * pm.log())).mean().item(), abs=1e-6)  # gamma = 1/e
    ps = p.sum(0)
    q = ps.softmax(0)
    assert l_bal.item() == pytest.approx(-(q * q.log()).sum().item(), abs=1e-6)


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


def test_deyo_plpd_filter_and_loss():
    scores = torch.tensor([[3.0, 0.0, 0.0], [0.0, 2.5, 0.0], [1.0, 1.0, 1.0]], requires_grad=True)
    view = torch.tensor([[0.0, 0.0, 0.0], [0.0, 2.5, 0.0]])  # views of rows 0 and 1 (row 2 is too uncertain)

    def reencode(transform):
        transform({"input_ids": torch.zeros(3, 5, dtype=torch.long)})
        return None, view

    deyo = build_objective("deyo", {"tau": 1.0, "selection": "paper", "deyo_margin": 0.9, "plpd_threshold": 0.2})
    out = deyo(_inputs(scores, reencode=reencode, query_modality="text"), {})
    p0 = math.exp(3) / (math.exp(3) + 2)
    d = p0 - 1 / 3  # PLPD of row 0; row 1's view is unchanged (PLPD 0, filtered)
    assert plpd(torch.tensor([[p0, (1 - p0) / 2, (1 - p0) / 2]]), torch.full((1, 3), 1 / 3)).item() == pytest.approx(d, abs=1e-6)
    e = -(p0 * math.log(p0) + (1 - p0) * math.log((1 - p0) / 2))
    expected = e * (math.exp(-(e - 0.4 * math.log(3))) + math.exp(d))
    assert out.n_selected == 1 and out.loss.item() == pytest.approx(expected, abs=1e-5)


def test_pl_and_shot():
    s = torch.tensor([[2.0, 0.0], [0.5, 0.0], [0.0, 1.0]])
    pl = build_objective("pl", {"tau": 1.0, "threshold": 0.7})
    out = pl(_inputs(s), {})
    assert out.n_selected == 2 and out.loss.item() == pytest.approx(F.cross_entropy(s[[0, 2]], torch.tensor([0, 1])).item())
    # SHOT's pseudo-labels: the features of row 1 sit with row 2's cluster, so it is relabelled although it predicts 0
    feats = torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.05, 1.0]])
    probs = torch.tensor([[0.9, 0.1], [0.6, 0.4], [0.2, 0.8]])
    assert shot_pseudo_labels(feats, probs).tolist() == [0, 1, 1]
    shot = build_objective("shot", {"tau": 1.0, "beta": 0.0})
    out = shot(_inputs(s), {})
    p = s.softmax(1)
    assert out.loss.item() == pytest.approx((softmax_entropy(s).mean() + (p.mean(0) * (p.mean(0) + 1e-5).log()).sum()).item(), abs=1e-6)


# =============================================================================================== resume
RESUME_CASES = [
    ("rest", {}, {"gradient_decoupling": True}),
    ("tent", {}, {"score_transform": "dn", "score_transform_config": {"num_samples": 8}}),
    ("tcr", {}, {"gradient_decoupling": True, "gd_per_tensor": True, "score_transform": "dn"}),
    ("sar", {"selection": "paper", "margin_e0": 1.0}, {}),
    ("cliptta", {"open_set": True}, {}),
    ("eata", {"e_margin": 1.0, "d_margin": 1.01, "fisher_alpha": 10.0, "fisher_batches": 3}, {}),
    ("titan", {"hub_threshold": 0, "query_bank_size": 8}, {}),
    ("deyo", {"deyo_margin": 1.0, "plpd_threshold": -1.0}, {}),
]


@pytest.mark.parametrize("objective,ocfg,wcfg", RESUME_CASES, ids=[c[0] + ("+gd" if c[2].get("gradient_decoupling") else "") + ("+dn" if c[2].get("score_transform") else "") for c in RESUME_CASES])
def test_resume_equals_uninterrupted(tmp_path, objective, ocfg, wcfg):
    query = "text"
    cfg = TTAConfig(objective=objective, objective_config=ocfg, query_modality=query, **wcfg)
    gallery_inputs = batch("image", 12, seed=1)
    stream = [batch(query, 6, seed=100 + i) for i in range(4)]
    full = TTAWrapper(make_model("clip"), cfg)
    g = full.encode_gallery(gallery_inputs)
    expected = [full.adapt_step(q, g).scores for q in stream]
    first = TTAWrapper(make_model("clip"), cfg)
    g1 = first.encode_gallery(gallery_inputs)
    for q in stream[:2]:
        first.adapt_step(q, g1)
    first.save_pretrained(tmp_path)
    resumed = TTAWrapper.from_pretrained(make_model("clip"), tmp_path)
    assert resumed.config.build_objective_config() == cfg.build_objective_config() and resumed.lr == full.lr
    g2 = resumed.encode_gallery(gallery_inputs)
    for q, exp in zip(stream[2:], expected[2:]):
        assert torch.allclose(resumed.adapt_step(q, g2).scores, exp, atol=1e-6)
    assert all(torch.allclose(resumed.params[n], full.params[n], atol=1e-6) for n in full.params)
