"""``AdapterState``: exact captures of what adaptation changes, round-tripped through the checkpoint's tensors, and the
one "a resumed stream equals the uninterrupted one" check over plain, objective, safety, routed and top-k streams (the
distributed stream's is in test_distributed, which needs processes)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hf_tta import (
    ChunkedGallery,
    ConsistencyConfig,
    GradientDecouplingConfig,
    RoutedTTAWrapper,
    RoutingConfig,
    RunConfig,
    TTAConfig,
    TTAWrapper,
    TuningConfig,
)
from hf_tta.state import ALL, ANSWER, OPTIMIZER, PARAMS, ROLLBACK, STEP_UNDO, AdapterState
from support import check_resume, dense_gallery, image_stream, state_of, style_stream
from tiny_models import TINY_MODELS, batch, make_model


def _other(query: str) -> str:
    return "text" if query != "text" else "image"


def _adapted(objective: str = "tcr", batches: int = 2, **cfg) -> tuple[TTAWrapper, object]:
    tta = TTAWrapper(make_model("clip"), TTAConfig(objective=objective, query_modality="image", **cfg))
    gallery = dense_gallery()
    for x in image_stream(batches):
        tta.adapt_step(x, gallery)
    return tta, gallery


# ------------------------------------------------------------------------------------- capture / apply
@pytest.mark.parametrize("parts", [STEP_UNDO, ROLLBACK, ALL], ids=["step_undo", "rollback", "all"])
def test_apply_restores_exactly_the_captured_parts(parts):
    tta, gallery = _adapted()
    before_all = AdapterState.capture(tta, ALL)
    snap = AdapterState.capture(tta, parts)
    tta.adapt_step(image_stream(1, seed=7)[0], gallery)  # moves every part
    moved = AdapterState.capture(tta, ALL)
    assert not moved.equals(before_all)
    snap.apply(tta)
    now = AdapterState.capture(tta, ALL)
    assert now.only(parts).equals(before_all.only(parts))
    others = ALL - parts  # what the capture did not take stays where the stream left it
    if others:
        assert now.only(others).equals(moved.only(others))


def test_a_refreshed_capture_reuses_its_buffers_and_stays_exact():
    tta, gallery = _adapted()
    snap = AdapterState.capture(tta, ROLLBACK)
    buffers = [t.data_ptr() for t in snap.params.values()]
    tta.adapt_step(image_stream(1, seed=8)[0], gallery)
    again = AdapterState.capture(tta, ROLLBACK, into=snap)
    assert again is snap and [t.data_ptr() for t in snap.params.values()] == buffers
    assert snap.equals(AdapterState.capture(tta, ROLLBACK))


def test_a_capture_is_a_copy_not_a_view():
    tta, gallery = _adapted()
    snap = AdapterState.capture(tta, ALL)
    frozen = AdapterState.capture(tta, ALL)
    snap.apply(tta)
    tta.adapt_step(image_stream(1, seed=9)[0], gallery)  # in-place AdamW updates must not reach the capture
    assert snap.equals(frozen)


def test_a_view_shares_the_replaced_parts_and_applies_exactly():
    """A view (what answers and the loop's undo read) shares the objective's state tensors instead of copying them,
    and applying it later restores that state exactly; parameters and moments (written in place) cannot be viewed."""
    tta, gallery = _adapted(score_transform="dn")
    view, kept = AdapterState.view(tta, ANSWER), AdapterState.capture(tta, ANSWER)
    assert all(view.objective[k] is t for k, t in tta.state.items()) and view.transform.keys() == tta.transform_state.keys()
    tta.adapt_step(image_stream(1, seed=7)[0], gallery)
    assert not AdapterState.capture(tta, ANSWER).equals(kept)
    view.apply(tta)
    assert AdapterState.capture(tta, ANSWER).equals(kept)
    for parts in (STEP_UNDO, {PARAMS}, {OPTIMIZER}):
        with pytest.raises(ValueError, match="written in place"):
            AdapterState.view(tta, parts)


def test_a_copy_is_independent_and_limited_to_its_parts():
    tta, gallery = _adapted()
    snap = AdapterState.capture(tta, ALL)
    dup = snap.copy()
    assert dup.equals(snap) and all(dup.params[n] is not t for n, t in snap.params.items())
    for t in snap.params.values():
        t.add_(1.0)  # the copy does not see it
    assert not dup.equals(snap) and dup.equals(AdapterState.capture(tta, ALL))
    only = AdapterState.capture(tta, ALL).only({PARAMS}).copy()
    assert only.parts == {PARAMS} and only.optimizer is None and not only.objective


def test_applying_a_fresh_optimiser_rebuilds_it():
    tta, _ = _adapted()
    assert tta.optimizer.state
    source = TTAWrapper(make_model("clip"), TTAConfig(objective="tcr", query_modality="image"))
    fresh = AdapterState.capture(source, {PARAMS, OPTIMIZER})
    fresh.optimizer.fresh = True
    fresh.apply(tta)
    assert not tta.optimizer.state and all(torch.equal(p, tta.source_parameters()[n]) for n, p in tta.params.items())


def test_applying_a_state_of_other_parameters_is_refused_before_anything_changes():
    tta, _ = _adapted()
    other = TTAWrapper(make_model("clip"), TTAConfig(objective="tcr", query_modality="text"))
    before = state_of(tta)
    with pytest.raises(ValueError, match="does not"):
        AdapterState.capture(other, ALL).apply(tta)
    assert all(torch.equal(before[k], v) for k, v in state_of(tta).items())


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    objective=st.sampled_from(["tcr", "tent", "sar", "cliptta", "eata"]),
    batches=st.integers(min_value=0, max_value=3),
    parts=st.sampled_from([STEP_UNDO, ROLLBACK, ALL]),
    keys=st.sampled_from(["pid", "name"]),
)
def test_round_trip_through_the_checkpoint_tensors(objective, batches, parts, keys):
    """Property: capture -> to_tensors -> (safetensors-like copy) -> from_tensors gives back an equal state, for any
    objective, stream length, subset of parts and optimiser key style."""
    cfg = {"objective_config": {"open_set": True}} if objective == "cliptta" else {}
    tta, _ = _adapted(objective, batches, **cfg)
    state = AdapterState.capture(tta, parts)
    tensors, meta = state.to_tensors("x.", optimizer_keys=keys)
    tensors = {k: v.clone() for k, v in tensors.items()}
    names = [n for n, _ in tta.named_optimized_parameters()]
    back = AdapterState.from_tensors(tensors, meta, parts, names, prefix="x.", optimizer_keys=keys, step_on_cpu=True)
    if keys == "pid":  # the per-batch optimiser extras (ClipTTA's alpha) are not saved as parameters
        state.params = {n: v for n, v in state.params.items() if not n.startswith("optimizer.extra.")}
    if state.optimizer is not None:
        back.optimizer.param_groups = state.optimizer.param_groups  # written to the metadata only in "pid" style
    assert back.equals(state)


# ------------------------------------------------------------------------------------- resume equals uninterrupted
def _plain(model: str, query: str, objective: str = "tcr", **cfg):
    def make():
        tta = TTAWrapper(make_model(model), TTAConfig(objective=objective, query_modality=query, **cfg))
        return tta, tta.encode_gallery(batch(_other(query), 15, seed=1))

    return make, [batch(query, 6, seed=100 + i) for i in range(5)], model


#: Objectives with state, optimiser extras or a second pass (text queries; the state of each must survive the cut).
LORA_MLP = ".*vision_model.*mlp.fc[12]"
LN_STEM_LIKE = ".*vision_model.*(layer_norm1|patch_embedding)"  # LayerNorms + the stem (issue 29's candidate)
OBJECTIVE_CASES = [
    ("rest", {}, {"gradient_decoupling": GradientDecouplingConfig()}),
    ("tent", {}, {"score_transform": "dn", "score_transform_config": {"num_samples": 8}}),
    ("tcr", {}, {"gradient_decoupling": GradientDecouplingConfig(per_tensor=True), "score_transform": "dn"}),
    ("sar", {"selection": "paper", "margin_e0": 1.0}, {}),
    ("cliptta", {"open_set": True}, {}),
    ("eata", {"e_margin": 1.0, "d_margin": 1.01, "fisher_alpha": 10.0, "fisher_batches": 3}, {}),
    ("titan", {"hub_threshold": 0, "query_bank_size": 8}, {}),
    ("deyo", {"deyo_margin": 1.0, "plpd_threshold": -1.0}, {}),
]


def _objective(objective: str, ocfg: dict, wcfg: dict):
    cfg = TTAConfig(objective=objective, objective_config=ocfg, query_modality="text", **wcfg)

    def make():
        tta = TTAWrapper(make_model("clip"), cfg)
        return tta, tta.encode_gallery(batch("image", 12, seed=1))

    return make, [batch("text", 6, seed=100 + i) for i in range(4)], "clip"


def _safety(push_name: str, **wcfg):
    cfg = TTAConfig(objective=push_name, objective_config={"mode": "shift", "harm_batches": [2, 7]}, lr=0.5,
                    safety={"min_agreement": 0.5, "collapse_ratio": 0.0, "snapshot_every": 3}, **wcfg)

    def make():
        return TTAWrapper(make_model("clip"), cfg), dense_gallery()

    return make, image_stream(10), "clip"


def _topk(objective: str):
    emb = dense_gallery(n=60).embeddings

    def make():
        tta = TTAWrapper(make_model("clip"), TTAConfig(objective=objective, query_modality="image"))
        return tta, ChunkedGallery(emb, "text", k=8)  # a fresh backend: its statistics are recomputed from the seed

    return make, image_stream(4, size=8), "clip"


def _routed(keyed: bool, push_name: str | None):
    """Three domains; with the safety layer, the harmful objective shifts each domain on its 3rd and 6th batch and
    ``snapshot_every=3`` keeps a last-good state older than the state at the cut."""
    cfg = TTAConfig(query_modality="image")
    if push_name is not None:
        safety = {"min_agreement": 0.5, "collapse_ratio": 0.0, "min_source_diversity": 0.0, "snapshot_every": 3}
        cfg = TTAConfig(objective=push_name, objective_config={"mode": "shift", "harm_batches": [2, 5]}, lr=0.5, safety=safety)

    def make():
        tta = RoutedTTAWrapper(make_model("clip"), cfg, routing=RoutingConfig(min_domain_batch=1))
        return tta, dense_gallery()

    return make, style_stream(8), "clip"


def _routed_step(keyed: bool):
    def step(tta, gallery, item):
        x, style = item
        return tta.adapt_step({"pixel_values": x}, gallery, domain=[["x", "y", 5][s] for s in style.tolist()] if keyed else None)

    return step


CASES = (
    [pytest.param("plain", (m, q), id=f"plain-{m}-{q}") for m in sorted(TINY_MODELS) for q in ("image", "text")]
    + [pytest.param("plain", ("blip2", "image", "tent"), id="plain-blip2-image-tent")]
    + [pytest.param("plain", ("clip", "image", "tcr", {"run": RunConfig(fast_step=True)}), id="plain-fast-path")]
    + [pytest.param("plain", ("clip", "image", "tcr", {"score_transform": "dn", "gradient_decoupling": GradientDecouplingConfig()}), id="plain-gd-dn")]
    + [pytest.param("plain", ("clip", "image", "tcr", {"run": RunConfig(scoring="before_update")}), id="plain-before-update")]
    + [pytest.param("plain", ("clip", "image", o, {"window": 8}), id=f"plain-window-{o}") for o in ("tcr", "sar")]
    + [pytest.param("objective", c, id=f"objective-{c[0]}" + ("-gd" if c[2].get("gradient_decoupling") else "")
                    + ("-dn" if c[2].get("score_transform") else "")) for c in OBJECTIVE_CASES]
    + [pytest.param("plain", ("clip", "image", "tcr", {"tuning": TuningConfig(method="bias", anchor_weight=1.0)}), id="plain-bitfit-anchor")]
    + [pytest.param("plain", ("clip", "image", "tcr", {"tuning": TuningConfig(method="lora", target_modules=LORA_MLP,
                                                       lr_multipliers={"lora_B": 0.5}, anchor_weight=1.0)}), id="plain-lora")]
    + [pytest.param("plain", ("clip", "image", "tcr", {"tuning": TuningConfig(target_modules=LN_STEM_LIKE, lr_multipliers={"patch": 3.0}),
                                                       "consistency": ConsistencyConfig(weight=1.0)}), id="plain-stem-consistency")]
    + [pytest.param("safety", (), id="safety")]
    + [pytest.param("safety", ({"tuning": TuningConfig(method="lora", target_modules=LORA_MLP)},), id="safety-lora")]
    + [pytest.param("topk", (o,), id=f"topk-{o}") for o in ("rest", "eata", "titan", "cliptta", "dn")]
    + [pytest.param("routed", (k, s), id=f"routed-{'keys' if k else 'router'}{'-safety' if s else ''}")
       for k in (False, True) for s in (False, True)]
)


@pytest.mark.parametrize("kind, args", CASES)
def test_resume_equals_uninterrupted(kind, args, tmp_path, request):
    step = None
    if kind == "plain":
        model, query, *rest = args
        make, stream, name = _plain(model, query, *rest[:1], **(rest[1] if len(rest) > 1 else {}))
    elif kind == "objective":
        make, stream, name = _objective(*args)
    elif kind == "safety":
        make, stream, name = _safety(request.getfixturevalue("push"), **(args[0] if args else {}))
    elif kind == "topk":
        make, stream, name = _topk(*args)
    else:
        keyed, safety = args
        make, stream, name = _routed(keyed, request.getfixturevalue("push") if safety else None)
        step = _routed_step(keyed)
    check_resume(make, stream, cut=len(stream) // 2, folder=tmp_path / "ckpt", step=step, model_name=name)
