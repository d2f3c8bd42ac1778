"""The steps of one batch: embed, objective, backward, optimiser step, ``config.steps`` times.

:class:`StepLoop` runs them for any :class:`~hf_tta.state.Adaptable` (the wrapper) and a ``make_inputs(step)`` callable
that embeds and scores the batch at the current parameters. It imports neither the wrapper nor the safety layer: the
wrapper passes what a batch needs, and the distributed wrapper fills the gradient-reduce hook.

**The one skip rule.** A step updates nothing when the objective selects no query, its loss is not finite, the loss
does not depend on the adapted parameters, or a gradient is not finite; a step with a non-finite loss or gradient also
leaves the objective's state as it was before the step. Skipped steps are listed in the result.

**Two ways to run it, one result.** The checked loop decides the rule on the host at every step. The fast path
(``TTAConfig.fast_step``, a fused AdamW, no closure, no gradient decoupling, no ``on_step_end`` hook, no gradient
reduce) decides it on the device and feeds it to the fused AdamW as ``found_inf`` (which then leaves parameters, moments
and step count untouched), with one device-to-host transfer per batch; if a step was non-finite it restores the batch's
:data:`~hf_tta.state.STEP_UNDO` capture and returns ``None``, and the checked loop replays the batch.

**SAM** (an optimiser with ``requires_closure``, SAR): the closure re-evaluates the loss at the perturbed point (on a
throw-away view of the objective's state); if that second pass is not finite, the step is undone from its
:data:`~hf_tta.state.STEP_UNDO` capture. A non-finite step restores the objective's state from the step's
:data:`~hf_tta.state.STEP_OBJECTIVE` view.

**A step rule** (:class:`StepRule`, the online lr rule of :mod:`hf_tta.lr_online`) runs in the checked loop only:
``before_step`` after a finite backward (it may set the lr), ``after_step(kept)`` once the step is kept or undone.

**Gradient decoupling** (REST Eq. 15-17, :mod:`hf_tta.gradient_decoupling`): the backward also takes the gradient of
``KL(source || adapted)``, projects out the conflicting component and scales the step size by ``W_d``.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from typing import Callable, Iterable, Protocol

import torch
from torch import nn

from .gradient_decoupling import apply_gradient_decoupling, scaled_step_size
from .objectives.base import LossOutput, Objective, ObjectiveInputs
from .outputs import PassCounts, float_logs
from .state import STEP_OBJECTIVE, STEP_UNDO, Adaptable, AdapterState

logger = logging.getLogger(__name__)

MakeInputs = Callable[[int], ObjectiveInputs]


class Penalty(Protocol):
    """A term added to every step's loss, logged under ``name`` (:class:`hf_tta.tuning.Anchor`,
    :class:`hf_tta.tuning.SourceConsistency`)."""

    name: str

    def value(self, inputs: ObjectiveInputs) -> torch.Tensor: ...


class StepRule(Protocol):
    """A hook around each optimiser step that is taken (see :mod:`hf_tta.loop`)."""

    def before_step(self, optimizer: torch.optim.Optimizer) -> None: ...

    def after_step(self, kept: bool) -> None: ...


@dataclass
class GradientDecoupling:
    """REST's gradient decoupling settings (``TTAConfig.gradient_decoupling``, ``gd_per_tensor``, ``gd_weight_on``)."""

    objective: str
    per_tensor: bool = False
    weight_on: str = "step_size"


@dataclass
class LoopResult:
    """What the steps of one batch produced: the last step's inputs and detached scores, and what was updated.
    ``first_loss``: the first step's loss, at the parameters the batch found (the prequential loss that
    :mod:`hf_tta.lr_search`'s ``next_loss`` proxy reads); ``None`` when that step had no loss."""

    inputs: ObjectiveInputs
    scores: torch.Tensor
    loss: float | None
    num_updates: int
    n_selected: int
    skipped: list[str] = field(default_factory=list)
    logs: dict[str, float] = field(default_factory=dict)
    first_loss: float | None = None


class StepLoop:
    """The steps of one batch for ``objective`` (see :mod:`hf_tta.loop`).

    Args:
        objective: the objective (its ``on_step_end`` hook may ask for recovery: ``recover`` is then called).
        steps: gradient steps per batch.
        fast: use the one-sync fast path where it applies.
        gradient_decoupling: REST's gradient decoupling, or ``None``.
        reduce_gradients: called on the adapted parameters after each backward (the distributed all-reduce).
        penalties: terms added to every step's loss (``penalty.value(inputs)``, e.g. :class:`hf_tta.tuning.Anchor`'s
            pull towards the source weights), each logged under its ``name``.
        passes: the meter of queries in backward passes (:class:`~hf_tta.outputs.PassCounts`; its ``backward``
            counts here, gradient decoupling's second gradient once more).
    """

    def __init__(
        self,
        objective: Objective,
        steps: int,
        fast: bool = False,
        gradient_decoupling: GradientDecoupling | None = None,
        reduce_gradients: Callable[[list[nn.Parameter]], None] | None = None,
        penalties: Iterable[Penalty] = (),
        passes: PassCounts | None = None,
    ):
        self.objective, self.steps, self.fast, self.penalties = objective, steps, fast, tuple(penalties)
        self.passes = passes if passes is not None else PassCounts()
        self.gradient_decoupling, self.reduce_gradients = gradient_decoupling, reduce_gradients

    def run(
        self, target: Adaptable, params: dict[str, nn.Parameter], make_inputs: MakeInputs, recover: Callable[[], None],
        rule: StepRule | None = None,
    ) -> LoopResult:
        """Run the batch's steps on ``target`` (its optimiser and objective state), with ``make_inputs(step)``; a
        ``rule`` around each step taken (the checked loop)."""
        if rule is None and self.fast_applies(target.optimizer):
            result = self._run_fast(target, params, make_inputs)
            if result is not None:
                return result
        return self._run_checked(target, params, make_inputs, recover, rule)

    def fast_applies(self, opt: torch.optim.Optimizer | None) -> bool:
        """The fast path holds for ``opt``: a fused AdamW, no closure (SAM), no gradient decoupling or reduce hook, and
        no ``on_step_end`` hook (SAR's recovery)."""
        return bool(
            self.fast and opt is not None and all(g.get("fused") for g in opt.param_groups)
            and not getattr(opt, "requires_closure", False) and self.gradient_decoupling is None
            and self.reduce_gradients is None and type(self.objective).on_step_end is Objective.on_step_end
        )

    # ------------------------------------------------------------------------------------------ checked loop
    def _run_checked(
        self, target: Adaptable, params: dict[str, nn.Parameter], make_inputs: MakeInputs, recover: Callable[[], None],
        rule: StepRule | None = None,
    ) -> LoopResult:
        skipped: list[str] = []
        updates, last_loss, first_loss, res, scores, inputs = 0, None, None, None, None, None
        opt = target.optimizer
        for step in range(self.steps):
            inputs = make_inputs(step)
            before = AdapterState.view(target, STEP_OBJECTIVE)  # the objective's state as the step found it
            res = self.evaluate(inputs, target.state)
            scores = (res.scores if res.scores is not None else inputs.scores).detach()
            last_loss = None if res.loss is None else float(res.loss.detach())
            first_loss = last_loss if step == 0 else first_loss
            reason = skip_reason(res)
            if reason is None:
                opt.zero_grad(set_to_none=True)
                res.logs.update(self.backward(res, inputs, params))
                if not grads_finite(params.values()):
                    reason = "non-finite gradient"
            if reason is not None:
                opt.zero_grad(set_to_none=True)
                if reason.startswith("non-finite"):  # nothing computed from a diverged step is kept
                    before.apply(target)
                skipped.append(f"step {step}: {reason}")
                continue
            closure = undo = fault = None
            if rule is not None:
                rule.before_step(opt)
            if getattr(opt, "requires_closure", False):  # SAM: a second pass inside the step
                undo, fault = AdapterState.capture(target, STEP_UNDO), []
                closure = self._closure(target, params, make_inputs, step, fault)
            with scaled_step_size(opt, self._step_factor(res)):  # GD's W_d on the step size
                opt.step(closure)
            opt.zero_grad(set_to_none=True)
            if rule is not None:
                rule.after_step(not fault)
            if fault:  # the second pass diverged: undo the step
                undo.apply(target)
                skipped.append(f"step {step}: {fault[0]} in the second (SAM) pass")
                continue
            updates += 1
            if self.objective.on_step_end(inputs, res, target.state):
                recover()
                opt = target.optimizer
        return LoopResult(inputs, scores, last_loss, updates, int(res.n_selected), skipped, float_logs(res.logs), first_loss)

    def evaluate(self, inputs: ObjectiveInputs, state: dict) -> LossOutput:
        """The objective's output at the current parameters, with the penalties added to its loss."""
        res = self.objective(inputs, state)
        for penalty in self.penalties if res.loss is not None else ():
            value = penalty.value(inputs)
            res = dataclasses.replace(res, loss=res.loss + value, logs={**res.logs, penalty.name: value.detach()})
        return res

    def backward(self, res: LossOutput, inputs: ObjectiveInputs, params: dict[str, nn.Parameter]) -> dict[str, torch.Tensor]:
        """``loss.backward()``, then gradient decoupling when configured, then the gradient-reduce hook."""
        gd = self.gradient_decoupling
        rows = int(inputs.query_emb.shape[0])
        if gd is None:
            res.loss.backward()
            self.passes.backward += rows
            logs: dict[str, torch.Tensor] = {}
        else:
            res.loss.backward(retain_graph=True)  # G_r = grad KL(p_S || p) is taken through the same graph
            logs = apply_gradient_decoupling(res, params, inputs.source_scores, gd.per_tensor, gd.objective, weight_on=gd.weight_on)
            self.passes.backward += 2 * rows  # G_d, then G_r through the same graph
        if self.reduce_gradients is not None:
            self.reduce_gradients(list(params.values()))
        return logs

    def _step_factor(self, res: LossOutput) -> torch.Tensor | None:
        """Gradient decoupling's ``W_d`` when it scales the step size (``gd_weight_on="step_size"``), else ``None``."""
        gd = self.gradient_decoupling
        return res.logs.get("gd_weight") if gd is not None and gd.weight_on == "step_size" else None

    def _closure(
        self, target: Adaptable, params: dict[str, nn.Parameter], make_inputs: MakeInputs, step: int, fault: list[str]
    ) -> Callable[[], torch.Tensor]:
        """Re-evaluates the loss at the optimiser's current point (SAM); a diverged pass is recorded in ``fault``."""

        def closure() -> torch.Tensor:
            target.optimizer.zero_grad(set_to_none=True)
            inputs = dataclasses.replace(make_inputs(step), in_closure=True)
            res = self.evaluate(inputs, AdapterState.view(target, STEP_OBJECTIVE).objective)  # a throw-away state
            loss = res.loss if res.loss is not None and res.n_selected > 0 else None
            if loss is None:  # nothing selected: SAR's code still takes its zero-gradient base step
                return torch.tensor(float("nan"))
            if not torch.isfinite(loss.detach()):
                fault.append("non-finite loss")
                return torch.tensor(float("nan"))
            self.backward(res, inputs, params)
            if not grads_finite(params.values()):
                fault.append("non-finite gradient")
            return loss.detach()

        return closure

    # ------------------------------------------------------------------------------------------ fast path
    def _run_fast(self, target: Adaptable, params: dict[str, nn.Parameter], make_inputs: MakeInputs) -> LoopResult | None:
        """The checked loop with one host sync per batch; ``None`` (state restored) when a step was non-finite."""
        undo = AdapterState.capture(target, STEP_UNDO)
        opt = target.optimizer
        flags: list[tuple[int, torch.Tensor]] = []  # (step, 0 update | 1 nothing selected | 2 non-finite loss | 3 grad)
        skipped: dict[int, str] = {}  # skips decided without the device
        res = inputs = scores = first = None
        for step in range(self.steps):
            inputs = make_inputs(step)
            before = AdapterState.view(target, STEP_OBJECTIVE)
            res = self.evaluate(inputs, target.state)
            first = res.loss if step == 0 else first
            scores = (res.scores if res.scores is not None else inputs.scores).detach()
            n_sel = res.n_selected
            if res.loss is None or not res.loss.requires_grad or (not torch.is_tensor(n_sel) and n_sel == 0):
                reason = skip_reason(res)  # decided on the host (at most one sync, only in these cases)
                if reason.startswith("non-finite"):
                    before.apply(target)
                skipped[step] = reason
                continue
            opt.zero_grad(set_to_none=True)
            res.loss.backward()
            self.passes.backward += int(inputs.query_emb.shape[0])
            grads = [p.grad for p in params.values() if p.grad is not None]
            flag = torch.where(torch.isfinite(res.loss.detach()).all(), 0, 2)
            if grads:
                finite_grad = torch.isfinite(torch.stack(torch._foreach_norm(grads))).all()
                flag = torch.where((flag == 0) & ~finite_grad, 3, flag)
            if torch.is_tensor(n_sel):
                flag = torch.where(n_sel == 0, 1, flag)
            opt.found_inf = (flag != 0).float()
            try:
                opt.step()
            finally:
                del opt.found_inf
            opt.zero_grad(set_to_none=True)
            flags.append((step, flag))
        # the one sync: step flags, last loss, selected count and logs in one device-to-host transfer
        named = {f"flag.{s}": f for s, f in flags}
        named.update({f"log.{k}": v for k, v in res.logs.items()})
        named["loss"], named["n_selected"], named["first_loss"] = res.loss, res.n_selected, first
        on_device = {k: v for k, v in named.items() if torch.is_tensor(v) and v.device.type != "cpu"}
        values = {k: v.item() if torch.is_tensor(v) else v for k, v in named.items() if k not in on_device}
        if on_device:
            stacked = torch.stack([v.detach().reshape(()).to(torch.float64) for v in on_device.values()]).tolist()
            values.update(zip(on_device, stacked))
        codes = {s: int(values[f"flag.{s}"]) for s, _ in flags}
        if any(c >= 2 for c in codes.values()):
            undo.apply(target)
            return None
        skipped.update({s: "no query selected" for s, c in codes.items() if c == 1})
        skipped_list = [f"step {s}: {skipped[s]}" for s in sorted(skipped)]
        logs = {k[len("log.") :]: v for k, v in values.items() if k.startswith("log.")}
        loss = None if res.loss is None else values["loss"]
        first_loss = None if first is None else values["first_loss"]
        return LoopResult(inputs, scores, loss, self.steps - len(skipped_list), int(values["n_selected"]), skipped_list,
                          float_logs(logs), first_loss)


def skip_reason(res: LossOutput) -> str | None:
    """The one skip rule's host-side part: why a step must not update (``None`` if it may)."""
    if res.n_selected == 0:
        return "no query selected"
    if res.loss is None or not torch.isfinite(res.loss.detach()).all():
        return "non-finite loss"
    if not res.loss.requires_grad:
        return "loss does not depend on the adapted parameters"
    return None


def grads_finite(params: Iterable[nn.Parameter]) -> bool:
    """One device sync for all gradients (not one per tensor)."""
    grads = [p.grad for p in params if p.grad is not None]
    return not grads or bool(torch.isfinite(torch.stack(torch._foreach_norm(grads))).all())

