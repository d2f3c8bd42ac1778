"""One table, the same checks for every objective, on tiny Hugging Face models built from configs.

Adding an objective = one file in hf_tta/objectives/ + one row in OBJECTIVE_CASES.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch

from hf_tta import TTAConfig, TTAWrapper, available_objectives
from hf_tta.objectives import get_objective_class
from tiny_models import TINY_MODELS, batch, make_model


@dataclass
class ObjectiveCase:
    name: str
    config: dict = field(default_factory=dict)  # objective_config overrides for tiny batches
    wrapper: dict = field(default_factory=dict)  # extra TTAConfig fields

    def __str__(self) -> str:
        return self.name


OBJECTIVE_CASES = [
    ObjectiveCase("tent"),
    ObjectiveCase("tcr"),
    ObjectiveCase("tcr_training_free"),
    ObjectiveCase("rest"),
    ObjectiveCase("cliptta"),
    ObjectiveCase("dn", {"num_samples": 4}),
    ObjectiveCase("titan", {"hub_threshold": 0}),  # every item a hub: counterfactual text queries on tiny batches
    # Untrained tiny models predict almost uniformly: the baselines' entropy/PLPD filters are opened so that updates
    # happen (the filters themselves are checked in test_objectives_math.py).
    ObjectiveCase("eata", {"e_margin": 1.0, "d_margin": 1.01}),
    ObjectiveCase("sar", {"selection": "paper", "margin_e0": 1.0}),
    ObjectiveCase("read"),
    ObjectiveCase("deyo", {"deyo_margin": 1.0, "plpd_threshold": -1.0}),
    ObjectiveCase("pl"),
    ObjectiveCase("shot"),
    ObjectiveCase("oracle"),  # supervised ceiling: _wrapper labels each query with one gallery item
]

DIRECTIONS = [("image", "text"), ("text", "image")]
BATCH, GALLERY = 6, 20


def test_every_registered_objective_has_a_row():
    assert sorted(c.name for c in OBJECTIVE_CASES) == available_objectives()


def _wrapper(case: ObjectiveCase, model_name: str, query: str, **extra) -> TTAWrapper:
    model = make_model(model_name)
    cfg = TTAConfig(objective=case.name, objective_config=case.config, query_modality=query, **{**case.wrapper, **extra})
    tta = TTAWrapper(model, cfg)
    if get_objective_class(case.name).requires_labels:  # supervised objectives get labels: query i -> item i mod N
        step = tta.adapt_step
        tta.adapt_step = lambda q, g, **kw: step(q, g, labels=[[i % len(g)] for i in range(next(iter(q.values())).shape[0])], **kw)
    return tta


def _snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("model_name", sorted(TINY_MODELS))
@pytest.mark.parametrize("query,gallery", DIRECTIONS)
@pytest.mark.parametrize("case", OBJECTIVE_CASES, ids=str)
def test_only_intended_parameters_change(case, model_name, query, gallery):
    tta = _wrapper(case, model_name, query)
    g = tta.encode_gallery(batch(gallery, GALLERY, seed=1))
    cached = g.embeddings.clone()
    before = _snapshot(tta.model)
    outs = [tta.adapt_step(batch(query, BATCH, seed=10 + i), g) for i in range(2)]
    after = _snapshot(tta.model)
    changed = {n for n in before if not torch.equal(before[n], after[n])}
    trains = get_objective_class(case.name).requires_grad
    for out in outs:
        assert out.scores.shape == (BATCH, GALLERY)
        assert torch.isfinite(out.scores).all()
        if trains and out.loss is not None:
            assert torch.isfinite(torch.tensor(out.loss))
    if trains:
        assert sum(o.num_updates for o in outs) > 0, [o.skipped for o in outs]
        assert changed, "an update was made but no parameter changed"
        adapted = set(tta.params)
        assert changed <= adapted, f"parameters outside the adapted set changed: {sorted(changed - adapted)[:3]}"
        # every changed tensor sits in a module of the query tower
        for n in changed:
            module = n.split(".ln_tuning_layers")[0]
            assert query in tta.adapter.tower_of(module)
    else:
        assert not changed and not tta.params
    # the cached gallery is untouched and still equals a fresh encoding by the source model
    assert torch.equal(g.embeddings, cached)
    assert torch.allclose(tta.encode_gallery(batch(gallery, GALLERY, seed=1)).embeddings, cached, atol=1e-6)


@pytest.mark.parametrize("case", OBJECTIVE_CASES, ids=str)
def test_reset_is_exact(case):
    tta = _wrapper(case, "clip", "image")
    g = tta.encode_gallery(batch("text", GALLERY, seed=1))
    q = batch("image", BATCH, seed=3)
    first = tta.adapt_step(q, g).scores
    state0 = {k: v.clone() for k, v in tta.objective.init_state().items()}
    for i in range(3):
        tta.adapt_step(batch("image", BATCH, seed=20 + i), g)
    tta.reset()
    for name, p in tta.params.items():
        assert torch.equal(p, tta.source_parameters()[name])
    assert tta.batch_index == 0
    assert set(tta.state) == set(state0) and all(torch.equal(tta.state[k], state0[k]) for k in state0)
    # the stream replays bit-exactly after reset
    assert torch.equal(tta.adapt_step(q, g).scores, first)


TRAINABLE_CASES = [c for c in OBJECTIVE_CASES if get_objective_class(c.name).requires_grad]


@pytest.mark.parametrize("case", TRAINABLE_CASES, ids=str)
def test_skip_rule_updates_nothing(case, monkeypatch):
    tta = _wrapper(case, "clip", "text")
    g = tta.encode_gallery(batch("image", GALLERY, seed=1))
    before = _snapshot(tta.model)
    original = type(tta.objective).__call__

    def nothing_selected(self, inputs, state):
        out = original(self, inputs, state)
        out.n_selected = 0
        return out

    monkeypatch.setattr(type(tta.objective), "__call__", nothing_selected)
    out = tta.adapt_step(batch("text", BATCH, seed=2), g)
    assert out.num_updates == 0 and len(out.skipped) == tta.config.steps
    assert all("no query selected" in s for s in out.skipped)
    after = _snapshot(tta.model)
    assert all(torch.equal(before[n], after[n]) for n in before)
    assert not tta.optimizer.state  # the optimiser was never stepped


@pytest.mark.parametrize("case", OBJECTIVE_CASES, ids=str)
def test_config_round_trip(case, tmp_path):
    cls = get_objective_class(case.name)
    cfg = cls.config_class(**case.config)
    assert cls.config_class.from_dict(cfg.to_dict()) == cfg
    tta_cfg = TTAConfig(objective=case.name, objective_config=case.config)
    tta_cfg.save_pretrained(tmp_path)
    assert TTAConfig.from_pretrained(tmp_path) == tta_cfg


def test_readme_table_states_every_objective_and_its_defaults():
    """The README's objective table has a row per objective, and the defaults it names are the configs' defaults."""
    import pathlib

    readme = (pathlib.Path(__file__).resolve().parents[1] / "README.md").read_text()
    rows = {line.split("`")[1]: line for line in readme.splitlines() if line.startswith("| `")}
    assert set(available_objectives()) <= set(rows)  # the oracle ceiling too, marked as not a method
    assert "not a method" in rows["oracle"] and "labels=" in rows["oracle"]
    default = lambda name, field: getattr(get_objective_class(name).config_class(), field)  # noqa: E731
    assert default("oracle", "tau") == 0.01 and "τ=0.01" in rows["oracle"]
    assert default("dn", "lam") == 0.25 and "λ=0.25 [code" in rows["dn"]
    assert default("tcr", "queue_size") == 64 and "queue of 64" in rows["tcr"]
    for name in ("eata", "sar", "deyo"):
        assert default(name, "selection") == "tcr_port" and "[TCR port]" in rows[name] and 'selection="paper"' in rows[name]
    assert default("deyo", "plpd_threshold") == 0.0 and "PLPD > 0.0" in rows["deyo"]
    assert default("cliptta", "protocol") == "tcr" and 'protocol="tcr"` (default' in rows["cliptta"]
