"""TCR: Test-time adaptation for Cross-modal Retrieval with query shift (Li et al., ICLR 2025).

Paper: https://arxiv.org/abs/2410.15624 — code: github.com/XLearning-SCU/2025-ICLR-TCR (losses.py,
models/tta_baselines/tcr.py, commit de2e102). Equation numbers below are the paper's.

Per step, with B queries:
  * candidates: each query's nearest gallery item (Eq. 4); refined prediction p̂ = softmax(z^Q Z^{G'}^T / tau),
    a B x B matrix over the batch's candidates (Eq. 5), tau = 0.02;
  * source-like pairs: the 30% lowest SI scores (Eq. 6) enter a queue of size B (``queue_size``, 64 as in the
    authors' runs; a short batch does not shrink it), updated at step 0 of the
    first 10 batches only (App. B.3 and the code's ``num_update_signal``); from the queue come the source gap
    Delta_S (Eq. 7) and the entropy threshold E_m (Eq. 8);
  * L = L_NA (Eq. 11) + L_MU (Eq. 9) + L_MG (Eq. 10).

With ``TTAConfig(window=W)`` (:mod:`hf_tta.window`) the batch is the current B queries joined by the W recent
queries' detached rows: the refined prediction is (B + W) x (B + W), L_NA, L_MU and L_MG are their means over all
rows (the full-batch loss; only the current rows carry a gradient, and ``n_selected`` counts the window's selected
rows too, as a batch of B + W would), and the queue takes the current rows among the lowest-SI 30 % of the B + W, for
the first ``queue_update_batches x queue_size`` queries. Gradient decoupling keeps the current rows' B x B prediction.

The functions are pure functions of tensors so each equation is unit-tested on its own.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..configuration_utils import check_fraction, check_positive
from .base import (
    LossOutput,
    Objective,
    ObjectiveConfig,
    ObjectiveInputs,
    ObjectiveState,
    config_field,
    nearest_neighbours,
    register_objective,
    softmax_entropy,
)


# ----------------------------------------------------------------------------------------------- equations
def si_score(zq: torch.Tensor, zg: torch.Tensor) -> torch.Tensor:
    """Eq. 6: ``SI_i = 2||z_i^Q - z_i^G'|| - (||z_i^Q - mean(z^Q)|| + ||z_i^G' - mean(z^G')||)`` (batch centres)."""
    return 2 * (zq - zg).norm(dim=1) - ((zq - zq.mean(0)).norm(dim=1) + (zg - zg.mean(0)).norm(dim=1))


def modality_gap(zq: torch.Tensor, zg: torch.Tensor) -> torch.Tensor:
    """``||mean(z^Q) - mean(z^G')||`` (Eq. 7 on the queue, Delta_T of Eq. 10 on the batch)."""
    return (zq.mean(0) - zg.mean(0)).norm()


def uniformity_loss(zq: torch.Tensor, t: float = 10.0) -> torch.Tensor:
    """Eq. 9: ``L_MU = 1/B sum_i exp(-||z_i^Q - mean(z^Q)|| / t)``; the centre is not detached (as in the code)."""
    return torch.exp(-(zq - zq.mean(0)).norm(dim=1) / t).mean()


def gap_loss(zq: torch.Tensor, zg: torch.Tensor, delta_s: torch.Tensor) -> torch.Tensor:
    """Eq. 10: ``L_MG = (Delta_T - Delta_S)^2``."""
    return (modality_gap(zq, zg) - delta_s) ** 2


def noise_robust_entropy(
    entropy: torch.Tensor, e_max: torch.Tensor, eps: float = 1e-3
) -> tuple[torch.Tensor, torch.Tensor]:
    """Eq. 11 as the code computes it: weight ``S = max(1 - E.detach() / (E_m + eps), 0)`` and the mean of
    ``S * E`` over queries with ``E <= E_m``. Returns ``(loss, selected_mask)``; with nothing selected the loss
    is a zero that still depends on the inputs (the reference code would return NaN here). Computed as a masked
    sum over the count, so no host sync is needed."""
    weight = (1 - entropy.detach() / (e_max + eps)).clamp(min=0)
    mask = entropy.detach() <= e_max
    return torch.where(mask, entropy * weight, 0).sum() / mask.sum().clamp(min=1), mask


def update_queue(
    state: ObjectiveState, zq: torch.Tensor, zg: torch.Tensor, refined_logits: torch.Tensor, ratio: float, size: int,
    insert: int | None = None,
) -> None:
    """Append the ``int(ratio * B)`` lowest-SI pairs of the batch to the queue; once it holds ``size`` pairs or more,
    keep the ``size`` lowest-SI ones (code: ``losses.update_queue``, ``max_queue_size = 64``). ``size`` is the configured
    capacity, never the current batch's size, so a short batch does not shrink the queue. Entropies are those at
    insertion time. The queue is kept in the embeddings' dtype (as the code keeps CLIP's fp16 features). ``insert``
    (with a window): only the first ``insert`` rows (the current batch's) of the lowest-SI ones enter; the window's
    rows were offered when they were current."""
    with torch.no_grad():
        zq, zg = zq.detach(), zg.detach().to(zq.dtype)
        si = si_score(zq, zg)
        ent = softmax_entropy(refined_logits.detach()).to(zq.dtype)
        k = max(1, int(ratio * zq.shape[0]))  # the code's int(0.3 * 64) = 19; max(1, .) keeps tiny batches usable
        idx = si.argsort()[:k]
        if insert is not None:
            idx = idx[idx < insert]
        q_si = torch.cat([state["queue_si"].to(zq.dtype), si[idx]])
        q_q = torch.cat([state["queue_q"].to(zq.dtype).reshape(-1, zq.shape[1]), zq[idx]])
        q_g = torch.cat([state["queue_g"].to(zq.dtype).reshape(-1, zg.shape[1]), zg[idx]])
        q_e = torch.cat([state["queue_entropy"].to(zq.dtype), ent[idx]])
        if q_si.numel() >= size:
            keep = q_si.argsort(stable=True)[:size]
            q_si, q_q, q_g, q_e = q_si[keep], q_q[keep], q_g[keep], q_e[keep]
        state.update(queue_si=q_si, queue_q=q_q, queue_g=q_g, queue_entropy=q_e)
        state["queue_updates"] = state["queue_updates"] + 1


def queue_constraints(state: ObjectiveState) -> tuple[torch.Tensor, torch.Tensor]:
    """Eq. 7 and 8 on the queue: ``(Delta_S, E_m)``. The code re-normalises the queued rows first (a no-op for
    normalised embeddings, kept for fidelity)."""
    qq = torch.nn.functional.normalize(state["queue_q"], dim=1)
    qg = torch.nn.functional.normalize(state["queue_g"], dim=1)
    return modality_gap(qq, qg), state["queue_entropy"].max()


def init_queue_state(device) -> ObjectiveState:
    return {
        "queue_si": torch.zeros(0, device=device),
        "queue_q": torch.zeros(0, device=device),
        "queue_g": torch.zeros(0, device=device),
        "queue_entropy": torch.zeros(0, device=device),
        "queue_updates": torch.zeros((), dtype=torch.long, device=device),
    }


# ----------------------------------------------------------------------------------------------- objective
@dataclass
class TCRConfig(ObjectiveConfig):
    tau: float = config_field(0.02, "Temperature of the refined prediction (Eq. 5); 0.02 in all TCR experiments.")
    uniformity_t: float = config_field(10.0, "t of Eq. 9 (the code's multiplier 0.1 = 1/t).")
    source_ratio: float = config_field(0.3, "Fraction of lowest-SI pairs taken as source-like (Eq. 6; code con_ratio).")
    queue_size: int = config_field(
        64, "Queue capacity: the configured batch size B (Alg. 1; 64 in the authors' runs), not the current batch's size."
    )
    queue_update_batches: int = config_field(10, "The queue is updated at step 0 of the first N batches only (App. B.3).")
    entropy_eps: float = config_field(1e-3, "eps in S = max(1 - E/(E_m + eps), 0) (code).")
    weight_na: float = config_field(1.0, "Weight of L_NA (Eq. 3: 1).")
    weight_mu: float = config_field(1.0, "Weight of L_MU (Eq. 3: 1).")
    weight_mg: float = config_field(1.0, "Weight of L_MG (Eq. 3: 1).")

    def __post_init__(self):
        super().__post_init__()
        check_positive("tau", self.tau)
        check_positive("uniformity_t", self.uniformity_t)
        check_fraction("source_ratio", self.source_ratio)
        check_positive("queue_size", self.queue_size)
        check_positive("queue_update_batches", self.queue_update_batches)
        for name in ("entropy_eps", "weight_na", "weight_mu", "weight_mg"):
            check_positive(name, getattr(self, name), allow_zero=True)


def refine(inputs: ObjectiveInputs, tau: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Eq. 4-5: nearest-neighbour candidates, their embeddings and the B x B refined logits.

    ``scores[:, nn]`` equals ``z^Q (Z^{G'})^T`` (exact also for multi-vector models)."""
    nn_idx = nearest_neighbours(inputs.scores)
    return nn_idx, inputs.gallery_emb[nn_idx], inputs.scores[:, nn_idx] / tau


def maybe_update_queue(config, inputs: ObjectiveInputs, state: ObjectiveState, zg, logits, zq=None) -> None:
    """Queue update at step 0 while fewer than ``queue_update_batches`` updates were made; with a window (``zq``, ``zg``
    and ``logits`` are then of the batch and the window's rows) while fewer than ``queue_update_batches x queue_size``
    queries were pushed (the same first 640 queries at any batch size)."""
    if inputs.step != 0:
        return
    w = inputs.window
    if w is None:
        if int(state["queue_updates"]) < config.queue_update_batches:
            update_queue(state, inputs.query_emb, zg, logits, config.source_ratio, config.queue_size)
    elif w.seen < config.queue_update_batches * config.queue_size:
        n = inputs.query_emb.shape[0]
        update_queue(state, zq, zg, logits, config.source_ratio, config.queue_size, insert=n)


def with_window(inputs: ObjectiveInputs, zg: torch.Tensor, logits: torch.Tensor, tau: float):
    """The batch joined by the window's rows (:mod:`hf_tta.window`): ``(zq, zg, logits)`` of ``B + W`` rows, the refined
    logits (Eq. 5) over the candidates of all of them; only the current rows carry a gradient. Without a window (or
    rows) the inputs are returned as they are."""
    w = inputs.window
    zq = inputs.query_emb
    if w is None or not len(w):
        return zq, zg, logits
    wq, wg = w.query_emb.detach().to(zq), w.candidate_emb.detach().to(zq)
    zg = zg.to(zq)
    current = torch.cat([logits, zq @ wg.T / tau], dim=1)
    past = torch.cat([wq @ zg.T, wq @ wg.T], dim=1) / tau
    return torch.cat([zq, wq]), torch.cat([zg, wg]), torch.cat([current.to(past), past])


@register_objective("tcr", TCRConfig)
class TCR(Objective):
    """``L = L_NA + L_MU + L_MG`` on the refined B x B prediction (TCR Eq. 3)."""
    gallery_access = "topk"  # top-1 candidates only (Eq. 4): exact with any top-k backend
    gallery_k = 1

    def init_state(self, device="cpu") -> ObjectiveState:
        return init_queue_state(device)

    def __call__(self, inputs: ObjectiveInputs, state: ObjectiveState) -> LossOutput:
        c = self.config
        nn_idx, zg_batch, logits = refine(inputs, c.tau)
        zq, zg, logits_all = with_window(inputs, zg_batch, logits, c.tau)
        maybe_update_queue(c, inputs, state, zg, logits_all, zq)
        if state["queue_si"].numel() == 0:  # no source-like pair yet (a skipped first step): nothing to compare to
            return LossOutput(loss=None, n_selected=0, logs={"queue_size": 0.0})
        delta_s, e_max = queue_constraints(state)
        entropy = softmax_entropy(logits_all)
        l_na, mask = noise_robust_entropy(entropy, e_max, c.entropy_eps)
        l_mu = uniformity_loss(zq, c.uniformity_t)
        l_mg = gap_loss(zq, zg, delta_s)
        loss = c.weight_na * l_na + c.weight_mu * l_mu + c.weight_mg * l_mg
        return LossOutput(
            loss=loss,
            n_selected=mask.sum(),  # a 0-d tensor: the wrapper reads it without a sync per step (TTAConfig.fast_step)
            logits=logits,
            candidates=nn_idx[None, :].expand(len(nn_idx), -1),
            temperature=c.tau,
            logs={
                "loss_na": l_na.detach(),
                "loss_mu": l_mu.detach(),
                "loss_mg": l_mg.detach(),
                "delta_s": delta_s,
                "entropy_threshold": e_max,
            },
        )
