"""OnlineRetriever: sync mode equals adapt_step with scoring="before_update" (with DN, the recommended preset and a
top-k backend); answers under concurrency are each one published state's answer (dense, and a top-k backend changing
meanwhile); answers leave the published state as it was; tenants route to domains; a LiveGallery and a live top-k
backend answer with external ids; save/resume equals the uninterrupted stream; refusals."""

from __future__ import annotations

import threading
import time

import pytest
import torch
import torch.nn.functional as F

from hf_tta import RunConfig, TTAConfig, TTAWrapper
from hf_tta.gallery import ChunkedGallery, FaissGallery, GalleryCache, ShardedGallery
from hf_tta.gallery.live import LiveGallery
from hf_tta.routing import RoutedTTAWrapper
from hf_tta.serving import OnlineRetriever, captured_fingerprint, frozen_copy, state_fingerprint
from hf_tta.state import ALL, AdapterState
from support import QUIET, dense_gallery, image_stream
from tiny_models import batch, make_model

B = 8
CONFIGS = {
    "tcr": {}, "eata": dict(objective="eata"), "tcr+safety": dict(safety=QUIET), "tcr+dn": dict(score_transform="dn"),
    "recommended": None,
}


def config(**kw) -> TTAConfig:
    return TTAConfig(**{"objective": "tcr", "query_modality": "image", "lr": 1e-2, **kw})


def named_config(name: str, **kw) -> TTAConfig:
    return TTAConfig.recommended("image", **kw) if CONFIGS[name] is None else config(**CONFIGS[name], **kw)


def split(queries: dict, sizes: list[int]) -> list[dict]:
    out, start = [], 0
    for n in sizes:
        out.append({k: v[start : start + n] for k, v in queries.items()})
        start += n
    return out


def backend_of(kind: str, emb: torch.Tensor, ids, k: int):
    if kind == "chunked":
        return ChunkedGallery(emb.clone(), "text", k=k, chunk_size=7, ids=ids)
    pytest.importorskip("faiss")
    return FaissGallery.build(emb.clone(), "text", index="flat", k=k, ids=ids)


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("pieces", [[B], [3, 5], [1] * B], ids=["whole", "3+5", "ones"])
def test_sync_equals_before_update(name, pieces):
    gallery, stream = dense_gallery(), image_stream(4, size=B)
    ref = TTAWrapper(make_model("clip"), named_config(name, run=RunConfig(scoring="before_update")))
    online = OnlineRetriever(TTAWrapper(make_model("clip"), named_config(name)), gallery, batch_size=B, mode="sync")
    versions = []
    for x in stream:
        before = frozen_copy(ref)
        expected = ref.adapt_step(x, gallery).scores
        parts = split(x, pieces)
        answers = [online.search(piece, k=5) for piece in parts]
        got = torch.cat([a.scores for a in answers])
        if len(pieces) == 1:  # the same forward: bit for bit
            assert torch.equal(got, expected)
            assert torch.equal(torch.cat([a.ids for a in answers]), expected.topk(5, dim=1).indices)
        else:  # each search is answered as adapt_step answers it as a batch of its own
            for piece, answer in zip(parts, answers):
                assert torch.equal(answer.scores, frozen_copy(before).adapt_step(piece, gallery).scores)
            if named_config(name).score_transform is None:  # no batch statistic in the answer: the rows are the batch's
                torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)  # CPU kernels round the last bit by size
        versions.append({a.version for a in answers})
    assert versions == [{0}, {1}, {2}, {3}]  # each batch answered by the state before it
    assert online.stats()["batches_adapted"] == 4 and online.stats()["pending"] == 0
    assert AdapterState.capture(online.wrapper, ALL).equals(AdapterState.capture(ref, ALL))  # DN's query mean too
    assert ref.batch_index == online.wrapper.batch_index == 4
    assert online.stats()["safety_counts"] == ref.safety_counts


@pytest.mark.parametrize("name", ["tcr", "tcr+dn", "recommended"])
def test_sync_equals_before_update_topk_backend(name):
    emb = dense_gallery().embeddings
    backend = backend_of("chunked", emb, ids=range(1000, 1040), k=5)
    ref = TTAWrapper(make_model("clip"), named_config(name, run=RunConfig(scoring="before_update")))
    online = OnlineRetriever(TTAWrapper(make_model("clip"), named_config(name)), backend, batch_size=B, mode="sync")
    for i, x in enumerate(image_stream(4, size=B)):
        expected = ref.adapt_step(x, backend).topk
        got = online.search(x, k=5)
        assert got.scores is None and got.version == i and got.gallery_version == backend.version == 0
        assert torch.equal(got.values, expected.values)
        assert torch.equal(got.ids, backend.to_ids(expected.indices))  # external ids of adapt_step's gallery positions
    assert AdapterState.capture(online.wrapper, ALL).equals(AdapterState.capture(ref, ALL))
    assert online.stats()["safety_counts"] == ref.safety_counts


def test_frozen_copy_shares_frozen_tensors_and_answers_alike():
    tta = TTAWrapper(make_model("clip"), config())
    gallery = dense_gallery()
    tta.adapt_step(batch("image", B, 1), gallery)
    copy_ = frozen_copy(tta)
    mine = {id(p) for p in tta.model.parameters()}
    shared = [p for p in copy_.model.parameters() if id(p) in mine]
    assert shared and all(not p.requires_grad for p in shared)
    assert not any(id(p) in mine for _, p in copy_.named_optimized_parameters())
    q = batch("image", 4, 9)
    assert torch.equal(copy_.embed_and_score(q, gallery)[1], tta.embed_and_score(q, gallery)[1])
    before = state_fingerprint(copy_)
    tta.adapt_step(batch("image", B, 2), gallery)  # the copy is not touched by later adaptation
    assert state_fingerprint(copy_) == before != state_fingerprint(tta)
    # a captured state's fingerprint is its wrapper's (the published versions log either)
    assert captured_fingerprint(AdapterState.capture(tta, ALL)) == state_fingerprint(tta)
    assert captured_fingerprint(AdapterState.capture(copy_, ALL)) == before


def _scores(online, published, queries, gallery):
    """The scores the state ``published`` gives ``queries`` (a reader holding it)."""
    with online.reading(published) as reader:
        return reader.embed_and_score(queries, gallery)[1]


def test_background_answers_are_each_one_published_state():
    gallery = dense_gallery()
    published = {}
    online = OnlineRetriever(
        TTAWrapper(make_model("clip"), config(lr=5e-2)), gallery, batch_size=4, max_wait=0.01,
        on_publish=lambda p: published.setdefault(p.version, p),
    )
    published[0] = online.published
    answers, errors = [], []

    def client(seed: int) -> None:
        try:
            for i in range(200):
                q = batch("image", 1 + (i % 2), seed * 1000 + i)
                answers.append((q, online.search(q, k=3)))
                if len(published) >= 6 and i >= 10:
                    return
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=client, args=(s,)) for s in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    online.close()
    assert not errors and online.error is None
    assert len(published) >= 3, "the worker published too few states for the test to mean anything"
    probe = batch("image", 2, 77)
    probes = {v: _scores(online, p, probe, gallery) for v, p in published.items()}
    assert len({tuple(p.flatten().tolist()) for p in probes.values()}) == len(probes)  # the versions differ
    for q, res in answers:
        matches = [v for v, p in published.items() if torch.allclose(res.scores, _scores(online, p, q, gallery), rtol=0, atol=1e-6)]
        assert res.version in matches, (res.version, matches)
    assert len({res.version for _, res in answers}) >= 2  # answers really were served from several states


def test_background_topk_answers_are_each_one_published_state_and_gallery_version():
    emb = dense_gallery().embeddings
    backend = backend_of("chunked", emb, ids=range(1000, 1040), k=5)
    contents = {0: (backend.ids, emb.clone())}  # gallery version -> (ids, rows)
    published = {}
    online = OnlineRetriever(
        TTAWrapper(make_model("clip"), config(lr=5e-2, score_transform="dn")), backend, batch_size=4, max_wait=0.01,
        on_publish=lambda p: published.setdefault(p.version, p),
    )
    published[0] = online.published
    answers, errors, done = [], [], threading.Event()

    def client(seed: int) -> None:
        try:
            for i in range(200):
                q = batch("image", 1 + (i % 2), seed * 1000 + i)
                answers.append((q, online.search(q, k=3)))
                if len(published) >= 6 and len(contents) >= 4 and i >= 10:
                    return
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    def writer() -> None:  # the only writer: after each change the backend holds what it records
        gen = torch.Generator().manual_seed(5)
        for j in range(60):
            if done.is_set():
                return
            if j % 3 == 2:
                backend.remove([2000 + j - 1])
            else:
                backend.add([2000 + j], F.normalize(torch.randn(1, emb.shape[1], generator=gen), dim=1))
            with backend.reading():
                contents[backend.version] = (backend.ids, backend.embeddings.clone())
            time.sleep(0.01)

    threads = [threading.Thread(target=client, args=(s,)) for s in range(3)]
    changer = threading.Thread(target=writer)
    for t in [*threads, changer]:
        t.start()
    for t in threads:
        t.join()
    done.set()
    changer.join()
    online.close()
    assert not errors and online.error is None
    assert len(published) >= 3, "the worker published too few states for the test to mean anything"
    for q, res in answers:  # the dense answer of the state and gallery version it names, in that version's ids
        ids, rows = contents[res.gallery_version]
        with online.reading(published[res.version]) as reader:
            scores = reader.answer(q, GalleryCache(rows, "text")).scores
        match = res.ids[..., None] == ids  # (B, k, N): where each answered id is in that version
        assert res.scores is None and bool(match.any(-1).all()), (res.version, res.gallery_version)
        torch.testing.assert_close(res.values, scores.topk(3, dim=1).values, rtol=0, atol=1e-5)  # the best 3 scores
        torch.testing.assert_close(res.values, scores.gather(1, match.int().argmax(-1)), rtol=0, atol=1e-5)  # of these ids
    assert len({res.version for _, res in answers}) >= 2 and len({res.gallery_version for _, res in answers}) >= 2


def test_answers_leave_the_published_state_unchanged():
    gallery = dense_gallery()  # DN's gallery mean of 10 sampled items: each answer draws them with a copy of the RNG
    tta = TTAWrapper(make_model("clip"), config(score_transform="dn", score_transform_config={"num_samples": 10}))
    online = OnlineRetriever(tta, gallery, batch_size=B, mode="sync")
    published, before = online.published, online.published.state.copy()
    first = [online.search(q, k=3) for q in image_stream(3, size=2)]
    assert {a.version for a in first} == {0} and online.published is published and before.equals(published.state)
    again = online.search(image_stream(1, size=2)[0], k=3)  # the same queries, the same state: the same answer
    assert torch.equal(again.scores, first[0].scores)
    with pytest.raises(TypeError, match="use answer"):
        tta.embed_and_score(batch("image", 1), backend_of("chunked", gallery.embeddings, None, k=3))


def test_background_adapts_after_max_wait_and_flush():
    gallery = dense_gallery()
    with OnlineRetriever(TTAWrapper(make_model("clip"), config()), gallery, batch_size=64, max_wait=0.02) as online:
        online.search(batch("image", 3, 1))
        deadline = time.monotonic() + 30
        while online.stats()["batches_adapted"] < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        stats = online.stats()
        assert stats["batches_adapted"] == 1 and stats["queries_adapted"] == 3 and stats["pending"] == 0
        assert stats["version"] == 1 and online.wrapper.batch_index == 1
    sync = OnlineRetriever(TTAWrapper(make_model("clip"), config()), gallery, batch_size=4, mode="sync")
    for i in range(3):
        sync.search(batch("image", 3, i))  # 9 queries: 2 batches of 4 inline, 1 buffered
    assert sync.stats()["batches_adapted"] == 2 and sync.stats()["pending"] == 1
    assert sync.flush() == 1 and sync.stats()["pending"] == 0 and sync.wrapper.batch_index == 3


def test_tenants_route_to_domains():
    gallery = dense_gallery()
    ref = RoutedTTAWrapper(make_model("clip"), config())
    online = OnlineRetriever(RoutedTTAWrapper(make_model("clip"), config()), gallery, batch_size=B, mode="sync")
    keys = ["a"] * 4 + ["b"] * 4
    for i, x in enumerate(image_stream(3, size=B)):
        expected = ref.embed_and_score(x, gallery, domain=keys)[1]
        got = torch.cat([online.search(x_, tenant=keys[j * 4]).scores for j, x_ in enumerate(split(x, [4, 4]))])
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)  # 4-query forwards vs one of 8 (last bit)
        ref.adapt_step(x, gallery, domain=keys)
    assert online.wrapper.domain_keys == ref.domain_keys == ["a", "b"]
    for key in ("a", "b"):
        assert online.wrapper.domain_state(key).equals(ref.domain_state(key))
    assert not torch.equal(*(torch.cat(list(ref.domain_parameters(k).values())) for k in ("a", "b")))
    with pytest.raises(ValueError, match="tenant, or none"):
        online.search(batch("image", 1), tenant=None)
    fresh = OnlineRetriever(RoutedTTAWrapper(make_model("clip"), config()), gallery, batch_size=B, mode="sync")
    with pytest.raises(ValueError):  # a refused first search fixes nothing
        fresh.search({"pixel_values": torch.full((1, 3, 32, 32), float("nan"))}, tenant="a")
    assert fresh.search(batch("image", 1)).version == 0 and fresh.stats()["pending"] == 1


@pytest.mark.parametrize("kind", ["dense", "chunked"])
def test_sync_routed_with_dn_equals_before_update(kind):
    gallery = dense_gallery() if kind == "dense" else backend_of(kind, dense_gallery().embeddings, range(1000, 1040), k=5)
    ref = RoutedTTAWrapper(make_model("clip"), config(score_transform="dn", run=RunConfig(scoring="before_update")))
    online = OnlineRetriever(RoutedTTAWrapper(make_model("clip"), config(score_transform="dn")), gallery, batch_size=B, mode="sync")
    keys = ["a"] * 3 + ["b"] * 5  # "a": 3 queries < min_domain_batch, scored and not adapted; each its own DN state
    for x in image_stream(3, size=B):
        expected = ref.adapt_step(x, gallery, domain=keys)
        got = online.search(x, k=5, tenant=keys)
        if kind == "dense":
            assert torch.equal(got.scores, expected.scores)
        else:
            assert torch.equal(got.values, expected.topk.values) and torch.equal(got.ids, gallery.to_ids(expected.topk.indices))
    for key in ("a", "b"):
        assert online.wrapper.domain_state(key).equals(ref.domain_state(key))


def test_live_gallery_answers_external_ids():
    emb = dense_gallery(n=10).embeddings
    live = LiveGallery(emb, "text", ids=list(range(100, 110)))
    online = OnlineRetriever(TTAWrapper(make_model("clip"), config()), live, batch_size=4, mode="sync")
    q = batch("image", 2, 5)
    first = online.search(q, k=10)
    assert set(first.ids.flatten().tolist()) <= set(range(100, 110)) and first.gallery_version == 0
    best = int(first.ids[0, 0])
    live.remove([best])
    live.add([500], first.scores.new_zeros(1, emb.shape[1]) + emb[best - 100])  # the removed item's vector, new id
    second = online.search(q, k=10)
    assert best not in second.ids.tolist()[0] and int(second.ids[0, 0]) == 500
    assert second.gallery_version == live.version and torch.equal(second.values[0, 0], first.values[0, 0])
    online.flush()  # adapts against the current snapshot


@pytest.mark.parametrize("kind", ["chunked", "faiss_flat"])
def test_live_topk_backend_answers_new_external_ids(kind):
    emb = dense_gallery(n=10).embeddings
    backend = backend_of(kind, emb, ids=range(100, 110), k=4)
    online = OnlineRetriever(TTAWrapper(make_model("clip"), config(score_transform="dn")), backend, batch_size=B, mode="sync")
    q = batch("image", 2, 5)
    first = online.search(q, k=4)
    assert first.scores is None and first.ids.shape == (2, 4) and first.gallery_version == 0
    assert set(first.ids.flatten().tolist()) <= set(range(100, 110))
    best = int(first.ids[0, 0])
    backend.remove([best])
    backend.add([500], emb[best - 100][None].clone())  # the removed item's vector, under a new id
    second = online.search(q, k=4)
    assert second.gallery_version == backend.version == 2 and second.version == 0
    assert best not in second.ids.flatten().tolist() and int(second.ids[0, 0]) == 500
    torch.testing.assert_close(second.values, first.values, rtol=0, atol=1e-6)  # the same vectors, reordered
    assert torch.equal(online.search(q, k=2).ids, second.ids[:, :2])  # a smaller k: the first columns
    with pytest.raises(ValueError, match="build the backend with k >= 5"):
        online.search(q, k=5)
    assert online.flush() == 1 and online.search(q, k=4).version == 1  # adapted on the changed backend


@pytest.fixture
def one_process_group(tmp_path):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'group'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_sharded_backend_answers_in_sync_mode_only(one_process_group):
    emb = dense_gallery().embeddings
    sharded = ShardedGallery(backend_of("chunked", emb, ids=range(1000, 1040), k=5))
    chunked = backend_of("chunked", emb, ids=range(1000, 1040), k=5)
    with pytest.raises(ValueError, match="mode='sync'"):
        OnlineRetriever(TTAWrapper(make_model("clip"), config()), sharded)
    online = {g: OnlineRetriever(TTAWrapper(make_model("clip"), config(score_transform="dn")), g, batch_size=B, mode="sync")
              for g in (sharded, chunked)}
    for x in image_stream(3, size=B):
        a, b = (online[g].search(x, k=5) for g in (sharded, chunked))
        assert torch.equal(a.ids, b.ids) and torch.equal(a.values, b.values) and a.version == b.version
    assert online[sharded].published.fingerprint == online[chunked].published.fingerprint


def test_checkpoint_resume_equals_uninterrupted(tmp_path):
    gallery, stream = dense_gallery(), image_stream(6, size=B)
    whole = OnlineRetriever(TTAWrapper(make_model("clip"), config(safety=QUIET)), gallery, batch_size=B, mode="sync")
    full = [whole.search(x).scores for x in stream]
    first = OnlineRetriever(TTAWrapper(make_model("clip"), config(safety=QUIET)), gallery, batch_size=B, mode="sync")
    for x in stream[:3]:
        first.search(x)
    assert first.checkpoint(tmp_path / "ckpt") == 0
    resumed = OnlineRetriever(TTAWrapper.from_pretrained(make_model("clip"), tmp_path / "ckpt"), gallery, batch_size=B, mode="sync")
    for expected, x in zip(full[3:], stream[3:]):
        assert torch.equal(resumed.search(x).scores, expected)
    assert AdapterState.capture(whole.wrapper, ALL).equals(AdapterState.capture(resumed.wrapper, ALL))
    assert resumed.published.fingerprint == whole.published.fingerprint
    first.search(batch("image", 3, 1))
    assert first.checkpoint(tmp_path / "ckpt") == 3  # buffered queries are reported, not saved


def test_refusals():
    gallery = dense_gallery()
    tta = TTAWrapper(make_model("clip"), config())
    with pytest.raises(ValueError, match="mode"):
        OnlineRetriever(tta, gallery, mode="later")
    with pytest.raises(ValueError, match="batch_size"):
        OnlineRetriever(tta, gallery, batch_size=0)
    with pytest.raises(ValueError, match="max_wait"):
        OnlineRetriever(tta, gallery, max_wait=0)
    with pytest.raises(TypeError, match="LiveGallery"):
        OnlineRetriever(tta, [1, 2], mode="sync")
    online = OnlineRetriever(tta, gallery, batch_size=4, mode="sync")
    with pytest.raises(ValueError, match="RoutedTTAWrapper"):
        online.search(batch("image", 1), tenant="a")
    with pytest.raises(ValueError, match="k="):
        online.search(batch("image", 1), k=0)
    with pytest.raises(TypeError, match="dict of tensors"):
        online.search(torch.zeros(1, 3, 32, 32))
    online.search(batch("image", 1))
    with pytest.raises(ValueError, match="padding='max_length'"):
        online.search({"pixel_values": torch.zeros(1, 3, 16, 16)})
    assert online.stats()["pending"] == 1 and online.stats()["queries_answered"] == 1  # refusals left no trace


@pytest.mark.parametrize("mode", ["sync", "background"])
def test_a_closed_retriever_refuses_to_answer_or_buffer_in_one_line(mode):
    """Before: search() after close() answered and buffered without bound (nothing adapts any more)."""
    online = OnlineRetriever(TTAWrapper(make_model("clip"), config()), dense_gallery(), batch_size=B, mode=mode)
    online.search(batch("image", 2, 1))
    online.close()
    before, stats = online.published.state.copy(), online.stats()
    with pytest.raises(ValueError, match="closed: build a new OnlineRetriever") as err:
        online.search(batch("image", 2, 2))
    assert "\n" not in str(err.value) and before.equals(online.published.state)
    assert online.stats()["pending"] == stats["pending"] == 2 and online.stats()["queries_answered"] == 2
