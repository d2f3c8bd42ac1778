"""The batch-policy seam (hf_tta/policies, issue 46): a policy written outside the wrapper can answer a batch with
the source view, change the answer's scores and act after the update, and the wrapper's one ``_finish`` counts the
batch whoever answered it."""

from __future__ import annotations

import pytest
import torch

from hf_tta import TTAConfig, TTAWrapper
from hf_tta.policies import Answer, BatchPolicy
from hf_tta.state import ALL, PARAMS, AdapterState
from tiny_models import batch, make_model

STREAM = [batch("image", 8, seed=70 + i) for i in range(3)]


class SourceGate(BatchPolicy):
    """Answer every batch with the source model's view (a shift gate that never sees a shift)."""

    name = "gate"

    def begin(self, ctx):
        view = ctx.source_view()
        return Answer(view, view.scores, skipped=["gate: not shifted"])


class SourceAnchor(BatchPolicy):
    """Mix the adapted answer with the source view's scores (source-anchored answers)."""

    def finish(self, ctx, answer):
        return Answer(answer.inputs, 0.5 * (answer.scores + ctx.source_view().scores), answer.loss,
                      answer.num_updates, answer.n_selected, answer.skipped, answer.logs)


class EnsembleWithSource(BatchPolicy):
    """After each update, the adapted parameters halfway back to the source (ROID-style weight ensembling)."""

    def after(self, ctx, decision):
        state, source = ctx.capture(frozenset({PARAMS})), ctx.source_state.params
        state.params = {n: 0.5 * (v + source[n]) if n in ctx.params else v for n, v in state.params.items()}
        ctx.load(state)


def _pair():
    make = lambda: TTAWrapper(make_model("clip"), TTAConfig(objective="tcr", query_modality="image"))  # noqa: E731
    plain, tta = make(), make()
    return plain, tta, plain.encode_gallery(batch("text", 20, seed=1))


def test_no_feature_on_means_no_policy_and_named_lookup():
    plain, tta, _ = _pair()
    assert plain.policies == [] and plain.policy("lr_search") is None and plain.lr_search is None
    with_search = TTAWrapper(make_model("clip"), TTAConfig(objective="tcr", query_modality="image", lr_search={}))
    assert [p.name for p in with_search.policies] == ["lr_search"] and with_search.policy("lr_search") is with_search.lr_search


def test_a_gate_answers_with_the_source_and_the_wrapper_counts_the_batch():
    plain, tta, g = _pair()
    tta.policies.append(SourceGate())
    before = AdapterState.capture(tta, ALL - {"counter"})
    out = tta.adapt_step(STREAM[0], g)
    assert torch.equal(out.scores, plain.answer(STREAM[0], g).scores) and out.skipped == ["gate: not shifted"]
    assert out.num_updates == 0 and tta.batch_index == 1
    assert AdapterState.capture(tta, ALL - {"counter"}).equals(before)


def test_a_policy_changes_the_answers_scores():
    plain, tta, g = _pair()
    tta.policies.append(SourceAnchor())
    source = plain.answer(STREAM[0], g).scores
    mine, theirs = tta.adapt_step(STREAM[0], g), plain.adapt_step(STREAM[0], g)
    assert mine.num_updates == theirs.num_updates == 3
    torch.testing.assert_close(mine.scores, 0.5 * (theirs.scores + source))
    assert not torch.equal(mine.scores, theirs.scores)


@pytest.mark.parametrize("batches", [1, 2])
def test_a_policy_acts_after_the_update(batches):
    plain, tta, g = _pair()
    tta.policies.append(EnsembleWithSource())
    for b in STREAM[:batches]:
        tta.adapt_step(b, g)
    plain.adapt_step(STREAM[0], g)
    if batches == 1:  # the first batch: plain's update, halfway back to the source
        source = plain.source_parameters()
        for n, p in tta.params.items():
            torch.testing.assert_close(p.detach(), 0.5 * (plain.params[n].detach() + source[n]))
    assert tta.batch_index == batches and any(not torch.equal(p, plain.params[n]) for n, p in tta.params.items())
