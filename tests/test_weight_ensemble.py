"""Weight ensembling with the source (ROID's rule), by hand on small tensors."""

import pytest
import torch

from hf_tta.config_features import WeightEnsembleConfig
from hf_tta.weight_ensemble import ensemble_with_source


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


# ------------------------------------------------------------------------------------------ in the wrapper
from hf_tta import TTAConfig, TTAWrapper  # noqa: E402
from support import check_resume  # noqa: E402
from tiny_models import image_batch, make_model, text_batch  # noqa: E402

STREAM = [image_batch(8, seed=40 + i) for i in range(4)]


def _wrapper(**extra):
    tta = TTAWrapper(make_model("clip"), TTAConfig(objective="tcr", query_modality="image", lr=1e-2, **extra))
    return tta, tta.encode_gallery(text_batch(20, seed=1))


def test_after_a_batch_the_weights_are_pulled_towards_the_source_and_the_moments_are_not():
    ens, gallery = _wrapper(weight_ensemble={"momentum": 0.5})
    plain, _ = _wrapper()
    src = ens.source_parameters()
    out_e, out_p = ens.adapt_step(STREAM[0], gallery), plain.adapt_step(STREAM[0], gallery)
    assert torch.equal(out_e.scores, out_p.scores)  # the pull follows the batch's answer and updates
    for name, p in ens.params.items():
        assert torch.allclose(p, 0.5 * plain.params[name] + 0.5 * src[name], atol=1e-7), name
    for pe, pp in zip(ens.optimizer.param_groups[0]["params"], plain.optimizer.param_groups[0]["params"]):
        assert torch.equal(ens.optimizer.state[pe]["exp_avg"], plain.optimizer.state[pp]["exp_avg"])


def test_a_batch_that_updated_nothing_is_not_pulled():
    ens, gallery = _wrapper(weight_ensemble={"momentum": 0.5}, shift_gate={"threshold": 1e9})
    ens.fit_shift_gate(image_batch(64, seed=3))  # every batch stays below the threshold: the gate is closed
    ens.adapt_step(STREAM[0], gallery)
    assert all(torch.equal(p, ens.source_parameters()[n]) for n, p in ens.params.items())


def test_a_stream_with_weight_ensembling_resumes_bit_exact(tmp_path):
    check_resume(lambda: _wrapper(weight_ensemble={}), STREAM, 2, tmp_path)


def test_refused_on_an_episodic_stream_or_a_training_free_objective():
    with pytest.raises(ValueError, match="episodic"):
        TTAConfig(weight_ensemble={}, reset_policy="episodic")
    with pytest.raises(ValueError, match="training-free"):
        TTAConfig(objective="nnn", weight_ensemble={})
