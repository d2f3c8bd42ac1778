"""An online learning-rate rule (selector (c) of issue 37): the multiplicative hypergradient rule of Baydin et al. 2018,
"Online Learning Rate Adaptation with Hypergradient Descent" (ICLR 2018), on the lr of the :mod:`hf_tta.lr_search`.

``LRSearchConfig(online="hypergradient")`` moves the lr in use at every optimiser step after the probe's commit (or
from the first batch with ``probe_batches=0``), by

    alpha_t = alpha_{t-1} * (1 - beta * cos(g_t, u_{t-1})),    clamped to [lowest candidate, highest candidate],

where ``g_t`` is the gradient the step is about to use (after the backward, before ``optimizer.step``: after gradient
decoupling's projection, before SAM's perturbation) and ``u_{t-1} = theta_t - theta_{t-1}`` the actual change of the
previous kept optimiser step, both flattened over every tensor the optimiser steps (the adapted parameters and, for
ClipTTA, its alpha). ``beta`` is ``hypergradient_rate`` (default :data:`DEFAULT_HYPERGRADIENT_RATE`, set a priori,
before any measurement: a step moves the lr by at most 2 %, so a decade takes about 116 steps).

**The sign.** The paper writes the update as ``theta_t = u(Theta_{t-1}, alpha_t)`` and descends on the lr with the
hypergradient ``h_t = d f(theta_{t-1}) / d alpha = grad f(theta_{t-1}) . grad_alpha u(Theta_{t-2}, alpha_{t-1})``:
``alpha_t = alpha_{t-1} - beta h_t`` (the additive rule of SGD-HD and Adam-HD); the paper's multiplicative rule
normalises ``h_t`` by the two vectors' norms: ``alpha_t = alpha_{t-1} (1 - beta h_t / (|grad f| |grad_alpha u|))``.
Every optimiser here makes a step proportional to its lr: AdamW's ``-alpha (m_hat / (sqrt(v_hat) + eps) + lambda
theta)`` (decoupled weight decay scales with the lr too), a parameter group's ``lr_multipliers`` factor, gradient
decoupling's ``W_d`` and SAM's base step alike, so ``grad_alpha u_{t-1} = u_{t-1} / alpha_{t-1}`` and, alpha being
positive, ``h_t / (|g_t| |grad_alpha u|) = cos(g_t, u_{t-1})``. With ``u`` the *actual* change no optimiser internals
are needed (Adam-HD's direction has no weight decay; here AdamW's decoupled decay is part of the step, as it is part
of what the lr scales). Overshoot: the new gradient points back along the last step (``g_t`` aligned with ``u_{t-1}``, cos > 0),
the lr shrinks; still descending the same way (``u_{t-1}`` along ``-g_t``, cos < 0), it grows.

**Where it runs.** On the committed (served) stream only: the probe's shadows keep their candidate lrs (so each is a
fixed-lr run), the probe's choice is the rule's starting lr. Without a probe (``probe_batches=0``) the rule starts at
the candidate nearest the base lr (``TTAConfig.lr`` or the model's default; with the default grid, the base lr
itself). A step's lr is the rule's; the first step after a start, a safety reset or SAR's recovery has no ``u`` and
keeps the lr. A step that the loop skips (nothing selected, a non-finite loss or gradient, SAM's diverged second pass)
changes neither the lr nor ``u``. The rule runs in the checked loop (:mod:`hf_tta.loop`): it reads the gradient and
sets the lr on the host at each step, so a batch of the served stream does not take the one-sync fast path.

**Cost**: none in passes (it reads the gradient the step computed); per step two flat copies of the optimised tensors
(the LayerNorms: small) and one host sync.

**State** (:data:`~hf_tta.state.SELECTOR`, ``selector.*`` in a checkpoint): the lr in use (``lr``, which the
back-off also scales), ``online.u`` (``u_{t-1}``, float32), and the trace's summary ``online.updates`` (the steps
the rule ran on: those with a last step), ``online.lr_min``, ``online.lr_max``: saved and resumed bit-exactly,
restored by a rollback, cleared by ``reset()``; a safety reset keeps the lr and drops ``u`` (the parameters jumped back to the source). Each change is
logged at debug level; ``TTAOutput.logs`` carry ``lr_search.lr`` (the lr in use after the batch), ``lr_search.lr_min``,
``lr_search.lr_max`` and ``lr_search.cos`` (the mean cosine of the batch's steps that had a ``u``; absent if none).
"""

from __future__ import annotations

import logging
import math
from typing import Any

import torch

from . import tuning
from .lr_search_config import DEFAULT_HYPERGRADIENT_RATE, ONLINE_RULES, check_online  # noqa: F401 (their old home)

logger = logging.getLogger(__name__)


def cosine(grad: torch.Tensor, update: torch.Tensor) -> float:
    """``cos(grad, update)`` in float64; 0 when either vector is zero (no direction: the lr stays)."""
    g, u = grad.double(), update.double()
    norm = float(g.norm() * u.norm())
    return float(g @ u) / norm if norm > 0 else 0.0


def hypergradient_lr(lr: float, grad: torch.Tensor, update: torch.Tensor, rate: float, low: float,
                     high: float) -> tuple[float, float]:
    """The multiplicative rule (see :mod:`hf_tta.lr_online`): ``(alpha_t, cos)`` with
    ``alpha_t = clamp(lr * (1 - rate * cos(grad, update)), low, high)``.

    Example:
        >>> g, u = torch.tensor([1.0, 0.0]), torch.tensor([-1.0, 0.0])  # still descending: the lr grows
        >>> hypergradient_lr(1e-3, g, u, 0.02, 1e-4, 1e-2)
        (0.00102, -1.0)
    """
    cos = cosine(grad, update)
    return min(max(lr * (1.0 - rate * cos), low), high), cos


def flat(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The tensors flattened into one float32 vector (a copy)."""
    return torch.cat([t.detach().reshape(-1).float() for t in tensors])


class HypergradientRule:
    """The rule's step hook for :class:`hf_tta.loop.StepLoop` (``before_step`` after a finite backward, ``after_step``
    once the step is kept or undone), acting on an :class:`~hf_tta.lr_search.LRSearch`'s state and optimiser lr."""

    def __init__(self, search: Any):
        self.search = search
        self.cosines: list[float] = []  # this batch's (logs only, not state)
        self._pending: tuple[float, float, list[torch.Tensor], torch.Tensor] | None = None

    def before_step(self, optimizer: torch.optim.Optimizer) -> None:
        """The new lr from this step's gradient and the last step's change, put into the optimiser."""
        s = self.search
        tensors = [p for group in optimizer.param_groups for p in group["params"]]
        state, lr = s._state, float(s._state["lr"])
        new, cos = lr, math.nan
        u = state.get("online.u")
        if u is not None:
            grad = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).detach().reshape(-1).float()
                              for p in tensors])
            if grad.shape == u.shape:
                new, cos = hypergradient_lr(lr, grad, u.to(grad.device), s.config.rate, s.candidates[0], s.candidates[-1])
        self._pending = (new, cos, tensors, flat(tensors))
        if new != lr:
            s.set_lr(new)

    def after_step(self, kept: bool) -> None:
        """Keep the new lr and the step's change (``kept``), or put the lr back (the step was undone)."""
        if self._pending is None:
            return
        s, (new, cos, tensors, before) = self.search, self._pending
        self._pending = None
        state = s._state
        old = float(state["lr"])
        if not kept:
            s.set_lr(old)
            return
        f64 = (lambda v: torch.tensor(v, dtype=torch.float64))
        lo, hi = float(state.get("online.lr_min", old)), float(state.get("online.lr_max", old))
        updates = int(state.get("online.updates", 0)) + (not math.isnan(cos))
        s.wrapper.selector_state = {**state, "lr": f64(new), "online.u": flat(tensors) - before,
                                    "online.updates": torch.tensor(updates), "online.lr_min": f64(min(lo, new)),
                                    "online.lr_max": f64(max(hi, new))}
        if not math.isnan(cos):
            self.cosines.append(cos)
            logger.debug("lr_search: hypergradient: cos(g, u) = %+.4f: lr %.6g -> %.6g", cos, old, new)


class OnlineMixin:
    """What :class:`~hf_tta.lr_search.LRSearch` adds for the online rule (see :mod:`hf_tta.lr_online`)."""

    config: Any
    candidates: list[float]
    base_lr: float
    wrapper: Any
    active: float | None

    @property
    def _state(self) -> dict[str, torch.Tensor]:
        return self.wrapper.selector_state

    @property
    def _committed(self) -> bool:
        return int(self._state.get("chosen", -1)) >= 0

    @property
    def probing(self) -> bool:
        """Whether the next batch is a probe batch (no lr chosen since the last reset; never with ``probe_batches=0``)."""
        return self.config.probe_batches > 0 and not self._committed

    def set_lr(self, lr: float) -> None:
        """Put ``lr`` (times each group's ``lr_multipliers`` factor) into the wrapper's optimiser; a rebuilt optimiser
        (a reset, SAR's recovery inside a shadow's steps) gets it too (:attr:`active`)."""
        w = self.wrapper
        self.active = lr
        if w.optimizer is None:
            return
        factors = [g["lr"] for g in tuning.param_groups(w.params, 1.0, w.config.tuning.lr_multipliers)]
        for i, group in enumerate(w.optimizer.param_groups):
            group["lr"] = lr * (factors[i] if i < len(factors) else 1.0)


    @property
    def online_rule(self) -> HypergradientRule | None:
        """The step hook the served stream's loop runs (``None``: no online rule, or the probe runs)."""
        if self.config.online is None or self.probing:
            return None
        if getattr(self, "_rule", None) is None:
            self._rule = HypergradientRule(self)
        return self._rule

    def batch_rule(self) -> HypergradientRule | None:
        """:attr:`online_rule` for the batch about to run (its logged cosines start afresh)."""
        rule = self.online_rule
        if rule is not None:
            rule.cosines = []
        return rule

    def start_index(self) -> int:
        """The candidate a stream without a probe starts at: nearest the base lr with the online rule (ties: the
        lower), the highest with the back-off alone."""
        if self.config.online is None:
            return len(self.candidates) - 1
        return min(range(len(self.candidates)), key=lambda k: (abs(math.log(self.candidates[k] / self.base_lr)), k))

    def trace_of(self, lr: float | None) -> dict[str, float | int | None]:
        """The lr trace's summary since the start or commit, ``lr`` being the lr in use: ``lr``, ``lr_min``, ``lr_max``
        and ``updates`` (steps the online rule ran on: those with a last step); ``None`` values before the start."""
        st = self._state
        return {"lr": lr, "lr_min": float(st.get("online.lr_min", lr)) if lr is not None else None,
                "lr_max": float(st.get("online.lr_max", lr)) if lr is not None else None,
                "updates": int(st.get("online.updates", 0))}

    def forget_update(self) -> None:
        """Drop ``u_{t-1}`` (a safety reset or SAR's recovery moved the parameters: the next step has no last step)."""
        if "online.u" in self._state:
            self.wrapper.selector_state = {k: v for k, v in self._state.items() if k != "online.u"}

    def batch_logs(self, lr: float | None) -> dict[str, float]:
        """The lr's entries of a served batch's ``TTAOutput.logs`` (see :mod:`hf_tta.lr_online`), ``lr`` being the lr
        in use (``None`` before the commit: none)."""
        if lr is None:
            return {}
        logs = {"lr_search.lr": float(lr)}
        if self.config.online is not None:
            rule, trace = getattr(self, "_rule", None), self.trace_of(lr)
            cosines = rule.cosines if rule is not None else []
            logs.update({"lr_search.lr_min": trace["lr_min"], "lr_search.lr_max": trace["lr_max"]})
            if cosines:  # (absent when no step had a last step to compare with)
                logs["lr_search.cos"] = sum(cosines) / len(cosines)
        return logs
