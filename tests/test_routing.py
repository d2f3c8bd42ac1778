"""Per-domain adapters (hf_tta.routing) and their router (hf_tta.router): config, user keys, the unsupervised router,
reset, save/resume, bad input."""

from __future__ import annotations

import pytest
import torch

from hf_tta import TTAConfig, TTAWrapper
from hf_tta.routing import (
    DomainRouter,
    RoutedTTAOutput,
    RoutedTTAWrapper,
    RoutingConfig,
    make_wrapper,
    style_statistics,
)
from hf_tta.state import ALL, AdapterState
from support import mixed_styles, style_images, style_stream
from tiny_models import make_model, text_batch


def _routed(routing=None, **cfg) -> RoutedTTAWrapper:
    return RoutedTTAWrapper(make_model("clip"), TTAConfig(query_modality="image", **cfg), routing=routing)


def _gallery(tta):
    return tta.encode_gallery(text_batch(20, seed=1), show_progress=False)


# ------------------------------------------------------------------------------------- config
def test_routing_config_round_trip_and_one_line_errors(tmp_path):
    cfg = RoutingConfig(max_domains=3, new_domain_threshold=4.0, features="embedding", momentum=0.9, min_domain_batch=2)
    assert RoutingConfig.from_dict(cfg.to_dict()) == cfg
    cfg.save_pretrained(tmp_path)
    assert RoutingConfig.from_pretrained(tmp_path) == cfg
    for bad, word in [
        (dict(max_domains=0), "max_domains"),
        (dict(features="pixels"), "features"),
        (dict(momentum=1.0), "momentum"),
        (dict(new_domain_threshold=0.0), "new_domain_threshold"),
        (dict(min_domain_batch=0), "min_domain_batch"),
    ]:
        with pytest.raises(ValueError, match=word) as err:
            RoutingConfig(**bad)
        assert "\n" not in str(err.value)
    assert isinstance(make_wrapper(make_model("clip"), TTAConfig()), TTAWrapper)
    routed = make_wrapper(make_model("clip"), TTAConfig(), {"max_domains": 2})
    assert isinstance(routed, RoutedTTAWrapper) and routed.routing.max_domains == 2


# ------------------------------------------------------------------------------------- user keys
def test_user_keys_give_each_domain_the_state_of_a_wrapper_that_saw_only_its_queries():
    tta = _routed(RoutingConfig(min_domain_batch=1))
    gallery = _gallery(tta)
    refs = {key: TTAWrapper(make_model("clip"), TTAConfig(query_modality="image")) for key in ("a", "b")}
    for b in range(3):
        x, style = mixed_styles(b)
        keys = ["a" if s == 0 else "b" for s in style.tolist()]
        out = tta.adapt_step({"pixel_values": x}, gallery, domain=keys)
        assert isinstance(out, RoutedTTAOutput) and out.num_updates == 6
        assert [out.domain_keys[i] for i in out.domains.tolist()] == keys
        for key, ref in refs.items():
            mine = torch.tensor([k == key for k in keys])
            ref_out = ref.adapt_step({"pixel_values": x[mine]}, gallery)
            assert torch.equal(out.scores[mine], ref_out.scores)  # bit-identical, in the original query order
    for key, ref in refs.items():
        params = tta.domain_parameters(key)
        assert all(torch.equal(params[n], p) for n, p in ref.params.items())
        assert any(not torch.equal(params[n], tta.source_parameters()[n]) for n in params)  # it did adapt
    a, b = tta.domain_parameters("a"), tta.domain_parameters("b")
    assert any(not torch.equal(a[n], b[n]) for n in a)  # and the two domains differ


def test_one_key_for_the_whole_batch_and_integer_keys():
    tta = _routed()
    gallery = _gallery(tta)
    ref = TTAWrapper(make_model("clip"), TTAConfig(query_modality="image"))
    for b in range(2):
        x = style_images(0, 8, seed=b)
        out = tta.adapt_step({"pixel_values": x}, gallery, domain=7)
        assert torch.equal(out.scores, ref.adapt_step({"pixel_values": x}, gallery).scores)
    out = tta.adapt_step({"pixel_values": style_images(1, 8, seed=5)}, gallery, domain=torch.tensor([7, 3] * 4))
    assert tta.domain_keys == [7, 3] and out.new_domains == [3]
    assert tta.router.num_domains == 0  # user keys never touch the router


def test_small_sub_batches_are_scored_by_their_domain_without_an_update():
    tta = _routed(RoutingConfig(min_domain_batch=4))
    gallery = _gallery(tta)
    source = TTAWrapper(make_model("clip"), TTAConfig(query_modality="image"))
    x = style_images(0, 6, seed=0)
    out = tta.adapt_step({"pixel_values": x}, gallery, domain=["a"] * 4 + ["b"] * 2)
    assert out.num_updates == 3 and any("min_domain_batch" in s for s in out.skipped)
    assert all(torch.equal(v, tta.source_parameters()[n]) for n, v in tta.domain_parameters("b").items())
    with source.disabled():
        _, src_scores = source.embed_and_score({"pixel_values": x[4:]}, gallery)
    assert torch.equal(out.scores[4:], src_scores)


def test_bad_domain_keys_are_one_line_value_errors():
    tta = _routed(RoutingConfig(max_domains=2))
    gallery = _gallery(tta)
    x = {"pixel_values": style_images(0, 4, seed=0)}
    cases = [
        (["a", "b"], "2 keys for 4 queries"),  # wrong length
        ([["a"], ["b"], ["a"], ["b"]], "str or int"),  # unhashable keys
        ([1.5, 2.5, 1.5, 2.5], "str or int"),
        ({"a": 1}, "str or int key"),
        ("auto:0", "router"),
        (torch.ones(4), "integer keys"),
    ]
    for domain, words in cases:
        with pytest.raises(ValueError, match=words) as err:
            tta.adapt_step(x, gallery, domain=domain)
        assert "\n" not in str(err.value)
    assert tta.num_domains == 0  # nothing was opened by a refused batch
    with pytest.raises(ValueError, match="adds 3 .* raise max_domains"):
        tta.adapt_step(x, gallery, domain=["a", "b", "c", "c"])  # 3 new keys, room for 2
    assert tta.num_domains == 0  # not even the two that would have fitted
    tta.adapt_step(x, gallery, domain=["a", "a", "b", "b"])
    with pytest.raises(ValueError, match="raise max_domains"):
        tta.adapt_step(x, gallery, domain="c")
    with pytest.raises(ValueError, match="max_domains"):
        tta.adapt_step(x, gallery)  # the router has no room left


# ------------------------------------------------------------------------------------- the router
def test_router_separates_styles_and_opens_a_domain_for_a_new_one():
    tta = _routed()
    gallery = _gallery(tta)
    seen: dict[int, int] = {}  # style -> domain, the same in every batch
    for b, (x, style) in enumerate(style_stream(4)):
        out = tta.adapt_step({"pixel_values": x}, gallery)
        pairs = set(zip(style.tolist(), out.domains.tolist()))
        assert len(pairs) == len(set(style.tolist())) == len({d for _, d in pairs})  # one domain per style
        for s, d in pairs:
            assert seen.setdefault(s, d) == d
        assert out.new_domains == (["auto:0", "auto:1"] if b == 0 else ["auto:2"] if b == 2 else [])
    assert tta.domain_keys == ["auto:0", "auto:1", "auto:2"]
    assert tta.router.counts.tolist() == [32.0, 32.0, 16.0]
    assert seen[2] == 2  # the third style opened the third domain
    ids = tta.assign_domains({"pixel_values": style_images(2, 3, seed=999)})  # unseen draws of a known style
    assert ids.tolist() == [2, 2, 2] and tta.num_domains == 3


def test_a_group_smaller_than_min_domain_batch_opens_no_domain():
    tta = _routed(RoutingConfig(min_domain_batch=4))
    gallery = _gallery(tta)
    tta.adapt_step({"pixel_values": mixed_styles(0)[0]}, gallery)
    assert tta.num_domains == 2
    few = torch.cat([style_images(0, 8, seed=1), style_images(2, 3, seed=2)])  # 3 queries of a new style: routed, no new domain
    out = tta.adapt_step({"pixel_values": few}, gallery)
    assert tta.num_domains == 2 and out.new_domains == [] and out.domains.max() <= 1
    assert tta.router.counts.sum() == 16 + 8  # the misfits did not move the domain they were sent to
    enough = torch.cat([style_images(0, 8, seed=3), style_images(2, 4, seed=4)])
    out = tta.adapt_step({"pixel_values": enough}, gallery)
    assert out.new_domains == ["auto:2"] and out.domains[8:].tolist() == [2] * 4


def test_style_statistics_find_the_channels_of_every_norm_layout():
    x = torch.randn(6, 5, 4, 3, dtype=torch.float64)  # (B, C, H, W)
    channels_last = x.permute(0, 2, 3, 1).reshape(6, 12, 5)
    ref = style_statistics(channels_last, torch.nn.LayerNorm(5), 6)
    assert ref.shape == (6, 10)
    assert torch.allclose(ref[:, :5], x.mean(dim=(2, 3))) and torch.allclose(ref[:, 5:], x.std(dim=(2, 3), unbiased=False).log())
    assert torch.allclose(style_statistics(x, torch.nn.BatchNorm2d(5), 6), ref)
    assert torch.allclose(style_statistics(x, torch.nn.GroupNorm(1, 5), 6), ref)
    assert torch.allclose(style_statistics(x, torch.nn.LayerNorm(5), 6), ref)  # ConvNeXt's channels-first layer norm
    frames = channels_last.reshape(12, 6, 5)  # 2 frames per query: grouped back by query
    assert torch.allclose(style_statistics(frames, torch.nn.LayerNorm(5), 6), ref)


def test_router_respects_the_cap():
    tta = _routed(RoutingConfig(max_domains=2))
    gallery = _gallery(tta)
    for x, style in style_stream(4):
        out = tta.adapt_step({"pixel_values": x}, gallery)
        assert out.domains.max() <= 1
    assert tta.num_domains == 2 and tta.router.num_domains == 2
    assert tta.router.counts.tolist() == [32.0, 32.0]  # queries sent beyond the cap do not move a domain


def test_router_is_deterministic_and_its_state_is_tensors():
    a, b = _routed(), _routed()
    ga, gb = _gallery(a), _gallery(b)
    for x, _ in style_stream(4):
        oa, ob = a.adapt_step({"pixel_values": x}, ga), b.adapt_step({"pixel_values": x}, gb)
        assert torch.equal(oa.domains, ob.domains) and torch.equal(oa.scores, ob.scores)
    state = a.router.state_tensors()
    assert set(state) == {"means", "vars", "counts"} and state["means"].dtype == torch.float64
    copy = DomainRouter(a.routing)
    copy.load_state_tensors(state)
    x, _ = mixed_styles(9, (0, 1, 2))
    feats = a.router_features({"pixel_values": x})
    assert torch.equal(copy.route(feats)[0], a.router.route(feats)[0])


def test_router_on_embedding_features_and_text_padding_is_masked():
    tta = _routed(RoutingConfig(features="embedding"))
    gallery = _gallery(tta)
    for x, style in style_stream(3):
        out = tta.adapt_step({"pixel_values": x}, gallery)
        assert len(set(zip(style.tolist(), out.domains.tolist()))) == len(set(style.tolist()))
    text = RoutedTTAWrapper(make_model("clip"), TTAConfig(query_modality="text"))
    q = text_batch(3, seed=0, length=7)
    padded = {
        "input_ids": torch.cat([q["input_ids"], torch.ones(3, 4, dtype=torch.long)], dim=1),
        "attention_mask": torch.cat([q["attention_mask"], torch.zeros(3, 4, dtype=torch.long)], dim=1),
    }
    f, fp = text.router_features(q), text.router_features(padded)
    assert f.shape == (3, 64)  # mean and std of the 32 channels of the first LayerNorm's input
    assert torch.allclose(f, fp, atol=1e-6)


def test_training_free_objective_keeps_one_state_per_domain():
    tta = RoutedTTAWrapper(make_model("clip"), TTAConfig(query_modality="image", objective="tcr_training_free"))
    gallery = _gallery(tta)
    refs = {k: TTAWrapper(make_model("clip"), TTAConfig(query_modality="image", objective="tcr_training_free")) for k in "ab"}
    for b in range(3):
        x, style = mixed_styles(b)
        keys = ["a" if s == 0 else "b" for s in style.tolist()]
        out = tta.adapt_step({"pixel_values": x}, gallery, domain=keys)
        for key, ref in refs.items():
            mine = torch.tensor([k == key for k in keys])
            assert torch.equal(out.scores[mine], ref.adapt_step({"pixel_values": x[mine]}, gallery).scores)


def test_answer_and_embed_and_score_only_read():
    """After domains "a" then "b" adapt (b's state in the model), answers and scores for a's, b's and a new key's
    queries equal those of plain wrappers that saw only their own queries, and change nothing: not the model's state
    (b stays loaded), not any domain's, not the next step."""
    tta = _routed(RoutingConfig(min_domain_batch=1), score_transform="dn")
    gallery = _gallery(tta)
    refs = {key: TTAWrapper(make_model("clip"), TTAConfig(query_modality="image", score_transform="dn")) for key in "ab"}
    for key, seed in (("a", 0), ("b", 1)):
        x, _ = mixed_styles(seed)
        tta.adapt_step({"pixel_values": x}, gallery, domain=key)
        refs[key].adapt_step({"pixel_values": x}, gallery)
    refs["new"] = TTAWrapper(make_model("clip"), TTAConfig(query_modality="image", score_transform="dn"))
    loaded = AdapterState.capture(tta, ALL)
    domains = {key: tta.domain_state(key) for key in tta.domain_keys}
    x, _ = mixed_styles(2)
    keys = ["a", "b", "new"] * (x.shape[0] // 3) + ["a"] * (x.shape[0] % 3)
    out = tta.answer({"pixel_values": x}, gallery, domain=keys)
    _, scores = tta.embed_and_score({"pixel_values": x}, gallery, domain=keys)
    for key, ref in refs.items():
        rows = torch.tensor([k == key for k in keys])
        assert torch.equal(out.scores[rows], ref.answer({"pixel_values": x[rows]}, gallery).scores), key
        assert torch.equal(scores[rows], ref.embed_and_score({"pixel_values": x[rows]}, gallery)[1]), key
    assert AdapterState.capture(tta, ALL).equals(loaded) and tta.domain_keys == ["a", "b"]
    assert all(tta.domain_state(key).equals(state) for key, state in domains.items())
    x, _ = mixed_styles(3)  # and the next steps go on as if nothing had been asked
    for key in "ba":
        assert torch.equal(tta.adapt_step({"pixel_values": x}, gallery, domain=key).scores,
                           refs[key].adapt_step({"pixel_values": x}, gallery).scores), key


# ------------------------------------------------------------------------------------- reset, save, resume
def test_reset_returns_to_the_source_and_drops_every_domain():
    tta = _routed()
    gallery = _gallery(tta)
    x, _ = mixed_styles(0, (0, 1, 2))
    with tta.disabled():
        _, source_scores = tta.embed_and_score({"pixel_values": x}, gallery)
    for xb, _ in style_stream(3):
        tta.adapt_step({"pixel_values": xb}, gallery)
    _, adapted = tta.embed_and_score({"pixel_values": x}, gallery)  # each query with its domain's model
    assert not torch.equal(adapted, source_scores)
    tta.reset()
    assert tta.num_domains == 0 and tta.router.num_domains == 0 and tta.batch_index == 0
    assert all(torch.equal(p, tta.source_parameters()[n]) for n, p in tta.params.items())
    _, after = tta.embed_and_score({"pixel_values": x}, gallery)
    assert torch.equal(after, source_scores)
    fresh = _routed()
    for xb, _ in style_stream(2):  # and it adapts again exactly like a new wrapper
        assert torch.equal(tta.adapt_step({"pixel_values": xb}, gallery).scores, fresh.adapt_step({"pixel_values": xb}, gallery).scores)


def test_load_state_replaces_every_domain_of_a_wrapper_that_adapted_elsewhere(tmp_path):
    stream = style_stream(5)

    def step(tta, gallery, x, style):
        return tta.adapt_step({"pixel_values": x}, gallery)

    whole = _routed()
    gallery = _gallery(whole)
    full = [step(whole, gallery, x, s) for x, s in stream]
    first = _routed()
    for x, s in stream[:3]:
        step(first, gallery, x, s)
    first.save_pretrained(tmp_path / "ckpt")
    other = _routed()
    step(other, gallery, *mixed_styles(42, (2,)))
    other.load_state(tmp_path / "ckpt")
    assert other.domain_keys == first.domain_keys and other.routing == first.routing
    assert torch.equal(step(other, gallery, *stream[3]).scores, full[3].scores)


def test_routed_and_plain_checkpoints_are_not_confused(tmp_path):
    tta = _routed()
    gallery = _gallery(tta)
    tta.adapt_step({"pixel_values": mixed_styles(0)[0]}, gallery)
    tta.save_pretrained(tmp_path / "routed")
    with pytest.raises(ValueError, match="saved by RoutedTTAWrapper.*load it with RoutedTTAWrapper"):
        TTAWrapper.from_pretrained(make_model("clip"), tmp_path / "routed")
    with pytest.raises(ValueError, match="another config .*objective: 'tcr' there, 'tent' here.*RoutedTTAWrapper.from_pretrained"):
        _routed(objective="tent").load_state(tmp_path / "routed")
    plain = TTAWrapper(make_model("clip"), TTAConfig(query_modality="image"))
    plain.save_pretrained(tmp_path / "plain")
    with pytest.raises(ValueError, match="one adapter"):
        RoutedTTAWrapper.from_pretrained(make_model("clip"), tmp_path / "plain")
    keys = tta.domain_keys
    with pytest.raises(ValueError, match="routed with"):
        _routed(RoutingConfig(max_domains=3)).load_state(tmp_path / "routed")
    assert tta.domain_keys == keys
