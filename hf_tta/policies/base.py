"""The batch-policy protocol (issue 46): what a batch-level feature may do to one ``adapt_step``.

Modelled on transformers' ``TrainerCallback`` (public objects in, a decision out) and tent's one ``forward`` that owns
counting and reset: a policy never builds a :class:`~hf_tta.TTAOutput`, counts a batch or resets the wrapper; it
answers (:meth:`BatchPolicy.begin`), shapes the steps (:meth:`BatchPolicy.step_rule`), acts after the update and the
safety decision (:meth:`BatchPolicy.after`), and may rewrite the answer (:meth:`BatchPolicy.finish`). The wrapper runs
its policies in order (``TTAWrapper.policies``, built from the config; empty when no batch-level feature is on):

1. ``begin(ctx)`` of each policy; the first :class:`Answer` answers the batch (the steps do not run);
2. the safety layer's source view and decision; ``step_rule(ctx)`` of each policy (at most one rule), the steps;
3. the safety layer's verdict carried out, then ``after(ctx, decision)`` of each policy, then ``logs()`` into the
   batch's logs;
4. ``finish(ctx, answer)`` of each policy on every answer (from step 1 or 3), then the one ``TTAOutput``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # (annotations only: no runtime import of the loop or the safety layer)
    from ..loop import LoopResult
    from .context import BatchContext


@dataclass
class Answer:
    """A batch's answer before the score transform: the view that answers (``inputs``: the query embeddings the
    score transform reads) and its ``scores``, with the batch's record. ``update_state=False``: the score transform
    reads the batch without taking it into its state (a degenerate batch). ``report_safety``: the output carries the
    safety layer's action and logs (``False`` where it did not judge the batch, e.g. an update budget's skip)."""

    inputs: Any
    scores: Any
    loss: float | None = None
    num_updates: int = 0
    n_selected: int = 0
    skipped: list[str] = field(default_factory=list)
    logs: dict[str, float] = field(default_factory=dict)
    update_state: bool = True
    report_safety: bool = True

    @classmethod
    def from_result(cls, inputs: Any, scores: Any, result: LoopResult) -> Answer:
        """The answer of a batch whose steps ran (:class:`~hf_tta.loop.LoopResult`'s record)."""
        return cls(inputs, scores, result.loss, result.num_updates, result.n_selected, result.skipped, result.logs)


class BatchPolicy:
    """A batch-level feature (see :mod:`hf_tta.policies.base`); every hook's default does nothing, so a policy
    overrides only what it changes. Its state tensors are its own (saved with the wrapper's
    :data:`~hf_tta.state.SELECTOR` part when it keeps them in ``wrapper.selector_state``)."""

    #: the policy's name (``TTAWrapper.policy(name)``)
    name: str = ""
    #: state parts a safety *reset* leaves as they are (the lr search keeps its choice: ``{"selector"}``)
    keeps_on_reset: frozenset[str] = frozenset()

    def begin(self, ctx: BatchContext) -> Answer | None:
        """Answer the batch without the wrapper's steps (``None``: the batch goes on)."""
        return None

    def step_rule(self, ctx: BatchContext) -> Any:
        """A step hook for :class:`hf_tta.loop.StepLoop` (``before_step``/``after_step``) for this batch, or ``None``."""
        return None

    def after(self, ctx: BatchContext, decision: Any) -> None:
        """After the steps and the safety layer's :class:`~hf_tta.safety.SafetyDecision` was carried out (before a
        last-good snapshot is refreshed)."""

    def logs(self) -> dict[str, float]:
        """Entries for the adapted batch's ``TTAOutput.logs``."""
        return {}

    def finish(self, ctx: BatchContext, answer: Answer) -> Answer:
        """The answer as this policy wants it reported (e.g. scores mixed with the source view's)."""
        return answer

    def recovered(self) -> None:
        """An objective's model recovery (SAR) put the source parameters back inside the steps."""

    def optimizer_rebuilt(self) -> None:
        """The wrapper built a fresh optimiser (a reset, a checkpoint load)."""

    @property
    def needs_checked_loop(self) -> bool:
        """Whether the next batch's steps need the checked loop (a step rule reads the host), not the fast path."""
        return False
