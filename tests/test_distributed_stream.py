"""One stream across 2 CPU processes (gloo, spawned here) equals the single-process run on the same global batches
(TCR and Tent, to 1e-5): query embeddings all-gathered with their gradient, gradients all-reduced and averaged, identical
state on both processes, save from the main process and resume; a sharded gallery equals the dense top-k."""

from __future__ import annotations

import os

import pytest
import torch
import torch.multiprocessing as mp
from safetensors.torch import load_file, save_file

from hf_tta import TTAConfig, TTAWrapper
from hf_tta.distributed import shard_bounds
from tiny_models import make_model

OBJECTIVES = ("tcr", "tent")
BATCHES, BATCH = 3, 7  # 7 rows: an uneven split (4 + 3) across the 2 processes


def _captions():
    gen = torch.Generator().manual_seed(1)
    return {
        "input_ids": torch.randint(3, 99, (60, 8), generator=gen),
        "attention_mask": torch.ones(60, 8, dtype=torch.long),
    }


def _batches():
    gen = torch.Generator().manual_seed(2)
    return [{"pixel_values": torch.randn(BATCH, 3, 32, 32, generator=gen)} for _ in range(BATCHES)]


def _run(tta, gallery, batches):
    out = {}
    for b, batch in enumerate(batches):
        res = tta.adapt_step(batch, gallery)
        out[f"scores.{b}"] = res.scores
    for name, p in tta.params.items():
        out[f"param.{name}"] = p.detach().clone()
    for key, value in tta.state.items():
        out[f"state.{key}"] = value
    for i, st in enumerate(tta.optimizer.state.values()):
        out[f"optim.{i}.exp_avg"] = st["exp_avg"]
    return out


def _worker(rank: int, world: int, init_file: str, out_dir: str) -> None:
    import torch.distributed as dist

    from hf_tta.distributed import DistributedTTAWrapper
    from hf_tta.gallery import ChunkedGallery, ShardedGallery

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
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
    finally:
        dist.destroy_process_group()


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
    assert any(not torch.equal(p, tta._source[n]) for n, p in tta.params.items())


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
