"""What the adapting process publishes, as bytes: every tenant's answer-side state and the counters that describe it.

A published state is, per tenant, the :data:`PUBLISHED` parts of its :class:`~hf_tta.state.AdapterState` (the adapted
parameters with the optimiser's extra tensors, the objective's and score transform's state, the RNG and the batch
counter: what :meth:`~hf_tta.TTAWrapper.answer` reads; not the optimiser's moments, which only adaptation reads),
written with :meth:`AdapterState.to_tensors` under ``tenant.<i>.`` into one safetensors blob (no pickle), and a JSON
header: the tenants' keys, versions and publish times, safety counts and the worker's counters.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

import torch

from ..state import SERVED, AdapterState

PUBLISHED = SERVED  # (hf_tta.readers: what a reader answers with)


@dataclass
class TenantState:
    """One tenant's published state: its ``version`` (+1 per adapted batch of this tenant, kept across restarts),
    ``published`` (wall time of that version) and the answer-side ``state``."""

    version: int
    published: float
    state: AdapterState
    safety_counts: dict[str, int] = field(default_factory=dict)


@dataclass
class Snapshot:
    """Every tenant's :class:`TenantState` and the worker's ``counters`` (batches adapted, queries, actions)."""

    tenants: dict[str, TenantState]
    counters: dict[str, Any] = field(default_factory=dict)


def encode(snapshot: Snapshot) -> bytes:
    """The snapshot as one safetensors blob (tensors contiguous, on the CPU)."""
    from safetensors.torch import save

    tensors: dict[str, torch.Tensor] = {}
    keys = list(snapshot.tenants)
    for i, key in enumerate(keys):
        state = dataclasses.replace(snapshot.tenants[key].state.only(PUBLISHED), optimizer=None)
        part, _ = state.to_tensors(f"tenant.{i}.", optimizer_keys="name")
        tensors.update({k: v.detach().cpu().contiguous() for k, v in part.items()})
    header = {
        "keys": keys,
        "tenants": [{"version": t.version, "published": t.published, "safety_counts": t.safety_counts} for t in snapshot.tenants.values()],
        "names": {key: list(t.state.params) for key, t in snapshot.tenants.items()},
        "counters": snapshot.counters,
    }
    return save(tensors, metadata={"hf_tta_service": json.dumps(header)})


def decode(data: bytes) -> Snapshot:
    """Read what :func:`encode` wrote."""
    from safetensors.torch import load

    tensors = load(data)
    header = _header(data)
    tenants = {}
    for i, (key, info) in enumerate(zip(header["keys"], header["tenants"])):
        state = AdapterState.from_tensors(tensors, {}, PUBLISHED, header["names"][key], f"tenant.{i}.", optimizer_keys="name")
        tenants[key] = TenantState(int(info["version"]), float(info["published"]), state, dict(info["safety_counts"]))
    return Snapshot(tenants, dict(header["counters"]))


def _header(data: bytes) -> dict[str, Any]:
    """The JSON header (safetensors' format: an 8-byte length, then the JSON that holds ``__metadata__``)."""
    import struct

    n = struct.unpack_from("<Q", data, 0)[0]
    meta = json.loads(data[8 : 8 + n].decode("utf-8")).get("__metadata__", {})
    return json.loads(meta["hf_tta_service"])


__all__ = ["PUBLISHED", "Snapshot", "TenantState", "decode", "encode"]
