"""hf_tta.slots: one bank of keyed adapted states over one model; a key's stream is bit-identical to a wrapper that saw
only its batches, the switch stores and restores exactly, reading never changes a state."""

import pytest
import torch

from hf_tta import TTAConfig, TTAWrapper
from hf_tta.slots import SlotBank
from hf_tta.state import ALL, AdapterState
from support import QUIET, assert_bit_equal, dense_gallery, image_stream, state_of
from tiny_models import make_model

CONFIG = dict(objective="tcr", lr=1e-2, query_modality="image", safety=QUIET)


def _wrapper() -> TTAWrapper:
    return TTAWrapper(make_model("clip"), TTAConfig(**CONFIG))


@pytest.fixture
def active_a() -> tuple[TTAWrapper, SlotBank]:
    """A bank over a fresh wrapper with key "a" active (at the source)."""
    tta = _wrapper()
    bank = SlotBank(tta)
    bank.add("a")
    bank.set_active("a")
    return tta, bank


@pytest.mark.parametrize("reuse_buffers", [False, True])
def test_interleaved_keys_equal_one_wrapper_per_key(reuse_buffers):
    """Keys "a" and "b" adapt on interleaved batches of one bank; each ends bit-identical (state and scores) to a
    wrapper of its own that saw only its batches."""
    gallery, batches = dense_gallery(), image_stream(6)
    tta = _wrapper()
    bank = SlotBank(tta, reuse_buffers=reuse_buffers)
    bank.add("a"), bank.add("b")
    alone = {"a": _wrapper(), "b": _wrapper()}
    for i, batch in enumerate(batches):
        key = "ab"[i % 2]
        bank.set_active(key)
        assert bank.active == key and tta.safety is bank.slot(key).safety
        got, want = tta.adapt_step(batch, gallery), alone[key].adapt_step(batch, gallery)
        assert torch.equal(got.scores, want.scores)
    for key in "ab":
        assert_bit_equal(state_of(bank.state(key)), state_of(AdapterState.capture(alone[key], ALL)))


def test_a_new_key_starts_at_the_source_and_reading_changes_nothing(active_a):
    tta, bank = active_a
    tta.adapt_step(image_stream(1)[0], dense_gallery())
    bank.add("b")
    assert_bit_equal(state_of(bank.state("b")), state_of(tta.source_state))
    before = state_of(AdapterState.capture(tta, ALL))
    with bank.computing_as("b"):  # the source's parameters, for one forward
        assert_bit_equal({n: p.detach() for n, p in tta.params.items()}, {n: tta.source_state.params[n] for n in tta.params})
    assert_bit_equal(state_of(AdapterState.capture(tta, ALL)), before)
    assert bank.active == "a"
    assert_bit_equal(state_of(bank.state("a")), before)


def test_put_replaces_a_keys_state_and_an_active_key_is_applied_again(active_a):
    tta, bank = active_a
    saved = bank.state("a")
    tta.adapt_step(image_stream(1)[0], dense_gallery())
    bank.put("a", saved)  # a rollback
    assert bank.active is None
    bank.set_active("a")
    assert_bit_equal(state_of(AdapterState.capture(tta, ALL)), state_of(saved))


def test_unknown_and_duplicate_keys_are_refused_in_one_line():
    bank = SlotBank(_wrapper())
    bank.add("a")
    with pytest.raises(ValueError, match="slot 'a' exists already"):
        bank.add("a")
    with pytest.raises(KeyError, match=r"no slot 'z': the keys are \['a'\]"):
        bank.set_active("z")
    assert bank.active is None and bank.keys == ["a"]


def test_clear_drops_every_slot_and_gives_the_wrapper_a_fresh_monitor(active_a):
    tta, bank = active_a
    monitor = tta.safety
    bank.clear()
    assert len(bank) == 0 and bank.active is None and tta.safety is not monitor


def test_a_bank_without_monitors_leaves_the_wrappers_monitor_and_restores_what_it_stored():
    """The lr search's bank (``monitors=False``): switching and clearing keep the wrapper's one monitor; ``stored()``
    is a snapshot by reference that ``restore()`` puts back exactly after more adaptation, dropping a key added since."""
    tta, gallery, batches = _wrapper(), dense_gallery(), image_stream(3)
    monitor = tta.safety
    bank = SlotBank(tta, frozenset({"params", "optimizer", "objective"}), monitors=False)
    bank.add(0), bank.set_active(0)
    tta.adapt_step(batches[0], gallery)
    snapshot = bank.stored()
    assert bank.active is None and tta.safety is monitor
    want = state_of(bank.state(0))
    bank.set_active(0)
    tta.adapt_step(batches[1], gallery)
    bank.add(1), bank.set_active(1)
    tta.adapt_step(batches[2], gallery)
    assert any(not torch.equal(t, want[k]) for k, t in state_of(bank.state(0)).items())  # it moved on
    bank.restore(snapshot)
    assert bank.keys == [0] and bank.active is None and tta.safety is monitor
    assert_bit_equal(state_of(bank.state(0)), want)
    bank.clear()
    assert tta.safety is monitor
    with pytest.raises(ValueError, match="restore\\(\\) needs a bank whose stored states are not reused"):
        SlotBank(tta, reuse_buffers=True).restore({})
