"""READ (hf_tta/objectives/read.py): its two losses by hand."""

from __future__ import annotations

import math

import pytest
import torch

from hf_tta.objectives.read import read_losses


def test_read_losses():
    logits = torch.tensor([[2.0, 0.0], [0.0, 1.0]])
    p = logits.softmax(1)
    pm = p.max(1).values
    l_ra, l_bal = read_losses(logits, math.exp(-1))
    assert l_ra.item() == pytest.approx((-(pm * pm.log())).mean().item(), abs=1e-6)  # gamma = 1/e
    ps = p.sum(0)
    q = ps.softmax(0)
    assert l_bal.item() == pytest.approx(-(q * q.log()).sum().item(), abs=1e-6)
