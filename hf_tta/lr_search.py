"""Choosing the learning rate online without labels (issue 37): ``TTAConfig(lr_search=LRSearchConfig(...))``, or
``lr_search={}`` for its defaults (``lr="auto"`` was removed: protocol v4's default study, issue 48, found a fixed lr
chosen on held-out corruptions better and safer).

**The probe (selector (a) of issue 37).** During the first ``probe_batches`` batches of the stream the wrapper keeps
one *shadow* of the adapted state per candidate lr: the adapted parameters, the optimiser's moments and the
objective's state (:data:`~hf_tta.state.SHADOW`; the LayerNorms are small). Per batch:

1. the source model's one no-grad forward (the served state, which never moves before the proxy has chosen): what the
   safety layer and the ``agreement`` proxy read and, by default (``serve="source"``), the answer;
2. each shadow in turn is loaded into the model and runs the batch's ``steps`` at its own lr (:mod:`hf_tta.loop`);
   the proxy scores it on its **first** step's forward, i.e. on the incoming batch *before* the shadow adapts on it
   (prequential, label-free), so scoring costs no extra pass;
3. the served (source) state is put back.

On the first probe batch every shadow is still the source, so the proxies are scored from the second on: the choice
rests on ``probe_batches - 1`` prequential scores per candidate. After the last probe batch the selector commits:
the chosen shadow becomes the adapted state, the others are dropped, the chosen lr is logged and exposed
(``wrapper.lr_search.chosen``) and the stream goes on as a fixed-lr stream at that lr (``run.scoring`` applies
again). The safety layer's last-good snapshot is taken at the commit.

**Serving the leader (selector (b) of issue 37)**: ``serve="leader"`` answers a probe batch with the *leading* shadow
instead of the source: a follow-the-leader bandit over the candidate population during the probe. The leader
(``wrapper.lr_search.leader``) is the candidate the commit's rule (:func:`~hf_tta.lr_search_config.choose`, the same
tie rule) chooses on the means of the batches scored so far, i.e. before this batch; it answers with its first step's
forward, its view before adapting on the batch (prequential, causal, label-free; point 2 computes that forward anyway,
so it costs no pass: the cost below is unchanged; with ClipTTA's ``score_after_update`` too). On the first two probe batches no
score exists yet (or ever, for a proxy that never scores, e.g. EATA's ``next_loss``): the source answers. The answer's
scores (a top-k backend's candidates), the query embeddings the score transform reads and ``TTAOutput.logs``'
``lr_search.served`` (the lr that answered; 0: the source) are the leader's. Only the answers change: the shadows, the
choice, the state and the stream after the commit are ``serve="source"``'s bit for bit, and nothing new is stored (the
leader is a function of the recorded means), so save/resume, reset and rollback are as below.

**Proxies** (``proxy``; each is a label-free signal of one shadow on the incoming batch, averaged over the scored
probe batches). The probe records all four at no extra pass (``wrapper.lr_search.all_scores``, and the lr each
proxy's rule would choose, ``wrapper.lr_search.choices``; per batch in ``TTAOutput.logs``) and commits by ``proxy``:

* ``"next_loss"``: the objective's own loss (with any penalty) at the first step, on the next batch before updating
  on it; lower is better (the prequential self-supervised loss of issue 37's proxy study);
* ``"agreement"``: the share of queries whose top-1 gallery item under the shadow equals the source model's; the
  rule backs off: the highest lr whose mean agreement stays at or above ``agreement_floor``, else the candidate of
  highest agreement;
* ``"uniformity"``: TCR's uniformity of the query embeddings, the mean distance to their centre
  (``hf_tta.metrics.recall.uniformity``, TCR Eq. 14, the benchmark's ``uniformity_after`` column); higher is better;
* ``"gap"``: TCR's query-gallery gap, the distance between the batch's query centre and the gallery's centre (the
  candidates' with a top-k backend; ``hf_tta.metrics.recall.modality_gap``, TCR Eq. 15, ``gap_after``); lower is
  better. ``hf_tta.benchmarks.protocols.v3_summary.proxy_study`` ranks the lrs by the same two on whole streams.

The default proxy, ``next_loss``, and the default grid and ``probe_batches`` are set a priori, before any
measurement; issue 37's study on the protocol-v3 selection split (:mod:`hf_tta.benchmarks.protocols.v3_splits`) is to choose them.

Ties go to the candidate nearest the wrapper's base lr (``TTAConfig.lr`` or the model's default), then the lower. A
candidate whose proxy value is not finite on a scored batch (its steps diverged) is out of the choice; a batch whose
first step selects no query (EATA, SAR, DeYO) leaves ``next_loss`` unscored for that candidate (its mean is over the
batches it was scored on; a candidate never scored is not chosen; none scored: the lowest lr, with a warning); a batch
on which every candidate's loss is not finite (garbage in) changes nothing, not even the counters.

**The safety layer.** It judges nothing during the probe (the served state, the source, does not adapt; with
``serve="leader"`` it does not judge the leader's answer either) but its rule 1: a degenerate batch is not probed,
leaves no trace and the source answers it. After the commit it judges as on any stream. A rollback
restores the selector's state with the rest, bit-exactly. A safety *reset* returns the adapted state to the source
but keeps the choice (the lr in use and the cost counters): the stream goes on at that lr rather than probing again
(which would likely choose it again). :meth:`~hf_tta.TTAWrapper.reset` clears everything, the choice included.

**Back-off (selector (d) of issue 37)**: ``backoff=f`` (needs the safety layer) multiplies the lr in use by ``f``
after every rollback (a collapse of the source agreement, the layer's rule 3) and every reset (collapse, or
``max_rollbacks`` rollbacks in a row), never below the lowest candidate. It acts after the rollback has restored the
selector's state, on the lr the batch started at, so successive rollbacks compound (``f``, ``f^2``, ...); each is logged
as a warning. ``probe_batches=0`` runs it alone, without a probe: the stream starts at the highest candidate.

**Online rule (selector (c))**: ``online="hypergradient"``: the served stream's lr moves at every step by Baydin et al.'s
hypergradient rule, no extra pass, from the probe's choice (or the base lr, ``probe_batches=0``): :mod:`hf_tta.lr_online`.

**Cost** (``wrapper.lr_search.cost``): the probe counts the query tower's forward and backward passes it runs, per
query, from the wrapper's meter, :attr:`~hf_tta.TTAWrapper.passes` (so SAM's second pass, re-encoded views and
gradient decoupling's second backward count too). With ``K`` candidates, ``S`` steps and a dense gallery a probe batch costs ``1 + K S``
forwards and ``K S`` backwards per query, against ``S`` and ``S`` for a fixed-lr batch (``S + 1`` forwards with the
safety layer). Amortised over ``T`` batches of which ``P`` probe, the ratio of passes to a fixed-lr run is
``1 + P (1 + 2 S (K - 1)) / (2 S T)`` (safety off; with it, whose source forward the probe shares,
``1 + 2 S P (K - 1) / ((2 S + 1) T)``): K = 5, S = 3, P = 4 gives 1.17 at T = 100 and 1.5 at T = 33 (safety off).

**Where it runs.** :class:`~hf_tta.TTAWrapper` with a gradient objective on a continual stream; refused in one line
with a training-free objective, ``reset_policy="episodic"``, ``update_budget`` (which skips batches the probe needs),
``backoff`` without the safety layer, and by :class:`~hf_tta.RoutedTTAWrapper` and ``DistributedTTAWrapper``.

**State.** Everything lives in the :data:`~hf_tta.state.SELECTOR` part of the wrapper's
:class:`~hf_tta.state.AdapterState` (``selector.*`` in a checkpoint): the scores, choice and lr in
``wrapper.selector_state``, the shadows as the slots of one :class:`~hf_tta.slots.SlotBank` (``wrapper.selector_shadows``,
keyed by candidate index, no monitors of their own: the probe's one switch; ``selector.shadow.<k>.*`` in a
checkpoint, as before the bank). Saved and resumed bit-exactly mid-probe, cleared by ``reset()``, restored by a
rollback, kept (its choice) by a safety reset.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import Any, NamedTuple

import torch

from . import window
from .lr_online import OnlineMixin
from .lr_search_config import PROXIES, LRSearchConfig, choose
from .policies import Answer, BatchContext, BatchPolicy
from .slots import SlotBank
from .state import SELECTOR, SHADOW

__all__ = ["LRSearch", "LRSearchConfig", "PROXIES", "choose", "proxy_value", "proxy_values"]
logger = logging.getLogger(__name__)


@torch.no_grad()
def proxy_values(first: Any, first_loss: float | None, source: Any, gallery_mean: torch.Tensor | None = None) -> torch.Tensor:
    """Every proxy of one shadow on a batch, in :data:`PROXIES` order (a float64 CPU tensor): ``first`` is its first
    step's :class:`~hf_tta.objectives.ObjectiveInputs` (before it adapts on the batch), ``first_loss`` that step's
    loss, ``source`` the source model's view of the batch, ``gallery_mean`` the dense gallery's mean (computed once
    per batch; ``None``: the mean of ``first``'s gallery rows, a top-k backend's candidates)."""
    q = first.query_emb.detach().double()
    mine = window.top1(first.scores.detach(), first.candidate_ids)[1]
    theirs = window.top1(source.scores, source.candidate_ids)[1].to(mine.device)
    if gallery_mean is None:
        gallery_mean = first.gallery_emb.detach().mean(0, dtype=torch.float64)  # no float64 copy of N x D
    loss = torch.tensor(float("nan") if first_loss is None else first_loss, dtype=torch.float64)
    return torch.stack([loss, (mine == theirs).double().mean().cpu(), (q - q.mean(0)).norm(dim=1).mean().cpu(),
                        (q.mean(0) - gallery_mean.to(q.device)).norm().cpu()])


def proxy_value(proxy: str, first: Any, first_loss: float | None, source: Any) -> torch.Tensor:
    """One proxy of :func:`proxy_values` (a 0-d float64 tensor)."""
    return proxy_values(first, first_loss, source)[PROXIES.index(proxy)]


class _Undo(NamedTuple):
    """What a probe batch found, to put back when it fails: the search's state, its shadows (by reference, from
    :meth:`~hf_tta.slots.SlotBank.stored`) and the RNG."""

    state: dict[str, torch.Tensor]
    shadows: dict[int, Any]
    rng: torch.Tensor


# ------------------------------------------------------------------------------------------------- the selector
class LRSearch(OnlineMixin, BatchPolicy):
    """The learning-rate search of one wrapper, a :class:`~hf_tta.policies.BatchPolicy`: its probe answers a probe
    batch (:meth:`begin`), then its online rule (:meth:`step_rule`) and back-off (:meth:`after`) act on the served
    stream. Its state is the wrapper's ``selector_state`` (see :mod:`hf_tta.lr_search`), so this object holds only
    settings and reads the state through the wrapper's public names."""

    name = "lr_search"
    keeps_on_reset = frozenset({SELECTOR})  # a safety reset keeps the choice

    def __init__(self, config: LRSearchConfig, wrapper: Any):
        self.config, self.wrapper = config, wrapper
        self.base_lr = float(wrapper.lr)
        self.candidates = config.resolved_candidates(self.base_lr)
        self.active: float | None = None  # the lr last put into the optimiser
        #: the shadows, keyed by candidate index (hf_tta.slots; the wrapper's selector_shadows)
        self.shadows = SlotBank(wrapper, SHADOW, monitors=False)
        self._lr_start: float | None = None  # the lr in use when the batch's steps started (what a back-off scales)

    # ---------------------------------------------------------------------------------------- the policy's hooks
    def begin(self, ctx: BatchContext) -> Answer | None:
        """A probe batch's answer (:meth:`probe`); ``None`` once the lr is chosen."""
        return self.probe(ctx) if self.probing else None

    def step_rule(self, ctx: BatchContext) -> Any:
        """The lr in use into the optimiser (:meth:`before_steps`) and the online rule's hook for the batch."""
        self.before_steps()
        self._lr_start = self.lr
        return self.batch_rule()

    def after(self, ctx: BatchContext, decision: Any) -> None:
        """The back-off after a safety rollback or reset (:meth:`back_off`)."""
        self.back_off(self._lr_start, decision.action)

    def logs(self) -> dict[str, float]:
        return self.batch_logs(self.lr)

    def recovered(self) -> None:  # the online rule's last step led elsewhere
        self.forget_update()

    def optimizer_rebuilt(self) -> None:  # a rebuilt optimiser gets the lr in use
        if self.active is not None:
            self.set_lr(self.active)

    @property
    def needs_checked_loop(self) -> bool:
        return self.online_rule is not None

    # ---------------------------------------------------------------------------------------- what it exposes
    @property
    def chosen(self) -> float | None:
        """The lr the probe chose (without a probe: the start, :meth:`start_index`); ``None`` before."""
        return self.candidates[int(self._state["chosen"])] if self._committed else None

    @property
    def lr(self) -> float | None:
        """The lr in use after the commit (the chosen lr, moved by the online rule and the back-off); ``None`` before."""
        return float(self._state["lr"]) if self._committed else None

    @property
    def trace(self) -> dict[str, float | int | None]:
        """The lr trace's summary since the start or commit (:meth:`~hf_tta.lr_online.OnlineMixin.trace_of`)."""
        return self.trace_of(self.lr)

    @property
    def probed(self) -> int:
        """Probe batches run since the last reset."""
        return int(self._state.get("probed", 0))

    @property
    def scores(self) -> dict[float, float]:
        """Each candidate's mean value of the configured proxy over the scored probe batches (NaN before the second
        probe batch, and for a candidate that was out of the choice)."""
        return self.all_scores[self.config.proxy]

    @property
    def all_scores(self) -> dict[str, dict[float, float]]:
        """:attr:`scores` for every proxy: the probe records them all (they cost nothing beyond the configured one's),
        so one stream gives each proxy's choice (:attr:`choices`) for issue 37's proxy study."""
        means = self._means()
        return {p: dict(zip(self.candidates, means[i])) for i, p in enumerate(PROXIES)}

    def _means(self) -> list[list[float]]:
        """Mean of each proxy (rows) for each candidate (columns) over the batches it was scored on; NaN where it
        never was, or where the candidate is out of the choice."""
        st = self._state
        if "sum" not in st:
            return [[float("nan")] * len(self.candidates) for _ in PROXIES]
        means = torch.where(st["valid"] & (st["count"] > 0), st["sum"] / st["count"].clamp(min=1), float("nan"))
        return means.tolist()

    @property
    def choices(self) -> dict[str, float | None]:
        """The lr each proxy's rule chooses from the probe's scores so far (``None`` before the second probe batch);
        the configured proxy's is the one committed to."""
        means = self._means()
        return {p: self.candidates[choose(p, self.candidates, means[i], [True] * len(self.candidates), self.base_lr,
                                          self.config.floor)] if any(map(math.isfinite, means[i])) else None
                for i, p in enumerate(PROXIES)}

    @property
    def leader(self) -> float | None:
        """With ``serve="leader"``, the lr whose shadow answers the next probe batch: the configured proxy's choice on
        the scores so far (:attr:`choices`); ``None`` when the source answers it (no score yet, ``serve="source"``, or
        no probe batch next)."""
        return self.choices[self.config.proxy] if self.config.serve == "leader" and self.probing else None

    @property
    def cost(self) -> dict[str, float]:
        """The probe's passes of the query tower: ``queries`` probed, ``forward`` and ``backward`` passes (in queries)
        and their ratios per query."""
        st = self._state
        q, f, b = (int(st.get(f"cost.{k}", 0)) for k in ("queries", "forward", "backward"))
        return {"queries": q, "forward": f, "backward": b, "forward_per_query": f / q if q else 0.0,
                "backward_per_query": b / q if q else 0.0}

    # ---------------------------------------------------------------------------------------- the lr in use
    def before_steps(self) -> None:
        """Before a committed batch's steps: the lr in use into the optimiser (a reset or a rebuilt optimiser starts
        from the base lr). Without a probe (``probe_batches=0``) the first batch starts at :meth:`start_index`."""
        if not self._committed:
            lr = self.candidates[self.start_index()]
            self.wrapper.selector_state = self._unprobed(lr)
            logger.info("lr_search: no probe: starting at lr=%.3g (online rule: %s; back-off on collapse: %s)", lr,
                        self.config.online, self.config.backoff)
        self.set_lr(self.lr)

    def back_off(self, lr_before: float | None, action: str | None) -> None:
        """The back-off (selector (d)): after a safety rollback or reset (``action``), the lr in use before it times
        ``backoff``, never below the lowest candidate."""
        if action == "reset":  # the online rule's last step led elsewhere than the source
            self.forget_update()
        if self.config.backoff is None or lr_before is None or action not in ("rollback", "reset") or (
                not self._committed and self.config.probe_batches):  # (a probe's snapshot is never taken before its commit)
            return
        lr = max(lr_before * self.config.backoff, self.candidates[0])
        # a rollback to a snapshot from before an unprobed start restores no choice: start again, backed off
        state = self._state if self._committed else self._unprobed(lr)
        self.wrapper.selector_state = {**state, "lr": torch.tensor(lr, dtype=torch.float64)}
        logger.warning("lr_search: safety %s: lr backed off %.3g -> %.3g", action, lr_before, lr)

    def _unprobed(self, lr: float) -> dict[str, torch.Tensor]:
        """The state of a search without a probe (``probe_batches=0``): :meth:`start_index` chosen, ``lr`` in use."""
        return {**self._fresh(), "chosen": torch.tensor(self.start_index()), "lr": torch.tensor(lr, dtype=torch.float64)}

    # ---------------------------------------------------------------------------------------- the probe
    def probe(self, ctx: BatchContext) -> Answer:
        """One probe batch (see :mod:`hf_tta.lr_search`): the source answers, every shadow is scored then adapts. An
        error on the way leaves the wrapper as the batch found it."""
        w = self.wrapper
        undo = _Undo(dict(self._state), self.shadows.stored(), w.generator.get_state())
        try:
            return self._probe(ctx, undo)
        except BaseException:
            self._undo(ctx, undo)
            raise

    def _undo(self, ctx: BatchContext, undo: _Undo) -> None:
        """The search's state, its shadows and the RNG as the batch found them; the source (served) in the model."""
        ctx.load_source(SHADOW)
        self.wrapper.selector_state = undo.state
        self.shadows.restore(undo.shadows)
        self.wrapper.generator.set_state(undo.rng)

    def _probe(self, ctx: BatchContext, undo: _Undo) -> Answer:
        w, cfg, batch, before = self.wrapper, self.config, ctx.batch, undo.state
        start = w.passes.copy()  # the query tower's passes the probe runs (TTAWrapper.passes, hf_tta.outputs.PassCounts)
        source = ctx.source_view()  # the answer, rule 1, agreement
        decision = w.safety.before(source)
        if decision.action == "skip_degenerate":  # not probed: the source answers, the batch leaves no trace
            return self._answer((source, 0.0), decision.action, {})
        state = dict(before) or self._fresh()
        cache = [source.scores] if source.candidate_ids is None else []
        dense_mean = source.gallery_emb.mean(0, dtype=torch.float64) if source.candidate_ids is None else None
        values, losses, logs = [], [], {}
        lead, served = self.leader, (source, 0.0)  # serve="leader": the leader by the scores before this batch
        for k, lr in enumerate(self.candidates):
            self._load(k)  # stores the shadow before it (after its steps), as the bank's switch does
            self.set_lr(lr)
            first: list[Any] = []

            def make(step: int, _first: list = first) -> Any:
                inputs = w.forward.inputs(batch, step, source_cache=cache)
                if step == 0:
                    _first[:] = [inputs]
                return inputs

            result = ctx.run_steps(make)
            window.record(w.state, w.config.window, *ctx.reported_view(result), source)
            values.append(proxy_values(first[0], result.first_loss, source, dense_mean))
            if lr == lead:  # its view before adapting on the batch (prequential), already computed
                served = (dataclasses.replace(first[0], query_emb=first[0].query_emb.detach(),
                                              scores=first[0].scores.detach()), lr)
            losses.append(result.first_loss)
            if k == 0 and any(not torch.is_tensor(v) for st in w.optimizer.state.values() for v in st.values()):  # (one optimiser class for all)
                raise ValueError("lr_search keeps optimiser states of tensors only (AdamW, SAM); this optimiser "
                                 "has other state: drop lr_search.")
            logs.update({f"lr_search.{p}@{lr:.3g}": v for p, v in zip(PROXIES, values[-1].tolist())})
        self.shadows.deactivate()  # the last shadow stored
        ctx.load_source(SHADOW)  # the served state: the source, until the commit
        if all(v is not None and not math.isfinite(v) for v in losses):  # garbage in: nothing changes
            self._undo(ctx, undo)
            logger.warning("lr_search: every candidate's loss is not finite on this batch: not probed")
            return self._answer(served, None, logs)
        vals = torch.stack(values, dim=1)  # (proxies, candidates)
        finite = torch.isfinite(vals)
        # no loss (the objective selected no query) leaves next_loss unscored; a non-finite value puts the candidate out
        missing = torch.zeros_like(finite)
        missing[PROXIES.index("next_loss")] = torch.tensor([v is None for v in losses])
        out = ~finite & ~missing
        if int(state["probed"]) >= 1:  # from the second probe batch on the shadows differ
            state["sum"] = state["sum"] + torch.where(finite, vals, torch.zeros_like(vals))
            state["count"] = state["count"] + finite.long()
            state["valid"] = state["valid"] & ~out
        state["probed"] = state["probed"] + 1
        spent = w.passes.since(start)
        state["cost.forward"] = state["cost.forward"] + spent.forward
        state["cost.backward"] = state["cost.backward"] + spent.backward
        state["cost.queries"] = state["cost.queries"] + batch.size
        w.selector_state = state
        logs["lr_search.probe"] = float(state["probed"])
        if int(state["probed"]) >= cfg.probe_batches:
            self._commit(ctx)
        return self._answer(served, decision.action, logs)

    def _fresh(self) -> dict[str, torch.Tensor]:
        k = len(self.candidates)
        counters = {name: torch.zeros((), dtype=torch.int64)  # one tensor each: safetensors refuses shared memory
                    for name in ("probed", "cost.queries", "cost.forward", "cost.backward")}
        return {"candidates": torch.tensor(self.candidates, dtype=torch.float64),
                "sum": torch.zeros(len(PROXIES), k, dtype=torch.float64),
                "count": torch.zeros(len(PROXIES), k, dtype=torch.int64),
                "valid": torch.ones(len(PROXIES), k, dtype=torch.bool), **counters,
                "chosen": torch.tensor(-1), "lr": torch.tensor(self.base_lr, dtype=torch.float64)}

    def _load(self, k: int) -> None:
        """Shadow ``k`` into the wrapper (the source before its first probe batch): the bank's switch."""
        if k not in self.shadows:
            self.shadows.add(k)
        self.shadows.set_active(k)

    def _commit(self, ctx: BatchContext) -> None:
        """The proxy's choice becomes the adapted state; the other shadows are dropped (logged)."""
        w, st = self.wrapper, self._state
        means = self._means()[PROXIES.index(self.config.proxy)]
        k = choose(self.config.proxy, self.candidates, means, [True] * len(means), self.base_lr, self.config.floor)
        self._load(k)
        self.shadows.clear()  # the chosen shadow is the adapted state now; the others are dropped
        lr = self.candidates[k]
        self.set_lr(lr)
        w.selector_state = {**st, "chosen": torch.tensor(k), "lr": torch.tensor(lr, dtype=torch.float64)}
        if not any(map(math.isfinite, means)):
            logger.warning("lr_search: no candidate could be scored by %s (diverged, or no loss): the lowest lr %.3g is "
                           "used", self.config.proxy, lr)
        table = ", ".join(f"{c:.3g}: {m:.4g}" for c, m in zip(self.candidates, means))
        others = ", ".join(f"{p}: {c:.3g}" for p, c in self.choices.items() if p != self.config.proxy)
        logger.info("lr_search: chose lr=%.3g by %s over %d probe batches (%s; the other proxies would choose %s)",
                    lr, self.config.proxy, int(st["probed"]), table, others)
        w.safety.remember(w)

    def _answer(self, served: tuple[Any, float], action: str | None, logs: dict[str, float]) -> Answer:
        """The answer to a probe batch: ``served`` is the view that answers and its lr (0: the source model's), through
        the score transform (unless degenerate); with ``serve="leader"`` that lr is logged (``lr_search.served``)."""
        view, lr = served
        if self.config.serve == "leader":
            logs = {**logs, "lr_search.served": lr}
        skipped = [] if action is None else ["safety: degenerate batch: not probed"]
        return Answer(view, view.scores, skipped=skipped, logs=logs, update_state=action != "skip_degenerate")
