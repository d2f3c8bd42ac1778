"""Source-anchored answers: the adapted model answers only while it is surer of the gallery than the source model.

``TTAConfig(source_anchor={"margin": 0.01})`` (issue 48's mechanism (b), a label-free choice between the source's and
the adapted model's answer). Adaptation goes on as without it; what changes is who answers. On a batch whose steps ran,
both the adapted model's answer (the view the wrapper reports, before the update with ``scoring="before_update"``) and
the source model's (one no-grad forward, shared with the safety layer's) score the batch's :math:`B` queries against
the gallery. The batch's evidence is the difference of their mean top-1 softmax probabilities at temperature :math:`T`,

.. math::  d_t = \\frac{1}{B}\\sum_{i} \\max_j \\operatorname{softmax}(s^{A}_{i\\cdot}/T)_j
             - \\frac{1}{B}\\sum_{i} \\max_j \\operatorname{softmax}(s^{S}_{i\\cdot}/T)_j ,

and its moving average over the stream :math:`e_t = m\\,e_{t-1} + (1 - m)\\,d_t` (:math:`e_0 = 0`: the source).
The adapted model answers batch :math:`t` when :math:`e_t > \\text{margin}`; otherwise the source's scores answer it,
or with ``ensemble_weight`` :math:`w > 0` the two models' scores mixed, :math:`(1 - w)\\,s^{S} + w\\,s^{A}` (an output
ensemble with the source: where the two disagree, the one with the larger score gap wins the query; default-study-r7
chose :math:`w = 0.3` on the selection split). With ``source_confidence`` :math:`\\tau`, a query :math:`i` whose
source top-1 probability :math:`p^S_i = \\max_j \\operatorname{softmax}(s^S_{i\\cdot}/T)_j \\ge \\tau` keeps the
source's scores in that mix (the queries the source is sure of are mostly the ones it has right, and the mix flips
some of them: default-study-r8). With ``mix_agreement`` :math:`[a_{lo}, a_{hi}]` the mix answers a batch only while
the share of its queries on whose top-1 item the two models agree, :math:`a = \\frac{1}{B}\\sum_i [\\arg\\max_j
s^S_{ij} = \\arg\\max_j s^A_{ij}]`, is within the band; otherwise the source answers alone: below it the adapted
model has drifted away from the source on most queries (a style the source hardly knows), above it it changes too
few answers for the change to be more than noise (default-study-r9). The mix needs both models' scores over the same items: no score
transform (refused), and a dense gallery (with a top-k backend each model has its own candidates: the source alone
answers while the anchor holds, logged once).
Two settings act on the batches the adapted model answers alone (:math:`e_t > \\text{margin}`; default-study-r11).
With ``adapted_agreement`` :math:`a_{max}` such a batch is answered by the source's scores when :math:`a > a_{max}`
(the two models share the top-1 item of nearly every query, so the few answers adaptation changes are more likely
noise than gain: on a mild corruption the source is already right on ~97 % of them). With
``source_confidence_scope="all"`` the queries the source is sure of (:math:`p^S_i \\ge \\tau`) keep the source's
scores there too, not only in the mix. With a top-k backend the agreement compares global item indices, and the
sure queries' rows cannot be swapped (each model scores its own candidates): the adapted answer stands, logged once.
Neither is in the default: on the selection split ``adapted_agreement`` 0.9 never acts and 0.8 gives back share
without saving a right answer, and ``"all"`` keeps the source's confidently wrong answers on severe corruptions
(default-study-r11 and -r12, the results card).
The idea: an adaptation that helps makes the model surer of the gallery than the source is on the same queries
(TCR on a blurred stream); one that only drifts does not (a style the source hardly knows, on which its
pseudo-labels are mostly wrong), and then the source's answers are kept. It is a design of this library, not of a
paper: the design probes and the registered studies that chose its settings are in ``model_cards/`` (protocol v4,
default-study-r6 and -r7).

The evidence :math:`e_t` is adapted state (``AdapterState``'s selector part, key ``source_anchor.evidence``): saved
with the checkpoint, restored by a safety rollback, and back at :math:`e_0 = 0` after :meth:`~hf_tta.TTAWrapper.reset`.
A batch answered without the steps (a closed shift gate, an update budget's skip) or answered by the source already
(the safety layer's degenerate skip; with ``scoring="after_update"`` also its rollback or reset) is not judged and
leaves :math:`e` as it was. With a top-k gallery backend the
softmax runs over each view's candidates.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import torch

from .config_anchor import SourceAnchorConfig
from .policies.base import Answer, BatchPolicy
from .window import top1

logger = logging.getLogger(__name__)

#: the evidence's key in ``TTAWrapper.selector_state`` (:data:`hf_tta.state.SELECTOR`)
EVIDENCE = "source_anchor.evidence"


def top1_probability(scores: torch.Tensor, temperature: float) -> torch.Tensor:
    """:math:`p_i = \\max_j \\operatorname{softmax}(s_{i\\cdot}/T)_j` of ``(B, N)`` scores, ``(B,)`` in float64."""
    return (scores.detach().double() / temperature).softmax(dim=-1).amax(dim=-1)


def top1_agreement(first: torch.Tensor, second: torch.Tensor, first_ids: torch.Tensor | None = None,
                   second_ids: torch.Tensor | None = None) -> float:
    """:math:`a = \\frac{1}{B}\\sum_i [\\arg\\max_j s^{S}_{ij} = \\arg\\max_j s^{A}_{ij}]`: the share of the batch's
    queries whose top-1 item two ``(B, N)`` score matrices share; with a top-k backend's candidate ids, compared as
    gallery items (:func:`hf_tta.window.top1`)."""
    mine, theirs = top1(first.detach(), first_ids)[1], top1(second.detach(), second_ids)[1]
    return float((mine == theirs.to(mine.device)).double().mean())


def mean_top1_probability(scores: torch.Tensor, temperature: float) -> float:
    """:math:`\\frac{1}{B}\\sum_i \\max_j \\operatorname{softmax}(s_{i\\cdot}/T)_j` of ``(B, N)`` scores, in float64."""
    return float(top1_probability(scores, temperature).mean())


def evidence_step(previous: float, d: float, momentum: float) -> float:
    """:math:`e_t = m\\,e_{t-1} + (1 - m)\\,d_t`."""
    return momentum * previous + (1.0 - momentum) * d


class SourceAnchor(BatchPolicy):
    """``TTAConfig.source_anchor`` as a batch policy (:mod:`hf_tta.policies`): its :meth:`finish` keeps the adapted
    answer while the evidence exceeds the margin and gives the source's otherwise (see :mod:`hf_tta.source_anchor`)."""

    name = "source_anchor"

    def __init__(self, config: SourceAnchorConfig):
        self.config = config
        self._told = False  # the top-k backend's fallback is logged once
        self._told_sure = False  # and source_confidence's

    @staticmethod
    def evidence(wrapper: Any) -> float:
        """The wrapper's current :math:`e` (0 before the first judged batch)."""
        e = wrapper.selector_state.get(EVIDENCE)
        return 0.0 if e is None else float(e)

    def finish(self, ctx: Any, answer: Answer) -> Answer:
        if ctx.result is None:  # answered without the steps: nothing adapted spoke
            return answer
        source = ctx.source_view()
        if answer.inputs is source:  # the safety layer already answered with the source
            return answer
        c = self.config
        d = mean_top1_probability(answer.scores, c.temperature) - mean_top1_probability(source.scores, c.temperature)
        e = evidence_step(self.evidence(ctx.wrapper), d, c.momentum)
        ctx.wrapper.selector_state[EVIDENCE] = torch.tensor(e, dtype=torch.float64)
        logs = {**answer.logs, "source_anchor.evidence": e}
        adapted = e > c.margin
        if adapted and c.adapted_agreement is not None:  # the models hardly differ: the change is noise, not a gain
            a = top1_agreement(source.scores, answer.scores, source.candidate_ids, answer.inputs.candidate_ids)
            logs["source_anchor.agreement"] = a
            adapted = a <= c.adapted_agreement
            if not adapted:
                logs["source_anchor.adapted_answers"] = 0.0
                return dataclasses.replace(answer, inputs=source, scores=source.scores, logs=logs)
        logs["source_anchor.adapted_answers"] = float(adapted)
        if adapted:
            if c.source_confidence is not None and c.source_confidence_scope == "all":
                return self._keep_sure(source, answer, answer.scores.detach(), logs)
            return dataclasses.replace(answer, logs=logs)
        w = c.ensemble_weight
        if w > 0 and c.mix_agreement is not None and source.candidate_ids is None:
            a = top1_agreement(source.scores, answer.scores)
            logs["source_anchor.agreement"] = a
            if not c.mix_agreement[0] <= a <= c.mix_agreement[1]:  # the models drift apart, or hardly differ
                w = 0.0
        if w > 0 and source.candidate_ids is not None:  # a top-k backend: each view holds its own candidates
            if not self._told:
                logger.warning("source_anchor: with a top-k gallery backend each model scores its own candidates, so "
                               "ensemble_weight %s cannot mix them: the source alone answers while the anchor holds "
                               "(pass the dense gallery for the mix)", w)
                self._told = True
            w = 0.0
        logger.debug("source_anchor: evidence %.4g <= margin %s: the source answers (adapted weight %s)", e, c.margin, w)
        if w == 0:
            return dataclasses.replace(answer, inputs=source, scores=source.scores, logs=logs)  # the batch's record kept
        mixed = torch.lerp(source.scores.detach(), answer.scores.detach().to(source.scores.dtype), w)
        if c.source_confidence is not None:  # the queries the source is sure of keep its scores
            return self._keep_sure(source, answer, mixed, logs)
        return dataclasses.replace(answer, scores=mixed, logs=logs)

    def _keep_sure(self, source: Any, answer: Answer, scores: torch.Tensor, logs: dict) -> Answer:
        """``scores`` with the rows of the queries the source is sure of (:math:`p^S_i \\ge \\tau`) replaced by the
        source's; with a top-k backend (each model's own candidates: rows cannot be swapped) ``scores`` as they are,
        logged once."""
        if source.candidate_ids is not None:
            if not self._told_sure:
                logger.warning("source_anchor: with a top-k gallery backend each model scores its own candidates, so "
                               "source_confidence cannot keep the source's rows: the adapted answer stands (pass the "
                               "dense gallery for it)")
                self._told_sure = True
            return dataclasses.replace(answer, logs=logs)
        sure = top1_probability(source.scores, self.config.temperature) >= self.config.source_confidence
        logs["source_anchor.kept_source"] = float(sure.double().mean())
        kept = torch.where(sure[:, None], source.scores.detach(), scores.to(source.scores.dtype))
        return dataclasses.replace(answer, scores=kept, logs=logs)
