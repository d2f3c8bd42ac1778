"""Diverse query shift (REST's DQS, the "-D" benchmarks): every query draws its own corruption and severity.

The draw of query ``index`` depends only on ``(seed, index)`` and the pool, never on the order or the batch in which
queries are processed, so a stream can be rebuilt query by query.

Example:
    >>> pool = make_pool("image", names=["gaussian_noise", "fog"], severities=[3, 5])
    >>> pool
    (('gaussian_noise', 3), ('gaussian_noise', 5), ('fog', 3), ('fog', 5))
    >>> draw_corruption(pool, seed=0, index=7) == draw_corruption(pool, seed=0, index=7)
    True
"""

from __future__ import annotations

import random
from typing import Any, Iterable, Mapping, Sequence

from .base import derive_seed
from .image import ALL_IMAGE_CORRUPTIONS, IMAGE_CORRUPTIONS, IMAGE_SEVERITIES, MAX_IMAGE_SEVERITY, corrupt_image
from .text import MAX_TEXT_SEVERITY, TEXT_CORRUPTIONS, TEXT_SEVERITIES, corrupt_text

Pool = tuple[tuple[str, int], ...]

#: REST's -D setting: any of the 16 image corruptions, at the maximum severity.
DEFAULT_IMAGE_POOL: Pool = tuple((n, MAX_IMAGE_SEVERITY) for n in IMAGE_CORRUPTIONS)
#: Any of the 15 text corruptions, at the maximum severity (char/word 7, sentence 1).
DEFAULT_TEXT_POOL: Pool = tuple((n, MAX_TEXT_SEVERITY[n]) for n in TEXT_CORRUPTIONS)


def make_pool(
    modality: str,
    names: Iterable[str] | None = None,
    severities: str | int | Sequence[int] | Mapping[str, Sequence[int]] = "max",
) -> Pool:
    """A pool of ``(corruption, severity)`` pairs.

    Args:
        modality: ``"image"`` or ``"text"``.
        names: corruptions to draw from (default: all of the modality; for images COCO-C's 16, and ImageNet-C's
            validation corruptions may be named too).
        severities: ``"max"`` (the benchmark's maximum severity), ``"all"``, one int, a list applied to every
            corruption, or a mapping name -> list.
    """
    if modality not in ("image", "text"):
        raise ValueError(f"modality must be 'image' or 'text'; got {modality!r}.")
    known = ALL_IMAGE_CORRUPTIONS if modality == "image" else TEXT_CORRUPTIONS
    names = list((IMAGE_CORRUPTIONS if modality == "image" else known) if names is None else names)
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ValueError(f"Unknown {modality} corruptions {unknown}; choose from {list(known)}.")

    def allowed(n: str) -> tuple[int, ...]:
        return IMAGE_SEVERITIES if modality == "image" else TEXT_SEVERITIES[n]

    pool = []
    for n in names:
        if severities == "max":
            sev: Sequence[int] = [MAX_IMAGE_SEVERITY if modality == "image" else MAX_TEXT_SEVERITY[n]]
        elif severities == "all":
            sev = allowed(n)
        elif isinstance(severities, str):
            raise ValueError(f"severities must be 'max', 'all', an int, a list or a mapping; got {severities!r}.")
        elif isinstance(severities, Mapping):
            sev = severities.get(n, ())
        elif isinstance(severities, int):
            sev = [severities]
        else:
            sev = list(severities)
        if not sev:
            raise ValueError(f"No severity given for {n!r}.")
        bad = [s for s in sev if s not in allowed(n)]
        if bad and not isinstance(severities, str):
            raise ValueError(
                f"{n!r} has no severity {bad}; it has {list(allowed(n))}. Give a mapping name -> severities, or 'max'."
            )
        pool.extend((n, int(s)) for s in sev)
    if not pool:
        raise ValueError("The pool is empty: no (corruption, severity) pair matches.")
    return tuple(pool)


def _check_pool(pool: Sequence[tuple[str, int]]) -> Pool:
    pool = tuple((str(n), int(s)) for n, s in pool)
    if not pool:
        raise ValueError("The pool is empty.")
    return pool


def draw_corruption(pool: Sequence[tuple[str, int]], seed: int, index: int) -> tuple[str, int]:
    """The ``(corruption, severity)`` of query ``index``: uniform over the pool, a function of ``(seed, index)``."""
    pool = _check_pool(pool)
    return pool[random.Random(derive_seed(seed, "diverse", int(index))).randrange(len(pool))]


def diverse_plan(num_queries: int, seed: int, pool: Sequence[tuple[str, int]]) -> list[tuple[str, int]]:
    """The draws of queries ``0..num_queries-1``."""
    return [draw_corruption(pool, seed, i) for i in range(num_queries)]


def _apply_seed(seed: int, index: int) -> int:
    return derive_seed(seed, "diverse-apply", int(index))


def corrupt_image_diverse(image, index: int, seed: int, pool: Sequence[tuple[str, int]] = DEFAULT_IMAGE_POOL):
    """Corrupt query ``index`` with its own draw from ``pool``; returns ``(image, name, severity)``."""
    name, severity = draw_corruption(pool, seed, index)
    return corrupt_image(image, name, severity, seed=_apply_seed(seed, index)), name, severity


def corrupt_text_diverse(
    text: str, index: int, seed: int, pool: Sequence[tuple[str, int]] = DEFAULT_TEXT_POOL, **kwargs: Any
) -> tuple[str, str, int]:
    """Corrupt query ``index`` with its own draw from ``pool``; returns ``(text, name, severity)``.

    ``kwargs`` go to :func:`~hf_tta.data.corruptions.text.corrupt_text` (``models=``, ``wordnet=``, ...).
    """
    name, severity = draw_corruption(pool, seed, index)
    return corrupt_text(text, name, severity, seed=_apply_seed(seed, index), **kwargs), name, severity


def corrupt_images_diverse(images: Sequence, seed: int, pool=DEFAULT_IMAGE_POOL, start_index: int = 0):
    """A batch: image ``i`` is query ``start_index + i``. Returns ``(images, [(name, severity), ...])``."""
    out = [corrupt_image_diverse(img, start_index + i, seed, pool) for i, img in enumerate(images)]
    return [o[0] for o in out], [(o[1], o[2]) for o in out]


def corrupt_texts_diverse(texts: Sequence[str], seed: int, pool=DEFAULT_TEXT_POOL, start_index: int = 0, **kwargs):
    """A batch: text ``i`` is query ``start_index + i``. Returns ``(texts, [(name, severity), ...])``."""
    out = [corrupt_text_diverse(t, start_index + i, seed, pool, **kwargs) for i, t in enumerate(texts)]
    return [o[0] for o in out], [(o[1], o[2]) for o in out]


__all__ = [
    "DEFAULT_IMAGE_POOL",
    "DEFAULT_TEXT_POOL",
    "corrupt_image_diverse",
    "corrupt_images_diverse",
    "corrupt_text_diverse",
    "corrupt_texts_diverse",
    "diverse_plan",
    "draw_corruption",
    "make_pool",
]
