"""ClipTTA: robust contrastive vision-language test-time adaptation (Lafon, Vargas Hakim, Rambour, Desrosiers, Thome,
NeurIPS 2025), ported to retrieval; its native zero-shot classification is the special case of a gallery of class prompts.

Code: github.com/MarcLafon/cliptta (f4221f4). Equations below are the paper's.

Per step, with B queries and the gallery (captions, or class prompts):
  * pseudo-captions: each query's top-1 gallery item, recomputed every step (Sec. 2.2);
  * soft contrastive loss (Eq. 3, query->gallery term only, since the gallery tower is frozen): the mean row entropy of
    softmax(z^Q Z^{G_hat}^T / tau) over the B pseudo-captions of the batch (duplicates allowed, as intended), tau = 0.01
    (CLIP's logit scale 100);
  * regulariser (Sec. 2.5): L_reg = sum_c q̄_c log q̄_c, minus the entropy of the batch-mean prediction over the whole
    gallery, lambda_reg = 1;
  * class-wise confident memory (CCM, Sec. 2.6): raw queries (tensors in the state) stored under their pseudo-label
    with their confidence, the max softmax probability over the gallery of the **raw cosines** times
    ``ood_logit_scale`` (= 1), not at tau: the code's ``get_scores(logits)`` with ``score_type="max_prob"`` on
    ``logits = image_feature @ text_features.t()`` (ttavlm/methods/cliptta.py:96-100, abstract_model.py:475, 482-485;
    ttavlm/memory/ccm.py:64-65 keeps the top ``num_shots`` by it); at most ``memory_shots`` per gallery item,
    ``memory_size`` in all (the most confident kept). At step 0 of each batch the batch is added; every step a random
    ``memory_sample_size`` of them (default: B) is re-embedded by the current model (``ObjectiveInputs.reencode``) and the
    same soft contrastive loss is computed on it. L = 1/2 (L_s-cont + L_s-cont^M) + lambda_reg L_reg (Eq. 4; the code adds
    the two instead of averaging). A retrieval gallery has one "class" per item, hence 1 shot per item by default;
  * open set (``open_set=True``), for queries that may have no relevant gallery item (Sec. 3.3): OOD score s_i (the
    code's max log-softmax of the unscaled cosines, ``ood_score="max_log_prob"``; the paper's max softmax probability at
    tau with ``"max_prob"``), soft ID weight w_i = sigmoid((s_i - alpha) / gamma), gamma = 0.005 (code), and
    L_OCE = -(mu_id - mu_ood)^2 with the w-weighted means (Eq. 9), lambda_oce = 1. The threshold alpha is initialised
    with Otsu's method on the batch scores at step 0 of every batch (code) and learned with the model's optimiser
    (its own parameter group, no weight decay). Only queries with s_i > alpha enter the soft contrastive loss and the
    memory; L_reg and L_OCE use every query. ``ood_mask(scores)`` gives the ID/OOD decision of the last alpha.

Protocol (``protocol``). ``"tcr"`` (default, for comparison with the other objectives): the loss above and scores
from the last step's forward, as TCR's loop reports every method. ``"cliptta"`` (ClipTTA's own code,
``ttavlm``): the memory batch also gets the marginal-entropy regulariser and the memory terms are added, not averaged
(L = L_s-cont + L_s-cont^M + lambda_reg (L_reg + L_reg^M); the code's ``loss_tta += ...; loss_reg += ...``, which this
library follows where it departs from Eq. 4's 1/2), and the predictions are taken after the last update (a fresh
forward of the adapted model, ``score_after_update``).

With a top-k gallery backend (``gallery_access="per_item"``) the memory keys its queries by global gallery index (the
pseudo-label's ``ObjectiveInputs.candidate_ids`` entry), and every softmax over the gallery (confidence, OOD score,
L_reg) is over the batch's candidate set C; the soft contrastive loss (over the batch's pseudo-captions) is exact, and
the replayed memory queries are scored against C.

Paper settings to reproduce it (set them on ``TTAConfig``): Adam, lr 1e-4, no weight decay, 10 steps per batch,
continual. The wrapper's defaults (AdamW, 3 steps, TCR's learning rates) are kept unless you change them.

Zero-shot classification (the paper's native task): the gallery is the class prompts, the queries are the images,
``out.scores.argmax(1)`` is the predicted class::

    >>> prompts = processor(text=[f"a photo of a {c}" for c in classes], padding=True, return_tensors="pt")  # doctest: +SKIP
    >>> cfg = TTAConfig(objective="cliptta", query_modality="image", lr=1e-4, steps=10, weight_decay=0.0,
    ...                 objective_config=ClipTTAConfig.for_classification(len(classes)).to_dict())  # doctest: +SKIP
    >>> tta = TTAWrapper(model, cfg); prompts_g = tta.encode_gallery(prompts)  # doctest: +SKIP
    >>> preds = [tta.adapt_step(processor(images=x, return_tensors="pt"), prompts_g).scores.argmax(1) for x in stream]  # doctest: +SKIP
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..configuration_utils import check_choice, check_positive
from .base import (
    LossOutput,
    Objective,
    ObjectiveConfig,
    ObjectiveInputs,
    ObjectiveState,
    config_field,
    register_objective,
    select_rows,
    softmax_entropy,
)

OOD_SCORES = ("max_log_prob", "max_prob")
PROTOCOLS = ("tcr", "cliptta")
MEMORY_PREFIX = "memory."


@dataclass
class ClipTTAConfig(ObjectiveConfig):
    protocol: str = config_field(
        "tcr",
        "'tcr' (default): TCR's protocol (scores from the last step's forward, 1/2 (L_sc + L_sc^M) + lambda_reg L_reg). "
        "'cliptta': ClipTTA's code (memory batch also regularised, memory terms added, scores after the last update).",
    )
    tau: float = config_field(0.01, "Temperature (CLIP logit scale 100).")
    lambda_reg: float = config_field(1.0, "Weight of the marginal-entropy regulariser (paper: 1).")
    use_memory: bool = config_field(True, "Class-wise confident memory (CCM).")
    memory_size: int = config_field(64, "Memory capacity (queries); the most confident are kept.")
    memory_shots: int = config_field(1, "Queries kept per pseudo-label (gallery item); the code uses 4-16 per class.")
    memory_sample_size: int | None = config_field(None, "Memory queries replayed per step; None = the batch size.")
    open_set: bool = config_field(False, "Open-set mode: ID/OOD weighting with an Otsu-initialised learnable threshold + OCE.")
    lambda_oce: float = config_field(1.0, "Weight of the OCE loss (paper: 1).")
    ood_score: str = config_field("max_log_prob", "'max_log_prob' (code, unscaled cosines) or 'max_prob' (paper, at tau).")
    ood_logit_scale: float = config_field(1.0, "Scale of the cosines in the 'max_log_prob' OOD score and the memory confidence (code: 1).")
    ood_gamma: float = config_field(0.005, "Temperature of the soft ID weight sigmoid((s - alpha) / gamma) (code: 0.005).")
    otsu_bins: int = config_field(256, "Histogram bins of Otsu's threshold (skimage default: 256).")

    def __post_init__(self):
        super().__post_init__()
        check_positive("tau", self.tau)
        check_positive("lambda_reg", self.lambda_reg, allow_zero=True)
        check_positive("memory_size", self.memory_size)
        check_positive("memory_shots", self.memory_shots)
        check_positive("memory_sample_size", self.memory_sample_size)
        check_positive("lambda_oce", self.lambda_oce, allow_zero=True)
        check_positive("ood_logit_scale", self.ood_logit_scale)
        check_positive("ood_gamma", self.ood_gamma)
        check_positive("otsu_bins", self.otsu_bins)
        check_choice("ood_score", self.ood_score, OOD_SCORES)
        check_choice("protocol", self.protocol, PROTOCOLS)

    @classmethod
    def for_classification(cls, num_classes: int, shots: int = 16, **overrides) -> ClipTTAConfig:
        """The paper's classification memory: ``shots`` per class (code: 16 for CIFAR-100/ImageNet, 4 for CIFAR-10)."""
        return cls(memory_shots=shots, memory_size=shots * num_classes, **overrides)


# ----------------------------------------------------------------------------------------------- equations
def soft_contrastive_loss(scores: torch.Tensor, tau: float) -> torch.Tensor:
    """Eq. 3 (query->gallery term): mean entropy of each row of ``softmax(scores[:, top1] / tau)`` (``B x B``)."""
    top1 = scores.detach().argmax(dim=1)
    return softmax_entropy(scores[:, top1] / tau).mean()


def marginal_entropy_regulariser(scores: torch.Tensor, tau: float) -> torch.Tensor:
    """``L_reg = sum_c q̄_c log q̄_c`` with ``q̄`` the batch-mean softmax over the gallery (minimising it diversifies)."""
    q_bar = (scores / tau).softmax(dim=1).mean(0)
    return (q_bar * q_bar.clamp(min=1e-12).log()).sum()


def ood_scores(scores: torch.Tensor, kind: str, tau: float, logit_scale: float) -> torch.Tensor:
    """MCM-style OOD score per query: max log-softmax of ``logit_scale * cos`` or max softmax of ``cos / tau``."""
    if kind == "max_log_prob":
        return (logit_scale * scores).log_softmax(dim=1).max(dim=1).values
    return (scores / tau).softmax(dim=1).max(dim=1).values


def otsu_threshold(values: torch.Tensor, bins: int = 256) -> torch.Tensor:
    """Otsu's threshold exactly as ``skimage.filters.threshold_otsu`` computes it (histogram over [min, max] with
    ``bins`` bins; the bin centre maximising the between-class variance, the first one on ties)."""
    v = values.detach().double().flatten()
    lo, hi = v.min(), v.max()
    if lo == hi:
        return lo.float()
    hist = torch.histc(v, bins=bins, min=float(lo), max=float(hi))
    edges = torch.linspace(float(lo), float(hi), bins + 1, dtype=torch.float64, device=v.device)
    centres = (edges[:-1] + edges[1:]) / 2
    w1 = hist.cumsum(0)
    w2 = hist.flip(0).cumsum(0).flip(0)
    m1 = (hist * centres).cumsum(0) / w1
    m2 = ((hist * centres).flip(0).cumsum(0) / hist.flip(0).cumsum(0)).flip(0)
    var12 = w1[:-1] * w2[1:] * (m1[:-1] - m2[1:]) ** 2
    var12 = torch.nan_to_num(var12, nan=-1.0)
    return centres[int(var12.argmax())].float()


def oce_loss(s: torch.Tensor, alpha: torch.Tensor, gamma: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Eq. 8-9: ``w = sigmoid((s - alpha) / gamma)``, ``L_OCE = -(mu_id - mu_ood)^2``. Returns ``(loss, w)``."""
    w = torch.sigmoid((s - alpha) / gamma)
    mu_id = (w * s).sum() / w.sum().clamp(min=1e-12)
    mu_ood = ((1 - w) * s).sum() / (1 - w).sum().clamp(min=1e-12)
    return -((mu_id - mu_ood) ** 2), w


def _pad_cat(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Concatenate along rows, right-padding dimension 1 with zeros when token lengths differ."""
    if a.dim() >= 2 and a.shape[2:] == b.shape[2:] and a.shape[1] != b.shape[1]:
        width = max(a.shape[1], b.shape[1])
        a = F.pad(a, (0, 0) * (a.dim() - 2) + (0, width - a.shape[1]))
        b = F.pad(b, (0, 0) * (b.dim() - 2) + (0, width - b.shape[1]))
    return torch.cat([a, b.to(a.device, a.dtype)])


# ----------------------------------------------------------------------------------------------- objective
@register_objective("cliptta", ClipTTAConfig)
class ClipTTA(Objective):
    """Soft contrastive loss on pseudo-captions + marginal-entropy regulariser + confident memory (+ OCE, open set)."""

    gallery_access = "per_item"  # memory keyed by global gallery index; its softmaxes are over C

    def __init__(self, config=None):
        super().__init__(config)
        # The learnable OOD threshold (open set): re-initialised by Otsu at step 0 of every batch, stepped by the
        # wrapper's optimiser (see make_optimizer). Its value never carries over to the next batch.
        self.alpha = nn.Parameter(torch.zeros(()))

    @property
    def score_after_update(self) -> bool:  # type: ignore[override]
        """ClipTTA's own protocol reports the predictions of a fresh forward after the last update (wrapper hook)."""
        return self.config.protocol == "cliptta"

    def make_optimizer(self, params, lr: float, weight_decay: float) -> torch.optim.Optimizer:
        groups = list(params)  # tensors, or parameter groups (TTAConfig.lr_multipliers)
        if not self.config.open_set:
            return super().make_optimizer(groups, lr, weight_decay)
        groups = groups if isinstance(groups[0], dict) else [{"params": groups}]
        with torch.no_grad():
            self.alpha = nn.Parameter(self.alpha.detach().to(groups[0]["params"][0].device))
        return torch.optim.AdamW([*groups, {"params": [self.alpha], "weight_decay": 0.0}], lr=lr, weight_decay=weight_decay)

    def init_state(self, device="cpu") -> ObjectiveState:
        return {
            "memory_label": torch.zeros(0, dtype=torch.long, device=device),
            "memory_confidence": torch.zeros(0, device=device),
        }

    # ------------------------------------------------------------------------------------ memory
    def _update_memory(self, inputs: ObjectiveInputs, state: ObjectiveState, rows: torch.Tensor) -> None:
        c = self.config
        if rows.numel() == 0 or not inputs.queries:
            return
        with torch.no_grad():
            # ranked by max softmax of the raw cosines (x ood_logit_scale = 1), as the code's CCM (see the docstring)
            prob = (c.ood_logit_scale * inputs.scores.detach()[rows]).softmax(dim=1)
            conf, label = prob.max(dim=1)
            label = inputs.global_ids(label)
        raw = {k: v[rows.to(v.device)] for k, v in inputs.queries.items() if isinstance(v, torch.Tensor) and v.dim() > 0}
        old = {k[len(MEMORY_PREFIX):]: v for k, v in state.items() if k.startswith(MEMORY_PREFIX)}
        if old and (set(old) != set(raw) or any(old[k].shape[2:] != raw[k].shape[2:] for k in raw)):
            old = {}  # another input layout: start a new memory
        if old:
            try:
                merged = {k: _pad_cat(old[k], raw[k]) for k in raw}
            except RuntimeError:
                merged = raw
                state["memory_label"], state["memory_confidence"] = state["memory_label"][:0], state["memory_confidence"][:0]
        else:
            merged = raw
            state["memory_label"], state["memory_confidence"] = state["memory_label"][:0], state["memory_confidence"][:0]
        labels = torch.cat([state["memory_label"], label])
        confs = torch.cat([state["memory_confidence"], conf])
        keep = self.memory_keep(labels, confs, c.memory_shots, c.memory_size)
        for k, v in merged.items():
            state[MEMORY_PREFIX + k] = v[keep.to(v.device)]
        state["memory_label"], state["memory_confidence"] = labels[keep], confs[keep]

    @staticmethod
    def memory_keep(labels: torch.Tensor, confs: torch.Tensor, shots: int, size: int) -> torch.Tensor:
        """Indices kept: per label the ``shots`` most confident, then the ``size`` most confident overall (ties: older
        first)."""
        order = confs.argsort(descending=True, stable=True)
        rank_in_label = torch.zeros_like(labels)
        seen: dict[int, int] = {}
        for i in order.tolist():
            lab = int(labels[i])
            rank_in_label[i] = seen.get(lab, 0)
            seen[lab] = seen.get(lab, 0) + 1
        ok = order[rank_in_label[order] < shots]
        return ok[:size].sort().values

    def _memory_scores(self, inputs: ObjectiveInputs, state: ObjectiveState) -> torch.Tensor | None:
        """Scores of a random memory batch re-embedded by the current model (``None`` without a usable memory)."""
        c = self.config
        n = state["memory_label"].numel()
        if not c.use_memory or n < 2 or inputs.reencode is None:
            return None
        size = min(n, c.memory_sample_size or inputs.scores.shape[0])
        pick = torch.randperm(n, generator=inputs.generator)[:size].sort().values if size < n else torch.arange(n)
        memory = {k[len(MEMORY_PREFIX):]: v for k, v in state.items() if k.startswith(MEMORY_PREFIX)}
        _, m_scores = inputs.reencode(lambda _: select_rows(pick)(memory))
        return m_scores

    def on_gallery_change(self, change, state: ObjectiveState) -> None:
        """The memory keys its queries by the pseudo-label's gallery position: keys follow their items, and the memory
        queries whose pseudo-label was removed leave the memory (a replaced item keeps its queries: same id)."""
        labels = state["memory_label"]
        if labels.numel() == 0:
            return
        new = change.remap(labels)
        keep = new >= 0
        for key in [k for k in state if k.startswith(MEMORY_PREFIX)]:
            state[key] = state[key][keep.to(state[key].device)]
        state["memory_label"], state["memory_confidence"] = new[keep], state["memory_confidence"][keep]

    def ood_mask(self, scores: torch.Tensor) -> torch.Tensor:
        """``True`` for the queries the last threshold calls in-distribution (open set)."""
        c = self.config
        return ood_scores(scores, c.ood_score, c.tau, c.ood_logit_scale) > self.alpha.detach().to(scores.device)

    # ------------------------------------------------------------------------------------ loss
    def __call__(self, inputs: ObjectiveInputs, state: ObjectiveState) -> LossOutput:
        c = self.config
        scores = inputs.scores
        b = scores.shape[0]
        logs: dict[str, float] = {}
        loss = c.lambda_reg * marginal_entropy_regulariser(scores, c.tau)
        id_rows = torch.arange(b, device=scores.device)
        if c.open_set:
            s = ood_scores(scores, c.ood_score, c.tau, c.ood_logit_scale)
            if inputs.step == 0 and not inputs.in_closure:
                with torch.no_grad():
                    self.alpha.copy_(otsu_threshold(s, c.otsu_bins).to(self.alpha.device))
            l_oce, w = oce_loss(s, self.alpha, c.ood_gamma)
            loss = loss + c.lambda_oce * l_oce
            id_rows = (s.detach() > self.alpha.detach()).nonzero().flatten()
            logs.update(loss_oce=l_oce.detach(), alpha=self.alpha.detach().clone(), id_fraction=id_rows.numel() / b)
        if c.use_memory and inputs.step == 0 and not inputs.in_closure:
            self._update_memory(inputs, state, id_rows)
        top1 = scores.detach().argmax(dim=1)
        cols = top1[id_rows] if id_rows.numel() else top1  # the ID queries' pseudo-captions (all, if none is ID)
        logits = scores[:, cols] / c.tau  # every query against them (the prediction gradient decoupling regularises)
        l_sc = softmax_entropy(logits[id_rows]).mean() if id_rows.numel() else scores.sum() * 0
        m_scores = self._memory_scores(inputs, state)
        if m_scores is not None:
            l_mem = soft_contrastive_loss(m_scores, c.tau)
            if c.protocol == "cliptta":  # the code: memory terms added, and the memory batch regularised too
                l_sc = l_sc + l_mem
                loss = loss + c.lambda_reg * marginal_entropy_regulariser(m_scores, c.tau)
            else:
                l_sc = 0.5 * (l_sc + l_mem)
            logs["loss_memory"] = l_mem.detach()
        loss = loss + l_sc
        logs.update(loss_s_cont=l_sc.detach(), memory_size=state["memory_label"].numel())
        return LossOutput(
            loss=loss, n_selected=b, logits=logits, candidates=cols[None, :].expand(b, -1), temperature=c.tau, logs=logs
        )
