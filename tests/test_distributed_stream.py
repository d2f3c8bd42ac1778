"""One stream across 2 CPU processes (gloo, spawned here) equals the single-process run on the same global batches
(TCR and Tent, to 1e-5): query embeddings all-gathered with their gradient, gradients all-reduced and averaged, identical
state on both processes, save from the main process and resume; a sharded gallery equals the dense top-k. With the
safety layer (TCR + safety through a kept batch, a degenerate batch, rollbacks and a reset; the image presets on a
dense and a sharded gallery) both processes take the single process's actions and end in its state, and a stream saved
and resumed under distributed (mid-way through a run of rollbacks) continues as the uninterrupted one."""

from __future__ import annotations

import os

import pytest
import torch
import torch.multiprocessing as mp
from safetensors.torch import load_file, save_file

from hf_tta import ChunkedGallery, GalleryCache, RunConfig, TTAConfig, TTAWrapper, TuningConfig
from hf_tta.distributed import shard_bounds
from hf_tta.preset import GATED_TCR_IMAGE, REST_DN_IMAGE
from support import gloo_worker
from tiny_models import make_model

OBJECTIVES = ("tcr", "tent")
BATCHES, BATCH = 3, 7  # 7 rows: an uneven split (4 + 3) across the 2 processes
ACTIONS = (None, "skip_degenerate", "rollback", "reset")  # TTAOutput.safety_action, stored as its index
# TCR with a strict agreement floor (judged from 2 queries up: the batches have 7): the stream below gives
# [kept, skip_degenerate, rollback, rollback, reset (the 3rd rollback in a row), rollback] on one process
SAFE = TTAConfig(
    objective="tcr", query_modality="image", lr=5e-4, safety={"min_agreement": 0.9, "collapse_ratio": 0.0, "min_queries": 2}
)
SAVE_AFTER = 4  # the safety stream is saved after 4 batches (2 rollbacks in a row: the next one resets) and resumed
REC_BATCH = 9  # the preset judges batches of >= 8 queries (SafetyConfig.min_queries); 5 + 4 rows
# L2-SP's anchor with one step per batch: the first batch's logged penalty is its value at the source point
ANCHORED = TTAConfig(objective="tcr", query_modality="image", steps=1, lr=5e-3, tuning=TuningConfig(anchor_weight=50.0))


def _model(rank: int):
    """The tiny CLIP built from seed ``rank``, with rank > 0's LayerNorms moved off their (seed-free) 1 / 0 init, so
    that the processes start from different values of the adapted tensors too."""
    model = make_model("clip", seed=rank)
    gen = torch.Generator().manual_seed(rank)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, torch.nn.LayerNorm) and rank:
                m.weight.add_(0.1 * torch.randn(m.weight.shape, generator=gen))
                m.bias.add_(0.1 * torch.randn(m.bias.shape, generator=gen))
    return model


def _captions():
    gen = torch.Generator().manual_seed(1)
    return {
        "input_ids": torch.randint(3, 99, (60, 8), generator=gen),
        "attention_mask": torch.ones(60, 8, dtype=torch.long),
    }


def _batches():
    gen = torch.Generator().manual_seed(2)
    return [{"pixel_values": torch.randn(BATCH, 3, 32, 32, generator=gen)} for _ in range(BATCHES)]


def _safety_gallery():
    """Random item embeddings (the captions above all retrieve one item: every batch would be degenerate)."""
    emb = torch.randn(40, 16, generator=torch.Generator().manual_seed(3))
    return GalleryCache(torch.nn.functional.normalize(emb, dim=1), "text")


def _gate_reference():
    """Clean reference queries for the preset's shift gate, drawn narrower than the stream's images (std 0.5 against 1),
    so that the gate opens on the stream and the preset adapts (and its safety layer acts) on every process."""
    return {"pixel_values": 0.5 * torch.randn(64, 3, 32, 32, generator=torch.Generator().manual_seed(9))}


#: The image presets run through the safety stream (their gates fitted by _preset): TTAConfig.recommended("image")
#: (protocol v4's sixth round: gated TCR with source-anchored answers), the gated TCR of its first rounds
#: (hf_tta.preset.GATED_TCR_IMAGE: the same without the anchor) and REST + DN of its rounds 4-5 (REST_DN_IMAGE).
PRESETS = {"recommended": TTAConfig.recommended("image"), "gated_tcr": TTAConfig.recommended("image", **GATED_TCR_IMAGE),
           "rest_dn": TTAConfig.recommended("image", **REST_DN_IMAGE)}


def _preset(tta):
    if tta.config.shift_gate is not None:
        tta.fit_shift_gate(_gate_reference())
    return tta


def _safety_stream(rows: int):
    """Images, with one image repeated ``rows`` times (a degenerate batch) second."""
    gen = torch.Generator().manual_seed(4)
    xs = [{"pixel_values": torch.randn(rows, 3, 32, 32, generator=gen)} for _ in range(5)]
    constant = {"pixel_values": torch.randn(1, 3, 32, 32, generator=gen).expand(rows, -1, -1, -1).contiguous()}
    return [xs[0], constant, *xs[1:]]


def _run(tta, gallery, batches, start=0, save_after=None, save_dir=None):
    out, actions = {}, []
    for b, batch in enumerate(batches, start):
        res = tta.adapt_step(batch, gallery)
        if res.scores is None:  # a top-k backend
            out[f"topk.values.{b}"], out[f"topk.indices.{b}"] = res.topk.values, res.topk.indices
        else:
            out[f"scores.{b}"] = res.scores
        if "anchor" in res.logs:
            out[f"anchor.{b}"] = torch.tensor(res.logs["anchor"])
        for key in ("source_anchor.evidence", "source_anchor.adapted_answers"):  # a batch the source anchor judged
            if key in res.logs:
                out[f"{key}.{b}"] = torch.tensor(res.logs[key], dtype=torch.float64)
        actions.append(ACTIONS.index(res.safety_action))
        if b + 1 == save_after:
            tta.save_pretrained(save_dir)
    if tta.safety.active:
        out["actions"] = torch.tensor(actions)
        out["counts"] = torch.tensor([tta.safety_counts[a] for a in ACTIONS[1:]])
    for key, value in tta.transform_state.items():
        out[f"transform.{key}"] = value
    for name, p in tta.params.items():
        out[f"param.{name}"] = p.detach().clone()
    for key, value in tta.state.items():
        out[f"state.{key}"] = value
    for i, st in enumerate(tta.optimizer.state.values()):
        out[f"optim.{i}.exp_avg"] = st["exp_avg"]
    return out


def _worker(rank: int, world: int, init_file: str, out_dir: str) -> None:
    from hf_tta.distributed import DistributedTTAWrapper
    from hf_tta.gallery import ChunkedGallery, ShardedGallery

    with gloo_worker(rank, world, init_file):
        for objective in OBJECTIVES:
            # rank 1 builds its model from another seed: the wrapper broadcasts the main process's weights
            tta = DistributedTTAWrapper(
                make_model("clip", seed=rank), TTAConfig(objective=objective, query_modality="image")
            )
            gallery = tta.encode_gallery(_captions(), show_progress=False)
            out = _run(tta, gallery, _batches())
            save_file(
                {k: v.contiguous() for k, v in out.items()},
                os.path.join(out_dir, f"{objective}.rank{rank}.safetensors"),
            )
            if objective == "tcr":
                tta.save_pretrained(os.path.join(out_dir, "ckpt"))
                # a sharded gallery (rows split 31 / 29) gives the dense top-k
                emb = gallery.embeddings
                lo, hi = (0, 31) if rank == 0 else (31, 60)
                sharded = ShardedGallery(ChunkedGallery(emb[lo:hi], "text", k=5, chunk_size=8))
                q = torch.nn.functional.normalize(
                    torch.randn(6, emb.shape[1], generator=torch.Generator().manual_seed(3)), dim=1
                )
                res = sharded.search(q, 5)
                cand = torch.tensor([0, 59, 30, 31])
                save_file(
                    {"values": res.values, "indices": res.indices, "rows": sharded.gather(cand)},
                    os.path.join(out_dir, f"sharded.rank{rank}.safetensors"),
                )
        # ranks built from different weights: the anchor's reference is the broadcast source, not each rank's own
        tta = DistributedTTAWrapper(_model(rank), ANCHORED)
        out = _run(tta, tta.encode_gallery(_captions(), show_progress=False), _batches())
        save_file({k: v.contiguous() for k, v in out.items()}, os.path.join(out_dir, f"anchored.rank{rank}.safetensors"))
        _safety_worker(rank, out_dir)


def _safety_worker(rank: int, out_dir: str) -> None:
    from hf_tta.distributed import DistributedTTAWrapper
    from hf_tta.gallery import ChunkedGallery, ShardedGallery

    def save(name, out):
        save_file({k: v.contiguous() for k, v in out.items()}, os.path.join(out_dir, f"{name}.rank{rank}.safetensors"))

    gallery, xs = _safety_gallery(), _safety_stream(BATCH)
    ckpt = os.path.join(out_dir, "safe_ckpt")
    tta = DistributedTTAWrapper(make_model("clip", seed=rank), SAFE)
    save("safe", _run(tta, gallery, xs, save_after=SAVE_AFTER, save_dir=ckpt))
    resumed = DistributedTTAWrapper.from_pretrained(make_model("clip", seed=rank), ckpt)  # read on every process
    save("safe_resumed", _run(resumed, gallery, xs[SAVE_AFTER:], start=SAVE_AFTER))
    # the image presets (the default, and those of protocol v4's earlier rounds) on the dense gallery and on a sharded
    # one (24 / 16)
    xs = _safety_stream(REC_BATCH)[:4]
    lo, hi = (0, 24) if rank == 0 else (24, 40)
    sharded = ShardedGallery(ChunkedGallery(gallery.embeddings[lo:hi], "text", k=5, chunk_size=8))
    for name, config in PRESETS.items():
        save(name, _run(_preset(DistributedTTAWrapper(make_model("clip", seed=rank), config)), gallery, xs))
        save(f"{name}_sharded", _run(_preset(DistributedTTAWrapper(make_model("clip", seed=rank), config)), sharded, xs))
    # fast_step asked for: the fast path is off and the optimiser is the unfused AdamW a reset rebuilds, from the start
    tta = DistributedTTAWrapper(make_model("clip", seed=rank), TTAConfig(objective="tcr", query_modality="image", run=RunConfig(fast_step=True)))
    fused = [any(g.get("fused") for g in tta.optimizer.param_groups)]
    tta.reset()
    fused.append(any(g.get("fused") for g in tta.optimizer.param_groups))
    save("fast_step", {"fused": torch.tensor(fused), "deferred": torch.tensor(tta.fast_path_active)})


@pytest.fixture(scope="module")
def distributed_outputs(tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("dist")
    mp.spawn(_worker, args=(2, str(out_dir / "init"), str(out_dir)), nprocs=2, join=True)
    return out_dir


def test_shard_bounds_match_tensor_split():
    for b, w in [(7, 2), (8, 3), (5, 5)]:
        parts = torch.arange(b).tensor_split(w)
        assert [(int(p[0]), int(p[-1]) + 1) for p in parts] == shard_bounds(b, w)


@pytest.mark.parametrize("objective", OBJECTIVES)
def test_two_processes_equal_one(distributed_outputs, objective):
    tta = TTAWrapper(make_model("clip", seed=0), TTAConfig(objective=objective, query_modality="image"))
    single = _run(tta, tta.encode_gallery(_captions(), show_progress=False), _batches())
    ranks = [load_file(os.path.join(distributed_outputs, f"{objective}.rank{r}.safetensors")) for r in (0, 1)]
    assert set(ranks[0]) == set(single) == set(ranks[1])
    for key, ref in single.items():
        torch.testing.assert_close(ranks[0][key], ref, rtol=0, atol=1e-5, msg=key)
        assert torch.equal(ranks[0][key], ranks[1][key]), f"{key} differs between the processes"
    # the adaptation did something (the comparison is not between two source models)
    assert any(not torch.equal(p, tta.source_parameters()[n]) for n, p in tta.params.items())


def test_anchor_follows_the_broadcast_source(distributed_outputs):
    tta = TTAWrapper(_model(0), ANCHORED)
    single = _run(tta, tta.encode_gallery(_captions(), show_progress=False), _batches())
    ranks = _load_ranks(distributed_outputs, "anchored")
    for r in (0, 1):  # zero at the source on every rank (rank 1 started from seed 1's weights)
        assert float(ranks[r]["anchor.0"]) == 0.0, f"rank {r}: penalty {float(ranks[r]['anchor.0'])} at the source"
    assert float(single["anchor.2"]) > 0  # the anchor is live once the weights have moved
    assert set(ranks[0]) == set(single) == set(ranks[1])
    for key, ref in single.items():
        torch.testing.assert_close(ranks[0][key], ref, rtol=0, atol=1e-5, msg=key)
        assert torch.equal(ranks[0][key], ranks[1][key]), f"{key} differs between the processes"


def test_resume_from_the_main_process_checkpoint(distributed_outputs):
    batches = _batches()
    resumed = TTAWrapper.from_pretrained(make_model("clip", seed=0), os.path.join(distributed_outputs, "ckpt"))
    tta = TTAWrapper(make_model("clip", seed=0), TTAConfig(objective="tcr", query_modality="image"))
    gallery = tta.encode_gallery(_captions(), show_progress=False)
    for batch in batches:
        tta.adapt_step(batch, gallery)
    extra = {"pixel_values": torch.randn(BATCH, 3, 32, 32, generator=torch.Generator().manual_seed(9))}
    torch.testing.assert_close(
        resumed.adapt_step(extra, gallery).scores, tta.adapt_step(extra, gallery).scores, rtol=0, atol=1e-5
    )


def test_sharded_gallery_equals_dense(distributed_outputs):
    tta = TTAWrapper(make_model("clip", seed=0), TTAConfig(objective="tcr", query_modality="image"))
    emb = tta.encode_gallery(_captions(), show_progress=False).embeddings
    q = torch.nn.functional.normalize(torch.randn(6, emb.shape[1], generator=torch.Generator().manual_seed(3)), dim=1)
    v, i = (q @ emb.T).sort(dim=1, descending=True, stable=True)
    for r in (0, 1):
        got = load_file(os.path.join(distributed_outputs, f"sharded.rank{r}.safetensors"))
        assert torch.equal(got["indices"], i[:, :5])
        torch.testing.assert_close(got["values"], v[:, :5], rtol=0, atol=1e-6)
        assert torch.equal(got["rows"], emb[torch.tensor([0, 59, 30, 31])])


def _load_ranks(out_dir, name):
    return [load_file(os.path.join(out_dir, f"{name}.rank{r}.safetensors")) for r in (0, 1)]


def _assert_ranks_equal_single(ranks, single):
    assert set(ranks[0]) == set(single) == set(ranks[1])
    assert torch.equal(ranks[0]["actions"], single["actions"]) and torch.equal(ranks[0]["counts"], single["counts"])
    for key, ref in single.items():
        torch.testing.assert_close(ranks[0][key], ref, rtol=0, atol=1e-5, msg=key)
        assert torch.equal(ranks[0][key], ranks[1][key]), f"{key} differs between the processes"


#: TCR at 3e-2 behind its gate, which opens on the safety stream: the collapse rule resets the tiny model twice
GATED_ACTIONS = ["reset", "skip_degenerate", None, "reset"]
SAFETY_RUNS = {  # name: (config, gallery on one process, batch rows, batches, the actions taken)
    "safe": (SAFE, "dense", BATCH, 6, [None, "skip_degenerate", "rollback", "rollback", "reset", "rollback"]),
    # the default: the gated TCR with source-anchored answers. The anchor chooses who answers after the steps and the
    # safety layer's checks, so it takes the gated TCR's actions; it judges the batch the safety layer kept
    "recommended": (PRESETS["recommended"], "dense", REC_BATCH, 4, GATED_ACTIONS),
    "recommended_sharded": (PRESETS["recommended"], "topk", REC_BATCH, 4, GATED_ACTIONS),
    "gated_tcr": (PRESETS["gated_tcr"], "dense", REC_BATCH, 4, GATED_ACTIONS),
    "gated_tcr_sharded": (PRESETS["gated_tcr"], "topk", REC_BATCH, 4, GATED_ACTIONS),
    # REST + DN under the whole safety layer (no gate): the degenerate batch is skipped, the others kept
    "rest_dn": (PRESETS["rest_dn"], "dense", REC_BATCH, 4, [None, "skip_degenerate", None, None]),
    "rest_dn_sharded": (PRESETS["rest_dn"], "topk", REC_BATCH, 4, [None, "skip_degenerate", None, None]),
}


@pytest.mark.parametrize("name", SAFETY_RUNS)
def test_safety_two_processes_equal_one(distributed_outputs, name):
    config, kind, rows, n, actions = SAFETY_RUNS[name]
    gallery = _safety_gallery()
    if kind == "topk":
        gallery = ChunkedGallery(gallery.embeddings, "text", k=5, chunk_size=8)
    tta = _preset(TTAWrapper(make_model("clip", seed=0), config))
    single = _run(tta, gallery, _safety_stream(rows)[:n])
    assert [ACTIONS[i] for i in single["actions"].tolist()] == actions  # the stream exercises what it should
    # the source anchor judges every batch that adapted and that the safety layer let the adapted model answer, and no
    # other (a skip or a reset answers with the source already); its evidence is compared across processes below
    judged = {b for b, a in enumerate(actions) if a is None} if config.source_anchor is not None else set()
    assert {int(k.rsplit(".", 1)[1]) for k in single if k.startswith("source_anchor.evidence.")} == judged
    _assert_ranks_equal_single(_load_ranks(distributed_outputs, name), single)


def test_safety_resume_under_distributed(distributed_outputs):
    # both processes resumed from the main process's checkpoint continue exactly as the uninterrupted distributed run
    full, resumed = _load_ranks(distributed_outputs, "safe"), _load_ranks(distributed_outputs, "safe_resumed")
    for r in (0, 1):
        assert torch.equal(resumed[r]["actions"], full[r]["actions"][SAVE_AFTER:])
        for key, value in resumed[r].items():
            if key != "actions":
                assert torch.equal(value, full[r][key]), f"rank {r}: {key}"
    # and one process resumed from it continues as one uninterrupted process (rollbacks in a row, EMA and snapshot)
    gallery, xs = _safety_gallery(), _safety_stream(BATCH)
    one = TTAWrapper.from_pretrained(make_model("clip", seed=0), os.path.join(distributed_outputs, "safe_ckpt"))
    tail = _run(one, gallery, xs[SAVE_AFTER:], start=SAVE_AFTER)
    single = _run(TTAWrapper(make_model("clip", seed=0), SAFE), gallery, xs)
    assert [ACTIONS[i] for i in tail["actions"].tolist()] == ["reset", "rollback"]
    for key, value in tail.items():
        ref = single[key][SAVE_AFTER:] if key == "actions" else single[key]
        torch.testing.assert_close(value, ref, rtol=0, atol=1e-5, msg=key)


def test_fast_step_is_off_with_one_optimiser_kind(distributed_outputs):
    for got in _load_ranks(distributed_outputs, "fast_step"):
        assert not got["deferred"] and got["fused"].tolist() == [False, False]
    one = TTAWrapper(make_model("clip", seed=0), TTAConfig(objective="tcr", query_modality="image", run=RunConfig(fast_step=True)))
    assert any(g.get("fused") for g in one.optimizer.param_groups)  # what the distributed wrapper used to start with
