"""The shift gate's statistic and rule, by hand on small feature matrices."""

import math

import pytest
import torch

from hf_tta.config_features import ShiftGateConfig
from hf_tta.shift_gate import VARIANCE_FLOOR, ShiftGate


def _gate(threshold=1.5, min_reference=2):
    gate = ShiftGate(ShiftGateConfig(threshold=threshold, min_reference=min_reference))
    # reference: feature 0 takes 0, 2 (mean 1, unbiased var 2); feature 1 takes 1, 1, ... constant -> var = floor
    gate.fit(torch.tensor([[0.0, 5.0], [2.0, 5.0]]))
    return gate


def test_fit_takes_the_mean_and_the_unbiased_variance():
    gate = _gate()
    assert torch.allclose(gate.mean, torch.tensor([1.0, 5.0], dtype=torch.float64))
    assert torch.allclose(gate.var, torch.tensor([2.0 + VARIANCE_FLOOR, VARIANCE_FLOOR], dtype=torch.float64))


def test_the_statistic_is_the_mean_squared_z_score():
    gate = ShiftGate(ShiftGateConfig(min_reference=2))
    gate.fit(torch.tensor([[0.0, 0.0], [2.0, 4.0]]))  # means (1, 2), variances (2, 8)
    batch = torch.tensor([[3.0, 2.0], [1.0, 6.0]])
    # query 1: (3-1)^2/2 = 2, (2-2)^2/8 = 0 -> 1;  query 2: 0, (6-2)^2/8 = 2 -> 1;  T = 1
    assert gate.statistic(batch) == pytest.approx(1.0, rel=1e-9)
    assert gate.statistic(torch.tensor([[5.0, 2.0]])) == pytest.approx((16 / 2 + 0) / 2, rel=1e-9)  # 4


@pytest.mark.parametrize("statistic,open_", [(1.4, False), (1.5, False), (1.6, True)])
def test_the_gate_opens_strictly_above_its_threshold(statistic, open_):
    assert _gate(1.5).is_open(statistic) is open_


def test_without_a_reference_the_gate_stays_closed_and_says_so_once(caplog):
    gate = ShiftGate(ShiftGateConfig())
    t = gate.statistic(torch.zeros(4, 3))
    assert math.isnan(t)
    with caplog.at_level("WARNING", logger="hf_tta.shift_gate"):
        assert not gate.is_open(t) and not gate.is_open(t)
    assert sum("fit_shift_gate" in r.message for r in caplog.records) == 1


def test_an_unfitted_gate_in_a_wrapper_answers_as_the_source():
    tta = TTAWrapper(make_model("clip"), TTAConfig(objective="tcr", query_modality="image", lr=1e-2, shift_gate={}))
    gallery = tta.encode_gallery(text_batch(20, seed=1))
    before = state_of(tta)
    out = tta.adapt_step(SHIFTED[0], gallery)  # a shifted batch, but no reference to tell
    with tta.disabled():
        _, source_scores = tta.embed_and_score(SHIFTED[0], gallery)
    assert torch.equal(out.scores, source_scores) and "no reference" in out.skipped[0]
    assert all(torch.equal(v, state_of(tta)[k]) for k, v in before.items())


@pytest.mark.parametrize("features,match", [
    (torch.zeros(3, 2), "pass at least 32"),
    (torch.full((40, 2), float("nan")), "non-finite"),
    (torch.zeros(40), r"\(N, D\)"),
])
def test_a_bad_reference_is_refused_and_changes_nothing(features, match):
    gate = ShiftGate(ShiftGateConfig())
    with pytest.raises(ValueError, match=match):
        gate.fit(features)
    assert not gate.fitted


def test_a_batch_of_another_width_is_refused():
    with pytest.raises(ValueError, match="another model"):
        _gate().statistic(torch.zeros(2, 3))


def test_the_reference_round_trips_through_state_tensors():
    gate, other = _gate(), ShiftGate(ShiftGateConfig(min_reference=2))
    other.load_state_tensors(gate.state_tensors())
    assert torch.equal(other.mean, gate.mean) and torch.equal(other.var, gate.var) and other.count == 2
    other.load_state_tensors({})
    assert not other.fitted


@pytest.mark.parametrize("kwargs,match", [({"threshold": 0}, "threshold"), ({"min_reference": 1}, "at least 2")])
def test_bad_settings_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ShiftGateConfig(**kwargs)


# ------------------------------------------------------------------------------------------ in the wrapper
from hf_tta import TTAConfig, TTAWrapper  # noqa: E402
from support import check_resume, state_of  # noqa: E402
from tiny_models import image_batch, make_model, text_batch  # noqa: E402

REFERENCE = image_batch(96, seed=7)
SHIFTED = [{"pixel_values": 4.0 * image_batch(8, seed=60 + i)["pixel_values"] + 2.0} for i in range(4)]
LIKE_REFERENCE = [image_batch(8, seed=80 + i) for i in range(2)]


def _gated(**gate) -> tuple[TTAWrapper, object]:
    tta = TTAWrapper(make_model("clip"), TTAConfig(objective="tcr", query_modality="image", lr=1e-2, shift_gate=gate))
    tta.fit_shift_gate(REFERENCE)
    return tta, tta.encode_gallery(text_batch(20, seed=1))


def test_a_closed_gate_answers_with_the_source_and_adapts_nothing():
    tta, gallery = _gated()
    before = state_of(tta)
    out = tta.adapt_step(LIKE_REFERENCE[0], gallery)
    assert out.logs["shift_gate_open"] == 0.0 and out.logs["shift_gate_statistic"] < 1.5
    assert "shift gate" in out.skipped[0]
    with tta.disabled():
        _, source_scores = tta.embed_and_score(LIKE_REFERENCE[0], gallery)
    assert torch.equal(out.scores, source_scores)
    after = state_of(tta)
    assert all(torch.equal(before[k], after[k]) for k in before) and tta.batch_index == 1


def test_an_open_gate_adapts_as_without_the_gate():
    tta, gallery = _gated()
    plain = TTAWrapper(make_model("clip"), TTAConfig(objective="tcr", query_modality="image", lr=1e-2))
    out, ref = tta.adapt_step(SHIFTED[0], gallery), plain.adapt_step(SHIFTED[0], gallery)
    assert out.logs["shift_gate_open"] == 1.0 and out.logs["shift_gate_statistic"] > 1.5
    assert torch.equal(out.scores, ref.scores)
    a, b = state_of(tta), state_of(plain)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert any(not torch.equal(p, tta.source_parameters()[n]) for n, p in tta.params.items())


def test_the_reference_is_kept_by_reset_and_resumes_bit_exact(tmp_path):
    tta, _ = _gated()
    mean = tta.shift_gate.mean.clone()
    tta.reset()
    assert torch.equal(tta.shift_gate.mean, mean)
    check_resume(_gated, [SHIFTED[0], LIKE_REFERENCE[0], SHIFTED[1], LIKE_REFERENCE[1], SHIFTED[2]], 2, tmp_path)


def test_fit_shift_gate_refuses_bad_queries_and_changes_nothing():
    tta, _ = _gated()
    mean = tta.shift_gate.mean.clone()
    with pytest.raises(ValueError):
        tta.fit_shift_gate({"pixel_values": torch.zeros(40, 3, 32)})  # not (B, C, H, W)
    assert torch.equal(tta.shift_gate.mean, mean)
    off = TTAWrapper(make_model("clip"), TTAConfig(objective="tcr", query_modality="image"))
    with pytest.raises(ValueError, match="the gate is off"):
        off.fit_shift_gate(REFERENCE)


@pytest.mark.parametrize("kwargs,match", [
    ({"objective": "dn", "shift_gate": {}}, "training-free"),
    ({"shift_gate": {}, "lr_search": {}}, "lr search"),
    ({"shift_gate": {"treshold": 2}}, "did you mean 'threshold'"),
])
def test_config_refusals(kwargs, match):
    with pytest.raises(ValueError, match=match):
        TTAConfig(**kwargs)


def test_the_batch_mean_statistic_is_the_squared_z_score_of_the_batch_mean():
    gate = ShiftGate(ShiftGateConfig(min_reference=2, statistic="batch_mean"))
    gate.fit(torch.tensor([[0.0, 0.0], [2.0, 4.0]]))  # means (1, 2), variances (2, 8)
    batch = torch.tensor([[3.0, 2.0], [1.0, 6.0]])  # batch mean (2, 4), B = 2
    # feature 0: (2 - 1)^2 / (2 / 2) = 1; feature 1: (4 - 2)^2 / (8 / 2) = 1; T = 1
    assert gate.statistic(batch) == pytest.approx(1.0, rel=1e-9)
    # four copies of the same queries: the same mean, B = 4: each term doubles -> T = 2
    assert gate.statistic(batch.repeat(2, 1)) == pytest.approx(2.0, rel=1e-9)
    # one query: batch_mean equals per_query
    one = torch.tensor([[5.0, 2.0]])
    per_query = ShiftGate(ShiftGateConfig(min_reference=2))
    per_query.load_state_tensors(gate.state_tensors())
    assert gate.statistic(one) == pytest.approx(per_query.statistic(one), rel=1e-12)


def test_an_unknown_statistic_is_refused():
    with pytest.raises(ValueError, match="statistic"):
        ShiftGateConfig(statistic="max")


def test_answer_gives_what_adapt_step_answers_on_both_sides_of_the_gate():
    tta, gallery = _gated()
    for x in SHIFTED[:2]:  # adapt first, so that the adapted and the source model differ
        tta.adapt_step(x, gallery)
    for x in (LIKE_REFERENCE[0], SHIFTED[2]):
        answered = tta.answer(x, gallery)
        out = tta.adapt_step(x, gallery, scoring="before_update")
        assert torch.equal(answered.scores, out.scores)
    with tta.disabled():
        _, source_scores = tta.embed_and_score(LIKE_REFERENCE[1], gallery)
    assert torch.equal(tta.answer(LIKE_REFERENCE[1], gallery).scores, source_scores)
