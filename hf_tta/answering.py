"""Answering without adapting: :meth:`AnswerMixin.answer` gives what :meth:`~hf_tta.TTAWrapper.adapt_step` with
``TTAConfig(scoring="before_update")`` answers for a batch, without the adaptation and without changing the wrapper.

It runs the before-update path of ``adapt_step`` itself (the same view of the batch, the same score transform and
top-k: the wrapper's ``_view``, ``_score_only`` and ``_scored``) on a *reader*: a shallow copy of the wrapper that shares
the model and has the wrapper's :data:`~hf_tta.state.ANSWER` state applied from a captured
:meth:`~hf_tta.state.AdapterState.view` (the objective's and score transform's state, whose entries are replaced and
never written in place, so the view shares their tensors; the RNG, which DN's seeded gallery sample draws from), and
its own record of the gallery versions those states follow. So an answer is a read: concurrent answers may share a wrapper that
nothing adapts meanwhile (:mod:`hf_tta.serving` answers from frozen copies), and the wrapper's next ``adapt_step``
advances DN's query mean exactly as it would have without the answers.
"""

from __future__ import annotations

import copy
from typing import Any, Mapping

import torch

from . import batch as batching
from .gallery.base import GalleryBackend
from .gallery.cache import GalleryCache
from .objectives.base import Objective
from .outputs import TTAOutput
from .state import ANSWER, AdapterState


class AnswerMixin:
    """:meth:`answer` for :class:`~hf_tta.TTAWrapper` (see :mod:`hf_tta.answering`; this module does not import the
    wrapper, whose ``_view``, ``_score_only``, ``_scored`` and checks it calls)."""

    @torch.no_grad()
    def answer(self, queries: Mapping[str, torch.Tensor], gallery: GalleryCache | GalleryBackend | torch.Tensor) -> TTAOutput:
        """What :meth:`adapt_step` with ``TTAConfig(scoring="before_update")`` answers for this batch, without adapting
        and without changing the wrapper: the current model's scores through the score transform (DN), its state and
        the RNG read from copies. ``TTAOutput.scores`` ``(B, N)`` for a dense gallery; with a top-k backend ``topk``
        (each query's backend-``k`` best items by gallery position, searched at one version) and ``scores`` ``None``.
        Unlike ``adapt_step`` the safety layer does not judge the batch: a degenerate batch gets the current model's
        answer, not the source model's."""
        batch = self._answer_batch(queries, gallery)  # on self: memoises the wrapped tensor gallery and encoder id
        reader = self._reader()
        with batching.pinned(gallery, reader._gallery_versions, reader._answer_states(), warn=False):
            return reader._answer(batch)

    def _answer_batch(self, queries: Mapping[str, torch.Tensor], gallery: Any) -> batching.Batch:
        gallery = self._check_gallery(gallery)
        queries = self._check_inputs(queries, self.query_modality)
        return batching.Batch(queries, gallery, None, batching.batch_size(queries))

    def _reader(self) -> AnswerMixin:
        """A shallow copy sharing the model, with a view of the :data:`~hf_tta.state.ANSWER` state applied (its own
        RNG) and its own record of the gallery versions followed."""
        reader = copy.copy(self)
        reader.generator = torch.Generator(self.generator.device)
        AdapterState.view(self, ANSWER).apply(reader)
        reader._gallery_versions = dict(self._gallery_versions)
        return reader

    def _answer_states(self) -> list[tuple[Objective | None, dict]]:
        """The states an answer reads, to bring up to a changed gallery as ``adapt_step`` does: the score transform's,
        and the objective's when it scores (training-free) or adds candidates (``search_vectors``)."""
        obj = self.objective
        reads = not obj.requires_grad or type(obj).search_vectors is not Objective.search_vectors
        return [(self.score_transform, self.transform_state)] + ([(obj, self.state)] if reads else [])

    def _answer(self, batch: batching.Batch, step: int | None = None) -> TTAOutput:
        """``batch`` answered as ``adapt_step`` with ``scoring="before_update"`` answers it (the view of the last step,
        or of ``step``; a training-free objective's scores), advancing this wrapper's states: call it on a reader."""
        if self.objective.requires_grad:
            inputs = self._view(batch, self.config.steps - 1 if step is None else step)
            return self._scored(batch, inputs, inputs.scores)
        inputs, result = self._score_only(batch, None)
        return self._scored(batch, inputs, result.scores)
