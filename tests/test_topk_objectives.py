"""Every objective on the top-k gallery backends (issue 11): REST and DN from whole-gallery statistics computed once per
backend, EATA / TITAN / ClipTTA with per-item state keyed by global gallery index.

(a) each runs on ChunkedGallery, FaissGallery (flat and IVF) and a ShardedGallery over 2 gloo processes; (b) exact
backends equal the dense gallery where the maths allows it: REST at k >= its K (top-1, the other queries' top-K and the
centroids are all exact), DN at any k (it searches its shifted queries), TITAN at k > B - 1 (rematching cannot pick an
item outside the candidates), EATA and ClipTTA at k >= N (their softmax is over the candidates); (c) the statistics are
computed once per backend, equal the dense ones, and save/load with the backend; a resumed stream is bit-identical."""

from __future__ import annotations

import os

import pytest
import torch
import torch.multiprocessing as mp
from safetensors.torch import load_file, save_file

from hf_tta import TTAConfig, TTAWrapper
from hf_tta.gallery import ChunkedGallery, FaissGallery
from hf_tta.gallery import stats as gallery_stats
from hf_tta.objectives.base import gallery_fingerprint
from hf_tta.objectives.eata import eata_selection, update_model_probs
from hf_tta.objectives.rest import spherical_kmeans
from tiny_models import make_model

OBJECTIVES = ("rest", "eata", "dn", "titan", "cliptta")
OBJECTIVES_STATS, OBJECTIVES_ITEM = ("rest", "dn"), ("eata", "titan", "cliptta")
N, B, BATCHES = 60, 12, 3
# EATA's redundancy filter drops every query of the tiny random model (its predictions all look alike): keep them
CONFIGS = {"eata": {"objective_config": {"d_margin": 1.01}}}


def _captions(n=N, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return {"input_ids": torch.randint(3, 99, (n, 8), generator=gen), "attention_mask": torch.ones(n, 8, dtype=torch.long)}


def _batches(batches=BATCHES, seed=2):
    gen = torch.Generator().manual_seed(seed)
    return [{"pixel_values": torch.randn(B, 3, 32, 32, generator=gen)} for _ in range(batches)]


def _wrapper(objective, **cfg):
    cfg = {**CONFIGS.get(objective, {}), **cfg}
    return TTAWrapper(make_model("clip"), TTAConfig(objective=objective, query_modality="image", **cfg))


def _gallery_embeddings():
    return _wrapper("tcr").encode_gallery(_captions(), show_progress=False).embeddings


def _stream(objective, make_gallery, batches=None, **cfg):
    tta = _wrapper(objective, **cfg)
    gallery = make_gallery(tta.encode_gallery(_captions(), show_progress=False))
    return tta, [tta.adapt_step(b, gallery) for b in (batches or _batches())]


def _assert_topk_equals_dense(dense, outs, atol=1e-5):
    """The top-k run's items are the dense run's top-k (the same indices but for near-ties, which the tiny random
    model has: then the items it returns score as the dense ones), with the dense run's scores."""
    for a, b in zip(dense, outs):
        v, i = a.scores.sort(dim=1, descending=True, stable=True)
        k = b.topk.k
        assert (b.topk.indices == i[:, :k]).float().mean() > 0.97
        torch.testing.assert_close(a.scores.gather(1, b.topk.indices), v[:, :k], rtol=0, atol=atol)
        torch.testing.assert_close(b.topk.values, v[:, :k], rtol=0, atol=atol)
        assert (a.loss is None) == (b.loss is None) and (a.loss is None or a.loss == pytest.approx(b.loss, abs=atol))


def _backend(kind, emb, k):
    if kind == "chunked":
        return ChunkedGallery(emb, "text", k=k, chunk_size=16)
    if kind == "faiss_flat":
        return FaissGallery.build(emb, "text", index="flat", k=k)
    return FaissGallery.build(emb, "text", index="ivf", k=k, nlist=4, nprobe=2)


def _make(kind, k):
    return lambda g: _backend(kind, g.embeddings, k)


# ------------------------------------------------------------------------------------------------ (a) runs everywhere
@pytest.mark.parametrize("kind", ["chunked", "faiss_flat", "faiss_ivf"])
@pytest.mark.parametrize("objective", OBJECTIVES)
def test_objective_runs_on_topk_backend(objective, kind):
    tta, outs = _stream(objective, _make(kind, 5))
    for out in outs:
        assert out.scores is None and out.topk.values.shape == (B, 5)
        assert ((out.topk.indices >= 0) & (out.topk.indices < N)).all()
        assert (out.topk.values[:, :-1] >= out.topk.values[:, 1:]).all()
        if objective != "dn":
            assert out.num_updates > 0 and out.loss is not None
    per_item = {"eata": "model_probs", "titan": "match_counts"}
    if objective in per_item:  # a dense vector over the whole gallery, not over the candidates
        assert tta.state[per_item[objective]].shape == (N,)
    if objective == "titan":  # every query's top-1 of step 0 counted once, by global index
        assert int(tta.state["match_counts"].sum()) == BATCHES * B
    if objective == "cliptta":
        assert ((tta.state["memory_label"] >= 0) & (tta.state["memory_label"] < N)).all()


def test_every_objective_declares_a_gallery_access():
    from hf_tta.objectives.base import GALLERY_ACCESS, OBJECTIVES, Objective, register_objective

    declared = {name: cls.gallery_access for name, cls in OBJECTIVES.items()}
    assert set(declared.values()) <= set(GALLERY_ACCESS) and "full" not in declared.values()
    assert {declared[o] for o in OBJECTIVES_STATS} == {"stats"} and {declared[o] for o in OBJECTIVES_ITEM} == {"per_item"}
    with pytest.raises(ValueError, match="gallery_access must be one of"):
        register_objective("bad_access_objective", OBJECTIVES["tent"].config_class)(
            type("Bad", (Objective,), {"gallery_access": "whole"})
        )
    assert "bad_access_objective" not in OBJECTIVES


def test_full_access_is_still_refused():
    """No built-in objective needs every item at every step any more; one that declares it is refused."""
    tta = _wrapper("tent")
    tta.objective.gallery_access = "full"
    with pytest.raises(ValueError, match="every gallery item's score at every step"):
        tta.adapt_step(_batches(1)[0], ChunkedGallery(_gallery_embeddings(), "text"))


# ------------------------------------------------------------------------------------------------ (b) exact = dense
@pytest.mark.parametrize(
    "objective,k,cfg",
    [
        ("rest", 10, {}),  # REST's K = 10: top-1, sample negatives and centroids all exact
        ("rest", 10, {"gradient_decoupling": True}),  # the source model's scores include the centroid columns
        ("rest", N, {}),
        ("dn", 5, {}),  # DN searches its shifted queries: exact at any k
        ("dn", 5, {"objective_config": {"gallery_mean": "all", "query_mean": "running"}}),
        ("tcr", 5, {"score_transform": "dn"}),
        ("titan", B, {}),  # k > B - 1: the rematched pseudo-match is always among the candidates
        ("eata", N, {}),  # a softmax over the candidates: the dense one when they are the whole gallery
        ("cliptta", N, {}),
        ("cliptta", N, {"objective_config": {"open_set": True}}),
    ],
)
@pytest.mark.parametrize("kind", ["chunked", "faiss_flat"])
def test_exact_backend_equals_dense(objective, k, cfg, kind):
    dense_tta, dense = _stream(objective, lambda g: g, **cfg)
    tta, outs = _stream(objective, _make(kind, k), **cfg)
    _assert_topk_equals_dense(dense, outs)
    for name, p in tta.params.items():
        torch.testing.assert_close(p, dense_tta.params[name], rtol=0, atol=1e-5)
    if objective == "eata":
        torch.testing.assert_close(tta.state["model_probs"], dense_tta.state["model_probs"], rtol=0, atol=1e-6)
    if objective in ("titan", "cliptta"):
        key = "match_counts" if objective == "titan" else "memory_label"
        assert torch.equal(tta.state[key], dense_tta.state[key])


def test_softmax_objectives_approach_dense_with_small_k():
    """EATA and ClipTTA at k < N take their softmax over the candidates: close to, not equal to, the dense run."""
    for objective in ("eata", "cliptta"):
        _, dense = _stream(objective, lambda g: g)
        _, outs = _stream(objective, _make("chunked", 5))
        _assert_topk_equals_dense(dense, outs, atol=1e-3)


def test_eata_redundancy_over_candidates_is_the_dense_cosine():
    """The candidates' prediction is an N-vector that is zero outside them: its cosine with the dense average and the
    scattered update equal the dense computation on that N-vector."""
    gen = torch.Generator().manual_seed(0)
    cols = torch.tensor([1, 4, 5, 8])
    logits = torch.randn(6, 4, generator=gen) * 3
    avg = torch.rand(10, generator=gen).softmax(0)
    padded = torch.full((6, 10), -1e4).index_copy(1, cols, logits)  # probability exactly 0 outside the candidates
    kept = []
    for d in (0.1, 0.2, 0.3, 0.4, 0.6):
        got = eata_selection(logits, avg, 0.9, d, columns=cols)
        ref = eata_selection(padded, avg, 0.9, d)
        assert torch.equal(got[2], ref[2]) and torch.allclose(got[0], ref[0])
        kept.append(int(got[2].sum()))
    assert len(set(kept)) > 1, kept  # the threshold decided something
    new = logits.softmax(1)
    torch.testing.assert_close(
        update_model_probs(avg, new, 0.9, cols, 10), update_model_probs(avg, padded.softmax(1), 0.9), rtol=0, atol=1e-7
    )


# ------------------------------------------------------------------------------------------------ (c) statistics
def _count_passes(gallery):
    calls = []
    inner = gallery.iter_blocks

    def counted(*args, **kwargs):
        calls.append(1)
        return inner(*args, **kwargs)

    gallery.iter_blocks = counted
    return calls


@pytest.mark.parametrize("kind", ["chunked", "faiss_flat"])
def test_statistics_computed_once_and_equal_dense(kind, tmp_path):
    emb = _gallery_embeddings()
    gallery = _backend(kind, emb, 10)
    passes = _count_passes(gallery)
    tta = _wrapper("rest")
    for batch in _batches():
        tta.adapt_step(batch, gallery)
    after_first = len(passes)
    assert after_first > 0
    dn = _wrapper("dn", objective_config={"gallery_mean": "all"})
    for batch in _batches():
        dn.adapt_step(batch, gallery)
        tta.adapt_step(batch, gallery)
    assert len(passes) == after_first + 1  # REST's k-means once; DN's mean and fingerprint in one more pass
    km = gallery.kmeans(10, 50, 0)
    assert len(passes) == after_first + 1  # cached
    # the dense path's k-means (the same code on the same blocks): bit-identical
    centroids, labels = spherical_kmeans(emb, 10, torch.Generator().manual_seed(0), 50)
    assert torch.equal(km.labels, labels) and torch.equal(km.centroids, centroids)
    assert torch.equal(km.counts, torch.bincount(labels, minlength=10))
    st = gallery.statistics()
    torch.testing.assert_close(st.mean, emb.mean(0), rtol=0, atol=1e-7)
    torch.testing.assert_close(st.fingerprint, gallery_fingerprint(emb), rtol=1e-12, atol=1e-9)
    # saved beside the backend and read back: no pass at all after load
    gallery.save(tmp_path)
    assert (tmp_path / "gallery_stats.safetensors").exists()
    again = type(gallery).load(tmp_path)
    passes2 = _count_passes(again)
    assert torch.equal(again.kmeans(10, 50, 0).centroids, km.centroids)
    assert torch.equal(again.statistics().mean, st.mean) and passes2 == []
    # a gallery saved without statistics over that folder removes the stale file
    fresh = _backend(kind, emb[:30], 10)
    fresh.save(tmp_path)
    assert not (tmp_path / "gallery_stats.safetensors").exists()


def test_chunked_fp16_mmap_statistics_and_move(tmp_path):
    emb = _gallery_embeddings()
    gal = ChunkedGallery(emb.half(), "text", chunk_size=7)
    gal.save(tmp_path)
    mapped = ChunkedGallery.load(tmp_path, mmap=True)
    ref = emb.half().float()
    torch.testing.assert_close(mapped.statistics().mean, ref.mean(0), rtol=0, atol=1e-7)
    assert torch.equal(mapped.kmeans(4, 20, 3).labels, spherical_kmeans(ref, 4, torch.Generator().manual_seed(3), 20)[1])
    moved = gal.to("cpu")
    gal.statistics()
    assert "statistics" not in moved._stats_cache()  # computed after the move: not shared
    assert gal.to("cpu").statistics() is gal.statistics()  # carried over by a later move


def test_saved_statistics_of_another_gallery_are_refused(tmp_path):
    emb = _gallery_embeddings()
    big = ChunkedGallery(emb, "text")
    big.statistics()
    tensors = big.statistics_tensors()
    with pytest.raises(ValueError, match="another gallery"):
        ChunkedGallery(emb[:10], "text").load_statistics_tensors(tensors)


def test_weighted_draw_beyond_multinomial_limit(monkeypatch):
    monkeypatch.setattr(gallery_stats, "_MULTINOMIAL_MAX", 4)
    w = torch.tensor([0.0, 0.0, 3.0, 0.0, 1.0, 0.0], dtype=torch.float64)
    gen = torch.Generator().manual_seed(0)
    draws = [gallery_stats._weighted_draw(w, gen) for _ in range(400)]
    assert set(draws) == {2, 4} and 0.65 < draws.count(2) / 400 < 0.85


@pytest.mark.parametrize("objective", ["rest", "eata", "titan", "cliptta", "dn"])
def test_resumed_stream_on_backend_is_bit_identical(objective, tmp_path):
    emb = _gallery_embeddings()
    batches = _batches(4)
    tta = _wrapper(objective)
    gallery = ChunkedGallery(emb, "text", k=8)
    for b in batches[:2]:
        tta.adapt_step(b, gallery)
    tta.save_pretrained(tmp_path)
    rest = [tta.adapt_step(b, gallery) for b in batches[2:]]
    resumed = TTAWrapper.from_pretrained(make_model("clip"), tmp_path)
    gallery2 = ChunkedGallery(emb, "text", k=8)  # a fresh backend: its statistics are recomputed from the seed
    for a, b in zip(rest, [resumed.adapt_step(b, gallery2) for b in batches[2:]]):
        assert torch.equal(a.topk.indices, b.topk.indices) and torch.equal(a.topk.values, b.topk.values)
    tta.reset()
    fresh = _wrapper(objective)
    assert tta.state.keys() == fresh.state.keys()
    assert all(torch.equal(tta.state[k], fresh.state[k]) for k in fresh.state)
    assert all(torch.equal(p, tta.source_parameters()[n]) for n, p in tta.params.items())


# ------------------------------------------------------------------------------------------------ sharded (2 processes)
SHARD = 31  # rows 0..30 on rank 0, 31..59 on rank 1


def _sharded_worker(rank: int, world: int, init_file: str, out_dir: str) -> None:
    import torch.distributed as dist

    from hf_tta.gallery import ShardedGallery

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        emb = _gallery_embeddings()
        local = emb[:SHARD] if rank == 0 else emb[SHARD:]
        out = {}
        for objective in OBJECTIVES:
            gallery = ShardedGallery(ChunkedGallery(local, "text", k=10, chunk_size=8))
            tta = _wrapper(objective)
            for i, b in enumerate(_batches()):
                res = tta.adapt_step(b, gallery)
                out[f"{objective}.{i}.values"], out[f"{objective}.{i}.indices"] = res.topk.values, res.topk.indices
        km = gallery.kmeans(10, 50, 0)
        out.update(mean=gallery.statistics().mean, fingerprint=gallery.statistics().fingerprint, labels=km.labels,
                   centroids=km.centroids)
        save_file({k: v.contiguous() for k, v in out.items()}, os.path.join(out_dir, f"rank{rank}.safetensors"))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def sharded_outputs(tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("sharded")
    mp.spawn(_sharded_worker, args=(2, str(out_dir / "init"), str(out_dir)), nprocs=2, join=True)
    return [load_file(os.path.join(out_dir, f"rank{r}.safetensors")) for r in (0, 1)]


def test_sharded_statistics_equal_dense(sharded_outputs):
    emb = _gallery_embeddings()
    centroids, labels = spherical_kmeans(emb, 10, torch.Generator().manual_seed(0), 50)
    for got in sharded_outputs:
        torch.testing.assert_close(got["mean"], emb.mean(0), rtol=0, atol=1e-7)
        torch.testing.assert_close(got["fingerprint"], gallery_fingerprint(emb), rtol=1e-12, atol=1e-9)
        assert torch.equal(got["labels"], labels)
        torch.testing.assert_close(got["centroids"], centroids, rtol=0, atol=1e-6)


@pytest.mark.parametrize("objective", OBJECTIVES)
def test_sharded_backend_equals_one_process(sharded_outputs, objective):
    """Every objective on a gallery sharded across 2 processes equals the single-process chunked run (same k)."""
    _, outs = _stream(objective, _make("chunked", 10))
    for i, out in enumerate(outs):
        for got in sharded_outputs:
            assert torch.equal(got[f"{objective}.{i}.indices"], out.topk.indices)
            torch.testing.assert_close(got[f"{objective}.{i}.values"], out.topk.values, rtol=0, atol=1e-5)
