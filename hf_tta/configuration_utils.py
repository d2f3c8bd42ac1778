"""Serialisable dataclass configs, in the style of ``peft.PeftConfig``.

Every config in hf_tta is a dataclass whose fields carry ``metadata={"help": ...}``. They serialise to sorted JSON
(nested configs as nested objects), and loading refuses a key the config does not define in one line naming the
closest valid field (a misspelled ``lrr`` would otherwise run silently with the default ``lr``).
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import logging
import math
import numbers
import os
import re
import types
import typing
from typing import Any, TypeVar

from .version import __version__

logger = logging.getLogger(__name__)

T = TypeVar("T", bound="ConfigMixin")


class ConfigMixin:
    """``to_dict`` / ``from_dict`` / ``save_pretrained`` / ``from_pretrained`` for dataclass configs."""

    config_file_name: str = "config.json"

    def to_dict(self) -> dict[str, Any]:
        out = {}
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            value = getattr(self, f.name)
            if isinstance(value, ConfigMixin):
                value = value.to_dict()
            elif isinstance(value, tuple):
                value = list(value)
            out[f.name] = value
        return out

    def to_json_string(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n"

    @classmethod
    def from_dict(cls: type[T], data: dict[str, Any]) -> T:
        """The config of ``data`` (what :meth:`to_dict` wrote); a key the config does not define is refused in one
        line naming the closest field (:func:`check_known_keys`)."""
        if not isinstance(data, dict):
            raise TypeError(f"{cls.__name__}.from_dict needs a dict of its fields, got {type(data).__name__}.")
        check_known_keys(cls, data)
        return cls(**data)

    def save_pretrained(self, save_directory: str | os.PathLike) -> str:
        os.makedirs(save_directory, exist_ok=True)
        path = os.path.join(save_directory, self.config_file_name)
        payload = self.to_dict()
        payload["hf_tta_version"] = __version__
        with open(path, "w", encoding="utf-8") as fh:
            json.dump(payload, fh, indent=2, sort_keys=True)
            fh.write("\n")
        return path

    @classmethod
    def from_pretrained(
        cls: type[T], directory: str | os.PathLike, *, revision: str | None = None, token: str | None = None, api=None
    ) -> T:
        """Read the config from a local folder, or from a Hub repository id (``owner/name``, through
        ``huggingface_hub``; offline it reads the cache) as :meth:`hf_tta.TTAWrapper.from_pretrained` does."""
        path = os.path.join(directory, cls.config_file_name)
        if not os.path.isdir(directory) and re.match(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$", str(directory)):
            from huggingface_hub import HfApi

            path = (api or HfApi(token=token)).hf_hub_download(str(directory), cls.config_file_name, revision=revision)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"No {cls.config_file_name} in {directory!r}: was it written by save_pretrained()?")
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
        data.pop("hf_tta_version", None)
        return cls.from_dict(data)


def check_known_keys(config_class: type, data: Any, where: str = "", extra: Any = ()) -> None:
    """Raise a ``ValueError`` naming the first key of ``data`` that ``config_class`` (a dataclass) does not define (nor
    ``extra`` names) and the closest valid key (``difflib``), e.g. ``TTAConfig has no field 'lrr': did you mean 'lr'?``."""
    known = [f.name for f in dataclasses.fields(config_class) if f.init] + list(extra)
    message = unknown_key_message(data, known, config_class.__name__)
    if message:
        raise ValueError(where + message)


def unknown_key_message(data: Any, known: list[str], owner: str) -> str | None:
    """``"<owner> has no field 'key': did you mean 'closest'?"`` for the first key of ``data`` not in ``known``."""
    unknown = sorted(set(data) - set(known), key=str)
    if not unknown:
        return None
    key = unknown[0]
    close = difflib.get_close_matches(str(key), known, n=1, cutoff=0.6)
    hint = f"did you mean {close[0]!r}?" if close else f"valid fields: {', '.join(sorted(known))}."
    return f"{owner} has no field {key!r}: {hint}"


class ConfigTypeError(TypeError, ValueError):
    """A config field holds a value of the wrong type (a ``ValueError`` too, like every other bad config value)."""


def _matches(value: Any, annotation: Any) -> bool:
    """Whether ``value`` fits ``annotation`` (the simple annotations configs use; anything else is not checked)."""
    if annotation is Any:
        return True
    if annotation is type(None):
        return value is None
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        return any(_matches(value, arg) for arg in typing.get_args(annotation))
    if annotation is bool:
        return isinstance(value, bool)
    if annotation is int:
        return isinstance(value, numbers.Integral) and not isinstance(value, bool)
    if annotation is float:
        return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)
    if origin in (list, tuple):  # JSON turns tuples into lists
        return isinstance(value, (list, tuple))
    if origin is dict:
        return isinstance(value, dict)
    if isinstance(annotation, type):
        return isinstance(value, annotation)
    return True


def check_field_types(config: Any) -> None:
    """Raise a :class:`ConfigTypeError` naming the first field of a dataclass config whose value does not fit its
    annotation: ``None`` only where the field is optional, no ``bool`` for a number, finite floats, integers for
    ``int`` fields."""
    hints = typing.get_type_hints(type(config))
    for f in dataclasses.fields(config):
        if f.name not in hints:
            continue
        value, annotation = getattr(config, f.name), hints[f.name]
        if not _matches(value, annotation):
            expected = getattr(annotation, "__name__", None) or str(annotation)
            if annotation is float:
                expected = "a finite number"
            raise ConfigTypeError(f"{type(config).__name__} `{f.name}` must be {expected}, got {value!r}.")


def check_positive(name: str, value: float, *, allow_zero: bool = False, owner: str = "") -> None:
    """Raise a ``ValueError`` naming the field unless ``value`` is (strictly) positive; ``None`` passes (an optional
    field left unset: :func:`check_field_types` refuses ``None`` where a field is not optional)."""
    if value is None:
        return
    ok = value >= 0 if allow_zero else value > 0
    if not ok:
        bound = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"{owner + ' ' if owner else ''}`{name}` must be {bound}, got {value!r}.")


def check_positive_int(name: str, value, owner: str = "") -> None:
    """Raise a ``ValueError`` naming the field unless ``value`` is an integer >= 1 (``bool`` is refused)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{owner + ' ' if owner else ''}`{name}` must be an integer >= 1, got {value!r}.")


def check_fraction(name: str, value: float) -> None:
    if not 0.0 < value <= 1.0:
        raise ValueError(f"`{name}` must be in (0, 1], got {value!r}.")


def check_choice(name: str, value, choices, allow_none: bool = False, owner: str = "") -> None:
    """Raise a ``ValueError`` naming the field and its valid values unless ``value`` is one of ``choices``."""
    if allow_none and value is None:
        return
    if value not in choices:
        prefix = "None or one of" if allow_none else "one of"
        raise ValueError(f"{owner + ' ' if owner else ''}`{name}` must be {prefix} {list(choices)}, got {value!r}.")
