"""recipes/serve.py over real HTTP (FastAPI's TestClient) on a tiny CLIP built from a config: search, live items,
health, tenants, checkpoint on shutdown and resume, refusals."""

from __future__ import annotations

import base64
import importlib.util
import io
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from hf_tta import TTAConfig
from hf_tta.state import ALL, AdapterState
from support import word_level_clip_tokenizer
from tiny_models import make_model

pytest.importorskip("fastapi", reason="needs the serve extra")
pytest.importorskip("httpx", reason="needs the serve extra")
from fastapi.testclient import TestClient  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
CAPTIONS = ["a red dog", "a blue cat", "a green bird", "a small fish", "a big house", "a yellow car"]


def _recipe():
    spec = importlib.util.spec_from_file_location("serve_recipe", REPO / "recipes" / "serve.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["serve_recipe"] = module
    spec.loader.exec_module(module)
    return module


serve = _recipe()


def png(seed: int) -> str:
    from PIL import Image

    rgb = np.random.default_rng(seed).integers(0, 256, (40, 40, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(rgb).save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode()


def service_config(state_dir=None, **kw) -> serve.ServiceConfig:
    tok = word_level_clip_tokenizer(CAPTIONS + ["a pink tree"])

    def text(texts):
        return dict(tok(list(texts), padding="max_length", max_length=12, return_tensors="pt"))

    def image(images):
        x = torch.stack([torch.from_numpy(np.array(im)).permute(2, 0, 1).float() / 255 for im in images])
        return {"pixel_values": (F.interpolate(x, size=(32, 32), mode="bilinear") - 0.5) / 0.5}

    cfg = TTAConfig(objective="tcr", query_modality="image", lr=1e-2)
    kw = {"batch_size": 4, "mode": "sync", "checkpoint_every": 0, **kw}
    return serve.ServiceConfig(lambda: make_model("clip"), cfg, {"image": image, "text": text}, CAPTIONS, str(state_dir) if state_dir else None, **kw)


def test_search_items_health_and_resume(tmp_path):
    state = tmp_path / "state"
    with TestClient(serve.create_app(service_config(state))) as client:
        assert client.get("/health").json()["batches_adapted"] == 0
        answers = [client.post("/search", json={"image": png(i), "k": 3}).json() for i in range(5)]
        assert all(len(a["ids"]) == 3 and set(a["ids"]) <= set(range(6)) for a in answers)
        assert [a["version"] for a in answers] == [0, 0, 0, 0, 1]  # the 4th query filled the batch
        health = client.get("/health").json()
        assert health["batches_adapted"] == 1 and health["pending"] == 1 and health["status"] == "ok"
        first_fp = health["fingerprint"]
        r = client.post("/items", json={"id": 42, "text": "a pink tree"})
        assert r.status_code == 201 and r.json()["gallery_size"] == 7
        assert client.post("/items", json={"id": 42, "text": "a pink tree"}).status_code == 409
        hits = client.post("/search", json={"image": png(0), "k": 7}).json()
        assert 42 in hits["ids"] and hits["gallery_version"] == 1
        assert client.delete("/items/3").status_code == 200
        assert client.delete("/items/3").status_code == 404
        hits = client.post("/search", json={"image": png(1), "k": 10}).json()
        assert 3 not in hits["ids"] and len(hits["ids"]) == 6
        for i in range(10, 12):
            client.post("/search", json={"image": png(i)})
        health = client.get("/health").json()
        assert health["batches_adapted"] == 2 and health["fingerprint"] != first_fp
        live = client.app.state.service.retriever.wrapper
    saved = AdapterState.capture(live, ALL)  # shutdown checkpointed it
    assert (state / "adapter" / "tta_config.json").exists() and (state / "gallery.safetensors").exists()
    with TestClient(serve.create_app(service_config(state))) as client:
        health = client.get("/health").json()
        assert health["resumed"] and health["fingerprint"] == hits_fp(live) and health["gallery_size"] == 6
        assert AdapterState.capture(client.app.state.service.retriever.wrapper, ALL).equals(saved)
        hits = client.post("/search", json={"image": png(0), "k": 10}).json()
        assert 42 in hits["ids"] and 3 not in hits["ids"]


def hits_fp(wrapper) -> str:
    from hf_tta.serving import state_fingerprint

    return state_fingerprint(wrapper)


def test_tenants_and_refusals():
    with TestClient(serve.create_app(service_config(tenants=True))) as client:
        for i in range(4):
            assert client.post("/search", json={"image": png(i)}, headers={"X-Tenant": "acme"}).json()["tenant"] == "acme"
        assert client.post("/search", json={"image": png(9)}).json()["tenant"] == "default"
        wrapper = client.app.state.service.retriever.wrapper
        assert wrapper.domain_keys == ["acme"]  # 4 acme queries adapted; the default tenant has 1 buffered
        assert client.post("/search", json={"text": "a red dog"}).status_code == 400  # queries are images
        assert client.post("/search", json={"image": "not base64!"}).status_code == 400
        assert client.post("/search", json={"image": png(1), "k": 0}).status_code == 422
        assert client.post("/items", json={"id": 1, "image": png(1)}).status_code == 400  # items are texts
    with TestClient(serve.create_app(service_config())) as client:
        r = client.post("/search", json={"image": png(1)}, headers={"X-Tenant": "acme"})
        assert r.status_code == 400 and "--tenants" in r.json()["detail"]


def test_adaptation_off_answers_only():
    with TestClient(serve.create_app(service_config(adapt=False, mode="background"))) as client:
        for i in range(6):
            assert client.post("/search", json={"image": png(i)}).json()["version"] == 0
        health = client.get("/health").json()
        assert health["batches_adapted"] == 0 and health["pending"] == 0 and health["queries_answered"] == 6


def test_timer_checkpoint(tmp_path):
    state = tmp_path / "state"
    with TestClient(serve.create_app(service_config(state, checkpoint_every=0.05))) as client:
        for i in range(4):
            client.post("/search", json={"image": png(i)})
        deadline = time.monotonic() + 60
        while client.get("/health").json()["last_checkpoint"] is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert client.get("/health").json()["last_checkpoint"] is not None  # written by the timer, before shutdown
        assert (state / "adapter" / "tta_config.json").exists()


def test_loadtest_summary_by_hand():
    spec = importlib.util.spec_from_file_location("serve_loadtest", REPO / "recipes" / "serve_loadtest.py")
    lt = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(lt)
    rows = [{"status": 200, "latency_ms": float(ms), "query": q, "top1": t} for ms, q, t in [(10, 0, 5), (20, 1, 9), (30, 0, 7)]]
    rows.append({"status": 500, "latency_ms": 1.0, "query": 0, "top1": -1})
    s = lt.summarise(rows, wall=1.5, captions_of=[[5, 6], [8]])
    assert s["n"] == 3 and s["errors"] == 1 and s["p50"] == 20.0 and s["qps"] == 2.0
    assert abs(s["p99"] - (20 + 0.98 * 10)) < 1e-9  # linear interpolation between the 2nd and 3rd of 3
    assert abs(s["r1"] - 100 / 3) < 1e-9  # only query 0 -> 5 is a hit
