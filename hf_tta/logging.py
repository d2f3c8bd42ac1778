"""Logging and progress bars the way the rest of the Hugging Face stack does them.

Every module logs through ``logging.getLogger(__name__)``, so all records live under one ``hf_tta`` hierarchy,
whose level this module sets, as ``transformers.logging`` does for ``transformers``:

    >>> import hf_tta
    >>> hf_tta.logging.set_verbosity_info()      # or _warning (the default), _error, _debug
    >>> hf_tta.logging.get_verbosity() == hf_tta.logging.INFO
    True
    >>> hf_tta.logging.set_verbosity_warning()

The environment variable ``HF_TTA_VERBOSITY`` (``debug``, ``info``, ``warning``, ``error``, ``critical``) sets the
level at import. Records propagate to the root logger (an application's ``logging`` configuration, pytest's
``caplog``); while the root logger has no handler, a default handler prints them on stderr, so a bare script
sees the warnings and, after ``set_verbosity_info()``, the decisions hf_tta took on its behalf.

Progress bars: use :func:`tqdm` (a drop-in for ``tqdm.auto.tqdm``). A bar is hidden when

- :func:`disable_progress_bar` was called (undo with :func:`enable_progress_bar`), or
- ``HF_HUB_DISABLE_PROGRESS_BARS`` or ``TQDM_DISABLE`` is set to a true value (``1``, ``true``, ``yes``, ``on``), or
- stderr is not a terminal (a log file, CI, a pipe): no redraws, hence no ``\\r``-separated lines in logs, or
- the caller passes ``disable=True``.

This module imports nothing from hf_tta, so any module may import it.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from logging import CRITICAL, DEBUG, ERROR, INFO, WARNING  # noqa: F401  (re-exported, as transformers.logging does)
from typing import Any

_LIBRARY = "hf_tta"
_LEVELS = {"debug": DEBUG, "info": INFO, "warning": WARNING, "error": ERROR, "critical": CRITICAL}
_DEFAULT_LEVEL = WARNING
_TRUE = {"1", "true", "yes", "on"}
_lock = threading.Lock()
_progress_enabled = True


class _DefaultHandler(logging.StreamHandler):
    """stderr, only while the application has configured no root handler (else the record propagates there)."""

    def emit(self, record: logging.LogRecord) -> None:
        if logging.getLogger().handlers:
            return
        self.stream = sys.stderr  # follow redirections (pytest's capsys, contextlib.redirect_stderr)
        super().emit(record)


_default_handler: _DefaultHandler | None = None


def _env_level() -> int:
    value = os.environ.get("HF_TTA_VERBOSITY", "").strip().lower()
    if not value:
        return _DEFAULT_LEVEL
    if value not in _LEVELS:
        logging.getLogger(_LIBRARY).warning(
            "Unknown HF_TTA_VERBOSITY=%r; use one of %s.", value, ", ".join(_LEVELS)
        )
        return _DEFAULT_LEVEL
    return _LEVELS[value]


def _configure() -> None:
    global _default_handler
    with _lock:
        if _default_handler is not None:
            return
        _default_handler = _DefaultHandler()
        _default_handler.setFormatter(logging.Formatter("[%(name)s] %(levelname)s: %(message)s"))
        root = logging.getLogger(_LIBRARY)
        root.addHandler(_default_handler)
        root.setLevel(_env_level())


def get_logger(name: str | None = None) -> logging.Logger:
    """The logger ``name`` (a module's ``__name__``), or the library's root logger ``hf_tta``."""
    _configure()
    return logging.getLogger(name or _LIBRARY)


def get_verbosity() -> int:
    """The level of the ``hf_tta`` logger (``hf_tta.logging.WARNING`` by default)."""
    return get_logger().getEffectiveLevel()


def set_verbosity(level: int | str) -> None:
    """Set the ``hf_tta`` level: ``logging.INFO`` or a name such as ``"info"``."""
    if isinstance(level, str):
        if level.lower() not in _LEVELS:
            raise ValueError(f"Unknown verbosity {level!r}; use one of {', '.join(_LEVELS)}.")
        level = _LEVELS[level.lower()]
    get_logger().setLevel(level)


def set_verbosity_debug() -> None:
    set_verbosity(DEBUG)


def set_verbosity_info() -> None:
    set_verbosity(INFO)


def set_verbosity_warning() -> None:
    set_verbosity(WARNING)


def set_verbosity_error() -> None:
    set_verbosity(ERROR)


def disable_default_handler() -> None:
    """Never print through hf_tta's own stderr handler (records still propagate to the root logger)."""
    _configure()
    get_logger().removeHandler(_default_handler)


def enable_default_handler() -> None:
    _configure()
    if _default_handler not in get_logger().handlers:
        get_logger().addHandler(_default_handler)


# ------------------------------------------------------------------------------------------------ progress bars
def disable_progress_bar() -> None:
    """Hide every hf_tta progress bar (the global off switch)."""
    global _progress_enabled
    _progress_enabled = False


def enable_progress_bar() -> None:
    """Undo :func:`disable_progress_bar` (the environment switches and a non-terminal stderr still hide bars)."""
    global _progress_enabled
    _progress_enabled = True


def is_progress_bar_enabled() -> bool:
    """Whether a bar would be drawn now: the global switch, the environment switches and a terminal stderr."""
    if not _progress_enabled:
        return False
    if any(os.environ.get(v, "").strip().lower() in _TRUE for v in ("HF_HUB_DISABLE_PROGRESS_BARS", "TQDM_DISABLE")):
        return False
    isatty = getattr(sys.stderr, "isatty", None)
    return bool(isatty and isatty())


def tqdm(*args: Any, disable: bool = False, **kwargs: Any):
    """``tqdm.auto.tqdm`` that honours :func:`is_progress_bar_enabled`; iterate it or use it as a context manager
    exactly as tqdm (a hidden bar still iterates its iterable and accepts ``update``/``set_postfix``)."""
    from tqdm.auto import tqdm as _tqdm

    return _tqdm(*args, disable=disable or not is_progress_bar_enabled(), **kwargs)


_configure()
