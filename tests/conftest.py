"""Test settings (offline, one thread for 2-core CI, tiny models and tests/support.py on sys.path) and shared fixtures."""

import os
import sys

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402
from transformers.utils import logging as transformers_logging  # noqa: E402

torch.set_num_threads(1)
# transformers gives its root logger a stderr handler on first use: make that now (pytest's session-long capture),
# not inside whichever test logs first, whose captured stream is closed after it (import hf_tta no longer loads
# transformers, and with pytest-xdist any test can come first)
transformers_logging.get_logger("transformers")
sys.path.insert(0, os.path.dirname(__file__))


import pytest  # noqa: E402

from hf_tta.objectives.base import OBJECTIVES, register_objective  # noqa: E402


@pytest.fixture
def push():
    """The harmful test objective of ``support.Push``, registered for one test; yields its name."""
    from support import Push, PushConfig

    register_objective("safety_push_test", PushConfig)(Push)
    yield "safety_push_test"
    OBJECTIVES.pop("safety_push_test")


@pytest.fixture
def gallery():
    """A dense 40-item text gallery of 16-d unit vectors (the tiny CLIP's embedding size)."""
    from support import dense_gallery

    return dense_gallery()
