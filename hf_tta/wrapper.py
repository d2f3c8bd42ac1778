"""``TTAWrapper``: a Hugging Face dual encoder adapted online on a stream of queries.

Sets up what adapts (LayerNorm tuning in place, BitFit or PEFT LoRA of the query tower: :mod:`hf_tta.tuning`), embeds
and scores against a cached gallery, and orders :meth:`TTAWrapper.adapt_step`: prepare, source view, safety decision, the steps
(:mod:`hf_tta.loop`), decision, report. What adaptation changes is one :class:`~hf_tta.state.AdapterState`;
checkpoints are :mod:`hf_tta.checkpoint_hub`'s; answering without adapting (``answer``) is :mod:`hf_tta.answering`'s.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from functools import partial
from pathlib import Path
from typing import Any, Iterable, Mapping

import torch
from torch import nn

from . import batch as batching
from . import checkpoint, tuning, window
from .answering import AnswerMixin
from .checkpoint_hub import CheckpointMixin
from .config import SCORING, TTAConfig
from .configuration_utils import check_choice
from .forward import BatchForward
from .gallery.base import GalleryBackend, TopKScores
from .gallery.cache import GalleryCache
from .logging import tqdm
from .loop import GradientDecoupling, LoopResult, StepLoop
from .models.base import ModelAdapter, get_adapter
from .models.peft_interop import PeftExportMixin, light_copy, unwrap_peft
from .objectives.base import ObjectiveInputs, build_objective
from .outputs import PassCounts, TTAOutput, float_logs
from .policies import Answer, BatchContext, BatchPolicy
from .policies.build import build_policies
from .safety import SafetyDecision, build_monitor
from .state import ALL, OPTIMIZER, PARAMS, ROLLBACK, AdapterState, named_optimized

logger = logging.getLogger(__name__)


class TTAWrapper(CheckpointMixin, AnswerMixin, PeftExportMixin):
    """Test-time adaptation of a Hugging Face dual encoder for retrieval under query shift.

    The query tower's selected parameters (by default its LayerNorm affine parameters) are adapted online with
    the chosen objective; the gallery tower and the cached gallery embeddings never change. The adapted values live in
    the model's own parameters (its modules and state-dict keys stay as they were, so ``model.save_pretrained``
    saves the adapted model); the source values are kept in the wrapper, which :meth:`reset` returns to and
    :meth:`disabled` computes with. ``tuning="lora"`` wraps the selected layers with PEFT's LoRA instead.

    Args:
        model (`nn.Module` or `ModelAdapter`): a supported Hugging Face model (``CLIPModel``, ``SiglipModel``,
            ``BlipForImageTextRetrieval``, ``Blip2ForImageTextRetrieval``, ``VisionTextDualEncoderModel``), or a
            :class:`~hf_tta.DualEncoderAdapter` around a custom dual encoder.
        config (`TTAConfig`, *optional*): objective, query modality, steps, optimiser and parameter selection.

    ``passes`` (:class:`~hf_tta.PassCounts`) meters the compute since the last :meth:`reset`: queries embedded
    (``forward``) and backpropagated (``backward``); a meter, not adapted state (not saved, not restored).

    Example:
        >>> tta = TTAWrapper(model, TTAConfig(objective="tcr", query_modality="image"))  # doctest: +SKIP
        >>> gallery = tta.encode_gallery(text_inputs)  # doctest: +SKIP
        >>> out = tta.adapt_step({"pixel_values": pixels}, gallery)  # doctest: +SKIP
        >>> out.scores.topk(10).indices  # doctest: +SKIP
    """

    #: whether this wrapper runs ``TTAConfig.lr_search`` (one stream in one process: not routed, not distributed)
    runs_lr_search = True

    #: whether the one-sync fast path may run (``TTAConfig.fast_step``); a subclass whose every update takes the loop's
    #: gradient reduction sets it ``False`` (:class:`~hf_tta.DistributedTTAWrapper`)
    allows_fast_step = True
    #: called on the adapted parameters after each backward (``None``: nothing; the distributed all-reduce)
    reduce_gradients = None

    def __init__(self, model: nn.Module | ModelAdapter, config: TTAConfig | None = None):
        self.config = cfg = config if config is not None else TTAConfig()
        if cfg.lr_search is not None and not self.runs_lr_search:
            raise ValueError(f"{type(self).__name__} does not run TTAConfig.lr_search (it probes one stream in one "
                             "process): use TTAWrapper or drop lr_search.")
        model = unwrap_peft(model)  # a LoRA-tuned PeftModel: its adapters merged, then LN-tuned on top (logged)
        self.adapter = get_adapter(model, modalities=(cfg.query_modality, cfg.gallery_modality))
        self.model = self.adapter.model
        self.adapter.check_modality(cfg.query_modality)
        self.query_modality = cfg.query_modality
        self.gallery_modality = cfg.gallery_modality or self._other_modality()
        self.adapter.check_modality(self.gallery_modality)
        self.objective = build_objective(cfg.objective, cfg.build_objective_config())
        # a training-free objective applied to the output scores of any objective (e.g. Distribution Normalization)
        self.score_transform = build_objective(cfg.score_transform, cfg.build_score_transform_config()) if cfg.score_transform else None
        batching.check_query_vectors(self.adapter, self.query_modality, (self.objective, self.score_transform))
        self.model.eval()  # dropout off; TTA toggles requires_grad only (LayerNorm has no train-mode behaviour)
        self.peft_model: nn.Module | None = None  # a peft.PeftModel (LoRA only)
        self.params: dict[str, nn.Parameter] = {}
        self.target_modules: list[str] = []
        self.lr = cfg.lr
        if self.objective.requires_grad:
            self._wrap_targets()
        self.passes = PassCounts()  # queries through the query tower since the last reset (a meter, not state)
        self.forward = BatchForward(self.adapter, cfg, self.objective, self.score_transform, self.query_modality,
                                    self.gallery_modality, self, lambda: self.disabled(), self.params, self.passes)
        # TTAConfig.fast_step: one host sync per adapt_step (fused AdamW skips bad steps on the device)
        self.fast_step = self.allows_fast_step and (cfg.run.fast_step if cfg.run.fast_step is not None else self.device.type == "cuda")
        self.optimizer = self._make_optimizer()
        self.generator = torch.Generator().manual_seed(cfg.seed)
        self.state = self.objective.init_state(self.device)
        self.transform_state = self.score_transform.init_state(self.device) if self.score_transform else {}
        self.batch_index = 0
        self.selector_state: dict[str, torch.Tensor] = {}  # TTAConfig.lr_search's (hf_tta.lr_search); empty when off
        #: the batch-level features (hf_tta.policies), in the order they act; empty when none is on
        self.policies: list[BatchPolicy] = build_policies(self)
        self.budget, self.lr_search = self.policy("update_budget"), self.policy("lr_search")
        self.shift_gate = self.policy("shift_gate")  # TTAConfig.shift_gate (hf_tta.shift_gate); None when off
        self.safety = build_monitor(cfg.build_safety_config())  # a NullSafetyMonitor when the layer is off
        gd = GradientDecoupling(cfg.objective, g.per_tensor, g.weight_on) if (g := cfg.gradient_decoupling) else None
        self.loop = StepLoop(self.objective, cfg.steps, fast=self.fast_step, gradient_decoupling=gd, passes=self.passes,
                             reduce_gradients=self.reduce_gradients)
        self.capture_source()

    def _wrap_targets(self) -> None:  # what adapts (hf_tta.tuning: LN tuning, BitFit or LoRA)
        targets = tuning.wrap_targets(self.adapter, self.query_modality, self.config)
        self.peft_model, self.params, self.target_modules = targets.peft_model, targets.params, targets.modules
        self.lr = self.config.lr if self.config.lr is not None else self.adapter.default_lr[self.query_modality]
        logger.info("hf_tta adapts %d tensors in %d modules", len(self.params), len(self.target_modules))

    def capture_source(self) -> None:
        """Take the current state as the source that :meth:`reset` returns to (an :data:`~hf_tta.state.ALL` capture,
        fresh optimiser), and build the loop's penalties on it: a re-capture (``DistributedTTAWrapper`` after
        broadcasting the main process's weights) moves the anchor's reference and the objectives' source values too."""
        self._source_state = AdapterState.capture(self, ALL)
        if self._source_state.optimizer is not None:
            self._source_state.optimizer.fresh = True
        self._source_params = self.forward.source_params = {n: self._source_state.params[n] for n in self.params}
        self.loop.penalties = tuple(tuning.penalties(self.config, self.model, self.params, self._source_params))

    # ------------------------------------------------------------------------------------------ setup
    def _other_modality(self) -> str:
        others = [m for m in self.adapter.modalities if m != self.config.query_modality]
        if len(others) != 1:
            raise ValueError(f"Set `gallery_modality`: the model embeds {list(self.adapter.modalities)}.")
        return others[0]

    def _make_optimizer(self) -> torch.optim.Optimizer | None:
        if not self.params:
            return None
        groups = tuning.param_groups(self.params, self.lr, self.config.tuning.lr_multipliers)
        opt = self.objective.make_optimizer(groups, self.lr, self.config.weight_decay)
        if self.fast_step and type(opt) is torch.optim.AdamW and not opt.defaults["fused"]:
            # the same update in one fused kernel, which can also skip a step on the device (``found_inf``)
            keys = ("params", "lr", "betas", "eps", "weight_decay", "amsgrad", "maximize")
            with contextlib.suppress(RuntimeError):  # a device without a fused kernel keeps the default AdamW
                opt = torch.optim.AdamW([{k: g[k] for k in keys} for g in opt.param_groups], fused=True)
        return opt

    def rebuild_optimizer(self) -> None:
        """A fresh optimiser over the adapted parameters (what a reset and SAR's recovery start from), at the lr in
        use (the lr search's, :mod:`hf_tta.lr_search`)."""
        self.optimizer = self._make_optimizer()
        for policy in getattr(self, "policies", ()):  # (the lr search's lr in use)
            policy.optimizer_rebuilt()

    @property
    def selector_shadows(self) -> Any:
        """The lr search's shadows during its probe (a :class:`~hf_tta.slots.SlotBank` keyed by candidate index,
        :mod:`hf_tta.lr_search`; part of the :data:`~hf_tta.state.SELECTOR` state), ``None`` without an lr search."""
        return self.lr_search.shadows if getattr(self, "lr_search", None) is not None else None

    def policy(self, name: str) -> BatchPolicy | None:
        """The batch policy called ``name`` (``"update_budget"``, ``"lr_search"``; :mod:`hf_tta.policies`), or ``None``."""
        return next((p for p in self.policies if p.name == name), None)

    def named_optimized_parameters(self) -> list[tuple[str, torch.Tensor]]:
        """The optimised tensors in the optimiser's order (its groups: ``lr_multipliers``): the adapted parameters by
        name, then other tensors it steps (ClipTTA's alpha: ``optimizer.extra.<i>``)."""
        return named_optimized(self.optimizer, self.params)

    @property
    def fast_path_active(self) -> bool:
        """Whether the next batch takes the one-sync fast path (:mod:`hf_tta.loop`; ``TTAConfig.fast_step``)."""
        return self.loop.fast_applies(self.optimizer) and not any(p.needs_checked_loop for p in self.policies)

    def source_parameters(self) -> dict[str, torch.Tensor]:  # copies of the source values :meth:`reset` restores
        return {n: t for n, t in self._source_state.only({PARAMS}).copy().params.items() if n in self.params}

    device = property(lambda self: next(self.model.parameters()).device)

    def disabled(self) -> contextlib.AbstractContextManager:
        """Context in which the model computes exactly as the source model (the adapted parameters' source values
        swapped in, or LoRA's adapters off); also after :meth:`merge_and_unload` and :meth:`export_peft_adapter`."""
        if self.peft_model is not None:
            return self.peft_model.disable_adapter()
        return tuning.source_values(self.model, self.params, self._source_params) if self.params else contextlib.nullcontext()

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
            batch_size: chunk size for a dict input (default ``config.run.gallery_batch_size``).
        """
        parts = list(batching.chunks(inputs, batch_size or self.config.run.gallery_batch_size)) if isinstance(inputs, Mapping) else inputs
        embs = []
        total = len(parts) if hasattr(parts, "__len__") else None
        show = show_progress if show_progress is not None else (total is None or total > 4)
        with self.disabled():
            for chunk in tqdm(parts, total=total, desc=f"Encoding {self.gallery_modality} gallery", disable=not show):
                chunk = self.forward.check_inputs(chunk, self.gallery_modality)
                embs.append(self.adapter.encode(self.gallery_modality, chunk))
        if not embs:
            raise ValueError("The gallery is empty.")
        return GalleryCache(torch.cat(embs), self.gallery_modality, self.forward.gallery_encoder())

    @torch.no_grad()
    def embed_and_score(
        self, queries: Mapping[str, torch.Tensor], gallery: GalleryCache | torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Score a batch with the current model, without adapting (the source model inside ``disabled()``).

        Returns the single-vector query embeddings ``(B, D)`` (see ``ModelAdapter.single_vector``) and the scores
        ``(B, N)`` from the adapter's ``score`` (a max over vectors for multi-vector models); no score transform."""
        gallery = self.forward.check_gallery(gallery)
        if isinstance(gallery, GalleryBackend):
            raise TypeError(f"embed_and_score needs the dense GalleryCache; for {type(gallery).__name__} use answer(...).")
        queries = self.forward.check_inputs(queries, self.query_modality)
        return self.forward.embed_and_score(queries, gallery)

    # ------------------------------------------------------------------------------------------ the online step
    def adapt_step(
        self, queries: Mapping[str, torch.Tensor], gallery: GalleryCache | GalleryBackend | torch.Tensor, labels: Any = None,
        scoring: str | None = None,
    ) -> TTAOutput:
        """Adapt on one batch of queries and return their scores against the whole gallery.

        Runs ``config.steps`` steps of: embed the queries, compute the objective, update the adapted parameters
        (:mod:`hf_tta.loop`). A step with nothing selected, or with a non-finite loss or gradient, updates nothing and
        is listed in ``TTAOutput.skipped``. ``labels`` (each query's relevant gallery items: a ``(B, N)`` bool mask or
        a list of index lists) is for supervised objectives only (``oracle``, the benchmark's ceilings) and refused
        otherwise. With ``config.run.scoring="before_update"`` (or ``scoring=`` for this batch) the current model answers
        before the batch adapts it (:meth:`answer` gives that answer alone). A live top-k backend stays at one version
        for the step (:func:`hf_tta.batch.pinned`).
        """
        check_choice("scoring", scoring, SCORING, allow_none=True)
        with batching.pinned(gallery, self.forward.gallery_versions, [(self.objective, self.state), (self.score_transform, self.transform_state)]):
            return self.step_batch(queries, gallery, labels, scoring)

    def step_batch(self, queries: Mapping[str, torch.Tensor], gallery: Any, labels: Any, scoring: str | None = None) -> TTAOutput:
        """One batch's driver, inside :meth:`adapt_step`'s pinned gallery (a subclass's seam: routing steps each
        domain's sub-batch through it); call :meth:`adapt_step`, not this."""
        batch = self.prepare_batch(queries, gallery, labels)
        ctx = BatchContext(self, batch, scoring, self._recover, self._source_state)
        if self.safety.last_good is None:  # (what it snapshots, ROLLBACK, no policy's answer changes)
            self.safety.remember(self)
        for policy in self.policies:  # TTAConfig.update_budget's skip, TTAConfig.lr_search's probe (hf_tta.policies)
            if (answer := policy.begin(ctx)) is not None:
                return self._finish(ctx, answer)
        source = ctx.source_view() if self.safety.active else ctx.source
        decision = self.safety.before(source)
        if decision.action == "skip_degenerate":  # the source answers; the batch leaves no trace, not even in DN
            answer = Answer(source, source.scores, skipped=[decision.reason], update_state=False)
        elif not self.objective.requires_grad:
            inputs, result = self._score_only(batch, source)
            answer = Answer.from_result(inputs, result.scores, result)
        else:
            answer = self._steps(ctx, source, scoring)
        return self._finish(ctx, answer)

    def _steps(self, ctx: BatchContext, source: ObjectiveInputs | None, scoring: str | None) -> Answer:
        """The batch's steps (:mod:`hf_tta.loop`), the safety layer's verdict carried out, and the answer."""
        batch = ctx.batch
        answer = self.forward.view(batch, self.config.steps - 1) if (scoring or self.config.run.scoring) == "before_update" else None
        cache = [source.scores] if source is not None and source.candidate_ids is None else []
        rules = [r for p in self.policies if (r := p.step_rule(ctx)) is not None]  # LRSearchConfig.online (hf_tta.lr_online)
        if len(rules) > 1:
            raise ValueError("Two batch policies set a step rule; the loop runs one: drop one of them.")
        result = ctx.result = ctx.run_steps(partial(self.forward.inputs, batch, source_cache=cache), rules[0] if rules else None)
        if result.skipped:
            logger.info("adapt_step skipped %s", "; ".join(result.skipped))
        inputs, scores = ctx.reported_view(result)
        window.record(self.state, self.config.window, inputs, scores, source)
        decision = self.safety.after(inputs, scores)
        self._apply(ctx, decision)
        for policy in self.policies:  # e.g. the lr in use after the batch (and the online rule's trace)
            result.logs.update(policy.logs())
        if decision.action is not None:  # a flagged batch returns the source model's scores
            inputs, scores = source, source.scores
        if answer is not None:
            inputs, scores = answer, answer.scores
        return Answer.from_result(inputs, scores, result)

    def _finish(self, ctx: BatchContext, answer: Answer) -> TTAOutput:
        """The one place a batch's :class:`~hf_tta.TTAOutput` is built: each policy's last word on the answer, the
        scores through the score transform (a degenerate batch leaves its state untouched), the batch's record; then
        the batch is counted and, with ``reset_policy="episodic"``, the source state restored."""
        for policy in self.policies:
            answer = policy.finish(ctx, answer)
        out = self.forward.scored(ctx.batch, answer.inputs, answer.scores, update_state=answer.update_state)
        out = dataclasses.replace(out, loss=answer.loss, num_updates=answer.num_updates, n_selected=answer.n_selected,
                                  skipped=answer.skipped, logs=answer.logs)
        if answer.report_safety:
            out = dataclasses.replace(out, safety_action=self.safety.action, safety_logs=dict(self.safety.logs))
        self.batch_index += 1
        if self.config.reset_policy == "episodic":
            self.restore_source()
        return out

    def fit_shift_gate(self, queries: Mapping[str, torch.Tensor] | Iterable[Mapping[str, torch.Tensor]]) -> None:
        """Give ``TTAConfig.shift_gate`` its reference: clean, in-distribution queries (a dict of input tensors or an
        iterable of them; no labels), described by the source model (:mod:`hf_tta.shift_gate`). Kept by
        :meth:`reset` and saved with the checkpoint."""
        if self.shift_gate is None:
            raise ValueError("fit_shift_gate needs TTAConfig(shift_gate={...}): the gate is off.")
        self.shift_gate.fit_queries(self, queries)

    def prepare_batch(self, queries: Mapping[str, torch.Tensor], gallery: Any, labels: Any) -> batching.Batch:
        """The checked batch :meth:`step_batch` runs on (inputs, gallery and labels validated; refused in one line)."""
        batching.check_step_context()
        gallery = self.forward.check_gallery(gallery)
        queries = self.forward.check_inputs(queries, self.query_modality)
        n = batching.batch_size(queries)
        batching.warn_small_batch(n, self.objective, self.safety.min_queries, self.config.window)
        return batching.Batch(queries, gallery, batching.label_mask(labels, self.objective, n, gallery, self.device), n)

    def _score_only(self, batch: batching.Batch, source: ObjectiveInputs | None) -> tuple[ObjectiveInputs, LoopResult]:
        """A training-free objective: nothing is adapted (:meth:`hf_tta.forward.BatchForward.training_free`)."""
        inputs, res, scores = self.forward.training_free(batch, source)
        return inputs, LoopResult(inputs, scores, None, 0, res.n_selected, logs=float_logs(res.logs))

    def _recover(self) -> None:  # an objective's model recovery (SAR): source parameters, fresh optimiser
        self._source_state.only({PARAMS, OPTIMIZER}).apply(self)
        for policy in self.policies:  # (the online rule's last step led elsewhere)
            policy.recovered()

    def _apply(self, ctx: BatchContext, decision: SafetyDecision) -> None:
        """Carry out the safety monitor's decision: roll back to its last-good state, or reset to the source model
        (batch counter, RNG and score transform go on; what a policy keeps, e.g. the lr search's choice, too), or
        refresh the last-good state after a kept batch; each policy acts after it (the lr search's back-off)."""
        if decision.action == "rollback":
            self.safety.last_good.apply(self)
        elif decision.action == "reset":
            kept = frozenset().union(*(p.keeps_on_reset for p in self.policies))
            self._source_state.only(ROLLBACK - kept).apply(self)
        for policy in self.policies:
            policy.after(ctx, decision)
        if decision.action == "reset" or decision.refresh:
            self.safety.remember(self)

    def adapt_stream(
        self, batches: Iterable[Mapping[str, torch.Tensor]], gallery: GalleryCache | GalleryBackend, show_progress: bool = True
    ) -> torch.Tensor | TopKScores:
        """Adapt on every batch of a stream; return the concatenated ``(num_queries, N)`` score matrix (the concatenated
        :class:`~hf_tta.gallery.TopKScores` with a top-k gallery backend)."""
        total = len(batches) if hasattr(batches, "__len__") else None
        outs = (self.adapt_step(b, gallery) for b in tqdm(batches, total=total, desc=f"TTA ({self.config.objective})", disable=not show_progress))
        rows = [out.topk if out.scores is None else out.scores for out in outs]
        return TopKScores.cat(rows) if isinstance(rows[0], TopKScores) else torch.cat(rows)

    # ------------------------------------------------------------------------------------------ state
    def reset(self) -> None:
        """Return exactly to the source model: adapted parameters, optimiser, objective and score-transform state, batch
        counter, RNG, the lr search's state (the next batches probe again) and the safety monitor; the :attr:`passes`
        meter starts again from zero."""
        self.restore_source()
        self.passes.clear()

    def restore_source(self) -> None:
        """Put the source state into the model and clear the monitor (:meth:`reset`; ``reset_policy="episodic"`` after
        every batch; in a :class:`~hf_tta.routing.RoutedTTAWrapper`, the loaded domain's only)."""
        self._source_state.apply(self)
        self.safety.clear()

    @property
    def source_state(self) -> AdapterState:
        """The captured :data:`~hf_tta.state.ALL` source state :meth:`reset` applies (read it, do not change it)."""
        return self._source_state

    @property
    def safety_counts(self) -> dict[str, int]:
        """How often the safety layer skipped, rolled back and reset since the last :meth:`reset` (empty when off)."""
        return dict(self.safety.counts)

    def resolved_config(self) -> TTAConfig:
        """The config with every default written out (what ``tta_config.json`` records)."""
        return self.config.resolved(lr=self.lr, gallery_modality=self.gallery_modality)

    def fingerprint(self) -> dict[str, Any]:  # the source model: class, config hash, adapted names, shapes and values
        return checkpoint.model_fingerprint(self.model, self.params, self._source_params)

    def step_on_cpu(self) -> bool:
        """AdamW keeps ``step`` on the CPU unless fused or capturable (then on the parameters' device)."""
        opt = self.optimizer
        return opt is None or not any(g.get("fused") or g.get("capturable") for g in opt.param_groups)

    def reader(self) -> TTAWrapper:
        """A new wrapper that answers exactly as this one does now (:mod:`hf_tta.readers`), built as
        :meth:`from_pretrained` builds one, without a disk: this class's constructor around a copy of the *source*
        model that shares every frozen tensor with this one (LoRA's layers taken out of the copy, then added again by
        the constructor from the config's seed), then this wrapper's checkpoint payload loaded into it (its
        ``AdapterState``, the safety monitor's and the shift gate's tensors; a routed wrapper's domains and router).
        Not a deep copy of this wrapper: the optimiser, loop and snapshots are the new wrapper's own."""
        with self.disabled():  # the source values in the model (LN / BitFit: frozen stand-ins, copied, never shared)
            own = [self.model.get_parameter(n) for n in self.params]
            adapter, peft_copy = light_copy((self.adapter, self.peft_model), own, model=self.model)
        if peft_copy is not None:
            peft_copy.unload()  # the copy's LoRA layers out (its base weights shared with this model, unmerged)
        config, tensors, meta = self.checkpoint_payload()
        reader = type(self)(adapter, **self._init_kwargs(dict(config)))
        reader.load_checkpoint(checkpoint.Checkpoint(Path("."), config, tensors, meta))
        return reader

    def checkpoint_payload(self) -> tuple[dict[str, Any], dict[str, torch.Tensor], dict[str, Any]]:
        """The checkpoint of this wrapper: its resolved config, its :data:`~hf_tta.state.ALL` state's tensors and the
        safety monitor's (see :mod:`hf_tta.checkpoint` for the layout)."""
        tensors, meta = AdapterState.capture(self, ALL).to_tensors()
        safety_tensors, safety_meta = self.safety.state_tensors()
        tensors.update(safety_tensors)
        if self.shift_gate is not None:  # the gate's reference (hf_tta.shift_gate)
            tensors.update(self.shift_gate.state_tensors())
        if safety_meta is not None:  # the layer is on
            meta["safety"] = safety_meta
        meta["param_names"] = list(self.params)
        return self.config.checkpoint_dict(lr=self.lr, gallery_modality=self.gallery_modality), tensors, meta

    def load_checkpoint(self, ckpt: checkpoint.Checkpoint) -> None:
        """Load a checkpoint of :meth:`checkpoint_payload`; everything is checked before anything changes."""
        meta = ckpt.metadata
        if "routed" in meta:
            raise ValueError("This checkpoint holds one adapter per domain (saved by RoutedTTAWrapper): load it with RoutedTTAWrapper.")
        self.check_checkpoint(ckpt, meta["param_names"])
        tensors = {k: v.to(self.device) for k, v in ckpt.tensors.items()}
        names = [n for n, _ in self.named_optimized_parameters()]
        state = AdapterState.from_tensors(tensors, meta, ALL, names, step_on_cpu=self.step_on_cpu())
        self.rebuild_optimizer()
        state.apply(self)
        self.safety.load_state_tensors(tensors, meta.get("safety"), names, self.step_on_cpu())
        if (gate := self.shift_gate) is not None:
            gate.load_state_tensors(tensors)

    def check_checkpoint(self, ckpt: checkpoint.Checkpoint, param_names: list[str]) -> None:
        """Refuse a checkpoint adapted from another model or saved with another config, naming the difference."""
        if ckpt.fingerprint is not None:
            current = checkpoint.model_fingerprint(self.model, self.params, self._source_params, ckpt.legacy_names)
            mismatch = checkpoint.fingerprint_mismatch(ckpt.fingerprint, current)
            if mismatch:
                raise ValueError(mismatch)
        mismatch = self.resolved_config().mismatch(ckpt.config, owner=type(self).__name__)
        if mismatch:
            raise ValueError(mismatch)
        if param_names != list(self.params):
            raise ValueError("The checkpoint adapts other parameters than this wrapper: was it saved from another model or config?")

    def __repr__(self) -> str:
        return f"TTAWrapper({self.adapter.describe()}, {self.config.objective!r}, {self.query_modality}->{self.gallery_modality})"

