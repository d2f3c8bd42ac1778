"""The one-sync ``adapt_step`` (``TTAConfig.fast_step``: fused AdamW whose ``found_inf`` skips a step on the device,
checks read once per batch) against the per-step checked loop: equal results, also when steps are skipped."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hf_tta import GalleryCache, RunConfig, TTAConfig, TTAWrapper
from tiny_models import batch, make_model

BATCHES = 4


def _gallery(n=40, dim=16, seed=3):
    g = torch.Generator().manual_seed(seed)
    return GalleryCache(F.normalize(torch.randn(n, dim, generator=g), dim=1), "text")


def _run(fast: bool, **cfg):
    tta = TTAWrapper(make_model("clip"), TTAConfig(objective="tcr", run=RunConfig(fast_step=fast), **cfg))
    torch.manual_seed(7)
    xs = [batch("image", 6) for _ in range(BATCHES)]
    gallery = _gallery()
    return tta, [tta.adapt_step(x, gallery) for x in xs]


def _assert_same(a: TTAWrapper, outs_a, b: TTAWrapper, outs_b, atol=1e-5):
    for oa, ob in zip(outs_a, outs_b):
        assert torch.allclose(oa.scores, ob.scores, atol=atol)
        assert oa.num_updates == ob.num_updates and oa.skipped == ob.skipped and oa.n_selected == ob.n_selected
        assert (oa.loss is None) == (ob.loss is None)
        if oa.loss is not None:
            assert oa.loss == pytest.approx(ob.loss, abs=atol, nan_ok=True)  # a skipped last step reports its NaN
    for name in a.params:
        assert torch.allclose(a.params[name], b.params[name], atol=atol), name
        sa, sb = a.optimizer.state.get(a.params[name], {}), b.optimizer.state.get(b.params[name], {})
        for key in ("exp_avg", "exp_avg_sq"):
            if key in sa or key in sb:  # a step skipped before any update leaves zero moments in the fused AdamW
                va = sa.get(key, torch.zeros_like(a.params[name]))
                vb = sb.get(key, torch.zeros_like(b.params[name]))
                assert torch.allclose(va, vb, atol=atol), (name, key)
        assert float(sa.get("step", 0)) == float(sb.get("step", 0))
    assert a.state.keys() == b.state.keys()
    for key in a.state:
        assert torch.allclose(a.state[key].float(), b.state[key].float(), atol=atol), key


def test_fast_step_equals_checked_loop():
    checked, outs_c = _run(False)
    fast, outs_f = _run(True)
    assert fast.optimizer.defaults["fused"] and not checked.optimizer.defaults["fused"]
    assert sum(o.num_updates for o in outs_c) > 0  # the comparison covers real updates
    _assert_same(checked, outs_c, fast, outs_f)


def test_fused_adamw_found_inf_skips_exactly_like_not_stepping():
    torch.manual_seed(0)
    fused = [torch.nn.Parameter(torch.randn(5)) for _ in range(3)]
    plain = [torch.nn.Parameter(p.detach().clone()) for p in fused]
    opt_f = torch.optim.AdamW(fused, lr=1e-2, weight_decay=1e-4, fused=True)
    opt_p = torch.optim.AdamW(plain, lr=1e-2, weight_decay=1e-4, foreach=True)
    for it in range(4):
        grads = [torch.randn(5) for _ in fused]
        if it == 2:
            grads[0][1] = float("nan")
        for p, q, g in zip(fused, plain, grads):
            p.grad, q.grad = g.clone(), g.clone()
        opt_f.found_inf = torch.tensor(float(it == 2))
        opt_f.step()
        if it != 2:
            opt_p.step()
    for p, q in zip(fused, plain):
        assert torch.allclose(p, q, atol=1e-6)
        assert float(opt_f.state[p]["step"]) == float(opt_p.state[q]["step"]) == 3.0


@pytest.fixture
def nan_at(monkeypatch):
    """Make the objective's loss NaN at the given (batch_index, step) pairs, in both wrappers alike."""

    def install(tta: TTAWrapper, where: set[tuple[int, int]]):
        cls = type(tta.objective)
        call = cls.__call__

        def patched(self, inputs, state):
            out = call(self, inputs, state)
            if (inputs.batch_index, inputs.step) in where and out.loss is not None:
                out.loss = out.loss * float("nan")
            return out

        monkeypatch.setattr(cls, "__call__", patched)

    return install


def test_fast_step_non_finite_step_replays_the_batch_exactly(nan_at):
    where = {(0, 0), (2, 1)}  # step 0 of the first batch also rolls back its queue update
    nan_at(TTAWrapper(make_model("clip"), TTAConfig(objective="tcr")), where)
    checked, outs_c = _run(False)
    fast, outs_f = _run(True)
    assert any("non-finite loss" in s for s in outs_c[2].skipped)
    _assert_same(checked, outs_c, fast, outs_f)


def test_fast_step_nothing_selected_is_skipped_on_the_device(monkeypatch):
    """A 0-d tensor ``n_selected`` of 0 skips the update without a host check; the objective's state is kept."""
    tta = TTAWrapper(make_model("clip"), TTAConfig(objective="tcr"))
    cls = type(tta.objective)
    call = cls.__call__

    def none_selected(self, inputs, state):
        out = call(self, inputs, state)
        if inputs.batch_index == 1 and out.loss is not None:
            out.n_selected = torch.zeros((), dtype=torch.long)
        return out

    monkeypatch.setattr(cls, "__call__", none_selected)
    checked, outs_c = _run(False)
    fast, outs_f = _run(True)
    assert outs_f[1].num_updates == 0 and all("no query selected" in s for s in outs_f[1].skipped)
    _assert_same(checked, outs_c, fast, outs_f)


def test_fast_step_non_finite_last_step_keeps_the_first_two_updates(nan_at):
    """A non-finite last step: the replay keeps the batch's first two updates, and the later batches match."""
    nan_at(TTAWrapper(make_model("clip"), TTAConfig(objective="tcr")), {(1, 2)})
    fast, outs_f = _run(True)
    checked, outs_c = _run(False)
    assert outs_f[1].num_updates == 2 and outs_f[1].skipped == ["step 2: non-finite loss"]
    _assert_same(checked, outs_c, fast, outs_f)


def test_fast_step_validation():
    with pytest.raises(TypeError, match="fast_step"):
        TTAConfig(run={"fast_step": "yes"})
    assert TTAWrapper(make_model("clip"), TTAConfig(objective="tcr")).fast_step is False  # auto: CUDA only
