"""hf_tta/forward.py: the forward of a batch (checks, embed, score, the views), on a tiny CLIP wrapper's ``forward``.

The views equal the wrapper's public scores; the source view is the source model's; the source scores of a batch are
computed once; a reading forward answers from a captured view and leaves the stream bit-identical; a degenerate
batch's score transform leaves no trace; a top-k backend's answer is each query's top-k of the exact scores."""

from __future__ import annotations

import torch

from hf_tta import ChunkedGallery, TTAConfig, TTAWrapper
from hf_tta.state import ALL, ANSWER, TRANSFORM, AdapterState
from support import dense_gallery, image_stream
from tiny_models import make_model


def _wrapper(**cfg) -> TTAWrapper:
    return TTAWrapper(make_model("clip"), TTAConfig(objective="tcr", query_modality="image", **cfg))


def test_views_are_the_current_and_the_source_models_scores():
    tta, gallery = _wrapper(), dense_gallery()
    xs = image_stream(2)
    tta.adapt_step(xs[0], gallery)  # the adapted model differs from the source now
    batch = tta.forward.answer_batch(xs[1], gallery)
    current, source = tta.forward.view(batch, step=0), tta.forward.view(batch, step=0, source=True)
    assert not current.scores.requires_grad and not current.query_emb.requires_grad
    assert torch.equal(current.scores, tta.embed_and_score(xs[1], gallery)[1])
    with tta.disabled():
        assert torch.equal(source.scores, tta.embed_and_score(xs[1], gallery)[1])
    assert not torch.equal(current.scores, source.scores)
    with torch.enable_grad():  # the steps' inputs carry the gradient to the adapted parameters
        assert tta.forward.inputs(batch, step=0).scores.requires_grad


def test_the_source_scores_of_a_batch_are_computed_once():
    tta, gallery = _wrapper(), dense_gallery()
    batch = tta.forward.answer_batch(image_stream(1)[0], gallery)
    cache: list[torch.Tensor] = []
    first = tta.forward.inputs(batch, step=0, source_cache=cache).source_scores()
    assert len(cache) == 1 and tta.forward.inputs(batch, step=1, source_cache=cache).source_scores() is first


def test_a_reading_answers_from_a_captured_view_and_leaves_the_stream_as_it_was():
    tta, gallery = _wrapper(score_transform="dn"), dense_gallery()
    xs = image_stream(3)
    tta.adapt_step(xs[0], gallery)
    before = AdapterState.capture(tta, ALL)
    reading = tta.forward.reading(AdapterState.view(tta, ANSWER))
    batch = reading.answer_batch(xs[1], gallery)
    inputs = reading.view(batch, step=tta.config.steps - 1)
    out = reading.scored(batch, inputs, inputs.scores)
    assert AdapterState.capture(tta, ALL).equals(before)  # the wrapper's state and RNG untouched
    assert not AdapterState.capture(reading.stream, {TRANSFORM}).equals(before.only({TRANSFORM}))  # DN's mean moved
    assert torch.equal(out.scores, tta.answer(xs[1], gallery).scores)


def test_a_transform_without_update_leaves_no_trace():
    tta, gallery = _wrapper(score_transform="dn"), dense_gallery()
    batch = tta.forward.answer_batch(image_stream(1)[0], gallery)
    view = tta.forward.view(batch, step=0)
    before = AdapterState.capture(tta, {TRANSFORM})
    kept = tta.forward.transform_scores(view, view.scores, update_state=False)
    assert AdapterState.capture(tta, {TRANSFORM}).equals(before)
    moved = tta.forward.transform_scores(view, view.scores, update_state=True)
    assert not AdapterState.capture(tta, {TRANSFORM}).equals(before) and torch.equal(kept, moved)


def test_a_topk_backend_answers_each_querys_topk_of_the_exact_scores():
    tta, gallery = _wrapper(), dense_gallery()
    backend = ChunkedGallery(gallery.embeddings, "text", k=4, chunk_size=8)
    x = image_stream(1)[0]
    batch = tta.forward.answer_batch(x, backend)
    view = tta.forward.view(batch, step=0)
    out = tta.forward.scored(batch, view, view.scores)
    dense = tta.embed_and_score(x, gallery)[1]
    values, indices = dense.topk(4, dim=1)
    assert out.scores is None and torch.equal(out.topk.indices, indices)
    torch.testing.assert_close(out.topk.values, values, rtol=0, atol=1e-6)
