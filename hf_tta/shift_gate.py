"""A shift gate: adapt, and answer with the adapted model, only while the queries are off the source distribution.

``TTAConfig(shift_gate={"threshold": 1.5})`` with reference statistics of clean, in-distribution queries
(:meth:`~hf_tta.TTAWrapper.fit_shift_gate`; no labels). Per batch the source model's **style statistics** of each
query are computed (:class:`hf_tta.router.QueryFeatures` ``"style"``: the channel-wise mean and log std of the input
of the query tower's first normalisation layer, a forward that stops there) and compared with the reference's
per-feature mean :math:`\\mu_d` and variance :math:`\\sigma^2_d`:

.. math::  T = \\frac{1}{B}\\sum_{i=1}^{B} \\frac{1}{D}\\sum_{d=1}^{D} \\frac{(f_{id} - \\mu_d)^2}{\\sigma_d^2}

the batch's mean squared z-score (``statistic="per_query"``, how far its queries are from the reference), or with
``statistic="batch_mean"`` the squared z-score of the batch's mean, :math:`T = \\frac{1}{D}\\sum_d (\\bar f_d -
\\mu_d)^2 / (\\sigma_d^2 / B)`, a two-sample test of the batch against the reference that a small shift shared by
the whole batch moves far (both are about 1 on batches drawn like the reference). ``T > threshold`` opens the gate:
the batch adapts as without the gate and is answered as without it. Otherwise the gate is closed: the **source model**
answers the batch (one no-grad forward of the source) and nothing adapts; what was adapted before stays for the next
open batch. So a stream of clean queries is answered exactly as the source model answers it, whatever the objective
would have done there, and a gradual shift is adapted to only once it is large enough to matter.

Without reference statistics the gate cannot tell a shift from the source distribution, so it stays **closed**: the
source model answers every batch, nothing adapts (never worse than the source), and the log says so once, naming the
fix (``tta.fit_shift_gate(clean_queries)``); ``TTAOutput.logs["shift_gate_statistic"]`` then holds ``nan``.

The reference (``mean``, ``var``, ``count``) is adapted state of a kind: it is saved with the wrapper's checkpoint and
kept by :meth:`~hf_tta.TTAWrapper.reset` (it describes the source distribution, not the adaptation).
"""

from __future__ import annotations

import logging
import math
from typing import Any, Iterable, Mapping

import torch

from .config_features import ShiftGateConfig
from .policies.base import Answer, BatchPolicy

logger = logging.getLogger(__name__)

#: Added to each reference variance (features that do not vary over the reference would divide by zero).
VARIANCE_FLOOR = 1e-12


class ShiftGate(BatchPolicy):
    """The gate's reference and rule, a batch policy (:mod:`hf_tta.policies`). ``fit`` takes ``(N, D)`` features of
    reference queries; ``statistic`` and ``is_open`` judge a batch's ``(B, D)`` features; ``fit_queries`` and
    :meth:`begin` do both for a wrapper, and :meth:`finish` adds the batch's statistic to its logs."""

    name = "shift_gate"

    def __init__(self, config: ShiftGateConfig):
        self.config = config
        self._judged: tuple[Any, dict[str, float]] | None = None  # (the batch's context, its gate logs)
        self.mean: torch.Tensor | None = None
        self.var: torch.Tensor | None = None
        self.count = 0
        self._warned = False
        self._features = None  # a hf_tta.router.QueryFeatures of the wrapper's query tower, made at first use

    def features(self, wrapper: Any, queries: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """The source model's ``(B, D)`` style statistics of checked query inputs (a forward that stops at the query
        tower's first normalisation layer)."""
        if self._features is None:
            from .router import QueryFeatures

            self._features = QueryFeatures(wrapper.adapter, wrapper.query_modality, "style")
        with wrapper.disabled():
            return self._features(queries)

    def fit_queries(self, wrapper: Any, queries: Mapping[str, torch.Tensor] | Iterable[Mapping[str, torch.Tensor]]) -> None:
        """Fit the reference on clean queries: a dict of input tensors (one row per query) or an iterable of such
        dicts; checked as ``adapt_step`` checks a batch, and nothing changes when one is refused."""
        from . import batch as batching

        parts = batching.chunks(queries, wrapper.config.run.gallery_batch_size) if isinstance(queries, Mapping) else queries
        feats = [self.features(wrapper, wrapper.forward.check_inputs(q, wrapper.query_modality)) for q in parts]
        if not feats:
            raise ValueError("fit_shift_gate got no reference queries.")
        self.fit(torch.cat(feats))
        logger.info("shift_gate: reference of %d queries (%d features), threshold %s", self.count, self.mean.numel(),
                    self.config.threshold)

    def opens(self, wrapper: Any, queries: Mapping[str, torch.Tensor]) -> tuple[bool, float]:
        """Whether checked ``queries`` open the gate, and their statistic (``nan`` before :meth:`fit`)."""
        t = self.statistic(self.features(wrapper, queries)) if self.fitted else math.nan
        return self.is_open(t), t

    def begin(self, ctx: Any) -> Answer | None:
        """The batch's answer when the gate is closed: the source model's no-grad view (through the score transform in
        the wrapper's ``_finish``, which counts the batch and resets an episodic wrapper); nothing adapted changes.
        ``None`` when the gate is open (the batch adapts)."""
        opened, t = self.opens(ctx.wrapper, ctx.batch.queries)
        logs = {"shift_gate_statistic": t, "shift_gate_open": float(opened)}
        self._judged = (ctx, logs)
        if opened:
            return None
        view = ctx.source_view()
        why = "no reference (fit_shift_gate)" if math.isnan(t) else f"statistic {t:.4g} <= {self.config.threshold}"
        return Answer(view, view.scores, skipped=[f"shift gate: {why} (the source answered, nothing adapted)"],
                      report_safety=False)

    def finish(self, ctx: Any, answer: Answer) -> Answer:
        """Every answer of a batch the gate judged carries its statistic (``shift_gate_statistic``, ``_open``)."""
        if self._judged is not None and self._judged[0] is ctx:
            answer.logs = {**answer.logs, **self._judged[1]}
        self._judged = None
        return answer

    @property
    def fitted(self) -> bool:
        return self.mean is not None

    def fit(self, features: torch.Tensor) -> None:
        """Take ``features`` (``(N, D)``, one row per reference query) as the source distribution: per-feature mean
        and unbiased variance (+ :data:`VARIANCE_FLOOR`). Refuses non-finite features or fewer than ``min_reference``
        rows in one line, changing nothing."""
        if not isinstance(features, torch.Tensor) or features.dim() != 2:
            raise ValueError("fit_shift_gate needs (N, D) features of reference queries.")
        if features.shape[0] < self.config.min_reference:
            raise ValueError(f"fit_shift_gate got {features.shape[0]} reference queries; pass at least "
                             f"{self.config.min_reference} clean, in-distribution queries (ShiftGateConfig.min_reference).")
        x = features.to("cpu", torch.float64)
        if not torch.isfinite(x).all():
            raise ValueError("fit_shift_gate: the reference queries gave non-finite features; check the inputs.")
        self.mean, self.var, self.count = x.mean(0), x.var(0, unbiased=True) + VARIANCE_FLOOR, int(x.shape[0])

    def statistic(self, features: torch.Tensor) -> float:
        """``T`` of a batch's ``(B, D)`` features (``nan`` before :meth:`fit`): ``per_query``, the mean over queries and
        features of ``(f - mean)^2 / var``; ``batch_mean``, the mean over features of ``(mean_i f_i - mean)^2 /
        (var / B)``."""
        if self.mean is None:
            return math.nan
        x = features.to("cpu", torch.float64)
        if x.shape[-1] != self.mean.shape[0]:
            raise ValueError(f"The shift gate's reference has {self.mean.shape[0]} features, this batch {x.shape[-1]}: "
                             "was it fitted with another model? Call fit_shift_gate again.")
        if self.config.statistic == "batch_mean":
            return float(((x.mean(0) - self.mean) ** 2 / (self.var / x.shape[0])).mean())
        return float(((x - self.mean) ** 2 / self.var).mean())

    def is_open(self, statistic: float) -> bool:
        """Whether a batch with this statistic adapts: above the threshold; never before :meth:`fit` (the source
        answers; logged once)."""
        if math.isnan(statistic):
            if not self._warned:
                logger.warning("shift_gate has no reference statistics, so the source model answers and nothing adapts: call "
                               "tta.fit_shift_gate(clean_queries) with a few hundred clean, in-distribution queries.")
                self._warned = True
            return False
        return statistic > self.config.threshold

    # ---------------------------------------------------------------- state (checkpoints)
    def state_tensors(self) -> dict[str, torch.Tensor]:
        if self.mean is None:
            return {}
        return {"shift_gate.mean": self.mean.clone(), "shift_gate.var": self.var.clone(),
                "shift_gate.count": torch.tensor(self.count, dtype=torch.int64)}

    def load_state_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        if "shift_gate.mean" not in tensors:
            self.mean, self.var, self.count = None, None, 0
            return
        self.mean = tensors["shift_gate.mean"].to("cpu", torch.float64).clone()
        self.var = tensors["shift_gate.var"].to("cpu", torch.float64).clone()
        self.count = int(tensors["shift_gate.count"])
