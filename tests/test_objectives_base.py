"""Tests shared by every objective (hf_tta/objectives/base.py and the registry): one table of the same checks for
every objective on tiny Hugging Face models built from configs, resume equals an uninterrupted stream, and every
objective on the top-k gallery backends (issue 11).

Adding an objective = one file in hf_tta/objectives/ + one row in OBJECTIVE_CASES.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import pytest
import torch
import torch.multiprocessing as mp
from safetensors.torch import load_file, save_file

from hf_tta import TTAConfig, TTAWrapper, available_objectives
from hf_tta.gallery import ChunkedGallery, FaissGallery
from hf_tta.gallery import stats as gallery_stats
from hf_tta.models import get_adapter
from hf_tta.objectives import get_objective_class
from hf_tta.objectives.base import gallery_fingerprint
from hf_tta.objectives.rest import spherical_kmeans
from hf_tta.state import OBJECTIVE, TRANSFORM, AdapterState
from support import gloo_worker
from tiny_models import TINY_MODELS, batch, make_model


# ----------------------------------------------------------------------- the table: the same checks for every objective
@dataclass
class ObjectiveCase:
    name: str
    config: dict = field(default_factory=dict)  # objective_config overrides for tiny batches
    wrapper: dict = field(default_factory=dict)  # extra TTAConfig fields

    def __str__(self) -> str:
        return self.name


OBJECTIVE_CASES = [
    ObjectiveCase("tent"),
    ObjectiveCase("tcr"),
    ObjectiveCase("tcr_training_free"),
    ObjectiveCase("rest"),
    ObjectiveCase("cliptta"),
    ObjectiveCase("dn", {"num_samples": 4}),
    ObjectiveCase("nnn", {"k": 3}),  # the stream's bank holds k = 3 queries after the first tiny batch
    ObjectiveCase("qbnorm"),
    ObjectiveCase("titan", {"hub_threshold": 0}),  # every item a hub: counterfactual text queries on tiny batches
    # Untrained tiny models predict almost uniformly: the baselines' entropy/PLPD filters are opened so that updates
    # happen (the filters themselves are checked in tests/test_objectives_<name>.py).
    ObjectiveCase("eata", {"e_margin": 1.0, "d_margin": 1.01}),
    ObjectiveCase("sar", {"selection": "paper", "margin_e0": 1.0}),
    ObjectiveCase("read"),
    # DeYO's port filters strictly below the k-th smallest entropy: the tiny BLIP's tied entropies would leave nothing,
    # so the table runs the paper mode with every query admitted (E < 2 ln C, PLPD > -1)
    ObjectiveCase("deyo", {"selection": "paper", "deyo_margin": 2.0, "plpd_threshold": -1.0}),
    ObjectiveCase("pl"),
    ObjectiveCase("shot"),
    ObjectiveCase("oracle"),  # supervised ceiling: _wrapper labels each query with one gallery item
]


DIRECTIONS = [("image", "text"), ("text", "image")]


BATCH, GALLERY = 6, 20


def test_every_registered_objective_has_a_row():
    assert sorted(c.name for c in OBJECTIVE_CASES) == available_objectives()


def _wrapper(case: ObjectiveCase, model_name: str, query: str, **extra) -> TTAWrapper:
    model = make_model(model_name)
    cfg = TTAConfig(objective=case.name, objective_config=case.config, query_modality=query, **{**case.wrapper, **extra})
    tta = TTAWrapper(model, cfg)
    if get_objective_class(case.name).requires_labels:  # supervised objectives get labels: query i -> item i mod N
        step = tta.adapt_step
        tta.adapt_step = lambda q, g, **kw: step(q, g, labels=[[i % len(g)] for i in range(next(iter(q.values())).shape[0])], **kw)
    return tta


def _snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("model_name", sorted(TINY_MODELS))
@pytest.mark.parametrize("query,gallery", DIRECTIONS)
@pytest.mark.parametrize("case", OBJECTIVE_CASES, ids=str)
def test_only_intended_parameters_change(case, model_name, query, gallery):
    if not get_objective_class(case.name).multi_vector_queries and query in get_adapter(make_model(model_name)).multi_vector:
        with pytest.raises(ValueError, match="multi-vector: use 'dn' there"):  # NNN's and QB-Norm's single-vector bank
            _wrapper(case, model_name, query)
        return
    tta = _wrapper(case, model_name, query)
    g = tta.encode_gallery(batch(gallery, GALLERY, seed=1))
    cached = g.embeddings.clone()
    before = _snapshot(tta.model)
    outs = [tta.adapt_step(batch(query, BATCH, seed=10 + i), g) for i in range(2)]
    after = _snapshot(tta.model)
    changed = {n for n in before if not torch.equal(before[n], after[n])}
    trains = get_objective_class(case.name).requires_grad
    for out in outs:
        assert out.scores.shape == (BATCH, GALLERY)
        assert torch.isfinite(out.scores).all()
        if trains and out.loss is not None:
            assert torch.isfinite(torch.tensor(out.loss))
    if trains:
        assert sum(o.num_updates for o in outs) > 0, [o.skipped for o in outs]
        assert changed, "an update was made but no parameter changed"
        adapted = set(tta.params)
        assert changed <= adapted, f"parameters outside the adapted set changed: {sorted(changed - adapted)[:3]}"
        # every changed tensor sits in a module of the query tower
        for n in changed:
            module = n.rsplit(".", 1)[0]
            assert query in tta.adapter.tower_of(module)
    else:
        assert not changed and not tta.params
    # the cached gallery is untouched and still equals a fresh encoding by the source model
    assert torch.equal(g.embeddings, cached)
    assert torch.allclose(tta.encode_gallery(batch(gallery, GALLERY, seed=1)).embeddings, cached, atol=1e-6)


@pytest.mark.parametrize("case", OBJECTIVE_CASES, ids=str)
def test_reset_is_exact(case):
    tta = _wrapper(case, "clip", "image")
    g = tta.encode_gallery(batch("text", GALLERY, seed=1))
    q = batch("image", BATCH, seed=3)
    first = tta.adapt_step(q, g).scores
    state0 = {k: v.clone() for k, v in tta.objective.init_state().items()}
    for i in range(3):
        tta.adapt_step(batch("image", BATCH, seed=20 + i), g)
    tta.reset()
    for name, p in tta.params.items():
        assert torch.equal(p, tta.source_parameters()[name])
    assert tta.batch_index == 0
    assert set(tta.state) == set(state0) and all(torch.equal(tta.state[k], state0[k]) for k in state0)
    # the stream replays bit-exactly after reset
    assert torch.equal(tta.adapt_step(q, g).scores, first)


@pytest.mark.parametrize("case", OBJECTIVE_CASES, ids=str)
def test_no_objective_writes_its_state_in_place(case):
    """AdapterState.view shares the objective's and score transform's state tensors (the loop's undo of a non-finite
    step, answers, a degenerate batch's score transform): exact only if every objective replaces its state's entries
    and never writes them in place. A view and a copy taken after a first batch, two more batches (with DN as the score
    transform where the objective is not DN, whose query mean then runs on): the view still equals the copy, though the
    state moved on."""
    if case.name == "dn":
        case = ObjectiveCase("dn", {**case.config, "query_mean": "running"})
    tta = _wrapper(case, "clip", "image", **({} if case.name == "dn" else {"score_transform": "dn"}))
    g = tta.encode_gallery(batch("text", GALLERY, seed=1))
    tta.adapt_step(batch("image", BATCH, seed=3), g)
    view, kept = AdapterState.view(tta, {OBJECTIVE, TRANSFORM}), AdapterState.capture(tta, {OBJECTIVE, TRANSFORM})
    for i in range(2):
        tta.adapt_step(batch("image", BATCH, seed=30 + i), g)
    assert view.equals(kept), "an objective or score transform wrote its state in place"
    assert not AdapterState.capture(tta, {OBJECTIVE, TRANSFORM}).equals(kept)  # the state did change meanwhile


TRAINABLE_CASES = [c for c in OBJECTIVE_CASES if get_objective_class(c.name).requires_grad]


@pytest.mark.parametrize("case", TRAINABLE_CASES, ids=str)
def test_skip_rule_updates_nothing(case, monkeypatch):
    tta = _wrapper(case, "clip", "text")
    g = tta.encode_gallery(batch("image", GALLERY, seed=1))
    before = _snapshot(tta.model)
    original = type(tta.objective).__call__

    def nothing_selected(self, inputs, state):
        out = original(self, inputs, state)
        out.n_selected = 0
        return out

    monkeypatch.setattr(type(tta.objective), "__call__", nothing_selected)
    out = tta.adapt_step(batch("text", BATCH, seed=2), g)
    assert out.num_updates == 0 and len(out.skipped) == tta.config.steps
    assert all("no query selected" in s for s in out.skipped)
    after = _snapshot(tta.model)
    assert all(torch.equal(before[n], after[n]) for n in before)
    assert not tta.optimizer.state  # the optimiser was never stepped


@pytest.mark.parametrize("case", OBJECTIVE_CASES, ids=str)
def test_config_round_trip(case, tmp_path):
    cls = get_objective_class(case.name)
    cfg = cls.config_class(**case.config)
    assert cls.config_class.from_dict(cfg.to_dict()) == cfg
    tta_cfg = TTAConfig(objective=case.name, objective_config=case.config)
    tta_cfg.save_pretrained(tmp_path)
    assert TTAConfig.from_pretrained(tmp_path) == tta_cfg


def test_readme_table_states_every_objective_and_its_defaults():
    """The README's objective table has a row per objective, and the defaults it names are the configs' defaults."""
    import pathlib

    readme = (pathlib.Path(__file__).resolve().parents[1] / "README.md").read_text()
    rows = {line.split("`")[1]: line for line in readme.splitlines() if line.startswith("| `")}
    assert set(available_objectives()) <= set(rows)  # the oracle ceiling too, marked as not a method
    assert "not a method" in rows["oracle"] and "labels=" in rows["oracle"]
    default = lambda name, field: getattr(get_objective_class(name).config_class(), field)  # noqa: E731
    assert default("oracle", "tau") == 0.01 and "τ=0.01" in rows["oracle"]
    assert default("dn", "lam") == 0.25 and "λ=0.25 [code" in rows["dn"]
    assert default("tcr", "queue_size") == 64 and "queue of 64" in rows["tcr"]
    for name in ("eata", "sar", "deyo"):
        assert default(name, "selection") == "tcr_port" and "[TCR port]" in rows[name] and 'selection="paper"' in rows[name]
    assert default("deyo", "plpd_threshold") == 0.0 and "PLPD > 0.0" in rows["deyo"]
    assert default("cliptta", "protocol") == "tcr" and 'protocol="tcr"` (default' in rows["cliptta"]


# ------------------------------------------------------------------------------------------ resume equals uninterrupted
# ------------------------------------------------------------------------------------ top-k gallery backends (issue 11)
OBJECTIVES = ("rest", "eata", "dn", "titan", "cliptta")


OBJECTIVES_STATS, OBJECTIVES_ITEM = ("rest", "dn"), ("eata", "titan", "cliptta")


N, TOPK_B, BATCHES = 60, 12, 3


# EATA's redundancy filter drops every query of the tiny random model (its predictions all look alike): keep them
CONFIGS = {"eata": {"objective_config": {"d_margin": 1.01}}}


def _captions(n=N, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return {"input_ids": torch.randint(3, 99, (n, 8), generator=gen), "attention_mask": torch.ones(n, 8, dtype=torch.long)}


def _batches(batches=BATCHES, seed=2):
    gen = torch.Generator().manual_seed(seed)
    return [{"pixel_values": torch.randn(TOPK_B, 3, 32, 32, generator=gen)} for _ in range(batches)]


def _topk_wrapper(objective, **cfg):
    cfg = {**CONFIGS.get(objective, {}), **cfg}
    return TTAWrapper(make_model("clip"), TTAConfig(objective=objective, query_modality="image", **cfg))


def _gallery_embeddings():
    return _topk_wrapper("tcr").encode_gallery(_captions(), show_progress=False).embeddings


def _stream(objective, make_gallery, batches=None, **cfg):
    tta = _topk_wrapper(objective, **cfg)
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


@pytest.mark.parametrize("kind", ["chunked", "faiss_flat", "faiss_ivf"])
@pytest.mark.parametrize("objective", OBJECTIVES)
def test_objective_runs_on_topk_backend(objective, kind):
    tta, outs = _stream(objective, _make(kind, 5))
    for out in outs:
        assert out.scores is None and out.topk.values.shape == (TOPK_B, 5)
        assert ((out.topk.indices >= 0) & (out.topk.indices < N)).all()
        assert (out.topk.values[:, :-1] >= out.topk.values[:, 1:]).all()
        if objective != "dn":
            assert out.num_updates > 0 and out.loss is not None
    per_item = {"eata": "model_probs", "titan": "match_counts"}
    if objective in per_item:  # a dense vector over the whole gallery, not over the candidates
        assert tta.state[per_item[objective]].shape == (N,)
    if objective == "titan":  # every query's top-1 of step 0 counted once, by global index
        assert int(tta.state["match_counts"].sum()) == BATCHES * TOPK_B
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
    tta = _topk_wrapper("tent")
    tta.objective.gallery_access = "full"
    with pytest.raises(ValueError, match="every gallery item's score at every step"):
        tta.adapt_step(_batches(1)[0], ChunkedGallery(_gallery_embeddings(), "text"))


@pytest.mark.parametrize(
    "objective,k,cfg",
    [
        ("rest", 10, {}),  # REST's K = 10: top-1, sample negatives and centroids all exact
        ("rest", 10, {"gradient_decoupling": True}),  # the source model's scores include the centroid columns
        ("rest", N, {}),
        ("dn", 5, {}),  # DN searches its shifted queries: exact at any k
        ("dn", 5, {"objective_config": {"gallery_mean": "all", "query_mean": "running"}}),
        ("tcr", 5, {"score_transform": "dn"}),
        ("titan", TOPK_B, {}),  # k > TOPK_B - 1: the rematched pseudo-match is always among the candidates
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
    tta = _topk_wrapper("rest")
    for queries in _batches():
        tta.adapt_step(queries, gallery)
    after_first = len(passes)
    assert after_first > 0
    dn = _topk_wrapper("dn", objective_config={"gallery_mean": "all"})
    for queries in _batches():
        dn.adapt_step(queries, gallery)
        tta.adapt_step(queries, gallery)
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
    assert "mean" not in moved.statistics_tensors()  # computed after the move: not shared
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
def test_reset_on_a_backend_returns_to_the_source(objective):
    """(Resume on a backend equals the uninterrupted stream: tests/test_state.py.)"""
    emb = _gallery_embeddings()
    tta = _topk_wrapper(objective)
    gallery = ChunkedGallery(emb, "text", k=8)
    for b in _batches(3):
        tta.adapt_step(b, gallery)
    tta.reset()
    fresh = _topk_wrapper(objective)
    assert tta.state.keys() == fresh.state.keys()
    assert all(torch.equal(tta.state[k], fresh.state[k]) for k in fresh.state)
    assert all(torch.equal(p, tta.source_parameters()[n]) for n, p in tta.params.items())


SHARD = 31  # rows 0..30 on rank 0, 31..59 on rank 1


def _sharded_worker(rank: int, world: int, init_file: str, out_dir: str) -> None:
    from hf_tta.gallery import ShardedGallery

    with gloo_worker(rank, world, init_file):
        emb = _gallery_embeddings()
        local = emb[:SHARD] if rank == 0 else emb[SHARD:]
        out = {}
        for objective in OBJECTIVES:
            gallery = ShardedGallery(ChunkedGallery(local, "text", k=10, chunk_size=8))
            tta = _topk_wrapper(objective)
            for i, b in enumerate(_batches()):
                res = tta.adapt_step(b, gallery)
                out[f"{objective}.{i}.values"], out[f"{objective}.{i}.indices"] = res.topk.values, res.topk.indices
        km = gallery.kmeans(10, 50, 0)
        out.update(mean=gallery.statistics().mean, fingerprint=gallery.statistics().fingerprint, labels=km.labels,
                   centroids=km.centroids)
        save_file({k: v.contiguous() for k, v in out.items()}, os.path.join(out_dir, f"rank{rank}.safetensors"))


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
