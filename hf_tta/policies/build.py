"""The wrapper's batch policies from its config (issue 46): the update budget first (it decides before anything
runs on the batch), then the lr search (its probe answers a probe batch; after it, its step rule and back-off)."""

from __future__ import annotations

from typing import Any

from ..lr_search import LRSearch
from ..update_budget import UpdateBudget
from .base import BatchPolicy


def build_policies(wrapper: Any) -> list[BatchPolicy]:
    """``TTAConfig.update_budget`` and ``TTAConfig.lr_search`` as policies, in the order they act; empty when off."""
    cfg, policies = wrapper.config, []
    if cfg.update_budget is not None:
        policies.append(UpdateBudget(cfg.build_update_budget_config()))
    if cfg.lr_search is not None:
        policies.append(LRSearch(cfg.lr_search, wrapper))
    return policies
