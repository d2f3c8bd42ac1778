"""The safety layer: adaptation that never ends below the source model (``TTAConfig(safety={...})``).

Around any gradient objective, :class:`SafetyMonitor` judges every batch from label-free signals and undoes
adaptation that the signals say hurt. Around a training-free objective (``objective="dn"``) only rule 1 applies: there
is nothing to roll back, but a degenerate batch must not enter its state (DN's query mean). Per ``adapt_step``:

1. **Degenerate batch** (before adapting): the frozen source model scores the batch (one no-grad forward, shared with
   objectives and gradient decoupling that need the source scores anyway). If its top-1 items are nearly all the same
   (``source_diversity < min_source_diversity``; e.g. one constant image repeated), the batch is not adapted on:
   no step runs, no state changes, and the source model's scores are returned (``"skip_degenerate"``).
2. **Collapse** (after the steps): the adapted top-1 items are far less diverse than the source's on the same batch
   (``adapted_diversity < collapse_ratio * source_diversity``: the queries all retrieve the same few items), or the
   adapted scores are not finite: reset to the source model (``"reset"``).
3. **Harmful drift**: the top-1 agreement between the adapted and the source model falls below ``min_agreement``, or
   below ``(1 - max_agreement_drop)`` times its running level (an EMA over the kept batches, decay
   ``agreement_ema_decay``): roll back to the last-good snapshot (``"rollback"``); the ``max_rollbacks``-th rollback
   in a row resets to the source instead.
4. Otherwise the batch is kept: the EMA moves, and after ``snapshot_every`` kept batches in a row the last-good
   snapshot is refreshed to the state after this batch.

A flagged batch (skip, rollback, reset) returns the **source model's scores** (through the score transform, if any),
so it is never worse than the source. A degenerate batch leaves no trace at all: not even the score transform's
state sees it (DN's query mean would otherwise be the constant query's embedding: measured on the emoji benchmark,
TCR+DN+safety on 200 constant batches then the clean stream: 95.6 on the clean part vs the source's 96.4). Batches
with fewer than ``min_queries`` queries are adapted on without judgement (the signals are too noisy). With
``TTAConfig(window=W)`` (:mod:`hf_tta.window`) rules 1-3 judge the batch together with the window's W recent queries:
diversity and agreement are over the batch's and the window's top-1 items (each window row's adapted and source top-1
as recorded when its batch was adapted on), and a batch of 1-8 queries is judged once ``B + W >= min_queries``. The
signals are then a sliding aggregate: a drift shows over several batches, so pair a window with ``snapshot_every`` of
about ``W / B`` for a last-good state from before it.

*Diversity* is ``(distinct top-1 items - 1) / (B - 1)``: 0 when every query retrieves the same item, 1 when all
differ, at any batch size. *Agreement* is the share of queries whose adapted top-1 item is the source's.

**Why label-free.** Every signal compares the model with itself: the adapted and the source model's rankings of the
same queries against the same cached gallery. No label, caption or relevance judgement enters: collapse and a
degenerate batch are properties of the ranking alone (many queries, one answer), and the agreement test asks only
whether the adapted model departs from the source abruptly, not whether either is right. The monitor also logs the
refined (batch-candidate) prediction's entropy and TCR's query spread and query–gallery gap for both models
(``TTAOutput.safety_logs``); they inform tuning but trigger nothing (entropy falls both when adaptation helps and when
it collapses). The loss trend is ``TTAOutput.loss`` itself.

**What a rollback and a reset restore.** A rollback restores the adapted parameters, the optimiser state (moments and
step counts; state created after the snapshot is dropped) and the objective state bit-exactly to the snapshot. A
reset restores them to the source model (as :meth:`TTAWrapper.reset` does). Both keep the batch counter, the RNG
stream and the score transform's state going (they are not adaptation), and the counts of actions
(``TTAWrapper.safety_counts``). The monitor's state (counts, EMA, streaks, snapshot) is saved with the checkpoint
under ``safety.``, so a resumed stream equals an uninterrupted one; :meth:`TTAWrapper.reset` clears it.

**Per-domain adapters.** :class:`~hf_tta.routing.RoutedTTAWrapper` gives every domain its own monitor, swapped in
with the rest of the domain's state: each domain's sub-batch is judged on its own queries, a rollback or reset
restores that domain only, and each monitor is saved under ``domain.<id>.safety.``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping

import torch

from .config import SafetyConfig
from .state import ROLLBACK, Adaptable, AdapterState
from .window import WindowView
from .window import top1 as _top1

if TYPE_CHECKING:  # pragma: no cover
    from .objectives.base import ObjectiveInputs

logger = logging.getLogger(__name__)

SAFETY_ACTIONS = ("skip_degenerate", "rollback", "reset")


@dataclass(frozen=True)
class SafetyDecision:
    """What the monitor decided for a batch; the wrapper applies it.

    ``action``: ``None`` (keep), ``"skip_degenerate"`` (do not adapt on the batch), ``"rollback"`` (restore
    :attr:`SafetyMonitor.last_good`) or ``"reset"`` (return to the source model). ``refresh``: a kept batch after which
    the last-good snapshot is to be taken again. ``reason``: one line for the log and ``TTAOutput.skipped``.
    """

    action: str | None = None
    refresh: bool = False
    reason: str = ""


KEEP = SafetyDecision()


class NullSafetyMonitor:
    """The safety layer off (``TTAConfig.safety=None``): a monitor that never acts. Every decision is keep, it takes no
    snapshot, counts nothing and saves nothing, and ``active`` is false, so the wrapper spends no source forward on it.
    The wrapper holds one instead of ``None``, so it asks the same questions whether the layer is on or off."""

    active = False
    min_queries: int | None = None
    config: SafetyConfig | None = None

    def __init__(self) -> None:
        self.clear()

    def clear(self) -> None:
        self.counts: dict[str, int] = {}
        self.agreement_ema: float | None = None
        self.rollbacks_in_row = self.kept_in_row = 0
        self.last_good: AdapterState | None = None
        self.action: str | None = None
        self.logs: dict[str, float] = {}

    def fresh(self) -> NullSafetyMonitor:
        return NullSafetyMonitor()

    def remember(self, target: Adaptable) -> None:
        """Nothing to remember."""

    def before(self, source: ObjectiveInputs | None) -> SafetyDecision:
        return KEEP

    def after(self, inputs: ObjectiveInputs, scores: torch.Tensor) -> SafetyDecision:
        return KEEP

    def state_tensors(self, prefix: str = "safety.") -> tuple[dict[str, torch.Tensor], dict[str, Any] | None]:
        """No tensors, and ``None`` metadata: a checkpoint without the safety layer has no ``safety`` entry."""
        return {}, None

    def load_state_tensors(self, tensors: Mapping[str, torch.Tensor], meta: Mapping[str, Any] | None, names: list[str],
                           step_on_cpu: bool, prefix: str = "safety.") -> None:
        self.clear()


def build_monitor(config: SafetyConfig | None) -> SafetyMonitor | NullSafetyMonitor:
    """The monitor of ``config`` (:class:`NullSafetyMonitor` when the safety layer is off)."""
    return SafetyMonitor(config) if config is not None else NullSafetyMonitor()


class SafetyMonitor:
    """The per-stream state of the safety layer and its decisions (see :mod:`hf_tta.safety`).

    Per batch the wrapper calls :meth:`before` with the source model's view of the batch, and (if it adapted)
    :meth:`after` with the view it would return; each returns a :class:`SafetyDecision`. The monitor keeps the
    last-good :data:`~hf_tta.state.ROLLBACK` state (:attr:`last_good`, taken by :meth:`remember`), saves and loads its
    own tensors (:meth:`state_tensors`, :meth:`load_state_tensors`) and never touches the wrapper otherwise.
    """

    active = True

    def __init__(self, config: SafetyConfig):
        self.config = config
        self.clear()

    @property
    def min_queries(self) -> int:
        """The smallest batch (with the window) the monitor judges."""
        return self.config.min_queries

    def fresh(self) -> SafetyMonitor:
        """A new monitor with the same thresholds (a new domain's)."""
        return SafetyMonitor(self.config)

    def clear(self) -> None:
        """Forget the stream: counts, EMA, streaks and the last-good state (taken again at the next batch)."""
        self.counts: dict[str, int] = {a: 0 for a in SAFETY_ACTIONS}
        self.agreement_ema: float | None = None
        self.rollbacks_in_row = 0
        self.kept_in_row = 0
        self.last_good: AdapterState | None = None
        self._begin_batch()

    def remember(self, target: Adaptable) -> None:
        """Take the last-good state from ``target`` (into the same buffers when the layout is unchanged)."""
        self.last_good = AdapterState.capture(target, ROLLBACK, into=self.last_good)

    def _begin_batch(self) -> None:
        # what after() needs of the source view: its scores, embeddings and top-1 items' rows. Not the view itself,
        # which refers to the batch's gallery (a top-k backend cannot be copied: OnlineRetriever publishes copies)
        self._source: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self.action: str | None = None
        self.logs: dict[str, float] = {}
        self._judged = False

    # ---------------------------------------------------------------------------------------- decisions
    def before(self, source: ObjectiveInputs) -> SafetyDecision:
        """Judge the batch from the source model's view (embeddings, scores and, with a top-k backend, the source's
        candidate ids): a degenerate batch is not to be adapted on (rule 1)."""
        self._begin_batch()
        self._source_top1 = _top1(source.scores, source.candidate_ids)
        self._source = (source.scores, source.query_emb, source.gallery_emb[self._source_top1[0]])
        self._window = _window_rows(source.window)
        b = source.scores.shape[0] + self._window[0].numel()
        if b < self.config.min_queries:
            return KEEP
        self._judged = True
        source_ids = torch.cat([self._source_top1[1], self._window[1].to(self._source_top1[1].device)])
        d_src = float(_diversity(source_ids))  # the one host sync before adapting
        self.logs["source_diversity"] = d_src
        if d_src >= self.config.min_source_diversity:
            return KEEP
        return self._act(
            "skip_degenerate",
            f"degenerate batch (source top-1 diversity {d_src:.3g} < {self.config.min_source_diversity}): not adapted",
        )

    @torch.no_grad()
    def after(self, inputs: ObjectiveInputs, scores: torch.Tensor) -> SafetyDecision:
        """Judge the adapted view of the batch (the inputs and scores it would return) against the source's: keep,
        roll back (rule 3) or reset (rule 2)."""
        if not self._judged:
            return KEEP
        cfg, (src_scores, src_emb, src_top1_rows) = self.config, self._source
        a_col, a_top1 = _top1(scores, inputs.candidate_ids)
        s_col, s_top1 = self._source_top1
        w_top1, w_source = (t.to(a_top1.device) for t in self._window)  # the window's rows (0 without one)
        signals = {
            "finite": torch.isfinite(scores).all().to(torch.float64),
            "adapted_diversity": _diversity(torch.cat([a_top1, w_top1])),
            "agreement": torch.cat([a_top1 == s_top1.to(a_top1.device), w_top1 == w_source]).to(torch.float64).mean(),
            "adapted_entropy": _refined_entropy(scores, a_col, cfg.entropy_temperature),
            "source_entropy": _refined_entropy(src_scores, s_col, cfg.entropy_temperature),
            "adapted_spread": _spread(inputs.query_emb.detach()),
            "source_spread": _spread(src_emb),
            "adapted_gap": _gap(inputs.query_emb.detach(), inputs.gallery_emb[a_col]),
            "source_gap": _gap(src_emb, src_top1_rows),
        }
        values = torch.stack([v.to(torch.float64).reshape(()).cpu() for v in signals.values()]).tolist()  # one sync
        logs = dict(zip(signals, values))
        finite = logs.pop("finite") == 1.0
        self.logs.update(logs)
        agreement = logs["agreement"]
        if not finite or logs["adapted_diversity"] < cfg.collapse_ratio * self.logs["source_diversity"]:
            self.agreement_ema, self.rollbacks_in_row, self.kept_in_row = None, 0, 0
            why = "non-finite scores" if not finite else f"collapse (adapted top-1 diversity {logs['adapted_diversity']:.3g})"
            return self._act("reset", f"{why}: reset to the source model")
        drop = self.agreement_ema is not None and agreement < (1.0 - cfg.max_agreement_drop) * self.agreement_ema
        if agreement < cfg.min_agreement or drop:
            self.rollbacks_in_row += 1
            self.kept_in_row = 0
            if self.rollbacks_in_row >= cfg.max_rollbacks:
                self.agreement_ema, self.rollbacks_in_row = None, 0
                return self._act("reset", f"{cfg.max_rollbacks} rollbacks in a row: reset to the source model")
            if self.agreement_ema is not None:
                self.logs["agreement_ema"] = self.agreement_ema
            return self._act("rollback", f"top-1 agreement with the source {agreement:.3g}: rolled back to the last-good state")
        self.rollbacks_in_row = 0
        d = cfg.agreement_ema_decay
        self.agreement_ema = agreement if self.agreement_ema is None else d * self.agreement_ema + (1 - d) * agreement
        self.logs["agreement_ema"] = self.agreement_ema
        self.kept_in_row += 1
        refresh = self.kept_in_row >= cfg.snapshot_every
        if refresh:
            self.kept_in_row = 0
        return SafetyDecision(refresh=refresh)

    def _act(self, action: str, reason: str) -> SafetyDecision:
        self.action = action
        self.counts[action] += 1
        logger.log(logging.INFO if action == "skip_degenerate" else logging.WARNING, "safety: %s", reason)
        return SafetyDecision(action=action, reason=reason)

    # ---------------------------------------------------------------------------------------- checkpoint
    def state_tensors(self, prefix: str = "safety.") -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """The monitor's tensors (``safety.counts.*``, streaks, EMA, ``safety.snapshot.*``) and metadata."""
        tensors = {f"{prefix}counts.{a}": torch.tensor(n, dtype=torch.int64) for a, n in self.counts.items()}
        tensors[f"{prefix}rollbacks_in_row"] = torch.tensor(self.rollbacks_in_row, dtype=torch.int64)
        tensors[f"{prefix}kept_in_row"] = torch.tensor(self.kept_in_row, dtype=torch.int64)
        if self.agreement_ema is not None:
            tensors[f"{prefix}agreement_ema"] = torch.tensor(self.agreement_ema, dtype=torch.float64)
        meta: dict[str, Any] = {"snapshot": self.last_good is not None, "optim_plain": {}}
        if self.last_good is not None:
            snap, snap_meta = self.last_good.to_tensors(f"{prefix}snapshot.", optimizer_keys="name")
            tensors.update(snap)
            meta["optim_plain"] = snap_meta.get("optim_plain", {})
        return tensors, meta

    def load_state_tensors(
        self, tensors: Mapping[str, torch.Tensor], meta: Mapping[str, Any] | None, names: list[str],
        step_on_cpu: bool, prefix: str = "safety.",
    ) -> None:
        """Restore what :meth:`state_tensors` wrote (``names``: the wrapper's optimised tensors, in order); a checkpoint
        saved without the safety layer starts a fresh monitor."""
        self.clear()
        if not meta or f"{prefix}rollbacks_in_row" not in tensors:
            return
        self.counts = {a: int(tensors[f"{prefix}counts.{a}"]) for a in SAFETY_ACTIONS}
        self.rollbacks_in_row = int(tensors[f"{prefix}rollbacks_in_row"])
        self.kept_in_row = int(tensors[f"{prefix}kept_in_row"])
        if f"{prefix}agreement_ema" in tensors:
            self.agreement_ema = float(tensors[f"{prefix}agreement_ema"])
        if meta.get("snapshot"):
            self.last_good = AdapterState.from_tensors(
                tensors, meta, ROLLBACK, names, prefix=f"{prefix}snapshot.", optimizer_keys="name", step_on_cpu=step_on_cpu
            )


# ---------------------------------------------------------------------------------------------------- signals
def _window_rows(window: WindowView | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The window's rows that the monitor judges with the batch (``TTAConfig.window``): their adapted and source top-1
    gallery indices, recorded when they were adapted on; rows without a source top-1 (pushed without the safety layer)
    are left out."""
    if window is None or not len(window):
        empty = torch.zeros(0, dtype=torch.long)
        return empty, empty
    known = window.source_top1 >= 0
    return window.top1[known], window.source_top1[known]


def _diversity(top1: torch.Tensor) -> torch.Tensor:
    """``(distinct - 1) / (B - 1)`` of the top-1 items (0-d tensor; 1 for a single query), without a device sync."""
    b = top1.numel()
    if b < 2:
        return torch.ones((), dtype=torch.float64, device=top1.device)
    s = top1.sort().values
    distinct = 1 + (s[1:] != s[:-1]).sum()
    return (distinct - 1).to(torch.float64) / (b - 1)


def _refined_entropy(scores: torch.Tensor, top1_col: torch.Tensor, temperature: float) -> torch.Tensor:
    """Mean entropy of the softmax over the batch's top-1 candidates (TCR's refined B x B prediction, Eq. 4)."""
    logits = scores[:, top1_col].float() / temperature
    return -(logits.softmax(dim=1) * logits.log_softmax(dim=1)).sum(dim=1).mean()


def _spread(q: torch.Tensor) -> torch.Tensor:
    """Mean distance of the query embeddings to their centre (the quantity in TCR's uniformity term, Eq. 9)."""
    q = q.float()
    return (q - q.mean(0)).norm(dim=1).mean()


def _gap(q: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """``||mean(q) - mean(top-1 gallery items)||`` (TCR's query-gallery gap, Eq. 7)."""
    return (q.float().mean(0) - g.float().mean(0)).norm()
