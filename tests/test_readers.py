"""hf_tta.readers: published versions are served parts, answered by readers made once (not per version); a reader
holds exactly the state it was handed and nobody writes it while it is handed out."""

import threading

import pytest
import torch

from hf_tta import RoutedTTAWrapper, TTAConfig, TTAWrapper
from hf_tta.readers import ReaderPool
from hf_tta.state import ALL, SERVED, AdapterState
from support import dense_gallery, image_stream
from tiny_models import batch, image_batch, make_model


def _adapted(n: int) -> tuple[TTAWrapper, list[AdapterState]]:
    """A wrapper adapted on ``n`` batches and its served parts after each (version 0: the source)."""
    tta = TTAWrapper(make_model("clip"), TTAConfig(objective="tcr", lr=5e-2, query_modality="image", score_transform="dn"))
    pool_states = [ReaderPool.capture(tta)]
    for q in image_stream(n):
        tta.adapt_step(q, dense_gallery())
        pool_states.append(ReaderPool.capture(tta))
    return tta, pool_states


def test_a_reader_answers_as_the_wrapper_did_at_that_version_and_is_reused_across_versions():
    gallery, probe = dense_gallery(), batch("image", 4, 77)
    tta = TTAWrapper(make_model("clip"), TTAConfig(objective="tcr", lr=5e-2, query_modality="image", score_transform="dn"))
    pool = ReaderPool(tta)
    for q in image_stream(3):
        state, want = ReaderPool.capture(tta), tta.answer(probe, gallery).scores
        with pool.reading(state) as reader:
            assert torch.equal(reader.answer(probe, gallery).scores, want)
        tta.adapt_step(q, gallery)
    assert pool.size == 1  # one reader served every version (a version is a state, not a copy of the wrapper)
    assert state.parts == SERVED and not any(p is tta.params[n] for n, p in state.params.items())


def test_answering_never_changes_a_published_state():
    tta, states = _adapted(2)
    pool = ReaderPool(tta)
    before = [s.copy() for s in states]
    for s in states:
        with pool.reading(s) as reader:
            reader.answer(batch("image", 3, 5), dense_gallery())
    assert all(b.equals(s) for b, s in zip(before, states))


def test_concurrent_answers_of_two_states_get_two_readers_and_exact_answers():
    """Two threads hold readers of two versions at once: each answers with its own version's scores."""
    tta, states = _adapted(1)
    gallery, probe = dense_gallery(), batch("image", 4, 7)
    pool = ReaderPool(tta)
    with pool.reading(states[0]) as r0:
        want0 = r0.embed_and_score(probe, gallery)[1]
    with pool.reading(states[1]) as r1:
        want1 = r1.embed_and_score(probe, gallery)[1]
    assert not torch.equal(want0, want1)
    inside, results = threading.Barrier(2), {}

    def answer(i: int) -> None:
        with pool.reading(states[i]) as reader:
            inside.wait(timeout=30)  # both readers are handed out at this point
            results[i] = reader.embed_and_score(probe, gallery)[1]

    threads = [threading.Thread(target=answer, args=(i,)) for i in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert pool.size == 2 and torch.equal(results[0], want0) and torch.equal(results[1], want1)


def test_an_exclusive_pool_never_hands_one_reader_to_two_answers():
    tta, states = _adapted(0)
    pool = ReaderPool(tta, exclusive=True)
    with pool.reading(states[0]) as a, pool.reading(states[0]) as b:
        assert a is not b
    shared = ReaderPool(tta)
    with shared.reading(states[0]) as a, shared.reading(states[0]) as b:
        assert a is b


MLP = ".*vision_model.*mlp.fc[12]"


@pytest.mark.parametrize("tuning", [{}, {"method": "bias"}, {"method": "lora", "target_modules": MLP}], ids=["ln", "bias", "lora"])
def test_a_reader_is_built_by_the_constructor_and_equals_the_wrapper(tuning):
    """Issue 46: ``TTAWrapper.reader`` (what every reader is) builds a new wrapper around a copy of the source model
    and loads the wrapper's state into it; no deep copy of the wrapper. It holds exactly the wrapper's state (the
    shift gate's reference included), shares its frozen tensors, owns its adapted ones and its optimiser, has the same
    source (a reset answers as the wrapper's source view), goes on exactly as the wrapper does, and leaves the wrapper
    bit-identical."""
    cfg = TTAConfig(objective="tcr", lr=5e-2, query_modality="image", tuning=tuning, shift_gate={"threshold": 1e-6})
    tta, gallery = TTAWrapper(make_model("clip"), cfg), dense_gallery()
    tta.fit_shift_gate(image_batch(64, seed=7))
    for q in image_stream(2):
        tta.adapt_step(q, gallery)
    before = AdapterState.capture(tta, ALL)
    reader = tta.reader()
    assert type(reader) is TTAWrapper and AdapterState.capture(tta, ALL).equals(before)
    assert AdapterState.capture(reader, ALL).equals(before) and reader.optimizer is not tta.optimizer
    probe = batch("image", 4, 77)
    assert torch.equal(reader.answer(probe, gallery).scores, tta.answer(probe, gallery).scores)
    mine = {id(t) for t in (*tta.model.parameters(), *tta.model.buffers())}
    assert not any(id(p) in mine for p in reader.params.values())
    assert all(id(t) in mine for t in reader.model.parameters() if not t.requires_grad)  # frozen: shared, not copied
    gate_tensors = tta.checkpoint_payload()[1]
    assert torch.equal(reader.checkpoint_payload()[1]["shift_gate.mean"], gate_tensors["shift_gate.mean"])
    nxt = batch("image", 8, 91)
    assert torch.equal(reader.adapt_step(nxt, gallery).scores, tta.adapt_step(nxt, gallery).scores)
    assert AdapterState.capture(reader, ALL).equals(AdapterState.capture(tta, ALL))
    with tta.disabled():
        source = tta.embed_and_score(probe, gallery)[1]
    reader.reset()
    assert torch.equal(reader.embed_and_score(probe, gallery)[1], source)


def test_a_routed_wrappers_reader_holds_every_domain_and_the_router():
    tta = RoutedTTAWrapper(make_model("clip"), TTAConfig(objective="tcr", lr=5e-2, query_modality="image"))
    gallery = dense_gallery()
    for i, q in enumerate(image_stream(3)):
        tta.adapt_step(q, gallery, domain=[i % 2] * q["pixel_values"].shape[0])
    reader = tta.reader()
    assert type(reader) is RoutedTTAWrapper and reader.domain_keys == tta.domain_keys == [0, 1]
    for key in tta.domain_keys:
        assert reader.domain_state(key).equals(tta.domain_state(key))
    probe = batch("image", 4, 5)
    assert torch.equal(reader.answer(probe, gallery, domain=[1] * 4).scores, tta.answer(probe, gallery, domain=[1] * 4).scores)
