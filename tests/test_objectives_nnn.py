"""NNN (hf_tta/objectives/nnn.py, hf_tta/query_bank.py): parity with the authors' code on identical tensors, a case
derived by hand, the stream's bank, the refusals, and NNN as a score transform (save/resume, reset, TCR)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from hf_tta import TTAConfig, TTAWrapper
from hf_tta.gallery import ChunkedGallery
from hf_tta.objectives import build_objective
from hf_tta.objectives.nnn import nnn_bias, nnn_scores
from hf_tta.query_bank import save_reference_bank
from hf_tta.state import ALL, AdapterState
from objective_helpers import score_inputs
from support import check_resume
from tiny_models import batch, blip2_model, make_model


# ------------------------------------------------------------------------------ the authors' code, transcribed
# github.com/multimodal-interpretability/nnn @ cea80de, nnn/nnn_retriever.py, NNNRetriever.compute_alignment_means
# (L28-42) and NNNRetriever.retrieve (L52-76), line by line (tqdm and the final .cpu().numpy() dropped).
def ref_compute_alignment_means(retrieval_embeds, reference_embeds, alternate_ks, batch_size):
    alignment_means = []
    for i in range(0, retrieval_embeds.shape[0], batch_size):
        batch_reference_similarity_scores = torch.einsum("ik,jk->ij", retrieval_embeds[i : i + batch_size, :], reference_embeds)
        top_k_reference_scores = torch.topk(batch_reference_similarity_scores, alternate_ks, dim=1)
        alignment_means.append(torch.mean(top_k_reference_scores.values, dim=1, keepdim=True))
    return torch.cat(alignment_means)


def ref_retrieve(retrieval_embeds, batch_query, top_k, alternate_weight, alignment_means, batch_size):
    distances = []
    indices = []
    for i in range(0, batch_query.shape[0], batch_size):
        batch_similarity_scores = (
            torch.einsum("ik,jk->ij", batch_query[i : i + batch_size, :], retrieval_embeds) - alternate_weight * alignment_means.T
        )
        top_k_results = torch.topk(batch_similarity_scores, top_k, dim=1)
        distances.append(top_k_results.values)
        indices.append(top_k_results.indices)
    return torch.vstack(distances), torch.vstack(indices)


def _unit(n, d, seed):
    return F.normalize(torch.randn(n, d, generator=torch.Generator().manual_seed(seed)), dim=1)


def test_parity_with_the_authors_code(tmp_path):
    """A fixed random case: the reference bank of 40 queries, a gallery of 25 items, 5 queries, k = 7, alpha = 0.75;
    the whole ranking (values and items) equals the authors' retrieve, through the functions and the objective."""
    gallery, reference, queries = _unit(25, 8, 0), _unit(40, 8, 1), _unit(5, 8, 2)
    k, alpha = 7, 0.75
    means = ref_compute_alignment_means(gallery, reference, k, batch_size=4)
    want_v, want_i = ref_retrieve(gallery, queries, 25, alpha, means, batch_size=2)
    ours = nnn_scores(queries @ gallery.T, nnn_bias(reference, gallery, k), alpha)
    got_v, got_i = ours.topk(25, dim=1)
    torch.testing.assert_close(got_v, want_v, rtol=0, atol=1e-6)
    assert torch.equal(got_i, want_i)
    nnn = build_objective("nnn", {"k": k, "alpha": alpha, "reference_bank": save_reference_bank(tmp_path / "bank.safetensors", reference)})
    out = nnn(score_inputs(queries @ gallery.T, queries, gallery), nnn.init_state())
    torch.testing.assert_close(out.scores, ours, rtol=0, atol=0)


def test_hand_computed_case():
    """Items g1 = (1, 0), g2 = (0, 1); bank (1, 0), (0.8, 0.6), (0, 1): g1 scores [1, 0.8, 0], g2 [0, 0.6, 1]; k = 2:
    b(g1) = 0.9, b(g2) = 0.8. Query (0.6, 0.8): [0.6, 0.8] - 0.5 b = [0.15, 0.4]."""
    g = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    bank = torch.tensor([[1.0, 0.0], [0.8, 0.6], [0.0, 1.0]])
    torch.testing.assert_close(nnn_bias(bank, g, 2), torch.tensor([0.9, 0.8]))
    q = torch.tensor([[0.6, 0.8]])
    torch.testing.assert_close(nnn_scores(q @ g.T, nnn_bias(bank, g, 2), 0.5), torch.tensor([[0.15, 0.4]]))


def test_the_stream_bank_is_prequential_and_first_in_first_out():
    gallery = _unit(12, 8, 0)
    nnn = build_objective("nnn", {"k": 3, "bank_size": 5})
    state = nnn.init_state()
    q1, q2, q3 = _unit(4, 8, 1), _unit(4, 8, 2), _unit(4, 8, 3)
    out = nnn(score_inputs(q1 @ gallery.T, q1, gallery), state)
    assert torch.equal(out.scores, q1 @ gallery.T) and out.logs["nnn_active"] == 0  # no past query yet
    out = nnn(score_inputs(q2 @ gallery.T, q2, gallery), state)  # scored against q1 only, then pushed
    torch.testing.assert_close(out.scores, nnn_scores(q2 @ gallery.T, nnn_bias(q1, gallery, 3), 0.75), rtol=0, atol=0)
    assert torch.equal(state["bank"], torch.cat([q1, q2])[-5:]) and int(state["bank_seen"]) == 8
    nnn(score_inputs(q3 @ gallery.T, q3, gallery), state)
    assert torch.equal(state["bank"], torch.cat([q2, q3])[-5:])


def test_refusals(tmp_path):
    bank = save_reference_bank(tmp_path / "bank.safetensors", _unit(6, 8, 0))
    with pytest.raises(ValueError, match="drop bank_size"):
        TTAConfig(score_transform="nnn", score_transform_config={"reference_bank": bank, "bank_size": 10})
    with pytest.raises(ValueError, match="is not a file"):
        TTAConfig(score_transform="nnn", score_transform_config={"reference_bank": str(tmp_path / "missing.safetensors")})
    with pytest.raises(ValueError, match="`k` must be an integer >= 1"):
        TTAConfig(score_transform="nnn", score_transform_config={"k": 0})
    with pytest.raises(ValueError, match="`bank_size` must be >= k"):
        TTAConfig(score_transform="nnn", score_transform_config={"bank_size": 64})
    with pytest.raises(ValueError, match="holds 6 queries; NNN averages k=128"):
        TTAWrapper(make_model("clip"), TTAConfig(objective="nnn", query_modality="image", objective_config={"reference_bank": bank}))
    with pytest.raises(ValueError, match="L2-normalised"):
        save_reference_bank(tmp_path / "raw.safetensors", torch.randn(4, 8) * 3)
    save_file({"other": _unit(4, 8, 0)}, str(tmp_path / "other.safetensors"))
    with pytest.raises(ValueError, match="no `embeddings` tensor"):
        build_objective("nnn", {"reference_bank": str(tmp_path / "other.safetensors")}).init_state()
    nnn = build_objective("nnn", {"k": 2, "reference_bank": bank})
    state = nnn.init_state()
    before = {k: v.clone() for k, v in state.items()}
    q, g = _unit(3, 16, 1), _unit(5, 16, 2)
    with pytest.raises(ValueError, match="8-d embeddings but the queries are 16-d"):
        nnn(score_inputs(q @ g.T, q, g), state)
    assert all(torch.equal(before[k], state[k]) for k in state)
    with pytest.raises(ValueError, match="multi-vector: use 'dn' there"):
        TTAWrapper(blip2_model(), TTAConfig(objective="tcr", query_modality="image", score_transform="nnn"))


def _tcr(**transform):
    return TTAConfig(objective="tcr", query_modality="image", score_transform="nnn", score_transform_config={"k": 4, **transform})


def test_composes_with_tcr():
    """TCR + NNN answers what NNN makes of TCR's own answers, each batch against the queries before it."""
    stream = [batch("image", 6, seed=20 + i) for i in range(3)]
    plain = TTAWrapper(make_model("clip"), TTAConfig(objective="tcr", query_modality="image"))
    both = TTAWrapper(make_model("clip"), _tcr())
    g = plain.encode_gallery(batch("text", 15, seed=1))
    for i, q in enumerate(stream):
        bank = both.transform_state["bank"]
        want, got = plain.adapt_step(q, g), both.adapt_step(q, g)
        assert got.num_updates == want.num_updates == 3
        expected = want.scores if i == 0 else nnn_scores(want.scores, nnn_bias(bank, g.embeddings, 4), 0.75)
        torch.testing.assert_close(got.scores, expected, rtol=0, atol=1e-6)
    for name, p in plain.params.items():  # the transform changes the answers only
        assert torch.equal(p, both.params[name])


def test_save_resume_equals_uninterrupted_and_reset_is_exact(tmp_path):
    def make():
        tta = TTAWrapper(make_model("clip"), _tcr(bank_size=10))
        return tta, tta.encode_gallery(batch("text", 15, seed=1))

    stream = [batch("image", 6, seed=30 + i) for i in range(4)]
    check_resume(make, stream, cut=2, folder=tmp_path / "ckpt")
    tta, g = make()
    source = AdapterState.capture(tta, ALL)
    for q in stream:
        tta.adapt_step(q, g)
    assert tta.transform_state["bank"].shape == (10, 16)
    tta.reset()
    assert AdapterState.capture(tta, ALL).equals(source) and tta.transform_state["bank"].numel() == 0


def test_a_reference_bank_is_fixed_and_survives_reset(tmp_path):
    tta0 = TTAWrapper(make_model("clip"), TTAConfig(objective="dn", query_modality="image"))
    with torch.no_grad():
        bank = tta0.adapter.embed("image", batch("image", 9, seed=5))
    path = save_reference_bank(tmp_path / "bank.safetensors", bank)
    tta = TTAWrapper(make_model("clip"), TTAConfig(objective="nnn", query_modality="image", objective_config={"k": 3, "reference_bank": path}))
    g = tta.encode_gallery(batch("text", 15, seed=1))
    q = batch("image", 6, seed=7)
    first = tta.adapt_step(q, g)
    with torch.no_grad():
        zq = tta.adapter.embed("image", q)
    torch.testing.assert_close(first.scores, nnn_scores(zq @ g.embeddings.T, nnn_bias(bank, g.embeddings, 3), 0.75), rtol=0, atol=1e-6)
    assert torch.equal(tta.state["bank"], bank)  # never pushed
    tta.reset()
    assert torch.equal(tta.state["bank"], bank) and torch.equal(tta.adapt_step(q, g).scores, first.scores)


def test_multi_vector_gallery_scores_the_bank_as_the_model_does():
    """BLIP-2 text -> image: the bias of an image is over the max of its query-token vectors."""
    tta = TTAWrapper(blip2_model(), TTAConfig(objective="nnn", query_modality="text", objective_config={"k": 2}))
    g = tta.encode_gallery(batch("image", 7, seed=1))
    assert g.embeddings.dim() == 3
    q1, q2 = batch("text", 5, seed=2), batch("text", 5, seed=3)
    tta.adapt_step(q1, g)
    out = tta.adapt_step(q2, g)
    with torch.no_grad():
        z1, z2 = tta.adapter.embed("text", q1), tta.adapter.embed("text", q2)
    bias = tta.adapter.score(z1, g.embeddings).topk(2, dim=0).values.mean(0)
    torch.testing.assert_close(out.scores, tta.adapter.score(z2, g.embeddings) - 0.75 * bias, rtol=0, atol=1e-6)


def test_exact_backend_with_every_item_equals_dense():
    stream = [batch("image", 6, seed=40 + i) for i in range(3)]
    dense = TTAWrapper(make_model("clip"), _tcr())
    topk = TTAWrapper(make_model("clip"), _tcr())
    g = dense.encode_gallery(batch("text", 15, seed=1))
    backend = ChunkedGallery(g.embeddings, "text", k=15, chunk_size=4)
    for q in stream:
        a, b = dense.adapt_step(q, g), topk.adapt_step(q, backend)
        v, i = a.scores.sort(dim=1, descending=True, stable=True)
        torch.testing.assert_close(b.topk.values, v, rtol=0, atol=1e-5)
        assert (b.topk.indices == i).float().mean() > 0.95  # near-ties of the tiny random model aside
    small = ChunkedGallery(g.embeddings, "text", k=3)
    out = TTAWrapper(make_model("clip"), _tcr()).adapt_step(stream[0], small)
    assert out.topk.values.shape == (6, 3)
