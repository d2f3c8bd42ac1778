"""Per-tenant adapted states in the adapting process: one :class:`~hf_tta.TTAWrapper` and one slot per tenant in a
:class:`~hf_tta.slots.SlotBank` (its :class:`~hf_tta.state.AdapterState` and safety monitor), switched in around each
tenant's batch.

Why not :class:`~hf_tta.routing.RoutedTTAWrapper`: the service needs, per tenant, a version counter that survives
restarts, a reset and a rollback of that tenant alone, and a checkpoint that holds those; the versions and histories
are kept here, the states in the same bank of slots the router's domains use. A service without tenants is this with
the one tenant ``"default"``.

Checkpoint (:meth:`TenantAdapters.save`): one safetensors file (written beside and renamed: atomic) holding each
tenant's :data:`~hf_tta.state.ALL` state and safety monitor under ``tenant.<i>.``, with the tenants' keys, versions,
the global version and the resolved :class:`~hf_tta.TTAConfig` in its metadata; :meth:`load` refuses a file written
with another config or another set of adapted parameters, in one line, before changing anything.
"""

from __future__ import annotations

import collections
import json
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import torch

from ..config import TTAConfig
from ..slots import SlotBank
from ..state import ALL, AdapterState
from ..wrapper import TTAWrapper
from .codec import Snapshot, TenantState

logger = logging.getLogger(__name__)

DEFAULT_TENANT = "default"


class TenantLimit(ValueError):
    """A new tenant past the configured limit (the request's 4xx; nothing changes)."""


@dataclass
class Tenant:
    """One tenant's version, when it was last published and its recent states (for rollback); its state and monitor
    are its slot in :attr:`TenantAdapters.bank`."""

    version: int = 0
    published: float = field(default_factory=time.time)
    history: collections.deque = field(default_factory=lambda: collections.deque(maxlen=4))


class TenantAdapters:
    """A wrapper adapted per tenant (see :mod:`hf_tta.service.tenants`).

    Args:
        wrapper (`TTAWrapper`): the wrapper to adapt (a plain one; at its source state).
        max_tenants (`int`): how many tenants may have their own state; a new one past it raises :class:`TenantLimit`.
        history (`int`): adapted states kept per tenant for :meth:`rollback`.
    """

    def __init__(self, wrapper: TTAWrapper, max_tenants: int = 8, history: int = 4):
        if type(wrapper) is not TTAWrapper:
            raise TypeError(f"TenantAdapters adapts a plain TTAWrapper per tenant, got {type(wrapper).__name__}.")
        if not isinstance(max_tenants, int) or max_tenants < 1:
            raise ValueError(f"max_tenants={max_tenants!r}: pass a positive integer.")
        self.wrapper, self.max_tenants, self.history = wrapper, max_tenants, int(history)
        self.source = AdapterState.capture(wrapper, ALL)  # the state a new tenant starts from
        self.bank = SlotBank(wrapper, source=self.source)  # the tenants' states and monitors (its active key: whose state is in the wrapper)
        self.tenants: dict[str, Tenant] = {}
        self.version = 0  # +1 per publish, all tenants together
        self.counters: dict[str, Any] = {"batches": 0, "queries": 0, "actions": {}, "errors": 0}

    @property
    def live(self) -> str | None:
        """The tenant whose state is in the wrapper now (``None``: none since the last reset, rollback or load)."""
        return self.bank.active

    def check(self, key: str) -> None:
        """Raise :class:`TenantLimit` if ``key`` would be a tenant past the limit."""
        if key not in self.tenants and len(self.tenants) >= self.max_tenants:
            raise TenantLimit(f"tenant limit reached ({self.max_tenants} tenants have state, counting {DEFAULT_TENANT!r} once "
                              "a request without X-Tenant used it): raise --max-tenants or reuse an existing X-Tenant")

    def activate(self, key: str) -> Tenant:
        """Put tenant ``key``'s state into the wrapper (creating the tenant at the source state)."""
        self.check(key)
        if key not in self.tenants:
            self.tenants[key] = Tenant(history=collections.deque(maxlen=self.history))
            self.bank.add(key)
        self.bank.set_active(key)
        return self.tenants[key]

    def adapt(self, key: str, queries: Mapping[str, torch.Tensor], gallery: Any, **kwargs: Any) -> Any:
        """One ``adapt_step`` of tenant ``key`` on ``queries``; its version goes up by one."""
        tenant = self.activate(key)
        before = AdapterState.capture(self.wrapper, ALL)
        out = self.wrapper.adapt_step(queries, gallery, **kwargs)
        tenant.history.append(before)
        self._bump(tenant)
        action = getattr(out, "safety_action", None)
        n = next(iter(queries.values())).shape[0]
        self.counters["batches"] += 1
        self.counters["queries"] += n
        if action:
            self.counters["actions"][action] = self.counters["actions"].get(action, 0) + 1
        return out

    def _bump(self, tenant: Tenant) -> None:
        tenant.version += 1
        tenant.published = time.time()
        self.version += 1

    def reset(self, key: str | None = None) -> list[str]:
        """Return tenant ``key`` (every tenant: ``None``) exactly to the source state; their versions go on."""
        keys = list(self.tenants) if key is None else [key]
        for k in keys:
            if k not in self.tenants:
                raise KeyError(f"no tenant {k!r}: the tenants are {sorted(self.tenants)}")
        self.bank.deactivate()
        for k in keys:
            tenant = self.tenants[k]
            tenant.history.append(self.bank.slot(k).state or self.source)
            self.bank.put(k, None, self.wrapper.safety.fresh())
            self._bump(tenant)
        return keys

    def rollback(self, key: str) -> int:
        """Return tenant ``key`` to its state before its last adapted batch (or reset); returns the states left."""
        if key not in self.tenants:
            raise KeyError(f"no tenant {key!r}: the tenants are {sorted(self.tenants)}")
        tenant = self.tenants[key]
        if not tenant.history:
            raise LookupError(f"tenant {key!r} has no earlier state to roll back to (kept: {self.history})")
        self.bank.deactivate()
        self.bank.put(key, tenant.history.pop())
        self._bump(tenant)
        return len(tenant.history)

    # ------------------------------------------------------------------------------------------ publish / save
    def state(self, key: str) -> AdapterState:
        """An exact copy of tenant ``key``'s :data:`~hf_tta.state.ALL` state."""
        return self.bank.state(key)

    def snapshot(self, keys: list[str] | None = None) -> Snapshot:
        """Every tenant's published parts, versions and counts (what the channel carries)."""
        out = {}
        for key in keys or list(self.tenants):
            t = self.tenants[key]
            counts = dict(self.bank.slot(key).safety.counts)
            out[key] = TenantState(t.version, t.published, self.state(key), counts)
        return Snapshot(out, {**self.counters, "version": self.version, "tenants": len(self.tenants)})

    def save(self, path: str | os.PathLike) -> None:
        """The checkpoint (atomic: written beside ``path`` and renamed)."""
        from safetensors.torch import save_file

        tensors: dict[str, torch.Tensor] = {}
        meta: dict[str, Any] = {"keys": [], "tenants": [], "version": self.version,
                                "config": self.wrapper.resolved_config().to_dict(), "names": self._names()}
        for i, (key, t) in enumerate(self.tenants.items()):
            part, part_meta = self.state(key).to_tensors(f"tenant.{i}.", optimizer_keys="name")
            tensors.update(part)
            s_tensors, safety_meta = self.bank.slot(key).safety.state_tensors(f"tenant.{i}.safety.")
            tensors.update(s_tensors)
            meta["keys"].append(key)
            meta["tenants"].append({"version": t.version, "published": t.published, "optim": part_meta, "safety": safety_meta})
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp")
        save_file({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, str(tmp), metadata={"hf_tta_tenants": json.dumps(meta)})
        os.replace(tmp, path)

    def load(self, path: str | os.PathLike) -> None:
        """Restore a :meth:`save` file (checked first: nothing changes on a refusal)."""
        from safetensors import safe_open
        from safetensors.torch import load_file

        with safe_open(str(path), framework="pt") as fh:
            meta = json.loads(fh.metadata()["hf_tta_tenants"])
        config = self.wrapper.resolved_config().to_dict()
        saved = TTAConfig.from_dict(meta["config"]).to_dict()  # a field added since the file was written: its default
        if saved != config:
            diff = sorted(k for k in set(config) | set(saved) if config.get(k) != saved.get(k))
            raise ValueError(f"{path} was saved with another TTAConfig (differs in {diff[:4]}): start with that config or another --state-dir")
        if meta["names"] != self._names():
            raise ValueError(f"{path} adapts other parameters than this model: another model or --state-dir")
        if len(meta["keys"]) > self.max_tenants:
            raise ValueError(f"{path} holds {len(meta['keys'])} tenants, more than --max-tenants {self.max_tenants}")
        tensors = load_file(str(path), device=str(self.wrapper.device))
        names, loaded, bank = self._names(), {}, SlotBank(self.wrapper, source=self.source)
        for i, (key, info) in enumerate(zip(meta["keys"], meta["tenants"])):
            state = AdapterState.from_tensors(tensors, info["optim"], ALL, names, f"tenant.{i}.", optimizer_keys="name")
            bank.add(key)
            if info["safety"] is not None:
                bank.slot(key).safety.load_state_tensors(tensors, info["safety"], names, True, prefix=f"tenant.{i}.safety.")
            bank.put(key, state)
            loaded[key] = Tenant(int(info["version"]), float(info["published"]), collections.deque(maxlen=self.history))
        self.tenants, self.bank, self.version = loaded, bank, int(meta["version"])
        self.source.apply(self.wrapper)

    def _names(self) -> list[str]:
        return [n for n, _ in self.wrapper.named_optimized_parameters()]


__all__ = ["DEFAULT_TENANT", "Tenant", "TenantAdapters", "TenantLimit"]
