"""Optional dependencies: the core install is torch, transformers, peft, safetensors and huggingface-hub; the rest
comes with an extra (``pyproject.toml``), and a missing one is a one-line error that names it."""

from __future__ import annotations

import importlib
from types import ModuleType

#: The extra that installs each optional package.
EXTRA_OF = {"datasets": "data", "evaluate": "evaluate", "accelerate": "accelerate", "faiss": "index", "av": "audio", "fastapi": "serve"}


class MissingExtraError(ImportError):
    """An optional package is not installed: the message names the ``pip install "hf_tta[<extra>]"`` to run."""


def require(module: str, what: str) -> ModuleType:
    """Import ``module`` or raise :class:`MissingExtraError` naming the extra that installs it; ``what`` says what
    needs it, e.g. ``require("datasets", "loading a benchmark")``."""
    try:
        return importlib.import_module(module)
    except ImportError:
        extra = EXTRA_OF.get(module.split(".")[0], "test")
        raise MissingExtraError(f"{what} needs the `{module}` package: pip install \"hf_tta[{extra}]\"") from None
