"""TTAWrapper.answer: adapt_step's answer with scoring="before_update" (dense gallery and top-k backend; DN with its
query mean and a sampled gallery mean, a training-free objective), computed without changing the wrapper; adapt_step's
per-batch ``scoring=``."""

from __future__ import annotations

import pytest
import torch

from hf_tta import RunConfig, TTAConfig, TTAWrapper
from hf_tta.gallery import ChunkedGallery
from hf_tta.state import ALL, AdapterState
from support import dense_gallery, image_stream
from tiny_models import batch, make_model

CONFIGS = {
    "tcr+dn": dict(score_transform="dn"),
    "eata+dn-sampled": dict(objective="eata", score_transform="dn", score_transform_config={"num_samples": 10}),
    "dn-alone": dict(objective="dn"),
}


def config(**kw) -> TTAConfig:
    return TTAConfig(**{"objective": "tcr", "query_modality": "image", "lr": 1e-2, **kw})


@pytest.mark.parametrize("kind", ["dense", "chunked"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_answer_is_the_before_update_answer_and_changes_nothing(name, kind):
    gallery = dense_gallery() if kind == "dense" else ChunkedGallery(dense_gallery().embeddings, "text", k=5)
    tta = TTAWrapper(make_model("clip"), config(**CONFIGS[name]))
    ref = TTAWrapper(make_model("clip"), config(**CONFIGS[name], run=RunConfig(scoring="before_update")))
    for x in image_stream(3, size=8):
        before = AdapterState.capture(tta, ALL)
        got, again = tta.answer(x, gallery), tta.answer(x, gallery)
        assert before.equals(AdapterState.capture(tta, ALL))  # DN's query mean, the RNG it samples with: unchanged
        expected = ref.adapt_step(x, gallery)
        if kind == "dense":
            assert torch.equal(got.scores, expected.scores) and torch.equal(again.scores, got.scores)
        else:
            assert got.scores is None and torch.equal(got.topk.values, expected.topk.values)
            assert torch.equal(got.topk.indices, expected.topk.indices) and torch.equal(again.topk.indices, got.topk.indices)
        assert got.num_updates == 0
        tta.adapt_step(x, gallery, scoring="before_update")  # advances DN's state as ref's adapt_step did
    assert AdapterState.capture(tta, ALL).equals(AdapterState.capture(ref, ALL))


def test_scoring_override_is_checked():
    tta = TTAWrapper(make_model("clip"), config())
    with pytest.raises(ValueError, match="scoring"):
        tta.adapt_step(batch("image", 8), dense_gallery(), scoring="later")
    assert tta.batch_index == 0
