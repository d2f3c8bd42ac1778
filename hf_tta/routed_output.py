"""The output of a routed batch: each domain's :class:`~hf_tta.TTAOutput` of its rows, put back in the batch's order
(:class:`RoutedTTAOutput`, :func:`assemble`; :mod:`hf_tta.routing` runs the domains)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .gallery.base import TopKScores
from .outputs import TTAOutput
from .router import DomainKey
from .safety import SAFETY_ACTIONS


@dataclass
class RoutedTTAOutput(TTAOutput):
    """:class:`~hf_tta.TTAOutput` of a routed batch, in the original query order.

    ``num_updates`` and ``n_selected`` are summed over the domains, ``loss`` is the query-weighted mean of the domains'
    losses, ``skipped``, ``logs`` and ``safety_logs`` carry each domain's entries prefixed by its key
    (``"auto:0/loss_na"``). With the safety layer, ``safety_action`` is the most severe action of the batch's domains
    (``"reset"`` > ``"rollback"`` > ``"skip_degenerate"``; ``None`` when no sub-batch was flagged) and
    ``safety_actions`` holds each domain's.

    Args:
        domains (`torch.Tensor` of shape `(B,)`): each query's domain id (an index into ``domain_keys``).
        domain_keys (`list`): the wrapper's domain keys after this batch (user keys, or ``"auto:<k>"`` for the
            domains the router opened).
        new_domains (`list`): the keys of the domains this batch opened.
        safety_actions (`dict`): with the safety layer, each of the batch's domains' action (key -> action or ``None``).
    """

    domains: torch.Tensor | None = None
    domain_keys: list[DomainKey] = field(default_factory=list)
    new_domains: list[DomainKey] = field(default_factory=list)
    safety_actions: dict[DomainKey, str | None] = field(default_factory=dict)


def assemble(
    outputs: list[tuple[DomainKey, torch.Tensor, TTAOutput]], slots: torch.Tensor, n: int, domain_keys: list[DomainKey],
    new_keys: list[DomainKey], with_safety: bool,
) -> RoutedTTAOutput:
    """One :class:`RoutedTTAOutput` of ``n`` rows from each domain's ``(key, its rows' indices, its output)``."""
    scores = topk = None
    first = outputs[0][2]
    if first.scores is not None:
        scores = first.scores.new_empty(n, first.scores.shape[1])
        for _, idx, out in outputs:
            scores.index_copy_(0, idx.to(scores.device), out.scores)
    else:
        k = min(out.topk.k for _, _, out in outputs)  # equal unless the gallery is smaller than the backend's k
        values = first.topk.values.new_empty(n, k)
        indices = first.topk.indices.new_empty(n, k)
        for _, idx, out in outputs:
            values.index_copy_(0, idx.to(values.device), out.topk.values[:, :k])
            indices.index_copy_(0, idx.to(indices.device), out.topk.indices[:, :k])
        topk = TopKScores(values, indices)
    with_loss = [(idx.numel(), out.loss) for _, idx, out in outputs if out.loss is not None]
    loss = sum(m * v for m, v in with_loss) / sum(m for m, _ in with_loss) if with_loss else None
    actions = {key: out.safety_action for key, _, out in outputs} if with_safety else {}
    flagged = [a for a in reversed(SAFETY_ACTIONS) if a in actions.values()]  # the most severe first
    return RoutedTTAOutput(
        scores=scores,
        loss=loss,
        num_updates=sum(out.num_updates for _, _, out in outputs),
        n_selected=sum(int(out.n_selected) for _, _, out in outputs),
        skipped=[f"{key}: {s}" for key, _, out in outputs for s in out.skipped],
        logs={f"{key}/{name}": v for key, _, out in outputs for name, v in out.logs.items()},
        topk=topk,
        safety_action=flagged[0] if flagged else None,
        safety_logs={f"{key}/{name}": v for key, _, out in outputs for name, v in out.safety_logs.items()},
        safety_actions=actions,
        domains=slots,
        domain_keys=domain_keys,
        new_domains=new_keys,
    )
