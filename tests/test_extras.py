"""The install footprint: the core needs torch, transformers, peft, safetensors and huggingface-hub; datasets, evaluate
and accelerate come with extras, and a missing one is a one-line error naming the extra."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from hf_tta.extras import MissingExtraError, require

ROOT = Path(__file__).resolve().parents[1]


def _pyproject() -> dict:
    tomllib = pytest.importorskip("tomllib", reason="Python >= 3.11")
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def _names(requirements) -> set[str]:
    return {re.split(r"[<>=!~\[ ;]", r, maxsplit=1)[0].lower() for r in requirements}


def test_core_dependencies_leave_datasets_evaluate_and_accelerate_to_extras():
    project = _pyproject()["project"]
    core = _names(project["dependencies"])
    assert {"torch", "transformers", "peft", "safetensors", "huggingface-hub"} <= core
    assert core - {"torch", "transformers", "peft", "safetensors", "huggingface-hub"} <= {"numpy", "tqdm"}  # transformers' own
    extras = project["optional-dependencies"]
    for package, extra in (("datasets", "data"), ("evaluate", "evaluate"), ("accelerate", "accelerate")):
        assert package not in core and package in _names(extras[extra]), package
        assert extra in extras["test"][0], extra  # the test extra installs everything the suite runs


def test_core_works_without_datasets_and_evaluate():
    """A fresh process where `datasets` and `evaluate` cannot be imported (accelerate cannot be hidden: peft imports
    it) wraps and adapts a model, and loading a benchmark names the extra."""
    code = (
        "import sys\n"
        "sys.modules['datasets'] = None; sys.modules['evaluate'] = None\n"
        "sys.path.insert(0, 'tests')\n"
        "from tiny_models import batch, make_model\n"
        "from hf_tta import GalleryCache, TTAConfig, TTAWrapper\n"
        "import torch\n"
        "tta = TTAWrapper(make_model('clip'), TTAConfig(objective='tent'))\n"
        "gallery = tta.encode_gallery([batch('text', 16)])\n"
        "out = tta.adapt_step(batch('image', 8), gallery)\n"
        "assert out.num_updates == 3, out.num_updates\n"
        "from hf_tta.data.builders import load_retrieval_split\n"
        "try:\n"
        "    load_retrieval_split('somewhere', 'clean', task='i2t')\n"
        "except ImportError as err:\n"
        "    print(type(err).__name__, err)\n"
    )
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=str(ROOT), timeout=300)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip().splitlines()[-1] == (
        'MissingExtraError Loading a benchmark needs the `datasets` package: pip install "hf_tta[data]"')


@pytest.mark.parametrize("module, extra", [("datasets", "data"), ("evaluate", "evaluate"), ("accelerate", "accelerate")])
def test_require_names_the_extra(module, extra, monkeypatch):
    monkeypatch.setitem(sys.modules, module, None)  # as if not installed
    with pytest.raises(MissingExtraError, match=re.escape(f'needs the `{module}` package: pip install "hf_tta[{extra}]"')):
        require(module, "this")


def test_the_cli_and_the_accelerate_recipe_name_the_missing_extra(monkeypatch, tmp_path, capsys):
    from hf_tta import cli

    (tmp_path / "model").mkdir()
    (tmp_path / "data").mkdir()
    monkeypatch.setitem(sys.modules, "datasets", None)
    assert cli.main(["run", "--model", str(tmp_path / "model"), "--dataset", str(tmp_path / "data"), "--quiet"]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and 'pip install "hf_tta[data]"' in err, err
    monkeypatch.setitem(sys.modules, "accelerate", None)
    spec = importlib.util.spec_from_file_location("accelerate_grid", ROOT / "recipes" / "accelerate_grid.py")
    recipe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(recipe)
    with pytest.raises(MissingExtraError, match=re.escape('pip install "hf_tta[accelerate]"')):
        recipe.main(["--quiet"])


def test_distributed_stream_refuses_fp16_in_one_line():
    env = {**os.environ, "ACCELERATE_MIXED_PRECISION": "fp16", "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    res = subprocess.run([sys.executable, "recipes/distributed_stream.py"], capture_output=True, text=True, env=env,
                         cwd=str(ROOT), timeout=300)
    assert res.returncode == 1
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "--mixed_precision fp16" in lines[0] and "--mixed_precision bf16" in lines[0], res.stderr
