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
with fewer than ``min_queries`` queries are adapted on without judgement (the signals are too noisy).

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

import copy
import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Mapping

import torch

from .configuration_utils import ConfigMixin, check_field_types, check_positive_int

if TYPE_CHECKING:  # pragma: no cover
    from .objectives.base import ObjectiveInputs
    from .wrapper import TTAOutput, TTAWrapper

SAFETY_ACTIONS = ("skip_degenerate", "rollback", "reset")


@dataclass
class SafetyConfig(ConfigMixin):
    """Thresholds of the safety layer (see :mod:`hf_tta.safety` for the rule). Defaults are set a priori, before
    any tuning; every threshold can be switched off (the value given in its help).

    Example:
        >>> cfg = SafetyConfig(min_agreement=0.3)
        >>> SafetyConfig.from_dict(cfg.to_dict()) == cfg
        True
    """

    min_queries: int = field(
        default=8, metadata={"help": "Batches with fewer queries are adapted on without judgement (noisy signals)."}
    )
    min_source_diversity: float = field(
        default=0.1,
        metadata={
            "help": "A batch whose source top-1 diversity ((distinct - 1) / (B - 1)) is below this is degenerate and "
            "not adapted on (any value > 0 flags a batch whose queries all retrieve one item). 0 disables."
        },
    )
    collapse_ratio: float = field(
        default=0.5,
        metadata={"help": "Adapted diversity < collapse_ratio x source diversity = collapse: reset. 0 disables."},
    )
    min_agreement: float = field(
        default=0.2, metadata={"help": "Adapted-vs-source top-1 agreement below this floor: rollback. 0 disables."}
    )
    max_agreement_drop: float = field(
        default=0.5,
        metadata={"help": "Agreement < (1 - max_agreement_drop) x its EMA over kept batches: rollback. 1 disables."},
    )
    agreement_ema_decay: float = field(
        default=0.9, metadata={"help": "Decay of the agreement's EMA (the first kept batch initialises it)."}
    )
    max_rollbacks: int = field(
        default=3, metadata={"help": "This many rollbacks in a row reset to the source model instead."}
    )
    snapshot_every: int = field(
        default=1, metadata={"help": "Refresh the last-good snapshot after this many kept batches in a row."}
    )
    entropy_temperature: float = field(
        default=0.01, metadata={"help": "Temperature of the logged refined-prediction entropy (a log, not a trigger)."}
    )

    def __post_init__(self):
        check_field_types(self)
        for name in ("min_queries", "max_rollbacks", "snapshot_every"):
            check_positive_int(name, getattr(self, name), owner="SafetyConfig")
        ranges = {
            "min_source_diversity": (0.0, 1.0, "[0, 1]", True),
            "collapse_ratio": (0.0, 1.0, "[0, 1]", True),
            "min_agreement": (0.0, 1.0, "[0, 1]", True),
            "max_agreement_drop": (0.0, 1.0, "(0, 1]", True),
            "agreement_ema_decay": (0.0, 1.0, "[0, 1)", False),
        }
        for name, (lo, hi, text, hi_ok) in ranges.items():
            value = getattr(self, name)
            ok = isinstance(value, (int, float)) and not isinstance(value, bool) and lo <= value <= hi
            ok = ok and (hi_ok or value < hi) and not (name == "max_agreement_drop" and value == 0)
            if not ok:
                raise ValueError(f"SafetyConfig `{name}` must be in {text}, got {value!r}.")
        if not isinstance(self.entropy_temperature, (int, float)) or not self.entropy_temperature > 0:
            raise ValueError(f"SafetyConfig `entropy_temperature` must be > 0, got {self.entropy_temperature!r}.")


def build_safety_config(value: SafetyConfig | Mapping[str, Any] | None) -> SafetyConfig | None:
    """``TTAConfig.safety`` (``None``, a dict of overrides or a :class:`SafetyConfig`) as a :class:`SafetyConfig`."""
    if value is None or isinstance(value, SafetyConfig):
        return value
    if not isinstance(value, Mapping):
        raise TypeError(f"`safety` must be None, a dict of SafetyConfig overrides or a SafetyConfig, got {value!r}.")
    known = {f.name for f in dataclasses.fields(SafetyConfig)}
    unknown = sorted(set(value) - known)
    if unknown:
        raise ValueError(f"`safety` has keys {unknown} that SafetyConfig does not define; valid keys: {sorted(known)}.")
    return SafetyConfig(**value)


# ---------------------------------------------------------------------------------------------------- snapshot
class StateSnapshot:
    """Copies of the adapted parameters, the optimiser state and the objective state, keyed by parameter name (so a
    snapshot survives the optimiser being rebuilt, e.g. by SAR's recovery). Refreshing copies into the same buffers
    on the device (one foreach copy) when the layout is unchanged."""

    def __init__(self):
        self.keys: list[tuple[str, ...]] = []  # ("param", name) | ("optim", name, key)
        self.buffers: list[torch.Tensor] = []
        self.optim_plain: dict[str, dict[str, Any]] = {}  # non-tensor optimiser state, by parameter name
        self.objective: dict[str, torch.Tensor] = {}

    @staticmethod
    def _live(tta: "TTAWrapper") -> tuple[list[tuple[str, ...]], list[torch.Tensor], dict[str, dict[str, Any]]]:
        named = tta.named_optimized_parameters()  # the adapted parameters and e.g. ClipTTA's open-set alpha
        keys: list[tuple[str, ...]] = [("param", n) for n, _ in named]
        tensors: list[torch.Tensor] = [p.detach() for _, p in named]
        plain: dict[str, dict[str, Any]] = {}
        opt_state = tta.optimizer.state if tta.optimizer is not None else {}
        for name, p in named:
            for key, value in opt_state.get(p, {}).items():
                if torch.is_tensor(value):
                    keys.append(("optim", name, key))
                    tensors.append(value)
                else:
                    plain.setdefault(name, {})[key] = copy.deepcopy(value)
        return keys, tensors, plain

    @torch.no_grad()
    def take(self, tta: "TTAWrapper") -> "StateSnapshot":
        keys, tensors, plain = self._live(tta)
        same = keys == self.keys and all(
            b.shape == t.shape and b.dtype == t.dtype and b.device == t.device for b, t in zip(self.buffers, tensors)
        )
        if same and tensors:
            torch._foreach_copy_(self.buffers, tensors)
        else:
            self.keys, self.buffers = keys, [t.clone() for t in tensors]
        self.optim_plain = plain
        self.objective = {k: v.clone() for k, v in tta.state.items()}
        return self

    @torch.no_grad()
    def restore(self, tta: "TTAWrapper") -> None:
        """Put the snapshot back, bit-exactly: parameters copied in place, the optimiser's per-parameter state replaced
        by copies (state created after the snapshot is dropped), the objective state replaced by copies."""
        live = dict(tta.named_optimized_parameters())
        params = [live[k[1]] for k in self.keys if k[0] == "param"]
        values = [b for k, b in zip(self.keys, self.buffers) if k[0] == "param"]
        if params:
            torch._foreach_copy_(params, values)
        if tta.optimizer is not None:
            for p in live.values():
                tta.optimizer.state.pop(p, None)
            for key, buf in zip(self.keys, self.buffers):
                if key[0] == "optim":
                    tta.optimizer.state[live[key[1]]][key[2]] = buf.clone()
            for name, plain in self.optim_plain.items():
                tta.optimizer.state[live[name]].update(copy.deepcopy(plain))
        tta.state.clear()
        tta.state.update({k: v.clone() for k, v in self.objective.items()})

    def tensors(self, prefix: str) -> dict[str, torch.Tensor]:
        out = {f"{prefix}{'.'.join(k)}": b for k, b in zip(self.keys, self.buffers)}
        out.update({f"{prefix}objective.{k}": v for k, v in self.objective.items()})
        return out

    @classmethod
    def from_tensors(
        cls, tta: "TTAWrapper", tensors: Mapping[str, torch.Tensor], prefix: str, plain: Mapping[str, Any]
    ) -> "StateSnapshot":
        snap = cls()
        entries = {k[len(prefix) :]: v for k, v in tensors.items() if k.startswith(prefix)}
        for name in tta.params:  # parameters first, in the wrapper's order, then the optimiser's entries
            snap.keys.append(("param", name))
            snap.buffers.append(entries[f"param.{name}"].clone())
        for sub, value in entries.items():
            if sub.startswith("optim."):
                name, key = sub[len("optim.") :].rsplit(".", 1)
                snap.keys.append(("optim", name, key))
                snap.buffers.append(value.cpu().clone() if key == "step" and _step_on_cpu(tta) else value.clone())
            elif sub.startswith("objective."):
                snap.objective[sub[len("objective.") :]] = value.clone()
        snap.optim_plain = {k: dict(v) for k, v in plain.items()}
        return snap


def _step_on_cpu(tta: "TTAWrapper") -> bool:
    """AdamW keeps ``step`` on the CPU unless fused or capturable (then on the parameters' device)."""
    opt = tta.optimizer
    return opt is not None and not any(g.get("fused") or g.get("capturable") for g in opt.param_groups)


# ---------------------------------------------------------------------------------------------------- monitor
class SafetyMonitor:
    """The per-stream state of the safety layer and its decisions (see :mod:`hf_tta.safety`). The wrapper calls
    :meth:`begin` before adapting on a batch, :meth:`judge` on the scores the batch would return, and :meth:`finish`
    on its output."""

    def __init__(self, config: SafetyConfig):
        self.config = config
        self.clear()

    def clear(self) -> None:
        """Forget the stream: counts, EMA, streaks and the snapshot (taken again from the state at the next batch)."""
        self.counts: dict[str, int] = {a: 0 for a in SAFETY_ACTIONS}
        self.agreement_ema: float | None = None
        self.rollbacks_in_row = 0
        self.kept_in_row = 0
        self.snapshot: StateSnapshot | None = None
        self._end_batch()

    def _end_batch(self) -> None:
        self._source: ObjectiveInputs | None = None
        self._source_ids: torch.Tensor | None = None
        self._source_top1: tuple[torch.Tensor, torch.Tensor] | None = None
        self._action: str | None = None
        self._logs: dict[str, float] = {}
        self._judged = False

    # ---------------------------------------------------------------------------------------- per batch
    def source_cache(self) -> list[torch.Tensor]:
        """The batch's source scores for the objective's ``source_scores()`` (dense gallery), so no second forward."""
        if self._source is None or self._source_ids is not None:
            return []
        return [self._source.scores]

    def source_inputs(self) -> "ObjectiveInputs | None":
        """The batch's source-model inputs (embeddings and scores) on a dense gallery, else ``None``: a training-free
        objective scores on them instead of running the same forward again."""
        return self._source if self._source is not None and self._source_ids is None else None

    def begin(self, tta: "TTAWrapper", queries: dict, gallery) -> "TTAOutput | None":
        """Score the batch with the source model; return the output of a degenerate batch (not to be adapted on),
        else ``None``."""
        self._end_batch()
        if self.snapshot is None:
            self.snapshot = StateSnapshot().take(tta)
        with torch.no_grad(), tta.disabled():
            src = tta._inputs(queries, gallery, tta.config.steps - 1, record=True)
        self._source = dataclasses.replace(src, query_emb=src.query_emb.detach(), scores=src.scores.detach())
        self._source_ids = tta._candidate_ids if _is_backend(gallery) else None  # the source's candidate columns
        self._source_top1 = _top1(self._source.scores, self._source_ids)
        b = self._source.scores.shape[0]
        if b < self.config.min_queries:
            return None
        self._judged = True
        d_src = float(_diversity(self._source_top1[1]))  # the one host sync before adapting
        self._logs["source_diversity"] = d_src
        if d_src >= self.config.min_source_diversity:
            return None
        self._act("skip_degenerate")
        from .wrapper import TTAOutput

        return TTAOutput(
            scores=self.source_scores(tta, update_transform=False), loss=None, num_updates=0, n_selected=0,
            skipped=[f"degenerate batch (source top-1 diversity {d_src:.3g} < {self.config.min_source_diversity}): not adapted"],
        )

    def source_scores(self, tta: "TTAWrapper", update_transform: bool = True) -> torch.Tensor:
        """The source model's scores of the batch through the score transform (a top-k backend reports the source
        candidates' top-k); ``update_transform=False`` leaves the transform's state as it was (a degenerate batch)."""
        if self._source_ids is not None:
            tta._candidate_ids = self._source_ids
        return tta._transform_scores(self._source, self._source.scores, update_state=update_transform)

    @torch.no_grad()
    def judge(self, tta: "TTAWrapper", inputs: "ObjectiveInputs", scores: torch.Tensor) -> tuple["ObjectiveInputs", torch.Tensor]:
        """Decide keep / rollback / reset from the scores the batch would return; on a rollback or reset the state is
        restored and the source model's inputs and scores are returned instead."""
        if not self._judged:
            return inputs, scores
        cfg = self.config
        ids = getattr(tta, "_candidate_ids", None) if self._source_ids is not None else None
        a_col, a_top1 = _top1(scores, ids)
        s_col, s_top1 = self._source_top1
        src = self._source
        signals = {
            "finite": torch.isfinite(scores).all().to(torch.float64),
            "adapted_diversity": _diversity(a_top1),
            "agreement": (a_top1 == s_top1.to(a_top1.device)).to(torch.float64).mean(),
            "adapted_entropy": _refined_entropy(scores, a_col, cfg.entropy_temperature),
            "source_entropy": _refined_entropy(src.scores, s_col, cfg.entropy_temperature),
            "adapted_spread": _spread(inputs.query_emb.detach()),
            "source_spread": _spread(src.query_emb),
            "adapted_gap": _gap(inputs.query_emb.detach(), inputs.gallery_emb[a_col]),
            "source_gap": _gap(src.query_emb, src.gallery_emb[s_col]),
        }
        values = torch.stack([v.to(torch.float64).reshape(()).cpu() for v in signals.values()]).tolist()  # one sync
        logs = dict(zip(signals, values))
        finite = logs.pop("finite") == 1.0
        self._logs.update(logs)
        agreement = logs["agreement"]
        if not finite or logs["adapted_diversity"] < cfg.collapse_ratio * self._logs["source_diversity"]:
            action = "reset"
        elif agreement < cfg.min_agreement or (
            self.agreement_ema is not None and agreement < (1.0 - cfg.max_agreement_drop) * self.agreement_ema
        ):
            self.rollbacks_in_row += 1
            action = "rollback" if self.rollbacks_in_row < cfg.max_rollbacks else "reset"
        else:
            action = None
        if action is None:
            self.rollbacks_in_row = 0
            d = cfg.agreement_ema_decay
            self.agreement_ema = agreement if self.agreement_ema is None else d * self.agreement_ema + (1 - d) * agreement
            self.kept_in_row += 1
            if self.kept_in_row >= cfg.snapshot_every:
                self.snapshot.take(tta)
                self.kept_in_row = 0
        elif action == "rollback":
            self.snapshot.restore(tta)
            self.kept_in_row = 0
        else:  # reset to the source model; batch counter, RNG and score transform state go on
            tta._restore_parameters()
            tta.state = tta.objective.init_state(tta.device)
            self.agreement_ema, self.rollbacks_in_row, self.kept_in_row = None, 0, 0
            self.snapshot.take(tta)
        if self.agreement_ema is not None:
            self._logs["agreement_ema"] = self.agreement_ema
        if action is None:
            return inputs, scores
        self._act(action)
        if self._source_ids is not None:
            tta._candidate_ids = self._source_ids
        return self._source, self._source.scores

    def _act(self, action: str) -> None:
        self._action = action
        self.counts[action] += 1

    def finish(self, out: "TTAOutput") -> "TTAOutput":
        """Attach this batch's action and signals to the output."""
        out = dataclasses.replace(out, safety_action=self._action, safety_logs=dict(self._logs))
        self._end_batch()
        return out

    # ---------------------------------------------------------------------------------------- checkpoint
    def save_into(self, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
        """Add the monitor's state to a checkpoint's tensors (``safety.*``) and metadata (``"safety"``)."""
        for action, n in self.counts.items():
            tensors[f"safety.counts.{action}"] = torch.tensor(n, dtype=torch.int64)
        tensors["safety.rollbacks_in_row"] = torch.tensor(self.rollbacks_in_row, dtype=torch.int64)
        tensors["safety.kept_in_row"] = torch.tensor(self.kept_in_row, dtype=torch.int64)
        if self.agreement_ema is not None:
            tensors["safety.agreement_ema"] = torch.tensor(self.agreement_ema, dtype=torch.float64)
        if self.snapshot is not None:
            tensors.update(self.snapshot.tensors("safety.snapshot."))
        meta["safety"] = {
            "snapshot": self.snapshot is not None,
            "optim_plain": self.snapshot.optim_plain if self.snapshot is not None else {},
        }

    def load_from(self, tta: "TTAWrapper", tensors: Mapping[str, torch.Tensor], meta: Mapping[str, Any] | None) -> None:
        """Restore what :meth:`save_into` wrote; a checkpoint saved without the safety layer starts a fresh monitor."""
        self.clear()
        if not meta or "safety.rollbacks_in_row" not in tensors:
            return
        self.counts = {a: int(tensors[f"safety.counts.{a}"]) for a in SAFETY_ACTIONS}
        self.rollbacks_in_row = int(tensors["safety.rollbacks_in_row"])
        self.kept_in_row = int(tensors["safety.kept_in_row"])
        if "safety.agreement_ema" in tensors:
            self.agreement_ema = float(tensors["safety.agreement_ema"])
        if meta.get("snapshot"):
            self.snapshot = StateSnapshot.from_tensors(tta, tensors, "safety.snapshot.", meta.get("optim_plain", {}))


# ---------------------------------------------------------------------------------------------------- signals
def _is_backend(gallery) -> bool:
    from .gallery.base import GalleryBackend

    return isinstance(gallery, GalleryBackend)


def _top1(scores: torch.Tensor, ids: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Each query's best column and its gallery index (the first on ties). With a top-k backend the columns after the
    candidates (an objective's extra rows) are not gallery items."""
    if ids is None:
        col = scores.argmax(dim=1)
        return col, col
    col = scores[:, : ids.numel()].argmax(dim=1)
    return col, ids.to(col.device)[col]


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
