"""The reference query bank of the bank-based score transforms (NNN, QB-Norm: :mod:`hf_tta.objectives.nnn`,
:mod:`hf_tta.objectives.qbnorm`).

Both papers correct a gallery item's scores with its scores against a bank of *other* queries: NNN (Chowdhury et al.,
EMNLP 2024) with the mean of each item's top-k scores against "reference queries", QB-Norm (Bogolin et al., CVPR 2022)
with an inverted softmax over a "querybank". Their code takes a fixed bank drawn from the training split: NNN's example
(``examples/nnn_clip_flickr_30k.py``) embeds all Flickr30k training captions, QB-Norm's README (step 1) the similarity
matrix of the training captions against the test gallery. A test-time stream has no training queries, so by default the
bank here is drawn **from the stream, online**: the last ``bank_size`` query embeddings answered, first in first out,
each batch scored against the bank of the queries *before* it and then pushed (prequential: a query never normalises
its own scores). ``bank_size = 4096`` is this library's choice (the papers' banks are whole training splits, 10^4 to
10^5 captions; 4096 keeps NNN's k = 128 neighbours at 3 % of the bank, as 128 of Flickr30k's 145k captions is far less,
and costs one 4096 x N product per batch). A user-supplied bank (``reference_bank``: a safetensors file with an
``embeddings`` tensor ``(M, D)`` of L2-normalised query embeddings, :func:`save_reference_bank`) is the papers' setting:
it is used whole and never changes.

The bank is score-transform state (``bank``, ``bank_seen``): saved with ``save_pretrained`` (safetensors), resumed
bit-exactly, emptied (or, with ``reference_bank``, reloaded) by ``reset()``. The query embeddings pushed are those the
transform sees: the adapted model's under a gradient objective (the bank then mixes embeddings from the recent models,
as the stream's queries do).

Scores of the bank against the gallery are computed in column chunks (:func:`column_chunks`), so an ``M x N`` matrix is
never held whole; a multi-vector gallery (BLIP-2 images) is scored as the model scores it (the max over each item's
vectors, ``ObjectiveInputs.gallery_items``). Multi-vector *queries* are refused (the bank holds single vectors).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Iterator

import torch

from .configuration_utils import check_positive_int
from .gallery.base import item_scores
from .objectives.base import ObjectiveConfig, ObjectiveInputs, ObjectiveState, config_field

BANK_SIZE = 4096
#: Elements of one chunk of bank-against-gallery scores (64 MiB of float32).
CHUNK_ELEMENTS = 2**24


@dataclass
class QueryBankConfig(ObjectiveConfig):
    """Where the reference queries come from (see :mod:`hf_tta.query_bank`)."""

    bank_size: int = config_field(BANK_SIZE, "Queries kept in the stream's bank (first in, first out); not with reference_bank.")
    reference_bank: str | None = config_field(
        None, "A safetensors file whose `embeddings` (M, D) are the reference queries (the papers' fixed bank); None = the stream's."
    )

    def __post_init__(self):
        super().__post_init__()
        check_positive_int("bank_size", self.bank_size)
        if self.reference_bank is not None:
            if self.bank_size != BANK_SIZE:
                raise ValueError("`bank_size` sizes the stream's bank; a `reference_bank` is used whole: drop bank_size.")
            if not os.path.isfile(self.reference_bank):
                raise ValueError(f"`reference_bank` {self.reference_bank!r} is not a file: write it with hf_tta.query_bank.save_reference_bank.")


def save_reference_bank(path: str | os.PathLike, embeddings: torch.Tensor) -> str:
    """Write ``embeddings`` ``(M, D)`` (the reference queries embedded by the source model's query tower, L2-normalised,
    e.g. ``wrapper.embed_and_score(queries, gallery)[0]`` inside ``wrapper.disabled()``) for ``reference_bank``."""
    from safetensors.torch import save_file

    check_bank(embeddings, str(path))
    save_file({"embeddings": embeddings.detach().float().contiguous().cpu()}, str(path))
    return str(path)


def check_bank(bank: torch.Tensor, where: str) -> None:
    """A bank is a finite ``(M, D)`` float tensor of unit rows, ``M >= 1`` (one line otherwise)."""
    if not isinstance(bank, torch.Tensor) or bank.dim() != 2 or bank.shape[0] == 0 or not bank.is_floating_point():
        shape = tuple(bank.shape) if isinstance(bank, torch.Tensor) else type(bank).__name__
        raise ValueError(f"The reference bank {where} must be a non-empty float (M, D) tensor of query embeddings, got {shape}.")
    if not torch.isfinite(bank).all() or not torch.allclose(bank.float().norm(dim=1), torch.ones(()), atol=1e-3):
        raise ValueError(f"The reference bank {where} must hold finite L2-normalised embeddings (as the wrapper's queries are).")


def init_bank(config: QueryBankConfig, device: torch.device | str = "cpu") -> ObjectiveState:
    """The bank's state: empty for the stream's bank, the file's embeddings for ``reference_bank``."""
    if config.reference_bank is None:
        bank = torch.zeros(0, device=device)
    else:
        from safetensors.torch import load_file

        tensors = load_file(config.reference_bank)
        if "embeddings" not in tensors:
            raise ValueError(f"`reference_bank` {config.reference_bank!r} has no `embeddings` tensor: write it with save_reference_bank.")
        check_bank(tensors["embeddings"], repr(config.reference_bank))
        bank = tensors["embeddings"].float().to(device)
    return {"bank": bank, "bank_seen": torch.zeros((), dtype=torch.long, device=device)}


def current_bank(inputs: ObjectiveInputs, state: ObjectiveState) -> torch.Tensor:
    """The bank before this batch, ``(M, D)`` (``M = 0`` at the start of a stream); refuses a bank of another width."""
    bank = state["bank"]
    if bank.numel() and bank.shape[1] != inputs.query_emb.shape[1]:
        raise ValueError(
            f"The reference bank holds {bank.shape[1]}-d embeddings but the queries are {inputs.query_emb.shape[1]}-d: "
            "embed the bank with this model's query tower."
        )
    return bank.to(inputs.query_emb.device) if bank.numel() else bank.reshape(0, inputs.query_emb.shape[1]).to(inputs.query_emb.device)


def push(config: QueryBankConfig, inputs: ObjectiveInputs, state: ObjectiveState) -> None:
    """After the batch was scored: its queries join the stream's bank (the oldest leave beyond ``bank_size``); a
    ``reference_bank`` does not change. Entries are replaced, never written in place."""
    if config.reference_bank is not None:
        return
    q = inputs.query_emb.detach().float()
    bank = current_bank(inputs, state)
    state["bank"] = torch.cat([bank, q])[-config.bank_size :].clone()
    state["bank_seen"] = state["bank_seen"] + q.shape[0]


def gallery_rows(inputs: ObjectiveInputs) -> torch.Tensor:
    """The rows of ``inputs.scores``' columns as the model scores them: ``(C, D)``, or ``(C, Q, D)`` multi-vector."""
    return inputs.gallery_items if inputs.gallery_items is not None else inputs.gallery_emb.detach()


def column_chunks(bank: torch.Tensor, rows: torch.Tensor) -> Iterator[tuple[int, torch.Tensor]]:
    """``(start, S)`` with ``S`` the bank's scores ``(M, c)`` against the next ``c`` gallery rows (a max over a
    multi-vector item's vectors, :func:`hf_tta.gallery.base.item_scores`), ``M * c * Q`` at most :data:`CHUNK_ELEMENTS`."""
    per_row = max(1, bank.shape[0]) * (rows.shape[1] if rows.dim() == 3 else 1)
    step = max(1, CHUNK_ELEMENTS // per_row)
    bank = bank.to(rows.dtype)
    for start in range(0, rows.shape[0], step):
        yield start, item_scores(bank, rows[start : start + step])
