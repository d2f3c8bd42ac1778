"""The sentence-level text corruptions of COCO-C / Flickr-C: Styleformer style transfer (formal, casual, passive,
active) and en→de→en back-translation, with any Hugging Face seq2seq checkpoint.

The checkpoint of a corruption comes from the ``models=`` argument, else :func:`register_text_model`, else
:data:`DEFAULT_TEXT_MODELS` (the benchmark's). Offline by default: the defaults load only from the local Hugging
Face cache (``hf download <id>`` first, or name them with ``models=`` to let them download); checkpoints the user
names load as ``from_pretrained`` does. Loaded models are cached per process (:func:`clear_text_model_cache`).
"""

from __future__ import annotations

import os
import threading
from typing import Any, Mapping, Sequence

from .base import MissingResourceError

#: The checkpoints the benchmark used (Styleformer and fairseq WMT19 via nlpaug). Tried when no model is given.
DEFAULT_TEXT_MODELS: dict[str, Any] = {
    "formal": "prithivida/informal_to_formal_styletransfer",
    "casual": "prithivida/formal_to_informal_styletransfer",
    "passive": "prithivida/active_to_passive_styleformer",
    "active": "prithivida/passive_to_active_styleformer",
    "back_translation": ("facebook/wmt19-en-de", "facebook/wmt19-de-en"),
}
#: Styleformer's task prefixes.
STYLE_PREFIXES: dict[str, str] = {
    "formal": "transfer Casual to Formal: ",
    "casual": "transfer Formal to Casual: ",
    "passive": "transfer Active to Passive: ",
    "active": "transfer Passive to Active: ",
}
#: Styleformer's sampling settings for the style models.
STYLE_GENERATE_KWARGS: dict[str, Any] = {"do_sample": True, "top_k": 50, "top_p": 0.95, "max_length": 32}
BACK_TRANSLATION_GENERATE_KWARGS: dict[str, Any] = {"max_new_tokens": 128}

#: The sentence-level corruptions, in the benchmark's order.
SENTENCE_CORRUPTIONS: tuple[str, ...] = tuple(DEFAULT_TEXT_MODELS)

_LOCK = threading.Lock()
_TEXT_MODELS: dict[str, Any] = {}
_LOADED: dict[tuple, "Seq2SeqGenerator"] = {}


def register_text_model(name: str, model: Any) -> None:
    """Set the seq2seq model of a sentence-level corruption for this process.

    ``model`` is a checkpoint path or Hub id, a ``(model, tokenizer)`` pair or a :class:`Seq2SeqGenerator`; for
    ``back_translation`` a pair ``(en→de, de→en)`` of those. ``None`` removes the registration.
    """
    if name not in SENTENCE_CORRUPTIONS:
        raise ValueError(f"Only sentence-level corruptions take a model: {list(SENTENCE_CORRUPTIONS)}; got {name!r}.")
    if model is None:
        _TEXT_MODELS.pop(name, None)
    else:
        _TEXT_MODELS[name] = model


def clear_text_model_cache() -> None:
    """Forget the loaded seq2seq models."""
    _LOADED.clear()


class Seq2SeqGenerator:
    """A seq2seq model + tokenizer that maps a batch of strings to a batch of strings."""

    def __init__(self, model, tokenizer, device=None):
        self.model = model.eval()
        self.tokenizer = tokenizer
        if device is not None:
            self.model.to(device)

    @classmethod
    def from_pretrained(
        cls, spec: str | os.PathLike, device=None, purpose: str = "", local_files_only: bool = False
    ) -> "Seq2SeqGenerator":
        try:
            import torch
            from transformers import AutoModelForSeq2SeqLM, AutoTokenizer
        except ImportError as err:  # pragma: no cover
            raise MissingResourceError(f"{purpose} needs `transformers` and `torch`. ({err})") from err
        try:
            tokenizer = AutoTokenizer.from_pretrained(str(spec), local_files_only=local_files_only)
            model = AutoModelForSeq2SeqLM.from_pretrained(str(spec), dtype=torch.float32, local_files_only=local_files_only)
        except (OSError, ValueError, ImportError) as err:
            raise MissingResourceError(
                f"{purpose} could not load the seq2seq checkpoint {str(spec)!r}: {type(err).__name__}: "
                f"{str(err).splitlines()[0] if str(err) else ''}. Give a local checkpoint directory or a Hub id that "
                "is in your Hugging Face cache (download it first, e.g. `hf download <id>`, when offline)."
            ) from err
        return cls(model, tokenizer, device)

    @property
    def device(self):
        return next(self.model.parameters()).device

    def __call__(self, texts: Sequence[str], prefix: str = "", **generate_kwargs) -> list[str]:
        import torch

        enc = self.tokenizer([prefix + t for t in texts], return_tensors="pt", padding=True, truncation=True)
        enc = {k: v.to(self.device) for k, v in enc.items() if k in ("input_ids", "attention_mask")}
        with torch.no_grad():
            out = self.model.generate(**enc, **generate_kwargs)
        return [s.strip() for s in self.tokenizer.batch_decode(out, skip_special_tokens=True)]


def _resolve_generator(spec: Any, name: str, device, role: str = "", local_files_only: bool = False) -> Seq2SeqGenerator:
    if isinstance(spec, Seq2SeqGenerator):
        return spec
    if isinstance(spec, (tuple, list)) and len(spec) == 2 and not isinstance(spec[0], (str, os.PathLike)):
        return Seq2SeqGenerator(spec[0], spec[1], device)
    key = (str(spec), str(device))
    if key not in _LOADED:
        purpose = f"The sentence-level text corruption {name!r}{role}"
        with _LOCK:
            if key not in _LOADED:
                _LOADED[key] = Seq2SeqGenerator.from_pretrained(spec, device, purpose, local_files_only=local_files_only)
    return _LOADED[key]


def _model_spec(name: str, models: Mapping[str, Any] | None) -> tuple[Any, bool]:
    """The checkpoint(s) of a sentence-level corruption and whether the user named them (``models=`` or
    :func:`register_text_model`): only those may be downloaded; the benchmark's defaults load from the local cache."""
    if models and name in models:
        return models[name], True
    if name in _TEXT_MODELS:
        return _TEXT_MODELS[name], True
    return DEFAULT_TEXT_MODELS[name], False


def _missing_model_error(name: str, err: Exception) -> MissingResourceError:
    default = DEFAULT_TEXT_MODELS[name]
    how = (
        "models={'back_translation': (en_de_path, de_en_path)}" if name == "back_translation" else f"models={{{name!r}: path}}"
    )
    return MissingResourceError(
        f"{err} The benchmark used {default!r}, which loads only from your Hugging Face cache (`hf download` it, or "
        f"name it in `{how}` to let it download). Or pass your own checkpoint(s) with `{how}` (any Hugging Face seq2seq "
        f"model; {'translation models' if name == 'back_translation' else 'Styleformer-style T5 prompted with ' + repr(STYLE_PREFIXES[name])}), "
        f"or `register_text_model({name!r}, ...)`."
    )


def sentence_generators(name: str, models: Mapping[str, Any] | None = None, device=None) -> list[Seq2SeqGenerator]:
    """The loaded generator(s) of a sentence-level corruption (two for back-translation); raises a clear error."""
    spec, named = _model_spec(name, models)
    local = not named  # offline by default: a default checkpoint is never downloaded behind the user's back
    try:
        if name == "back_translation":
            if isinstance(spec, Mapping):
                spec = (spec["forward"], spec["backward"])
            if not isinstance(spec, (tuple, list)) or len(spec) != 2:
                raise MissingResourceError("back_translation needs two models: (en→de, de→en).")
            return [
                _resolve_generator(spec[0], name, device, " (en→de)", local_files_only=local),
                _resolve_generator(spec[1], name, device, " (de→en)", local_files_only=local),
            ]
        return [_resolve_generator(spec, name, device, local_files_only=local)]
    except MissingResourceError as err:
        raise _missing_model_error(name, err) from err


def sentence_corrupt(
    texts: Sequence[str], name: str, models=None, device=None, generate_kwargs: Mapping[str, Any] | None = None
) -> list[str]:
    """``texts`` through the corruption's generator(s) with the benchmark's ``generate`` settings."""
    gens = sentence_generators(name, models, device)
    if name == "back_translation":
        kw = {**BACK_TRANSLATION_GENERATE_KWARGS, **(generate_kwargs or {})}
        return gens[1](gens[0](texts, **kw), **kw)
    kw = {**STYLE_GENERATE_KWARGS, **(generate_kwargs or {})}
    if "max_new_tokens" in kw:
        kw.pop("max_length", None)
    return gens[0](texts, prefix=STYLE_PREFIXES[name], **kw)


__all__ = [
    "BACK_TRANSLATION_GENERATE_KWARGS",
    "DEFAULT_TEXT_MODELS",
    "SENTENCE_CORRUPTIONS",
    "STYLE_GENERATE_KWARGS",
    "STYLE_PREFIXES",
    "Seq2SeqGenerator",
    "clear_text_model_cache",
    "register_text_model",
    "sentence_corrupt",
    "sentence_generators",
]
