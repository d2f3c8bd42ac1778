"""``hf_tta.tuning``: which tensors adapt (LN tuning, BitFit, LoRA) selected by name, per-group learning rates, and the
L2-SP pull towards the source weights and the consistency with the source's top-k predictions, checked by hand on
small cases."""

from __future__ import annotations

import pytest
import torch
from peft.tuners.lora import LoraLayer

from hf_tta import ConsistencyConfig, TTAConfig, TTAWrapper, TuningConfig
from hf_tta.objectives.base import ObjectiveInputs
from hf_tta.state import ALL, AdapterState
from hf_tta.tuning import SourceConsistency
from support import dense_gallery, image_stream
from tiny_models import batch, make_model

MLP = ".*vision_model.*mlp.fc[12]"
ATTN = ".*vision_model.*self_attn.(q|v)_proj"


def _wrapper(lr=None, weight_decay=1e-4, steps=3, seed=0, consistency=None, **tuning) -> TTAWrapper:
    """A TCR wrapper of the tiny CLIP's image tower; ``tuning`` are :class:`TuningConfig` fields."""
    cfg = TTAConfig(objective="tcr", query_modality="image", lr=lr, weight_decay=weight_decay, steps=steps, seed=seed,
                    consistency=consistency, tuning=TuningConfig(**tuning))
    return TTAWrapper(make_model("clip"), cfg)


# ------------------------------------------------------------------------------------- selection by name
def test_bias_tuning_adapts_every_bias_of_the_query_tower_and_nothing_else():
    tta = _wrapper(method="bias")
    source = make_model("clip")
    expected = {n for n, p in source.named_parameters() if n.startswith("vision_model.") and n.endswith(".bias")}
    expected |= {n for n, p in source.named_parameters() if n.startswith("visual_projection") and n.endswith(".bias")}
    assert set(tta.params) == expected  # the model's own names: adapted in place
    assert {n for n, p in tta.model.named_parameters() if p.requires_grad} == expected


def test_bias_tuning_with_target_modules_adapts_only_their_biases():
    tta = _wrapper(method="bias", target_modules=MLP)
    assert sorted({n.rsplit(".", 2)[-2] for n in tta.params}) == ["fc1", "fc2"]
    assert len(tta.params) == 2 * make_model("clip").config.vision_config.num_hidden_layers


@pytest.mark.parametrize("target, kinds", [(MLP, {"fc1", "fc2"}), (ATTN, {"q_proj", "v_proj"})], ids=["mlp", "attention"])
@pytest.mark.parametrize("rank", [1, 4])
def test_lora_adapts_only_low_rank_factors_of_the_named_layers(target, kinds, rank):
    tta = _wrapper(method="lora", lora_rank=rank, target_modules=target)
    layers = {n: m for n, m in tta.model.named_modules() if isinstance(m, LoraLayer)}
    assert {n.rsplit(".", 1)[-1] for n in layers} == kinds
    assert all("lora_A" in n or "lora_B" in n for n in tta.params)
    assert len(tta.params) == 2 * len(layers)
    for layer in layers.values():
        assert layer.lora_A["default"].weight.shape[0] == rank and layer.lora_B["default"].weight.shape[1] == rank
        assert layer.scaling["default"] == 1.0  # lora_alpha = r


def test_lora_starts_at_the_source_model_and_its_init_follows_the_seed():
    gallery, x = dense_gallery(), image_stream(1)[0]
    source = _wrapper()
    a = _wrapper(method="lora", target_modules=MLP, seed=3)
    b = _wrapper(method="lora", target_modules=MLP, seed=3)
    c = _wrapper(method="lora", target_modules=MLP, seed=4)
    assert torch.equal(a.embed_and_score(x, gallery)[1], source.embed_and_score(x, gallery)[1])  # B = 0: ΔW = 0
    assert all(torch.equal(p, b.params[n]) for n, p in a.params.items())
    assert any(not torch.equal(p, c.params[n]) for n, p in a.params.items() if "lora_A" in n)


@pytest.mark.parametrize(
    "cfg, match",
    [
        ({"method": "lora"}, "target_modules"),
        ({"method": "lora", "target_modules": ".*vision_model.*layer_norm1"}, "lora"),
        ({"method": "loraa"}, "method"),
        ({"method": "lora", "target_modules": MLP, "lora_rank": 0}, "lora_rank"),
        ({"lora_rank": 8}, "lora_rank` applies to method='lora' only"),
        ({"anchor_weight": -1.0}, "anchor_weight"),
        ({"consistency": {"weight": -1.0}}, "ConsistencyConfig `weight`"),
        ({"consistency": {"weight": 1.0, "top_k": 0}}, "ConsistencyConfig `top_k`"),
        ({"consistency": {"weight": 1.0, "temperature": 0.0}}, "ConsistencyConfig `temperature`"),
        ({"lr_multipliers": {"fc1": 0.0}}, "lr_multipliers"),
        ({"lr_multipliers": {"(": 0.5}}, "regular expression"),
        ({"lr_multipliers": {"no_such_tensor": 0.5}}, "match no adapted parameter"),
    ],
)
def test_a_bad_tuning_option_gets_one_line_naming_it(cfg, match):
    with pytest.raises(ValueError, match=match) as err:
        _wrapper(**cfg)
    assert "\n" not in str(err.value)


def test_the_options_round_trip_through_json():
    cfg = TTAConfig(tuning=TuningConfig(method="lora", lora_rank=8, target_modules=MLP, lr_multipliers={"lora_B": 0.1}, anchor_weight=2.5))
    assert TTAConfig.from_dict(cfg.to_dict()) == cfg


# ------------------------------------------------------------------------------------- per-group learning rates
def test_lr_multipliers_scale_each_groups_first_adamw_step():
    """AdamW's first step moves every element by lr * sign(grad) (|m_hat / sqrt(v_hat)| = 1 when eps is negligible)
    plus the decoupled decay lr * wd * theta: the matched LayerNorm biases move by a tenth of the others' step."""
    tta = _wrapper(lr=1e-3, weight_decay=0.0, steps=1, lr_multipliers={r"layer_norm1\..*bias": 0.1})
    lrs = sorted(g["lr"] for g in tta.optimizer.param_groups)
    assert lrs == pytest.approx([1e-4, 1e-3])
    before = tta.source_parameters()
    tta.adapt_step(image_stream(1)[0], dense_gallery())
    for name, p in tta.params.items():
        moved = (p.detach() - before[name]).abs()
        grad_nonzero = moved > 0
        expected = 1e-4 if ("layer_norm1" in name and name.endswith("bias")) else 1e-3
        assert grad_nonzero.any(), name
        assert torch.allclose(moved[grad_nonzero], torch.full_like(moved[grad_nonzero], expected), rtol=1e-3), name


def test_one_multiplier_of_one_is_bit_identical_to_none():
    gallery, stream = dense_gallery(), image_stream(2)
    a, b = _wrapper(), _wrapper(lr_multipliers={"layer_norm": 1.0})
    for x in stream:
        assert torch.equal(a.adapt_step(x, gallery).scores, b.adapt_step(x, gallery).scores)


# ------------------------------------------------------------------------------------- the pull towards the source
def test_anchor_value_by_hand_on_plain_tensors():
    tta = _wrapper(anchor_weight=3.0)
    source = tta.source_parameters()
    offsets = {}
    with torch.no_grad():
        for i, (name, p) in enumerate(tta.params.items()):
            offsets[name] = 0.01 * (i + 1)
            p.add_(offsets[name])
    by_hand = 0.5 * 3.0 * sum(off**2 * source[n].numel() for n, off in offsets.items())
    assert tta.loop.penalties[0].value().item() == pytest.approx(by_hand, rel=1e-4)


def test_anchor_value_by_hand_on_lora_is_the_effective_weight_change():
    tta = _wrapper(method="lora", lora_rank=2, target_modules=".*vision_model.encoder.layers.0.mlp.fc1", anchor_weight=0.5)
    (layer,) = [m for m in tta.model.modules() if isinstance(m, LoraLayer)]
    A, B = layer.lora_A["default"].weight, layer.lora_B["default"].weight
    with torch.no_grad():
        A.copy_(torch.tensor([[1.0] + [0.0] * (A.shape[1] - 1), [0.0, 2.0] + [0.0] * (A.shape[1] - 2)]))
        B.zero_()
        B[0, 0], B[1, 1] = 3.0, -1.0  # ΔW = B A has entries 3 (row 0, col 0) and -2 (row 1, col 1)
    assert tta.loop.penalties[0].value().item() == pytest.approx(0.5 * 0.5 * (9.0 + 4.0))


def test_the_anchor_is_part_of_the_loss_and_logged():
    gallery, x = dense_gallery(), image_stream(1)[0]
    plain, anchored = _wrapper(), _wrapper(anchor_weight=100.0)
    a, b = plain.adapt_step(x, gallery), anchored.adapt_step(x, gallery)
    assert "anchor" not in a.logs and b.logs["anchor"] > 0
    drift = {n: sum((p.detach() - w.source_parameters()[n]).norm() for n, p in w.params.items()) for n, w in
             (("plain", plain), ("anchored", anchored))}
    assert drift["anchored"] < drift["plain"]  # a strong pull keeps the parameters nearer the source


# ------------------------------------------------------------------------------------- state
@pytest.mark.parametrize("cfg", [{"method": "bias"}, {"method": "lora", "target_modules": MLP}], ids=["bias", "lora"])
def test_reset_returns_the_new_parameters_to_the_source_exactly(cfg):
    tta = _wrapper(**cfg)
    gallery = dense_gallery()
    source = AdapterState.capture(tta, ALL)
    x = batch("image", 8, seed=5)
    before = tta.embed_and_score(x, gallery)[1]
    for b in image_stream(2):
        tta.adapt_step(b, gallery)
    assert not AdapterState.capture(tta, ALL).equals(source)
    tta.reset()
    assert torch.equal(tta.embed_and_score(x, gallery)[1], before)
    assert all(torch.equal(p, tta.source_parameters()[n]) for n, p in tta.params.items())


def test_lora_exports_as_a_peft_adapter_that_embeds_the_same(tmp_path):
    from peft import PeftModel

    tta = _wrapper(method="lora", target_modules=MLP)
    gallery, x = dense_gallery(), batch("image", 6, seed=9)
    for b in image_stream(2):
        tta.adapt_step(b, gallery)
    tta.export_peft_adapter(tmp_path / "adapter")
    loaded = PeftModel.from_pretrained(make_model("clip"), tmp_path / "adapter")
    with torch.no_grad():
        theirs = loaded.get_image_features(**x)
        theirs = theirs if torch.is_tensor(theirs) else theirs.pooler_output
    ours = tta.adapter.encode("image", x)
    assert torch.allclose(torch.nn.functional.normalize(theirs, dim=-1), ours, atol=1e-6)


# ------------------------------------------------------------------------------------- consistency with the source
def test_consistency_value_by_hand():
    # query 0: the source's top-2 are columns 0 and 2 (scores 0.3, 0.2: at T = 0.1, p0 = softmax(3, 2)); the adapted
    # scores there are 0.1, 0.2 (p = softmax(1, 2)). KL(p0 || p) = (p0_0 - p0_1) * ln(e) = 2 sigma(1) - 1 = 0.46212.
    # Query 1 is unchanged (KL 0), so the mean is 0.23106 and weight 2 makes it 0.46212.
    source = torch.tensor([[0.3, 0.1, 0.2], [0.5, 0.4, 0.0]])
    adapted = torch.tensor([[0.1, 0.3, 0.2], [0.5, 0.4, 0.0]])
    inputs = ObjectiveInputs(query_emb=torch.zeros(2, 4), gallery_emb=torch.zeros(3, 4), scores=adapted,
                             source_scores=lambda: source)
    by_hand = 2 * torch.sigmoid(torch.tensor(1.0)).item() - 1
    assert SourceConsistency(2.0, 2, 0.1).value(inputs).item() == pytest.approx(by_hand, rel=1e-5)
    assert SourceConsistency(1.0, 2, 0.1).value(inputs).item() == pytest.approx(by_hand / 2, rel=1e-5)
    # top_k larger than the gallery compares every item; identical scores give exactly 0
    same = ObjectiveInputs(query_emb=torch.zeros(2, 4), gallery_emb=torch.zeros(3, 4), scores=source,
                           source_scores=lambda: source)
    assert SourceConsistency(1.0, 10, 0.1).value(same).item() == 0.0


def test_the_consistency_is_part_of_the_loss_logged_and_keeps_the_source_answers():
    gallery, stream = dense_gallery(), image_stream(3)
    plain, held = _wrapper(lr=1e-2), _wrapper(lr=1e-2, consistency=ConsistencyConfig(weight=1000.0, top_k=3))
    source = _wrapper()
    kl = {}
    for x in stream:
        a, b, s = plain.adapt_step(x, gallery), held.adapt_step(x, gallery), source.answer(x, gallery)
        assert "consistency" not in a.logs and b.logs["consistency"] >= 0
        kl = {name: SourceConsistency(1.0, 3, 0.01).value(ObjectiveInputs(
            query_emb=torch.zeros(1), gallery_emb=torch.zeros(1), scores=out.scores, source_scores=lambda: s.scores))
            for name, out in (("plain", a), ("held", b))}
    assert kl["held"] < kl["plain"]  # a strong pull keeps the adapted top-k predictions nearer the source's
