"""A window of recent queries, so that micro-batches of 1-8 queries get full-batch statistics (``TTAConfig.window``).

The papers compute their batch-level statistics over a batch of B = 64 queries. Online traffic arrives one or a few
queries at a time, and over one query those statistics are degenerate: TCR's refined prediction is a 1 x 1 softmax
(entropy 0), its uniformity centre is the query itself, EATA's/SAR's/DeYO's "lowest 40 % of the batch" keeps the one
query whatever its entropy, and the safety layer judges nothing under ``min_queries``. With ``TTAConfig(window=W)``
the wrapper keeps the last ``W`` queries it adapted on, **detached**, and each objective computes its batch statistic
over the current queries together with those rows: the loss is the full-batch loss of ``B + W`` rows of which only the
current ``B`` carry a gradient. ``window=0`` (the default) is the papers' per-batch statistics, unchanged.

What each row keeps (:class:`WindowView`): the query's embedding, the embedding of its top-1 gallery item (TCR's
candidate, Eq. 4), its top-1 gallery index under the adapted and under the source model (the safety layer's
signals; ``-1`` when the source model was not run, i.e. without the safety layer), and the count of queries pushed.

**Which view.** A row holds the query's embedding from the forward its batch was answered with (the last step's, or a
fresh forward for ``score_after_update`` objectives), not the frozen source model's. The window stands for the rest of a
batch that the *current* model would embed; the adapted view is the closer stand-in (the model moves slowly) and costs
nothing (that forward was run anyway). A source-model window would pin TCR's gap and uniformity statistics at the
source's values: at B = 1, W = 63 the gap term would ask the one current query to close the whole batch's gap alone.

**Where it applies** (each objective documents its part):
  * TCR: the refined prediction (Eq. 5) is over the candidates of all ``B + W`` rows, and L_NA, L_MU (Eq. 9) and
    L_MG (Eq. 10) are the means over all rows; the queue (Eq. 6) takes the current rows that are among the lowest-SI
    30 % of the ``B + W`` rows (SI centres over them too), while fewer than ``queue_update_batches x queue_size``
    queries have been pushed (the first 10 batches of 64 = the first 640 queries, at any batch size);
  * EATA, SAR, DeYO with ``selection="tcr_port"``: the batch-relative entropy thresholds (the k-th smallest entropy,
    k = int(fraction (B + W))) are taken over the current and the window's entropies (the window's recomputed against
    the current gallery at the objective's temperature); DeYO's E_0 over the current survivors of both filters and the
    window rows that pass the entropy filter (their PLPD would need their raw inputs: they count as passing).
    ``selection="paper"`` thresholds are absolute (``fraction * ln C``) and per query: unchanged. EATA's redundancy
    filter and SAR's EMA already run over the stream: unchanged;
  * DN: its query mean is already a stream statistic (the first ``num_samples`` queries, or a running mean), not a
    batch one: unchanged;
  * the safety layer (:mod:`hf_tta.safety`): diversity and agreement are over the current and the window's rows, and a
    batch is judged once ``B + W`` reaches ``min_queries``.

For a multi-vector query (BLIP-2 images) the scores against a window row's candidate use the single-vector view.

**State.** The rows are tensors of the objective's state (keys ``window.*``), so they belong to the
:data:`~hf_tta.state.OBJECTIVE` part: saved with ``save_pretrained`` and resumed bit-exactly, cleared by ``reset()``,
restored by a safety rollback or reset and by a step's undo, and kept per domain by ``RoutedTTAWrapper``. The rows of a
batch are pushed before the safety layer's decision is applied, so a flagged batch leaves no row (it is rolled back
with the rest) and a refreshed snapshot includes the batch's rows; a degenerate (skipped) batch is never pushed. Only
gradient objectives push rows (a training-free objective has no batch statistic to widen).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

PREFIX = "window."
KEYS = ("query", "candidate", "top1", "source_top1", "seen")


@dataclass(frozen=True)
class WindowView:
    """The window's rows as an objective sees them (all detached, oldest first).

    Args:
        query_emb (`torch.Tensor` of shape `(W, D)`): the recent queries' embeddings (float32).
        candidate_emb (`torch.Tensor` of shape `(W, D)`): the embedding of each row's top-1 gallery item.
        top1 (`torch.Tensor` of shape `(W,)`): each row's top-1 gallery index (adapted model, at its batch).
        source_top1 (`torch.Tensor` of shape `(W,)`): the same under the source model; ``-1`` = not computed.
        seen (`int`): queries pushed since the last reset, before the current batch.
        size (`int`): the window's capacity ``TTAConfig.window``.
    """

    query_emb: torch.Tensor
    candidate_emb: torch.Tensor
    top1: torch.Tensor
    source_top1: torch.Tensor
    seen: int
    size: int

    def __len__(self) -> int:
        return self.query_emb.shape[0]


def view(state: dict[str, torch.Tensor], size: int) -> WindowView | None:
    """The window held in an objective ``state`` (``None`` when ``size`` is 0: the window is off; empty rows before the
    first push)."""
    if not size:
        return None
    if PREFIX + "query" not in state:
        empty = torch.zeros(0)
        return WindowView(empty.reshape(0, 0), empty.reshape(0, 0), empty.long(), empty.long(), 0, size)
    rows = [state[PREFIX + k] for k in KEYS[:4]]
    return WindowView(*rows, seen=int(state[PREFIX + "seen"]), size=size)


def top1(scores: torch.Tensor, ids: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Each query's best column and its gallery index (the first on ties). With a top-k backend (``ids``: the
    candidates' gallery indices) the columns after the candidates (an objective's extra rows) are not gallery items."""
    if ids is None:
        col = scores.argmax(dim=1)
        return col, col
    col = scores[:, : ids.numel()].argmax(dim=1)
    return col, ids.to(col.device)[col]


@torch.no_grad()
def record(
    state: dict[str, torch.Tensor], size: int, inputs: Any, scores: torch.Tensor, source: Any,
) -> None:
    """Push the rows of the batch whose reported view is ``(inputs, scores)`` into the window in ``state`` (keeping the
    last ``size``; nothing when ``size`` is 0). ``source``: the source
    model's view of the batch (the safety layer's), for each row's source top-1; ``None`` records ``-1``. ``inputs``
    and ``source`` are :class:`~hf_tta.objectives.base.ObjectiveInputs` (this module imports no objective). Entries of
    ``state`` are replaced, never written in place."""
    if not size:
        return
    q = inputs.query_emb.detach().float()
    col, ids = top1(scores.detach(), inputs.candidate_ids)
    cand = inputs.gallery_emb.detach()[col.to(inputs.gallery_emb.device)].float().to(q.device)
    src = top1(source.scores, source.candidate_ids)[1] if source is not None else torch.full_like(ids, -1)
    new = {"query": q, "candidate": cand, "top1": ids.long(), "source_top1": src.long().to(ids.device)}
    for key, rows in new.items():
        old = state.get(PREFIX + key)
        rows = rows if old is None else torch.cat([old.to(rows.device), rows])
        state[PREFIX + key] = rows[-size:].clone()
    seen = state.get(PREFIX + "seen", torch.zeros((), dtype=torch.long))
    state[PREFIX + "seen"] = seen + q.shape[0]


# ---------------------------------------------------------------------------------------- helpers for the objectives
def entropies(inputs: Any, tau: float) -> torch.Tensor | None:
    """The window rows' entropies of ``softmax(z_w . Z^G / tau)`` over the current gallery (over the batch's candidates
    with a top-k backend, as for the current queries), or ``None`` without a window or rows."""
    w = inputs.window
    if w is None or not len(w):
        return None
    g = inputs.gallery_emb.detach().float()
    logits = w.query_emb.detach().to(g.device, torch.float32) @ g.T / tau
    logp = logits.float().log_softmax(dim=-1)
    return -(logp.exp() * logp).sum(dim=-1)
