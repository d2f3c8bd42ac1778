"""What every CLI module shares without import cycles: the user-error type, the comma-list option type and the
notes printed once per run."""

from __future__ import annotations

import os
import sys


class UsageError(ValueError):
    """A mistake in the command line: reported as one line naming the fix, exit status 2 (traceback with --debug)."""


def comma_list(value: str) -> list[str]:
    """The non-empty items of a comma list, stripped."""
    return [v.strip() for v in value.split(",") if v.strip()]


def on_main_process() -> bool:
    """Whether this process is the one that prints: rank 0 of an initialised ``torch.distributed`` group (the group
    accelerate's ``PartialState`` starts for ``accelerate launch --num_processes P``), else rank 0 of a launcher's
    environment (``RANK``, set by ``accelerate launch`` and ``torchrun``), else the only process."""
    if "torch" in sys.modules:  # a process that never imported torch has no process group
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_rank() == 0
    return os.environ.get("RANK", "0").strip() in ("", "0")


def say(message: str) -> None:
    """An ``hf-tta: <message>`` note on stdout (what the run decided for the user), printed by the main process
    only: every process of the accelerate recipe prepares the same grid, and one line is the run's, not one each."""
    if on_main_process():
        print(f"hf-tta: {message}", flush=True)
