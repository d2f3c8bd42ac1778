"""An update budget: adapt on some batches only, answer every batch (``TTAConfig(update_budget={...})``).

Every adapted batch costs ``steps`` forward and backward passes (TCR: 3 + 3). Sparse-update methods (SNAP, NeurIPS
2025) and EATA's sample selection save time only if the skipped queries skip the kernel, not just the loss. With an
update budget a batch is either adapted on as usual, or **skipped**: the current model answers it from one no-grad
forward, and nothing else runs (no backward, no optimiser step, no source-model forward for the safety layer).

Two rules, one of them per budget (:class:`UpdateBudgetConfig`):

* ``fraction``: a deterministic share of the batches, evenly spaced by the wrapper's batch counter ``i`` (the batches
  since the last reset, saved with the checkpoint): batch ``i`` is adapted on iff ``ceil((i + 1) f) > ceil(i f)``,
  computed in exact rational arithmetic. So batch 0 is adapted on, and after ``n`` batches exactly ``ceil(n f)`` were
  (``f = 0.25``: batches 0, 4, 8, ...). No random draw: a resumed stream takes the same decisions.
* ``entropy_threshold``: a label-free trigger. The current model's one no-grad forward scores the batch; the batch is
  adapted on iff the mean over its queries of the normalised prediction entropy ``H(softmax(s / T)) / ln C`` (``C``
  the gallery size, or the candidate set's with a top-k backend; ``T = entropy_temperature``, 0.01 as TCR's gallery
  softmax) exceeds the threshold: the model is unsure of the batch. Below it, that forward is the answer. Above it,
  the batch adapts as usual, after one extra no-grad forward (the trigger's).

**What a skipped batch changes.** Nothing of the adaptation: parameters, optimiser, objective state (and the window's
rows), the RNG and the safety monitor stay bit-identical; the batch counter advances (the schedule goes on), and the
score transform (DN, NNN, QB-Norm) scores the answer and takes the batch into its state, as it does for every
answered batch. The safety layer does not judge a skipped batch (nothing is adapted on it, so there is nothing to roll
back, and judging it would cost the source model's forward the budget saves). ``TTAOutput.skipped`` names the rule, and
on a skipped batch ``TTAOutput.logs["update_budget_entropy"]`` holds the trigger's value (an adapted batch's logs are
the objective's).

**Where it applies.** :class:`~hf_tta.TTAWrapper` and what runs its step: each domain of a
:class:`~hf_tta.RoutedTTAWrapper` keeps its own batch counter, so its own schedule; a
:class:`~hf_tta.DistributedTTAWrapper`'s ranks see the same counter and the same all-gathered scores, so they decide
alike.
"""

from __future__ import annotations

import math
from typing import Callable

import torch

from .config_features import DEFAULT_TEMPERATURE, UpdateBudgetConfig, build_update_budget_config  # noqa: F401 (their old home)
from .objectives.base import ObjectiveInputs, softmax_entropy
from .policies import Answer, BatchContext, BatchPolicy


def mean_normalised_entropy(scores: torch.Tensor, temperature: float, columns: int | None = None) -> torch.Tensor:
    """Mean over the rows of ``H(softmax(s / T)) / ln C`` (0-d float64 tensor): 0 for a sure prediction, 1 for a
    uniform one. ``columns``: the first ``C`` columns only (a top-k backend's candidates, before the extras)."""
    s = scores if columns is None else scores[:, :columns]
    c = s.shape[1]
    if c < 2:
        return torch.zeros((), dtype=torch.float64, device=s.device)
    return (softmax_entropy(s.detach().double() / temperature) / math.log(c)).mean()


class UpdateBudget(BatchPolicy):
    """The budget's decision per batch, a :class:`~hf_tta.policies.BatchPolicy` (the wrapper asks it before anything
    else runs on the batch)."""

    name = "update_budget"

    def __init__(self, config: UpdateBudgetConfig):
        self.config = config

    def decide(
        self, batch_index: int, make_view: Callable[[], ObjectiveInputs]
    ) -> tuple[str | None, dict[str, float], ObjectiveInputs | None]:
        """``(why the batch is skipped or None, logs, the current model's view)`` for batch ``batch_index``.
        ``make_view()`` runs the current model's no-grad forward: called for the entropy trigger and for a batch that
        the fraction rule skips (the answer), never for a batch the fraction rule adapts on."""
        cfg = self.config
        if cfg.fraction is not None:
            if cfg.adapts_on(batch_index):
                return None, {}, None
            return f"update budget: batch {batch_index} is outside fraction={cfg.fraction} (answered, not adapted)", {}, make_view()
        view = make_view()
        columns = None if view.candidate_ids is None else view.candidate_ids.numel()
        value = float(mean_normalised_entropy(view.scores, cfg.entropy_temperature, columns))  # the one host sync
        logs = {"update_budget_entropy": value}
        if value > cfg.entropy_threshold:
            return None, logs, view
        reason = f"update budget: mean normalised entropy {value:.4g} <= {cfg.entropy_threshold} (answered, not adapted)"
        return reason, logs, view

    def begin(self, ctx: BatchContext) -> Answer | None:
        """The batch's answer when the budget skips it, else ``None`` (the batch adapts as usual). A skipped batch is
        answered from the current model's one no-grad forward (``ctx.view``); the wrapper's ``_finish`` puts it through
        the score transform, advances the batch counter and, with ``reset_policy="episodic"``, resets as after any
        batch. Nothing adapted changes; the safety layer did not judge the batch (``report_safety=False``)."""
        reason, logs, view = self.decide(ctx.batch_index, ctx.view)
        if reason is None:
            return None
        return Answer(view, view.scores, skipped=[reason], logs=logs, report_safety=False)
