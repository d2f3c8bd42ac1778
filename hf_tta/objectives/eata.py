"""EATA: Efficient Anti-forgetting Test-time Adaptation (Niu et al., ICML 2022, https://arxiv.org/abs/2204.02610),
applied to retrieval as TCR's baselines (Li et al., ICLR 2025, Eq. 1): the classifier is the softmax of the query-gallery
cosine similarities over the whole gallery divided by tau = 0.01 (TCR App. B.2).

Upstream: github.com/mr-eggplant/EATA (``eata.py``: ``forward_and_adapt_eata``, ``update_model_probs``).
TCR's reference code instantiates ``EATA(e_margin=0.40, fishers=None)``: no Fisher penalty by default.

Per step, with ``selection="tcr_port"`` (the default: EATA as TCR's baseline port ran it, the source of the numbers of
TCR's tables; the port's semantics as checked against it in issue 13):
  * reliable queries: the lowest ``e_margin`` = 40% entropies of the batch (k-th smallest, k = int(0.4 B), ``E <= E_k``);
  * loss weight 1/exp(E_i - e_margin), i.e. E_0 = 0.40 taken literally in the weight.
With ``selection="paper"`` (EATA Eq. 3-4 as published):
  * reliable queries: E < E_0 = e_margin * ln(C), C = gallery size; loss weight 1/exp(E_i - E_0).
In both:
  * non-redundant queries: |cos(p_i, m)| < d_margin, with m the moving average (0.9 / 0.1) of the selected queries'
    predictions (state ``model_probs``; the first step has none, so nothing is filtered then);
  * loss = mean over the selected queries of E_i * weight_i (detached weight), plus, when ``fisher_alpha > 0``,
    the EWC penalty alpha * sum F (theta - theta_0)^2 (Eq. 9).

With ``TTAConfig(window=W)`` the ``"tcr_port"`` selection's k-th smallest entropy is over the batch and the window's W
recent queries (k = int(0.4 (B + W)), :mod:`hf_tta.window`); the ``"paper"`` threshold is per query and the redundancy
filter's average runs over the stream already, so neither changes.

With a top-k gallery backend (``gallery_access="per_item"``) the softmax is over the batch's candidate set C (as for
the other entropy baselines) and ``model_probs`` stays a dense vector over all N items, keyed by global index: a step's
mean prediction (zero outside C) is scattered into it, and the redundancy cosine is taken between N-vectors whose
prediction part is zero outside C. With C the whole gallery this is the dense computation.

The Fisher information needs in-distribution data, which a test-time library does not have (EATA used 2,000 held-out
samples). Here it is estimated on the test stream itself: the squared gradients of the pseudo-label cross-entropy at
step 0 of the first ``fisher_batches`` batches, averaged (EATA's estimator); theta_0 is the exact source value. The
first of those batches is scored at exactly theta_0 when the stream starts from the source model.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .. import window
from ..configuration_utils import check_choice, check_fraction, check_positive
from .base import (
    SELECTIONS,
    LossOutput,
    Objective,
    ObjectiveConfig,
    ObjectiveInputs,
    ObjectiveState,
    config_field,
    gallery_tau_field,
    log_classes_margin,
    lowest_fraction,
    register_objective,
    softmax_entropy,
)


@dataclass
class EATAConfig(ObjectiveConfig):
    tau: float = gallery_tau_field()
    selection: str = config_field(
        "tcr_port",
        "'tcr_port' (default; TCR's baseline port): keep the lowest e_margin fraction of the batch's entropies (k-th "
        "smallest, <=), weight 1/exp(E - e_margin). 'paper' (EATA Eq. 3): keep E < e_margin * ln C, weight 1/exp(E - E_0).",
    )
    e_margin: float = config_field(0.4, "Entropy margin: batch fraction kept ('tcr_port': 0.40) or fraction of ln C ('paper': 0.4 ln C).")
    d_margin: float = config_field(0.05, "Redundancy threshold on |cos(p, moving average)| (EATA: 0.05).")
    probs_momentum: float = config_field(0.9, "Momentum of the moving average of predictions (EATA: 0.9).")
    fisher_alpha: float = config_field(0.0, "Weight of the Fisher (EWC) penalty; 0 = off, as TCR ran EATA (EATA paper: 2000).")
    fisher_batches: int = config_field(1, "Batches of the stream whose step-0 gradients estimate the Fisher (when fisher_alpha > 0).")

    def __post_init__(self):
        super().__post_init__()
        check_positive("tau", self.tau)
        check_positive("e_margin", self.e_margin)
        check_positive("d_margin", self.d_margin)
        check_fraction("probs_momentum", self.probs_momentum)
        check_positive("fisher_alpha", self.fisher_alpha, allow_zero=True)
        check_positive("fisher_batches", self.fisher_batches)
        check_choice("selection", self.selection, SELECTIONS)


def update_model_probs(
    current: torch.Tensor, new_probs: torch.Tensor, momentum: float = 0.9, columns: torch.Tensor | None = None,
    num_items: int | None = None,
) -> torch.Tensor:
    """EATA's ``update_model_probs``: an empty ``current`` (no average yet) takes the mean of ``new_probs``.
    ``columns`` (with ``num_items``): the gallery indices of ``new_probs``' columns; the mean is scattered into an
    ``num_items``-vector (zero elsewhere) first."""
    if new_probs.shape[0] == 0:
        return current
    mean = new_probs.detach().mean(0)
    if columns is not None:
        mean = torch.zeros(num_items, device=mean.device, dtype=mean.dtype).index_copy(0, columns.to(mean.device), mean)
    if current.numel() == 0:
        return mean
    return momentum * current + (1 - momentum) * mean


def eata_selection(
    logits: torch.Tensor, model_probs: torch.Tensor, e_margin: float, d_margin: float, selection: str = "tcr_port",
    columns: torch.Tensor | None = None, context: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(entropy, reliable mask, selected mask, E_0 of the weight)``; selected = reliable and non-redundant.

    ``"tcr_port"``: reliable = the lowest ``e_margin`` fraction (k-th smallest, ``<=``), E_0 = ``e_margin``;
    ``"paper"``: reliable = ``E < e_margin * ln C`` = E_0. ``columns``: the gallery indices of the logits' columns
    (a top-k backend's candidates) into the dense ``model_probs``. ``context``: the window's entropies, which join the
    batch for the ``"tcr_port"`` threshold (:mod:`hf_tta.window`)."""
    entropy = softmax_entropy(logits)
    if selection == "tcr_port":
        reliable, _ = lowest_fraction(entropy, e_margin, context)
        e_0 = torch.tensor(e_margin, device=entropy.device, dtype=entropy.dtype)
    else:
        e_0 = log_classes_margin(e_margin, entropy, logits.shape[1])
        reliable = entropy.detach() < e_0
    selected = reliable.clone()
    if columns is not None:
        if model_probs.numel() > 0:  # cosine of N-vectors, the prediction being zero outside the candidates
            p = logits.detach().softmax(dim=1)
            eps = 1e-8
            dot = p @ model_probs[columns.to(model_probs.device)].to(p)
            cos = dot / (p.norm(dim=1).clamp(min=eps) * model_probs.norm().clamp(min=eps))
            selected &= cos.abs() < d_margin
    elif model_probs.numel() == model_probs.shape[0] == logits.shape[1]:
        cos = F.cosine_similarity(model_probs[None, :], logits.detach().softmax(dim=1), dim=1)
        selected &= cos.abs() < d_margin
    return entropy, reliable, selected, e_0


@register_objective("eata", EATAConfig)
class EATA(Objective):
    """Sample-efficient entropy minimisation with an optional Fisher anti-forgetting penalty."""

    gallery_access = "per_item"  # running average of the softmax: an N-vector; the softmax itself is over C

    def init_state(self, device="cpu") -> ObjectiveState:
        return {
            "model_probs": torch.zeros(0, device=device),
            "fisher_updates": torch.zeros((), dtype=torch.long, device=device),
        }

    def on_gallery_change(self, change, state: ObjectiveState) -> None:
        """The running softmax average follows its items: removed items' entries go, added and replaced items start at
        0 (the average is not renormalised: it is compared by cosine, Eq. 6)."""
        probs = state["model_probs"]
        if probs.numel() == 0:
            return
        probs = change.remap_vector(probs)
        if change.kind == "replace":
            probs = probs.index_fill(0, change.positions.to(probs.device), 0.0)
        state["model_probs"] = probs

    def __call__(self, inputs: ObjectiveInputs, state: ObjectiveState) -> LossOutput:
        c = self.config
        logits = inputs.scores / c.tau
        ids = inputs.candidate_ids
        if state["model_probs"].numel() not in (0, inputs.num_items):  # another gallery: start the average again
            state["model_probs"] = state["model_probs"][:0]
        entropy, reliable, selected, e_0 = eata_selection(
            logits, state["model_probs"], c.e_margin, c.d_margin, c.selection, columns=ids,
            context=window.entropies(inputs, c.tau) if c.selection == "tcr_port" else None,
        )
        if not inputs.in_closure:
            state["model_probs"] = update_model_probs(
                state["model_probs"], logits.detach()[selected].softmax(1), c.probs_momentum, ids, inputs.num_items
            )
        logs = {"reliable": reliable.sum(), "selected": selected.sum(), "entropy_margin": e_0}
        if not selected.any():
            return LossOutput(loss=None, n_selected=0, logs=logs)
        ent = entropy[selected]
        loss = (ent / torch.exp(ent.detach() - e_0)).mean()
        if c.fisher_alpha > 0 and inputs.params:
            self._update_fisher(inputs, logits, state)
            if int(state["fisher_updates"]) > 0:
                ewc = self.ewc_penalty(inputs, state)
                loss = loss + c.fisher_alpha * ewc
                logs["ewc"] = ewc.detach()
        return LossOutput(loss=loss, n_selected=int(selected.sum()), logits=logits, temperature=c.tau, logs=logs)

    def _update_fisher(self, inputs: ObjectiveInputs, logits: torch.Tensor, state: ObjectiveState) -> None:
        """EATA's Fisher estimator: squared gradients of CE(logits, argmax), averaged over the estimation batches."""
        if inputs.step != 0 or inputs.in_closure or int(state["fisher_updates"]) >= self.config.fisher_batches:
            return
        names = list(inputs.params)
        ce = F.cross_entropy(logits, logits.detach().argmax(dim=1))
        grads = torch.autograd.grad(ce, [inputs.params[n] for n in names], retain_graph=True, allow_unused=True)
        n = int(state["fisher_updates"])
        for name, g in zip(names, grads):
            sq = torch.zeros_like(inputs.params[name]) if g is None else g.detach() ** 2
            key = f"fisher.{name}"
            state[key] = sq if n == 0 else (state[key] * n + sq) / (n + 1)
        state["fisher_updates"] = state["fisher_updates"] + 1

    @staticmethod
    def ewc_penalty(inputs: ObjectiveInputs, state: ObjectiveState) -> torch.Tensor:
        """``sum_k F_k (theta_k - theta_0,k)^2`` over the adapted tensors (EATA Eq. 9 without alpha)."""
        total = 0.0
        for name, p in inputs.params.items():
            total = total + (state[f"fisher.{name}"] * (p - inputs.source_params[name]) ** 2).sum()
        return total
