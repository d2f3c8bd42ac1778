"""The process settings a command sets before it loads anything: torch threads, the Hugging Face offline mode and
(``--quiet``) the Hugging Face libraries' progress bars."""

from __future__ import annotations

import os
import sys


def setup_environment(args) -> None:
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    if args.model is None:
        go_offline()  # the emoji benchmark never needs the network; say so to the Hugging Face libraries
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if getattr(args, "quiet", False):
        hide_library_progress_bars()


def hide_library_progress_bars() -> None:
    """``--quiet``: no progress bar from the Hugging Face libraries, each hidden by its own switch: transformers'
    (loading weights), the hub's (downloads, uploads) and datasets' (generating, saving and loading splits: a build
    wrote 58 bar lines without it). hf_tta's own bars follow the commands' ``show_progress`` flags. datasets is not
    imported for this (a run of the emoji benchmark never loads it): until it is, its environment switch is set,
    which datasets reads at import."""
    import huggingface_hub.utils
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()
    huggingface_hub.utils.disable_progress_bars()
    datasets = sys.modules.get("datasets")  # None too where it is missing or blocked: the command names the extra later
    if datasets is not None:
        datasets.disable_progress_bars()
    else:
        os.environ["HF_DATASETS_DISABLE_PROGRESS_BARS"] = "1"


def go_offline() -> None:
    """Offline mode for the Hugging Face libraries unless the environment says ``HF_HUB_OFFLINE=0``. The hub reads the
    variable once at import (already done by the time a command runs), so its module flag is set too."""
    if os.environ.setdefault("HF_HUB_OFFLINE", "1") == "0":
        return
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    import huggingface_hub.constants

    huggingface_hub.constants.HF_HUB_OFFLINE = True
