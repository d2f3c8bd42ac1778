"""The process settings a command sets before it loads anything: torch threads, the Hugging Face offline mode and
(``--quiet``) the Hugging Face libraries' progress bars."""

from __future__ import annotations

import os


def setup_environment(args) -> None:
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    if args.model is None:
        go_offline()  # the emoji benchmark never needs the network; say so to the Hugging Face libraries
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if getattr(args, "quiet", False):  # --quiet: no progress bars, transformers' and the hub's (loading weights) too
        import huggingface_hub.utils
        from transformers.utils import logging as transformers_logging

        transformers_logging.disable_progress_bar()
        huggingface_hub.utils.disable_progress_bars()


def go_offline() -> None:
    """Offline mode for the Hugging Face libraries unless the environment says ``HF_HUB_OFFLINE=0``. The hub reads the
    variable once at import (already done by the time a command runs), so its module flag is set too."""
    if os.environ.setdefault("HF_HUB_OFFLINE", "1") == "0":
        return
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    import huggingface_hub.constants

    huggingface_hub.constants.HF_HUB_OFFLINE = True
