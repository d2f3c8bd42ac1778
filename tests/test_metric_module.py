"""The `evaluate` metric module hf_tta/metrics/retrieval_recall: loads offline, hand-computed cases, equal to the
core function, doctests, and shipped in the wheel's package data."""

import doctest
import importlib.util
import os

import pytest
import torch

from hf_tta.metrics import RETRIEVAL_RECALL_PATH, retrieval_metrics

MODULE_FILE = os.path.join(RETRIEVAL_RECALL_PATH, "retrieval_recall.py")


@pytest.fixture(scope="module")
def metric():
    import evaluate

    return evaluate.load(RETRIEVAL_RECALL_PATH)


def test_path_layout():
    # evaluate.load(<dir>) needs <dir>/<dir name>.py
    assert os.path.basename(RETRIEVAL_RECALL_PATH) == "retrieval_recall" and os.path.isfile(MODULE_FILE)


def test_one_import_per_line():
    """evaluate's import scanner is naive: `import a, b` is read as a package named 'a,'."""
    with open(MODULE_FILE, encoding="utf-8") as f:
        for line in f:
            if line.startswith("import "):
                assert "," not in line and " as " not in line, line


def test_hand_computed_single_positive(metric):
    # ranks of the relevant item: 1, 3, 2, 4
    scores = [[0.9, 0.1, 0.2, 0.3], [0.5, 0.6, 0.1, 0.7], [0.1, 0.2, 0.9, 0.8], [0.4, 0.3, 0.2, 0.1]]
    out = metric.compute(predictions=scores, references=[[0], [0], [3], [3]], k_values=[1, 2, 3])
    assert out["R@1"] == pytest.approx(25.0)
    assert out["R@2"] == pytest.approx(50.0)
    assert out["R@3"] == pytest.approx(75.0)
    assert out["medr"] == pytest.approx(2.5) and out["meanr"] == pytest.approx(2.5)
    assert out["mAP"] == pytest.approx(100 * (1 + 1 / 3 + 1 / 2 + 1 / 4) / 4)
    assert out["num_queries"] == 4


def test_hand_computed_several_relevant_items(metric):
    # query 0: relevant {1, 2} ranked 2 and 4 -> best 2, AP = (1/2 + 2/4) / 2 = 0.5
    # query 1: relevant {0, 3} ranked 1 and 2 -> best 1, AP = 1
    scores = [[0.9, 0.8, 0.1, 0.5], [0.9, 0.1, 0.2, 0.8]]
    out = metric.compute(predictions=scores, references=[[1, 2], [0, 3]], k_values=[1, 5, 10])
    assert out["R@1"] == pytest.approx(50.0) and out["R@5"] == 100.0 and out["R@10"] == 100.0
    assert out["medr"] == pytest.approx(1.5) and out["mAP"] == pytest.approx(75.0)


def test_equal_to_the_core_function_with_batches(metric):
    g = torch.Generator().manual_seed(0)
    scores = torch.randn(23, 40, generator=g)
    relevant = [sorted({int(i) for i in torch.randint(0, 40, (1 + q % 5,), generator=g)}) for q in range(23)]
    core = retrieval_metrics(scores, relevant, ks=(1, 5, 10))
    for start in range(0, 23, 8):
        metric.add_batch(predictions=scores[start : start + 8].tolist(), references=relevant[start : start + 8])
    out = metric.compute()
    assert out.keys() == core.keys()
    for k in core:
        assert out[k] == pytest.approx(core[k], abs=1e-6), k


def test_ties_are_pessimistic_and_arithmetic_exact(metric):
    # a collapsed model (all scores equal) reads 0 %, not 100 %
    out = metric.compute(predictions=[[0.5] * 4] * 3, references=[[0], [1], [2]], k_values=[1, 4])
    assert out["R@1"] == 0.0 and out["R@4"] == 100.0 and out["medr"] == 4.0
    # 1 hit in 5 queries is exactly 20.0 (float64), counts are ints
    scores = [[0.9, 0.1], [0.1, 0.9], [0.1, 0.9], [0.1, 0.9], [0.1, 0.9]]
    out = metric.compute(predictions=scores, references=[[0]] * 5, k_values=[1])
    assert out["R@1"] == 20.0 and type(out["R@1"]) is float and type(out["num_queries"]) is int
    # scores that differ only beyond float32 precision are not merged into a tie
    out = metric.compute(predictions=[[1.0, 1.0 + 1e-12]], references=[[1]], k_values=[1])
    assert out["R@1"] == 100.0


def test_ragged_predictions_are_refused(metric):
    with pytest.raises(ValueError, match="whole gallery"):
        metric.compute(predictions=[[0.1, 0.2], [0.3]], references=[[0], [0]])


def test_module_doctests():
    spec = importlib.util.spec_from_file_location("retrieval_recall_doctest", MODULE_FILE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    result = doctest.testmod(module)
    assert result.attempted >= 8 and result.failed == 0


def test_shipped_as_package_data():
    """setuptools' pyproject package discovery is namespace-aware, so the folder (no __init__.py) is packaged."""
    import tomllib
    from setuptools import find_namespace_packages

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(root, "pyproject.toml"), "rb") as f:
        find = tomllib.load(f)["tool"]["setuptools"]["packages"]["find"]
    assert find.get("namespaces", True)
    assert "hf_tta.metrics.retrieval_recall" in find_namespace_packages(root, include=find["include"])


@pytest.mark.parametrize("nan_rows", [[0, 1], [1]], ids=["all-nan", "one-row"])
def test_nan_scores_are_refused_in_one_line(metric, nan_rows):
    """Before: all-NaN scores gave R@1 0 without a word."""
    predictions = [[0.9, 0.1, 0.0], [0.2, 0.8, 0.1]]
    for i in nan_rows:
        predictions[i] = [float("nan")] * 3
    with pytest.raises(ValueError, match=rf"{len(nan_rows)} of 2 predictions hold NaN scores \(first: row {nan_rows[0]}\)") as err:
        metric.compute(predictions=predictions, references=[[0], [1]])
    assert "\n" not in str(err.value)
