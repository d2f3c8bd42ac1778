"""QB-Norm (hf_tta/objectives/qbnorm.py, hf_tta/query_bank.py): parity with the authors' code on identical tensors, a
case derived by hand, the stream's querybank, the refusals, and QB-Norm as a score transform (save/resume, reset,
TCR, top-k backends)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from hf_tta import TTAConfig, TTAWrapper
from hf_tta.gallery import ChunkedGallery
from hf_tta.objectives import build_objective
from hf_tta.objectives.qbnorm import bank_statistics, dynamic_inverted_softmax
from hf_tta.query_bank import save_reference_bank
from hf_tta.state import ALL, AdapterState
from objective_helpers import score_inputs
from support import check_resume
from tiny_models import batch, blip2_model, make_model


# ------------------------------------------------------------------------------ the authors' code, transcribed
# github.com/ioanacroi/qb-norm @ 76d4d90, dynamic_inverted_softmax.py: get_retrieved_videos (L7-11),
# get_index_to_normalize (L14-18) and qb_norm (L20-32), line by line (numpy, as there).
def ref_get_retrieved_videos(sims, k):
    argm = np.argsort(-sims, axis=1)
    topk = argm[:, :k].reshape(-1)
    retrieved_videos = np.unique(topk)
    return retrieved_videos


def ref_get_index_to_normalize(sims, videos):
    argm = np.argsort(-sims, axis=1)[:, 0]
    result = np.array(list(map(lambda x: x in videos, argm)))
    result = np.nonzero(result)
    return result


def ref_qb_norm(train_test, test_test, args):
    k = args.get("k", 1)
    beta = args.get("beta", 20)
    retrieved_videos = ref_get_retrieved_videos(train_test, k)
    test_test_normalized = test_test
    train_test = np.exp(train_test * beta)
    test_test = np.exp(test_test * beta)

    normalizing_sum = np.sum(train_test, axis=0)
    index_for_normalizing = ref_get_index_to_normalize(test_test, retrieved_videos)
    test_test_normalized[index_for_normalizing, :] = np.divide(test_test[index_for_normalizing, :], normalizing_sum)
    return test_test_normalized


def _unit(n, d, seed):
    return F.normalize(torch.randn(n, d, generator=torch.Generator().manual_seed(seed), dtype=torch.float64), dim=1)


@pytest.mark.parametrize("k", [1, 3])
def test_parity_with_the_authors_code(k, tmp_path):
    """A fixed random case: a querybank of 30 queries, a gallery of 20 items, 12 queries; the code's defaults
    beta = 20 and k = 1 (some queries are normalised and some are not: both rules are exercised), and k = 3."""
    gallery, bank, queries = _unit(20, 6, 0), _unit(30, 6, 1), _unit(12, 6, 2)
    want = ref_qb_norm((bank @ gallery.T).numpy(), (queries @ gallery.T).numpy().copy(), {"k": k, "beta": 20})
    raw = (queries @ gallery.T).numpy()
    changed = ~np.isclose(want, raw).all(axis=1)
    assert 0 < changed.sum() < len(raw) if k == 1 else changed.all()
    log_norm, _, top = bank_statistics(bank, gallery, 20.0, k)
    active = torch.zeros(20, dtype=torch.bool)
    active[top.reshape(-1)] = True
    ours = dynamic_inverted_softmax(queries @ gallery.T, log_norm, active, 20.0)
    np.testing.assert_allclose(ours.numpy(), want, rtol=1e-10, atol=0)
    # the objective, on float32 embeddings and the bank written to a file: the same up to float32 rounding
    path = save_reference_bank(tmp_path / "bank.safetensors", bank.float())
    qb = build_objective("qbnorm", {"k": k, "reference_bank": path})
    q32, g32 = queries.float(), gallery.float()
    out = qb(score_inputs(q32 @ g32.T, q32, g32), qb.init_state())
    np.testing.assert_allclose(out.scores.numpy(), want, rtol=2e-5, atol=1e-7)


def test_hand_computed_case():
    """beta = ln 2, so exp(beta s) = 2^s. Items g1 = (1, 0), g2 = (0, 1); querybank (1, 0), (0.8, 0.6): their
    top-1 is g1 both times, A = {g1}; sums 2^1 + 2^0.8 for g1, 2^0 + 2^0.6 for g2. Query (1, 0) (top-1 g1, in A):
    [2 / (2 + 2^0.8), 1 / (1 + 2^0.6)]; query (0.6, 0.8) (top-1 g2, not in A): its raw scores [0.6, 0.8]."""
    g = torch.tensor([[1.0, 0.0], [0.0, 1.0]], dtype=torch.float64)
    bank = torch.tensor([[1.0, 0.0], [0.8, 0.6]], dtype=torch.float64)
    q = torch.tensor([[1.0, 0.0], [0.6, 0.8]], dtype=torch.float64)
    beta = math.log(2)
    log_norm, _, top = bank_statistics(bank, g, beta, 1)
    assert top.reshape(-1).tolist() == [0, 0]
    out = dynamic_inverted_softmax(q @ g.T, log_norm, torch.tensor([True, False]), beta)
    want = torch.tensor([[2 / (2 + 2**0.8), 1 / (1 + 2**0.6)], [0.6, 0.8]], dtype=torch.float64)
    torch.testing.assert_close(out, want, rtol=1e-12, atol=0)


def test_chunked_statistics_equal_one_chunk(monkeypatch):
    import hf_tta.query_bank as query_bank

    gallery, bank = _unit(50, 6, 0), _unit(9, 6, 1)
    whole = bank_statistics(bank, gallery, 20.0, 3)
    monkeypatch.setattr(query_bank, "CHUNK_ELEMENTS", 9 * 7)  # 7 columns per chunk
    chunked = bank_statistics(bank, gallery, 20.0, 3)
    torch.testing.assert_close(chunked[0], whole[0], rtol=1e-12, atol=0)
    assert torch.equal(chunked[2].sort(dim=1).values, whole[2].sort(dim=1).values)


def test_the_stream_querybank_is_prequential():
    gallery = _unit(10, 6, 0).float()
    qb = build_objective("qbnorm", {"bank_size": 6})
    state = qb.init_state()
    q1, q2 = _unit(4, 6, 1).float(), _unit(4, 6, 2).float()
    out = qb(score_inputs(q1 @ gallery.T, q1, gallery), state)
    assert torch.equal(out.scores, q1 @ gallery.T)  # an empty querybank: an empty activation set
    out = qb(score_inputs(q2 @ gallery.T, q2, gallery), state)
    want = ref_qb_norm((q1 @ gallery.T).double().numpy(), (q2 @ gallery.T).double().numpy().copy(), {})
    np.testing.assert_allclose(out.scores.numpy(), want, rtol=2e-5, atol=1e-7)
    assert torch.equal(state["bank"], torch.cat([q1, q2])[-6:]) and int(state["bank_seen"]) == 8


def test_refusals():
    with pytest.raises(ValueError, match="`beta` must be > 0"):
        TTAConfig(score_transform="qbnorm", score_transform_config={"beta": 0.0})
    with pytest.raises(ValueError, match="valid keys"):
        TTAConfig(score_transform="qbnorm", score_transform_config={"temperature": 0.05})
    with pytest.raises(ValueError, match="multi-vector: use 'dn' there"):
        TTAWrapper(blip2_model(), TTAConfig(objective="qbnorm", query_modality="image"))


def _tcr(**transform):
    return TTAConfig(objective="tcr", query_modality="image", score_transform="qbnorm", score_transform_config=transform)


def test_composes_with_tcr():
    stream = [batch("image", 6, seed=20 + i) for i in range(3)]
    plain = TTAWrapper(make_model("clip"), TTAConfig(objective="tcr", query_modality="image"))
    both = TTAWrapper(make_model("clip"), _tcr())
    g = plain.encode_gallery(batch("text", 15, seed=1))
    for q in stream:
        bank = both.transform_state["bank"]
        want, got = plain.adapt_step(q, g), both.adapt_step(q, g)
        expected = want.scores.double().numpy().copy()
        if bank.numel():
            expected = ref_qb_norm((bank @ g.embeddings.T).double().numpy(), expected, {})
        np.testing.assert_allclose(got.scores.numpy(), expected, rtol=2e-5, atol=1e-7)
    for name, p in plain.params.items():
        assert torch.equal(p, both.params[name])


def test_save_resume_equals_uninterrupted_and_reset_is_exact(tmp_path):
    def make():
        tta = TTAWrapper(make_model("clip"), _tcr(bank_size=8, k=2))
        return tta, tta.encode_gallery(batch("text", 15, seed=1))

    stream = [batch("image", 6, seed=30 + i) for i in range(4)]
    check_resume(make, stream, cut=2, folder=tmp_path / "ckpt")
    tta, g = make()
    source = AdapterState.capture(tta, ALL)
    for q in stream:
        tta.adapt_step(q, g)
    tta.reset()
    assert AdapterState.capture(tta, ALL).equals(source) and tta.transform_state["bank"].numel() == 0


def test_multi_vector_gallery():
    tta = TTAWrapper(blip2_model(), TTAConfig(objective="qbnorm", query_modality="text"))
    g = tta.encode_gallery(batch("image", 7, seed=1))
    q1, q2 = batch("text", 5, seed=2), batch("text", 5, seed=3)
    tta.adapt_step(q1, g)
    out = tta.adapt_step(q2, g)
    with torch.no_grad():
        z1, z2 = tta.adapter.embed("text", q1), tta.adapter.embed("text", q2)
    want = ref_qb_norm(tta.adapter.score(z1, g.embeddings).double().numpy(), tta.adapter.score(z2, g.embeddings).double().numpy(), {})
    np.testing.assert_allclose(out.scores.numpy(), want, rtol=2e-5, atol=1e-7)


def test_exact_backend_with_every_item_equals_dense_and_a_small_k_keeps_the_activation_set_exact():
    stream = [batch("image", 6, seed=40 + i) for i in range(3)]
    dense, topk, small = (TTAWrapper(make_model("clip"), _tcr()) for _ in range(3))
    g = dense.encode_gallery(batch("text", 15, seed=1))
    for q in stream:
        a = dense.adapt_step(q, g)
        b = topk.adapt_step(q, ChunkedGallery(g.embeddings, "text", k=15, chunk_size=4))
        c = small.adapt_step(q, ChunkedGallery(g.embeddings, "text", k=3))
        v, i = a.scores.sort(dim=1, descending=True, stable=True)
        torch.testing.assert_close(b.topk.values, v, rtol=2e-5, atol=1e-6)
        # k = 3: each query's top-1 and the activation set are exact, so each candidate scores as in the dense run
        torch.testing.assert_close(a.scores.gather(1, c.topk.indices), c.topk.values, rtol=2e-5, atol=1e-6)
    torch.testing.assert_close(dense.transform_state["bank"], small.transform_state["bank"], rtol=0, atol=1e-5)
