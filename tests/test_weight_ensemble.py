"""Weight ensembling with the source (ROID's rule), by hand on small tensors."""

import pytest
import torch

from hf_tta.weight_ensemble import WeightEnsembleConfig, ensemble_with_source


def test_the_pull_is_m_theta_plus_one_minus_m_source():
    p = {"w": torch.tensor([1.0, 2.0, -4.0]), "b": torch.tensor([10.0])}
    src = {"w": torch.tensor([0.0, 2.0, 4.0]), "b": torch.tensor([0.0])}
    ensemble_with_source(p, src, 0.9)
    # 0.9 * 1 + 0.1 * 0 = 0.9; 0.9 * 2 + 0.1 * 2 = 2; 0.9 * -4 + 0.1 * 4 = -3.2; 0.9 * 10 = 9
    assert torch.allclose(p["w"], torch.tensor([0.9, 2.0, -3.2]))
    assert torch.allclose(p["b"], torch.tensor([9.0]))


def test_momentum_zero_returns_to_the_source_and_the_parameter_object_is_kept():
    w = torch.nn.Parameter(torch.tensor([3.0, -1.0]))
    src = {"w": torch.tensor([0.5, 0.25])}
    ensemble_with_source({"w": w}, src, 0.0)
    assert torch.equal(w.data, src["w"]) and w.requires_grad  # in place: the optimiser still holds this tensor


@pytest.mark.parametrize("momentum", [1.0, -0.1, 1.5])
def test_a_momentum_outside_0_1_is_refused_in_one_line(momentum):
    with pytest.raises(ValueError, match=r"must be in \[0, 1\)"):
        WeightEnsembleConfig(momentum=momentum)


def test_the_config_round_trips():
    assert WeightEnsembleConfig.from_dict(WeightEnsembleConfig(momentum=0.95).to_dict()).momentum == 0.95
