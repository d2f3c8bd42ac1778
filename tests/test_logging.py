"""hf_tta.logging: one ``hf_tta`` logger hierarchy with transformers-style verbosity, and progress bars that honour
the ecosystem's switches and stay silent when stderr is not a terminal."""

from __future__ import annotations

import io
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

import hf_tta
from hf_tta import logging as hf_logging

REPO = Path(__file__).resolve().parents[1]


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.fixture
def restore():
    level = hf_logging.get_verbosity()
    yield
    hf_logging.set_verbosity(level)
    hf_logging.enable_progress_bar()


@pytest.mark.parametrize(
    "setter,level",
    [("set_verbosity_debug", logging.DEBUG), ("set_verbosity_info", logging.INFO),
     ("set_verbosity_warning", logging.WARNING), ("set_verbosity_error", logging.ERROR)],
)
def test_set_verbosity_governs_every_module_logger(restore, caplog, setter, level):
    getattr(hf_tta.logging, setter)()
    assert hf_logging.get_verbosity() == level
    child = logging.getLogger("hf_tta.benchmarks.runner")  # a module's logger: a child of the hf_tta logger
    assert child.getEffectiveLevel() == level
    with caplog.at_level(logging.DEBUG):  # the root accepts everything: hf_tta's level alone decides
        child.info("an info record")
    assert ("an info record" in caplog.text) == (level <= logging.INFO)


def test_set_verbosity_by_name_and_refusal(restore):
    hf_logging.set_verbosity("error")
    assert hf_logging.get_verbosity() == logging.ERROR
    with pytest.raises(ValueError, match="Unknown verbosity"):
        hf_logging.set_verbosity("loud")


@pytest.mark.parametrize("value,expected", [("info", logging.INFO), ("ERROR", logging.ERROR), ("", logging.WARNING)])
def test_env_level(monkeypatch, value, expected):
    monkeypatch.setenv("HF_TTA_VERBOSITY", value)
    assert hf_logging._env_level() == expected


@pytest.mark.parametrize("verbosity,shown", [("info", True), ("error", False)])
def test_environment_variable_and_default_handler_in_a_fresh_process(verbosity, shown):
    code = "import logging, hf_tta; print(hf_tta.logging.get_verbosity()); logging.getLogger('hf_tta.x').warning('careful')"
    env = dict(os.environ, HF_TTA_VERBOSITY=verbosity, PYTHONPATH=str(REPO))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=REPO, check=True)
    assert int(out.stdout.strip().splitlines()[-1]) == {"info": logging.INFO, "error": logging.ERROR}[verbosity]
    assert ("careful" in out.stderr) == shown  # printed by hf_tta's handler: the script configured no logging


def _bar_disabled() -> bool:
    with hf_logging.tqdm(range(3)) as bar:
        return bar.disable


def test_progress_bar_draws_on_a_terminal_only(monkeypatch, restore):
    monkeypatch.delenv("HF_HUB_DISABLE_PROGRESS_BARS", raising=False)
    monkeypatch.delenv("TQDM_DISABLE", raising=False)
    monkeypatch.setattr(sys, "stderr", _Terminal())
    assert not _bar_disabled()
    hf_logging.disable_progress_bar()  # the global off switch
    assert _bar_disabled()
    hf_logging.enable_progress_bar()
    assert not _bar_disabled()
    monkeypatch.setattr(sys, "stderr", io.StringIO())  # a log file / pipe: no redraws
    assert _bar_disabled()


@pytest.mark.parametrize("variable", ["HF_HUB_DISABLE_PROGRESS_BARS", "TQDM_DISABLE"])
def test_progress_bar_honours_the_ecosystem_switches(monkeypatch, restore, variable):
    monkeypatch.setattr(sys, "stderr", _Terminal())
    monkeypatch.setenv(variable, "1")
    assert _bar_disabled()
    monkeypatch.setenv(variable, "0")
    assert not _bar_disabled()


def test_hidden_bar_still_iterates_and_writes_nothing(monkeypatch):
    stream = io.StringIO()
    monkeypatch.setattr(sys, "stderr", stream)
    assert list(hf_logging.tqdm(range(4), desc="x")) == [0, 1, 2, 3]
    assert stream.getvalue() == ""


@pytest.mark.parametrize(
    "module", ["hf_tta.benchmarks.runner", "hf_tta.data.builders.benchmark", "hf_tta.data.builders.karpathy",
               "hf_tta.data.builders.hub"],
)
def test_library_modules_use_the_wrapper(module):
    import importlib

    assert importlib.import_module(module).tqdm is hf_logging.tqdm
