"""Atomic writes for the benchmark's cache files (query streams, gallery embeddings).

Several processes share one ``--cache-dir`` (``hf-tta run --shard K/N``, the accelerate recipe): a file is written
beside its final name and renamed into place, so a reader sees either no file or a whole one, never a torn write.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Callable


def write_atomically(path: str | os.PathLike, write: Callable[[str], None]) -> Path:
    """Call ``write(tmp)`` on a fresh temporary path in ``path``'s folder, then rename it to ``path``.

    A failing ``write`` leaves neither ``path`` nor the temporary file behind."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path
