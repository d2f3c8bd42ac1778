"""TTAWrapper on the Hub, both ways (issue 12, item 3), against the offline fake Hub of ``tests/fake_hub.py``."""

from __future__ import annotations

import json

import pytest
import torch

from fake_hub import FakeHub
from hf_tta import TTAConfig, TTAWrapper
from hf_tta.checkpoint import CONFIG_FILE, STATE_FILE
from tiny_models import batch, make_model

SOURCE = "openai/clip-vit-base-patch16"


def _source_model():
    model = make_model("clip")
    model.config._name_or_path = SOURCE  # as from_pretrained("openai/...") sets it
    return model


@pytest.fixture
def adapted():
    tta = TTAWrapper(_source_model(), TTAConfig(objective="tent", query_modality="image", steps=2))
    g = tta.encode_gallery(batch("text", 9, seed=1))
    for i in range(3):
        tta.adapt_step(batch("image", 5, seed=20 + i), g)
    return tta, g


def test_push_then_load_resumes_the_stream(tmp_path, adapted):
    tta, g = adapted
    hub = FakeHub(tmp_path / "hub")
    assert tta.push_to_hub("me/clip-tent", api=hub.api()) == "me/clip-tent"
    assert len(hub.commits) == 1  # config, state and card in one commit
    repo, message, written = hub.commits[0]
    assert repo == "me/clip-tent" and sorted(written) == sorted([CONFIG_FILE, STATE_FILE, "README.md"])
    assert "tent" in message and "3 batches" in message

    loaded = TTAWrapper.from_pretrained(_source_model(), "me/clip-tent", api=hub.api())
    assert loaded.batch_index == 3 and loaded.config == tta.config and loaded.resolved_config() == tta.resolved_config()
    assert all(torch.equal(loaded.params[n], p) for n, p in tta.params.items())
    q = batch("image", 5, seed=99)
    assert torch.equal(loaded.adapt_step(q, loaded.encode_gallery(batch("text", 9, seed=1))).scores, tta.adapt_step(q, g).scores)


def test_model_card_records_source_objective_stream_and_config(tmp_path, adapted):
    tta, _ = adapted
    hub = FakeHub(tmp_path / "hub")
    tta.push_to_hub("me/clip-tent", api=hub.api())
    card = (hub.repo_dir("me/clip-tent") / "README.md").read_text()
    header, body = card.split("---\n", 2)[1:]
    assert "library_name: hf_tta" in header and f"base_model: {SOURCE}" in header and "- tent" in header
    assert f"| source model | `{SOURCE}` |" in body
    assert "| objective | `tent` |" in body
    assert "| stream length | 3 batches adapted (2 steps each, reset policy `never`) |" in body
    assert "| retrieval | image queries -> text gallery |" in body
    config_block = body.split("```json\n", 1)[1].split("```", 1)[0]
    assert json.loads(config_block) == tta.resolved_config().to_dict()
    assert f'CLIPModel.from_pretrained({SOURCE!r})' in body


def test_hub_checkpoint_of_another_model_is_refused(tmp_path, adapted):
    tta, _ = adapted
    hub = FakeHub(tmp_path / "hub")
    tta.push_to_hub("me/clip-tent", api=hub.api())
    with pytest.raises(ValueError, match="adapted from CLIPModel.*loaded into SiglipModel"):
        TTAWrapper.from_pretrained(make_model("siglip"), "me/clip-tent", api=hub.api())


def test_local_folder_wins_and_bad_ids_are_refused(tmp_path, adapted, monkeypatch):
    tta, _ = adapted
    local = tmp_path / "me" / "clip-tent"
    tta.save_pretrained(local)
    monkeypatch.chdir(tmp_path)  # "me/clip-tent" is now also a local folder: no Hub call is made

    class NoHub:
        def __getattr__(self, name):
            raise AssertionError(f"the Hub was called ({name}) for a local folder")

    assert TTAWrapper.from_pretrained(_source_model(), "me/clip-tent", api=NoHub()).batch_index == 3
    with pytest.raises(ValueError, match="owner/name"):
        tta.push_to_hub("not a repo id", api=NoHub())
    with pytest.raises(FileNotFoundError, match="save_pretrained"):
        TTAWrapper.from_pretrained(_source_model(), "no/such-folder/here", api=NoHub())


def test_ttaconfig_from_pretrained_takes_a_hub_id_like_the_wrapper(tmp_path, adapted):
    tta, _ = adapted
    hub = FakeHub(tmp_path / "hub")
    tta.push_to_hub("me/clip-tent", api=hub.api())
    cfg = TTAConfig.from_pretrained("me/clip-tent", api=hub.api())
    assert cfg == tta.config  # the config as given (the checkpoint also holds it resolved)
    with pytest.raises(FileNotFoundError, match="save_pretrained"):
        TTAConfig.from_pretrained(tmp_path / "no-such-folder")


def test_a_gallery_encoded_under_inference_mode_is_usable(adapted):
    tta, _ = adapted
    with torch.inference_mode():
        g = tta.encode_gallery(batch("text", 9, seed=1))
    assert not g.embeddings.is_inference()
    out = tta.adapt_step(batch("image", 5, seed=40), g)  # autograd through the scores: no inference-tensor error
    assert out.num_updates > 0
