"""Text corruptions that cannot be generated on this machine, named by the user or in the text diverse stream's pool:
read from the stream cache, or refused in one line (never dropped from the grid or the pool)."""

from __future__ import annotations

from .arguments import UsageError
from .common import say


def refuse_missing(missing: dict[str, str], diverse: bool = False) -> None:
    """The one-line refusal naming the corruptions and why the first cannot run (``diverse``: they are the diverse
    stream's pool, not named by the user)."""
    name, why = next(iter(missing.items()))
    if diverse:
        raise UsageError(f"--diverse: the text diverse stream draws from {', '.join(missing)}, which cannot run here "
                         f"({name}: {why}) and whose diverse stream is not in --cache-dir; install what it names, or "
                         "name the corruptions it should draw from with --text-corruptions.")
    raise UsageError(f"--text-corruptions: {', '.join(missing)} cannot run here ({name}: {why}); install what it "
                     "names, or leave them out of --text-corruptions.")


def check_text_streams(task, jobs: list, named_missing: dict[str, str], emoji: bool, cache_dir) -> None:
    """Every text stream of ``jobs`` can be generated here or is read from ``cache_dir``; else :func:`refuse_missing`.

    ``named_missing``: the named corruptions that cannot be generated here; their streams and the text diverse stream
    (which draws from them) must all be cached. The emoji task's diverse stream draws from a fixed pool
    (:meth:`~hf_tta.benchmarks.tasks.EmojiTask.diverse_text_corruptions`): a member this machine cannot generate
    needs that stream cached too (a pool that followed the machine's packages made two streams of one name)."""
    from ..benchmarks.grid import offline_text_corruptions

    missing = dict(named_missing)
    if emoji and any(j.condition.direction == "t2i" and j.condition.shift == "diverse" for j in jobs):
        pool = [n for n in task.diverse_text_corruptions() if n not in missing]
        missing |= offline_text_corruptions(pool)[1]
    if not missing:
        return
    needs = [j for j in jobs if j.condition.direction == "t2i"
             and (j.condition.shift in missing or j.condition.shift == "diverse")]
    if cache_dir is None or any(not task.cache_file(j.condition, j.seed).exists() for j in needs):
        refuse_missing(missing, diverse=not named_missing)
    flag = "--text-corruptions" if named_missing else "--diverse"
    say(f"{flag}: {', '.join(missing)} cannot be generated here; their streams are read from --cache-dir")
