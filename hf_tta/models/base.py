"""The model-adapter contract: how to embed each modality and which parameters belong to which tower.

One small module per Hugging Face architecture subclasses :class:`ModelAdapter` and registers itself
with :func:`register_adapter`. Everything architecture-specific lives there; the wrapper and the
objectives only see L2-normalised embeddings.
"""

from __future__ import annotations

import re
from typing import Callable, ClassVar, Iterable, Mapping

import torch
import torch.nn.functional as F
from torch import nn

from .inputs import FEATURES, IDS, MASK, PIXEL_MAX_ABS, InputSpec, check_input

#: ``composed``: a reference image + a modification text (composed image retrieval, :mod:`.blip2_composed`).
MODALITIES = ("image", "text", "audio", "video", "composed")

# Normalisation layers TTA adapts by default (TCR: "the parameters within the normalization layers").
NORM_TYPES: tuple[type[nn.Module], ...] = (nn.LayerNorm, nn.GroupNorm, nn.modules.batchnorm._BatchNorm)


class ModelAdapter:
    """Embeds one modality of a dual encoder and describes its towers.

    Subclasses set the class attributes and implement ``_embed(modality, inputs)`` returning *unnormalised*
    projected embeddings of shape ``(B, D)`` (or ``(B, Q, D)`` for multi-vector modalities).

    Class attributes:
        architectures: Hugging Face class names this adapter serves.
        modalities: the modalities the model embeds.
        input_names: per modality, the accepted input keys; the first is required.
        towers: per modality, module-name prefixes (as in ``named_modules()``) of that modality's tower.
        shared: prefixes of modules used by more than one tower (BLIP-2's Q-Former).
        default_lr: per query modality, the AdamW learning rate of the papers.
        multi_vector: modalities whose embedding is a set of vectors scored by a max (BLIP-2 images).
        excluded_norms: per modality, norm layers of the tower that the reference code does not adapt.
        unused_norms: per modality, regexes (full match) of norm layers inside the tower that this modality's
            forward never runs (BLIP's text cross-attention for text queries): adapting them would carry parameters
            that never change; ``tests/test_models.py`` checks with forward hooks that every selected layer runs.
        preprocess_as: modalities whose inputs are prepared by another modality's processor (CLIP over videos: frames
            are images, so ``{"video": "image"}``); benchmark tasks read it to pick the processor.
        processors: per modality, what prepares the inputs (named in the input errors).
        vocab_config: the sub-config whose ``vocab_size`` bounds the text ids (``"text_config"``).
        fixed_image_size: the vision tower's position embeddings fix the input H x W to ``vision_config.image_size``
            (ViT-style towers: CLIP, SigLIP, BLIP, BLIP-2, X-CLIP); another size is refused in one line naming the
            processor, before transformers' own error from inside the tower.

    What each input key must look like is declared by :meth:`input_specs` (from the model's config) and checked by
    :meth:`check_inputs` before anything runs; adapters override :meth:`input_specs`, never the wrapper.
    """

    architectures: ClassVar[tuple[str, ...]] = ()
    modalities: ClassVar[tuple[str, ...]] = ("image", "text")
    input_names: ClassVar[dict[str, tuple[str, ...]]] = {
        "image": ("pixel_values",),
        "text": ("input_ids", "attention_mask", "token_type_ids", "position_ids"),
    }
    towers: ClassVar[dict[str, tuple[str, ...]]] = {}
    shared: ClassVar[tuple[str, ...]] = ()
    default_lr: ClassVar[dict[str, float]] = {"image": 3e-4, "text": 3e-4}
    multi_vector: ClassVar[frozenset[str]] = frozenset()
    excluded_norms: ClassVar[dict[str, tuple[str, ...]]] = {}
    unused_norms: ClassVar[dict[str, tuple[str, ...]]] = {}
    preprocess_as: ClassVar[dict[str, str]] = {}
    processors: ClassVar[dict[str, str]] = {
        "image": "the model's processor (AutoProcessor / AutoImageProcessor)",
        "text": "the model's tokenizer (AutoProcessor / AutoTokenizer)",
        "audio": "the model's feature extractor (AutoProcessor / AutoFeatureExtractor)",
        "video": "the model's processor (AutoProcessor / AutoImageProcessor on the frames)",
    }
    vocab_config: ClassVar[str] = "text_config"
    fixed_image_size: ClassVar[bool] = False

    def __init__(self, model: nn.Module):
        self.model = model

    # ----------------------------------------------------------------------------------- embed
    def check_modality(self, modality: str) -> None:
        if modality not in self.modalities:
            raise ValueError(
                f"{type(self.model).__name__} embeds {list(self.modalities)}; got modality {modality!r}."
            )

    def select_inputs(self, modality: str, inputs: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Keep the keys this modality's tower accepts; raise if the required one is missing."""
        self.check_modality(modality)
        if not isinstance(inputs, Mapping):
            raise TypeError(
                f"{modality} inputs must be a dict of tensors such as {{'{self.input_names[modality][0]}': ...}} "
                f"(e.g. a processor's BatchEncoding); got {type(inputs).__name__}."
            )
        names = self.input_names[modality]
        if names[0] not in inputs:
            raise ValueError(
                f"{modality} inputs need {names[0]!r}; got keys {sorted(inputs)}. Is the query modality right?"
            )
        return {k: inputs[k] for k in names if k in inputs and inputs[k] is not None}

    def input_specs(self, modality: str) -> dict[str, InputSpec]:
        """Per input key of ``modality``, what the tensor must look like (dtype kind, layout, sizes from the config).

        The defaults cover the Hugging Face conventions: images ``(B, C, H, W)`` with ``C`` from
        ``vision_config.num_channels``, videos ``(B, T, C, H, W)``, text ids ``(B, L)`` within
        ``<vocab_config>.vocab_size``, masks of the ids' shape. Adapters override this for their own layouts.
        """
        self.check_modality(modality)
        proc = self.processors.get(modality, "the model's processor")
        config = getattr(self.model, "config", None)
        if modality in ("image", "video"):
            vision = getattr(config, "vision_config", None)
            # BLIP / BLIP-2 vision configs have no num_channels: their patch embedding is Conv2d(3, ...).
            channels = getattr(vision, "num_channels", 3) if config is not None else None
            sizes = () if channels is None else ((-3, channels, f"vision_config.num_channels={channels}"),)
            layout = ("B", "C", "H", "W") if modality == "image" else ("B", "T", "C", "H", "W")
            specs = {"pixel_values": InputSpec(
                FEATURES, layout, sizes, processor=proc, description="normalised pixel values", max_abs=PIXEL_MAX_ABS,
                **self._image_size_spec(getattr(config, "vision_config", None)),
            )}
            if modality == "video":
                specs["frame_mask"] = InputSpec(MASK, ("B", "T"), processor=proc)
            return specs
        if modality == "text":
            text = getattr(config, self.vocab_config, None)
            vocab = getattr(text, "vocab_size", None)
            types = getattr(text, "type_vocab_size", None)
            ids = ("B", "L")
            return {
                "input_ids": InputSpec(IDS, ids, vocab_size=vocab, vocab_source=f"{self.vocab_config}.vocab_size={vocab}", processor=proc),
                "attention_mask": InputSpec(MASK, ids, processor=proc, like="input_ids"),
                "token_type_ids": InputSpec(
                    IDS, ids, vocab_size=types, vocab_source=f"{self.vocab_config}.type_vocab_size={types}", processor=proc, like="input_ids"
                ),
                "position_ids": InputSpec(IDS, processor=proc),
            }
        return {  # audio: layouts differ per model (waveforms, spectrograms): adapters declare them
            "input_features": InputSpec(FEATURES, processor=proc, description="audio features"),
            "input_values": InputSpec(FEATURES, processor=proc, description="audio values"),
            "attention_mask": InputSpec(MASK, processor=proc),
        }

    def _image_size_spec(self, vision) -> dict:
        """The :class:`InputSpec` fields of the H x W check (none unless :attr:`fixed_image_size`): the size from
        ``vision_config.image_size`` (an int or ``(H, W)``) and the processor call of the checkpoint it came from."""
        size = getattr(vision, "image_size", None) if self.fixed_image_size else None
        if isinstance(size, int) and not isinstance(size, bool):
            size = (size, size)
        if not (isinstance(size, (tuple, list)) and len(size) == 2 and all(isinstance(v, int) for v in size)):
            return {}
        path = getattr(self.model, "name_or_path", "") or getattr(getattr(self.model, "config", None), "_name_or_path", "") or ""
        return {"image_size": tuple(size), "image_size_source": f"vision_config.image_size={size[0] if size[0] == size[1] else list(size)}",
                "resize_with": f"AutoProcessor.from_pretrained({str(path)!r})" if path else ""}

    def input_dtype(self) -> torch.dtype | None:
        """The dtype floating-point inputs are cast to: the model's (its first floating-point parameter's)."""
        for p in self.model.parameters():
            if p.is_floating_point():
                return p.dtype
        return None

    def check_inputs(self, modality: str, inputs: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Selected inputs checked against :meth:`input_specs`: a new dict (the caller's is never modified), with
        floating-point features cast once to :meth:`input_dtype`. Raises ``TypeError``/``ValueError`` naming the fix."""
        selected = self.select_inputs(modality, inputs)
        specs = self.input_specs(modality)
        dtype = self.input_dtype()
        for name, spec in specs.items():
            if spec.required and name not in selected:
                raise ValueError(f"{modality} inputs need {name!r} for this model ({spec.processor} returns it).")
        out = {}
        for name, value in selected.items():
            if not isinstance(value, torch.Tensor):
                raise TypeError(f"{modality} input {name!r} must be a torch.Tensor, got {type(value).__name__}.")
            out[name] = check_input(modality, name, value, specs[name], dtype, selected) if name in specs else value
        return out

    def embed(self, modality: str, inputs: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """L2-normalised projected embeddings ``(B, D)`` (``(B, Q, D)`` for multi-vector modalities) of raw inputs
        (selected and checked here)."""
        return self.encode(modality, self.check_inputs(modality, inputs))

    def encode(self, modality: str, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        """:meth:`embed` for inputs already returned by :meth:`check_inputs` (no second selection or check)."""
        return F.normalize(self._embed(modality, inputs).float(), dim=-1)

    def _embed(self, modality: str, inputs: dict[str, torch.Tensor]) -> torch.Tensor:  # pragma: no cover
        raise NotImplementedError

    # ----------------------------------------------------------------------------------- score
    @staticmethod
    def score(query: torch.Tensor, gallery: torch.Tensor) -> torch.Tensor:
        """Cosine similarities ``(B, N)``; a multi-vector side is reduced by a max over its vectors."""
        if query.dim() == 2 and gallery.dim() == 2:
            return query @ gallery.T
        if query.dim() == 3 and gallery.dim() == 2:
            return torch.einsum("bqd,nd->bqn", query, gallery).amax(dim=1)
        if query.dim() == 2 and gallery.dim() == 3:
            return torch.einsum("bd,nqd->bnq", query, gallery).amax(dim=2)
        raise ValueError(f"Cannot score query embeddings {tuple(query.shape)} against gallery {tuple(gallery.shape)}.")

    @staticmethod
    def single_vector(emb: torch.Tensor, scores: torch.Tensor | None = None, other: torch.Tensor | None = None):
        """One vector per item, for objectives that need centres and distances.

        Single-vector embeddings are returned as they are. A multi-vector query ``(B, Q, D)`` is reduced to the
        vector that attains its score with its top-1 gallery item (differentiable gather). A multi-vector gallery
        ``(N, Q, D)`` (no ``scores``) becomes the normalised mean of its vectors. Ranking always uses the exact
        max-over-vectors :meth:`score`; this view only feeds the objectives' centre/gap statistics.
        """
        if emb.dim() == 2:
            return emb
        if scores is None or other is None:
            return F.normalize(emb.mean(dim=1), dim=-1)
        top = other[scores.detach().argmax(dim=1)]  # (B, D) single-vector gallery items
        token = torch.einsum("bqd,bd->bq", emb.detach(), top).argmax(dim=1)
        return emb[torch.arange(emb.shape[0], device=emb.device), token]

    # ----------------------------------------------------------------------------------- params
    def tower_of(self, name: str) -> set[str]:
        """Modalities whose tower contains module ``name`` (several for shared modules)."""
        if any(_has_prefix(name, p) for p in self.shared):
            return set(self.modalities)
        return {m for m, prefixes in self.towers.items() if any(_has_prefix(name, p) for p in prefixes)}

    def norm_layer_names(self, modality: str) -> list[str]:
        """Names of the normalisation layers that ``modality``'s forward runs (TCR's default adapted parameters):
        those in its tower, without :attr:`excluded_norms` and :attr:`unused_norms`."""
        self.check_modality(modality)
        excluded = self.excluded_norms.get(modality, ())
        unused = re.compile("|".join(f"(?:{p})" for p in self.unused_norms.get(modality, ())) or "(?!)")
        return [
            name
            for name, module in self.model.named_modules()
            if isinstance(module, NORM_TYPES)
            and modality in self.tower_of(name)
            and name not in excluded
            and not unused.fullmatch(name)
            and any(True for _ in module.parameters(recurse=False))  # skip elementwise_affine=False
        ]

    def describe(self) -> str:
        return f"{type(self).__name__}({type(self.model).__name__}, modalities={list(self.modalities)})"


def pooled(out) -> torch.Tensor:
    """The projected embedding of a ``get_*_features`` call: transformers 5 returns ``BaseModelOutputWithPooling``
    (the projection is its ``pooler_output``); older versions returned the tensor itself."""
    return getattr(out, "pooler_output", out)


def _has_prefix(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


# ---------------------------------------------------------------------------------------------------- registry
ADAPTERS: dict[str, type[ModelAdapter]] = {}
# Every adapter registered for an architecture, the default first: e.g. CLIPModel has the image-text default and a
# video-text variant (frame mean pooling); ``get_adapter(model, modalities=...)`` picks the first that embeds them.
ADAPTER_VARIANTS: dict[str, list[type[ModelAdapter]]] = {}


def register_adapter(cls: type[ModelAdapter] | None = None, *, default: bool = True):
    """Class decorator registering an adapter for each name in ``cls.architectures``.

    ``@register_adapter`` makes it the architecture's default adapter; ``@register_adapter(default=False)``
    registers a variant that :func:`get_adapter` picks only when asked for modalities the default does not embed.
    """

    def register(klass: type[ModelAdapter]) -> type[ModelAdapter]:
        for arch in klass.architectures:
            variants = ADAPTER_VARIANTS.setdefault(arch, [])
            if klass in variants:
                variants.remove(klass)
            if default:
                ADAPTERS[arch] = klass
                variants.insert(0, klass)
            else:
                variants.append(klass)
        return klass

    return register(cls) if cls is not None else register


def supported_architectures() -> list[str]:
    return sorted(ADAPTERS)


def get_adapter(model: nn.Module | ModelAdapter, modalities: Iterable[str] | None = None) -> ModelAdapter:
    """The adapter for ``model`` (looked up by class name along its MRO), or ``model`` if it is one.

    Args:
        modalities: the modalities the adapter must embed (e.g. ``("video", "text")``). ``None`` gives the
            architecture's default adapter; otherwise the first registered adapter (default first) that embeds
            them all, e.g. ``get_adapter(clip_model, ["video"])`` gives the frame-pooling ``CLIPVideoAdapter``;
            the default adapter when none does.
    """
    if isinstance(model, ModelAdapter):
        return model
    wanted = [m for m in (modalities or ()) if m is not None]
    for klass in type(model).__mro__:
        if klass.__name__ in ADAPTERS:
            for cls in ADAPTER_VARIANTS.get(klass.__name__, ()) if wanted else ():
                if set(wanted) <= set(cls.modalities):
                    return cls(model)
            return ADAPTERS[klass.__name__](model)  # its check_modality() explains what it embeds
    instead = retrieval_class_name(type(model).__name__)
    if instead is not None:  # e.g. AutoModel gave BlipModel: no ITC projections to embed with
        raise ValueError(
            f"hf_tta has no adapter for {type(model).__name__}: load the checkpoint with "
            f"transformers.{instead}.from_pretrained(...) (the retrieval class, with the ITC projections)."
        )
    raise ValueError(
        f"hf_tta has no adapter for {type(model).__name__}. Supported: {', '.join(supported_architectures())}. "
        "For another dual encoder, wrap it with hf_tta.DualEncoderAdapter(model, encoders=..., towers=...)."
    )


#: Classes without an adapter whose checkpoints load into a retrieval class that has one.
RETRIEVAL_CLASS = {
    "BlipModel": "BlipForImageTextRetrieval",
    "BlipForConditionalGeneration": "BlipForImageTextRetrieval",
    "BlipForQuestionAnswering": "BlipForImageTextRetrieval",
    "Blip2Model": "Blip2ForImageTextRetrieval",
    "Blip2ForConditionalGeneration": "Blip2ForImageTextRetrieval",
}


def retrieval_class_name(class_name: str) -> str | None:
    """The retrieval class to load instead of ``class_name`` (``BlipModel`` → ``BlipForImageTextRetrieval``), if any."""
    return RETRIEVAL_CLASS.get(class_name)


def match_module_names(model: nn.Module, patterns: str | Iterable[str]) -> list[str]:
    """PEFT semantics: a string is a regex that must full-match; a list holds names or name suffixes."""
    names = [n for n, _ in model.named_modules() if n]
    if isinstance(patterns, str):
        rx = re.compile(patterns)
        return [n for n in names if rx.fullmatch(n)]
    wanted = list(patterns)
    return [n for n in names if any(n == w or n.endswith("." + w) for w in wanted)]


def resolve_target_modules(
    adapter: ModelAdapter, query_modality: str, target: str | list[str] | None, exclude: str | list[str] | None
) -> list[str]:
    """The modules a wrapper adapts: ``target`` (PEFT semantics, see :func:`match_module_names`) or, by default, the
    query tower's normalisation layers, less ``exclude``; refused when empty or outside the query tower."""
    model = adapter.model
    names = adapter.norm_layer_names(query_modality) if target is None else match_module_names(model, target)
    if exclude:
        roots = match_module_names(model, exclude)
        names = [n for n in names if not any(n == r or n.startswith(r + ".") for r in roots)]
    if not names:
        raise ValueError(
            f"No module to adapt for query modality {query_modality!r} (target_modules={target!r}, exclude_modules={exclude!r})."
        )
    gallery_only = [n for n in names if query_modality not in adapter.tower_of(n)]
    if gallery_only:
        raise ValueError(
            f"target_modules selects modules outside the {query_modality} (query) tower: {gallery_only[:3]}"
            f"{'...' if len(gallery_only) > 3 else ''}. The gallery tower is never adapted."
        )
    return names


EncodeFn = Callable[[nn.Module, dict], torch.Tensor]
