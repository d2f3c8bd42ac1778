"""SAR: Sharpness-Aware and Reliable entropy minimisation (Niu et al., ICLR 2023, https://arxiv.org/abs/2302.12400),
applied to retrieval as TCR's baselines (Li et al., ICLR 2025): softmax over the whole gallery at tau = 0.01.

Upstream: github.com/mr-eggplant/SAR (``sar.py``, ``sam.py``); TCR's port: models/tta_baselines/sar.py.

One step is SAM's two passes, run through the wrapper's optimiser-closure path (no copy of the loop):
  1. first pass (the wrapper's forward): entropy E over the gallery; reliable queries E < E_0; loss = mean E over
     them; backward; :class:`SAM` moves the parameters to the worst case theta + rho g/||g|| (rho = 0.05);
  2. second pass (the closure, ``ObjectiveInputs.in_closure``): entropies E2 at the perturbed point; queries reliable in
     pass 1 *and* with E2 < E_0; backward; SAM restores theta and the base optimiser (AdamW) steps with that gradient;
  3. model recovery (``on_step_end``): an exponential moving average (0.9) of the second loss; below
     ``reset_constant`` = 0.2 the wrapper restores the source parameters and a fresh optimiser.

Selection (``selection``):
  * ``"tcr_port"`` (default; SAR as TCR's baseline port ran it, github.com/XLearning-SCU/2025-ICLR-TCR,
    models/tta_baselines/sar.py, ``margin_e0=0.40`` read as a batch fraction): pass 1 keeps the k-th smallest entropy
    and below, k = int(0.4 B), ``E <= E_k`` (sar.py:85-90; 25 of 64; a linearly interpolated 0.4-quantile with ``<``
    would keep 26). When the second pass keeps nothing, the port sets ``loss_second = torch.tensor(0.0)`` (sar.py:113)
    and feeds that 0.0 to the EMA (sar.py:117-118), so the EMA drops to 0.9 x its value (to 0.0 on the first update)
    and model recovery fires as soon as that is below ``reset_constant`` (sar.py:125-128; at once on the first
    update). Its backward reaches no parameter, so SAM's second step, which skips parameters without a gradient
    (sar.py:181-183), neither restores them nor lets AdamW step them: the parameters stay at the perturbed point
    theta + rho g/||g|| until a recovery. (That holds with PyTorch >= 2.0, where ``first_step(zero_grad=True)`` sets the
    gradients to ``None``; under 1.x they would be zero tensors, restored and stepped. We follow the code as it runs
    today.) Here :class:`SAM` built with ``restore_without_grad=False`` does the same;
  * ``"paper"``: E_0 = 0.4 ln C with C the gallery size, ``E < E_0``; an empty second pass leaves the EMA alone (SAR's
    ``if not np.isnan(loss_second)``) and SAM restores theta and takes a zero-gradient base step (SAR's NaN mean over
    no query back-propagates zero gradients).
The second pass reuses the first pass's threshold (``E2 < E_0``) in both. With ``TTAConfig(window=W)`` the
``"tcr_port"`` threshold is the k-th smallest entropy of the batch and the window's W recent queries, k = int(0.4 (B + W))
(:mod:`hf_tta.window`); the ``"paper"`` threshold is per query and the EMA runs over the stream: unchanged.

Difference from the reference code: after a recovery SAR re-assigns the triggering EMA (so the next step usually
resets again); here the EMA starts afresh, as ``reset()`` intends.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .. import window
from ..configuration_utils import check_choice, check_fraction, check_positive
from .base import (
    SELECTIONS,
    LossOutput,
    Objective,
    ObjectiveConfig,
    ObjectiveInputs,
    ObjectiveState,
    config_field,
    gallery_tau_field,
    log_classes_margin,
    lowest_fraction,
    register_objective,
    softmax_entropy,
)


@dataclass
class SARConfig(ObjectiveConfig):
    tau: float = gallery_tau_field()
    selection: str = config_field(
        "tcr_port",
        "'tcr_port' (default; TCR's port): keep the lowest margin_e0 fraction (k-th smallest, <=); an empty second pass "
        "feeds 0.0 to the EMA and leaves the parameters perturbed. 'paper' (SAR): keep E < margin_e0 * ln C.",
    )
    margin_e0: float = config_field(0.4, "Entropy margin: batch fraction kept ('tcr_port': 0.40) or fraction of ln C ('paper': 0.4 ln C).")
    rho: float = config_field(0.05, "SAM neighbourhood radius (SAR: 0.05).")
    adaptive: bool = config_field(False, "Adaptive SAM (element-wise scaling by |theta|); SAR: False.")
    reset_constant: float = config_field(0.2, "Model recovery when the EMA of the second loss falls below this (SAR: 0.2).")
    ema_momentum: float = config_field(0.9, "Momentum of that EMA (SAR: 0.9).")

    def __post_init__(self):
        super().__post_init__()
        check_positive("tau", self.tau)
        check_positive("margin_e0", self.margin_e0)
        check_positive("rho", self.rho)
        check_positive("reset_constant", self.reset_constant, allow_zero=True)
        check_fraction("ema_momentum", self.ema_momentum)
        check_choice("selection", self.selection, SELECTIONS)


class SAM(torch.optim.Optimizer):
    """Sharpness-Aware Minimisation (Foret et al., ICLR 2021) around a base optimiser, for the wrapper's closure path.

    ``step(closure)``: ascend to ``theta + rho * g / ||g||`` with the gradient already in ``.grad``, re-evaluate the
    loss and its gradient there (``closure``), restore ``theta`` exactly, and let the base optimiser step with the
    perturbed gradient. State and ``state_dict`` are the base optimiser's (so checkpoints hold AdamW's moments).

    A parameter the closure left without a gradient (its pass selected nothing) is restored and stepped with a zero
    gradient when ``restore_without_grad`` (SAR's code); otherwise it is skipped, left at the perturbed point and not
    stepped (TCR's port, sar.py:181-185, with PyTorch >= 2.0 gradients set to ``None``).
    """

    requires_closure = True

    def __init__(self, params, base_optimizer: type[torch.optim.Optimizer] = torch.optim.AdamW, rho: float = 0.05,
                 adaptive: bool = False, restore_without_grad: bool = True, **kwargs):
        if rho < 0:
            raise ValueError(f"`rho` must be >= 0, got {rho}.")
        super().__init__(params, dict(rho=rho, adaptive=adaptive, **kwargs))
        self.base_optimizer = base_optimizer(self.param_groups, **kwargs)
        self.param_groups = self.base_optimizer.param_groups
        self.state = self.base_optimizer.state
        self._origin: dict[torch.Tensor, torch.Tensor] = {}
        self.restore_without_grad = restore_without_grad

    @torch.no_grad()
    def _grad_norm(self) -> torch.Tensor:
        norms = [
            ((torch.abs(p) if group["adaptive"] else 1.0) * p.grad).norm(p=2)
            for group in self.param_groups
            for p in group["params"]
            if p.grad is not None
        ]
        return torch.stack(norms).norm(p=2) if norms else torch.zeros(())

    @torch.no_grad()
    def first_step(self) -> None:
        grad_norm = self._grad_norm()
        for group in self.param_groups:
            scale = group["rho"] / (grad_norm + 1e-12)
            for p in group["params"]:
                if p.grad is None:
                    continue
                self._origin[p] = p.detach().clone()
                p.add_((torch.pow(p, 2) if group["adaptive"] else 1.0) * p.grad * scale.to(p))

    @torch.no_grad()
    def second_step(self) -> None:
        for p, origin in self._origin.items():
            if p.grad is None:  # the closure selected nothing
                if not self.restore_without_grad:
                    continue  # TCR's port: left perturbed, and the base optimiser skips it (sar.py:182)
                p.grad = torch.zeros_like(p)  # SAR's code: restored, then a zero-gradient base step
            p.copy_(origin)
        self._origin = {}
        self.base_optimizer.step()

    def step(self, closure: Callable[[], torch.Tensor] | None = None):
        if closure is None:
            raise ValueError("SAM needs a closure that re-evaluates the loss (the TTAWrapper passes one).")
        self.first_step()
        with torch.enable_grad():
            loss = closure()
        self.second_step()
        return loss

    def state_dict(self):
        return self.base_optimizer.state_dict()

    def load_state_dict(self, state_dict) -> None:
        self.base_optimizer.load_state_dict(state_dict)
        self.param_groups = self.base_optimizer.param_groups
        self.state = self.base_optimizer.state


@register_objective("sar", SARConfig)
class SAR(Objective):
    """Reliable (filtered) entropy minimisation with SAM and EMA-triggered model recovery."""

    def __init__(self, config=None):
        super().__init__(config)
        # Scratch shared by the two passes of one step (set by pass 1, consumed by pass 2 and on_step_end). It never
        # outlives the step, so it is not part of the saved state.
        self._first_pass: dict[str, torch.Tensor] | None = None
        self._second_loss: torch.Tensor | None = None

    @property
    def first_pass_selection(self) -> torch.Tensor | None:
        """The reliable-query mask of the first pass of the step in progress (``None`` between steps)."""
        return None if self._first_pass is None else self._first_pass["selected"]

    def init_state(self, device="cpu") -> ObjectiveState:
        return {"ema": torch.zeros(0, device=device)}  # empty = no EMA yet

    def make_optimizer(self, params, lr: float, weight_decay: float) -> torch.optim.Optimizer:
        c = self.config
        return SAM(params, torch.optim.AdamW, rho=c.rho, adaptive=c.adaptive, restore_without_grad=c.selection == "paper",
                   lr=lr, weight_decay=weight_decay)

    def __call__(self, inputs: ObjectiveInputs, state: ObjectiveState) -> LossOutput:
        c = self.config
        logits = inputs.scores / c.tau
        entropy = softmax_entropy(logits)
        if inputs.in_closure and self._first_pass is not None:  # pass 2, at the perturbed parameters
            threshold, first = self._first_pass["threshold"], self._first_pass["selected"]
            selected = first & (entropy.detach() < threshold)
            if not selected.any():
                # tcr_port: loss_second = 0.0 enters the EMA (sar.py:113, 117-118); paper: the EMA does not move
                self._second_loss = entropy.new_zeros(()).detach() if c.selection == "tcr_port" else None
                return LossOutput(loss=None, n_selected=0)
            loss = entropy[selected].mean()
            self._second_loss = loss.detach()
            return LossOutput(loss=loss, n_selected=int(selected.sum()), logits=logits, temperature=c.tau)
        if c.selection == "tcr_port":
            selected, threshold = lowest_fraction(entropy, c.margin_e0, window.entropies(inputs, c.tau))
        else:
            threshold = log_classes_margin(c.margin_e0, entropy, logits.shape[1])
            selected = entropy.detach() < threshold
        self._first_pass = {"threshold": threshold, "selected": selected}
        self._second_loss = None
        logs = {"selected": selected.sum(), "entropy_margin": threshold}
        if not selected.any():
            return LossOutput(loss=None, n_selected=0, logs=logs)
        return LossOutput(
            loss=entropy[selected].mean(), n_selected=int(selected.sum()), logits=logits, temperature=c.tau, logs=logs
        )

    def on_step_end(self, inputs: ObjectiveInputs, output: LossOutput, state: ObjectiveState) -> bool:
        """Update the EMA of the second loss; ask for recovery (source parameters) when it falls below the constant."""
        second, self._second_loss, self._first_pass = self._second_loss, None, None
        if second is None or not torch.isfinite(second):  # a diverged pass 2 never enters the EMA
            return False
        ema = state["ema"]
        m = self.config.ema_momentum
        new = second.to(ema) if ema.numel() == 0 else m * ema + (1 - m) * second.to(ema)
        output.logs["ema"] = new
        if new.item() < self.config.reset_constant:
            state["ema"] = ema.new_zeros(0)
            output.logs["recovered"] = 1.0
            return True
        state["ema"] = new
        return False
