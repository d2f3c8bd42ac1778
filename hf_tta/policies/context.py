"""The public view of one batch that a :class:`~hf_tta.policies.BatchPolicy` acts through (issue 46).

The wrapper builds one per ``adapt_step`` and hands it to every hook: the batch, the wrapper's forward, loop, safety
monitor, parameters and source state, and what a policy needs to run the batch itself: :meth:`BatchContext.run_steps`
(the loop with the wrapper's recovery), :meth:`BatchContext.reported_view`, :meth:`BatchContext.source_view` (the
source model's no-grad view, computed once per batch) and capture/load of :class:`~hf_tta.state.AdapterState` parts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from ..state import AdapterState


@dataclass
class BatchContext:
    """One batch of ``wrapper.adapt_step`` (read the wrapper through its public names only)."""

    wrapper: Any
    batch: Any
    scoring: str | None
    recover: Callable[[], None]
    #: the captured source state (:attr:`hf_tta.TTAWrapper.source_state`; read it, do not change it)
    source_state: AdapterState = field(repr=False)
    source: Any = field(default=None, repr=False)
    #: the steps' :class:`~hf_tta.loop.LoopResult` once they ran (``None`` before, and on a batch answered without them)
    result: Any = field(default=None, repr=False)

    forward = property(lambda self: self.wrapper.forward)
    loop = property(lambda self: self.wrapper.loop)
    safety = property(lambda self: self.wrapper.safety)
    params = property(lambda self: self.wrapper.params)
    config = property(lambda self: self.wrapper.config)
    batch_index = property(lambda self: self.wrapper.batch_index)

    def view(self, steps: int | None = None, source: bool = False) -> Any:
        """The current (or ``source``) model's no-grad view of the batch after ``steps`` steps (default: the last)."""
        return self.forward.view(self.batch, self.config.steps - 1 if steps is None else steps, source=source)

    def source_view(self) -> Any:
        """The source model's view of the batch (one no-grad forward, shared with the safety layer's)."""
        if self.source is None:
            self.source = self.view(source=True)
        return self.source

    def run_steps(self, make_inputs: Callable[[int], Any], rule: Any = None) -> Any:
        """The batch's steps on the wrapper's model (:meth:`hf_tta.loop.StepLoop.run`, with grad and the wrapper's
        recovery); ``make_inputs(step)`` embeds the queries."""
        with torch.enable_grad():
            return self.loop.run(self.wrapper, self.params, make_inputs, self.recover, rule)

    def reported_view(self, result: Any) -> tuple[Any, torch.Tensor]:
        """The view a batch whose steps ran reports: the last step's forward (TCR's protocol), or for an objective
        with ``score_after_update`` (ClipTTA's own protocol) a fresh forward after the last update."""
        if getattr(self.forward.objective, "score_after_update", False):
            inputs = self.forward.view(self.batch, self.config.steps)
            return inputs, inputs.scores
        return result.inputs, result.scores

    def capture(self, parts: frozenset[str]) -> AdapterState:
        """A copy of the wrapper's ``parts`` (:mod:`hf_tta.state`)."""
        return AdapterState.capture(self.wrapper, parts)

    def load(self, state: AdapterState) -> None:
        """Put ``state``'s parts into the wrapper."""
        state.apply(self.wrapper)

    def load_source(self, parts: frozenset[str]) -> None:
        """Put the source state's ``parts`` back into the wrapper."""
        self.source_state.only(parts).apply(self.wrapper)
