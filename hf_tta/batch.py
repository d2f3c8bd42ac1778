"""One batch checked at the boundary, before anything runs: the queries, the gallery and the labels of an
:meth:`~hf_tta.TTAWrapper.adapt_step`. A mistake is one line naming the fix; nothing has changed when it is raised."""

from __future__ import annotations

import logging
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator, Mapping, Sequence

import torch

from .gallery.base import GalleryBackend
from .gallery.cache import GalleryCache
from .gallery.candidates import check_gallery_access
from .metrics.recall import relevance_to_index
from .models.base import ModelAdapter
from .objectives.base import Objective, follow_gallery_changes

logger = logging.getLogger(__name__)


@dataclass
class Batch:
    """One checked batch: the queries (selected and cast by the adapter's input specs), the gallery (dense or top-k
    backend), the relevance mask (supervised objectives only) and the batch size."""

    queries: dict[str, torch.Tensor]
    gallery: GalleryCache | GalleryBackend
    labels: torch.Tensor | None
    size: int


def batch_size(inputs: Mapping[str, Any]) -> int:
    """The number of rows of a batch of inputs (its first tensor's)."""
    for value in inputs.values():
        if isinstance(value, torch.Tensor):
            return value.shape[0] if value.dim() else 0
    raise ValueError("Inputs hold no tensor.")


def chunks(inputs: Mapping[str, torch.Tensor], size: int) -> Iterator[dict[str, torch.Tensor]]:
    """Consecutive slices of ``size`` rows of a batch of inputs (e.g. a tokenised gallery, encoded in chunks)."""
    n = batch_size(inputs)
    for start in range(0, n, size):
        yield {k: v[start : start + size] if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}


#: Below this many queries a batch's statistics are too noisy for the objectives that use them (TCR's uniformity and
#: gap, the entropy filters of EATA / SAR / DeYO, DN's query mean); the safety layer judges no batch under its own
#: ``min_queries`` (8 by default).
MIN_BATCH_QUERIES = 8
#: The objectives whose small-batch warning was shown (once per process; clear it to warn again).
warned_small_batches: set[str] = set()


def check_step_context() -> None:
    """``adapt_step`` under ``torch.inference_mode`` cannot adapt: refused in one line."""
    if torch.is_inference_mode_enabled():
        raise RuntimeError(
            "adapt_step was called under torch.inference_mode(), which no enable_grad() can undo: "
            "call it outside inference_mode (torch.no_grad() is fine)."
        )


def check_query_vectors(adapter: ModelAdapter, modality: str, objectives: Sequence[Objective | None]) -> None:
    """Refuse (one line) an objective that keeps single-vector query embeddings to score against the gallery
    (``Objective.multi_vector_queries`` false: NNN's and QB-Norm's reference banks) when ``modality``'s queries are
    multi-vector (BLIP-2 images)."""
    for obj in objectives:
        if obj is not None and not obj.multi_vector_queries and modality in adapter.multi_vector:
            raise ValueError(
                f"{obj.name!r} scores its reference queries as single vectors, but {modality} queries of "
                f"{type(adapter.model).__name__} are multi-vector: use 'dn' there, or {obj.name!r} in the other direction."
            )


def warn_small_batch(n: int, objective: Objective, safety_min: int | None, window: int = 0) -> None:
    """Warn once per objective when a batch (with the ``window`` of recent queries, :mod:`hf_tta.window`) is smaller
    than its batch statistics need, naming what to do instead."""
    floor = safety_min if safety_min is not None else MIN_BATCH_QUERIES
    if n + window >= floor or objective.name in warned_small_batches:
        return
    warned_small_batches.add(objective.name)
    logger.warning(
        "adapt_step got %d queries (%r's batch statistics and the safety layer want at least %d): set "
        "TTAConfig(window=%d) so the batch statistics also cover the recent queries (gradients only through the current "
        "ones), buffer queries into larger batches, or answer single queries with TTAConfig(run=RunConfig(scoring='before_update')) "
        "and adapt on buffered batches (this warning is shown once).", n, objective.name, floor, max(64 - n, floor - n),
    )


def check_inputs(adapter: ModelAdapter, modality: str, inputs: Mapping[str, Any], device: torch.device) -> dict[str, torch.Tensor]:
    """Keys, dtypes, layouts, sizes and vocabulary by the adapter's input specs (floating-point features cast once to
    the model's dtype), then batch size, device and finiteness. Returns a new dict (the caller's is never modified),
    selected once for every embed of the batch."""
    selected = adapter.check_inputs(modality, inputs)
    n = batch_size(selected)
    if n == 0:
        raise ValueError(f"Empty {modality} batch: give at least one item (a query batch, or a gallery chunk).")
    for key, value in selected.items():
        if value.dim() == 0 or value.shape[0] != n:
            raise ValueError(f"{modality} inputs disagree on the batch size: {key!r} has shape {tuple(value.shape)}, expected {n} rows.")
        if value.device != device:
            raise ValueError(
                f"{modality} input {key!r} is on {value.device} but the model is on {device}: move it with .to({str(device)!r})."
            )
        if value.is_floating_point() and not torch.isfinite(value).all():
            raise ValueError(f"{modality} input {key!r} contains NaN or inf values.")
    return selected


def wrap_tensor(tensor: torch.Tensor, held: tuple | None, modality: str, dtype: torch.dtype) -> tuple[GalleryCache, tuple]:
    """A raw gallery tensor as a :class:`~hf_tta.GalleryCache` (cast once to the model's dtype, NaN-checked once);
    ``held`` is the last call's ``(tensor, its version, cache)``: the same unmodified tensor is not wrapped again."""
    if held is not None and held[0] is tensor and held[1] == tensor._version:
        return held[2], held
    cache = GalleryCache(tensor.to(dtype) if tensor.is_floating_point() and tensor.dtype != dtype else tensor, modality)
    return cache, (tensor, tensor._version, cache)


def encoder_id(adapter: ModelAdapter, modality: str) -> str:
    """Which model and tower encode ``modality``: the model's class and config hash, and a digest of the values of the
    parameters only that tower uses (a sum and a sum of squares each: one pass), the same before and after a wrapper adapts
    the query tower."""
    import hashlib

    from .checkpoint import config_hash

    digest = hashlib.sha256(f"{type(adapter.model).__name__}|{config_hash(adapter.model)}|{modality}".encode())
    with torch.no_grad():
        for name, p in adapter.model.named_parameters():
            name = name.replace(".base_layer.", ".")  # a LoRA layer's original weights
            if adapter.tower_of(name.rsplit(".", 1)[0]) == {modality}:
                x = p.detach().double()
                digest.update(f"{name}:{x.sum().item():.12e}:{x.square().sum().item():.12e}".encode())
    return digest.hexdigest()[:16]


def check_gallery(
    gallery: Any, modality: str, query_modality: str, device: torch.device, objectives: Mapping[str, Objective | None],
    encoder: str | None = None,
) -> GalleryCache | GalleryBackend:
    """A dense :class:`~hf_tta.GalleryCache` on the model's device, or a top-k backend whose objectives need only the
    batch's candidates (see :mod:`hf_tta.gallery.base`), holding ``modality`` items."""
    if not isinstance(gallery, (GalleryCache, GalleryBackend)):
        raise TypeError(
            f"gallery must be a GalleryCache (from encode_gallery), a top-k GalleryBackend (hf_tta.gallery) or a tensor, "
            f"got {type(gallery).__name__}."
        )
    if gallery.modality != modality:
        raise ValueError(
            f"The gallery holds {gallery.modality} embeddings but this wrapper retrieves {modality} "
            f"items for {query_modality} queries."
        )
    if isinstance(gallery, GalleryBackend):
        check_gallery_access(gallery, objectives)
        return gallery
    if len(gallery) == 0:
        raise ValueError("The gallery is empty.")
    if gallery.encoder is not None and encoder is not None and gallery.encoder != encoder:
        raise ValueError(
            "This gallery was encoded by another model (or another checkpoint of this architecture): encode it with "
            "this wrapper's encode_gallery(...)."
        )
    if gallery.embeddings.device != device:
        raise ValueError(f"The gallery is on {gallery.embeddings.device} but the model is on {device}: use gallery.to(...).")
    return gallery


def label_mask(labels: Any, objective: Objective, n: int, gallery: GalleryCache | GalleryBackend, device: torch.device) -> torch.Tensor | None:
    """Each query's relevant gallery items as a ``(B, N)`` bool mask, for supervised objectives only."""
    name = objective.name
    if labels is not None and isinstance(gallery, GalleryBackend):
        raise ValueError("labels need the dense GalleryCache: a top-k backend shows objectives only candidate items.")
    if labels is None:
        if objective.requires_labels:
            raise ValueError(
                f"Objective {name!r} is supervised: pass adapt_step(queries, gallery, labels=...) "
                "(a (B, N) bool mask or each query's list of relevant gallery indices)."
            )
        return None
    if not objective.requires_labels:
        raise ValueError(f"Objective {name!r} adapts without labels: drop labels=... from adapt_step.")
    if isinstance(labels, torch.Tensor) and labels.dtype == torch.bool and labels.dim() == 2:
        if labels.shape != (n, len(gallery)):
            raise ValueError(f"labels must have shape (queries, gallery) = {(n, len(gallery))}; got {tuple(labels.shape)}.")
        return labels.to(device=device, dtype=torch.bool)
    idx = relevance_to_index(labels, n, device=device)
    if (idx >= len(gallery)).any():
        raise ValueError(f"A label is >= the gallery size {len(gallery)}.")
    mask = torch.zeros(n, len(gallery) + 1, dtype=torch.bool, device=device)
    mask.scatter_(1, torch.where(idx >= 0, idx, len(gallery)), True)  # padding (-1) goes to a dropped column
    return mask[:, :-1]


@contextmanager
def pinned(
    gallery: Any, seen: dict[int, int], states: Sequence[tuple[Objective | None, dict]], warn: bool = True
) -> Iterator[None]:
    """Hold a top-k backend at one version for the whole step (its readers' lock: a concurrent ``add`` / ``remove`` /
    ``replace`` waits), after bringing the objectives' position-keyed states up to that version
    (:func:`~hf_tta.objectives.base.follow_gallery_changes`). ``seen`` maps each backend to the version the states
    last saw. When the backend's change log no longer reaches back, the states start again (logged unless ``warn`` is
    false: an answer's copies). Other galleries pass through."""
    if not isinstance(gallery, GalleryBackend):
        yield
        return
    with gallery.reading():
        last = seen.get(id(gallery))
        if last is not None and last != gallery.version and follow_gallery_changes(gallery, last, states) is None:
            if warn:
                logger.warning("The gallery changed more than its change log holds since the last step: objective state restarts.")
            for objective, state in states:
                if objective is not None:
                    fresh = objective.init_state(next(iter(state.values())).device if state else "cpu")
                    state.clear()
                    state.update(fresh)
        seen[id(gallery)] = gallery.version
        yield
