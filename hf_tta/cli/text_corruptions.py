"""Text corruptions a user named that cannot be generated on this machine: read from the stream cache, or refused in
one line (never dropped from the grid)."""

from __future__ import annotations

from .arguments import UsageError
from .common import say


def refuse_missing(missing: dict[str, str]) -> None:
    """The one-line refusal naming the corruptions and why the first cannot run."""
    name, why = next(iter(missing.items()))
    raise UsageError(f"--text-corruptions: {', '.join(missing)} cannot run here ({name}: {why}); install what it "
                     "names, or leave them out of --text-corruptions.")


def check_cached(task, jobs: list, missing: dict[str, str]) -> None:
    """Named text corruptions that cannot be generated here run from ``--cache-dir`` only if every stream of theirs
    (and the text diverse stream, which draws from them) is there; else :func:`refuse_missing`."""
    needs = [j for j in jobs if j.condition.direction == "t2i"
             and (j.condition.shift in missing or j.condition.shift == "diverse")]
    if any(not task.cache_file(j.condition, j.seed).exists() for j in needs):
        refuse_missing(missing)
    say(f"--text-corruptions: {', '.join(missing)} cannot be generated here; their streams are read from --cache-dir")
