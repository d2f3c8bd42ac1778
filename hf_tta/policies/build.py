"""The wrapper's batch policies from its config (issue 46): the update budget first (it decides before anything
runs on the batch), the shift gate (a closed gate answers with the source), then the lr search (its probe answers a
probe batch; after it, its step rule and back-off), weight ensembling (a pull towards the source after the update)
and the source anchor (last: it chooses who answers)."""

from __future__ import annotations

from typing import Any

from ..lr_search import LRSearch
from ..shift_gate import ShiftGate
from ..source_anchor import SourceAnchor
from ..update_budget import UpdateBudget
from ..weight_ensemble import WeightEnsemble
from .base import BatchPolicy


def build_policies(wrapper: Any) -> list[BatchPolicy]:
    """``TTAConfig.update_budget``, ``shift_gate``, ``lr_search``, ``weight_ensemble`` and ``source_anchor`` as
    policies, in the order they act; empty when none is on."""
    cfg, policies = wrapper.config, []
    if cfg.update_budget is not None:
        policies.append(UpdateBudget(cfg.build_update_budget_config()))
    if cfg.shift_gate is not None:
        policies.append(ShiftGate(cfg.build_shift_gate_config()))
    if cfg.lr_search is not None:
        policies.append(LRSearch(cfg.lr_search, wrapper))
    if cfg.weight_ensemble is not None:
        policies.append(WeightEnsemble(cfg.build_weight_ensemble_config()))
    if cfg.source_anchor is not None:
        policies.append(SourceAnchor(cfg.build_source_anchor_config()))
    return policies
