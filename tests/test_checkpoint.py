"""Checkpoints (issue 12, items 2 and 8): what a checkpoint contains, the full resolved config, the model fingerprint,
the atomic folder swap (each crash window, and a saving process SIGKILLed at random points many times)."""

from __future__ import annotations

import dataclasses
import json
import multiprocessing
import os
import random
import signal
import time

import pytest
import torch

from hf_tta import RunConfig, TTAConfig, TTAWrapper, checkpoint
from hf_tta.checkpoint import CONFIG_FILE, STATE_FILE, read_checkpoint
from hf_tta.objectives.base import get_objective_class
from tiny_models import batch, make_model


def _adapted(batches=1, model_name="clip", query="image", **cfg):
    tta = TTAWrapper(make_model(model_name), TTAConfig(query_modality=query, **cfg))
    g = tta.encode_gallery(batch("text" if query == "image" else "image", 8, seed=1))
    for i in range(batches):
        tta.adapt_step(batch(query, 6, seed=10 + i), g)
    return tta


def _same_tensors(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# ------------------------------------------------------------------------------------- contents
def test_checkpoint_contents_and_full_resolved_config(tmp_path):
    tta = _adapted(2, objective="tcr", objective_config={"tau": 0.05})
    target = tmp_path / "ckpt"
    tta.save_pretrained(target)
    assert sorted(p.name for p in target.iterdir()) == [CONFIG_FILE, STATE_FILE]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # no temporary folder or backup left
    saved = json.loads((target / CONFIG_FILE).read_text())
    # every hyper-parameter written out, the user's override kept; lr and gallery modality resolved
    full = dataclasses.asdict(get_objective_class("tcr").config_class(tau=0.05))
    assert saved["objective_config"] == json.loads(json.dumps(full)) and saved["objective_config"]["tau"] == 0.05
    assert saved["lr"] == 3e-4 and saved["gallery_modality"] == "text" and saved["hf_tta_version"]
    ckpt = read_checkpoint(target)
    assert {k: v for k, v in saved.items() if k != "hf_tta_version"} == ckpt.config  # the state file carries it too
    fp = ckpt.fingerprint
    assert fp["model_class"] == "CLIPModel" and len(fp["config_sha256"]) == 64
    assert fp["adapted"] == {n: list(p.shape) for n, p in tta.params.items()}
    kinds = {k.split(".", 1)[0] for k in ckpt.tensors}
    assert kinds == {"param", "optim", "objective", "wrapper"}
    assert int(ckpt.tensors["wrapper.batch_index"]) == 2
    assert _same_tensors({k[6:]: v for k, v in ckpt.tensors.items() if k.startswith("param.")}, {n: p.detach() for n, p in tta.params.items()})


def test_saved_config_keeps_its_meaning_when_a_default_changes(tmp_path, monkeypatch):
    tta = _adapted(1, objective="tcr")
    tta.save_pretrained(tmp_path / "ckpt")
    objective_class = get_objective_class("tcr")

    @dataclasses.dataclass
    class NewDefaults(objective_class.config_class):
        tau: float = 0.5  # a later release changes the default

    monkeypatch.setattr(objective_class, "config_class", NewDefaults)
    assert TTAConfig(objective="tcr").build_objective_config().tau == 0.5
    loaded = TTAWrapper.from_pretrained(make_model("clip"), tmp_path / "ckpt")
    assert loaded.objective.config.tau == 0.02 and loaded.lr == 3e-4


def test_fingerprint_is_stable_across_transformers_save_and_load(tmp_path):
    from transformers import CLIPModel

    model = make_model("clip")
    model.save_pretrained(tmp_path / "hf")
    reloaded = CLIPModel.from_pretrained(tmp_path / "hf")
    assert checkpoint.config_hash(model) == checkpoint.config_hash(reloaded)
    _adapted(1).save_pretrained(tmp_path / "ckpt")
    assert TTAWrapper.from_pretrained(reloaded, tmp_path / "ckpt").batch_index == 1


def test_same_architecture_with_other_weights_is_refused(tmp_path):
    """Class and config match, but the source values of the adapted layers differ (another fine-tune of one
    architecture): refused when the state is loaded, before anything changes."""
    _adapted(1).save_pretrained(tmp_path / "ckpt")
    other = make_model("clip")
    with torch.no_grad():
        other.vision_model.post_layernorm.weight.add_(0.1)  # pretrained checkpoints differ in every LayerNorm
    before = {n: p.detach().clone() for n, p in other.named_parameters()}
    with pytest.raises(ValueError, match="other weights .*source values differ"):
        TTAWrapper.from_pretrained(other, tmp_path / "ckpt")
    assert not any(p.requires_grad is False for p in other.parameters())  # refused before the wrapper froze it
    assert all(torch.equal(p, before[n]) for n, p in other.named_parameters())
    assert TTAWrapper.from_pretrained(make_model("clip"), tmp_path / "ckpt").batch_index == 1  # the right one loads


def test_another_model_is_refused_naming_both_before_it_is_touched(tmp_path):
    _adapted(1).save_pretrained(tmp_path / "ckpt")
    siglip = make_model("siglip")
    with pytest.raises(ValueError, match=r"adapted from CLIPModel .*loaded into SiglipModel.*another model class"):
        TTAWrapper.from_pretrained(siglip, tmp_path / "ckpt")
    assert all(p.requires_grad for p in siglip.parameters())  # refused before a wrapper touched it
    from transformers import CLIPConfig, CLIPModel

    cfg = make_model("clip").config.to_dict()
    cfg["projection_dim"] = 8
    other = CLIPModel(CLIPConfig.from_dict(cfg))
    with pytest.raises(ValueError, match=r"CLIPModel \(config sha256 \w+, \d+ adapted tensors\).*another model config"):
        TTAWrapper.from_pretrained(other, tmp_path / "ckpt")


def test_load_state_refusal_changes_nothing(tmp_path):
    _adapted(1, query="image").save_pretrained(tmp_path / "ckpt")
    text = _adapted(1, query="text")
    params = {n: p.detach().clone() for n, p in text.params.items()}
    state = {k: v.clone() for k, v in text.state.items()}
    with pytest.raises(ValueError, match="adapts other parameters"):
        text.load_state(tmp_path / "ckpt")
    assert _same_tensors(params, {n: p.detach() for n, p in text.params.items()}) and _same_tensors(state, text.state)
    assert text.batch_index == 1


@pytest.mark.parametrize(
    "other, words",
    [
        ({"objective": "rest"}, "objective: 'tcr' there, 'rest' here"),  # before: loaded TCR's queue into REST
        ({"lr": 1e-2}, "lr: 0.0003 there, 0.01 here"),  # before: the checkpoint's lr silently replaced the wrapper's
        ({"objective_config": {"queue_size": 32}}, "objective_config"),
        ({"objective": "cliptta", "objective_config": {"open_set": True}}, "objective"),  # 2 optimiser groups
    ],
)
def test_load_state_refuses_another_config_and_changes_nothing(tmp_path, other, words):
    saved = _adapted(1)
    saved.save_pretrained(tmp_path / "ckpt")
    tta = TTAWrapper(make_model("clip"), TTAConfig(**{"objective": "tcr", "query_modality": "image", **other}))
    params = {n: p.detach().clone() for n, p in tta.params.items()}
    with pytest.raises(ValueError, match=words) as err:
        tta.load_state(tmp_path / "ckpt")
    assert "TTAWrapper.from_pretrained" in str(err.value) and "\n" not in str(err.value)
    assert _same_tensors(params, {n: p.detach() for n, p in tta.params.items()}) and tta.batch_index == 0
    same = TTAWrapper(make_model("clip"), TTAConfig(objective="tcr", query_modality="image", run=RunConfig(fast_step=False)))
    same.load_state(tmp_path / "ckpt")  # how to run (fast_step, gallery_batch_size) is not the config's meaning
    assert same.batch_index == 1 and _same_tensors(dict(saved.params), dict(same.params))


def test_bad_targets_are_refused(tmp_path):
    tta = _adapted(0)
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="is a file"):
        tta.save_pretrained(tmp_path / "file")
    (tmp_path / "mixed").mkdir()
    (tmp_path / "mixed" / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match=r"holds other files than a checkpoint \(\['notes.txt'\]\)"):
        tta.save_pretrained(tmp_path / "mixed")
    assert (tmp_path / "mixed" / "notes.txt").read_text() == "mine"
    with pytest.raises(FileNotFoundError, match="save_pretrained"):
        TTAWrapper.from_pretrained(make_model("clip"), tmp_path / "missing")


# ------------------------------------------------------------------------------------- crash windows
class _Crash(BaseException):
    """Stands in for the process dying at that instant (BaseException: not swallowed by `except Exception`)."""


def _crash_on_call(monkeypatch, module, name, n):
    original = getattr(module, name)
    calls = []

    def wrapped(*args, **kwargs):
        calls.append(args)
        if len(calls) == n:
            raise _Crash(name)
        return original(*args, **kwargs)

    monkeypatch.setattr(module, name, wrapped)


def test_crash_between_the_two_renames_loads_the_old_checkpoint(tmp_path, monkeypatch, caplog):
    old, new = _adapted(1), _adapted(2)
    target = tmp_path / "ckpt"
    old.save_pretrained(target)
    _crash_on_call(monkeypatch, checkpoint.os, "rename", 2)  # 1: target -> backup done; 2: tmp -> target dies
    with pytest.raises(_Crash):
        new.save_pretrained(target)
    monkeypatch.undo()
    assert not target.exists() and (tmp_path / ".ckpt.old").is_dir()
    with caplog.at_level("WARNING"):
        assert int(read_checkpoint(target).tensors["wrapper.batch_index"]) == 1
    assert "interrupted save" in caplog.text
    assert TTAWrapper.from_pretrained(make_model("clip"), target).batch_index == 1
    new.save_pretrained(target)  # the next save completes and clears the backup
    assert int(read_checkpoint(target).tensors["wrapper.batch_index"]) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_crash_after_the_swap_loads_the_new_checkpoint(tmp_path, monkeypatch):
    old, new = _adapted(1), _adapted(2)
    target = tmp_path / "ckpt"
    old.save_pretrained(target)
    _crash_on_call(monkeypatch, checkpoint, "_fsync_dir", 2)  # 1: the temporary folder; 2: the parent, after the swap
    with pytest.raises(_Crash):
        new.save_pretrained(target)
    monkeypatch.undo()
    assert (tmp_path / ".ckpt.old").is_dir()  # stale backup
    assert int(read_checkpoint(target).tensors["wrapper.batch_index"]) == 2
    old.save_pretrained(target)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_crash_while_writing_leaves_the_old_checkpoint(tmp_path, monkeypatch):
    old, new = _adapted(1), _adapted(2)
    target = tmp_path / "ckpt"
    old.save_pretrained(target)
    _crash_on_call(monkeypatch, checkpoint, "_write_synced", 2)  # the config is written, the state is not
    with pytest.raises(_Crash):
        new.save_pretrained(target)
    monkeypatch.undo()
    assert int(read_checkpoint(target).tensors["wrapper.batch_index"]) == 1


# ------------------------------------------------------------------------------------- SIGKILL at random points
KILLS = 40


def _save_forever(a, b, target, started, saves):
    torch.set_num_threads(1)
    started.set()
    while True:
        for tta in (a, b):
            tta.save_pretrained(target)
            with saves.get_lock():
                saves.value += 1


def test_a_saving_process_killed_at_random_points_leaves_old_or_new(tmp_path):
    """A forked child saves two states alternately into one folder; the parent SIGKILLs it at random instants
    (KILLS times: after a random number of completed saves, then at a random instant within about the next save, so
    the kills land in both saves whatever the machine's speed); after every kill the folder loads, exactly, to one of
    them."""
    a, b = _adapted(1), _adapted(2)
    expected = {}
    for name, tta in (("a", a), ("b", b)):
        tta.save_pretrained(tmp_path / name)
        expected[name] = read_checkpoint(tmp_path / name)
    target = tmp_path / "ckpt"
    a.save_pretrained(target)
    start = time.perf_counter()
    for _ in range(5):
        a.save_pretrained(target)
    save_s = (time.perf_counter() - start) / 5
    ctx = multiprocessing.get_context("fork")
    rng = random.Random(0)
    outcomes = {"a": 0, "b": 0}
    for i in range(KILLS):
        started, saves = ctx.Event(), ctx.Value("i", 0)
        child = ctx.Process(target=_save_forever, args=(a, b, target, started, saves), daemon=True)
        child.start()
        assert started.wait(60)
        wait_for, deadline = rng.randrange(0, 4), time.monotonic() + 60
        while saves.value < wait_for and time.monotonic() < deadline:
            time.sleep(0.0005)
        time.sleep(rng.uniform(0, 1.5 * save_s))
        os.kill(child.pid, signal.SIGKILL)
        child.join()
        assert child.exitcode == -signal.SIGKILL
        got = read_checkpoint(target)
        matches = [n for n, e in expected.items() if got.config == e.config and _same_tensors(got.tensors, e.tensors)]
        assert len(matches) == 1, f"kill {i}: the folder holds neither complete state"
        outcomes[matches[0]] += 1
        if i % 10 == 0:  # and it loads into a wrapper
            loaded = TTAWrapper.from_pretrained(make_model("clip"), target)
            assert loaded.batch_index == {"a": 1, "b": 2}[matches[0]]
    assert outcomes["a"] + outcomes["b"] == KILLS and min(outcomes.values()) > 0  # kills landed in both saves


def test_config_hash_accepts_int_keys_as_json_writes_them():
    """Some transformers versions keep int keys (``id2label``) in nested configs' diff dicts; the hash reads them as
    JSON writes them (str), so {0: 'a'} and {'0': 'a'} hash alike and a private key is still dropped."""
    from types import SimpleNamespace

    def model(diff):
        return SimpleNamespace(config=SimpleNamespace(to_diff_dict=lambda: diff))

    as_int = checkpoint.config_hash(model({"vision_config": {"id2label": {0: "a", 1: "b"}, "_commit_hash": "x"}}))
    as_str = checkpoint.config_hash(model({"vision_config": {"id2label": {"0": "a", "1": "b"}}}))
    other = checkpoint.config_hash(model({"vision_config": {"id2label": {"0": "a", "1": "c"}}}))
    assert as_int == as_str != other


# ------------------------------------------------------------------------------------- integrity (issue 36, item 3)
def _header(data: bytes) -> tuple[int, dict]:
    n = int.from_bytes(data[:8], "little")
    return n, json.loads(data[8 : 8 + n])


def _state_of(tta):
    return {n: p.detach().clone() for n, p in tta.params.items()}, {k: v.clone() for k, v in tta.state.items()}, tta.batch_index


def _assert_unchanged(tta, before):
    params, state, batch_index = before
    assert _same_tensors(params, {n: p.detach() for n, p in tta.params.items()}) and _same_tensors(state, tta.state)
    assert tta.batch_index == batch_index


def _refused_everywhere(folder):
    """The damaged checkpoint is refused by from_pretrained and by load_state, in one line naming the file and the
    fix, and the wrapper it was loaded into is bit-identical afterwards."""
    path = str(folder / STATE_FILE)
    with pytest.raises(checkpoint.CheckpointError) as err:
        TTAWrapper.from_pretrained(make_model("clip"), folder)
    message = str(err.value)
    assert isinstance(err.value, ValueError) and "\n" not in message and path in message and "re-save it" in message
    tta = _adapted(1)
    before = _state_of(tta)
    with pytest.raises(checkpoint.CheckpointError):
        tta.load_state(folder)
    _assert_unchanged(tta, before)
    return message


def test_flipped_high_bytes_are_refused_by_the_digest(tmp_path):
    """XOR the high byte of 64 float32 values of the adapted LayerNorms (before: loaded, with a bias off by ~1e3)."""
    target = tmp_path / "ckpt"
    _adapted(1).save_pretrained(target)
    data = bytearray((target / STATE_FILE).read_bytes())
    n, header = _header(bytes(data))
    spans = [header[k]["data_offsets"] for k in header if k.startswith("param.") and header[k]["dtype"] == "F32"]
    flipped = 0
    for start, end in spans:
        for i in range(start, min(end, start + 4 * 8), 4):  # 8 floats of each tensor
            data[8 + n + i + 3] ^= 0x40
            flipped += 1
    assert flipped >= 64
    (target / STATE_FILE).write_bytes(bytes(data))
    assert "do not match the sha256 digest" in _refused_everywhere(target)


def _truncated(data):
    return data[: len(data) // 2]


def _damaged_header(data):
    return data[:8] + b"\x00\xff" * 8 + data[24:]


@pytest.mark.parametrize(
    "damage",
    [lambda d: b"", _truncated, lambda d: d[:5], _damaged_header, lambda d: b"PK\x03\x04not a safetensors file" * 4,
     lambda d: (10**12).to_bytes(8, "little") + d[8:]],
    ids=["empty", "truncated", "shorter-than-header", "damaged-header", "zip", "header-length-too-large"],
)
def test_malformed_state_files_are_one_line_naming_the_file(tmp_path, damage):
    target = tmp_path / "ckpt"
    _adapted(1).save_pretrained(target)
    (target / STATE_FILE).write_bytes(damage((target / STATE_FILE).read_bytes()))
    assert "is not a whole safetensors checkpoint" in _refused_everywhere(target)


def test_a_checkpoint_without_a_digest_loads_with_a_warning(tmp_path, caplog):
    """State files written before the digest existed still load (warned once, told to re-save); a re-save adds it."""
    from safetensors.torch import load, save

    target = tmp_path / "ckpt"
    saved = _adapted(2)
    saved.save_pretrained(target)
    data = (target / STATE_FILE).read_bytes()
    meta = json.loads(_header(data)[1]["__metadata__"]["hf_tta"])
    del meta["tensors_sha256"]
    (target / STATE_FILE).write_bytes(save(load(data), metadata={"hf_tta": json.dumps(meta)}))
    with caplog.at_level("WARNING", logger="hf_tta"):
        loaded = TTAWrapper.from_pretrained(make_model("clip"), target)
    assert "no integrity digest" in caplog.text and "re-save it" in caplog.text
    assert loaded.batch_index == 2 and _same_tensors(dict(saved.params), dict(loaded.params))
    loaded.save_pretrained(target)
    assert "tensors_sha256" in _header((target / STATE_FILE).read_bytes())[1]["__metadata__"]["hf_tta"]


def test_a_checkpoint_with_peft_ln_tuning_names_loads_and_continues_as_it_did(tmp_path, caplog):
    """tests/data/legacy_peft_ln: written at 8650706, when LayerNorm tuning went through PEFT (tensor and metadata names
    ``...ln_tuning_layers.default...``; no digest). It loads under the model's own names, its fingerprint (source
    hash over the old names) still matches, and the stream continues with the scores that version computed."""
    from pathlib import Path

    from safetensors.torch import load_file

    folder = Path(__file__).parent / "data" / "legacy_peft_ln"
    old = load_file(folder / "checkpoint" / STATE_FILE)
    with caplog.at_level("INFO", logger="hf_tta"):
        tta = TTAWrapper.from_pretrained(make_model("clip"), folder / "checkpoint")
    assert "no integrity digest" in caplog.text and "ln_tuning_layers" in caplog.text
    assert tta.batch_index == 2 and tta.safety is not None
    assert _same_tensors({n: p.detach() for n, p in tta.params.items()},
                         {k[6:].replace(".ln_tuning_layers.default.", "."): v for k, v in old.items() if k.startswith("param.")})
    g = tta.encode_gallery(batch("text", 12, seed=1))
    tta.save_pretrained(tmp_path / "resaved")  # today's names, with a digest
    scores = torch.cat([tta.adapt_step(batch("image", 8, seed=20 + i), g).scores for i in range(2)])
    torch.testing.assert_close(scores, load_file(folder / "continued_scores.safetensors")["scores"], rtol=0, atol=1e-5)
    resumed = TTAWrapper.from_pretrained(make_model("clip"), tmp_path / "resaved")
    assert torch.equal(torch.cat([resumed.adapt_step(batch("image", 8, seed=20 + i), g).scores for i in range(2)]), scores)
    with pytest.raises(ValueError, match="other weights"):  # the old source hash still tells other weights apart
        other = make_model("clip")
        with torch.no_grad():
            other.vision_model.post_layernorm.bias.add_(0.1)
        TTAWrapper.from_pretrained(other, folder / "checkpoint")


def test_the_refusal_of_another_model_names_the_real_counts_in_one_sentence(tmp_path):
    """Before: "... loaded into SiglipModel (..., 0 adapted tensors) ... of this architecture?. Load it ..."."""
    _adapted(1).save_pretrained(tmp_path / "ckpt")
    n = len(_adapted(0).params)
    other = make_model("clip")
    with torch.no_grad():
        other.vision_model.post_layernorm.bias.add_(0.1)
    for model, why in ((make_model("siglip"), "another model class. Load"), (other, "this architecture? Load")):
        with pytest.raises(ValueError) as err:
            TTAWrapper.from_pretrained(model, tmp_path / "ckpt")
        message = str(err.value)
        assert "CLIPModel (config sha256 " in message and f", {n} adapted tensors), but" in message and why in message
        assert "0 adapted tensors" not in message and "?." not in message and ".." not in message


def test_checkpoints_written_before_the_policy_driver_load_and_continue_as_they_did():
    """tests/data/pre_policies (written at 6d26979, before issue 46's policies, slot bank and readers): a gated default,
    a key-routed wrapper with safety and weight ensembling, and the service's tenants file load with today's code (the
    keys did not change) and continue each stream with the scores that commit computed."""
    from pathlib import Path

    from safetensors.torch import load_file

    from hf_tta.routing import RoutedTTAWrapper
    from hf_tta.service.tenants import TenantAdapters
    from support import dense_gallery, image_stream, style_images

    folder, g = Path(__file__).parent / "data" / "pre_policies", dense_gallery()
    want = load_file(folder / "continued_scores.safetensors")
    gated = TTAWrapper.from_pretrained(make_model("clip"), folder / "gated")
    assert gated.shift_gate.fitted and gated.batch_index == 2
    got = torch.cat([gated.adapt_step({"pixel_values": style_images(1, 16, 50 + i)}, g).scores for i in range(2)])
    assert torch.equal(got, want["gated"])
    routed = RoutedTTAWrapper.from_pretrained(make_model("clip"), folder / "routed")
    assert routed.domain_keys == ["a", "b"]
    got = torch.cat([routed.adapt_step(q, g, domain="ab"[i % 2]).scores for i, q in enumerate(image_stream(2, seed=300))])
    assert torch.equal(got, want["routed"])
    adapters = TenantAdapters(TTAWrapper(make_model("clip"), TTAConfig(objective="tcr", lr=1e-2, query_modality="image")))
    adapters.load(folder / "tenants.safetensors")
    assert {k: t.version for k, t in adapters.tenants.items()} == {"x": 2, "y": 1}
    got = torch.cat([adapters.adapt("xy"[i % 2], q, g).scores for i, q in enumerate(image_stream(2, seed=600))])
    assert torch.equal(got, want["tenants"])


def test_an_lr_search_saved_mid_probe_before_the_slot_bank_loads_and_continues_as_it_did(tmp_path):
    """tests/data/pre_bank (written at c40d6a8, when the lr search's shadows were tensors inside its selector state):
    today's shadows are slots of a SlotBank, saved under the same keys; the old checkpoint loads into the bank, and the
    stream goes on with the scores and the choice that commit computed. Saving it again writes the same keys."""
    from pathlib import Path

    from safetensors import safe_open
    from safetensors.torch import load_file

    from support import batch

    folder = Path(__file__).parent / "data" / "pre_bank"
    want = load_file(folder / "continued.safetensors")
    tta = TTAWrapper.from_pretrained(make_model("clip"), folder / "mid_probe")
    assert tta.lr_search.probed == 2 and tta.selector_shadows.keys == [0, 1, 2]
    assert not any(k.startswith("shadow.") for k in tta.selector_state)
    tta.save_pretrained(tmp_path / "again")
    keys = [set(safe_open(f / "tta_state.safetensors", "pt").keys()) for f in (folder / "mid_probe", tmp_path / "again")]
    assert keys[0] == keys[1]
    g = tta.encode_gallery(batch("text", 20, seed=1))
    got = torch.cat([tta.adapt_step(batch("image", 8, seed=70 + i), g).scores for i in range(2, 6)])
    assert torch.equal(got, want["scores"]) and tta.lr_search.chosen == float(want["chosen"])
    assert len(tta.selector_shadows) == 0  # the commit dropped them
