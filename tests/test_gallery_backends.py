"""Gallery backends: exact backends equal the dense gallery, FAISS within a recall tolerance, save/load, top-k metrics,
and the wrapper's top-k path (candidates re-scored exactly; TCR identical to the dense run), for single-vector and
multi-vector (BLIP-2's Q-Former tokens, scored by the max over an item's vectors) galleries."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hf_tta import TTAConfig, TTAWrapper, retrieval_metrics
from hf_tta.gallery import ChunkedGallery, FaissGallery, GalleryCache, TopKScores, merge_topk
from hf_tta.metrics.topk import topk_retrieval_metrics
from hf_tta.models import get_adapter
from hf_tta.objectives.base import gallery_fingerprint
from tiny_models import blip2_model, image_batch, make_model, text_batch


def unit(n, d, seed):
    return F.normalize(torch.randn(n, d, generator=torch.Generator().manual_seed(seed)), dim=1)


def dense_topk(q, g, k):
    v, i = (q @ g.T).sort(dim=1, descending=True, stable=True)
    return v[:, :k], i[:, :k]


# ------------------------------------------------------------------------------------------------ backends
def test_merge_topk_breaks_ties_by_index():
    v = torch.tensor([[0.5, 0.75, 0.5, 0.125]])
    i = torch.tensor([[7, 3, 2, 1]])
    out = merge_topk(v, i, 3)
    assert out.indices.tolist() == [[3, 2, 7]] and out.values.tolist() == [[0.75, 0.5, 0.5]]


@pytest.mark.parametrize("chunk_size", [1, 7, 64, 1000])
def test_chunked_search_equals_dense(chunk_size):
    g, q = unit(300, 16, 0), unit(9, 16, 1)
    res = ChunkedGallery(g, "text", chunk_size=chunk_size).search(q, 12)
    v, i = dense_topk(q, g, 12)
    assert torch.equal(res.indices, i)
    torch.testing.assert_close(res.values, v, rtol=0, atol=1e-6)


def test_chunked_fp16_save_load_and_mmap(tmp_path):
    g, q = unit(500, 32, 2), unit(5, 32, 3)
    gal = ChunkedGallery.from_chunks(g.split(64), 500, 32, "image", dtype=torch.float16, k=7, chunk_size=100)
    assert gal.embeddings.dtype == torch.float16 and len(gal) == 500 and gal.dim == 32
    gal.save(tmp_path)
    eager = ChunkedGallery.load(tmp_path)
    mapped = ChunkedGallery.load(tmp_path, mmap=True)
    assert mapped.embeddings is None and (mapped.k, mapped.chunk_size, mapped.modality) == (7, 100, "image")
    g16 = g.half().float()
    v, i = dense_topk(q, g16, 7)
    for backend in (gal, eager, mapped):
        res = backend.search(q, 7)
        assert torch.equal(res.indices, i)
        ids = torch.tensor([499, 0, 17])
        assert torch.equal(backend.gather(ids), g16[ids])


def test_chunked_rejects_bad_input():
    for shape in ((3, 0, 4), (3, 2, 2, 4), (3,)):
        with pytest.raises(ValueError, match=r"\(N, D\) or multi-vector \(N, Q, D\)"):
            ChunkedGallery(torch.zeros(shape), "text")
    with pytest.raises(ValueError, match="k must be a positive integer"):
        ChunkedGallery(unit(3, 4, 0), "text", k=0)
    with pytest.raises(ValueError, match="expected num_items=5"):
        ChunkedGallery.from_chunks([unit(3, 4, 0)], 5, 4, "text")


def test_faiss_flat_is_exact_and_round_trips(tmp_path):
    g, q = unit(400, 32, 4), unit(6, 32, 5)
    gal = FaissGallery.build(g, "text", index="flat", k=10)
    assert gal.exact and len(gal) == 400 and gal.dim == 32
    v, i = dense_topk(q, g, 10)
    res = gal.search(q, 10)
    assert torch.equal(res.indices, i)
    torch.testing.assert_close(res.values, v, rtol=0, atol=1e-5)
    gal.save(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gallery.faiss", "gallery.json"]
    again = FaissGallery.load(tmp_path)
    assert torch.equal(again.search(q, 10).indices, i) and again.k == 10
    torch.testing.assert_close(again.gather(i[0]), g[i[0]], rtol=0, atol=0)


@pytest.mark.parametrize("index,min_recall", [("ivf", 0.9), ("hnsw", 0.9), ("ivf_sq8", 0.85)])
def test_faiss_approximate_recall_tolerance(index, min_recall):
    """Documented tolerance: on clustered data (like real embeddings), recall@10 of the index's top-10 >= 0.9
    (0.85 for 8-bit vectors) with the default nprobe / efSearch."""
    centres = unit(20, 32, 6)
    g = F.normalize(centres.repeat_interleave(100, 0) + 0.3 * unit(2000, 32, 7), dim=1)
    q = F.normalize(centres[:10] + 0.3 * unit(10, 32, 8), dim=1)
    gal = FaissGallery.build(g, "text", index=index, nlist=16, nprobe=4)
    res = gal.search(q, 10)
    _, i = dense_topk(q, g, 10)
    recall = (res.indices[:, :, None] == i[:, None, :]).any(-1).float().mean().item()
    assert recall >= min_recall, recall


@pytest.mark.parametrize("index", ["chunked", "flat", "ivf", "hnsw"])
def test_unchanged_backend_ids_are_positions(index):
    """A backend built without ids names its items 0 .. N-1 (version 0), so search_ids answers as search does; the
    live-index operations are in tests/test_gallery_live.py."""
    g, q = unit(200, 16, 10), unit(4, 16, 11)
    gal = ChunkedGallery(g, "text") if index == "chunked" else FaissGallery.build(g, "text", index=index, nlist=4)
    assert torch.equal(gal.ids, torch.arange(200)) and gal.version == 0 and gal.changes_since(0) == []
    res, by_id = gal.search(q, 5), gal.search_ids(q, 5)
    assert torch.equal(res.indices, by_id.indices) and by_id.version == 0


def test_faiss_rejects_wrong_metric():
    import faiss

    idx = faiss.IndexFlatL2(4)
    idx.add(unit(3, 4, 0).numpy())
    with pytest.raises(ValueError, match="METRIC_INNER_PRODUCT"):
        FaissGallery(idx, "text")


# ------------------------------------------------------------------------------------------------ multi-vector items
MULTI = {
    "chunked_1": lambda g, **kw: ChunkedGallery(g, "image", chunk_size=1, **kw),  # one item per block
    "chunked_10": lambda g, **kw: ChunkedGallery(g, "image", chunk_size=10, **kw),  # 2 items (of Q=4) per block
    "chunked_mmap": None,  # saved, memory-mapped back
    "faiss_flat": lambda g, **kw: FaissGallery.build(g, "image", index="flat", **kw),
    "faiss_flat_ids": lambda g, **kw: FaissGallery.build(g, "image", index="flat", ids=torch.arange(len(g)) * 5 + 3, **kw),
}


@pytest.fixture(scope="module")
def blip2_embeddings():
    """A tiny BLIP-2's image gallery (N, Q, D), text queries (B, D) and the adapter's dense scores (max over tokens)."""
    adapter = get_adapter(blip2_model())
    with torch.no_grad():
        g = adapter.encode("image", image_batch(40, seed=1))
        q = adapter.encode("text", text_batch(6, seed=2))
    return g, q, adapter.score(q, g)


@pytest.mark.parametrize("kind", list(MULTI))
def test_multi_vector_topk_equals_the_adapters_dense_scores(kind, blip2_embeddings, tmp_path):
    g, q, dense = blip2_embeddings
    assert g.shape == (40, 4, 16)
    if kind == "chunked_mmap":
        ChunkedGallery(g, "image", chunk_size=6).save(tmp_path)
        gal = ChunkedGallery.load(tmp_path, mmap=True)
    else:
        gal = MULTI[kind](g)
    assert (len(gal), gal.dim, gal.num_vectors, gal.item_shape) == (40, 16, 4, (4, 16))
    v, i = dense.sort(dim=1, descending=True, stable=True)
    res = gal.search(q, 9)
    assert torch.equal(res.indices, i[:, :9])
    torch.testing.assert_close(res.values, v[:, :9], rtol=0, atol=1e-6)
    assert torch.equal(gal.gather(torch.tensor([39, 0, 7])), g[[39, 0, 7]])
    # the statistics are of the single-vector view the dense path hands objectives (GalleryCache.single)
    single = GalleryCache(g, "image").single
    torch.testing.assert_close(gal.statistics().mean, single.mean(0), rtol=0, atol=1e-6)
    torch.testing.assert_close(gal.statistics().fingerprint, gallery_fingerprint(single), rtol=1e-9, atol=1e-6)
    assert torch.equal(gal.kmeans(3, 20, 0).labels, ChunkedGallery(single, "image").kmeans(3, 20, 0).labels)
    with pytest.raises(ValueError, match="one side must be single-vector"):
        gal.search_tokens(g[:2], 3)


def test_multi_vector_faiss_ivf_recall_and_exact_scores():
    """IVF over the items' vectors: recall of the top-10 items >= 0.9 on clustered data with nprobe < nlist (the
    documented approximation), while every returned score is the exact max over the item's stored vectors."""
    centres = unit(20, 32, 6)
    g = F.normalize(centres.repeat_interleave(50, 0)[:, None] + 0.3 * torch.randn(1000, 4, 32, generator=torch.Generator().manual_seed(7)), dim=-1)
    q = F.normalize(centres[:10] + 0.3 * unit(10, 32, 8), dim=1)
    gal = FaissGallery.build(g, "text", index="ivf", nlist=16, nprobe=4)
    assert not gal.exact and len(gal) == 1000 and gal.index.ntotal == 4000
    res = gal.search(q, 10)
    exact = torch.einsum("bd,nqd->bnq", q, g).amax(-1)
    _, i = exact.sort(dim=1, descending=True, stable=True)
    recall = (res.indices[:, :, None] == i[:, None, :10]).any(-1).float().mean().item()
    assert recall >= 0.9, recall
    torch.testing.assert_close(res.values, exact.gather(1, res.indices), rtol=0, atol=1e-6)
    assert (res.values[:, :-1] >= res.values[:, 1:]).all()


def test_multi_vector_faiss_ids_must_fit_the_vector_labels(tmp_path):
    g = F.normalize(torch.randn(6, 4, 8), dim=-1)
    with pytest.raises(ValueError, match=r"ids must lie in \[0, "):
        FaissGallery.build(g, "image", index="flat", ids=[-1, 1, 2, 3, 4, 5])
    gal = FaissGallery.build(g, "image", index="flat", k=3)
    with pytest.raises(ValueError, match="ids must lie in"):
        gal.add([2**62], g[:1])
    assert len(gal) == 6 and gal.version == 0 and gal.index.ntotal == 24
    gal.save(tmp_path)
    again = FaissGallery.load(tmp_path)
    assert again.num_vectors == 4 and torch.equal(again.gather(torch.arange(6)), g)


# ------------------------------------------------------------------------------------------------ metrics
def test_topk_metrics_equal_dense_metrics_within_k():
    torch.manual_seed(0)
    s = torch.randn(40, 120)
    rel = torch.randint(0, 120, (40, 2))
    v, i = s.sort(dim=1, descending=True)
    top = topk_retrieval_metrics(TopKScores(v[:, :80], i[:, :80]), rel, ks=(1, 5, 10))
    dense = retrieval_metrics(s, rel, ks=(1, 5, 10))
    for key in ("R@1", "R@5", "R@10", "medr"):
        assert top[key] == pytest.approx(dense[key])
    with pytest.raises(ValueError, match="search more neighbours"):
        topk_retrieval_metrics(TopKScores(v[:, :5], i[:, :5]), rel, ks=(10,))


def test_topk_metrics_pessimistic_ties():
    # query 0: relevant item 4 ties with item 9 at the top -> rank 2 (1 + one other item scoring >= it)
    top = TopKScores(torch.tensor([[0.9, 0.9, 0.1]]), torch.tensor([[9, 4, 1]]))
    m = topk_retrieval_metrics(top, [[4]], ks=(1, 2))
    assert (m["R@1"], m["R@2"], m["medr"]) == (0.0, 100.0, 2.0)


# ------------------------------------------------------------------------------------------------ the wrapper
def _captions(n, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return {
        "input_ids": torch.randint(3, 99, (n, 8), generator=gen),
        "attention_mask": torch.ones(n, 8, dtype=torch.long),
    }


def _stream(objective, make_gallery, batches=3, **cfg):
    tta = TTAWrapper(make_model("clip"), TTAConfig(objective=objective, query_modality="image", **cfg))
    gallery = make_gallery(tta.encode_gallery(_captions(240), show_progress=False))
    gen = torch.Generator().manual_seed(2)
    outs = [
        tta.adapt_step({"pixel_values": torch.randn(12, 3, 32, 32, generator=gen)}, gallery) for _ in range(batches)
    ]
    return tta, outs


def _blip2_stream(objective, make_gallery, batches=3, **cfg):
    """Text -> image retrieval with a tiny BLIP-2 (Q-Former text input): a multi-vector image gallery (N, 4, 16)."""
    tta = TTAWrapper(blip2_model(), TTAConfig(objective=objective, query_modality="text", **cfg))
    gallery = make_gallery(tta.encode_gallery([image_batch(60, seed=1)], show_progress=False))
    outs = [tta.adapt_step(text_batch(12, seed=2 + b), gallery) for b in range(batches)]
    return tta, outs


@pytest.mark.parametrize("stream", [_stream, _blip2_stream], ids=["clip_i2t", "blip2_t2i_multi_vector"])
def test_tcr_with_exact_backends_equals_dense(stream):
    """TCR needs only each query's top-1 (gallery_access='topk'): a top-k backend gives the dense run exactly, also on
    a multi-vector gallery (the candidates keep their (C, Q, D) shape and are scored by the adapter)."""
    dense_tta, dense = stream("tcr", lambda g: g)
    for make in (
        lambda g: ChunkedGallery(g.embeddings, g.modality, k=10, chunk_size=50),
        lambda g: FaissGallery.build(g.embeddings, g.modality, index="flat", k=10),
    ):
        tta, outs = stream("tcr", make)
        for a, b in zip(dense, outs):
            assert b.scores is None and b.topk.k == 10
            v, i = a.scores.sort(dim=1, descending=True, stable=True)
            assert torch.equal(b.topk.indices, i[:, :10])
            torch.testing.assert_close(b.topk.values, v[:, :10], rtol=0, atol=1e-6)
            assert a.loss == pytest.approx(b.loss, abs=1e-6)
        for name, p in tta.params.items():
            torch.testing.assert_close(p, dense_tta.params[name], rtol=0, atol=1e-6)


def test_softmax_objective_over_candidates_and_stream():
    """Tent's softmax is taken over the batch's candidates: close to the dense run when k covers the mass, and
    adapt_stream concatenates top-k results."""
    _, dense = _stream("tent", lambda g: g, batches=2)
    tta, outs = _stream("tent", lambda g: ChunkedGallery(g.embeddings, "text", k=120), batches=2)
    for a, b in zip(dense, outs):
        assert b.loss == pytest.approx(a.loss, rel=1e-3, abs=1e-6)
    gen = torch.Generator().manual_seed(3)
    gallery = ChunkedGallery(tta.encode_gallery(_captions(240), show_progress=False).embeddings, "text", k=5)
    res = tta.adapt_stream(
        [{"pixel_values": torch.randn(4, 3, 32, 32, generator=gen)} for _ in range(2)], gallery, show_progress=False
    )
    assert isinstance(res, TopKScores) and res.values.shape == (8, 5)
    assert (res.values[:, :-1] >= res.values[:, 1:]).all()


def test_backend_of_another_modality_is_refused():
    """(Objectives that need every item at every step are refused too: tests/test_objectives_base.py.)"""
    tta = TTAWrapper(make_model("clip"), TTAConfig(objective="tcr", query_modality="image"))
    with pytest.raises(ValueError, match="holds image embeddings"):
        tta.adapt_step({"pixel_values": torch.randn(2, 3, 32, 32)}, ChunkedGallery(unit(50, 16, 0), "image"))


@pytest.mark.parametrize("objective", ["sar", "deyo", "read", "pl", "shot", "tcr_training_free"])
def test_softmax_objectives_run_on_candidates(objective):
    """Every softmax objective runs on a top-k backend (SAM's closure pass, DeYO's re-encoded views and the
    training-free scores all use the step's candidate set); the other objectives: tests/test_objectives_base.py."""
    tta = TTAWrapper(make_model("clip"), TTAConfig(objective=objective, query_modality="image"))
    emb = tta.encode_gallery(_captions(80), show_progress=False).embeddings
    out = tta.adapt_step(
        {"pixel_values": torch.randn(6, 3, 32, 32, generator=torch.Generator().manual_seed(4))},
        ChunkedGallery(emb, "text", k=7),
    )
    assert out.scores is None and out.topk.values.shape == (6, 7)
    assert ((out.topk.indices >= 0) & (out.topk.indices < 80)).all()
    assert (out.topk.values[:, :-1] >= out.topk.values[:, 1:]).all()
