"""Source-anchored answers (hf_tta.source_anchor): the evidence by hand on small tensors, the choice of who answers in
a wrapper, and the evidence as adapted state (reset, rollback part, checkpoint)."""

import math

import pytest
import torch

from hf_tta import TTAConfig, TTAWrapper
from hf_tta.config_features import SourceAnchorConfig
from hf_tta.source_anchor import SourceAnchor, evidence_step, mean_top1_probability, top1_agreement, top1_probability
from support import check_resume
from tiny_models import image_batch, make_model, text_batch


def test_the_mean_top1_probability_by_hand():
    scores = torch.tensor([[0.2, 0.1], [0.0, 0.0]])
    # softmax([2, 1]) tops at 1 / (1 + e^-1); softmax([0, 0]) at 1/2
    expected = (1 / (1 + math.exp(-1)) + 0.5) / 2
    assert mean_top1_probability(scores, 0.1) == pytest.approx(expected, abs=1e-7)  # (0.2 and 0.1 in float32)
    assert mean_top1_probability(scores, 1e9) == pytest.approx(0.5)  # a hot softmax is uniform over 2 items
    assert top1_probability(scores, 0.1).tolist() == pytest.approx([1 / (1 + math.exp(-1)), 0.5], abs=1e-7)


def test_the_evidence_is_a_moving_average_from_zero():
    assert evidence_step(0.0, 0.1, 0.8) == pytest.approx(0.02)
    assert evidence_step(0.02, 0.05, 0.8) == pytest.approx(0.8 * 0.02 + 0.2 * 0.05)
    assert evidence_step(0.3, -0.4, 0.0) == -0.4  # momentum 0: the batch alone


@pytest.mark.parametrize("fields, message", [
    ({"momentum": 1.0}, r"`momentum` must be in \[0, 1\)"),
    ({"margin": 1.5}, r"`margin` must be in \(-1, 1\)"),
    ({"temperature": 0.0}, "`temperature` must be > 0"),
    ({"ensemble_weight": 1.0}, r"`ensemble_weight` must be in \[0, 1\)"),
    ({"ensemble_weight": -0.1}, r"`ensemble_weight` must be in \[0, 1\)"),
    ({"source_confidence": 0.7}, "needs ensemble_weight > 0"),
    ({"source_confidence": 0.0, "ensemble_weight": 0.3}, r"must be in \(0, 1\]"),
    ({"source_confidence": 1.5, "ensemble_weight": 0.3}, r"must be in \(0, 1\]"),
    ({"source_confidence": "high", "ensemble_weight": 0.3}, "`source_confidence` must be"),
    ({"mix_agreement": [0.3, 0.9]}, "needs ensemble_weight > 0"),
    *[({"mix_agreement": band, "ensemble_weight": 0.5}, r"`mix_agreement` must be \[low, high\]")
      for band in ([0.9, 0.3], [0.3], [0.3, 0.5, 0.9], [-0.1, 0.5], [0.3, 1.5], ["a", 1.0], [True, 1.0])],
    ({"mix_agreement": 0.3, "ensemble_weight": 0.5}, "`mix_agreement` must be"),
    ({"source_confidence_scope": "everywhere", "source_confidence": 0.7, "ensemble_weight": 0.5},
     "`source_confidence_scope` must be one of"),
    ({"source_confidence_scope": "all"}, "`source_confidence_scope` needs `source_confidence`"),
    *[({"adapted_agreement": a}, "`adapted_agreement` must be") for a in (1.0, -0.1, 1.5, True)],
    ({"adapted_agreement": "high"}, "`adapted_agreement` must be"),
])
def test_bad_settings_are_refused_in_one_line(fields, message):
    with pytest.raises(ValueError, match=message):
        SourceAnchorConfig(**fields)


@pytest.mark.parametrize("extra, message", [
    ({"objective": "nnn"}, "training-free"),
    ({"reset_policy": "episodic"}, "episodic"),
    ({"lr_search": {}}, "lr search"),
    ({"source_anchor": {"margn": 0.1}}, "did you mean 'margin'"),
    ({"source_anchor": {"ensemble_weight": 0.3}, "score_transform": "dn"}, "ensemble_weight=0 or score_transform=None"),
])
def test_the_config_refuses_what_it_cannot_run(extra, message):
    with pytest.raises((ValueError, TypeError), match=message):
        TTAConfig(**{"objective": "tcr", "source_anchor": {}, **extra})


def test_the_config_round_trips():
    cfg = TTAConfig(objective="tcr", source_anchor={"margin": 0.02})
    assert TTAConfig.from_dict(cfg.to_dict()).build_source_anchor_config() == SourceAnchorConfig(margin=0.02)


# ------------------------------------------------------------------------------------------ in the wrapper
STREAM = [image_batch(8, seed=60 + i) for i in range(4)]


def _wrapper(**extra):
    tta = TTAWrapper(make_model("clip"), TTAConfig(objective="tcr", query_modality="image", lr=1e-2, **extra))
    return tta, tta.encode_gallery(text_batch(20, seed=1))


def _source_scores(batch):
    """The source model's scores of a batch: a fresh wrapper's answer (nothing adapted)."""
    fresh, gallery = _wrapper()
    return fresh.answer(batch, gallery).scores


@pytest.mark.parametrize("margin, weight", [(-0.99, 0.0), (0.99, 0.0), (-0.99, 0.3), (0.99, 0.3)])
def test_who_answers_follows_the_evidence_by_hand_and_adaptation_goes_on(margin, weight):
    anchored, gallery = _wrapper(source_anchor={"margin": margin, "momentum": 0.5, "ensemble_weight": weight})
    plain, gallery_p = _wrapper()
    e = 0.0
    for x in STREAM[:3]:
        out, ref = anchored.adapt_step(x, gallery), plain.adapt_step(x, gallery_p)
        source = _source_scores(x)
        d = mean_top1_probability(ref.scores, 0.01) - mean_top1_probability(source, 0.01)
        e = 0.5 * e + 0.5 * d  # e_t = m e_{t-1} + (1 - m) d_t
        assert out.logs["source_anchor.evidence"] == pytest.approx(e, abs=1e-9)
        assert SourceAnchor.evidence(anchored) == pytest.approx(e, abs=1e-9)
        adapted = e > margin
        assert out.logs["source_anchor.adapted_answers"] == float(adapted)
        closed = (1 - weight) * source + weight * ref.scores  # (1 - w) s^S + w s^A; w = 0: the source alone
        assert torch.allclose(out.scores, ref.scores if adapted else closed, atol=1e-6)
        assert out.num_updates == ref.num_updates  # the answer changes, not the adaptation
    assert all(torch.equal(p, plain.params[n]) for n, p in anchored.params.items())


@pytest.mark.parametrize("margin, scope", [(0.99, "mix"), (-0.99, "mix"), (-0.99, "all")],
                         ids=["held-mix", "adapted-mix", "adapted-all"])
def test_the_queries_the_source_is_sure_of_keep_its_scores_by_hand(margin, scope):
    """p^S_i >= tau: s^S_i; otherwise (1 - w) s^S_i + w s^A_i while the anchor holds (margin 0.99). Where the adapted
    model answers (margin -0.99) its answer is untouched with scope "mix" (the default), and the sure rows are s^S_i
    with scope "all"."""
    tau = float(top1_probability(_source_scores(STREAM[0]), 0.01).median())  # half the batch on each side
    kept, gallery = _wrapper(source_anchor={"margin": margin, "ensemble_weight": 0.3, "source_confidence": tau,
                                            "source_confidence_scope": scope})
    plain, gallery_p = _wrapper()
    held, seen = margin > 0, set()
    for x in STREAM[:3]:
        out, ref = kept.adapt_step(x, gallery), plain.adapt_step(x, gallery_p)
        source = _source_scores(x)
        sure = top1_probability(source, 0.01) >= tau
        seen |= set(sure.tolist())
        assert out.logs["source_anchor.adapted_answers"] == float(not held)
        answer = 0.7 * source + 0.3 * ref.scores if held else ref.scores
        want = torch.where(sure[:, None], source, answer) if held or scope == "all" else answer
        assert torch.allclose(out.scores, want, atol=1e-6)
        if held or scope == "all":
            assert out.logs["source_anchor.kept_source"] == pytest.approx(float(sure.double().mean()))
        else:
            assert "source_anchor.kept_source" not in out.logs
    assert seen == {True, False}  # both branches ran
    assert not torch.allclose(ref.scores, source, atol=1e-4)  # the adapted model moved: keeping rows changes them


def test_the_top1_agreement_by_hand():
    first = torch.tensor([[0.9, 0.1, 0.0], [0.1, 0.8, 0.1], [0.0, 0.2, 0.7], [0.5, 0.4, 0.1]])
    second = torch.tensor([[0.8, 0.1, 0.0], [0.9, 0.1, 0.0], [0.0, 0.2, 0.9], [0.1, 0.2, 0.3]])
    assert top1_agreement(first, second) == 0.5  # queries 0 and 2 share their top-1 item
    assert top1_agreement(first, first) == 1.0


@pytest.mark.parametrize("band", [[0.5, 1.0], [0.0, 0.5]])
@pytest.mark.parametrize("sure_kept", [False, True], ids=["every-query", "source-confidence"])
def test_the_mix_answers_only_batches_whose_agreement_is_in_the_band_by_hand(band, sure_kept):
    """a = the share of the batch's queries whose top-1 item the source and the adapted model share; the mix
    (1 - w) s^S + w s^A answers while band[0] <= a <= band[1], the source alone otherwise (the anchor holds: margin
    0.99). On this stream a is 1 on the first batch and 0 after (lr 1e-2): each band takes one side. With
    ``source_confidence`` tau as well (the default's combination), inside the band the queries with p^S_i >= tau keep
    s^S_i."""
    tau = float(top1_probability(_source_scores(STREAM[0]), 0.01).median()) if sure_kept else None
    anchor = {"margin": 0.99, "ensemble_weight": 0.3, "mix_agreement": band, **({"source_confidence": tau} if sure_kept else {})}
    banded, gallery = _wrapper(source_anchor=anchor)
    plain, gallery_p = _wrapper()
    seen, kept = set(), set()
    for x in STREAM:
        out, ref = banded.adapt_step(x, gallery), plain.adapt_step(x, gallery_p)
        source = _source_scores(x)
        a = top1_agreement(source, ref.scores)
        assert out.logs["source_anchor.agreement"] == pytest.approx(a)
        inside = band[0] <= a <= band[1]
        seen.add(inside)
        mix = 0.7 * source + 0.3 * ref.scores
        if sure_kept:
            sure = top1_probability(source, 0.01) >= tau
            kept |= set(sure.tolist()) if inside else set()
            mix = torch.where(sure[:, None], source, mix)
        assert torch.allclose(out.scores, mix if inside else source, atol=1e-6)
        assert out.num_updates == ref.num_updates  # the answer changes, not the adaptation
    assert seen == {True, False} and (not sure_kept or kept == {True, False})  # both branches ran inside the band


@pytest.mark.parametrize("limit", [0.5, 0.0])
def test_a_batch_the_two_models_agree_on_is_answered_by_the_source_by_hand(limit):
    """The adapted model answers (margin -0.99) only while a <= adapted_agreement; above it the source's scores. On
    this stream a is 1 on the first batch and 0 after (lr 1e-2): limit 0.5 hands the first batch back, and limit 0
    too (a = 0 is not above 0)."""
    capped, gallery = _wrapper(source_anchor={"margin": -0.99, "adapted_agreement": limit})
    plain, gallery_p = _wrapper()
    seen = set()
    for x in STREAM:
        out, ref = capped.adapt_step(x, gallery), plain.adapt_step(x, gallery_p)
        source = _source_scores(x)
        a = top1_agreement(source, ref.scores)
        assert out.logs["source_anchor.agreement"] == pytest.approx(a)
        adapted = a <= limit
        seen.add(adapted)
        assert out.logs["source_anchor.adapted_answers"] == float(adapted)
        assert torch.allclose(out.scores, ref.scores if adapted else source, atol=1e-6)
        assert out.num_updates == ref.num_updates  # the answer changes, not the adaptation
    assert seen == {True, False}


def test_a_batch_answered_without_the_steps_is_not_judged():
    tta, gallery = _wrapper(source_anchor={}, shift_gate={"threshold": 1e9})
    tta.fit_shift_gate(image_batch(64, seed=3))  # the gate stays closed: the source answers, nothing adapts
    out = tta.adapt_step(STREAM[0], gallery)
    assert "source_anchor.evidence" not in out.logs and SourceAnchor.evidence(tta) == 0.0


def test_reset_returns_the_evidence_to_zero_and_a_refused_batch_changes_nothing():
    tta, gallery = _wrapper(source_anchor={})
    for x in STREAM[:2]:
        tta.adapt_step(x, gallery)
    e = SourceAnchor.evidence(tta)
    assert e != 0.0
    with pytest.raises(ValueError):
        tta.adapt_step({"pixel_values": torch.full((2, 3, 30, 30), float("nan"))}, gallery)
    assert SourceAnchor.evidence(tta) == e
    tta.reset()
    assert SourceAnchor.evidence(tta) == 0.0


def test_with_a_top_k_backend_the_source_alone_answers_while_the_anchor_holds_and_it_is_logged_once(caplog):
    """Each model scores its own candidates there, so the mix falls back to the sixth round's answer (weight 0)."""
    from hf_tta.gallery import ChunkedGallery

    mixed, gallery = _wrapper(source_anchor={"margin": 0.99, "ensemble_weight": 0.3})
    alone, _ = _wrapper(source_anchor={"margin": 0.99})
    backend = ChunkedGallery(gallery.embeddings, "text", k=5)
    with caplog.at_level("WARNING", logger="hf_tta.source_anchor"):
        for x in STREAM[:3]:
            got, want = mixed.adapt_step(x, backend).topk, alone.adapt_step(x, backend).topk
            assert torch.equal(got.indices, want.indices) and torch.equal(got.values, want.values)
    assert caplog.text.count("cannot mix them: the source alone answers") == 1


def test_with_a_top_k_backend_the_agreement_compares_items_and_the_sure_rows_stay_adapted_logged_once(caplog):
    """The top-1 item's global index is each view's own candidates' best, so the agreement equals the dense gallery's;
    the sure queries' rows cannot be swapped between candidate sets: the adapted answer stands, said once."""
    from hf_tta.gallery import ChunkedGallery

    anchor = {"margin": -0.99, "adapted_agreement": 0.5}
    capped, gallery = _wrapper(source_anchor=anchor)
    dense, gallery_d = _wrapper(source_anchor=anchor)
    backend = ChunkedGallery(gallery.embeddings, "text", k=5)
    for x in STREAM:
        assert capped.adapt_step(x, backend).logs["source_anchor.agreement"] == dense.adapt_step(x, gallery_d).logs["source_anchor.agreement"]
    sure = {"margin": -0.99, "ensemble_weight": 0.3, "source_confidence": 0.5, "source_confidence_scope": "all"}
    kept, _ = _wrapper(source_anchor=sure)
    alone, _ = _wrapper(source_anchor={"margin": -0.99})
    with caplog.at_level("WARNING", logger="hf_tta.source_anchor"):
        for x in STREAM[:3]:
            got, want = kept.adapt_step(x, backend).topk, alone.adapt_step(x, backend).topk
            assert torch.equal(got.indices, want.indices) and torch.equal(got.values, want.values)
    assert caplog.text.count("source_confidence cannot keep the source's rows") == 1


@pytest.mark.parametrize("anchor", [{"margin": 0.0}, {"margin": 0.99, "ensemble_weight": 0.3, "source_confidence": 0.5},
                                    {"margin": 0.99, "ensemble_weight": 0.5, "mix_agreement": [0.0, 0.5]},
                                    {"margin": 0.99, "ensemble_weight": 0.5, "mix_agreement": [0.0, 0.5], "source_confidence": 0.5},
                                    {"margin": -0.99, "ensemble_weight": 0.5, "source_confidence": 0.5,
                                     "source_confidence_scope": "all", "adapted_agreement": 0.5}])
def test_a_stream_with_source_anchored_answers_resumes_bit_exact(tmp_path, anchor):
    check_resume(lambda: _wrapper(source_anchor=anchor), STREAM, 2, tmp_path)


def test_each_routed_domain_keeps_its_own_evidence_and_the_stream_resumes_bit_exact(tmp_path):
    from hf_tta import RoutedTTAWrapper

    def make():
        tta = RoutedTTAWrapper(make_model("clip"), TTAConfig(objective="tcr", query_modality="image", lr=1e-2,
                                                             source_anchor={"margin": 0.0}))
        return tta, tta.encode_gallery(text_batch(20, seed=1))

    routed, gallery = make()
    routed.adapt_step(STREAM[0], gallery, domain="a")
    first_b = routed.adapt_step(STREAM[1], gallery, domain="b").logs["b/source_anchor.evidence"]
    alone, gallery_alone = _wrapper(source_anchor={"margin": 0.0})  # domain b starts from e = 0, as a fresh wrapper
    assert first_b == alone.adapt_step(STREAM[1], gallery_alone).logs["source_anchor.evidence"] != 0.0
    stream = [("a", STREAM[0]), ("b", STREAM[1]), ("a", STREAM[2]), ("b", STREAM[3])]
    check_resume(make, stream, 2, tmp_path, step=lambda tta, g, x: tta.adapt_step(x[1], g, domain=x[0]))
