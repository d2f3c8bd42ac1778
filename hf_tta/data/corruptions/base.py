"""Helpers shared by the corruption modules: stable seeds, seeded global RNGs, severity checks, the missing-resource
error and word normalisation."""

from __future__ import annotations

import contextlib
import hashlib
import random
import re
from typing import Iterator

import numpy as np


def derive_seed(*parts: object) -> int:
    """A stable 32-bit seed from any parts (``hash()`` is salted per process; this is not)."""
    digest = hashlib.sha256("\x1f".join(repr(p) for p in parts).encode("utf-8")).digest()
    return int.from_bytes(digest[:4], "little")


@contextlib.contextmanager
def seeded(seed: int | None, torch_too: bool = False) -> Iterator[None]:
    """Seed Python's ``random`` and NumPy's global RNG (and torch's) inside the block, then restore them.

    With ``torch_too``, ``torch.manual_seed`` seeds the CPU generator and every accelerator's; all of them are
    restored on exit, so a corruption drawn on a GPU machine leaves the user's CUDA RNG stream where it was.

    With ``seed=None`` nothing is touched: the result then depends on the global RNG state, as upstream.
    The corruption packages (``imagecorruptions``, ``nlpaug``) draw from these global generators.
    """
    if seed is None:
        yield
        return
    seed = int(seed) % (2**32)
    py_state = random.getstate()
    np_state = np.random.get_state()
    random.seed(seed)
    np.random.seed(seed)
    with contextlib.ExitStack() as stack:
        if torch_too:
            import torch

            # torch.manual_seed also seeds every accelerator device; fork them all (an empty range without one)
            stack.enter_context(torch.random.fork_rng(devices=range(torch.accelerator.device_count())))
            torch.manual_seed(seed)
        try:
            yield
        finally:
            random.setstate(py_state)
            np.random.set_state(np_state)


def check_severity(name: str, severity: int, allowed: tuple[int, ...]) -> int:
    if isinstance(severity, bool) or not isinstance(severity, (int, np.integer)) or int(severity) not in allowed:
        raise ValueError(f"Severity of {name!r} must be one of {list(allowed)}; got {severity!r}.")
    return int(severity)


class MissingResourceError(RuntimeError):
    """A corruption needs data or a model that is not available here; the message says what to install."""


class BuildSettingsError(ValueError):
    """A build folder holds configs built with other settings (a resumed build must repeat them); the message names
    the differing settings and the fix."""


def bare_word(word: str) -> str:
    """``word`` lower-cased with everything but ``a``..``z`` removed (EDA's normalisation)."""
    return re.sub(r"[^a-z]", "", word.lower())
