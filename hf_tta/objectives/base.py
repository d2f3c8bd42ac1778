"""The objective contract and its registry.

An objective turns embeddings into a loss (or, for training-free methods, into new scores). It
never touches the model: the wrapper embeds the queries, hands an :class:`ObjectiveInputs` to the
objective, and owns backward, the optimiser, state, reset and save/load. So each objective is a
pure function of tensors plus an explicit ``state`` dict of tensors, unit-testable without a model.

Adding an objective = one file in ``hf_tta/objectives/`` with a dataclass config of paper defaults
and a class decorated with :func:`register_objective`, plus one row in the parametrized test table.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Mapping

import torch

from ..configuration_utils import ConfigMixin, check_field_types

if TYPE_CHECKING:  # pragma: no cover
    from ..window import WindowView

ObjectiveState = dict[str, torch.Tensor]


@dataclass
class ObjectiveConfig(ConfigMixin):
    """Base class of the per-objective configs (hyper-parameters with the paper's defaults).

    Subclasses are dataclasses; their ``__post_init__`` calls this one first, which checks every field's type against
    its annotation, then checks the ranges.
    """

    def __post_init__(self):
        check_field_types(self)


@dataclass
class ObjectiveInputs:
    """What the wrapper gives an objective at each step.

    Args:
        query_emb (`torch.Tensor` of shape `(B, D)`): L2-normalised query embeddings, with grad for
            gradient objectives. For multi-vector models (BLIP-2 images) this is the single-vector
            view described in :meth:`hf_tta.models.ModelAdapter.single_vector`.
        gallery_emb (`torch.Tensor` of shape `(N, D)`): cached, L2-normalised gallery embeddings (no grad),
            single-vector view.
        scores (`torch.Tensor` of shape `(B, N)`): exact query–gallery cosine similarities used for ranking
            (grad flows through the queries). ``scores[:, idx]`` gives exact sub-matrices, which is how
            refined predictions over candidate sets should be formed.
        step (`int`): step within the current batch, ``0 .. steps - 1``.
        batch_index (`int`): how many batches were adapted on before this one (since the last reset).
        generator (`torch.Generator`): the wrapper's RNG (saved with the state, so resumed streams match).
        reencode (`Callable`, *optional*): ``reencode(transform)`` re-embeds the current raw queries after
            ``transform(inputs: dict) -> dict`` and returns ``(query_emb, scores)``; used by objectives that
            need augmented views (DeYO).
        source_scores (`Callable`, *optional*): returns the frozen source model's ``(B, N)`` scores for the
            current queries (no grad); used by methods that regularise towards the source model.
        query_modality (`str`): the modality of the queries (``"image"``, ``"text"``, ...).
        queries (`dict`, *optional*): the raw query inputs of this batch (e.g. ``pixel_values`` or ``input_ids`` and
            ``attention_mask``), for objectives that keep raw samples (ClipTTA's memory) or edit them (TITAN).
        in_closure (`bool`): ``True`` when the wrapper re-evaluates the objective inside the optimiser's closure
            (the second pass of SAM-style optimisers); the state passed then is a copy, so writes are discarded.
        params (`dict`, *optional*): the adapted parameters by name (with grad), for regularisers on them (EATA's
            Fisher penalty).
        source_params (`dict`, *optional*): the source values of ``params`` (no grad).
        labels (`torch.Tensor` of shape `(B, N)`, *optional*): bool mask of each query's relevant gallery items, given
            only to supervised objectives (``requires_labels``: the benchmark's oracle ceilings), never to TTA methods.
        candidate_ids (`torch.Tensor` of shape `(C,)`, *optional*): with a top-k gallery backend, the global gallery
            indices (sorted) of the first ``C`` columns of ``scores`` and rows of ``gallery_emb``, the batch's candidate
            set; any further columns are the objective's :meth:`Objective.candidate_extras`. ``None`` for a dense gallery.
        backend (`GalleryBackend`, *optional*): the top-k backend itself, for whole-gallery statistics
            (``backend.statistics()``, ``backend.kmeans(...)``, ``len(backend)``); ``None`` for a dense gallery.
        window (`WindowView`, *optional*): the recent queries' detached rows (``TTAConfig.window``, :mod:`hf_tta.window`),
            for objectives whose statistics are over the batch; ``None`` when the window is off (the papers' batch).
        gallery_items (`torch.Tensor` of shape `(N, Q, D)`, *optional*): a multi-vector gallery's rows as the model
            scores them (a max over each item's vectors), for objectives that score other queries against the gallery
            (NNN's and QB-Norm's reference queries); ``None`` for a single-vector gallery (``gallery_emb`` is then the
            rows themselves).
    """

    query_emb: torch.Tensor
    gallery_emb: torch.Tensor
    scores: torch.Tensor
    step: int = 0
    batch_index: int = 0
    generator: torch.Generator | None = None
    reencode: Callable[[Callable[[dict], dict]], tuple[torch.Tensor, torch.Tensor]] | None = None
    source_scores: Callable[[], torch.Tensor] | None = None
    query_modality: str = "image"
    queries: Mapping[str, torch.Tensor] | None = None
    in_closure: bool = False
    params: Mapping[str, torch.Tensor] | None = None
    source_params: Mapping[str, torch.Tensor] | None = None
    labels: torch.Tensor | None = None
    candidate_ids: torch.Tensor | None = None
    backend: Any = None
    window: WindowView | None = None
    gallery_items: torch.Tensor | None = None

    @property
    def num_items(self) -> int:
        """The size of the whole gallery (not of the candidate set)."""
        return len(self.backend) if self.backend is not None else self.gallery_emb.shape[0]

    def global_ids(self, columns: torch.Tensor) -> torch.Tensor:
        """Gallery indices of ``scores`` columns (the columns themselves for a dense gallery)."""
        return columns if self.candidate_ids is None else self.candidate_ids.to(columns.device)[columns]

    def gallery_key(self) -> torch.Tensor:
        """The fingerprint of the whole gallery (:func:`gallery_fingerprint`; a backend's is computed once and cached)."""
        if self.backend is not None:
            return self.backend.statistics().fingerprint.to(self.gallery_emb.device)
        return gallery_fingerprint(self.gallery_emb)


#: What an objective needs of the gallery, for top-k backends (see ``hf_tta.gallery.base``).
GALLERY_ACCESS = ("topk", "softmax", "stats", "per_item", "full")


@dataclass
class LossOutput:
    """What an objective returns.

    Args:
        loss (`torch.Tensor`, *optional*): scalar loss; ``None`` for training-free objectives.
        n_selected (`int`): how many queries contributed. ``0`` means "nothing selected, skip the update"
            (the single skip rule of the library).
        logits (`torch.Tensor` of shape `(B, C)`, *optional*): the (refined) prediction logits the loss is built
            on, for gradient decoupling (REST Eq. 15).
        candidates (`torch.Tensor` of shape `(B, C)`, *optional*): gallery indices of ``logits``' columns, so the
            source model's prediction over the same candidates can be formed; ``None`` means all columns of
            ``scores`` in order.
        temperature (`float`, *optional*): the temperature that divides the scores in ``logits``.
        logits_fn (`Callable`, *optional*): maps any ``(B, N)`` score matrix to ``(B, C)`` logits built exactly as
            ``logits`` are (same candidates, masks and temperature), for candidate sets that are not plain gallery
            columns (REST's k-means centroids). When set, gradient decoupling uses it instead of ``candidates`` and
            ``temperature``.
        scores (`torch.Tensor` of shape `(B, N)`, *optional*): replacement ranking scores (training-free methods).
        logs (`dict`): scalar diagnostics (floats or 0-d detached tensors; the wrapper converts those of the
            reported step only, so logging costs no device sync per step).
    """

    loss: torch.Tensor | None
    n_selected: int
    logits: torch.Tensor | None = None
    candidates: torch.Tensor | None = None
    temperature: float | None = None
    logits_fn: Callable[[torch.Tensor], torch.Tensor] | None = None
    scores: torch.Tensor | None = None
    logs: dict[str, float | torch.Tensor] = field(default_factory=dict)


class Objective:
    """Base class. Subclasses set ``config_class`` and implement :meth:`__call__`.

    Class attributes:
        name: registry key (set by :func:`register_objective`).
        config_class: the dataclass of hyper-parameters.
        requires_grad: ``False`` for training-free objectives (no optimiser, no parameter change).
        requires_labels: ``True`` for supervised objectives (the oracle ceilings): ``adapt_step`` must get ``labels``.
        gallery_access: what the objective needs of the gallery, for top-k backends (``hf_tta.gallery``; one of
            :data:`GALLERY_ACCESS`): ``"topk"`` only each query's top-``gallery_k`` items (exact on the candidates);
            ``"softmax"`` a softmax over the gallery (taken over the batch's candidates with a top-k backend);
            ``"stats"`` whole-gallery statistics computed once by the backend (``ObjectiveInputs.backend``);
            ``"per_item"`` state per gallery item, an ``N``-vector keyed by global index
            (``ObjectiveInputs.candidate_ids``); ``"full"`` every item at every step (refused with a top-k backend).
        gallery_k: the neighbours per query the objective needs (the backend searches ``max(k, gallery_k)``).
        score_after_update: ``True`` asks the wrapper to report scores from a fresh forward after the batch's last
            update (ClipTTA's own protocol); ``False`` (default) reports the last step's forward, as TCR's code does.
        multi_vector_queries: ``False`` for objectives that keep single-vector query embeddings to score against the
            gallery (NNN's and QB-Norm's reference banks): the wrapper refuses them for multi-vector queries.

    Objectives must not write state tensors in place: they replace entries of ``state`` (the wrapper keeps the
    previous dict to roll back a step whose loss is not finite). An optimiser returned by :meth:`make_optimizer`
    that sets ``requires_closure = True`` (SAM) gets a closure re-evaluating the loss.
    """

    name: ClassVar[str] = ""
    config_class: ClassVar[type[ObjectiveConfig]] = ObjectiveConfig
    requires_grad: ClassVar[bool] = True
    requires_labels: ClassVar[bool] = False
    gallery_access: ClassVar[str] = "softmax"
    gallery_k: ClassVar[int] = 0
    score_after_update: ClassVar[bool] = False
    multi_vector_queries: ClassVar[bool] = True

    def __init__(self, config: ObjectiveConfig | None = None):
        self.config = config if config is not None else self.config_class()
        if not isinstance(self.config, self.config_class):
            raise TypeError(
                f"{type(self).__name__} expects a {self.config_class.__name__}, got {type(self.config).__name__}."
            )

    def init_state(self, device: torch.device | str = "cpu") -> ObjectiveState:
        """A fresh objective state (tensors only, so it saves with safetensors)."""
        return {}

    def __call__(self, inputs: ObjectiveInputs, state: ObjectiveState) -> LossOutput:  # pragma: no cover
        raise NotImplementedError

    def make_optimizer(self, params, lr: float, weight_decay: float) -> torch.optim.Optimizer:
        """The optimiser this objective adapts with (AdamW, as in TCR's code; SAR overrides it with SAM). ``params`` are
        tensors or parameter groups with their own ``lr`` (``TTAConfig.lr_multipliers``)."""
        return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)

    def on_step_end(self, inputs: ObjectiveInputs, output: LossOutput, state: ObjectiveState) -> bool:
        """Called after an update; return ``True`` to ask the wrapper to reset to the source (SAR's recovery)."""
        return False

    def search_vectors(self, query_emb: torch.Tensor, state: ObjectiveState) -> torch.Tensor | None:
        """With a top-k backend: extra vectors ``(M, D)`` whose top-k the wrapper adds to the candidate set (DN searches
        its shifted queries, so its re-ranked top-k is exact). ``query_emb`` is detached; ``state`` must not change."""
        return None

    def candidate_extras(self, backend, seed: int) -> torch.Tensor | None:
        """With a top-k backend: vectors ``(K, D)`` scored as extra columns after the candidates (REST's centroids,
        ``backend.kmeans(...)``), so that the source model's scores (gradient decoupling) include them too."""
        return None

    def on_gallery_change(self, change, state: ObjectiveState) -> None:
        """A live gallery changed (:class:`hf_tta.gallery.GalleryChange`: items added, removed or replaced): bring the
        gallery-derived entries of ``state`` to the new gallery, replacing entries (never writing tensors in place).
        Position-keyed state is remapped (:meth:`GalleryChange.remap_vector`), statistics of the whole gallery are
        dropped so the next step recomputes them. The default keeps nothing derived from the gallery."""


OBJECTIVES: dict[str, type[Objective]] = {}


def register_objective(name: str, config_class: type[ObjectiveConfig]):
    """Class decorator: register an :class:`Objective` subclass under ``name`` with its config class."""

    def deco(cls: type[Objective]) -> type[Objective]:
        if name in OBJECTIVES and OBJECTIVES[name] is not cls:
            raise ValueError(f"An objective named {name!r} is already registered ({OBJECTIVES[name].__name__}).")
        if cls.gallery_access not in GALLERY_ACCESS:
            raise ValueError(f"{cls.__name__}.gallery_access must be one of {GALLERY_ACCESS}, got {cls.gallery_access!r}.")
        cls.name = name
        cls.config_class = config_class
        OBJECTIVES[name] = cls
        return cls

    return deco


def available_objectives() -> list[str]:
    return sorted(OBJECTIVES)


def get_objective_class(name: str) -> type[Objective]:
    try:
        return OBJECTIVES[name]
    except KeyError:
        raise ValueError(f"Unknown objective {name!r}. Available: {', '.join(available_objectives())}.") from None


def build_objective(name: str, config: ObjectiveConfig | Mapping[str, Any] | None = None) -> Objective:
    """Instantiate the objective ``name`` from a config object or a dict of overrides."""
    cls = get_objective_class(name)
    if config is None or isinstance(config, Mapping):
        config = cls.config_class.from_dict(dict(config or {}))
    return cls(config)


# ---------------------------------------------------------------------------------------------
# Shared maths used by several objectives (kept here so objective files hold only their method).
# ---------------------------------------------------------------------------------------------


def softmax_entropy(logits: torch.Tensor) -> torch.Tensor:
    """Row-wise entropy ``-sum_j p_ij log p_ij`` of ``softmax(logits)`` (natural log)."""
    logp = logits.log_softmax(dim=-1)
    return -(logp.exp() * logp).sum(dim=-1)


def nearest_neighbours(scores: torch.Tensor) -> torch.Tensor:
    """Index of each query's top-1 gallery item (TCR Eq. 4)."""
    return scores.detach().argmax(dim=1)


def gallery_tau_field(default: float = 0.01) -> Any:
    """The softmax temperature over the whole gallery used by the recognition baselines (TCR Eq. 1, App. B.2)."""
    return config_field(default, "Softmax temperature over the gallery (TCR App. B.2: 0.01; 0.001 Fashion-Gen; 1e-4 ReID).")


def config_field(default: Any, help: str, **kwargs) -> Any:
    """``dataclasses.field`` with peft-style help metadata."""
    return dataclasses.field(default=default, metadata={"help": help}, **kwargs)


#: How the entropy-filtering baselines (EATA, SAR, DeYO) select queries: ``"tcr_port"`` as TCR's baseline ports ran
#: them (the default: per-batch selection of the lowest fraction by the k-th smallest entropy, with ``<=`` in EATA's and
#: SAR's ports and ``<`` in DeYO's), ``"paper"`` as the upstream papers define them (absolute margins ``fraction * ln C``).
SELECTIONS = ("tcr_port", "paper")


def lowest_fraction(
    entropy: torch.Tensor, fraction: float, context: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """TCR's per-batch selection: ``(mask, threshold)`` with ``threshold`` the k-th smallest entropy of the batch,
    ``k = int(fraction * B)`` (at least 1), and ``mask = E <= threshold`` (25 of 64 for ``fraction = 0.4``; ties at
    the threshold are all kept). ``context``: the window's entropies (:func:`hf_tta.window.entropies`), which join the
    batch for the threshold (``k = int(fraction * (B + W))``); the mask is of the batch's queries only."""
    e = entropy.detach()
    pool = e if context is None else torch.cat([e, context.to(e)])
    k = min(max(1, int(fraction * pool.shape[0])), pool.shape[0])
    threshold = pool.kthvalue(k).values
    return e <= threshold, threshold


def log_classes_margin(fraction: float, entropy: torch.Tensor, num_classes: int) -> torch.Tensor:
    """The papers' absolute entropy margin ``fraction * ln C``, with ``C`` the number of softmax columns (the gallery
    size in retrieval), as a 0-d tensor on the entropies' device."""
    return torch.tensor(fraction * math.log(num_classes), device=entropy.device, dtype=entropy.dtype)


def select_rows(rows: torch.Tensor) -> Callable[[dict], dict]:
    """A transform for :attr:`ObjectiveInputs.reencode` that keeps the rows ``rows`` of every batched tensor input."""

    def take(inputs: dict) -> dict:
        return {k: (v[rows.to(v.device)] if isinstance(v, torch.Tensor) and v.dim() > 0 else v) for k, v in inputs.items()}

    return take


def gallery_fingerprint(gallery_emb: torch.Tensor) -> torch.Tensor:
    """A cheap, order-sensitive fingerprint ``(N, sum, position-weighted sum)`` of the gallery (float64), so objectives
    that cache gallery statistics in their state (REST's k-means, DN's mean) notice a new gallery."""
    g = gallery_emb.detach().reshape(gallery_emb.shape[0], -1).sum(dim=1, dtype=torch.float64)
    pos = torch.arange(1, g.numel() + 1, device=g.device, dtype=torch.float64)
    return torch.stack([torch.tensor(float(g.numel()), dtype=torch.float64, device=g.device), g.sum(), (g * pos).sum()])


def same_gallery(state: ObjectiveState, key: str, gallery_emb: torch.Tensor) -> bool:
    """Whether ``state[key]`` holds the fingerprint of ``gallery_emb``."""
    return same_fingerprint(state, key, gallery_fingerprint(gallery_emb))


def follow_gallery_changes(gallery, version: int, states) -> int | None:
    """Bring objective states up to a live gallery's current version: each change since ``version``
    (``gallery.changes_since``) goes to :meth:`Objective.on_gallery_change` of every ``(objective, state)`` pair in
    ``states``, in order. Returns the gallery's version, or ``None`` when its change log no longer reaches back to
    ``version`` (position-keyed state cannot be remapped then: reset it). Call it under ``gallery.reading()`` (a
    backend), so that no change slips in between this and the step."""
    changes = gallery.changes_since(version)
    if changes is None:
        return None
    for change in changes:
        for objective, state in states:
            if objective is not None:
                objective.on_gallery_change(change, state)
    return changes[-1].version if changes else version


def mark_gallery_changed(state: ObjectiveState, key: str, new_size: int) -> None:
    """After :meth:`Objective.on_gallery_change` remapped position-keyed state: ``state[key]`` records the new size
    instead of a fingerprint, so the next step adopts the changed gallery's fingerprint (:func:`adopt_fingerprint`)
    instead of starting the state again."""
    state[key] = torch.tensor([float(new_size)], dtype=torch.float64, device=state[key].device)


def adopt_fingerprint(state: ObjectiveState, key: str, fingerprint: torch.Tensor, num_items: int) -> bool:
    """Whether ``state`` belongs to the gallery of ``fingerprint``: the same fingerprint, or a gallery change remapped
    to ``num_items`` items (:func:`mark_gallery_changed`; the fingerprint is then recorded)."""
    if same_fingerprint(state, key, fingerprint):
        return True
    old = state.get(key)
    if old is not None and old.numel() == 1 and int(old.item()) == num_items:
        state[key] = fingerprint
        return True
    return False


def same_fingerprint(state: ObjectiveState, key: str, fingerprint: torch.Tensor) -> bool:
    """Whether ``state[key]`` holds ``fingerprint`` (to ~1e-9: a streamed fingerprint rounds differently)."""
    old = state.get(key)
    if old is None or old.numel() != 3:
        return False
    return bool(torch.allclose(old.to(fingerprint.device), fingerprint, rtol=1e-9, atol=1e-9))
