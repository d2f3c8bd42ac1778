"""DeYO: Destroy Your Object (Lee, Jung, Chung, Kim, Shin, Park, ICLR 2024, https://arxiv.org/abs/2403.07366),
applied to retrieval as TCR's baselines (Li et al., ICLR 2025): softmax over the whole gallery at tau = 0.01.

Upstream: github.com/Jhyun17/DeYO (``deyo.py``). TCR's code instantiates ``DeYO(deyo_margin=0.50, margin_e0=0.40)``.
How those two numbers are read depends on ``selection``.

``selection="tcr_port"`` (default: DeYO as TCR's baseline port ran it, the source of TCR's table rows). The port
exists only as bytecode, ``models/tta_baselines/__pycache__/deyo.cpython-39.pyc`` of github.com/XLearning-SCU/2025-ICLR-TCR
(``forward_and_adapt_deyo``); its disassembly is the source followed here (offsets in brackets):
  1. entropy filter per batch: k = int(``deyo_margin`` B) (0.5: 32 of 64), E_k the k-th smallest entropy, keep
     ``E < E_k`` **strictly** (31 of 64 without ties) [82-122: ``torch.where(entropys < deyo_threshold)``]; k = 0 keeps
     nothing [126];
  2. the shape-destroying view of the selected queries (below), re-embedded by the current model without grad [252-750];
     text queries are **not** augmented: the port re-encodes the queries themselves, so PLPD = 0 (no re-encoding is
     spent on them here), and it sets the PLPD threshold to -1 for them [752: ``args.plpd_threshold = -1``], so every
     entropy-selected text query trains (``plpd_threshold`` applies to the other modalities);
  3. PLPD filter: PLPD > ``plpd_threshold`` = 0.0 [1008-1022];
  4. loss = mean over the kept queries of E * (1/(exp(E - E_0) + 0.1) + (exp(PLPD) + 0.1)) [1400-1482], E_0 the
     k'-th smallest entropy **of the queries that survived both filters**, k' = int(``margin_e0`` n), taken as
     ``torch.topk(entropys, k', largest=False)[0][-1]`` on the entropies that still carry the graph [1308-1374]; E_0 =
     +inf (entropy weight 10) when k' = 0 [1378-1398]. The weight detaches only the per-query entropy E (``coeff``
     from ``entropys.clone().detach()``), so **the gradient also flows through E_0** into the query whose entropy is
     the k'-th smallest: d loss / d E_0 = mean_i E_i exp(E_i - E_0) / (exp(E_i - E_0) + 0.1)^2. This follows the code;
     DeYO's paper (and ``"paper"`` below) treats the weights, its E_0 = ``margin_e0`` ln C included, as constants.

``selection="paper"`` (DeYO as published, thresholds as fractions of ln C, C = the number of softmax columns, here the
gallery size; ``plpd_threshold`` 0.2 in the paper — set it):
  1. entropy filter: E < deyo_margin * ln C;
  2. the shape-destroying view, text queries included (token shuffle);
  3. PLPD filter: PLPD > plpd_threshold;
  4. loss = mean over the kept queries of E * (exp(-(E - margin_e0 ln C)) + exp(PLPD)) (``reweight_ent`` and
     ``reweight_plpd``, both on by default; weights detached).

The shape-destroying view (``ObjectiveInputs.reencode``): image queries are cut into a ``patch_len`` x ``patch_len`` grid
whose patches are shuffled (DeYO's default ``aug_type='patch'``; video frames share one permutation; any other
array-like modality, e.g. audio spectrograms, is shuffled the same way over its last two axes); text queries (paper
mode) get the analogous *token shuffle*: the tokens between the first and the last valid position (so [CLS]/<bos> and
[SEP]/<eos>, where the towers pool, stay put) are permuted, padding untouched. Draws use the wrapper's seeded RNG.
PLPD = p(y_hat | x) - p(y_hat | x'), y_hat = argmax p(. | x).

With ``TTAConfig(window=W)`` (:mod:`hf_tta.window`), ``"tcr_port"``'s batch-relative thresholds take the window's W
recent queries in: the entropy filter's k-th smallest is over the batch and the window (k = int(0.5 (B + W))), and E_0
over the survivors of both filters and the window rows that pass the entropy filter (their PLPD would need their raw
inputs, so they count as passing). ``"paper"``'s thresholds are absolute and per query: unchanged.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .. import window
from ..configuration_utils import check_choice, check_positive
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
    register_objective,
    select_rows,
    softmax_entropy,
)

TEXT_KEYS = ("input_ids", "token_type_ids", "position_ids")
PORT_TEXT_PLPD_THRESHOLD = -1.0  # deyo.cpython-39.pyc offset 752: args.plpd_threshold = -1 for text queries

logger = logging.getLogger(__name__)


@dataclass
class DeYOConfig(ObjectiveConfig):
    tau: float = gallery_tau_field()
    selection: str = config_field(
        "tcr_port",
        "'tcr_port' (default; TCR's port): E below the k-th smallest, k = int(deyo_margin B) (strict <), E_0 = the "
        "k'-th smallest of the survivors of both filters, k' = int(margin_e0 n), weights 1/(exp(E - E_0) + 0.1) + "
        "(exp(PLPD) + 0.1), E_0 keeping its gradient; text queries not augmented and trained with PLPD threshold -1. "
        "'paper' (DeYO): E < deyo_margin * ln C, E_0 = margin_e0 * ln C, weights exp(-(E - E_0)) + exp(PLPD), token shuffle.",
    )
    deyo_margin: float = config_field(0.5, "Entropy filter: batch fraction ('tcr_port', strict <) or fraction of ln C ('paper'); TCR code: 0.5.")
    margin_e0: float = config_field(0.4, "E_0 of the entropy weight: fraction of the filtered queries ('tcr_port') or of ln C ('paper'); TCR code: 0.4.")
    plpd_threshold: float = config_field(0.0, "PLPD filter: keep PLPD > this (TCR's port: 0.0, and -1 for text queries; DeYO paper: 0.2).")
    reweight_ent: bool = config_field(True, "Weight by exp(-(E - E_0)) (DeYO: on).")
    reweight_plpd: bool = config_field(True, "Weight by exp(PLPD) (DeYO: on).")
    patch_len: int = config_field(4, "Grid size of the patch shuffle of array-like queries (DeYO: 4, i.e. 4 x 4 patches).")

    def __post_init__(self):
        super().__post_init__()
        check_positive("tau", self.tau)
        check_positive("deyo_margin", self.deyo_margin)
        check_positive("margin_e0", self.margin_e0)
        check_positive("patch_len", self.patch_len)
        check_choice("selection", self.selection, SELECTIONS)


def patch_shuffle(x: torch.Tensor, patch_len: int, generator: torch.Generator | None = None) -> torch.Tensor:
    """DeYO's patch shuffle on the last two axes of ``x`` (``(B, ..., H, W)``): resize to a multiple of ``patch_len``,
    permute the ``patch_len**2`` patches of each sample (one permutation per sample), resize back."""
    b, h0, w0 = x.shape[0], x.shape[-2], x.shape[-1]
    mid = x.shape[1:-2]
    p = patch_len
    h, w = max(1, h0 // p), max(1, w0 // p)
    flat = x.reshape(b, -1, h0, w0).float()
    if (h * p, w * p) != (h0, w0):
        flat = F.interpolate(flat, size=(h * p, w * p), mode="bilinear", align_corners=False)
    m = flat.shape[1]
    patches = flat.reshape(b, m, p, h, p, w).permute(0, 2, 4, 1, 3, 5).reshape(b, p * p, m, h, w)
    perm = torch.rand(b, p * p, generator=generator).argsort(dim=1).to(x.device)
    patches = patches[torch.arange(b, device=x.device)[:, None], perm]
    out = patches.reshape(b, p, p, m, h, w).permute(0, 3, 1, 4, 2, 5).reshape(b, m, h * p, w * p)
    if (h * p, w * p) != (h0, w0):
        out = F.interpolate(out, size=(h0, w0), mode="bilinear", align_corners=False)
    return out.reshape(b, *mid, h0, w0).to(x.dtype)


def token_shuffle(inputs: dict, generator: torch.Generator | None = None) -> dict:
    """Permute each sequence's tokens strictly between its first and last valid position (``attention_mask``).
    ``input_ids`` and ``token_type_ids`` are permuted alike; ``attention_mask`` and ``position_ids`` stay, so the
    shuffled tokens take new positions."""
    ids = inputs["input_ids"]
    b, length = ids.shape
    mask = inputs.get("attention_mask")
    valid = (mask.bool() if mask is not None else torch.ones_like(ids, dtype=torch.bool)).cpu()
    pos = torch.arange(length).expand(b, -1)
    big = torch.full_like(pos, length)
    first = torch.where(valid, pos, big).amin(dim=1, keepdim=True)
    last = torch.where(valid, pos, -1).amax(dim=1, keepdim=True)
    inner = valid & (pos > first) & (pos < last)
    # Vectorised per-row permutation of the inner positions: sort them by position (targets) and by random keys
    # (sources); every other position sorts after them in its own order in both lists (stable sorts), so it maps
    # to itself.
    keys = torch.rand(b, length, generator=generator)
    inf = torch.tensor(float("inf"))
    targets = torch.where(inner, pos.float(), inf).argsort(dim=1, stable=True)
    sources = torch.where(inner, keys, inf).argsort(dim=1, stable=True)
    index = torch.empty_like(pos).scatter_(1, targets, sources).to(ids.device)
    out = dict(inputs)
    for key in ("input_ids", "token_type_ids"):
        if key in out and isinstance(out[key], torch.Tensor) and out[key].shape == ids.shape:
            out[key] = out[key].gather(1, index)
    return out


def destroy_view(inputs: dict, modality: str, patch_len: int, generator: torch.Generator | None = None) -> dict:
    """The shape-destroying view of a query batch: token shuffle for text, patch shuffle for the others."""
    if modality == "text" or "input_ids" in inputs:
        return token_shuffle(inputs, generator)
    out = dict(inputs)
    for key, value in inputs.items():
        if isinstance(value, torch.Tensor) and value.is_floating_point() and value.dim() >= 3:
            out[key] = patch_shuffle(value, patch_len, generator)
            return out
    raise ValueError(f"DeYO found no array-like {modality} input to shuffle (keys: {sorted(inputs)}).")


def plpd(probs: torch.Tensor, probs_view: torch.Tensor) -> torch.Tensor:
    """Pseudo-label probability difference ``p(y_hat|x) - p(y_hat|x')`` with ``y_hat = argmax p(.|x)``."""
    y = probs.argmax(dim=1, keepdim=True)
    return (probs.gather(1, y) - probs_view.gather(1, y)).squeeze(1)


def port_kth_smallest(values: torch.Tensor, fraction: float) -> torch.Tensor | None:
    """TCR's port: ``torch.topk(values, k, largest=False)[0][-1]``, the k-th smallest of ``values`` with
    ``k = int(len(values) * fraction)`` (capped at ``len(values)``), or ``None`` when ``k = 0``. It keeps ``values``'
    graph, as the port's does (E_0's gradient reaches the k-th smallest entry); pass detached values for a threshold."""
    k = min(int(values.shape[0] * fraction), values.shape[0])
    return torch.topk(values, k, largest=False).values[-1] if k > 0 else None


@register_objective("deyo", DeYOConfig)
class DeYO(Objective):
    """Entropy minimisation on queries that are confident and whose prediction depends on their shape (PLPD)."""

    def __init__(self, config=None):
        super().__init__(config)
        self._told_text_threshold = False  # the port's text PLPD threshold is logged once

    def __call__(self, inputs: ObjectiveInputs, state: ObjectiveState) -> LossOutput:
        c = self.config
        if inputs.reencode is None:
            raise ValueError("DeYO needs ObjectiveInputs.reencode to embed the shuffled queries (TTAWrapper provides it).")
        logits = inputs.scores / c.tau
        entropy = softmax_entropy(logits)
        port = c.selection == "tcr_port"
        context = window.entropies(inputs, c.tau) if port else None  # TTAConfig.window: the recent queries join
        if port:  # deyo.cpython-39.pyc offsets 82-126: E < the k-th smallest (strict), nothing when k = 0
            pool = entropy.detach() if context is None else torch.cat([entropy.detach(), context.to(entropy)])
            e_k = port_kth_smallest(pool, c.deyo_margin)
            mask = entropy.detach() < e_k if e_k is not None else torch.zeros_like(entropy, dtype=torch.bool)
            if context is not None:  # the window rows past the entropy filter count for E_0 (their PLPD is unknown)
                context = context[context < e_k].to(entropy) if e_k is not None else context[:0]
        else:
            mask = entropy.detach() < log_classes_margin(c.deyo_margin, entropy, logits.shape[1])
        first = mask.nonzero().flatten()
        logs = {"entropy_selected": float(first.numel())}
        if first.numel() == 0:
            return LossOutput(loss=None, n_selected=0, logs=logs)
        probs = logits[first].detach().softmax(dim=1)
        text = inputs.query_modality == "text" or (inputs.queries is not None and "input_ids" in inputs.queries)
        threshold = c.plpd_threshold
        if port and text:
            diff = torch.zeros(first.numel(), device=probs.device, dtype=probs.dtype)  # x' = x: PLPD = 0
            threshold = PORT_TEXT_PLPD_THRESHOLD
            if c.plpd_threshold != threshold and not self._told_text_threshold:
                self._told_text_threshold = True
                logger.info("DeYO (selection='tcr_port') on text queries: PLPD threshold %s replaced by %s, as TCR's port "
                            "does (deyo.cpython-39.pyc offset 752).", c.plpd_threshold, threshold)
        else:
            gen = inputs.generator
            with torch.no_grad():
                _, view_scores = inputs.reencode(
                    lambda q: destroy_view(select_rows(first)(q), inputs.query_modality, c.patch_len, gen)
                )
            diff = plpd(probs, (view_scores / c.tau).softmax(dim=1))
        keep = diff > threshold
        logs["plpd"] = diff.mean()
        if not keep.any():
            return LossOutput(loss=None, n_selected=0, logs=logs)
        ent, d = entropy[first][keep], diff[keep]
        loss = ent
        if c.reweight_ent or c.reweight_plpd:
            e = ent.detach()
            if port:  # offsets 1308-1398: E_0 from the survivors of both filters, with their graph; +inf when k' = 0
                e_0 = port_kth_smallest(ent if context is None else torch.cat([ent, context.to(ent)]), c.margin_e0)
                e_0 = e_0 if e_0 is not None else torch.full((), float("inf"), dtype=e.dtype, device=e.device)
                w_ent, w_plpd = 1 / (torch.exp(e - e_0) + 0.1), torch.exp(d) + 0.1
            else:
                e_0 = log_classes_margin(c.margin_e0, entropy, logits.shape[1])
                w_ent, w_plpd = torch.exp(-(e - e_0)), torch.exp(d)
            logs["e_0"] = e_0.detach()
            loss = ent * (float(c.reweight_ent) * w_ent + float(c.reweight_plpd) * w_plpd)
        return LossOutput(loss=loss.mean(), n_selected=int(keep.sum()), logits=logits, temperature=c.tau, logs=logs)
