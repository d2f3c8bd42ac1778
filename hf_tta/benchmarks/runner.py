"""The benchmark runner behind ``hf-tta``: runs (condition, objective) jobs on a task and returns one row each.

Each run

* starts from the source model (one :class:`~hf_tta.TTAWrapper` per objective and direction, ``reset()`` before
  every run),
* streams the queries in a fixed random order (seeded) in batches of 64, adapting online (TCR's protocol),
* scores every query against the whole gallery, which the source model encodes once per gallery,
* reports R@1/5/10 and the paper's Fig. 1 diagnostics: query uniformity (Eq. 14) and query–gallery gap (Eq. 15)
  of the source model's query embeddings ("before") and of the adapted model's at the end of the stream ("after").

The source model's row ("source") is its own row, not an objective: :class:`SourceScorer` embeds and scores the
stream with the untouched source model through the model adapter's ``check_inputs``, ``encode``, ``score`` and
``single_vector``, the calls :meth:`~hf_tta.TTAWrapper.embed_and_score` makes (so multi-vector models such as BLIP-2
score the same way in every row); it also encodes the galleries. Every adapted row embeds and scores through a
:class:`~hf_tta.TTAWrapper` built for its row and seed. The oracle rows (``oracle``: the query tower's LayerNorms, ``oracle_all``:
every parameter of the query tower) adapt like the methods but on the true labels: ceilings, not methods. Each row
stores its per-query R@1 hits (``hits``, a string of 0/1 in query order) for the paired bootstrap of the report, and its
cost: passes per query through the query tower (``forward_per_query``, ``backward_per_query``: :class:`~hf_tta.PassCounts`;
the source row's is one forward) and the seconds of the scored stream (``stream_seconds``: answers and updates, not the
gallery's encoding, a degenerate stream's prefix nor the diagnostics; compare it within one run). Grids are planned in
:mod:`hf_tta.benchmarks.grid`, tasks live in :mod:`hf_tta.benchmarks.tasks`, tables and plots in
:mod:`hf_tta.benchmarks.report`.
"""

from __future__ import annotations

import copy
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from ..logging import tqdm
from ..outputs import PassCounts
from .grid import (
    DEGENERATE_BATCHES,
    GALLERY_MODALITY,
    QUERY_MODALITY,
    ROW_FEATURES,
    SOURCE,
    Condition,
    Job,
    RowSpec,
    row_spec,
    stream_order,
)
from .tasks import Task, take_items

logger = logging.getLogger(__name__)

#: The domain cap of the ``+key`` rows: every shift a stream can carry gets its own adapter (16 image corruptions).
KEY_MAX_DOMAINS = 64


@dataclass
class RunSettings:
    """How the runner adapts (the papers' protocol by default)."""

    steps: int = field(default=3, metadata={"help": "Gradient steps per batch (TCR: 3)."})
    batch_size: int = field(default=64, metadata={"help": "Queries per online batch (TCR: 64)."})
    seed: int = field(default=0, metadata={"help": "Seed of the stream order and the objectives' RNG for jobs without their own."})
    gallery_batch_size: int = field(default=256, metadata={"help": "Chunk size of the no-grad passes (gallery, source rows)."})
    lr: float | None = field(default=None, metadata={"help": "Learning rate (None: the adapter's rate for the query modality)."})
    objective_configs: dict[str, dict] = field(default_factory=dict, metadata={"help": "Per-objective config overrides."})
    show_progress: bool = field(default=True, metadata={"help": "Progress bars."})
    cache_dir: str | None = field(
        default=None, metadata={"help": "Gallery embeddings are stored here (safetensors) and read back; delete after changing model."}
    )
    safety: dict = field(
        default_factory=dict, metadata={"help": "SafetyConfig overrides of the `<objective>+safe` rows (default thresholds)."}
    )
    routing: dict = field(
        default_factory=dict, metadata={"help": "RoutingConfig overrides of the `<objective>+route` rows (default router)."}
    )
    degenerate_batches: int = field(
        default=DEGENERATE_BATCHES,
        metadata={"help": "Batches of one constant query that open the degenerate stream before its clean part."},
    )
    config_overrides: dict = field(
        default_factory=dict,
        metadata={"help": "TTAConfig fields every row's config starts from (e.g. weight_decay, reset_policy, autocast_dtype, "
                  "safety); the row sets its objective, modalities, steps, lr and seed, and +safe, +dn / +nnn / +qbnorm, +b<percent> and oracle_all "
                  "add theirs."},
    )
    gradient_decoupling: tuple[str, ...] | None = field(
        default=None,
        metadata={
            "help": "Objectives run with REST's gradient decoupling on every stream; None = REST's protocol: `rest` with "
            "gradient decoupling on the diverse streams only. A row named `<objective>+gd` always runs with it."
        },
    )


def query_tower_modules(adapter, modality: str) -> list[str]:
    """The fewest modules that hold every parameter of ``modality``'s tower: each module owning parameters directly,
    unless an ancestor does too (PEFT then wraps the ancestor, whose copy carries the descendants). Shared modules
    (BLIP-2's Q-Former) belong to every tower."""
    owners = [
        name for name, module in adapter.model.named_modules()
        if name and any(True for _ in module.parameters(recurse=False)) and modality in adapter.tower_of(name)
    ]
    chosen: list[str] = []
    for name in owners:  # named_modules lists ancestors first
        if not any(name.startswith(c + ".") for c in chosen):
            chosen.append(name)
    return chosen


def per_query_hits(scores: torch.Tensor, relevant: Sequence[Sequence[int]], chunk: int = 512) -> torch.Tensor:
    """``(Q,)`` bool: whether each query's best relevant item ranks first (pessimistic ties, as ``retrieval_metrics``)."""
    from ..metrics import relevant_ranks

    out = []
    for start in range(0, scores.shape[0], chunk):
        ranks, valid = relevant_ranks(scores[start : start + chunk], relevant[start : start + chunk])
        out.append(((ranks == 1) & valid).any(dim=1))
    return torch.cat(out)


class SourceScorer:
    """The source model's row: embeds and scores queries, and encodes galleries, with the source model as it is
    (nothing wrapped, nothing adapted). It makes the calls of :meth:`~hf_tta.TTAWrapper.embed_and_score` and
    :meth:`~hf_tta.TTAWrapper.encode_gallery` (the model adapter's ``check_inputs``, ``encode``, ``score``,
    ``single_vector``), so its rows equal what a wrapper gives inside ``disabled()`` (tested hit for hit)."""

    def __init__(self, model, query_modality: str, gallery_modality: str):
        from ..models import get_adapter

        self.adapter = get_adapter(model, modalities=(query_modality, gallery_modality))
        self.query_modality, self.gallery_modality = query_modality, gallery_modality
        self.adapter.model.eval()
        self.passes = PassCounts()  # queries embedded (one forward each; the gallery is not counted)

    @torch.no_grad()
    def encode_gallery(self, batches):
        """A :class:`~hf_tta.GalleryCache` of the gallery's input batches."""
        from ..gallery.cache import GalleryCache

        m = self.gallery_modality
        embs = [self.adapter.encode(m, self.adapter.check_inputs(m, inputs)) for inputs in batches]
        if not embs:
            raise ValueError("The gallery is empty.")
        return GalleryCache(torch.cat(embs), m)

    @torch.no_grad()
    def embed_and_score(self, inputs, gallery) -> tuple[torch.Tensor, torch.Tensor]:
        """Single-vector query embeddings ``(B, D)`` and scores ``(B, N)`` against a dense gallery."""
        q = self.adapter.encode(self.query_modality, self.adapter.check_inputs(self.query_modality, inputs))
        self.passes.forward += int(q.shape[0])
        scores = self.adapter.score(q, gallery.embeddings)
        return self.adapter.single_vector(q, scores, gallery.single), scores


class GridRunner:
    """Runs jobs on a task: galleries are encoded once (by the source model) and shared by every row."""

    def __init__(self, task: Task, settings: RunSettings | None = None):
        self.task = task
        self.settings = settings or RunSettings()
        self.pristine = task.model  # never adapted: every adapted row's TTAWrapper gets its own deep copy
        self._sources: dict[str, Any] = {}
        self._galleries: dict[str, Any] = {}
        self._wrappers: dict[tuple, Any] = {}
        self._source_rows: dict[tuple[str, int], dict] = {}

    # ---------------------------------------------------------------- wrappers
    def source_scorer(self, direction: str) -> SourceScorer:
        """The source model of a direction (:class:`SourceScorer`): the source rows and every gallery."""
        if direction not in self._sources:
            self._sources[direction] = SourceScorer(self.pristine, QUERY_MODALITY[direction], GALLERY_MODALITY[direction])
        return self._sources[direction]

    def row_config(self, row: str | RowSpec, cond: Condition, seed: int):
        """The :class:`~hf_tta.TTAConfig` of a row (a name or its parsed :class:`RowSpec`) on a stream for a seed:
        objective, gradient decoupling, adapted modules, and the seed of the wrapper's RNG."""
        from ..config import TTAConfig
        from ..config_flat import FLAT_FIELDS, nest
        from ..models import get_adapter
        from ..objectives.base import get_objective_class

        s = self.settings
        spec = row if isinstance(row, RowSpec) else row_spec(row, QUERY_MODALITY[cond.direction])
        objective, gd = spec.objective, spec.gd
        if s.gradient_decoupling is None:
            gd = gd or (objective == "rest" and cond.shift == "diverse")  # REST's protocol on diverse shift
        else:
            gd = gd or objective in s.gradient_decoupling
        modality = QUERY_MODALITY[cond.direction]
        targets = None
        if spec.all_params:
            targets = query_tower_modules(get_adapter(self.pristine, (modality, GALLERY_MODALITY[cond.direction])), modality)
        base = dict(s.config_overrides)  # the user's TTAConfig fields, flat (the CLI's options); the row's own choices win
        # the features a row does not run take no options: no tuning of a training-free row, no gd settings without gd
        off = {"gradient_decoupling"} if not gd else set()
        if not get_objective_class(objective).requires_grad:  # nor an update budget (nothing to update)
            off |= {"tuning", "consistency", "lr_search", "update_budget"}
        base = {k: v for k, v in base.items() if FLAT_FIELDS.get(k, (k,))[0] not in off}
        if spec.preset:  # the row `recommended`: exactly TTAConfig.recommended's settings, whatever the run's
            from ..preset import recommended_fields

            fields = recommended_fields(modality)
            base.update({k: fields.get(k) for k in ROW_FEATURES.values()})
        transform = spec.score_transform or base.get("score_transform")
        safety = base.get("safety")
        return TTAConfig(**nest({
            **base,
            "objective": objective,
            "objective_config": dict(s.objective_configs.get(spec.row, s.objective_configs.get(objective, {}))),
            "query_modality": modality,
            "gallery_modality": GALLERY_MODALITY[cond.direction],
            "steps": s.steps,
            "lr": s.lr if spec.lr is None else spec.lr,
            "seed": seed,
            "target_modules": targets if spec.all_params else base.get("target_modules"),
            "gradient_decoupling": gd,
            "score_transform": transform,
            "score_transform_config": base.get("score_transform_config", {}) if transform == base.get("score_transform") else {},
            "safety": {**(safety or {}), **s.safety} if spec.safe and not spec.preset else safety,
            # a row's switch turns its feature on with the run's settings ({} = the feature's defaults)
            **{name: dict(base.get(name) or {}) if getattr(spec, flag) else base.get(name)
               for flag, name in ROW_FEATURES.items() if name != "safety"},
            "update_budget": {"fraction": spec.budget} if spec.budget is not None else base.get("update_budget"),
            # the supervised ceilings are prequential: each batch is scored before its labels train the model
            "scoring": "before_update" if objective == "oracle" else base.get("scoring", "after_update"),
        }))

    def _wrapper(self, row: str | RowSpec, cond: Condition, seed: int):
        """The row's wrapper, reset to the source model. One is held per (row, direction, gradient decoupling); it
        is built with the row's config (the seed included) and rebuilt when the config changes (another seed)."""
        from ..wrapper import TTAWrapper

        spec = row if isinstance(row, RowSpec) else row_spec(row, QUERY_MODALITY[cond.direction])
        cfg = self.row_config(spec, cond, seed)
        key = (spec.row, cond.direction, cfg.gradient_decoupling is not None)
        held = self._wrappers.pop(key, None)
        if held is None or held.config != cfg:
            del held  # the previous seed's copy of the model goes before the next is made
            if spec.route or spec.key:
                from ..routing import make_wrapper

                routing = dict(self.settings.routing)
                if spec.key:  # one adapter per true shift: the diverse image stream draws from 16 corruptions
                    routing["max_domains"] = KEY_MAX_DOMAINS
                held = make_wrapper(copy.deepcopy(self.pristine), cfg, routing)
            else:
                held = TTAWrapper(copy.deepcopy(self.pristine), cfg)
            if cfg.shift_gate is not None:  # the gate's reference: the task's clean reference queries (no labels)
                modality = QUERY_MODALITY[cond.direction]
                items = self.task.gate_reference(cond.direction)
                held.fit_shift_gate(self._batches(modality, items, self.settings.gallery_batch_size))
        self._wrappers[key] = held
        held.reset()
        return held

    # ---------------------------------------------------------------- embeddings
    def _batches(self, modality: str, items: Sequence, batch_size: int):
        for start in range(0, len(items), batch_size):
            yield self.task.to_inputs(modality, take_items(items, range(start, min(start + batch_size, len(items)))))

    def gallery(self, cond: Condition):
        """The gallery of a condition as a :class:`~hf_tta.GalleryCache`, encoded once by the source model (cached
        in ``settings.cache_dir`` as safetensors when set)."""
        from ..gallery.cache import GalleryCache

        key = self.task.gallery_key(cond)
        if key not in self._galleries:
            path = None
            if self.settings.cache_dir is not None:
                from pathlib import Path

                n = len(getattr(self.task, "bench", ())) or "hub"
                path = Path(self.settings.cache_dir) / f"gallery-{self.task.name}-{n}-{key}.safetensors"
            modality = GALLERY_MODALITY[cond.direction]
            if path is not None and path.exists():
                from safetensors.torch import load_file

                emb = load_file(str(path), device=str(self.task.device))["embeddings"]
                self._galleries[key] = GalleryCache(emb, modality)
            else:
                items = self.task.gallery_items(cond)
                batches = self._batches(modality, items, self.settings.gallery_batch_size)
                self._galleries[key] = self.source_scorer(cond.direction).encode_gallery(batches)
                if path is not None:  # atomically: shards of one grid share the cache folder
                    from safetensors.torch import save_file

                    from .cache import write_atomically

                    emb = self._galleries[key].embeddings.cpu().contiguous()
                    write_atomically(path, lambda tmp: save_file({"embeddings": emb}, tmp))
        return self._galleries[key]

    def _score_all(self, scorer, modality: str, raw: Sequence, gallery) -> tuple[torch.Tensor, torch.Tensor]:
        """No-grad pass over every query: single-vector embeddings and scores (a wrapper's current model, or the
        :class:`SourceScorer`)."""
        embs, scores = [], []
        for inputs in self._batches(modality, raw, self.settings.gallery_batch_size):
            q, sc = scorer.embed_and_score(inputs, gallery)
            embs.append(q.float().cpu())
            scores.append(sc.float().cpu())
        return torch.cat(embs), torch.cat(scores)

    def order(self, n: int, seed: int | None = None) -> list[int]:
        """The fixed random order of the query stream for a seed (:func:`~hf_tta.benchmarks.grid.stream_order`)."""
        return stream_order(n, self.settings.seed if seed is None else seed)

    def _degenerate_prefix(
        self, tta, modality: str, raw: Sequence, relevant, gallery, seed: int, keyed: bool = False
    ) -> tuple[int, int]:
        """Feed ``settings.degenerate_batches`` batches of one constant query (a seeded pick of the clean stream)
        before the clean stream (keyed ``constant`` on ``+key`` rows); returns the updates made and steps skipped."""
        s = self.settings
        pick = stream_order(len(raw), seed)[0]
        inputs = self.task.to_inputs(modality, take_items(raw, [pick] * s.batch_size))
        labels = [relevant[pick]] * s.batch_size if tta.objective.requires_labels else None
        updates = skipped = 0
        bar = tqdm(range(s.degenerate_batches), desc=f"constant prefix ({tta.config.objective})", leave=False,
                   disable=not s.show_progress)
        for _ in bar:
            out = tta.adapt_step(inputs, gallery, labels=labels, **({"domain": "constant"} if keyed else {}))
            updates += out.num_updates
            skipped += len(out.skipped)
        return updates, skipped

    # ---------------------------------------------------------------- one job
    def run(self, job: Job) -> dict[str, Any]:
        from ..metrics import modality_gap, retrieval_metrics, uniformity
        from ..routing import RoutedTTAWrapper

        cond, s, seed = job.condition, self.settings, job.seed
        t0 = time.time()
        row: dict[str, Any] = {
            "direction": cond.direction,
            "shift": cond.shift,
            "severity": cond.severity,
            "objective": job.objective,
            "seed": seed,
        }
        try:
            raw, relevant = self.task.queries(cond, seed)
            gallery = self.gallery(cond)
            modality = cond.query_modality
            row.update({"stream": self.task.stream_key(cond), "num_queries": len(raw), "gallery_size": len(gallery)})
            if job.objective == SOURCE:
                scorer = self.source_scorer(cond.direction)
                counted, clock = scorer.passes.copy(), time.perf_counter()
                after, scores = self._score_all(scorer, modality, raw, gallery)
                cost = scorer.passes.since(counted), time.perf_counter() - clock
                info = {}
            else:
                spec = row_spec(job.objective, QUERY_MODALITY[cond.direction])  # parsed once per job
                if (cond.key, seed) not in self._source_rows:  # the "before" diagnostics (cheap: no adaptation)
                    self.run(Job(cond, SOURCE, seed))
                tta = self._wrapper(spec, cond, seed)
                supervised = tta.objective.requires_labels
                domains = None
                if spec.key:  # per-domain adapters keyed by each query's true shift
                    domains = self.task.query_domains(cond, seed)
                    if domains is None:
                        raise ValueError(f"Row {job.objective!r}: this task does not record each query's shift; use +route.")
                order = self.order(len(raw), seed)
                scores = torch.empty(len(raw), len(gallery))
                updates, skipped, served = 0, 0, []
                if cond.shift == "degenerate":  # a constant prefix first; recall is scored on the clean part only
                    updates, skipped = self._degenerate_prefix(tta, modality, raw, relevant, gallery, seed, domains is not None)
                batches = range(0, len(order), s.batch_size)
                counted, clock = tta.passes.copy(), time.perf_counter()  # the scored stream's cost, not the prefix's
                bar = tqdm(batches, desc=f"{job.objective} {cond.key}", leave=False, disable=not s.show_progress)
                for start in bar:
                    idx = order[start : start + s.batch_size]
                    labels = [relevant[i] for i in idx] if supervised else None
                    keys = {} if domains is None else {"domain": [domains[i] for i in idx]}
                    out = tta.adapt_step(self.task.to_inputs(modality, take_items(raw, idx)), gallery, labels=labels, **keys)
                    scores[idx] = out.scores.float().cpu()
                    updates += out.num_updates
                    skipped += len(out.skipped)
                    if "lr_search.served" in out.logs:  # LRSearchConfig(serve="leader"): the lr that answered
                        served.append(out.logs["lr_search.served"])
                cost = tta.passes.since(counted), time.perf_counter() - clock
                after, _ = self._score_all(tta, modality, raw, gallery)
                info = {"updates": updates, "skipped_steps": skipped, "gradient_decoupling": bool(tta.config.gradient_decoupling)}
                if tta.config.safety is not None:  # how often the safety layer acted over the stream
                    info["safety"] = tta.safety_counts
                if isinstance(tta, RoutedTTAWrapper):
                    info["domains"] = tta.num_domains
                if getattr(tta, "lr_search", None) is not None:  # issue 37: the lr the probe chose, and its passes
                    search = tta.lr_search
                    info["lr_search"] = {"chosen": search.chosen, "lr": search.lr, "choices": search.choices, **search.cost}
                    if search.config.serve == "leader":  # the lr that answered each probe batch (0: the source)
                        info["lr_search"]["served"] = served
                    if search.config.online is not None:  # the online rule's trace: the lr at the end, its range
                        info["lr_search"].update(lr_min=search.trace["lr_min"], lr_max=search.trace["lr_max"],
                                                 lr_updates=search.trace["updates"])
            metrics = retrieval_metrics(scores, relevant, ks=(1, 5, 10))
            row.update({k: round(float(metrics[k]), 4) for k in ("R@1", "R@5", "R@10")})
            extra = getattr(self.task, "extra_metrics", None)  # a task's own columns (composed retrieval: REST's)
            if extra is not None:
                row.update({k: v for k, v in extra(cond, scores).items() if k not in row})
            row.update(info)
            forward, backward = cost[0].per_query(len(raw))
            row.update({"forward_per_query": round(forward, 4), "backward_per_query": round(backward, 4),
                        "stream_seconds": round(cost[1], 3)})
            g = gallery.single.float().cpu()
            row["uniformity_after"] = round(uniformity(after), 6)
            row["gap_after"] = round(modality_gap(after, g), 6)
            row["hits"] = "".join("1" if h else "0" for h in per_query_hits(scores, relevant).tolist())
            if job.objective == SOURCE:
                self._source_rows[(cond.key, seed)] = row
            src = self._source_rows.get((cond.key, seed))
            if src is not None:
                row["uniformity_before"] = src["uniformity_after"]
                row["gap_before"] = src["gap_after"]
        except Exception as err:  # one failing objective must not lose the rest of the grid
            row["error"] = f"{type(err).__name__}: {err}"
            logger.warning("%s on %s (seed %s) failed: %s", job.objective, cond.key, seed, row["error"].splitlines()[0])
            logger.debug("traceback of %s on %s", job.objective, cond.key, exc_info=True)
        row["seconds"] = round(time.time() - t0, 2)
        return row

    def remember(self, rows: Sequence[dict]) -> None:
        """Take the source rows of an earlier (interrupted) run, so resumed rows get their "before" diagnostics."""
        for r in rows:
            if r.get("objective") == SOURCE and "error" not in r:
                cond = Condition(r["direction"], r["shift"], r.get("severity"))
                self._source_rows[(cond.key, int(r.get("seed", 0)))] = r

    def run_all(self, jobs: Sequence[Job], desc: str = "hf-tta grid", on_row=None) -> list[dict[str, Any]]:
        """Run the jobs (per seed, source rows first); ``on_row(row)`` is called after each (e.g. to save progress)."""
        rows = []
        ordered = sorted(jobs, key=lambda j: (j.seed, j.objective != SOURCE))
        for job in tqdm(ordered, desc=desc, disable=not self.settings.show_progress):
            rows.append(self.run(job))
            if on_row is not None:
                on_row(rows[-1])
        return rows
