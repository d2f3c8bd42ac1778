"""``AdapterState``: one exact copy of what adaptation changes, captured and applied by named parts.

What a :class:`~hf_tta.TTAWrapper` changes while it adapts is seven parts:

========== ==============================================================================================
part       what it holds
========== ==============================================================================================
params     the adapted parameters' values, and any other tensor the optimiser steps (ClipTTA's open-set
           threshold alpha, named ``optimizer.extra.<i>``)
optimizer  the optimiser's per-parameter state (AdamW's moments and step counts), keyed by parameter name,
           and its ``param_groups``; ``fresh`` = an optimiser that has never stepped (rebuilt on apply)
objective  the objective's state (TCR's queue, SAR's EMA, ...)
transform  the score transform's state (DN's query mean)
rng        the wrapper's random generator
counter    the batch counter
selector   the learning-rate search's state (:mod:`hf_tta.lr_search`, issue 37): its shadows during the probe (one
           :data:`SHADOW` state per candidate lr, the slots of its :class:`~hf_tta.slots.SlotBank`, in
           ``shadows``), the proxy's running scores, the chosen lr and
           the probe's cost counters, the lr in use and the online rule's last step (:mod:`hf_tta.lr_online`);
           empty when ``TTAConfig.lr_search`` is off or after a reset
========== ==============================================================================================

State is copied only here, and every copy takes one of the named subsets (the only rules there are):

* :data:`STEP_UNDO`: a step's undo (SAM's diverged second pass, the fast path's replay);
* :data:`STEP_OBJECTIVE`: the checked loop's per-step undo of the objective's state after a non-finite step, and the
  throw-away state SAM's second pass evaluates on (a :meth:`~AdapterState.view`);
* :data:`ROLLBACK`: the safety layer's last-good snapshot (the batch counter, RNG and score transform go on), the
  learning-rate search's state included, so a rollback restores its shadows and choice too;
* :data:`SHADOW`: one candidate of the learning-rate search (:mod:`hf_tta.lr_search`): what a candidate lr adapts;
* :data:`ANSWER`: what an answer reads besides the model (:mod:`hf_tta.answering`: objective and score-transform state,
  RNG; a :meth:`~AdapterState.view`), also the score transform's state that a degenerate batch must not change;
* :data:`SERVED`: what a published version is (:data:`ANSWER`, the adapted parameters and the batch counter), captured
  after an adapted batch and applied to the reader that answers with it (:mod:`hf_tta.readers`; the service's channel
  carries the same parts);
* :data:`ALL`: a routed domain, a checkpoint, the source state that :meth:`~hf_tta.TTAWrapper.reset` applies.

The safety monitor's own tensors are the monitor's (:meth:`hf_tta.safety.SafetyMonitor.state_tensors`).

**Capture, view, apply.** :meth:`AdapterState.capture` copies (``clone``; a refresh copies into the same buffers with one
foreach call), so a rollback, a reset, a domain swap and a resumed checkpoint are bit-identical to the state captured.
:meth:`AdapterState.view` takes the objective's and score transform's state, the RNG and the counter *without copying
the tensors*: new dicts sharing them. That is exact because those states are only ever replaced entry by entry, never
written in place (every objective of the registry is checked: ``tests/test_objectives_base.py``); parameters and
optimiser moments are written in place by the optimiser and cannot be viewed (nor can the selector's shadows).
:meth:`AdapterState.apply` puts a capture or a view back (copies again), :meth:`AdapterState.copy` gives an independent exact copy of a capture. :meth:`AdapterState.to_tensors` writes
the checkpoint's keys (``param.*``, ``optim.<pid>.*`` or ``optim.<name>.*``, ``objective.*``, ``score_transform.*``,
``wrapper.batch_index``, ``wrapper.rng_state``, ``selector.*`` with each shadow under ``selector.shadow.<k>.``) and
:meth:`AdapterState.from_tensors` reads them back.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Protocol

import torch

PARAMS, OPTIMIZER, OBJECTIVE, TRANSFORM, RNG, COUNTER = "params", "optimizer", "objective", "transform", "rng", "counter"
SELECTOR = "selector"
ALL = frozenset({PARAMS, OPTIMIZER, OBJECTIVE, TRANSFORM, RNG, COUNTER, SELECTOR})
STEP_UNDO = frozenset({PARAMS, OPTIMIZER, OBJECTIVE, RNG})
STEP_OBJECTIVE = frozenset({OBJECTIVE})
SHADOW = frozenset({PARAMS, OPTIMIZER, OBJECTIVE})
ROLLBACK = SHADOW | {SELECTOR}
ANSWER = frozenset({OBJECTIVE, TRANSFORM, RNG})
SERVED = ANSWER | {PARAMS, COUNTER}
VIEWABLE = frozenset({OBJECTIVE, TRANSFORM, RNG, COUNTER})  # the parts that are replaced, never written in place
EXTRA_PREFIX = "optimizer.extra."
SHADOW_PREFIX = "selector.shadow."  # the lr search's shadows in a checkpoint: selector.shadow.<k>.<a SHADOW state's keys>


class Adaptable(Protocol):
    """What an :class:`AdapterState` reads and writes (a :class:`~hf_tta.TTAWrapper`)."""

    optimizer: torch.optim.Optimizer | None
    state: dict[str, torch.Tensor]
    transform_state: dict[str, torch.Tensor]
    generator: torch.Generator
    batch_index: int
    selector_state: dict[str, torch.Tensor]
    selector_shadows: Any  # the lr search's SlotBank of shadows (hf_tta.slots), None without an lr search
    params: dict[str, torch.Tensor]

    def rebuild_optimizer(self) -> None: ...


def named_optimized(optimizer: torch.optim.Optimizer | None, params: dict[str, torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
    """The tensors ``optimizer`` steps in its order (its groups: ``lr_multipliers``): the adapted ``params`` by name,
    then other tensors it steps (ClipTTA's alpha: ``optimizer.extra.<i>``); ``params`` alone without an optimiser."""
    if optimizer is None:
        return list(params.items())
    names = {id(p): n for n, p in params.items()}
    ordered = [p for g in optimizer.param_groups for p in g["params"]]
    extra = [p for p in ordered if id(p) not in names]
    return [(names[id(p)], p) for p in ordered if id(p) in names] + [(f"{EXTRA_PREFIX}{i}", p) for i, p in enumerate(extra)]


@dataclass
class OptimizerState:
    """An optimiser's per-parameter state by parameter name (``names`` in the optimiser's order, which gives the
    checkpoint's ``pid``), and its ``param_groups`` as ``state_dict()`` writes them."""

    names: list[str]
    state: dict[str, dict[str, Any]]
    param_groups: list[dict[str, Any]]
    fresh: bool = False


@dataclass
class AdapterState:
    """An exact copy of the ``parts`` of an :class:`Adaptable`'s state (see :mod:`hf_tta.state`)."""

    parts: frozenset[str]
    params: dict[str, torch.Tensor] = field(default_factory=dict)
    optimizer: OptimizerState | None = None
    objective: dict[str, torch.Tensor] = field(default_factory=dict)
    transform: dict[str, torch.Tensor] = field(default_factory=dict)
    rng: torch.Tensor | None = None
    batch_index: int = 0
    selector: dict[str, torch.Tensor] = field(default_factory=dict)
    shadows: dict[int, AdapterState] = field(default_factory=dict)  # the lr search's, by candidate (SELECTOR part)
    shared: bool = False  # a view: its tensors are the target's (applied as new dicts, not cloned)

    # ------------------------------------------------------------------------------------------ capture / apply
    @classmethod
    @torch.no_grad()
    def capture(cls, target: Adaptable, parts: Iterable[str], into: AdapterState | None = None) -> AdapterState:
        """Copy ``parts`` of ``target``'s state. With ``into`` (an earlier capture of the same parts and layout) the
        tensors are copied into its buffers with one foreach call, and ``into`` is returned."""
        parts = frozenset(parts)
        named = named_optimized(target.optimizer, target.params) if parts & {PARAMS, OPTIMIZER} else []
        opt = target.optimizer if OPTIMIZER in parts else None
        live: list[tuple[tuple[str, ...], torch.Tensor]] = []
        plain: dict[str, dict[str, Any]] = {}
        if PARAMS in parts:
            live += [(("param", n), p.detach()) for n, p in named]
        if opt is not None:
            for name, p in named:
                for key, value in opt.state.get(p, {}).items():
                    if torch.is_tensor(value):
                        live.append((("optim", name, key), value))
                    else:
                        plain.setdefault(name, {})[key] = copy.deepcopy(value)
        if into is not None and into.parts == parts and into._layout() == [(k, t.shape, t.dtype, t.device) for k, t in live]:
            if live:
                torch._foreach_copy_(into._buffers(), [t for _, t in live])
            out = into
        else:
            out = cls(parts)
            copies = torch._foreach_mul([t for _, t in live], 1.0) if live else []  # x * 1 is exact (-0.0, NaN too)
            for (key, _), value in zip(live, copies):
                if key[0] == "param":
                    out.params[key[1]] = value
                else:
                    out._optim_state(key[1])[key[2]] = value
        if opt is not None:
            by_id = {id(p): n for n, p in named}
            names = [by_id[id(p)] for g in opt.param_groups for p in g["params"]]  # the optimiser's order (pid)
            state = out.optimizer.state if out.optimizer is not None else {}
            state = {n: {k: v for k, v in state.get(n, {}).items() if torch.is_tensor(v)} for n in names}
            for name, values in plain.items():
                state[name].update(values)
            out.optimizer = OptimizerState(names, {n: s for n, s in state.items() if s}, opt.state_dict()["param_groups"])
        if OBJECTIVE in parts:
            out.objective = {k: v.clone() for k, v in target.state.items()}
        if TRANSFORM in parts:
            out.transform = {k: v.clone() for k, v in target.transform_state.items()}
        if RNG in parts:
            out.rng = target.generator.get_state()
        if COUNTER in parts:
            out.batch_index = int(target.batch_index)
        if SELECTOR in parts:
            out.selector = {k: v.clone() for k, v in target.selector_state.items()}
            bank = target.selector_shadows
            out.shadows = {k: bank.state(k) for k in bank.keys} if bank is not None else {}
        return out

    @classmethod
    def view(cls, target: Adaptable, parts: Iterable[str]) -> AdapterState:
        """The ``parts`` of ``target``'s state without copying their tensors (new dicts sharing them; the RNG state is a
        copy): an exact capture as long as those tensors are replaced, never written in place, which holds for the
        :data:`VIEWABLE` parts only (see :mod:`hf_tta.state`)."""
        parts = frozenset(parts)
        if not parts <= VIEWABLE:
            raise ValueError(f"{sorted(parts - VIEWABLE)} are written in place (by the optimiser): capture them instead.")
        out = cls(parts, shared=True)
        if OBJECTIVE in parts:
            out.objective = dict(target.state)
        if TRANSFORM in parts:
            out.transform = dict(target.transform_state)
        if RNG in parts:
            out.rng = target.generator.get_state()
        if COUNTER in parts:
            out.batch_index = int(target.batch_index)
        return out

    def copy(self) -> AdapterState:
        """An independent exact copy of this state's parts (their tensors cloned; the parts left out stay empty)."""
        p, clone = self.parts, (lambda d: {k: v.clone() for k, v in d.items()})
        return AdapterState(
            p, params=clone(self.params) if PARAMS in p else {},
            optimizer=copy.deepcopy(self.optimizer) if OPTIMIZER in p else None,
            objective=clone(self.objective) if OBJECTIVE in p else {},
            transform=clone(self.transform) if TRANSFORM in p else {},
            rng=self.rng.clone() if RNG in p and self.rng is not None else None, batch_index=self.batch_index,
            selector=clone(self.selector) if SELECTOR in p else {},
            shadows={k: v.copy() for k, v in self.shadows.items()} if SELECTOR in p else {},
        )

    def only(self, parts: Iterable[str]) -> AdapterState:
        """A view of this state restricted to ``parts`` (shares the tensors: apply copies them)."""
        return dataclasses.replace(self, parts=self.parts & frozenset(parts))

    def _optim_state(self, name: str) -> dict[str, Any]:
        if self.optimizer is None:
            self.optimizer = OptimizerState([], {}, [])
        return self.optimizer.state.setdefault(name, {})

    def _tensor_items(self) -> list[tuple[tuple[str, ...], torch.Tensor]]:
        items: list[tuple[tuple[str, ...], torch.Tensor]] = [(("param", n), t) for n, t in self.params.items()]
        if self.optimizer is not None:
            for name, st in self.optimizer.state.items():
                items += [(("optim", name, k), v) for k, v in st.items() if torch.is_tensor(v)]
        return items

    def _layout(self) -> list[tuple]:
        return [(k, t.shape, t.dtype, t.device) for k, t in self._tensor_items()]

    def _buffers(self) -> list[torch.Tensor]:
        return [t for _, t in self._tensor_items()]

    @torch.no_grad()
    def apply(self, target: Adaptable) -> None:
        """Put the captured parts back into ``target``, bit-exactly. Parameters are copied in place; the optimiser's
        state is replaced by copies (state created after the capture is dropped; a ``fresh`` optimiser is rebuilt);
        objective and transform state are replaced by copies (by new dicts of the same tensors for a :meth:`view`, whose
        tensors are never written in place). ``target`` keeps what was not captured."""
        if SELECTOR in self.parts and self.shadows and target.selector_shadows is None:  # refused before any change
            raise ValueError("The state holds lr-search shadows and this wrapper runs no lr search: set TTAConfig.lr_search as saved.")
        if PARAMS in self.parts and self.params:
            live = dict(named_optimized(target.optimizer, target.params))
            missing = sorted(set(self.params) - set(live))
            if missing:
                raise ValueError(f"The captured state adapts {missing[:2]}, which this wrapper does not: another model or config?")
            names = list(self.params)
            torch._foreach_copy_([live[n] for n in names], [self.params[n] for n in names])
        if OPTIMIZER in self.parts:
            if self.optimizer is None or self.optimizer.fresh or target.optimizer is None:
                target.rebuild_optimizer()
            else:
                live = dict(named_optimized(target.optimizer, target.params))
                opt = target.optimizer
                for p in live.values():
                    opt.state.pop(p, None)
                for name, st in self.optimizer.state.items():
                    opt.state[live[name]] = {k: v.clone() if torch.is_tensor(v) else copy.deepcopy(v) for k, v in st.items()}
        own = dict if self.shared else (lambda d: {k: v.clone() for k, v in d.items()})
        if OBJECTIVE in self.parts:
            target.state = own(self.objective)
        if TRANSFORM in self.parts:
            target.transform_state = own(self.transform)
        if RNG in self.parts and self.rng is not None:
            target.generator.set_state(self.rng)
        if COUNTER in self.parts:
            target.batch_index = self.batch_index
        if SELECTOR in self.parts:
            target.selector_state = {k: v.clone() for k, v in self.selector.items()}
            bank = target.selector_shadows
            if bank is not None:
                bank.restore({k: v.copy() for k, v in self.shadows.items()})

    # ------------------------------------------------------------------------------------------ checkpoint layout
    def to_tensors(self, prefix: str = "", optimizer_keys: str = "pid") -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """The checkpoint's tensors and metadata of this state. ``optimizer_keys="pid"`` (a wrapper's own state) writes
        ``param.<name>`` for the adapted parameters (not the per-batch optimiser extras), ``optim.<pid>.<key>`` and the
        metadata ``{"optimizer": {"param_groups", "plain_state"}}``; ``"name"`` (the safety snapshot) writes every
        optimised tensor under ``param.<name>``, ``optim.<name>.<key>`` and ``{"optim_plain": {name: {...}}}``."""
        by_pid = optimizer_keys == "pid"
        tensors: dict[str, torch.Tensor] = {
            f"{prefix}param.{n}": t for n, t in self.params.items() if not (by_pid and n.startswith(EXTRA_PREFIX))
        }
        meta: dict[str, Any] = {}
        if self.optimizer is not None:
            plain: dict[str, dict[str, Any]] = {}
            pids = {n: i for i, n in enumerate(self.optimizer.names)}
            for name, st in self.optimizer.state.items():
                key = str(pids[name]) if by_pid else name
                for sub, value in st.items():
                    if torch.is_tensor(value):
                        tensors[f"{prefix}optim.{key}.{sub}"] = value
                    else:
                        plain.setdefault(key, {})[sub] = value
            meta = {"optimizer": {"param_groups": self.optimizer.param_groups, "plain_state": plain}} if by_pid else {"optim_plain": plain}
        tensors.update({f"{prefix}objective.{k}": v for k, v in self.objective.items()})
        if TRANSFORM in self.parts:
            tensors.update({f"{prefix}score_transform.{k}": v for k, v in self.transform.items()})
        if COUNTER in self.parts:
            tensors[f"{prefix}wrapper.batch_index"] = torch.tensor(self.batch_index)
        if RNG in self.parts and self.rng is not None:
            tensors[f"{prefix}wrapper.rng_state"] = self.rng
        if SELECTOR in self.parts:
            tensors.update({f"{prefix}selector.{k}": v for k, v in self.selector.items()})
            for k, shadow in self.shadows.items():
                shadow_tensors, shadow_meta = shadow.to_tensors(f"{prefix}selector.shadow.{k}.", optimizer_keys="name")
                if shadow_meta.get("optim_plain"):
                    raise ValueError("lr_search keeps optimiser states of tensors only (AdamW, SAM); this optimiser "
                                     "has other state: drop lr_search.")
                tensors.update(shadow_tensors)
        return tensors, meta

    @classmethod
    def from_tensors(
        cls,
        tensors: Mapping[str, torch.Tensor],
        meta: Mapping[str, Any],
        parts: Iterable[str],
        names: list[str],
        prefix: str = "",
        optimizer_keys: str = "pid",
        step_on_cpu: bool = True,
    ) -> AdapterState:
        """Read what :meth:`to_tensors` wrote. ``names`` are the optimised tensors' names in the optimiser's order
        (the wrapper's :meth:`~hf_tta.TTAWrapper.named_optimized_parameters`); ``step_on_cpu``: AdamW keeps ``step``
        on the CPU unless fused or capturable."""
        parts = frozenset(parts)
        entries = {k[len(prefix) :]: v for k, v in tensors.items() if k.startswith(prefix)}
        out = cls(parts)
        by_pid = optimizer_keys == "pid"
        out.params = {n: entries[f"param.{n}"].clone() for n in names if f"param.{n}" in entries}
        wanted = [n for n in names if not (by_pid and n.startswith(EXTRA_PREFIX))]
        absent = [n for n in wanted if n not in out.params]
        if absent:
            raise ValueError(f"The checkpoint lacks adapted tensor(s) {absent[:2]}: it is incomplete or of another config.")
        if OPTIMIZER in parts:
            source = meta.get("optimizer", {}) if by_pid else {"plain_state": meta.get("optim_plain", {})}
            state: dict[str, dict[str, Any]] = {}
            for sub, value in entries.items():
                if sub.startswith("optim."):
                    key, name = sub[len("optim.") :].rsplit(".", 1)
                    owner = names[int(key)] if by_pid else key
                    state.setdefault(owner, {})[name] = value.cpu().clone() if name == "step" and step_on_cpu else value.clone()
            for key, plain in source.get("plain_state", {}).items():
                state.setdefault(names[int(key)] if by_pid else key, {}).update(copy.deepcopy(plain))
            out.optimizer = OptimizerState(list(names), state, source.get("param_groups", []))
        out.objective = {k[len("objective.") :]: v.clone() for k, v in entries.items() if k.startswith("objective.")}
        out.transform = {k[len("score_transform.") :]: v.clone() for k, v in entries.items() if k.startswith("score_transform.")}
        if "wrapper.batch_index" in entries:
            out.batch_index = int(entries["wrapper.batch_index"])
        if "wrapper.rng_state" in entries:
            out.rng = entries["wrapper.rng_state"].cpu().clone()
        if SELECTOR in parts:
            out.selector = {k[len("selector.") :]: v.clone() for k, v in entries.items()
                            if k.startswith("selector.") and not k.startswith(SHADOW_PREFIX)}
            ks = sorted({int(k[len(SHADOW_PREFIX) :].split(".", 1)[0]) for k in entries if k.startswith(SHADOW_PREFIX)})
            out.shadows = {k: cls.from_tensors(entries, {}, SHADOW, names, f"{SHADOW_PREFIX}{k}.", "name", step_on_cpu)
                           for k in ks}
        return out

    def equals(self, other: AdapterState) -> bool:
        """Bit-exact equality of two captures (same parts, tensors equal including NaN positions and dtypes)."""

        def same(a: Any, b: Any) -> bool:
            if torch.is_tensor(a) or torch.is_tensor(b):
                return (
                    torch.is_tensor(a) and torch.is_tensor(b) and a.dtype == b.dtype and a.shape == b.shape
                    and bool(torch.equal(a.cpu().view(-1).view(torch.uint8) if a.numel() else a.cpu(),
                                         b.cpu().view(-1).view(torch.uint8) if b.numel() else b.cpu()))
                )
            if isinstance(a, dict) and isinstance(b, dict):
                return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
            return a == b

        if self.parts != other.parts:
            return False
        p = self.parts
        opt_a = None if self.optimizer is None else (self.optimizer.names, self.optimizer.state, self.optimizer.fresh)
        opt_b = None if other.optimizer is None else (other.optimizer.names, other.optimizer.state, other.optimizer.fresh)
        checks = [
            PARAMS not in p or same(self.params, other.params),
            OBJECTIVE not in p or same(self.objective, other.objective),
            TRANSFORM not in p or same(self.transform, other.transform),
            RNG not in p or same(self.rng, other.rng),
            COUNTER not in p or self.batch_index == other.batch_index,
            SELECTOR not in p or same(self.selector, other.selector),
            SELECTOR not in p or (self.shadows.keys() == other.shadows.keys()
                                  and all(v.equals(other.shadows[k]) for k, v in self.shadows.items())),
            OPTIMIZER not in p or (opt_a is None) == (opt_b is None),
            OPTIMIZER not in p or opt_a is None or (opt_a[0] == opt_b[0] and same(opt_a[1], opt_b[1]) and opt_a[2] == opt_b[2]),
        ]
        return all(checks)
