"""The safety layer with per-domain adapters (hf_tta.routing + hf_tta.safety): every domain has its own monitor, a
rollback, reset or degenerate skip acts on that domain only and its rows get the source model's scores, every monitor
resumes bit-exactly from a checkpoint, reset() clears them all, and a monitor that never fires changes nothing."""

from __future__ import annotations

import pytest
import torch

from hf_tta import TTAConfig, TTAWrapper
from hf_tta.objectives.base import OBJECTIVES, register_objective
from hf_tta.routing import RoutedTTAWrapper, RoutingConfig
from support import (
    QUIET,
    Push,
    PushConfig,
    assert_bit_equal,
    constant_batch,
    dense_gallery,
    source_scores,
    state_of,
    style_images,
    style_stream,
)
from tiny_models import batch, make_model

B = 16
ZERO = {"skip_degenerate": 0, "rollback": 0, "reset": 0}


@pytest.fixture
def push():
    register_objective("routed_safety_push_test", PushConfig)(type("_RoutedPush", (Push,), {}))
    yield "routed_safety_push_test"
    OBJECTIVES.pop("routed_safety_push_test")


def _config(objective: str, safety: dict | None, **cfg) -> TTAConfig:
    return TTAConfig(objective=objective, query_modality="image", safety=safety, **cfg)


def _routed(cfg: TTAConfig, **routing) -> RoutedTTAWrapper:
    return RoutedTTAWrapper(make_model("clip"), cfg, routing=RoutingConfig(min_domain_batch=1, **routing))


def _domain_state(tta: RoutedTTAWrapper, key) -> dict[str, torch.Tensor]:
    return state_of(tta.domain_state(key))  # an exact copy: reading a domain's state does not change it


def _keyed(parts: dict, seed: int) -> tuple[dict[str, torch.Tensor], list]:
    """One batch of the queries ``parts`` (key -> pixel values), interleaved by a seeded permutation, and its keys."""
    x = torch.cat(list(parts.values()))
    keys = [k for k, v in parts.items() for _ in range(v.shape[0])]
    perm = torch.randperm(len(keys), generator=torch.Generator().manual_seed(seed))
    return {"pixel_values": x[perm]}, [keys[i] for i in perm.tolist()]


def _rows(keys: list, key) -> torch.Tensor:
    return torch.tensor([k == key for k in keys])


def _part(queries: dict[str, torch.Tensor], keys: list, key) -> dict[str, torch.Tensor]:
    """The queries of domain ``key``, in batch order (the order of its sub-batch)."""
    return {"pixel_values": queries["pixel_values"][_rows(keys, key)]}


# ------------------------------------------------------------------------------------- one domain flagged, not the other
@pytest.mark.parametrize(
    "mode,lr,safety,action",
    [("shift", 0.5, {"min_agreement": 0.5, "collapse_ratio": 0.0}, "rollback"), ("collapse", 5.0, {}, "reset")],
)
def test_a_harmful_update_in_one_domain_restores_that_domain_only(push, mode, lr, safety, action):
    """Domain "a" is harmed on its 4th batch (batch_index 3), in the same batch as "b"'s 3rd (not harmed): "a" is rolled
    back to its last-good snapshot (or reset to the source on collapse) and its rows get the source model's scores,
    while "b" adapts on exactly as a wrapper that never saw "a"'s queries."""
    cfg = _config(push, safety, objective_config={"mode": mode, "harm_batches": [3]}, lr=lr)
    tta, gallery = _routed(cfg), dense_gallery()
    refs = {k: TTAWrapper(make_model("clip"), cfg) for k in "ab"}
    plan = [("a", "b"), ("a", "b"), ("a",), ("a", "b")]
    for i, present in enumerate(plan):
        parts = {k: batch("image", B, seed=10 * i + j)["pixel_values"] for j, k in enumerate(present)}
        queries, keys = _keyed(parts, seed=i)
        if i == 3:
            before_a = _domain_state(tta, "a")
        out = tta.adapt_step(queries, gallery, domain=keys)
        for k in present:
            ref_out = refs[k].adapt_step(_part(queries, keys, k), gallery)
            assert torch.equal(out.scores[_rows(keys, k)], ref_out.scores), (i, k)
            assert out.safety_actions[k] == ref_out.safety_action
    assert out.safety_actions == {"a": action, "b": None} and out.safety_action == action
    assert torch.equal(out.scores[_rows(keys, "a")], source_scores(tta, _part(queries, keys, "a"), gallery))
    if action == "rollback":
        assert_bit_equal(_domain_state(tta, "a"), before_a)  # parameters, moments, steps, objective state
    else:  # the source values with a fresh optimiser and objective state
        assert_bit_equal(_domain_state(tta, "a"), state_of(TTAWrapper(make_model("clip"), cfg)))
    assert_bit_equal(_domain_state(tta, "b"), state_of(refs["b"]))
    assert any(not torch.equal(v, tta.source_parameters()[n]) for n, v in tta.domain_parameters("b").items())  # "b" did adapt
    assert tta.domain_safety_counts == {"a": {**ZERO, action: 1}, "b": ZERO}
    assert tta.safety_counts == {**ZERO, action: 1}  # summed over the domains
    # the next batch: "a" adapts on from its restored state, "b" is harmed on its 4th batch and restored in turn
    assert tta.adapt_step(queries, gallery, domain=keys).safety_actions == {"a": None, "b": action}


def test_a_degenerate_sub_batch_is_skipped_in_its_domain_only():
    cfg = _config("tcr", {})
    tta, gallery = _routed(cfg), dense_gallery()
    ref_b = TTAWrapper(make_model("clip"), cfg)
    queries, keys = _keyed({"a": batch("image", B, seed=0)["pixel_values"], "b": batch("image", B, seed=1)["pixel_values"]}, 0)
    tta.adapt_step(queries, gallery, domain=keys)
    ref_b.adapt_step(_part(queries, keys, "b"), gallery)
    before_a = _domain_state(tta, "a")
    queries, keys = _keyed({"a": constant_batch()["pixel_values"], "b": batch("image", B, seed=2)["pixel_values"]}, seed=1)
    out = tta.adapt_step(queries, gallery, domain=keys)
    assert out.safety_actions == {"a": "skip_degenerate", "b": None} and out.safety_action == "skip_degenerate"
    assert out.safety_logs["a/source_diversity"] == 0.0 and out.num_updates == cfg.steps  # only "b" stepped
    assert_bit_equal(_domain_state(tta, "a"), before_a)  # the constant queries changed nothing in "a"
    assert torch.equal(out.scores[_rows(keys, "a")], source_scores(tta, constant_batch(), gallery))
    assert torch.equal(out.scores[_rows(keys, "b")], ref_b.adapt_step(_part(queries, keys, "b"), gallery).scores)
    assert_bit_equal(_domain_state(tta, "b"), state_of(ref_b))
    assert tta.domain_safety_counts == {"a": {**ZERO, "skip_degenerate": 1}, "b": ZERO}


# ------------------------------------------------------------------------------------- quiet = off
@pytest.mark.parametrize("keyed", [False, True], ids=["router", "user-keys"])
def test_safety_that_never_fires_gives_the_scores_of_a_routed_wrapper_without_it(keyed):
    runs = {}
    for name, safety in (("off", None), ("quiet", QUIET)):
        tta = RoutedTTAWrapper(make_model("clip"), _config("tcr", safety))
        gallery = tta.encode_gallery(batch("text", 20, seed=1), show_progress=False)
        outs = []
        for x, style in style_stream(4):
            outs.append(tta.adapt_step({"pixel_values": x}, gallery, domain=style.tolist() if keyed else None))
        runs[name] = (tta, outs)
    (off, outs_off), (quiet, outs_quiet) = runs["off"], runs["quiet"]
    assert quiet.num_domains == 3 and quiet.domain_keys == off.domain_keys
    for a, b in zip(outs_off, outs_quiet):
        assert torch.equal(a.scores, b.scores) and torch.equal(a.domains, b.domains) and a.loss == b.loss
        assert b.safety_action is None and set(b.safety_actions.values()) == {None} and a.safety_actions == {}
        assert any(k.endswith("/agreement") for k in b.safety_logs) and a.safety_logs == {}
    for key in off.domain_keys:
        assert_bit_equal(_domain_state(off, key), _domain_state(quiet, key))
    assert off.safety_counts == {} and off.domain_safety_counts == {} and quiet.safety_counts == ZERO


# ------------------------------------------------------------------------------------- save, resume, reset
PLAN = [(0, 1), (0, 1, 2), (0, 1, 2), (0, 2), (0, 1, 2), (1, 2), (0, 1, 2)]  # the styles of each batch


def _plan_stream() -> list[tuple[torch.Tensor, list[int]]]:
    out = []
    for b, styles in enumerate(PLAN):
        queries, keys = _keyed({s: style_images(s, 8, seed=100 * b + s) for s in styles}, seed=b)
        out.append((queries["pixel_values"], keys))
    return out


def test_a_checkpoint_saved_without_safety_loads_with_fresh_monitors(tmp_path):
    plain = RoutedTTAWrapper(make_model("clip"), _config("tcr", None))
    gallery = dense_gallery()
    x, style = style_stream(1)[0]
    plain.adapt_step({"pixel_values": x}, gallery, domain=style.tolist())
    plain.save_pretrained(tmp_path / "ckpt")
    safe = RoutedTTAWrapper(make_model("clip"), _config("tcr", {}))
    safe.load_state(tmp_path / "ckpt")
    assert safe.domain_keys == plain.domain_keys and safe.domain_safety_counts == {0: ZERO, 1: ZERO}
    assert all(safe.domain_monitor(k).last_good is None for k in safe.domain_keys)


# ------------------------------------------------------------------------------------- the benchmark row
def test_safe_routed_row_runs_in_the_benchmark():
    from hf_tta.benchmarks import Condition, GridRunner, Job, RunSettings
    from test_benchmark_runner import TinyTask

    runner = GridRunner(
        TinyTask(make_model("clip")),
        RunSettings(show_progress=False, batch_size=12, degenerate_batches=3, safety={"min_queries": 4}),
    )
    row = runner.run(Job(Condition("i2t", "degenerate"), "tent+safe+route", 0))
    assert "error" not in row, row.get("error")
    tta = runner._wrappers[("tent+safe+route", "i2t", False)]
    assert isinstance(tta, RoutedTTAWrapper) and tta.config.safety == {"min_queries": 4}
    assert row["domains"] == tta.num_domains >= 1 and row["safety"] == tta.safety_counts
    assert row["safety"]["skip_degenerate"] >= 3  # the constant prefix is never adapted on
