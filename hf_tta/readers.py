"""Answering from published states (issue 46): a published version is an :class:`~hf_tta.state.AdapterState` of its
:data:`~hf_tta.state.SERVED` parts, and an answer borrows a *reader* that holds it.

The adapting side captures the served parts after each adapted batch (the adapted parameters, the objective's and
score transform's state, the RNG and the batch counter: what :meth:`~hf_tta.TTAWrapper.answer` reads; not the
optimiser, the safety layer's snapshots or the lr search, which only adaptation reads). A :class:`ReaderPool` keeps
readers: answering wrappers built from it that share every frozen tensor with it (:func:`frozen_copy`), made from a
template taken once, so a new reader is needed only when more answers run at once than readers exist, never per
published version. :meth:`ReaderPool.reading` hands out a reader that holds the requested state, applying it by exact
copies to an idle reader when none holds it; while a reader is handed out nobody writes it, so every answer is the
scores of exactly one published state. Answers of one state share a reader (an answer only reads it) unless the pool
is ``exclusive`` (a reader whose answer writes it).
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass
from typing import Any, Iterator

from .state import SERVED, AdapterState


def frozen_copy(wrapper: Any) -> Any:
    """A wrapper that answers as ``wrapper`` does now and shares every tensor that adaptation never changes (frozen
    parameters and buffers): a reader, or the template readers are made from (:meth:`hf_tta.TTAWrapper.reader`: built
    by the constructor and given ``wrapper``'s state, never a deep copy of it)."""
    return wrapper.reader()


@dataclass
class _Reader:
    wrapper: Any
    state: AdapterState | None = None  # the published state it holds (by identity)
    users: int = 0


class ReaderPool:
    """Readers of ``wrapper``'s published states (see :mod:`hf_tta.readers`). The template is copied now: build the
    pool before anything else adapts ``wrapper``."""

    def __init__(self, wrapper: Any, exclusive: bool = False):
        self._template = frozen_copy(wrapper)  # never handed out, never written: new readers are copied from it
        self.exclusive = bool(exclusive)
        self._readers: list[_Reader] = []
        self._lock = threading.Lock()

    @staticmethod
    def capture(wrapper: Any) -> AdapterState:
        """``wrapper``'s served parts, to publish (an exact copy)."""
        return AdapterState.capture(wrapper, SERVED)

    @property
    def size(self) -> int:
        """How many readers exist (at most the number of answers that ran at once)."""
        return len(self._readers)

    @contextlib.contextmanager
    def reading(self, state: AdapterState) -> Iterator[Any]:
        """A reader holding ``state`` for the ``with`` block (nobody writes it meanwhile)."""
        with self._lock:
            holding = [r for r in self._readers if r.state is state and (r.users == 0 or not self.exclusive)]
            reader = holding[0] if holding else next((r for r in self._readers if r.users == 0), None)
            if reader is None:
                reader = _Reader(frozen_copy(self._template))
                self._readers.append(reader)
            if reader.state is not state:  # an idle reader: nobody reads it while the state is copied in
                state.apply(reader.wrapper)
                reader.state = state
            reader.users += 1
        try:
            yield reader.wrapper
        finally:
            with self._lock:
                reader.users -= 1


__all__ = ["ReaderPool", "frozen_copy"]
