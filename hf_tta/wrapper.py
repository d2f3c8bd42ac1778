"""``TTAWrapper``: the online loop (embed, objective, backward, optimiser), state, reset and save/load."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import re
import warnings
from typing import Any, Callable, Iterable, Iterator, Mapping

import torch
from peft import LNTuningConfig, PeftModel, get_peft_model
from peft.tuners.tuners_utils import BaseTunerLayer
from torch import nn
from tqdm.auto import tqdm

from . import checkpoint
from .config import TTAConfig
from .fast_step import adapt_deferred
from .gallery.base import GalleryBackend, TopKScores
from .gallery.cache import GalleryCache
from .gallery.candidates import candidate_items, candidate_topk, check_gallery_access
from .gradient_decoupling import apply_gradient_decoupling, scaled_step_size
from .metrics.recall import relevance_to_index
from .models.base import ModelAdapter, get_adapter, match_module_names
from .objectives.base import LossOutput, Objective, ObjectiveInputs, build_objective
from .outputs import TTAOutput, float_logs
from .safety import SafetyMonitor
from .version import __version__

logger = logging.getLogger(__name__)

STATE_FILE = checkpoint.STATE_FILE
_AUTOCAST = {"bf16": torch.bfloat16, "fp16": torch.float16}


class TTAWrapper:
    """Test-time adaptation of a Hugging Face dual encoder for retrieval under query shift.

    The query tower's selected parameters (by default its LayerNorm affine parameters) are adapted online with
    the chosen objective; the gallery tower and the cached gallery embeddings never change. Parameter selection,
    exact recovery of the source model and the adapted copies use PEFT's LN-tuning mechanism: note that, as with
    ``peft.get_peft_model``, the model passed in is modified in place (its target layers are wrapped).

    Args:
        model (`nn.Module` or `ModelAdapter`): a supported Hugging Face model (``CLIPModel``, ``SiglipModel``,
            ``BlipForImageTextRetrieval``, ``Blip2ForImageTextRetrieval``, ``VisionTextDualEncoderModel``), or a
            :class:`~hf_tta.DualEncoderAdapter` around a custom dual encoder.
        config (`TTAConfig`, *optional*): objective, query modality, steps, optimiser and parameter selection.

    Example:
        >>> tta = TTAWrapper(model, TTAConfig(objective="tcr", query_modality="image"))  # doctest: +SKIP
        >>> gallery = tta.encode_gallery(text_inputs)  # doctest: +SKIP
        >>> out = tta.adapt_step({"pixel_values": pixels}, gallery)  # doctest: +SKIP
        >>> out.scores.topk(10).indices  # doctest: +SKIP
    """

    def __init__(self, model: nn.Module | ModelAdapter, config: TTAConfig | None = None):
        self.config = config if config is not None else TTAConfig()
        if isinstance(model, PeftModel):
            raise ValueError("Pass the base model, not a PeftModel: TTAWrapper applies its own PEFT LN-tuning adapter.")
        self.adapter = get_adapter(model, modalities=(self.config.query_modality, self.config.gallery_modality))
        self.model = self.adapter.model
        cfg = self.config
        self.adapter.check_modality(cfg.query_modality)
        self.query_modality = cfg.query_modality
        self.gallery_modality = cfg.gallery_modality or self._other_modality()
        self.adapter.check_modality(self.gallery_modality)
        self.objective = build_objective(cfg.objective, cfg.build_objective_config())
        self._closure_fault: str | None = None  # set by a SAM closure whose pass diverged (see _closure)
        self._tensor_gallery: tuple | None = None  # (tensor, its version, its GalleryCache): a raw gallery, wrapped once
        # a training-free objective applied to the output scores of any objective (e.g. Distribution Normalization)
        self.score_transform = (
            build_objective(cfg.score_transform, cfg.build_score_transform_config()) if cfg.score_transform else None
        )
        self.model.eval()  # dropout off; TTA toggles requires_grad only (LayerNorm has no train-mode behaviour)

        self.peft_model: PeftModel | None = None
        self.params: dict[str, nn.Parameter] = {}
        self.target_modules: list[str] = []
        if self.objective.requires_grad:
            if any(isinstance(m, BaseTunerLayer) for m in self.model.modules()):
                raise ValueError(
                    "This model already carries PEFT adapter layers (does another TTAWrapper wrap it?): pass a fresh "
                    "source model, or load a checkpoint into the existing wrapper with its load_state(path)."
                )
            self.target_modules = self._resolve_targets()
            pattern = "^(" + "|".join(re.escape(n) for n in self.target_modules) + ")$"
            with warnings.catch_warnings():  # PEFT warns "Unsupported layer type LayerNorm": LN tuning is what we want
                warnings.filterwarnings("ignore", message="Unsupported layer type")
                # transformers 5 deprecates the attribute PEFT reads; the message is for PEFT, not for our users
                warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing", category=FutureWarning)
                self.peft_model = get_peft_model(self.model, LNTuningConfig(target_modules=pattern))
            self.model.eval()
            self.params = {n: p for n, p in self.model.named_parameters() if p.requires_grad}
            self._source = {n: p.detach().clone() for n, p in self.params.items()}
            self.lr = cfg.lr if cfg.lr is not None else self.adapter.default_lr[self.query_modality]
            logger.info("hf_tta adapts %d tensors in %d modules", len(self.params), len(self.target_modules))
        # TTAConfig.fast_step: one host sync per adapt_step (fused AdamW skips bad steps on the device)
        self.fast_step = cfg.fast_step if cfg.fast_step is not None else self.device.type == "cuda"
        self.optimizer = self._make_optimizer()
        self.generator = torch.Generator().manual_seed(cfg.seed)
        self._batch_labels: torch.Tensor | None = None  # the current adapt_step's labels (supervised objectives only)
        self.state = self.objective.init_state(self.device)
        self.transform_state = self.score_transform.init_state(self.device) if self.score_transform else {}
        self.batch_index = 0
        self.safety = SafetyMonitor(cfg.build_safety_config()) if cfg.safety is not None else None

    # ------------------------------------------------------------------------------------------ setup
    def _other_modality(self) -> str:
        others = [m for m in self.adapter.modalities if m != self.config.query_modality]
        if len(others) != 1:
            raise ValueError(f"Set `gallery_modality`: the model embeds {list(self.adapter.modalities)}.")
        return others[0]

    def _resolve_targets(self) -> list[str]:
        cfg, m = self.config, self.model
        if cfg.target_modules is None:
            names = self.adapter.norm_layer_names(self.query_modality)
        else:
            names = match_module_names(m, cfg.target_modules)
        if cfg.exclude_modules:
            roots = match_module_names(m, cfg.exclude_modules)
            names = [n for n in names if not any(n == r or n.startswith(r + ".") for r in roots)]
        if not names:
            raise ValueError(
                f"No module to adapt for query modality {self.query_modality!r} "
                f"(target_modules={cfg.target_modules!r}, exclude_modules={cfg.exclude_modules!r})."
            )
        gallery_only = [n for n in names if self.query_modality not in self.adapter.tower_of(n)]
        if gallery_only:
            raise ValueError(
                f"target_modules selects modules outside the {self.query_modality} (query) tower: {gallery_only[:3]}"
                f"{'...' if len(gallery_only) > 3 else ''}. The gallery tower is never adapted."
            )
        return names

    def _make_optimizer(self) -> torch.optim.Optimizer | None:
        if not self.params:
            return None
        opt = self.objective.make_optimizer(list(self.params.values()), self.lr, self.config.weight_decay)
        if self.fast_step and type(opt) is torch.optim.AdamW and len(opt.param_groups) == 1 and not opt.defaults["fused"]:
            # the same update in one fused kernel, which can also skip a step on the device (``found_inf``)
            group = opt.param_groups[0]
            hyper = {k: group[k] for k in ("lr", "betas", "eps", "weight_decay", "amsgrad", "maximize")}
            with contextlib.suppress(RuntimeError):  # a device without a fused kernel keeps the default AdamW
                opt = torch.optim.AdamW(group["params"], **hyper, fused=True)
        return opt

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def disabled(self) -> contextlib.AbstractContextManager:
        """Context in which the model computes exactly as the source model (adapters off)."""
        return self.peft_model.disable_adapter() if self.peft_model is not None else contextlib.nullcontext()

    def _autocast(self) -> contextlib.AbstractContextManager:
        if self.config.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=_AUTOCAST[self.config.autocast_dtype])

    # ------------------------------------------------------------------------------------------ gallery
    @torch.no_grad()
    def encode_gallery(
        self,
        inputs: Mapping[str, torch.Tensor] | Iterable[Mapping[str, torch.Tensor]],
        batch_size: int | None = None,
        show_progress: bool | None = None,
    ) -> GalleryCache:
        """Encode the gallery once with the source model, in chunks, without grad.

        Args:
            inputs: a dict of tensors with one row per gallery item (e.g. a tokenizer's output), or an iterable
                of such dicts (e.g. a DataLoader over a large gallery).
            batch_size: chunk size for a dict input (default ``config.gallery_batch_size``).
        """
        if isinstance(inputs, Mapping):
            chunks = list(self._chunk(inputs, batch_size or self.config.gallery_batch_size))
        else:
            chunks = inputs
        embs = []
        total = len(chunks) if hasattr(chunks, "__len__") else None
        show = show_progress if show_progress is not None else (total is None or total > 4)
        with self.disabled():
            for chunk in tqdm(chunks, total=total, desc=f"Encoding {self.gallery_modality} gallery", disable=not show):
                chunk = self._check_inputs(chunk, self.gallery_modality)
                embs.append(self.adapter.encode(self.gallery_modality, chunk))
        if not embs:
            raise ValueError("The gallery is empty.")
        return GalleryCache(torch.cat(embs), self.gallery_modality)

    @staticmethod
    def _chunk(inputs: Mapping[str, torch.Tensor], size: int) -> Iterator[dict[str, torch.Tensor]]:
        n = _batch_size(inputs)
        for start in range(0, n, size):
            yield {k: v[start : start + size] if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}

    # ------------------------------------------------------------------------------------------ checks
    def _check_inputs(self, inputs: Mapping[str, Any], modality: str) -> dict[str, torch.Tensor]:
        """One batch checked at the boundary, before anything runs: keys, dtypes, layouts, sizes and vocabulary by the
        adapter's input specs (floating-point features cast once to the model's dtype), then batch size, device and
        finiteness. Returns a new dict (the caller's is never modified), selected once for every embed of the batch."""
        selected = self.adapter.check_inputs(modality, inputs)
        n = _batch_size(selected)
        if n == 0:
            raise ValueError(f"Empty {modality} batch: give at least one item (a query batch, or a gallery chunk).")
        device = self.device
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

    def _check_gallery(self, gallery: GalleryCache | GalleryBackend | torch.Tensor) -> GalleryCache | GalleryBackend:
        """A dense gallery, or a top-k backend (objectives see the batch's candidates, see ``hf_tta.gallery.base``)."""
        if isinstance(gallery, torch.Tensor):
            held = self._tensor_gallery
            if held is not None and held[0] is gallery and held[1] == gallery._version:
                gallery = held[2]  # the same, unmodified tensor as the last batch: wrapped (and NaN-checked) once
            else:
                tensor, dtype = gallery, next(self.model.parameters()).dtype
                if tensor.is_floating_point() and tensor.dtype != dtype:
                    gallery = gallery.to(dtype)  # like the queries' features: cast once to the model's dtype
                gallery = GalleryCache(gallery, self.gallery_modality)
                self._tensor_gallery = (tensor, tensor._version, gallery)
        if not isinstance(gallery, (GalleryCache, GalleryBackend)):
            raise TypeError(
                f"gallery must be a GalleryCache (from encode_gallery), a top-k GalleryBackend (hf_tta.gallery) or a tensor, "
                f"got {type(gallery).__name__}."
            )
        if gallery.modality != self.gallery_modality:
            raise ValueError(
                f"The gallery holds {gallery.modality} embeddings but this wrapper retrieves {self.gallery_modality} "
                f"items for {self.query_modality} queries."
            )
        if isinstance(gallery, GalleryBackend):
            check_gallery_access(gallery, {"objective": self.objective, "score_transform": self.score_transform})
            return gallery
        if len(gallery) == 0:
            raise ValueError("The gallery is empty.")
        if gallery.embeddings.device != self.device:
            raise ValueError(f"The gallery is on {gallery.embeddings.device} but the model is on {self.device}: use gallery.to(...).")
        return gallery

    def _candidate_view(self, q: torch.Tensor, gallery: GalleryBackend, step: int) -> tuple[torch.Tensor, GalleryCache]:
        """The batch's candidates (:func:`~hf_tta.gallery.candidates.candidate_items`) as a small dense gallery that
        the queries are scored against exactly (so gradients flow as with the dense gallery); the score transform
        (DN's shifted queries) searches too on the reported step."""
        searchers = [(self.objective, self.state)]
        if self.score_transform is not None and (step >= self.config.steps - 1 or not self.objective.requires_grad):
            searchers.append((self.score_transform, self.transform_state))
        ids, emb = candidate_items(q, gallery, self.objective, searchers, self.config.seed)
        return ids, GalleryCache(emb, gallery.modality)

    def _topk_output(self, out: TTAOutput, gallery: GalleryBackend) -> TTAOutput:
        """Replace the candidate scores ``(B, |C|)`` of the reported step by each query's top-k over the gallery."""
        return dataclasses.replace(out, scores=None, topk=candidate_topk(out.scores, self._candidate_ids, gallery.k))

    # ------------------------------------------------------------------------------------------ the online step
    def _embed_queries(self, queries: dict) -> torch.Tensor:
        """The query embeddings with grad (``DistributedTTAWrapper`` embeds its shard and all-gathers them)."""
        with self._autocast():
            return self.adapter.encode(self.query_modality, queries)

    def _embed_and_score(self, queries: dict, gallery: GalleryCache) -> tuple[torch.Tensor, torch.Tensor]:
        return self._score(self._embed_queries(queries), gallery)

    def _score(self, q: torch.Tensor, gallery: GalleryCache) -> tuple[torch.Tensor, torch.Tensor]:
        if q.shape[-1] != gallery.dim:
            raise ValueError(
                f"Query embeddings have dimension {q.shape[-1]} but the gallery has {gallery.dim}: "
                "was the gallery encoded by another model?"
            )
        scores = self.adapter.score(q, gallery.embeddings)
        return self.adapter.single_vector(q, scores, gallery.single), scores

    def _inputs(
        self, queries: dict, gallery: GalleryCache | GalleryBackend, step: int, source_cache: list[torch.Tensor] | None = None,
        record: bool = True,
    ) -> ObjectiveInputs:
        backend = ids = None
        if isinstance(gallery, GalleryBackend):  # objectives see the batch's candidates, re-scored exactly
            q_raw = self._embed_queries(queries)
            backend = gallery
            ids, gallery = self._candidate_view(q_raw, gallery, step)
            if record:  # the columns of the scores this step reports (the SAM closure's pass does not report)
                self._candidate_ids = ids
            q, scores = self._score(q_raw, gallery)
            source_cache = []  # the candidates change with every step: source scores are per step
        else:
            q, scores = self._embed_and_score(queries, gallery)
        # the source model's scores do not change within a batch: pass one cache per adapt_step to compute them once
        source_cache = [] if source_cache is None else source_cache

        def source_scores() -> torch.Tensor:
            if not source_cache:
                with torch.no_grad(), self.disabled():
                    source_cache.append(self._embed_and_score(queries, gallery)[1])
            return source_cache[0]

        def reencode(transform: Callable[[dict], dict]) -> tuple[torch.Tensor, torch.Tensor]:
            return self._embed_and_score(transform(dict(queries)), gallery)

        return ObjectiveInputs(
            query_emb=q,
            gallery_emb=gallery.single,
            scores=scores,
            step=step,
            batch_index=self.batch_index,
            generator=self.generator,
            reencode=reencode,
            source_scores=source_scores,
            query_modality=self.query_modality,
            queries=queries,
            params=self.params or None,
            source_params=self._source if self.params else None,
            labels=self._batch_labels,
            candidate_ids=ids,
            backend=backend,
        )

    @torch.no_grad()
    def embed_and_score(
        self, queries: Mapping[str, torch.Tensor], gallery: GalleryCache | torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Score a batch with the current model, without adapting (the source model inside ``disabled()``).

        Returns the single-vector query embeddings ``(B, D)`` (see ``ModelAdapter.single_vector``) and the scores
        ``(B, N)`` from the adapter's ``score`` (a max over vectors for multi-vector models); no score transform."""
        gallery = self._check_gallery(gallery)
        if isinstance(gallery, GalleryBackend):
            raise TypeError(f"embed_and_score needs the dense GalleryCache; {type(gallery).__name__} answers gallery.search(...).")
        queries = self._check_inputs(queries, self.query_modality)
        return self._embed_and_score(queries, gallery)

    def _label_mask(self, labels: Any, batch: int, gallery: GalleryCache) -> torch.Tensor | None:
        if labels is None:
            if self.objective.requires_labels:
                raise ValueError(
                    f"Objective {self.config.objective!r} is supervised: pass adapt_step(queries, gallery, labels=...) "
                    "(a (B, N) bool mask or each query's list of relevant gallery indices)."
                )
            return None
        if not self.objective.requires_labels:
            raise ValueError(f"Objective {self.config.objective!r} adapts without labels: drop labels=... from adapt_step.")
        if isinstance(labels, torch.Tensor) and labels.dtype == torch.bool and labels.dim() == 2:
            if labels.shape != (batch, len(gallery)):
                raise ValueError(f"labels must have shape (queries, gallery) = {(batch, len(gallery))}; got {tuple(labels.shape)}.")
            return labels.to(device=self.device, dtype=torch.bool)
        idx = relevance_to_index(labels, batch, device=self.device)
        if (idx >= len(gallery)).any():
            raise ValueError(f"A label is >= the gallery size {len(gallery)}.")
        mask = torch.zeros(batch, len(gallery) + 1, dtype=torch.bool, device=self.device)
        mask.scatter_(1, torch.where(idx >= 0, idx, len(gallery)), True)  # padding (-1) goes to a dropped column
        return mask[:, :-1]

    def adapt_step(
        self, queries: Mapping[str, torch.Tensor], gallery: GalleryCache | GalleryBackend | torch.Tensor, labels: Any = None
    ) -> TTAOutput:
        """Adapt on one batch of queries and return their scores against the whole gallery.

        Runs ``config.steps`` steps of: embed the queries, compute the objective, update the adapted parameters.
        A step with nothing selected, or with a non-finite loss or gradient, updates nothing and is listed in
        ``TTAOutput.skipped``. ``labels`` (each query's relevant gallery items: a ``(B, N)`` bool mask or a list of
        index lists) is for supervised objectives only (``oracle``, the benchmark's ceilings) and refused otherwise.
        """
        if torch.is_inference_mode_enabled():
            raise RuntimeError(
                "adapt_step was called under torch.inference_mode(), which no enable_grad() can undo: "
                "call it outside inference_mode (torch.no_grad() is fine)."
            )
        gallery = self._check_gallery(gallery)
        queries = self._check_inputs(queries, self.query_modality)
        if isinstance(gallery, GalleryBackend) and labels is not None:
            raise ValueError("labels need the dense GalleryCache: a top-k backend shows objectives only candidate items.")
        self._batch_labels = self._label_mask(labels, _batch_size(queries), gallery)
        try:
            # the safety layer first: a degenerate batch gets the source's scores (training-free objectives: its only rule)
            out = self.safety.begin(self, queries, gallery) if self.safety is not None else None
            if out is None and not self.objective.requires_grad:
                out = self._score_only(queries, gallery)
            elif out is None:
                with torch.enable_grad():
                    out = self._adapt(queries, gallery)
            if self.safety is not None:
                out = self.safety.finish(out)
        finally:
            self._batch_labels = None
        if isinstance(gallery, GalleryBackend):
            out = self._topk_output(out, gallery)
        self.batch_index += 1
        if self.config.reset_policy == "episodic":
            self.reset()
        return out

    def _score_only(self, queries: dict, gallery: GalleryCache) -> TTAOutput:
        with torch.no_grad():
            # nothing is adapted, so the safety layer's source forward of this batch is this forward (dense gallery)
            shared = self.safety.source_inputs() if self.safety is not None else None
            inputs = dataclasses.replace(shared, step=0) if shared is not None else self._inputs(queries, gallery, step=0)
            res = self.objective(inputs, self.state)
        scores = self._transform_scores(inputs, res.scores if res.scores is not None else inputs.scores)
        return TTAOutput(scores=scores.detach(), loss=None, num_updates=0, n_selected=res.n_selected, logs=float_logs(res.logs))

    def _adapt(self, queries: dict, gallery: GalleryCache) -> TTAOutput:
        if self._deferred_checks_apply():
            out = self._adapt_deferred(queries, gallery)
            if out is not None:
                return out
        return self._adapt_checked(queries, gallery)

    def _deferred_checks_apply(self) -> bool:
        """``config.fast_step`` holds for this optimiser and objective: a fused AdamW (its ``found_inf`` skips a step on
        the device), no closure (SAM), no gradient decoupling and no ``on_step_end`` hook (SAR's recovery)."""
        opt = self.optimizer
        return bool(
            self.fast_step
            and opt is not None
            and all(g.get("fused") for g in opt.param_groups)
            and not getattr(opt, "requires_closure", False)
            and not self.config.gradient_decoupling
            and type(self.objective).on_step_end is Objective.on_step_end
        )

    def _adapt_deferred(self, queries: dict, gallery: GalleryCache) -> TTAOutput | None:
        """The checked loop with one host sync per batch (:func:`hf_tta.fast_step.adapt_deferred`)."""
        return adapt_deferred(self, queries, gallery)

    def named_optimized_parameters(self) -> list[tuple[str, torch.Tensor]]:
        """The adapted parameters by name, then any other tensor the optimiser steps (ClipTTA's open-set threshold
        alpha), named ``optimizer.extra.<i>``: what a rollback must restore, with its optimiser state."""
        named = list(self.params.items())
        if self.optimizer is not None:
            seen = {id(p) for _, p in named}
            extra = [p for g in self.optimizer.param_groups for p in g["params"] if id(p) not in seen]
            named += [(f"optimizer.extra.{i}", p) for i, p in enumerate(extra)]
        return named

    def _snapshot(self) -> tuple:
        """Adapted parameters (and other optimised tensors), optimiser moments and steps (copied on the device in one
        foreach call), the objective's state and the RNG state, for :meth:`_restore`."""
        opt_state = self.optimizer.state
        params = [p for _, p in self.named_optimized_parameters()]
        had_state = [p in opt_state and bool(opt_state[p]) for p in params]
        tensors = params + [t for p in params if p in opt_state for t in opt_state[p].values() if torch.is_tensor(t)]
        with torch.no_grad():
            copies = torch._foreach_mul(tensors, 1.0) if tensors else []  # x * 1 is exact (also -0.0 and NaN)
        return tensors, copies, params, had_state, dict(self.state), self.generator.get_state()

    @torch.no_grad()
    def _restore(self, snapshot: tuple) -> None:
        tensors, copies, params, had_state, state, rng = snapshot
        if tensors:
            torch._foreach_copy_(tensors, copies)
        for p, had in zip(params, had_state):
            if not had:
                self.optimizer.state.pop(p, None)  # moments created after the snapshot
        self.state.clear()
        self.state.update(state)
        self.generator.set_state(rng)

    def _adapt_checked(self, queries: dict, gallery: GalleryCache) -> TTAOutput:
        """The loop with the skip rule checked on the host at every step."""
        skipped: list[str] = []
        updates, last_loss, res, scores = 0, None, None, None
        source_cache: list[torch.Tensor] = self.safety.source_cache() if self.safety is not None else []
        for step in range(self.config.steps):
            inputs = self._inputs(queries, gallery, step, source_cache)
            previous_state = dict(self.state)  # objectives replace state tensors, never write them in place
            res = self.objective(inputs, self.state)
            scores = (res.scores if res.scores is not None else inputs.scores).detach()
            last_loss = None if res.loss is None else float(res.loss.detach())
            reason = self._skip_reason(res)
            if reason is None:
                self.optimizer.zero_grad(set_to_none=True)
                res.logs.update(self._backward(res, inputs))
                if not _grads_finite(self.params.values()):
                    reason = "non-finite gradient"
            if reason is not None:
                self.optimizer.zero_grad(set_to_none=True)
                if reason.startswith("non-finite"):  # nothing computed from a diverged step is kept
                    self.state.clear()
                    self.state.update(previous_state)
                skipped.append(f"step {step}: {reason}")
                continue
            closure, snapshot = None, None
            if getattr(self.optimizer, "requires_closure", False):  # SAM: a second pass inside the step
                closure, snapshot, self._closure_fault = self._closure(queries, gallery, step, source_cache), self._snapshot(), None
            with scaled_step_size(self.optimizer, self._gd_step_factor(res)):  # GD's W_d on the step size
                self.optimizer.step(closure)
            self.optimizer.zero_grad(set_to_none=True)
            if snapshot is not None and self._closure_fault is not None:  # the second pass diverged: undo the step
                self._restore(snapshot)
                skipped.append(f"step {step}: {self._closure_fault} in the second (SAM) pass")
                continue
            updates += 1
            if self.objective.on_step_end(inputs, res, self.state):
                self._restore_parameters()
        if skipped:
            logger.info("adapt_step skipped %s", "; ".join(skipped))
        scores = self._final_scores(queries, gallery, inputs, scores)
        return TTAOutput(
            scores=scores, loss=last_loss, num_updates=updates, n_selected=int(res.n_selected), skipped=skipped,
            logs=float_logs(res.logs),
        )

    def _backward(self, res: LossOutput, inputs: ObjectiveInputs) -> dict[str, torch.Tensor]:
        """``loss.backward()``, then REST's gradient decoupling when configured (see ``hf_tta.gradient_decoupling``)."""
        if not self.config.gradient_decoupling:
            res.loss.backward()
            return {}
        res.loss.backward(retain_graph=True)  # G_r = grad KL(p_S || p) is taken through the same graph
        return apply_gradient_decoupling(
            res, self.params, inputs.source_scores, self.config.gd_per_tensor, self.config.objective,
            weight_on=self.config.gd_weight_on,
        )

    def _gd_step_factor(self, res: LossOutput) -> torch.Tensor | None:
        """Gradient decoupling's ``W_d`` when it scales the step size (``gd_weight_on="step_size"``), else ``None``."""
        if self.config.gradient_decoupling and self.config.gd_weight_on == "step_size":
            return res.logs.get("gd_weight")
        return None

    def _final_scores(self, queries: dict, gallery, inputs: ObjectiveInputs, scores: torch.Tensor) -> torch.Tensor:
        """The scores to report: the last step's forward (TCR's protocol), or for an objective with
        ``score_after_update`` (ClipTTA's own protocol) a fresh forward after the last update; then the score transform."""
        if getattr(self.objective, "score_after_update", False):
            with torch.no_grad():
                inputs = self._inputs(queries, gallery, self.config.steps)
            scores = inputs.scores.detach()
        if self.safety is not None:  # judged before the transform: a flagged batch returns the source model's scores
            inputs, scores = self.safety.judge(self, inputs, scores)
        return self._transform_scores(inputs, scores)

    def _transform_scores(self, inputs: ObjectiveInputs, scores: torch.Tensor, update_state: bool = True) -> torch.Tensor:
        """Apply ``config.score_transform`` (a training-free objective, e.g. DN) to the output scores; with
        ``update_state=False`` on a copy of its state, so the batch leaves no trace (e.g. in DN's query mean)."""
        if self.score_transform is None:
            return scores
        state = self.transform_state if update_state else {k: v.clone() for k, v in self.transform_state.items()}
        with torch.no_grad():
            view = dataclasses.replace(inputs, query_emb=inputs.query_emb.detach(), scores=scores.detach())
            res = self.score_transform(view, state)
        return (res.scores if res.scores is not None else scores).detach()

    @staticmethod
    def _skip_reason(res: LossOutput) -> str | None:
        if res.n_selected == 0:
            return "no query selected"
        if res.loss is None or not torch.isfinite(res.loss.detach()).all():
            return "non-finite loss"
        if not res.loss.requires_grad:
            return "loss does not depend on the adapted parameters"
        return None

    def _closure(
        self, queries: dict, gallery: GalleryCache, step: int, source_cache: list[torch.Tensor] | None = None
    ) -> Callable[[], torch.Tensor]:
        """Re-evaluates the loss at the optimiser's current point (for SAM-style optimisers); the batch's source
        scores (``source_cache``) are reused, not recomputed."""

        def closure() -> torch.Tensor:
            self.optimizer.zero_grad(set_to_none=True)
            inputs = dataclasses.replace(self._inputs(queries, gallery, step, source_cache, record=False), in_closure=True)
            res = self.objective(inputs, dict(self.state))
            loss = res.loss if res.loss is not None and res.n_selected > 0 else None
            if loss is None:  # nothing selected: SAR's code still takes its zero-gradient base step
                return torch.tensor(float("nan"))
            if not torch.isfinite(loss.detach()):
                self._closure_fault = "non-finite loss"  # the caller restores the step's snapshot
                return torch.tensor(float("nan"))
            self._backward(res, inputs)
            if not _grads_finite(self.params.values()):
                self._closure_fault = "non-finite gradient"
            return loss.detach()

        return closure

    def adapt_stream(
        self, batches: Iterable[Mapping[str, torch.Tensor]], gallery: GalleryCache | GalleryBackend, show_progress: bool = True
    ) -> torch.Tensor | TopKScores:
        """Adapt on every batch of a stream; return the concatenated ``(num_queries, N)`` score matrix (the concatenated
        :class:`~hf_tta.gallery.TopKScores` with a top-k gallery backend)."""
        rows = []
        total = len(batches) if hasattr(batches, "__len__") else None
        for batch in tqdm(batches, total=total, desc=f"TTA ({self.config.objective})", disable=not show_progress):
            out = self.adapt_step(batch, gallery)
            rows.append(out.topk if out.scores is None else out.scores)
        return TopKScores.cat(rows) if isinstance(rows[0], TopKScores) else torch.cat(rows)

    # ------------------------------------------------------------------------------------------ state
    @torch.no_grad()
    def _restore_parameters(self) -> None:
        for name, p in self.params.items():
            p.copy_(self._source[name])
        self.optimizer = self._make_optimizer()

    def reset(self) -> None:
        """Return exactly to the source model: adapted parameters, optimiser, objective state, counters and RNG."""
        self._restore_parameters()
        self.state = self.objective.init_state(self.device)
        self.transform_state = self.score_transform.init_state(self.device) if self.score_transform else {}
        self.batch_index = 0
        self.generator.manual_seed(self.config.seed)
        if self.safety is not None:
            self.safety.clear()

    @property
    def safety_counts(self) -> dict[str, int]:
        """How often the safety layer skipped, rolled back and reset since the last :meth:`reset` (empty when off)."""
        return dict(self.safety.counts) if self.safety is not None else {}

    def resolved_config(self) -> TTAConfig:
        """The config with every default written out (objective hyper-parameters, learning rate, gallery modality):
        what ``tta_config.json`` records, so that a checkpoint keeps its meaning when a default changes."""
        return self.config.resolved(lr=getattr(self, "lr", self.config.lr), gallery_modality=self.gallery_modality)

    def fingerprint(self) -> dict[str, Any]:
        """The source model this wrapper adapts: class, config hash, adapted parameter names and shapes."""
        return checkpoint.model_fingerprint(self.model, self.params, getattr(self, "_source", None))

    def save_pretrained(self, save_directory: str | os.PathLike) -> None:
        """Write the checkpoint folder, atomically (written beside it, then renamed into place; see
        :mod:`hf_tta.checkpoint`): ``tta_config.json`` (the full resolved config) and ``tta_state.safetensors``
        (adapted parameters, optimiser and objective state, batch counter, RNG state, the config again and the model
        fingerprint), so that a resumed stream continues exactly where it stopped."""
        tensors, state_meta = checkpoint.state_tensors(
            self.params, self.optimizer.state_dict() if self.optimizer is not None else None, self.state,
            self.transform_state, self.batch_index, self.generator, self.safety,
        )
        meta: dict[str, Any] = {"param_names": list(self.params), "fingerprint": self.fingerprint(), "hf_tta_version": __version__}
        meta.update(state_meta)
        tensors = {k: v.detach().cpu().contiguous() for k, v in tensors.items()}
        config = {**self.resolved_config().to_dict(), "hf_tta_version": __version__}
        checkpoint.write_checkpoint(save_directory, config, tensors, meta)

    def load_state(self, directory: str | os.PathLike) -> None:
        """Load what :meth:`save_pretrained` wrote into this wrapper (same source model and config). A checkpoint
        adapted from another model is refused with a message naming both; nothing changes on a refusal."""
        self._load_checkpoint(checkpoint.read_checkpoint(directory))

    def _load_checkpoint(self, ckpt: checkpoint.Checkpoint) -> None:
        checkpoint.restore_state(self, ckpt)

    @classmethod
    def from_pretrained(
        cls,
        model: nn.Module | ModelAdapter,
        repo_id_or_path: str | os.PathLike,
        *,
        revision: str | None = None,
        token: str | None = None,
        api=None,
    ) -> "TTAWrapper":
        """Rebuild a wrapper around the *source* ``model`` and load the adapted state saved by :meth:`save_pretrained`
        in a local folder, or pushed by :meth:`push_to_hub` to a Hub repository (``revision`` pins a commit).

        The checkpoint's fingerprint is checked before the model is touched: a checkpoint adapted from another model
        is refused with a message naming both.
        """
        folder, ckpt = cls._read_checkpoint_for(model, repo_id_or_path, revision=revision, token=token, api=api)
        wrapper = cls(model, TTAConfig.from_dict(ckpt.config))
        wrapper.load_state(folder)  # through the (overridable) public path, e.g. DistributedTTAWrapper's barrier
        return wrapper

    @staticmethod
    def _read_checkpoint_for(
        model: nn.Module | ModelAdapter, repo_id_or_path: str | os.PathLike, **hub: Any
    ) -> tuple[str | os.PathLike, checkpoint.Checkpoint]:
        """Resolve (local folder or Hub repository) and read a checkpoint, refusing one adapted from another model:
        its class, config and the source values of the adapted layers are checked before PEFT wraps ``model``."""
        from .checkpoint_hub import resolve_checkpoint_folder

        folder = resolve_checkpoint_folder(repo_id_or_path, **hub)
        ckpt = checkpoint.read_checkpoint(folder)
        if ckpt.fingerprint is not None:
            base = model.model if isinstance(model, ModelAdapter) else model
            source = checkpoint.unwrapped_source(base, ckpt.fingerprint["adapted"]) if ckpt.fingerprint.get("source_sha256") else None
            current = checkpoint.model_fingerprint(base, {}, source)  # weights too, before PEFT wraps the model
            mismatch = checkpoint.fingerprint_mismatch(ckpt.fingerprint, current, check_params=False)
            if mismatch:
                raise ValueError(mismatch)
        return folder, ckpt

    def push_to_hub(
        self,
        repo_id: str,
        *,
        private: bool | None = None,
        token: str | None = None,
        revision: str | None = None,
        commit_message: str | None = None,
        api=None,
    ) -> str:
        """Push the checkpoint (as :meth:`save_pretrained` writes it) and a model card recording the source model,
        the objective, the stream length and the config to the Hub repository ``repo_id``, in one commit.
        ``api`` is an ``HfApi``-like object (default ``HfApi(token=token)``). Returns ``repo_id``."""
        from .checkpoint_hub import push_checkpoint

        return push_checkpoint(self, repo_id, private=private, token=token, revision=revision, commit_message=commit_message, api=api)

    def merge_and_unload(self) -> nn.Module:
        """The model with the adapted parameters merged in (a plain transformers model again)."""
        return self.peft_model.merge_and_unload() if self.peft_model is not None else self.model

    def __repr__(self) -> str:
        return (
            f"TTAWrapper({self.adapter.describe()}, objective={self.config.objective!r}, "
            f"{self.query_modality}->{self.gallery_modality}, adapted_tensors={len(self.params)}, batches={self.batch_index})"
        )


def _grads_finite(params: Iterable[nn.Parameter]) -> bool:
    """One device sync for all gradients (not one per tensor)."""
    grads = [p.grad for p in params if p.grad is not None]
    return not grads or bool(torch.isfinite(torch.stack(torch._foreach_norm(grads))).all())


def _batch_size(inputs: Mapping[str, Any]) -> int:
    for value in inputs.values():
        if isinstance(value, torch.Tensor):
            return value.shape[0] if value.dim() else 0
    raise ValueError("Inputs hold no tensor.")
