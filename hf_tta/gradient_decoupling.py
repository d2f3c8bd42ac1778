"""Gradient decoupling (GD), REST Eq. 15-17 (Li, Yang, Peng, "Toward Robust and Harmonious Adaptation for
Cross-modal Retrieval"), as a method-agnostic option of :class:`~hf_tta.TTAWrapper` (``TTAConfig(gradient_decoupling=GradientDecouplingConfig())``).

For any gradient objective whose :class:`~hf_tta.objectives.LossOutput` carries the prediction it is built on
(``logits``, with ``candidates``/``temperature`` or ``logits_fn``):

* the reference is the *frozen source model's* prediction over the same candidates, ``p̂_S``, formed from the source
  scores of the same queries (``ObjectiveInputs.source_scores()``: PEFT's disable-adapter, no second copy of the model);
* ``D = mean_i KL(p̂_S,i || p̂_i)`` (Eq. 15), ``G_r = ∇D`` (the "general" direction), ``G_d = ∇L`` (Eq. 16);
* if ``G_d · G_r < 0`` the component of ``G_d`` along ``G_r`` is removed; the update is scaled by
  ``W_d = exp(-D)`` (Eq. 17, D detached).

Where ``W_d`` acts (``GradientDecouplingConfig.weight_on``). Eq. 17 multiplies the gradient by ``W_d``, which shrinks the step of
plain SGD by ``W_d``. Under Adam(W), the optimiser of TCR's and REST's code, the update ``m / (sqrt(v) + eps)`` is
invariant to a constant rescaling of the gradient, so a weight on the gradient barely acts (a weight of 0.3 changed
the first step's norm by 0.01%, issue 13): GD would be a projection only. By default (``"step_size"``) ``W_d`` therefore
multiplies the optimiser's learning rate for that step (and is restored right after: :func:`scaled_step_size`), which
scales the whole AdamW update (the decoupled step and the decoupled weight decay) by exactly ``W_d`` — what Eq. 17 does
to an SGD step. ``"gradient"`` keeps the literal Eq. 17 (weight on the gradient). With SAM (SAR) the closure's second
pass is decoupled too and the weight of the first pass sets the base optimiser's step.

Granularity (the paper does not say): by default the dot product and the projection are taken over **one flattened
vector of all adapted parameters**; ``GradientDecouplingConfig(per_tensor=True)`` projects each parameter tensor on its own
(``W_d`` stays the global scalar). Theorem 2 (``Ĝ · G_r >= 0``) holds in both cases (per tensor, for each tensor).
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator, Mapping

import torch

from .objectives.base import LossOutput

#: Where the weight ``W_d`` of Eq. 17 acts: on the optimiser's step size (default) or on the gradient (literal Eq. 17).
WEIGHT_ON = ("step_size", "gradient")


@contextlib.contextmanager
def scaled_step_size(optimizer: torch.optim.Optimizer, factor: torch.Tensor | float | None) -> Iterator[None]:
    """Multiply every parameter group's learning rate by ``factor`` (``W_d``) for one ``optimizer.step``; the original
    values are put back afterwards (assigned, not divided, so they are restored bit for bit). ``None`` = no change.
    One host sync to read a tensor ``factor``."""
    if factor is None:
        yield
        return
    factor = float(factor)
    saved = [group["lr"] for group in optimizer.param_groups]
    for group, lr in zip(optimizer.param_groups, saved):
        group["lr"] = lr * factor
    try:
        yield
    finally:
        for group, lr in zip(optimizer.param_groups, saved):
            group["lr"] = lr


def source_logits(output: LossOutput, source_scores: torch.Tensor) -> torch.Tensor:
    """The frozen source model's logits over the same candidates as ``output.logits`` (no grad)."""
    if output.logits_fn is not None:
        return output.logits_fn(source_scores)
    cand = output.candidates
    logits = source_scores if cand is None else source_scores.gather(1, cand.to(source_scores.device))
    return logits / (output.temperature or 1.0)


def prediction_kl(source: torch.Tensor, adapted: torch.Tensor) -> torch.Tensor:
    """Eq. 15: ``mean_i KL(softmax(source_i) || softmax(adapted_i))``; gradients flow through ``adapted`` only."""
    log_ps = source.detach().float().log_softmax(dim=-1)
    log_p = adapted.float().log_softmax(dim=-1)
    return (log_ps.exp() * (log_ps - log_p)).sum(dim=-1).mean()


def decouple(g_d: torch.Tensor, g_r: torch.Tensor, weight: torch.Tensor | float) -> torch.Tensor:
    """Eq. 17 on one flat vector: drop the component of ``g_d`` along ``g_r`` when they conflict, then scale.
    Branch-free (no device sync): the coefficient is 0 unless ``g_d . g_r < 0`` (then ``||g_r|| > 0``)."""
    dot = torch.dot(g_d, g_r)
    coef = torch.where(dot < 0, dot / torch.dot(g_r, g_r).clamp(min=torch.finfo(g_r.dtype).tiny), torch.zeros_like(dot))
    return weight * (g_d - coef * g_r)


def apply_gradient_decoupling(
    output: LossOutput,
    params: Mapping[str, torch.nn.Parameter],
    source_scores: Callable[[], torch.Tensor],
    per_tensor: bool = False,
    objective_name: str = "",
    weight_on: str = "step_size",
) -> dict[str, torch.Tensor]:
    """Replace ``p.grad`` (holding ``G_d``, from ``loss.backward(retain_graph=True)``) by the decoupled gradient.

    ``weight_on="gradient"`` multiplies the gradient by ``W_d`` (Eq. 17 literally); ``"step_size"`` leaves the
    projected gradient unscaled and the caller scales the step by the returned ``gd_weight`` (:func:`scaled_step_size`).

    Returns diagnostics as 0-d tensors (no device sync): the KL, ``W_d``, the angle between ``G_d`` and ``G_r`` before
    projection (degrees) and whether the projection fired (flattened vector).
    """
    if weight_on not in WEIGHT_ON:
        raise ValueError(f"`weight_on` must be one of {list(WEIGHT_ON)}, got {weight_on!r}.")
    if output.logits is None:
        raise ValueError(
            f"gradient_decoupling=True needs the prediction the loss is built on, but objective {objective_name!r} "
            "returned no `LossOutput.logits`. Turn gradient decoupling off for it, or return its logits "
            "(with `candidates`/`temperature` or `logits_fn`)."
        )
    plist = list(params.values())
    with torch.no_grad():
        ref = source_logits(output, source_scores())
    logits = output.logits
    kl = prediction_kl(ref, logits).detach()
    # G_r = grad of mean_i KL_i through the logits, whose gradient is (softmax(logits) - p_S) / B. It is written out
    # rather than autograd'ed from the KL so that it is exactly zero at the source (p = p_S bit for bit): autograd's
    # -p_S + p * sum(p_S) leaves a rounding residue whose direction is noise, and the projection is scale-invariant.
    with torch.no_grad():
        grad_logits = (logits.detach().float().softmax(dim=-1) - ref.float().softmax(dim=-1)) / logits.shape[0]
    g_r = torch.autograd.grad(logits, plist, grad_outputs=grad_logits.to(logits.dtype), allow_unused=True)
    outside = [p.grad is None and g is None for p, g in zip(plist, g_r)]  # in neither graph
    g_r = [torch.zeros_like(p) if g is None else g for p, g in zip(plist, g_r)]
    g_d = [torch.zeros_like(p) if p.grad is None else p.grad for p in plist]
    weight = torch.exp(-kl)
    grad_weight = weight if weight_on == "gradient" else torch.ones_like(weight)
    flat_d = torch.cat([g.reshape(-1) for g in g_d])
    flat_r = torch.cat([g.reshape(-1) for g in g_r])
    dot = torch.dot(flat_d, flat_r)
    cos = dot / (flat_d.norm() * flat_r.norm()).clamp(min=torch.finfo(dot.dtype).tiny)  # 0 (90 degrees) if G_r = 0
    angle = torch.rad2deg(torch.acos(cos.clamp(-1, 1)))
    with torch.no_grad():
        if per_tensor:
            new = [decouple(d.reshape(-1), r.reshape(-1), grad_weight).view_as(d) for d, r in zip(g_d, g_r)]
        else:
            flat = decouple(flat_d, flat_r, grad_weight)
            new = list(torch.split(flat, [p.numel() for p in plist]))
            new = [n.view_as(p) for n, p in zip(new, plist)]
        for p, g, out in zip(plist, new, outside):
            if out:
                continue  # a parameter outside both graphs keeps no gradient (the optimiser skips it, as without GD)
            p.grad = g.to(p.dtype).clone()
    return {"gd_kl": kl, "gd_weight": weight, "gd_angle": angle, "gd_projected": (dot < 0).float()}
