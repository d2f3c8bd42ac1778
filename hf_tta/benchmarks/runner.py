"""The benchmark runner behind ``hf-tta``: runs (condition, objective) jobs on a task and returns one row each.

Each run

* starts from the source model (one :class:`~hf_tta.TTAWrapper` per objective and direction, ``reset()`` before
  every run),
* streams the queries in a fixed random order (seeded) in batches of 64, adapting online (TCR's protocol),
* scores every query against the whole gallery, which the source model encodes once per gallery,
* reports R@1/5/10 and the paper's Fig. 1 diagnostics: query uniformity (Eq. 14) and query–gallery gap (Eq. 15)
  of the source model's query embeddings ("before") and of the adapted model's at the end of the stream ("after").

The source model's row ("source") is the same stream without adaptation. Grids are planned in
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
from tqdm.auto import tqdm

from .grid import GALLERY_MODALITY, QUERY_MODALITY, SOURCE, Condition, Job
from .tasks import Task, take_items

logger = logging.getLogger(__name__)


@dataclass
class RunSettings:
    steps: int = 3
    batch_size: int = 64
    seed: int = 0
    gallery_batch_size: int = 256
    lr: float | None = None
    objective_configs: dict[str, dict] = field(default_factory=dict)
    show_progress: bool = True
    cache_dir: str | None = None  # gallery embeddings are stored here and read back (delete it after changing model)


class GridRunner:
    """Runs jobs on a task: galleries and source query embeddings are computed once and shared."""

    def __init__(self, task: Task, settings: RunSettings | None = None):
        from ..models import get_adapter

        self.task = task
        self.settings = settings or RunSettings()
        self.pristine = task.model
        self.adapter = get_adapter(self.pristine)  # never wrapped: every TTAWrapper gets its own deep copy
        self._adapters: dict[str, Any] = {}
        self._galleries: dict[str, torch.Tensor] = {}
        self._wrappers: dict[tuple[str, str], Any] = {}
        self._source_rows: dict[str, dict] = {}

    def adapter_for(self, direction: str):
        """The (never wrapped) adapter that embeds both modalities of a direction, e.g. CLIP's video adapter."""
        from ..models import get_adapter

        if direction not in self._adapters:
            self._adapters[direction] = get_adapter(self.pristine, (QUERY_MODALITY[direction], GALLERY_MODALITY[direction]))
        return self._adapters[direction]

    # ---------------------------------------------------------------- embeddings
    @torch.no_grad()
    def _embed(self, adapter, modality: str, items: Sequence, batch_size: int) -> torch.Tensor:
        out = []
        for start in range(0, len(items), batch_size):
            chunk = items[start : start + batch_size]
            out.append(adapter.embed(modality, self.task.to_inputs(modality, chunk)))
        return torch.cat(out)

    def gallery(self, cond: Condition) -> torch.Tensor:
        key = self.task.gallery_key(cond)
        if key not in self._galleries:
            path = None
            if self.settings.cache_dir is not None:
                from pathlib import Path

                n = len(getattr(self.task, "bench", ())) or "hub"
                path = Path(self.settings.cache_dir) / f"gallery-{self.task.name}-{n}-{key}.pt"
            if path is not None and path.exists():
                self._galleries[key] = torch.load(path, map_location=self.task.device)
            else:
                items = self.task.gallery_items(cond)
                self._galleries[key] = self._embed(
                    self.adapter_for(cond.direction), GALLERY_MODALITY[cond.direction], items, self.settings.gallery_batch_size
                )
                if path is not None:
                    path.parent.mkdir(parents=True, exist_ok=True)
                    torch.save(self._galleries[key].cpu(), path)
        return self._galleries[key]

    def _wrapper(self, objective: str, direction: str):
        from ..config import TTAConfig
        from ..wrapper import TTAWrapper

        key = (objective, direction)
        if key not in self._wrappers:
            s = self.settings
            cfg = TTAConfig(
                objective=objective,
                objective_config=dict(s.objective_configs.get(objective, {})),
                query_modality=QUERY_MODALITY[direction],
                gallery_modality=GALLERY_MODALITY[direction],
                steps=s.steps,
                lr=s.lr,
                seed=s.seed,
            )
            self._wrappers[key] = TTAWrapper(copy.deepcopy(self.pristine), cfg)
        return self._wrappers[key]

    def order(self, n: int) -> list[int]:
        """The fixed random order of the query stream."""
        return torch.randperm(n, generator=torch.Generator().manual_seed(self.settings.seed)).tolist()

    # ---------------------------------------------------------------- one job
    def run(self, job: Job) -> dict[str, Any]:
        from ..metrics import modality_gap, retrieval_metrics, uniformity

        cond, s = job.condition, self.settings
        raw, relevant = self.task.queries(cond)
        gallery = self.gallery(cond)
        modality = cond.query_modality
        t0 = time.time()
        row: dict[str, Any] = {
            "direction": cond.direction,
            "shift": cond.shift,
            "severity": cond.severity,
            "objective": job.objective,
            "num_queries": len(raw),
            "gallery_size": int(gallery.shape[0]),
        }
        try:
            if job.objective == SOURCE:
                emb = self._embed(self.adapter_for(cond.direction), modality, raw, s.gallery_batch_size)
                scores = emb @ gallery.T
                after = emb
                info = {}
            else:
                if cond.key not in self._source_rows:  # the "before" diagnostics (cheap: no adaptation)
                    self.run(Job(cond, SOURCE))
                tta = self._wrapper(job.objective, cond.direction)
                tta.reset()
                order = self.order(len(raw))
                scores = torch.empty(len(raw), gallery.shape[0])
                updates, skipped = 0, 0
                batches = range(0, len(order), s.batch_size)
                bar = tqdm(batches, desc=f"{job.objective} {cond.key}", leave=False, disable=not s.show_progress)
                for start in bar:
                    idx = order[start : start + s.batch_size]
                    out = tta.adapt_step(self.task.to_inputs(modality, take_items(raw, idx)), gallery)
                    scores[idx] = out.scores.float().cpu()
                    updates += out.num_updates
                    skipped += len(out.skipped)
                after = self._embed(tta.adapter, modality, raw, s.gallery_batch_size)
                info = {"updates": updates, "skipped_steps": skipped}
            metrics = retrieval_metrics(scores.float().cpu(), relevant, ks=(1, 5, 10))
            row.update({k: round(float(metrics[k]), 4) for k in ("R@1", "R@5", "R@10")})
            row.update(info)
            g = gallery.float().cpu()
            row["uniformity_after"] = round(uniformity(after.float().cpu()), 6)
            row["gap_after"] = round(modality_gap(after.float().cpu(), g), 6)
            if job.objective == SOURCE:
                self._source_rows[cond.key] = row
            src = self._source_rows.get(cond.key)
            if src is not None:
                row["uniformity_before"] = src["uniformity_after"]
                row["gap_before"] = src["gap_after"]
        except Exception as err:  # one failing objective must not lose the rest of the grid
            logger.exception("%s on %s failed", job.objective, cond.key)
            row["error"] = f"{type(err).__name__}: {err}"
        row["seconds"] = round(time.time() - t0, 2)
        return row

    def run_all(self, jobs: Sequence[Job], desc: str = "hf-tta grid", on_row=None) -> list[dict[str, Any]]:
        """Run the jobs (source rows first); ``on_row(row)`` is called after each (e.g. to save progress)."""
        rows = []
        ordered = sorted(jobs, key=lambda j: j.objective != SOURCE)
        for job in tqdm(ordered, desc=desc, disable=not self.settings.show_progress):
            rows.append(self.run(job))
            if on_row is not None:
                on_row(rows[-1])
        return rows
