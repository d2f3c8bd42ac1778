"""Grid planning for the benchmark runner: query streams (:class:`Condition`), runs (:class:`Job`) and grids.

A *condition* is one query stream: image→text (``i2t``) with image queries corrupted by one ImageNet-C
corruption at one severity, text→image (``t2i``) with corrupted caption queries, the clean stream, the unseen
drawing style (``noto``: Noto Emoji renders as i2t queries, or as the t2i gallery), the diverse stream (every
query its own random corruption, REST's "-D"), or a robustness stream (:data:`ROBUSTNESS_SHIFTS`: shifts switching
every few batches, a degenerate constant prefix); audio/video conditions name a dataset config of one of the six
:data:`AV_DIRECTIONS`. A *job* is a (condition, objective) pair; :func:`build_grid` and :func:`build_av_grid`
list them, the source model first for every condition.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterable, Sequence

if TYPE_CHECKING:
    import numpy as np

SOURCE = "source"
#: The image–text directions of the emoji and Hub benchmarks.
IMAGE_TEXT_DIRECTIONS = ("i2t", "t2i")
#: The audio/video directions (:class:`AVTask`): name -> (query modality, gallery modality).
AV_DIRECTIONS = {
    "a2t": ("audio", "text"),
    "t2a": ("text", "audio"),
    "v2t": ("video", "text"),
    "t2v": ("text", "video"),
    "v2a": ("video", "audio"),
    "a2v": ("audio", "video"),
    # composed image retrieval (REST Table III / A.8): reference image + modification text -> target images
    "c2i": ("composed", "image"),
}
#: Streams that check that adaptation is safe to leave running: ``switch`` changes shift every
#: :data:`SWITCH_EVERY` queries of the stream (2 batches of 64), cycling through one corruption per family;
#: ``degenerate`` is :data:`DEGENERATE_BATCHES` batches of one constant query, then the clean stream, scored on the
#: clean part only (the source model's row is the clean stream's: a safe method matches it).
ROBUSTNESS_SHIFTS = ("switch", "degenerate")
OTHER_SHIFTS = ("clean", "noto", "diverse", *ROBUSTNESS_SHIFTS)
SWITCH_EVERY = 128
DEGENERATE_BATCHES = 200
QUERY_MODALITY = {"i2t": "image", "t2i": "text", **{d: q for d, (q, _) in AV_DIRECTIONS.items()}}
GALLERY_MODALITY = {"i2t": "text", "t2i": "image", **{d: g for d, (_, g) in AV_DIRECTIONS.items()}}
#: The default grid's image streams, ``(corruption, severity)``: one per ImageNet-C family, picked by the rule of
#: :func:`hf_tta.benchmarks.bands.choose_representatives` (where the source model keeps between a quarter and three
#: quarters of its clean R@1, closest to half; ties to the lower severity) from the source model's rows only
#: (``model_cards/results/source-severity-sweep/``, seed 0; a test re-applies the rule to those rows). Sized to run
#: in a few minutes on 2 CPU cores.
DEFAULT_IMAGE_CONDITIONS: tuple[tuple[str, int], ...] = (("shot_noise", 5), ("motion_blur", 4), ("snow", 2), ("contrast", 1))
DEFAULT_IMAGE_CORRUPTIONS = tuple(c for c, _ in DEFAULT_IMAGE_CONDITIONS)
#: The image severities of the full grid (``--full``): severity 3, where methods can be told apart, and 5.
FULL_IMAGE_SEVERITIES = (3, 5)
DEFAULT_OBJECTIVES = ("tent", "tcr", "rest")
#: The shifts the switching stream cycles through: for images the first corruption of each ImageNet-C family (the
#: default grid's before issue 25, kept so the switching stream stays the one its committed rows measured); for text,
#: one character-level and one word-level corruption of each kind (insertion/replacement-like, order/deletion-like)
#: that run offline.
SWITCH_IMAGE_CORRUPTIONS = ("gaussian_noise", "defocus_blur", "snow", "contrast")
SWITCH_TEXT_CORRUPTIONS = ("ocr", "char_swap", "synonym_replacement", "random_deletion")
#: The text diverse stream's pool when no text corruption is named: every character- and word-level corruption (none
#: needs a checkpoint), whatever this machine can generate; one it cannot is read from the stream cache or refused
#: (``hf-tta run``), never left out (a pool that followed the machine's packages made two streams of one name).
DIVERSE_TEXT_CORRUPTIONS = ("ocr", "char_insert", "char_replace", "char_swap", "char_delete",
                            "synonym_replacement", "random_insertion", "random_swap", "random_deletion", "insert_punctuation")
#: The supervised ceilings (not methods): the oracle objective on the TTA methods' parameters (the query tower's
#: LayerNorms) and on every parameter of the query tower.
ORACLE_ROWS = ("oracle", "oracle_all")
#: A row name ending in this runs its objective with REST's gradient decoupling (e.g. ``rest+gd``).
GD_SUFFIX = "+gd"
#: The row that runs the recommended preset (:func:`hf_tta.TTAConfig.recommended`).
RECOMMENDED = "recommended"
#: Row options, appended in any order (``tcr+gd+safe``): gradient decoupling, the safety layer
#: (:mod:`hf_tta.safety`, default thresholds), per-domain adapters with the unsupervised router
#: (:mod:`hf_tta.routing`, default config), every parameter of the query tower instead of its LayerNorms
#: (``oracle_all`` is ``oracle+all``), and per-domain adapters keyed by each query's true shift (``+key``: a routing
#: ceiling, not label-free; it tells the router's errors from what per-domain adaptation itself can give), the shift gate
#: (``+gate``: :mod:`hf_tta.shift_gate`, its reference the task's :meth:`~hf_tta.benchmarks.tasks.Task.gate_reference`)
#: weight ensembling with the source (``+ens``: :mod:`hf_tta.weight_ensemble`) and source-anchored answers (``+anchor``:
#: :mod:`hf_tta.source_anchor`). Each maps to its :class:`RowSpec` field.
ROW_OPTIONS = {"gd": "gd", "safe": "safe", "route": "route", "all": "all_params", "key": "key", "gate": "gate", "ens": "ens",
               "anchor": "anchor"}
#: The row switches (:class:`RowSpec` fields) that turn on a :class:`~hf_tta.TTAConfig` feature whose settings are the
#: run's (``hf-tta run --safety / --shift_gate / --weight_ensemble / --source_anchor``), and that field.
ROW_FEATURES = {"safe": "safety", "gate": "shift_gate", "ens": "weight_ensemble", "anchor": "source_anchor"}
#: Score transforms a row may add on top of its objective, one per row (``tcr+nnn``): :attr:`RowSpec.score_transform`,
#: ``TTAConfig.score_transform``. Alone they are rows of their own: ``dn``, ``nnn``, ``qbnorm`` are the source model
#: with the transform and nothing adapted (training-free objectives).
SCORE_TRANSFORMS = ("dn", "nnn", "qbnorm")
#: ``+b<percent>`` adapts on that share of the batches, evenly spaced (``tcr+b25``: 25 %, ``TTAConfig.update_budget``
#: ``{"fraction": 0.25}``, :mod:`hf_tta.update_budget`); the other batches are answered from one forward.
BUDGET_OPTION = "b"


# ------------------------------------------------------------------------------------------------ grid
@dataclass(frozen=True)
class Condition:
    """One query stream: ``direction`` (i2t / t2i), ``shift`` (a corruption, ``clean``, ``noto``, ``diverse``)
    and ``severity`` (``None`` where it does not apply)."""

    direction: str
    shift: str
    severity: int | None = None

    @property
    def key(self) -> str:
        return f"{self.direction}/{self.shift}" + (f"/{self.severity}" if self.severity is not None else "")

    @property
    def query_modality(self) -> str:
        return QUERY_MODALITY[self.direction]

    @property
    def group(self) -> str:
        """Which table the condition belongs to (audio/video: one table per direction)."""
        if self.direction in AV_DIRECTIONS:
            return self.direction
        if self.shift in OTHER_SHIFTS:
            return "shifts"
        return f"{self.direction}-severity-{self.severity}"


@dataclass(frozen=True)
class Job:
    """One run: a query stream, the row it fills (``source``, an objective or an oracle / ``+gd`` row, see
    :func:`row_objective`) and the seed of its stream order and corruptions."""

    condition: Condition
    objective: str
    seed: int = 0


def direction_name(value: str) -> str:
    """The short name of a direction: ``i2t``, ``t2i`` or one of :data:`AV_DIRECTIONS`, also from the long forms
    ``video->audio``, ``video2audio``, ``video_to_audio``, ``video→audio``."""
    import re

    v = value.strip().lower()
    if v in QUERY_MODALITY:
        return v
    pairs = {(QUERY_MODALITY[d], GALLERY_MODALITY[d]): d for d in QUERY_MODALITY}
    pair = tuple(re.split(r"\s*(?:->|→|_to_|2)\s*", v))
    if pair in pairs:
        return pairs[pair]
    names = ", ".join(f"{d} ({QUERY_MODALITY[d]}->{GALLERY_MODALITY[d]})" for d in QUERY_MODALITY)
    raise ValueError(f"Unknown direction {value!r}; choose from {names}.")


def image_corruption_names() -> tuple[str, ...]:
    """COCO-C's 16 image corruptions (``--corruptions all``)."""
    from ..data.corruptions import IMAGE_CORRUPTIONS

    return IMAGE_CORRUPTIONS


def known_image_corruptions() -> tuple[str, ...]:
    """Every image corruption a stream may name: COCO-C's 16 and ImageNet-C's validation corruptions."""
    from ..data.corruptions import ALL_IMAGE_CORRUPTIONS

    return ALL_IMAGE_CORRUPTIONS


def offline_text_corruptions(candidates: Iterable[str] | None = None) -> tuple[list[str], dict[str, str]]:
    """The text corruptions that run here (``(available, {name: why not})``); sentence-level ones need seq2seq
    checkpoints and are only tried when named in ``candidates``."""
    from ..data.corruptions import CHAR_CORRUPTIONS, MAX_TEXT_SEVERITY, WORD_CORRUPTIONS, corrupt_text

    names = list(candidates) if candidates is not None else list(CHAR_CORRUPTIONS + WORD_CORRUPTIONS)
    ok, missing = [], {}
    for name in names:
        try:
            corrupt_text("grinning face with big eyes", name, MAX_TEXT_SEVERITY[name], seed=0)
            ok.append(name)
        except Exception as err:  # MissingResourceError, ImportError, OSError (no checkpoint offline)
            missing[name] = f"{type(err).__name__}: {str(err).splitlines()[0][:160]}"
    return ok, missing


def stream_order(n: int, seed: int) -> list[int]:
    """The fixed random order in which a stream of ``n`` queries is fed for a seed."""
    import torch

    return torch.randperm(n, generator=torch.Generator().manual_seed(int(seed))).tolist()


def switch_segments(n: int, seed: int, num_shifts: int, every: int = SWITCH_EVERY) -> "np.ndarray":
    """The shift of each query of the switching stream (an index into the cycled shifts): the query's position in
    the stream order (:func:`stream_order`), in segments of ``every`` queries, cycling through ``num_shifts``."""
    import numpy as np

    position = np.empty(n, dtype=np.int64)
    position[np.asarray(stream_order(n, seed), dtype=np.int64)] = np.arange(n)
    return (position // every) % num_shifts


def build_grid(
    objectives: Sequence[str],
    directions: Sequence[str] = ("i2t",),
    image_corruptions: Sequence[str] = DEFAULT_IMAGE_CORRUPTIONS,
    severities: Sequence[int] = (5,),
    text_corruptions: Sequence[str] = (),
    text_severities: Sequence[int] = (7,),
    style: bool = False,
    diverse: bool = False,
    clean: bool = False,
    seeds: Sequence[int] = (0,),
    switch: bool = False,
    degenerate: bool = False,
    image_conditions: Sequence[tuple[str, int]] | None = None,
) -> list[Job]:
    """All (condition, objective, seed) jobs, the source model first for every condition. The clean stream's source
    row is always run (the reference of the won-back share); ``clean=True`` adapts on it too; ``switch`` and
    ``degenerate`` add the :data:`ROBUSTNESS_SHIFTS` streams. ``image_conditions`` (``(corruption, severity)``
    pairs, e.g. :data:`DEFAULT_IMAGE_CONDITIONS`) replaces the product of ``image_corruptions`` and ``severities``."""
    conds: list[Condition] = []
    references: list[Condition] = []
    for d in directions:
        (conds if clean else references).append(Condition(d, "clean"))
        if d == "i2t":
            pairs = image_conditions if image_conditions is not None else [(c, s) for s in severities for c in image_corruptions]
            conds += [Condition(d, c, s) for c, s in pairs]
        else:
            from ..data.corruptions import TEXT_SEVERITIES

            conds += [
                Condition(d, c, min(s, max(TEXT_SEVERITIES[c]))) for s in text_severities for c in text_corruptions
            ]
        if style:
            conds.append(Condition(d, "noto"))
        if diverse:
            conds.append(Condition(d, "diverse"))
        conds += [Condition(d, name) for name, wanted in zip(ROBUSTNESS_SHIFTS, (switch, degenerate)) if wanted]
    return jobs_for(conds, objectives, seeds, references)


def jobs_for(
    conds: Sequence[Condition], objectives: Sequence[str], seeds: Sequence[int] = (0,), references: Sequence[Condition] = ()
) -> list[Job]:
    """One job per (seed, condition, row): the source model first, then each objective; duplicate conditions once.
    ``references`` get the source row only (the clean stream, for the won-back share)."""
    seeds = list(dict.fromkeys(int(s) for s in seeds)) or [0]
    seen, unique = set(), []
    for c in conds:
        if c not in seen:
            seen.add(c)
            unique.append(c)
    refs = [c for c in dict.fromkeys(references) if c not in seen]
    rows = (SOURCE, *[o for o in dict.fromkeys(objectives) if o != SOURCE])
    return [Job(c, o, s) for s in seeds for c in refs for o in (SOURCE,)] + [
        Job(c, o, s) for s in seeds for c in unique for o in rows
    ]


@dataclass(frozen=True)
class RowSpec:
    """What a row name asks for: the registered objective, the :data:`ROW_OPTIONS` switched on, the score transform
    (one of :data:`SCORE_TRANSFORMS`, or ``None``), the update budget (the share of batches adapted on, in (0, 1], or
    ``None``: every batch) and the row's own lr; ``row`` is the name it was parsed from (per-row config overrides and
    held wrappers are keyed by it)."""

    objective: str
    gd: bool = False
    safe: bool = False
    route: bool = False
    all_params: bool = False
    key: bool = False
    gate: bool = False
    ens: bool = False
    anchor: bool = False
    score_transform: str | None = None
    budget: float | None = None
    lr: float | None = None
    row: str = field(default="", compare=False)
    #: the row ``recommended`` (or ``recommended@<lr>``) alone: its safety, shift gate and weight ensembling settings
    #: are the preset's (:func:`hf_tta.preset.recommended_fields`), not the run's
    preset: bool = False


def _budget(row: str, option: str) -> float:
    """The fraction of a ``+b<percent>`` option (``b25`` -> 0.25), refusing a share outside (0, 100] in one line."""
    try:
        percent = float(option[len(BUDGET_OPTION):])
    except ValueError:
        percent = float("nan")
    if not 0 < percent <= 100:
        raise ValueError(f"Row {row!r}: +{option} is an update budget, +b<percent of batches adapted on> with a percent "
                         "in (0, 100], e.g. tcr+b25.")
    return percent / 100


def _training_free(name: str) -> bool:
    """Whether ``name`` is a registered training-free objective (an unregistered name is the caller's to refuse)."""
    from ..objectives import available_objectives, get_objective_class

    return name in available_objectives() and not get_objective_class(name).requires_grad


def row_spec(row: str, query_modality: str = "image") -> RowSpec:
    """Parse a row name: ``"tcr+safe"`` -> ``RowSpec("tcr", safe=True)``, ``"oracle_all"`` ->
    ``RowSpec("oracle", all_params=True)``, ``"tcr+nnn"`` -> ``RowSpec("tcr", score_transform="nnn")``,
    ``"rest+b25"`` -> ``RowSpec("rest", budget=0.25)``; a trailing ``@<lr>`` runs the row at its own learning rate
    (``"tcr+safe@3e-3"``: protocol v3 reports each method at the paper's lr and at the lr chosen for it). Raises
    ``ValueError`` for an unknown or repeated option, two score transforms, a score transform or budget on a
    training-free objective, a budget outside (0, 100] % or an lr that is not a positive number. The row
    ``recommended`` is the preset of ``query_modality`` (:func:`hf_tta.preset.recommended_row`), at the preset's lr
    unless the row names its own (``recommended@3e-4``), with the preset's feature settings (``preset=True``)."""
    body, at, lr_text = row.partition("@")
    is_preset = body == RECOMMENDED  # exactly TTAConfig.recommended: its feature settings too (RowSpec.preset)
    if body.split("+")[0] == RECOMMENDED:  # the preset of TTAConfig.recommended, as a row (tests check the two agree)
        from ..preset import recommended_row

        preset, _, preset_lr = recommended_row(query_modality).partition("@")
        body = preset + body[len(RECOMMENDED):]
        if not at and preset_lr:
            at, lr_text = "@", preset_lr
    lr = None
    if at:
        try:
            lr = float(lr_text)
        except ValueError:
            lr = float("nan")
        if not lr > 0 or lr == float("inf"):
            raise ValueError(f"Row {row!r}: after @ comes the row's learning rate, a positive number such as 3e-3.")
    name, *options = body.split("+")
    if name == "oracle_all":
        name, options = "oracle", [*options, "all"]
    budgets = [o for o in options if o[:1] == BUDGET_OPTION and o[1:2] in set("0123456789.")]
    transforms = [o for o in options if o in SCORE_TRANSFORMS]
    unknown = [o for o in options if o not in ROW_OPTIONS and o not in SCORE_TRANSFORMS and o not in budgets]
    if unknown or len(set(options)) != len(options):
        raise ValueError(f"Row {row!r}: options are +{', +'.join([*ROW_OPTIONS, *SCORE_TRANSFORMS])} and +b<percent>, "
                         f"each at most once; got {options}.")
    if "key" in options and "route" in options:
        raise ValueError(f"Row {row!r}: +key routes by the true shift, +route by the unsupervised router; pick one.")
    if len(transforms) > 1:
        raise ValueError(f"Row {row!r}: one score transform per row; got +{' and +'.join(transforms)}.")
    if len(budgets) > 1:
        raise ValueError(f"Row {row!r}: one update budget per row; got +{' and +'.join(budgets)}.")
    budget = _budget(row, budgets[0]) if budgets else None
    if (transforms or budgets) and _training_free(name):
        option = (transforms or budgets)[0]
        raise ValueError(f"Row {row!r}: {name} is training-free (the source model with its own scoring, nothing adapts), "
                         f"so +{option} does not apply: write {name} alone, or +{option} on a gradient objective (tcr+{option}).")
    flags = {ROW_OPTIONS[o]: True for o in options if o in ROW_OPTIONS}
    return RowSpec(name, **flags, score_transform=transforms[0] if transforms else None, budget=budget, lr=lr, row=row,
                   preset=is_preset)


def row_objective(row: str) -> tuple[str, bool]:
    """The registered objective a row runs and whether the row name asks for gradient decoupling:
    ``"rest+gd"`` -> ``("rest", True)``, ``"oracle_all"`` -> ``("oracle", False)``."""
    spec = row_spec(row)
    return spec.objective, spec.gd


def av_dataset_configs(dataset) -> list[str]:
    """The configs of an audio-video benchmark (a :func:`~hf_tta.data.builders.audioset.save_av_benchmark` folder,
    a Hub id or local Hub-layout folder, or the mapping ``build_av_benchmark`` returns), in the builders' order."""
    from collections.abc import Mapping
    from pathlib import Path

    from ..data.builders.audioset import AV_BENCHMARKS

    if isinstance(dataset, Mapping):
        names = list(dataset)
    else:
        path = Path(str(dataset))
        names = sorted(p.name for p in path.iterdir() if (p / "dataset_info.json").is_file()) if path.is_dir() else []
        if not names:
            from datasets import get_dataset_config_names

            names = list(get_dataset_config_names(str(dataset)))
    known = list(dict.fromkeys(c for configs in AV_BENCHMARKS.values() for c in configs))
    return sorted(names, key=lambda c: (known.index(c) if c in known else len(known), c))


def av_shifts(direction: str, configs: Sequence[str]) -> list[str]:
    """The shifts a direction can run on a dataset with these configs: its query modality's corruption configs
    without the prefix (``video_noise_blur`` -> ``noise_blur``); text queries have only ``clean``."""
    prefix = QUERY_MODALITY[direction] + "_"
    return [c[len(prefix):] for c in configs if c.startswith(prefix)]


def build_av_grid(
    objectives: Sequence[str],
    directions: Sequence[str],
    configs: Sequence[str],
    selected: Sequence[str] | None = None,
    clean: bool = False,
    seeds: Sequence[int] = (0,),
) -> list[Job]:
    """Jobs of an audio/video grid: for each direction, the dataset's corruption configs of its query modality
    (``selected`` picks some by name, e.g. ``["video_noise_blur", "audio_diverse"]``) and ``clean`` (with
    ``clean=True``, or when none is left for the direction: text queries, VGGSound)."""
    conds: list[Condition] = []
    references: list[Condition] = []
    for d in directions:
        available = av_shifts(d, configs)
        if selected is not None:
            available = av_shifts(d, [c for c in configs if c in selected])
        (conds if clean or not available else references).append(Condition(d, "clean"))
        conds += [Condition(d, s) for s in available]
    return jobs_for(conds, objectives, seeds, references)
