"""Input limits and checks: every bad input is refused with a 4xx and one line naming the fix, before any model runs.

:class:`Limits` holds the bounds (request body bytes, image pixels and sides, text length, ``k``, the answer's time).
:func:`decode_image` opens a base64 image by its header first (PIL reads the size without decoding the pixels), so an
image over ``max_pixels`` is refused before it costs memory; PIL's own decompression-bomb guard is set to the same bound
and raised to an error. :func:`adaptable` says whether a query may be adapted on: constant, tiny (a side under
``min_side``) and non-finite images (a float TIFF with NaN) are answered but never adapted on.
"""

from __future__ import annotations

import base64
import binascii
import io
import warnings
from dataclasses import dataclass
from typing import Any

import numpy as np


class InputError(ValueError):
    """A refused input: ``status`` (the HTTP code) and a one-line message."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class Limits:
    """Bounds on what a request may carry (the service's defaults are for 224-px retrieval queries)."""

    max_body_bytes: int = 8 * 1024 * 1024
    max_pixels: int = 4096 * 4096
    min_side: int = 8  # smaller images are answered but not adapted on
    max_text_chars: int = 2000
    max_k: int = 1000
    timeout: float = 10.0  # seconds per answer

    def __post_init__(self) -> None:
        for name in ("max_body_bytes", "max_pixels", "min_side", "max_text_chars", "max_k"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"Limits.{name}={value!r}: pass a positive integer.")
        if not self.timeout > 0:
            raise ValueError(f"Limits.timeout={self.timeout!r}: pass a positive number of seconds.")


@dataclass(frozen=True)
class Decoded:
    """A decoded query or item: ``value`` (PIL image or str) and whether it may be adapted on (and why not)."""

    value: Any
    adapt: bool = True
    why_not: str | None = None


def decode_text(text: Any, limits: Limits) -> Decoded:
    if not isinstance(text, str) or not text.strip():
        raise InputError("text is empty: send a non-empty string")
    if len(text) > limits.max_text_chars:
        raise InputError(f"text has {len(text)} characters, more than the limit {limits.max_text_chars}", 413)
    return Decoded(text)


def decode_image(data: Any, limits: Limits) -> Decoded:
    """A base64 image file (PNG, JPEG, TIFF, ...) as an RGB PIL image, within ``limits``."""
    from PIL import Image, UnidentifiedImageError

    if not isinstance(data, str) or not data:
        raise InputError("image is empty: send a base64-encoded image file")
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise InputError("image is not valid base64: send the file's bytes base64-encoded") from None
    Image.MAX_IMAGE_PIXELS = limits.max_pixels  # PIL's guard: warns above, raises above twice this
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            img = Image.open(io.BytesIO(raw))  # reads the header only
            w, h = img.size
            if w * h > limits.max_pixels:
                raise InputError(f"image is {w}x{h} pixels, more than the limit {limits.max_pixels}: downscale it", 413)
            img.load()
    except InputError:
        raise
    except (Image.DecompressionBombError, Image.DecompressionBombWarning):
        raise InputError(f"image exceeds the pixel limit {limits.max_pixels}: downscale it", 413) from None
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError, EOFError):
        raise InputError("image is not a readable image file (PNG, JPEG, TIFF, ...)") from None
    if w < 1 or h < 1:
        raise InputError("image has no pixels")
    why = _not_adaptable(img, limits)
    rgb = _finite_rgb(img)
    return Decoded(rgb, why is None, why)


def _not_adaptable(img: Any, limits: Limits) -> str | None:
    w, h = img.size
    if min(w, h) < limits.min_side:
        return f"tiny ({w}x{h})"
    arr = np.asarray(img)
    if arr.dtype.kind == "f" and not np.isfinite(arr).all():
        return "non-finite pixels"
    if arr.size and (arr == arr.reshape(-1)[0]).all():
        return "constant"
    return None


def _finite_rgb(img: Any) -> Any:
    """RGB; a float image's non-finite pixels become 0 first (its answer is still given)."""
    from PIL import Image

    if img.mode in ("F", "I", "I;16"):
        arr = np.nan_to_num(np.asarray(img, dtype=np.float64), nan=0.0, posinf=0.0, neginf=0.0)
        lo, hi = float(arr.min()), float(arr.max())
        scaled = np.zeros_like(arr) if hi <= lo else (arr - lo) / (hi - lo) * 255
        return Image.fromarray(scaled.astype(np.uint8)).convert("RGB")
    return img.convert("RGB")


def adaptable(inputs: dict[str, Any]) -> str | None:
    """Why a processed query must not be adapted on (non-finite or constant model inputs), or ``None``."""
    import torch

    for key, value in inputs.items():
        if torch.is_tensor(value) and value.is_floating_point():
            if not torch.isfinite(value).all():
                return f"non-finite {key}"
            if key == "pixel_values" and value.numel() and bool((value == value.reshape(-1)[0]).all()):
                return "constant"
    return None


__all__ = ["Decoded", "InputError", "Limits", "adaptable", "decode_image", "decode_text"]
