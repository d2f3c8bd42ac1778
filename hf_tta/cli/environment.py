"""The process settings a command sets before it loads anything: torch threads and the Hugging Face offline mode."""

from __future__ import annotations

import os


def setup_environment(args) -> None:
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    if args.model is None:
        go_offline()  # the emoji benchmark never needs the network; say so to the Hugging Face libraries
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def go_offline() -> None:
    """Offline mode for the Hugging Face libraries unless the environment says ``HF_HUB_OFFLINE=0``. The hub reads the
    variable once at import (already done by the time a command runs), so its module flag is set too."""
    if os.environ.setdefault("HF_HUB_OFFLINE", "1") == "0":
        return
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    import huggingface_hub.constants

    huggingface_hub.constants.HF_HUB_OFFLINE = True
