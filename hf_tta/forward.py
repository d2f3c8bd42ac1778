"""The forward of a batch: check it, embed the queries with the current model, score them, and give the views that the
objective, the safety layer and an answer read.

:class:`BatchForward` is the one place that turns a batch into :class:`~hf_tta.objectives.ObjectiveInputs`: the steps'
inputs with grad (:meth:`BatchForward.inputs`), a detached view of the current or the source model
(:meth:`BatchForward.view`), a training-free objective's scores (:meth:`BatchForward.training_free`) and the answer
through the score transform (:meth:`BatchForward.scored`). :class:`~hf_tta.TTAWrapper` orders them in ``adapt_step``;
:mod:`hf_tta.answering` answers from a :meth:`BatchForward.reading`, a forward that reads a captured
:data:`~hf_tta.state.ANSWER` view instead of the wrapper's own state, so an answer changes nothing;
:class:`~hf_tta.routing.RoutedTTAWrapper` runs it per domain; ``DistributedTTAWrapper`` sets :attr:`BatchForward.embed`
to embed its shard and all-gather the embeddings.

What the stream changes (the objective's and score transform's state, the RNG, the batch counter) is read from
:attr:`BatchForward.stream` at every call (the wrapper, whose state entries are replaced as it adapts); what does not
(the adapter, the config, the objectives, the adapted parameters) is the forward's own.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Protocol

import torch
from torch import nn

from . import batch as batching
from . import window
from .gallery.base import GalleryBackend
from .gallery.cache import GalleryCache
from .gallery.candidates import candidate_items, candidate_topk
from .models.base import ModelAdapter
from .objectives.base import LossOutput, Objective, ObjectiveInputs
from .outputs import PassCounts, TTAOutput
from .state import TRANSFORM, AdapterState

_AUTOCAST = {"bf16": torch.bfloat16, "fp16": torch.float16}  # TTAConfig.autocast_dtype -> the autocast dtype


class Stream(Protocol):
    """What a forward reads of the stream (a :class:`~hf_tta.TTAWrapper`, or a :class:`Reading`)."""

    state: dict[str, torch.Tensor]
    transform_state: dict[str, torch.Tensor]
    generator: torch.Generator
    batch_index: int


@dataclass
class Reading:
    """The stream as an answer reads it: a captured :data:`~hf_tta.state.ANSWER` view applied to its own dicts and
    RNG (see :meth:`BatchForward.reading`)."""

    generator: torch.Generator
    state: dict[str, torch.Tensor] = field(default_factory=dict)
    transform_state: dict[str, torch.Tensor] = field(default_factory=dict)
    batch_index: int = 0


class BatchForward:
    """Checks, embeds, scores and views the batches of one wrapper (see :mod:`hf_tta.forward`).

    Args:
        adapter: the model's :class:`~hf_tta.models.ModelAdapter`.
        config: the wrapper's :class:`~hf_tta.TTAConfig` (steps, seed, window, autocast).
        objective, score_transform: the wrapper's objective and score transform (``None``).
        query_modality, gallery_modality: the two towers.
        stream: what the stream changes (the wrapper).
        disabled: a context in which the model computes as the source model.
        params: the adapted parameters by name (empty for a training-free objective).
        passes: the meter of queries embedded (:class:`~hf_tta.outputs.PassCounts`; its ``forward`` counts here).
    """

    def __init__(
        self, adapter: ModelAdapter, config: Any, objective: Objective, score_transform: Objective | None,
        query_modality: str, gallery_modality: str, stream: Stream, disabled: Callable[[], contextlib.AbstractContextManager],
        params: dict[str, nn.Parameter], passes: PassCounts | None = None,
    ):
        self.adapter, self.config, self.objective, self.score_transform = adapter, config, objective, score_transform
        self.query_modality, self.gallery_modality = query_modality, gallery_modality
        self.stream, self.disabled, self.params = stream, disabled, params
        self.passes = passes if passes is not None else PassCounts()  # shared by every reading() copy
        self.source_params: dict[str, torch.Tensor] | None = None  # set with every source capture (the anchor's too)
        #: the version of each live gallery backend the objective and transform state follow (:func:`hf_tta.batch.pinned`)
        self.gallery_versions: dict[int, int] = {}
        #: the query embedding with grad; ``DistributedTTAWrapper`` sets it to embed its shard and all-gather them
        self.embed: Callable[[dict], torch.Tensor] = self.encode
        self._tensor_gallery: tuple | None = None  # (tensor, its version, its GalleryCache): a raw gallery, wrapped once
        self._encoder_id: str | None = None  # which model encoded this wrapper's galleries

    @property
    def device(self) -> torch.device:
        return next(self.adapter.model.parameters()).device

    def reading(self, view: AdapterState) -> BatchForward:
        """A forward that reads ``view`` (an :data:`~hf_tta.state.ANSWER` capture or view) instead of the stream, with
        its own record of the gallery versions: whatever it computes, the stream is unchanged."""
        out = copy.copy(self)
        out.stream = Reading(torch.Generator(self.stream.generator.device))
        view.apply(out.stream)
        out.gallery_versions = dict(self.gallery_versions)
        return out

    # ------------------------------------------------------------------------------------------ checks
    def check_inputs(self, inputs: Mapping[str, Any], modality: str) -> dict[str, torch.Tensor]:
        return batching.check_inputs(self.adapter, modality, inputs, self.device)

    def check_gallery(self, gallery: GalleryCache | GalleryBackend | torch.Tensor) -> GalleryCache | GalleryBackend:
        """A dense gallery, or a top-k backend (:func:`hf_tta.batch.check_gallery`); a raw tensor is wrapped once."""
        if isinstance(gallery, torch.Tensor):
            gallery, self._tensor_gallery = batching.wrap_tensor(gallery, self._tensor_gallery, self.gallery_modality,
                                                                 next(self.adapter.model.parameters()).dtype)
        roles = {"objective": self.objective, "score_transform": self.score_transform}
        encoder = self.gallery_encoder() if isinstance(gallery, GalleryCache) and gallery.encoder is not None else None
        return batching.check_gallery(gallery, self.gallery_modality, self.query_modality, self.device, roles, encoder)

    def gallery_encoder(self) -> str:
        """Which model and tower encode the gallery (computed once: the gallery tower never adapts)."""
        if self._encoder_id is None:
            self._encoder_id = batching.encoder_id(self.adapter, self.gallery_modality)
        return self._encoder_id

    def answer_batch(self, queries: Mapping[str, torch.Tensor], gallery: Any) -> batching.Batch:
        """A checked batch without labels (what an answer or a no-grad score takes)."""
        gallery = self.check_gallery(gallery)
        queries = self.check_inputs(queries, self.query_modality)
        return batching.Batch(queries, gallery, None, batching.batch_size(queries))

    # ------------------------------------------------------------------------------------------ embed and score
    def autocast(self) -> contextlib.AbstractContextManager:
        if self.config.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=_AUTOCAST[self.config.autocast_dtype])

    def encode(self, queries: dict) -> torch.Tensor:
        """The query embeddings of this process, with grad."""
        with self.autocast():
            return self.adapter.encode(self.query_modality, queries)

    def embedded(self, queries: dict) -> torch.Tensor:
        """:attr:`embed` (with grad where grad is on), counted in :attr:`passes` (one forward per query)."""
        q = self.embed(queries)
        self.passes.forward += int(q.shape[0])
        return q

    def embed_and_score(self, queries: dict, gallery: GalleryCache) -> tuple[torch.Tensor, torch.Tensor]:
        return self.score(self.embedded(queries), gallery)

    def score(self, q: torch.Tensor, gallery: GalleryCache) -> tuple[torch.Tensor, torch.Tensor]:
        """The single-vector query embeddings and the scores ``(B, N)`` against a dense gallery."""
        if q.shape[-1] != gallery.dim:
            raise ValueError(
                f"Query embeddings have dimension {q.shape[-1]} but the gallery has {gallery.dim}: "
                "was the gallery encoded by another model?"
            )
        scores = self.adapter.score(q, gallery.embeddings)
        return self.adapter.single_vector(q, scores, gallery.single), scores

    def candidate_view(self, q: torch.Tensor, gallery: GalleryBackend, step: int) -> tuple[torch.Tensor, GalleryCache]:
        """The batch's candidates (:func:`~hf_tta.gallery.candidates.candidate_items`) as a small dense gallery that
        the queries are scored against exactly (so gradients flow as with the dense gallery); the score transform
        (DN's shifted queries) searches too on the reported step."""
        s = self.stream
        searchers = [(self.objective, s.state)]
        if self.score_transform is not None and (step >= self.config.steps - 1 or not self.objective.requires_grad):
            searchers.append((self.score_transform, s.transform_state))
        ids, emb = candidate_items(q, gallery, self.objective, searchers, self.config.seed)
        return ids, GalleryCache(emb, gallery.modality)

    # ------------------------------------------------------------------------------------------ views
    def inputs(self, batch: batching.Batch, step: int, source_cache: list[torch.Tensor] | None = None) -> ObjectiveInputs:
        """The objective's view of ``batch`` at the current parameters. ``source_cache`` (one list per batch) holds
        the source model's scores once computed, so that they are computed once per batch (dense gallery)."""
        queries, gallery = batch.queries, batch.gallery
        backend = ids = None
        if isinstance(gallery, GalleryBackend):  # objectives see the batch's candidates, re-scored exactly
            q_raw = self.embedded(queries)
            backend = gallery
            ids, gallery = self.candidate_view(q_raw, gallery, step)
            q, scores = self.score(q_raw, gallery)
            source_cache = []  # the candidates change with every step: source scores are per step
        else:
            q, scores = self.embed_and_score(queries, gallery)
        source_cache = [] if source_cache is None else source_cache

        def source_scores() -> torch.Tensor:
            if not source_cache:
                with torch.no_grad(), self.disabled():
                    source_cache.append(self.embed_and_score(queries, gallery)[1])
            return source_cache[0]

        def reencode(transform: Callable[[dict], dict]) -> tuple[torch.Tensor, torch.Tensor]:
            return self.embed_and_score(transform(dict(queries)), gallery)

        s = self.stream
        return ObjectiveInputs(
            query_emb=q, gallery_emb=gallery.single, scores=scores, step=step, batch_index=s.batch_index,
            generator=s.generator, reencode=reencode, source_scores=source_scores, query_modality=self.query_modality,
            queries=queries, params=self.params or None, source_params=self.source_params if self.params else None,
            labels=batch.labels, candidate_ids=ids, backend=backend, window=window.view(s.state, self.config.window),
            gallery_items=gallery.embeddings if gallery.embeddings.dim() == 3 else None,  # multi-vector rows (NNN, QB-Norm)
        )

    @torch.no_grad()
    def view(self, batch: batching.Batch, step: int, source: bool = False) -> ObjectiveInputs:
        """A no-grad view of ``batch`` (the source model's with ``source``), detached."""
        with self.disabled() if source else contextlib.nullcontext():
            inputs = self.inputs(batch, step)
        return dataclasses.replace(inputs, query_emb=inputs.query_emb.detach(), scores=inputs.scores.detach())

    @torch.no_grad()
    def training_free(self, batch: batching.Batch, source: ObjectiveInputs | None) -> tuple[ObjectiveInputs, LossOutput, torch.Tensor]:
        """A training-free objective's ``(inputs, output, scores)``: nothing is adapted, so the source view of a dense
        gallery (``source``) is this forward."""
        shared = source is not None and source.candidate_ids is None
        inputs = dataclasses.replace(source, step=0) if shared else self.inputs(batch, step=0)
        res = self.objective(inputs, self.stream.state)
        return inputs, res, (res.scores if res.scores is not None else inputs.scores).detach()

    # ------------------------------------------------------------------------------------------ the answer
    def scored(self, batch: batching.Batch, inputs: ObjectiveInputs, scores: torch.Tensor, update_state: bool = True) -> TTAOutput:
        """The answer to ``batch``: ``scores`` through the score transform, or with a top-k backend each query's top-k
        of them (``TTAOutput.topk``, ``scores`` ``None``); nothing adapted."""
        scores = self.transform_scores(inputs, scores, update_state)
        if isinstance(batch.gallery, GalleryBackend):
            return TTAOutput(None, None, 0, 0, topk=candidate_topk(scores, inputs.candidate_ids, batch.gallery.k))
        return TTAOutput(scores, None, 0, 0)

    def transform_scores(self, inputs: ObjectiveInputs, scores: torch.Tensor, update_state: bool = True) -> torch.Tensor:
        """Apply ``config.score_transform`` (a training-free objective, e.g. DN) to the output scores; with
        ``update_state=False`` on a view of its state that is thrown away, so the batch leaves no trace (e.g. in DN's
        query mean)."""
        if self.score_transform is None:
            return scores
        state = self.stream.transform_state if update_state else AdapterState.view(self.stream, {TRANSFORM}).transform
        with torch.no_grad():
            view = dataclasses.replace(inputs, query_emb=inputs.query_emb.detach(), scores=scores.detach())
            res = self.score_transform(view, state)
        return (res.scores if res.scores is not None else scores).detach()
