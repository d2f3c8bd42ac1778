"""hf_tta/routed_output.py: the domains' outputs put back in the batch's order, by hand on two small outputs."""

from __future__ import annotations

import pytest
import torch

from hf_tta import TTAOutput
from hf_tta.gallery import TopKScores
from hf_tta.routed_output import assemble


def _two_domains(topk: bool = False):
    a = TTAOutput(torch.tensor([[1.0, 2.0], [3.0, 4.0]]), 0.5, 3, 2, skipped=["step 1: x"], logs={"l": 1.0},
                  safety_action="rollback", safety_logs={"agreement": 0.5})
    b = TTAOutput(torch.tensor([[5.0, 6.0]]), 2.0, 3, 1, logs={"l": 2.0}, safety_action="reset")
    if topk:
        a = TTAOutput(None, 0.5, 3, 2, topk=TopKScores(torch.tensor([[2.0, 1.0], [4.0, 3.0]]), torch.tensor([[1, 0], [1, 0]])))
        b = TTAOutput(None, 2.0, 3, 1, topk=TopKScores(torch.tensor([[6.0, 5.0]]), torch.tensor([[1, 0]])))
    slots = torch.tensor([0, 1, 0])  # rows 0 and 2 are domain "a"'s, row 1 is "b"'s
    return [("a", torch.tensor([0, 2]), a), ("b", torch.tensor([1]), b)], slots


def test_rows_go_back_in_order_and_the_records_are_combined():
    outputs, slots = _two_domains()
    out = assemble(outputs, slots, 3, ["a", "b"], ["b"], with_safety=True)
    assert torch.equal(out.scores, torch.tensor([[1.0, 2.0], [5.0, 6.0], [3.0, 4.0]]))
    assert out.loss == pytest.approx((2 * 0.5 + 1 * 2.0) / 3)  # weighted by each domain's rows
    assert (out.num_updates, out.n_selected) == (6, 3)
    assert out.skipped == ["a: step 1: x"] and out.logs == {"a/l": 1.0, "b/l": 2.0}
    assert out.safety_action == "reset" and out.safety_actions == {"a": "rollback", "b": "reset"}  # the most severe
    assert out.safety_logs == {"a/agreement": 0.5} and out.new_domains == ["b"] and torch.equal(out.domains, slots)
    assert assemble(outputs, slots, 3, ["a", "b"], [], with_safety=False).safety_actions == {}


def test_topk_rows_go_back_in_order():
    outputs, slots = _two_domains(topk=True)
    out = assemble(outputs, slots, 3, ["a", "b"], [], with_safety=False)
    assert out.scores is None
    assert torch.equal(out.topk.values, torch.tensor([[2.0, 1.0], [6.0, 5.0], [4.0, 3.0]]))
    assert torch.equal(out.topk.indices, torch.tensor([[1, 0], [1, 0], [1, 0]]))
