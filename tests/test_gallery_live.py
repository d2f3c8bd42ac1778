"""A live index: add / remove / replace with stable external ids on every backend (chunked, FAISS flat / IVF / HNSW,
sharded over 2 gloo processes) and on the dense LiveGallery, checked against a gallery rebuilt from scratch; refused
changes leave everything unchanged; ids survive save/load; answers stay exact while another thread changes the
gallery; objective state derived from the gallery follows the change (REST, DN, TITAN, ClipTTA, EATA). Kinds ending in
``_mv`` hold multi-vector items ``(N, Q, D)`` (BLIP-2's query tokens), checked against the adapter's max-over-vectors
score and the single-vector view of the items."""

from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from hf_tta.gallery import ChunkedGallery, FaissGallery, GalleryCache, GalleryChange, IdMap, LiveGallery
from hf_tta.gallery.cache import single_vector
from hf_tta.models.base import ModelAdapter
from hf_tta.objectives import build_objective
from hf_tta.objectives.base import ObjectiveInputs, gallery_fingerprint
from support import gloo_worker

D = 16
Q = 3  # vectors per item of the multi-vector kinds


def unit(n, d=D, seed=0, q=None):
    shape = (n, d) if q is None else (n, q, d)
    return F.normalize(torch.randn(shape, generator=torch.Generator().manual_seed(seed)), dim=-1)


class Reference:
    """What the gallery should hold: ids in position order and their rows (the rules of hf_tta.gallery.ids)."""

    def __init__(self, ids, emb):
        self.ids, self.emb = list(ids), emb.clone()
        self.q = emb.shape[1] if emb.dim() == 3 else None

    def new(self, n, seed=0, d=D):
        """``n`` new items of this gallery's item shape."""
        return unit(n, d, seed, self.q)

    @property
    def single(self):
        """The single-vector view of the items (what the statistics are of)."""
        return single_vector(self.emb)

    def add(self, ids, emb):
        self.ids += list(ids)
        self.emb = torch.cat([self.emb, emb])

    def remove(self, ids):
        keep = [i not in set(ids) for i in self.ids]
        self.ids = [i for i, k in zip(self.ids, keep) if k]
        self.emb = self.emb[torch.tensor(keep)]

    def replace(self, ids, emb):
        for i, row in zip(ids, emb):
            self.emb[self.ids.index(i)] = row

    def topk(self, q, k):
        v, cols = ModelAdapter.score(q, self.emb).sort(dim=1, descending=True, stable=True)
        return v[:, :k], torch.tensor(self.ids)[cols[:, :k]]


EXACT = ["chunked", "chunked_ids", "faiss_flat", "faiss_flat_ids", "faiss_ivf", "faiss_ivf_ids"]
EXACT += [f"{k}_mv" for k in EXACT]


def make_backend(kind: str, emb: torch.Tensor, ids=None):
    ids = ids if "_ids" in kind else None
    if kind.startswith("chunked"):
        return ChunkedGallery(emb, "text", k=5, chunk_size=7, ids=ids)
    if kind.startswith("faiss_flat"):
        return FaissGallery.build(emb, "text", index="flat", k=5, ids=ids)
    if kind.startswith("faiss_ivf"):  # nprobe = nlist: every list is visited, so the search is exact
        return FaissGallery.build(emb, "text", index="ivf", nlist=4, nprobe=4, k=5, ids=ids)
    return FaissGallery.build(emb, "text", index="hnsw", k=5, ids=ids)


def start(kind, n=40, seed=0):
    emb = unit(n, seed=seed, q=Q if kind.endswith("_mv") else None)
    ids = np.arange(n) * 10 + 7 if "_ids" in kind else np.arange(n)
    return make_backend(kind, emb, ids), Reference(ids.tolist(), emb)


def assert_same(backend, ref: Reference, q=None, k=6):
    assert backend.ids.tolist() == ref.ids and len(backend) == len(ref.ids)
    torch.testing.assert_close(backend.gather(torch.arange(len(ref.ids))), ref.emb, rtol=0, atol=1e-6)
    if q is not None:
        res, (v, i) = backend.search_ids(q, k), ref.topk(q, k)
        assert torch.equal(res.indices, i) and res.version == backend.version
        torch.testing.assert_close(res.values, v, rtol=0, atol=1e-5)


def changes(backend, ref, seed=1):
    """add 3, remove 3 (old and new), replace 2: returns the GalleryChange of each."""
    base = ref.ids
    new_ids, new_emb = [1001, 1002, 1003], ref.new(3, seed=seed)
    out = [backend.add(new_ids, new_emb)]
    ref.add(new_ids, new_emb)
    gone = [base[3], 1002, base[17]]
    out.append(backend.remove(torch.tensor(gone)))
    ref.remove(gone)
    swap, swap_emb = [base[0], 1003], ref.new(2, seed=seed + 1)
    out.append(backend.replace(np.array(swap), swap_emb))
    ref.replace(swap, swap_emb)
    return out


# ------------------------------------------------------------------------------------------------ every backend
@pytest.mark.parametrize("kind", EXACT)
def test_add_remove_replace_equal_a_rebuilt_gallery(kind):
    backend, ref = start(kind)
    q = unit(5, seed=9)
    before = backend.statistics().mean.clone()
    ch = changes(backend, ref)
    assert [c.kind for c in ch] == ["add", "remove", "replace"] and backend.version == 3
    assert ch[0].positions.tolist() == [40, 41, 42] and ch[1].positions.tolist() == [3, 41, 17]
    assert (ch[1].old_size, ch[1].new_size) == (43, 40)
    assert_same(backend, ref, q)
    # statistics were dropped with the old gallery and are those of the new one
    torch.testing.assert_close(backend.statistics().mean, ref.single.mean(0), rtol=0, atol=1e-6)
    torch.testing.assert_close(backend.statistics().fingerprint, gallery_fingerprint(ref.single), rtol=1e-9, atol=1e-6)
    assert not torch.allclose(before, backend.statistics().mean)
    km = backend.kmeans(3, 20, 0)
    assert km.labels.shape == (40,)
    # positions answer in the new order: search -> to_ids equals search_ids
    assert torch.equal(backend.to_ids(backend.search(q, 4).indices), backend.search_ids(q, 4).indices)
    assert backend.positions_of([ref.ids[5], 1003]).tolist() == [5, ref.ids.index(1003)]


@pytest.mark.parametrize("kind", ["chunked", "faiss_flat", "faiss_ivf_ids", "chunked_mv", "faiss_flat_ids_mv"])
def test_statistics_follow_changes_without_a_pass(kind, monkeypatch):
    """Cached mean and fingerprint are updated from the rows that left and came (O(N + M D)), equal to a fresh pass;
    the k-means is dropped and recomputed."""
    from hf_tta.gallery.stats import compute_statistics, tensor_blocks

    backend, ref = start(kind)
    backend.statistics()
    backend.kmeans(3, 10, 0)

    def no_pass(*args, **kwargs):
        raise AssertionError("a pass over the gallery")

    monkeypatch.setattr(backend, "iter_blocks", no_pass)
    changes(backend, ref)
    got = backend.statistics()
    fresh = compute_statistics(tensor_blocks(ref.single), len(ref.ids), D)
    torch.testing.assert_close(got.mean, fresh.mean, rtol=0, atol=1e-7)
    torch.testing.assert_close(got.fingerprint, fresh.fingerprint, rtol=1e-12, atol=1e-9)
    with pytest.raises(AssertionError, match="a pass"):
        backend.kmeans(3, 10, 0)


def test_chunked_never_writes_the_callers_tensor():
    emb = unit(20)
    keep = emb.clone()
    gal = ChunkedGallery(emb, "text")
    gal.replace([0], unit(1, seed=3))
    gal.remove([1, 2])
    gal.add([50], unit(1, seed=4))
    assert torch.equal(emb, keep)
    moved = gal.to("cpu")
    assert moved.ids.tolist() == gal.ids.tolist() and moved.version == gal.version
    before = moved.embeddings.clone()
    gal.replace([0], unit(1, seed=5))  # an in-place change of one copy leaves the other as it was
    assert torch.equal(moved.embeddings, before)


def test_hnsw_adds_but_refuses_removal():
    backend, ref = start("hnsw")
    new = unit(2, seed=5)
    backend.add([500, 501], new)
    assert backend.ids.tolist()[-2:] == [500, 501]
    assert backend.search_ids(new, 1).indices.flatten().tolist() == [500, 501]
    for call in (lambda: backend.remove([500]), lambda: backend.replace([500], unit(1, seed=6))):
        with pytest.raises(ValueError, match="HNSW indexes cannot remove items"):
            call()
    assert len(backend) == 42 and backend.version == 1


BAD = {
    "add an existing id": (lambda b, r: b.add([r.ids[2]], r.new(1, seed=3)), ValueError, "already exist"),
    "add an id twice": (lambda b, r: b.add([900, 900], r.new(2, seed=3)), ValueError, "twice in one call"),
    "add a wrong dimension": (lambda b, r: b.add([900], r.new(1, d=D + 1)), ValueError, r"\(M, (3, )?16\)"),
    "add fewer rows than ids": (lambda b, r: b.add([900, 901], r.new(1)), ValueError, "one id per row"),
    "add NaN": (lambda b, r: b.add([900], r.new(1) * float("nan")), ValueError, "NaN"),
    "add float ids": (lambda b, r: b.add(torch.tensor([9.0]), r.new(1)), TypeError, "must be integers"),
    "remove an unknown id": (lambda b, r: b.remove([r.ids[0], 123456]), ValueError, r"unknown gallery id\(s\) \[123456\]"),
    "remove everything": (lambda b, r: b.remove(r.ids), ValueError, "keeps at least one"),
    "replace an unknown id": (lambda b, r: b.replace([123456], r.new(1)), ValueError, "Cannot replace unknown"),
    "replace a wrong dimension": (lambda b, r: b.replace([r.ids[1]], r.new(1, d=4)), ValueError, "dimension"),
    "add a single vector to a multi-vector gallery or back": (
        lambda b, r: b.add([900], unit(1) if r.q else unit(1, q=Q)), ValueError, "item shape"),
}


@pytest.mark.parametrize("kind", ["chunked", "faiss_flat", "faiss_ivf_ids", "chunked_mv", "faiss_ivf_ids_mv"])
@pytest.mark.parametrize("bad", list(BAD))
def test_refused_changes_leave_the_gallery_unchanged(kind, bad):
    backend, ref = start(kind, n=12)
    call, err, msg = BAD[bad]
    with pytest.raises(err, match=msg) as info:
        call(backend, ref)
    assert "\n" not in str(info.value)
    assert backend.version == 0
    assert_same(backend, ref, unit(3, seed=8), k=4)


def test_a_change_inside_reading_is_refused_not_deadlocked():
    backend, ref = start("chunked", n=8)
    with backend.reading():
        with pytest.raises(RuntimeError, match="inside backend.reading"):
            backend.add([99], unit(1))
    backend.add([99], unit(1))  # the lock is free again
    assert backend.ids.tolist() == [*range(8), 99]


@pytest.mark.parametrize(
    "kind", ["chunked", "chunked_ids", "faiss_flat", "faiss_ivf", "faiss_ivf_ids", "chunked_ids_mv", "faiss_flat_mv", "faiss_ivf_ids_mv"]
)
def test_ids_survive_save_and_load(kind, tmp_path):
    backend, ref = start(kind)
    changes(backend, ref)
    backend.statistics()
    backend.save(tmp_path)
    assert (tmp_path / "gallery_ids.safetensors").exists()
    cls = ChunkedGallery if kind.startswith("chunked") else FaissGallery
    again = cls.load(tmp_path)
    q = unit(5, seed=9)
    assert_same(again, ref, q)
    torch.testing.assert_close(again.statistics().mean, ref.single.mean(0), rtol=0, atol=1e-6)
    again.add([2000], ref.new(1, seed=12))  # the loaded gallery goes on changing
    ref.add([2000], ref.new(1, seed=12))
    assert_same(again, ref, q)
    mapped = cls.load(tmp_path, mmap=True)
    assert mapped.ids.tolist() == ref.ids[:-1]
    with pytest.raises(ValueError, match="read-only: load it with mmap=False"):
        mapped.add([3000], ref.new(1))


def test_unchanged_gallery_saves_no_ids_file(tmp_path):
    backend, _ = start("chunked")
    backend.save(tmp_path)
    assert not (tmp_path / "gallery_ids.safetensors").exists()


# ------------------------------------------------------------------------------------------------ ids and changes
def test_id_map_matches_a_dictionary_through_changes():
    rng = np.random.default_rng(0)
    ids = rng.choice(10**6, 50, replace=False)
    m = IdMap(ids)
    for step in range(20):
        if step % 2:
            m = m.added(m.check_new(rng.choice(np.arange(10**6, 2 * 10**6), 5, replace=False)), at=int(rng.integers(len(m) + 1)))
        else:
            keep = rng.random(len(m)) > 0.2
            m = m.removed(keep)
        truth = {int(i): p for p, i in enumerate(m.ids)}
        probe = np.array(list(truth) + [-5, 3 * 10**6])
        pos, found = m.lookup(probe)
        assert found.tolist() == [True] * len(truth) + [False, False]
        assert pos[: len(truth)].tolist() == list(truth.values())


def test_gallery_change_remaps_by_hand():
    # 6 items, remove positions 1 and 4: 0->0, 2->1, 3->2, 5->3
    rm = GalleryChange("remove", torch.tensor([11, 44]), torch.tensor([1, 4]), 6, 4, 1)
    assert rm.position_map().tolist() == [0, -1, 1, 2, -1, 3]
    assert rm.remap_vector(torch.tensor([10, 11, 12, 13, 14, 15])).tolist() == [10, 12, 13, 15]
    # insert 2 at position 3 of 5 (a shard's end): 3 and 4 move to 5 and 6
    add = GalleryChange("add", torch.tensor([7, 8]), torch.tensor([3, 4]), 5, 7, 2)
    assert add.remap(torch.tensor([0, 2, 3, 4])).tolist() == [0, 2, 5, 6]
    assert add.remap_vector(torch.tensor([1, 2, 3, 4, 5]), fill=-1).tolist() == [1, 2, 3, -1, -1, 4, 5]


def test_changes_since_replays_the_log():
    backend, ref = start("chunked")
    ch = changes(backend, ref)
    assert backend.changes_since(3) == [] and backend.changes_since(0) == ch and backend.changes_since(1) == ch[1:]
    assert backend.changes_since(7) is None


# ------------------------------------------------------------------------------------------------ dense LiveGallery
def test_live_gallery_snapshots_are_immutable_versions():
    emb = unit(10)
    live = LiveGallery(emb, "text", ids=np.arange(10) + 100)
    s0 = live.snapshot()
    ref = Reference(range(100, 110), emb)
    new = unit(2, seed=1)
    live.add([200, 201], new)
    ref.add([200, 201], new)
    live.remove([103, 200])
    ref.remove([103, 200])
    live.replace([100], unit(1, seed=2))
    ref.replace([100], unit(1, seed=2))
    s1 = live.snapshot()
    assert isinstance(s1.cache, GalleryCache) and (s0.version, s1.version) == (0, 3)
    assert torch.equal(s0.cache.embeddings, emb) and s0.ids.tolist() == list(range(100, 110))
    assert s1.ids.tolist() == ref.ids and torch.equal(s1.cache.embeddings, ref.emb)
    q = unit(3, seed=5)
    v, got = s1.topk_ids(q @ s1.cache.embeddings.T, 4)
    assert torch.equal(got, ref.topk(q, 4)[1])
    assert live.snapshot() is not s1 and live.snapshot().cache is s1.cache  # one GalleryCache per version
    assert [c.kind for c in live.changes_since(0)] == ["add", "remove", "replace"]
    with pytest.raises(ValueError, match="already exist"):
        live.add([101], unit(1))
    with pytest.raises(ValueError, match="item shape"):
        live.replace([101], unit(1, d=3))
    assert live.version == 3


def test_live_gallery_multi_vector():
    emb = F.normalize(torch.randn(5, 3, D, generator=torch.Generator().manual_seed(0)), dim=-1)
    live = LiveGallery(emb, "image")
    live.add([9], emb[:1].flip(1))
    live.remove([0])
    snap = live.snapshot()
    assert snap.cache.embeddings.shape == (5, 3, D) and snap.ids.tolist() == [1, 2, 3, 4, 9]
    assert torch.equal(snap.cache.embeddings[-1], emb[0].flip(0))


# ------------------------------------------------------------------------------------------------ concurrency
def _mutations(ref_ids, rng):
    """A fixed script of changes (kind, ids, seed)."""
    next_id, live, script = 10_000, list(ref_ids), []
    for step in range(30):
        r = step % 3
        if r == 0:
            ids = list(range(next_id, next_id + 3))
            next_id += 3
            live += ids
            script.append(("add", ids, step))
        elif r == 1:
            ids = [live[int(i)] for i in rng.choice(len(live), 2, replace=False)]
            live = [i for i in live if i not in ids]
            script.append(("remove", ids, step))
        else:
            ids = [live[int(i)] for i in rng.choice(len(live), 2, replace=False)]
            script.append(("replace", ids, step))
    return script


@pytest.mark.parametrize("kind", ["chunked", "faiss_flat", "faiss_ivf_ids", "live"])
def test_answers_stay_exact_while_another_thread_changes_the_gallery(kind):
    """A searcher and a mutator thread: every answer is the exact top-k of the version it names (so its ids exist in
    that version), gathered rows are that version's, and in the end the gallery holds exactly the expected ids."""
    emb = unit(60)
    ids = np.arange(60) * 3
    backend = LiveGallery(emb, "text", ids=ids) if kind == "live" else make_backend(kind + "_ids", emb, ids)
    ref = Reference(ids.tolist(), emb)
    versions = {0: (list(ref.ids), ref.emb.clone())}
    script = _mutations(ref.ids, np.random.default_rng(1))
    q = unit(4, seed=7)
    answers, errors = [], []
    done = threading.Event()

    def search():
        try:
            while not done.is_set() or len(answers) < 5:
                if kind == "live":
                    snap = backend.snapshot()
                    v, got = snap.topk_ids(q @ snap.cache.embeddings.T, 5)
                    answers.append((snap.version, v, got, None))
                else:
                    with backend.reading():
                        res = backend.search_ids(q, 5)
                        rows = backend.gather(backend.positions_of(res.indices[0]))
                    answers.append((res.version, res.values, res.indices, rows))
        except Exception as err:  # pragma: no cover - reported below
            errors.append(err)

    def mutate():
        try:
            for kind_, ids_, seed in script:
                if kind_ == "remove":
                    ch = backend.remove(ids_)
                    ref.remove(ids_)
                else:
                    rows = unit(len(ids_), seed=100 + seed)
                    ch = getattr(backend, kind_)(ids_, rows)
                    getattr(ref, kind_)(ids_, rows)
                versions[ch.version] = (list(ref.ids), ref.emb.clone())
                seen = len(answers)  # let the searcher answer on (about) every version, while it keeps racing
                deadline = time.monotonic() + 5
                while len(answers) == seen and time.monotonic() < deadline:
                    time.sleep(1e-4)
        except Exception as err:  # pragma: no cover
            errors.append(err)
        finally:
            done.set()

    threads = [threading.Thread(target=search), threading.Thread(target=mutate)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    assert backend.version == len(script) and backend.ids.tolist() == ref.ids
    for version, values, got, rows in answers:
        v_ids, v_emb = versions[version]
        assert set(got.flatten().tolist()) <= set(v_ids)
        want_v, want_i = Reference(v_ids, v_emb).topk(q, 5)
        assert torch.equal(got, want_i)
        torch.testing.assert_close(values, want_v, rtol=0, atol=1e-5)
        if rows is not None:
            torch.testing.assert_close(rows, v_emb[[v_ids.index(i) for i in got[0].tolist()]], rtol=0, atol=1e-6)
    assert len({a[0] for a in answers}) > len(script) // 2  # answers came from many versions


# ------------------------------------------------------------------------------------------------ objective state
def _inputs(g, q, **kw):
    return ObjectiveInputs(query_emb=q, gallery_emb=g, scores=q @ g.T, generator=torch.Generator().manual_seed(0), **kw)


def _change(live, kind, ids, rows=None):
    return live.remove(ids) if kind == "remove" else getattr(live, kind)(ids, rows)


CHANGES = [("add", [100, 101]), ("remove", [2, 5]), ("replace", [0, 7])]


@pytest.mark.parametrize("kind,ids", CHANGES)
def test_dn_gallery_mean_follows_the_gallery(kind, ids):
    dn = build_objective("dn", {"gallery_mean": "all"})
    live = LiveGallery(unit(12), "text")
    q = unit(3, seed=4)
    state = dn.init_state()
    dn(_inputs(live.snapshot().cache.embeddings, q), state)
    old = state["gallery_mean"].clone()
    ch = _change(live, kind, ids, unit(len(ids), seed=6))
    dn.on_gallery_change(ch, state)
    assert state["gallery_mean"].numel() == 0  # dropped, recomputed at the next step
    g = live.snapshot().cache.embeddings
    dn(_inputs(g, q), state)
    torch.testing.assert_close(state["gallery_mean"], g.mean(0))
    assert not torch.allclose(state["gallery_mean"], old)


@pytest.mark.parametrize("kind,ids", CHANGES)
def test_rest_centroids_follow_the_gallery(kind, ids):
    from hf_tta.objectives.rest import spherical_kmeans

    rest = build_objective("rest", {"num_clusters": 3})
    live = LiveGallery(unit(20), "text")
    state = rest.init_state()
    rest.clusters(_inputs(live.snapshot().cache.embeddings, unit(2, seed=4)), state)
    ch = _change(live, kind, ids, unit(len(ids), seed=6))
    rest.on_gallery_change(ch, state)
    assert state["kmeans_labels"].numel() == 0
    g = live.snapshot().cache.embeddings
    labels, _ = rest.clusters(_inputs(g, unit(2, seed=4)), state)
    _, want = spherical_kmeans(g, 3, torch.Generator().manual_seed(0), rest.config.kmeans_iters)
    assert torch.equal(labels, want) and labels.shape == (len(g),)


@pytest.mark.parametrize("kind,ids", CHANGES)
def test_backend_centroids_and_mean_follow_the_gallery(kind, ids):
    """A top-k backend drops its cached k-means and mean at a change: REST's candidate extras and DN's mean are then
    those of the new gallery (the chunked k-means equals the dense one on the same rows)."""
    from hf_tta.objectives.rest import spherical_kmeans

    backend = ChunkedGallery(unit(20), "text", k=5)
    rest = build_objective("rest", {"num_clusters": 3})
    first = rest.candidate_extras(backend, 0).clone()
    _change(backend, kind, ids, unit(len(ids), seed=6))
    g = backend.embeddings
    cent, labels = spherical_kmeans(g, 3, torch.Generator().manual_seed(0), rest.config.kmeans_iters)
    km = backend.kmeans(3, rest.config.kmeans_iters, 0)
    assert torch.equal(km.labels, labels) and not torch.equal(rest.candidate_extras(backend, 0), first)
    torch.testing.assert_close(backend.statistics().mean, g.mean(0))


@pytest.mark.parametrize("kind,ids", CHANGES)
def test_titan_match_counts_follow_their_items(kind, ids):
    titan = build_objective("titan", {"counterfactual": False})
    live = LiveGallery(unit(10), "text")
    state = titan.init_state()
    g = live.snapshot().cache.embeddings
    titan(_inputs(g, g[[1, 3, 3, 6, 7]]), state)  # queries equal to items: top-1 = those items
    counts = state["match_counts"].clone()
    assert counts.tolist() == [0, 1, 0, 2, 0, 0, 1, 1, 0, 0]
    ch = _change(live, kind, ids, unit(len(ids), seed=6))
    titan.on_gallery_change(ch, state)
    want = {"add": counts.tolist() + [0, 0],
            "remove": [c for p, c in enumerate(counts.tolist()) if p not in (2, 5)],
            "replace": [0 if p in (0, 7) else c for p, c in enumerate(counts.tolist())]}[kind]
    assert state["match_counts"].tolist() == want
    g = live.snapshot().cache.embeddings
    titan(_inputs(g, g[:1]), state)  # the next step keeps the remapped counts (adopts the new fingerprint)
    want[0] += 1
    assert state["match_counts"].tolist() == want
    torch.testing.assert_close(state["gallery_fingerprint"], gallery_fingerprint(g))
    # without the hook, another gallery still starts the counts again
    titan(_inputs(unit(4, seed=9), unit(1, seed=9)), state)
    assert state["match_counts"].tolist() == [1, 0, 0, 0]


@pytest.mark.parametrize("kind,ids", CHANGES)
def test_cliptta_memory_keys_follow_their_items(kind, ids):
    clip = build_objective("cliptta", {"memory_shots": 4})
    state = clip.init_state()
    state.update(
        memory_label=torch.tensor([0, 2, 5, 7, 9]),
        memory_confidence=torch.tensor([0.9, 0.8, 0.7, 0.6, 0.5]),
        **{"memory.pixel_values": torch.arange(5.0)[:, None].expand(5, 3)},
    )
    live = LiveGallery(unit(10), "text")
    ch = _change(live, kind, ids, unit(len(ids), seed=6))
    clip.on_gallery_change(ch, state)
    want = {"add": ([0, 2, 5, 7, 9], [0, 1, 2, 3, 4]),  # appended items move no key
            "remove": ([0, 5, 7], [0, 3, 4]),  # items 2 and 5 leave with their queries; 7 -> 5, 9 -> 7
            "replace": ([0, 2, 5, 7, 9], [0, 1, 2, 3, 4])}[kind]  # same ids, same positions
    assert state["memory_label"].tolist() == want[0]
    assert state["memory.pixel_values"][:, 0].tolist() == [float(i) for i in want[1]]
    assert state["memory_confidence"].numel() == len(want[0])


@pytest.mark.parametrize("kind,ids", CHANGES)
def test_eata_running_probs_follow_their_items(kind, ids):
    eata = build_objective("eata")
    probs = torch.arange(10.0) / 45
    state = {**eata.init_state(), "model_probs": probs}
    live = LiveGallery(unit(10), "text")
    eata.on_gallery_change(_change(live, kind, ids, unit(len(ids), seed=6)), state)
    want = {"add": probs.tolist() + [0.0, 0.0],
            "remove": [p for i, p in enumerate(probs.tolist()) if i not in (2, 5)],
            "replace": [0.0 if i in (0, 7) else p for i, p in enumerate(probs.tolist())]}[kind]
    torch.testing.assert_close(state["model_probs"], torch.tensor(want))


# ------------------------------------------------------------------------------------------------ sharded (2 processes)
def _sharded_worker(rank: int, world: int, init_file: str, out_dir: str) -> None:
    with gloo_worker(rank, world, init_file):
        out = {}
        for q in (None, Q):  # single- and multi-vector items
            emb = unit(30, q=q)
            local = emb[:12] if rank == 0 else emb[12:]  # shard 0 is the smaller one: new items go to its end
            mv = "" if q is None else "_mv"
            # an IVF shard's labels 0 .. n_r - 1 (n_r Q for multi-vector) are relabelled to global ids at the first change
            out.update(_sharded_changes(f"chunked{mv}", ChunkedGallery(local, "text", k=5, chunk_size=4), q))
            out.update(_sharded_changes(f"ivf{mv}", FaissGallery.build(local, "text", index="ivf", nlist=2, nprobe=2, k=5), q))
        save_file({k: v.contiguous() for k, v in out.items()}, os.path.join(out_dir, f"rank{rank}.safetensors"))


def _sharded_changes(name, shard, q):
    """The changes of the sharded test on one sharded gallery and what they leave."""
    from hf_tta.gallery import ShardedGallery

    out = {}
    gal = ShardedGallery(shard)
    out[f"{name}.ids0"] = gal.ids
    out[f"{name}.add_positions"] = gal.add([100, 101], unit(2, seed=1, q=q)).positions
    gal.remove([2, 20, 100])
    gal.replace([0, 25], unit(2, seed=2, q=q))
    try:
        gal.remove([0, 1, *range(3, 12), 101])  # all of shard 0
    except ValueError as err:
        out[f"{name}.refused"] = torch.tensor([int("empty shard 0" in str(err))])
    res = gal.search_ids(unit(4, seed=3), 6)
    got = dict(ids=gal.ids, values=res.values, indices=res.indices, mean=gal.statistics().mean,
               rows=gal.gather(torch.arange(len(gal))), sizes=torch.tensor(gal.sizes))
    out.update({f"{name}.{k}": v for k, v in got.items()})
    return out


def test_sharded_gallery_changes_equal_one_process(tmp_path):
    mp.spawn(_sharded_worker, args=(2, str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=True)
    refs = {}
    for q, mv in ((None, ""), (Q, "_mv")):
        emb = unit(30, q=q)
        # the sharded order: shard 0 (ids 0..11) and the added 100, 101 at its end, then shard 1 (12..29)
        ref = Reference([*range(12), 100, 101, *range(12, 30)], torch.cat([emb[:12], unit(2, seed=1, q=q), emb[12:]]))
        ref.remove([2, 20, 100])
        ref.replace([0, 25], unit(2, seed=2, q=q))
        refs[mv] = ref
    for r, name in [(r, n + mv) for r in (0, 1) for n in ("chunked", "ivf") for mv in ("", "_mv")]:
        ref = refs["_mv" if name.endswith("_mv") else ""]
        v, i = ref.topk(unit(4, seed=3), 6)
        saved = load_file(os.path.join(tmp_path, f"rank{r}.safetensors"))
        got = {k[len(name) + 1 :]: v for k, v in saved.items() if k.startswith(name + ".")}
        assert got["ids0"].tolist() == list(range(30)) and got["add_positions"].tolist() == [12, 13]
        assert got["ids"].tolist() == ref.ids and got["sizes"].tolist() == [12, 17]
        assert got["refused"].tolist() == [1]
        assert torch.equal(got["indices"], i)
        torch.testing.assert_close(got["values"], v, rtol=0, atol=1e-5)
        torch.testing.assert_close(got["rows"], ref.emb, rtol=0, atol=1e-6)
        torch.testing.assert_close(got["mean"], ref.single.mean(0), rtol=0, atol=1e-6)


# ------------------------------------------------------------------------------------------------ the wrapper
@pytest.mark.parametrize("objective", ["titan", "eata", "rest"])
def test_wrapper_adapts_on_a_backend_changed_by_another_thread(objective):
    """The wrapper catches the objective state up with the gallery's changes at each step and holds the backend at one
    version for the step, while another thread adds, removes and replaces captions: no error, every answer's ids exist
    in its version, per-item state matches the gallery's size."""
    from hf_tta import TTAConfig, TTAWrapper
    from tiny_models import make_model

    tta = TTAWrapper(make_model("clip"), TTAConfig(objective=objective, query_modality="image", steps=1))
    gen = torch.Generator().manual_seed(1)
    captions = {"input_ids": torch.randint(3, 99, (70, 8), generator=gen), "attention_mask": torch.ones(70, 8, dtype=torch.long)}
    emb = tta.encode_gallery(captions, show_progress=False).embeddings
    backend = ChunkedGallery(emb[:50], "text", k=8)
    spare, errors, done = emb[50:], [], threading.Event()

    def mutate():
        try:
            for j in range(0, 20, 4):
                backend.add([1000 + j, 1001 + j], spare[j : j + 2])
                backend.remove([j, j + 1])
                backend.replace([1000 + j], spare[j + 2 : j + 3])
                time.sleep(0.01)
        except Exception as err:  # pragma: no cover
            errors.append(err)
        finally:
            done.set()

    thread = threading.Thread(target=mutate)
    thread.start()
    steps = 0
    while not done.is_set() or steps < 3:
        batch = {"pixel_values": torch.randn(6, 3, 32, 32, generator=gen)}
        with backend.reading():  # the user's read of the answer's ids at the step's version (nested in the wrapper's)
            out = tta.adapt_step(batch, backend)
            ids = backend.to_ids(out.topk.indices)
            assert set(ids.flatten().tolist()) <= set(backend.ids.tolist())
            for key in ("match_counts", "model_probs"):
                if tta.state.get(key) is not None and tta.state[key].numel():
                    assert tta.state[key].numel() == len(backend)
        steps += 1
    thread.join()
    assert not errors, errors
    assert backend.version == 15 and len(backend) == 50
    kept = [i for i in range(50) if i >= 20 or i % 4 >= 2]
    assert backend.ids.tolist() == kept + [i for j in range(0, 20, 4) for i in (1000 + j, 1001 + j)]
