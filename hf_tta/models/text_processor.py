"""Refuse a tokenizer under which distinct captions collide.

A checkpoint folder saved without its tokenizer files still loads a tokenizer in transformers 5: e.g.
``AutoTokenizer.from_pretrained(clip_folder)`` gives a ``CLIPTokenizer`` with a 2-token vocabulary that maps every
caption to the same ids (``[bos, eos, eos, ...]``). Every text embedding is then the same vector and a benchmark
prints a table of chance-level numbers with exit status 0. :func:`check_tokenizer` tokenises distinct captions and
refuses, in one line naming the fix, when two of them give the same content ids (the ids without the tokenizer's
special tokens and padding). The captions to probe are the benchmark's own (a benchmark task passes its gallery's
captions, up to :data:`MAX_PROBE`): the harm is distinct captions of *this* gallery colliding, so a domain tokenizer
whose vocabulary covers the user's captions passes even where it would map everyday English to unknown tokens.
Captions that differ only in case, accents or spacing are not distinct here (uncased tokenizers fold them).
"""

from __future__ import annotations

import unicodedata
from typing import Any, Iterable, Mapping, Sequence

SAMPLE_TEXTS: tuple[str, ...] = (
    "a dog runs across the green grass",
    "two people riding bicycles down a city street",
    "a red car parked next to a brick building",
    "a plate of food with rice and vegetables",
    "an airplane flying over snowy mountains",
)
MAX_PROBE = 5000  # distinct captions tokenised at most (one batched call: well under a second with a fast tokenizer)


def _fold(text: str) -> str:
    """``text`` as an uncased tokenizer sees it: case-folded, accents stripped, spacing collapsed."""
    decomposed = unicodedata.normalize("NFKD", text)
    return " ".join("".join(c for c in decomposed if not unicodedata.combining(c)).casefold().split())


def find_tokenizer(processor: Any) -> Any | None:
    """The tokenizer of a processor (``processor.tokenizer``), a tokenizer itself, or ``None`` when it has none
    (an image processor, a feature extractor, a stand-in callable)."""
    from transformers import PreTrainedTokenizerBase

    if isinstance(processor, PreTrainedTokenizerBase):
        return processor
    tok = getattr(processor, "tokenizer", None)
    return tok if isinstance(tok, PreTrainedTokenizerBase) else None


def check_tokenizer(tokenizer: Any, sample_texts: Sequence[str] | None = None, source: str | None = None) -> None:
    """Raise ``ValueError`` if two distinct texts of ``sample_texts`` tokenise to the same content ids.

    Args:
        tokenizer: a Hugging Face tokenizer, or a processor holding one (``processor.tokenizer``).
        sample_texts: distinct captions to try, best the gallery's own (default :data:`SAMPLE_TEXTS`); texts that
            differ only in case, accents or spacing count as one, and the first :data:`MAX_PROBE` distinct are tried.
        source: where the tokenizer was loaded from, named in the error (a folder or Hub id).
    """
    tok = find_tokenizer(tokenizer)
    if tok is None:
        raise TypeError(f"check_tokenizer needs a Hugging Face tokenizer or a processor with one; got {type(tokenizer).__name__}.")
    distinct: dict[str, str] = {}
    for text in sample_texts if sample_texts is not None else SAMPLE_TEXTS:
        distinct.setdefault(_fold(str(text)), str(text))
        if len(distinct) >= MAX_PROBE:
            break
    texts = list(distinct.values())
    if len(texts) < 2:
        raise ValueError("check_tokenizer needs at least two distinct sample texts.")
    special = set(tok.all_special_ids)
    seen: dict[tuple[int, ...], str] = {}
    for text, ids in zip(texts, tok(texts, add_special_tokens=True)["input_ids"]):
        content = tuple(int(i) for i in ids if int(i) not in special)
        if content in seen:
            where = f" loaded from {source}" if source else ""
            raise ValueError(
                f"The tokenizer ({type(tok).__name__}, {len(tok)} tokens){where} maps distinct captions "
                f"{seen[content]!r} and {text!r} to the same ids (was it saved without its tokenizer files, or does its "
                "vocabulary miss these words?): save the model's processor beside it (processor.save_pretrained(folder)) "
                "or load the model's original Hub id."
            )
        seen[content] = text


def text_tokenizer(processor: Any) -> Any | None:
    """The tokenizer of ``processor`` (or of ``processor["text"]`` for a per-modality dict), ``None`` if it has none."""
    if isinstance(processor, Mapping):
        processor = processor.get("text")
    return find_tokenizer(processor) if processor is not None else None


def check_text_processor(processor: Any, sample_texts: Iterable[str] | None = None, source: str | None = None) -> bool:
    """:func:`check_tokenizer` on :func:`text_tokenizer` of ``processor``; returns whether there was one to check."""
    tok = text_tokenizer(processor)
    if tok is None:
        return False
    check_tokenizer(tok, None if sample_texts is None else list(sample_texts), source=source)
    return True
