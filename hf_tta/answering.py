"""Answering without adapting: :meth:`AnswerMixin.answer` gives what :meth:`~hf_tta.TTAWrapper.adapt_step` with
``TTAConfig(scoring="before_update")`` answers for a batch, without the adaptation and without changing the wrapper.

It runs the before-update path of ``adapt_step`` itself (the same view of the batch, the same score transform and
top-k: :class:`~hf_tta.forward.BatchForward`'s ``view``, ``training_free`` and ``scored``) on a *reading* forward
(:meth:`~hf_tta.forward.BatchForward.reading`): the wrapper's model, with the wrapper's :data:`~hf_tta.state.ANSWER`
state read from a captured :meth:`~hf_tta.state.AdapterState.view` (the objective's and score transform's state, whose
entries are replaced and never written in place, so the view shares their tensors; the RNG, which DN's seeded gallery
sample draws from) and its own record of the gallery versions those states follow. So an answer is a read:
concurrent answers may share a wrapper that nothing adapts meanwhile, and the wrapper's next ``adapt_step`` advances
DN's query mean exactly as it would have without the answers. :func:`answer_with` answers a checked batch on any
forward (a routed wrapper's per domain).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Mapping

import torch

from . import batch as batching
from .gallery.base import GalleryBackend
from .gallery.cache import GalleryCache
from .objectives.base import Objective
from .outputs import TTAOutput
from .state import ANSWER, AdapterState

if TYPE_CHECKING:  # pragma: no cover
    from .forward import BatchForward


class AnswerMixin:
    """:meth:`answer` for :class:`~hf_tta.TTAWrapper` (see :mod:`hf_tta.answering`; it reads the wrapper's ``forward``
    and state only)."""

    forward: BatchForward

    @torch.no_grad()
    def answer(self, queries: Mapping[str, torch.Tensor], gallery: GalleryCache | GalleryBackend | torch.Tensor) -> TTAOutput:
        """What :meth:`adapt_step` with ``TTAConfig(scoring="before_update")`` answers for this batch, without adapting
        and without changing the wrapper: the current model's scores through the score transform (DN), its state and
        the RNG read from a captured view. ``TTAOutput.scores`` ``(B, N)`` for a dense gallery; with a top-k backend
        ``topk`` (each query's backend-``k`` best items by gallery position, searched at one version) and ``scores``
        ``None``. Unlike ``adapt_step`` the safety layer does not judge the batch: a degenerate batch gets the current
        model's answer, not the source model's. A shift gate (``TTAConfig.shift_gate``) does: a batch it keeps closed
        gets the source model's answer, as in ``adapt_step``."""
        batch = self.forward.answer_batch(queries, gallery)  # memoises the wrapped tensor gallery and encoder id
        reading = self.forward.reading(AdapterState.view(self, ANSWER))
        gate = getattr(self, "shift_gate", None)  # TTAConfig.shift_gate: a batch it keeps closed gets the source's answer
        source = gate is not None and not gate.opens(self, batch.queries)[0]
        with batching.pinned(gallery, reading.gallery_versions, answer_states(reading), warn=False):
            return answer_with(reading, batch, source=source)


def answer_states(forward: BatchForward) -> list[tuple[Objective | None, dict]]:
    """The states an answer reads, to bring up to a changed gallery as ``adapt_step`` does: the score transform's,
    and the objective's when it scores (training-free) or adds candidates (``search_vectors``)."""
    obj, stream = forward.objective, forward.stream
    reads = not obj.requires_grad or type(obj).search_vectors is not Objective.search_vectors
    return [(forward.score_transform, stream.transform_state)] + ([(obj, stream.state)] if reads else [])


def answer_with(forward: BatchForward, batch: batching.Batch, step: int | None = None, source: bool = False) -> TTAOutput:
    """``batch`` answered as ``adapt_step`` with ``scoring="before_update"`` answers it (the view of the last step,
    or of ``step``; a training-free objective's scores; with ``source`` the source model's view, as a closed shift
    gate answers), advancing ``forward``'s stream: call it on a reading."""
    if forward.objective.requires_grad:
        inputs = forward.view(batch, forward.config.steps - 1 if step is None else step, source=source)
        return forward.scored(batch, inputs, inputs.scores)
    inputs, _, scores = forward.training_free(batch, None)
    return forward.scored(batch, inputs, scores)
