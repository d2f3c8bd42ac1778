"""One bank of adapted states over one live model (issue 46): peft's ``set_adapter`` for hf_tta.

A :class:`SlotBank` holds keyed :class:`~hf_tta.state.AdapterState`\\ s and one safety monitor per key over the one
model of a :class:`~hf_tta.TTAWrapper`. :meth:`SlotBank.set_active` is the one switch: the active key's state is
stored from the model, the new key's state (the source state for a key that never adapted) is put into it by exact
copies and its monitor becomes the wrapper's; :attr:`SlotBank.active` is the read-only key whose state is in the
model. So a key's results are bit-identical to a wrapper that saw only its batches. Routing's domains
(:mod:`hf_tta.routing`), the service's tenants (:mod:`hf_tta.service.tenants`) and the lr search's candidates
(:mod:`hf_tta.lr_search`: shadows of one stream, a bank without monitors of its own, saved in the
:data:`~hf_tta.state.SELECTOR` part) are slots of a bank.

This is the only module that puts a key's monitor into the wrapper (``wrapper.safety``), as peft's ``set_adapter`` is
the only switch of its adapters.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Hashable, Iterator

from .safety import NullSafetyMonitor, SafetyMonitor
from .state import ALL, ANSWER, PARAMS, AdapterState


@dataclass
class Slot:
    """One key's adapted state while it is not in the model (``None``: the source state, never adapted) and its own
    safety monitor."""

    key: Hashable
    state: AdapterState | None = None
    safety: SafetyMonitor | NullSafetyMonitor = field(default_factory=NullSafetyMonitor)


class SlotBank:
    """Keyed adapted states over ``wrapper``'s one model (see :mod:`hf_tta.slots`).

    Args:
        wrapper (`TTAWrapper`): the wrapper whose model the slots share; its source state is a new key's state.
        parts (`frozenset[str]`): the :mod:`hf_tta.state` parts a slot holds (default: all of them).
        reuse_buffers (`bool`): store the active key's state into its slot's tensors instead of new ones (no
            allocation per switch). Only for a bank whose stored states no one else holds: a tenant's history does.
        source (`AdapterState`, *optional*): a new key's state (default: the wrapper's source state).
        monitors (`bool`): each key has its own safety monitor, which :meth:`set_active` makes the wrapper's (default);
            ``False``: the wrapper's monitor stays whatever the key (the lr search's shadows, judged as one stream).
    """

    def __init__(self, wrapper: Any, parts: frozenset[str] = ALL, reuse_buffers: bool = False, source: AdapterState | None = None,
                 monitors: bool = True):
        self._wrapper, self.parts, self.reuse_buffers = wrapper, frozenset(parts), bool(reuse_buffers)
        self.monitors = bool(monitors)
        self._source = source
        self._slots: dict[Hashable, Slot] = {}
        self._active: Hashable | None = None

    @property
    def source(self) -> AdapterState:
        """The state of a key that never adapted."""
        return self._source if self._source is not None else self._wrapper.source_state

    # ------------------------------------------------------------------------------------------ keys
    @property
    def active(self) -> Hashable | None:
        """The key whose state is in the model (``None``: none; the model holds whatever was last put in)."""
        return self._active

    @property
    def keys(self) -> list[Hashable]:
        """The keys, in the order they were added."""
        return list(self._slots)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._slots

    def __len__(self) -> int:
        return len(self._slots)

    def slot(self, key: Hashable) -> Slot:
        """Key ``key``'s slot (its stored state may be stale while it is :attr:`active`: read :meth:`state`)."""
        if key not in self._slots:
            raise KeyError(f"no slot {key!r}: the keys are {self.keys}")
        return self._slots[key]

    def add(self, key: Hashable) -> Slot:
        """A new slot at the source state, with a fresh monitor of the wrapper's thresholds."""
        if key in self._slots:
            raise ValueError(f"slot {key!r} exists already")
        self._slots[key] = Slot(key, None, self._wrapper.safety.fresh()) if self.monitors else Slot(key)
        return self._slots[key]

    # ------------------------------------------------------------------------------------------ the switch
    def set_active(self, key: Hashable) -> Slot:
        """Put ``key``'s state and monitor into the wrapper (exact copies; nothing happens when it is already there)."""
        slot = self.slot(key)
        if self._active == key and self._active is not None:
            return slot
        self.store()
        (slot.state or self.source).only(self.parts).apply(self._wrapper)
        if self.monitors:
            self._wrapper.safety = slot.safety
        self._active = key
        return slot

    def store(self) -> None:
        """Store the active key's state from the model into its slot (before another key's state replaces it)."""
        if self._active is not None:
            slot = self._slots[self._active]
            slot.state = AdapterState.capture(self._wrapper, self.parts, into=slot.state if self.reuse_buffers else None)

    def deactivate(self) -> None:
        """Store the active key's state; no key is active afterwards (the next :meth:`set_active` applies its state)."""
        self.store()
        self._active = None

    def state(self, key: Hashable) -> AdapterState:
        """An exact copy of ``key``'s state (reading it changes nothing)."""
        slot = self.slot(key)
        if key == self._active:
            return AdapterState.capture(self._wrapper, self.parts)
        return (slot.state or self.source.only(self.parts)).copy()

    def put(self, key: Hashable, state: AdapterState | None, safety: SafetyMonitor | NullSafetyMonitor | None = None) -> None:
        """Replace ``key``'s stored state (``None``: the source) and, when given, its monitor; an active key is
        deactivated first, so the next :meth:`set_active` applies the new state."""
        slot = self.slot(key)
        if key == self._active:
            self.deactivate()
        slot.state = state
        if safety is not None:
            slot.safety = safety

    def clear(self) -> None:
        """Drop every slot; the wrapper gets a fresh monitor (the dropped slots keep theirs; a bank without
        ``monitors`` leaves the wrapper's as it is)."""
        self._slots, self._active = {}, None
        if self.monitors:
            self._wrapper.safety = self._wrapper.safety.fresh()

    def stored(self) -> dict[Hashable, AdapterState | None]:
        """Every key's stored state, by reference (``None``: the source), after storing the active key's (no key is
        active afterwards). With ``reuse_buffers`` off a stored state is never written again, so this is a snapshot
        that :meth:`restore` puts back at no copy (the lr search's undo of a failed batch)."""
        self.deactivate()
        return {key: slot.state for key, slot in self._slots.items()}

    def restore(self, states: dict[Hashable, AdapterState | None]) -> None:
        """Exactly the keys and stored states of ``states`` (:meth:`stored`'s, or a checkpoint's), no key active:
        the model's state is not stored first (what it holds is the caller's to replace). A kept key keeps its
        monitor; a new one gets a fresh monitor."""
        if self.reuse_buffers:
            raise ValueError("restore() needs a bank whose stored states are not reused as buffers")
        old, self._slots, self._active = self._slots, {}, None
        for key, state in states.items():
            slot = Slot(key, None, old[key].safety) if key in old else self.add(key)
            slot.state, self._slots[key] = state, slot

    @contextlib.contextmanager
    def computing_as(self, key: Hashable | None) -> Iterator[AdapterState]:
        """The model computes with ``key``'s parameters (``None`` or a key never adapted: the source's) and yields its
        :data:`~hf_tta.state.ANSWER` state to read; the active key's parameters are back afterwards, exactly."""
        if key is not None and key == self._active:
            yield AdapterState.view(self._wrapper, ANSWER)
            return
        state = (self._slots[key].state if key is not None else None) or self.source
        loaded = AdapterState.capture(self._wrapper, {PARAMS})
        state.only({PARAMS}).apply(self._wrapper)
        try:
            yield state.only(ANSWER)
        finally:
            loaded.apply(self._wrapper)


__all__ = ["Slot", "SlotBank"]
