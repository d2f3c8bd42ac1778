"""hf_tta.service over HTTP (FastAPI's TestClient; the adapting worker is a real spawned process): answers carry their
state version and age, the published state is the worker's, bounded queue and tenant limit, inputs refused in one line
(4xx) or answered but not adapted on, bearer token, admin pause/resume/reset/rollback, metrics, a killed worker
restarted with readiness telling the truth, state resumed after a restart with per-tenant versions, and a
schema-driven fuzz that finds no 5xx and changes no state."""

from __future__ import annotations

import base64
import io
import json
import os
import signal
import time
from functools import partial

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from hf_tta import TTAConfig
from hf_tta.service.builders import build_wrapper
from hf_tta.service.codec import PUBLISHED
from hf_tta.service.limits import Limits
from hf_tta.service.service import CHECKPOINT_FILE, ServiceConfig
from hf_tta.service.tenants import TenantAdapters
from support import wait_for, word_level_clip_tokenizer
from tiny_models import make_model

pytest.importorskip("fastapi", reason="needs the serve extra")
pytest.importorskip("prometheus_client", reason="needs the serve extra")
from fastapi.testclient import TestClient  # noqa: E402

from hf_tta.service.app import create_app  # noqa: E402

CAPTIONS = ["a red dog", "a blue cat", "a green bird", "a small fish", "a big house", "a yellow car"]
TOKEN = "s3cret-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
TTA = TTAConfig(objective="tcr", query_modality="image", lr=1e-2)


def png(seed: int, side: int = 40, mode: str = "RGB", constant: bool = False) -> str:
    from PIL import Image

    rng = np.random.default_rng(seed)
    arr = np.full((side, side, 3), 128, np.uint8) if constant else rng.integers(0, 256, (side, side, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr).convert(mode).save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode()


def nan_tiff() -> str:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(np.full((32, 32), np.nan, np.float32), mode="F").save(buf, format="TIFF")
    return base64.b64encode(buf.getvalue()).decode()


def encoders():
    tok = word_level_clip_tokenizer(CAPTIONS + ["a pink tree"])

    def text(texts):
        return dict(tok(list(texts), padding="max_length", max_length=12, return_tensors="pt"))

    def image(images):
        x = torch.stack([torch.from_numpy(np.array(im)).permute(2, 0, 1).float() / 255 for im in images])
        return {"pixel_values": (F.interpolate(x, size=(32, 32), mode="bilinear") - 0.5) / 0.5}

    return {"image": image, "text": text}


def service_config(state_dir, **kw) -> ServiceConfig:
    # worker_idle off: the suite's other tests keep both cores busy, and a SCHED_IDLE worker would wait for them
    kw = {"batch_size": 4, "min_batch": 4, "max_wait": 0.05, "checkpoint_every": 0, "tenants": True, "max_tenants": 2,
          "token": TOKEN, "worker_nice": 0, "worker_idle": False, "limits": Limits(max_pixels=128 * 128, max_body_bytes=200_000, max_text_chars=100), **kw}
    return ServiceConfig(partial(build_wrapper, partial(make_model, "clip"), TTA), encoders(), CAPTIONS, str(state_dir), **kw)


@pytest.fixture(scope="module")
def state_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("service")


@pytest.fixture(scope="module")
def client(state_dir):
    with TestClient(create_app(service_config(state_dir)), headers={"X-Tenant": "acme"}) as c:
        assert wait_for(lambda: c.get("/readyz").status_code == 200)  # the adapting worker is up
        yield c


def search(client, seed, tenant="acme", **kw):
    return client.post("/search", json={"image": png(seed), "k": 3, **kw}, headers={"X-Tenant": tenant})


def test_answers_versions_and_published_state(client, state_dir):
    service = client.app.state.service
    first = search(client, 0).json()
    assert first["version"] == 0 and first["state_age_s"] is None and first["queued_for_adaptation"] and len(first["ids"]) == 3
    for i in range(1, 8):
        assert search(client, i).status_code == 200
    assert wait_for(lambda: service.answerer.current("acme").version >= 2)
    answer = search(client, 99).json()
    assert answer["version"] >= 2 and answer["state_age_s"] >= 0
    # the state answers use is, bit for bit, the worker's (read back from its checkpoint)
    assert wait_for(service.drained)
    assert client.post("/admin/checkpoint", headers=AUTH).status_code == 200
    saved = TenantAdapters(build_wrapper(partial(make_model, "clip"), TTA))
    saved.load(state_dir / CHECKPOINT_FILE)
    current = service.answerer.current("acme")
    assert saved.tenants["acme"].version == current.version
    assert current.state.equals(saved.state("acme").only(PUBLISHED))


def test_tenant_limit_is_a_4xx_and_the_worker_lives(client):
    assert search(client, 0).status_code == 200  # "acme" (the fixture's), the first of max_tenants=2
    assert search(client, 1, tenant="beta").status_code == 200  # the second, counted from its first query
    r = search(client, 2, tenant="gamma")
    assert r.status_code == 403 and "--max-tenants" in r.json()["detail"]
    assert "counting 'default' once a request without X-Tenant used it" in r.json()["detail"]  # "acme" and default: 2
    assert search(client, 3, tenant="bad key!").status_code == 400
    assert client.get("/readyz").status_code == 200 and client.app.state.service.supervisor.alive()


@pytest.mark.parametrize("raw, status", [
    ('{"image": "%s", "k": NaN}', 422), ('{"image": "%s", "k": Infinity}', 422), ('{"image": "%s", "k": 1e400}', 422),
    ('{"image": "%s", "k": 2.0}', 422), ('{"image": "%s", "k": "3"}', 422), ('{"image": "%s", "k": 100000}', 422),
    ('{"image": "%s", "extra": 1}', 422), ('{"image": "%s"', 422), ('{"text": "a red dog"}', 400),
    ('{"image": "not base64!"}', 400), ('{"image": "aGVsbG8="}', 400),
])
def test_bad_inputs_are_one_line_4xx(client, raw, status):
    body = raw % png(5) if "%s" in raw else raw
    r = client.post("/search", content=body, headers={"Content-Type": "application/json", "X-Tenant": "acme"})
    detail = r.json()["detail"]
    assert r.status_code == status and isinstance(detail, str) and "\n" not in detail
    assert "Error(" not in detail and "nan" not in detail.lower().replace("finite", "")


def test_size_and_pixel_limits(client):
    assert client.post("/search", content=b"x" * 300_000, headers={"Content-Type": "application/json"}).status_code == 413
    r = client.post("/search", json={"image": png(1, side=200)})  # 40,000 px > 128 * 128
    assert r.status_code == 413 and "pixel" in r.json()["detail"]
    from PIL import Image

    buf = io.BytesIO()  # a decompression bomb: 20000 x 20000 of one colour, a few kB compressed
    Image.new("1", (20000, 20000)).save(buf, format="PNG")
    r = client.post("/search", json={"image": base64.b64encode(buf.getvalue()).decode()})
    assert r.status_code == 413


@pytest.mark.parametrize("image, reason", [(lambda: png(3, constant=True), "constant"), (lambda: png(3, side=1), "tiny"),
                                           (nan_tiff, "non-finite")])
def test_degenerate_images_answered_not_adapted(client, image, reason):
    r = client.post("/search", json={"image": image(), "k": 2}, headers={"X-Tenant": "acme"})
    body = r.json()
    assert r.status_code == 200 and len(body["ids"]) == 2 and not body["queued_for_adaptation"]
    assert body["not_adapted"].startswith(reason)


def test_token_guards_gallery_and_admin(client):
    assert client.post("/items", json={"id": 7, "text": "a pink tree"}).status_code == 401
    assert client.post("/items", json={"id": 7, "text": "a pink tree"}, headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert client.delete("/items/1").status_code == 401 and client.post("/admin/pause").status_code == 401
    assert client.post("/items", json={"id": -7, "text": "a pink tree"}, headers=AUTH).status_code == 422
    assert client.post("/items", json={"id": 8, "text": "x" * 1000}, headers=AUTH).status_code == 413
    r = client.post("/items", json={"id": 7, "text": "a pink tree"}, headers=AUTH)
    assert r.status_code == 201 and r.json()["gallery_size"] == 7
    assert client.post("/items", json={"id": 7, "text": "a pink tree"}, headers=AUTH).status_code == 409
    assert client.delete("/items/7", headers=AUTH).status_code == 200 and client.delete("/items/7", headers=AUTH).status_code == 404


def test_admin_pause_reset_rollback_and_metrics(client):
    service = client.app.state.service
    assert client.post("/admin/pause", headers=AUTH).json()["paused"]
    version = service.answerer.current("acme").version
    for i in range(20, 26):
        search(client, i)
    time.sleep(0.3)
    assert service.answerer.current("acme").version == version and len(service.queue) >= 6
    assert client.post("/admin/resume", headers=AUTH).status_code == 200
    assert wait_for(lambda: service.answerer.current("acme").version > version)
    assert wait_for(service.drained)
    r = client.post("/admin/reset", json={"tenant": "acme"}, headers=AUTH)
    assert r.status_code == 200
    reset = service.answerer.current("acme")
    source = service.answerer.source.state
    assert reset.version > version and reset.state.equals(source)
    r = client.post("/admin/rollback", json={"tenant": "acme"}, headers=AUTH)
    back = service.answerer.current("acme")
    assert r.status_code == 200 and back.version == reset.version + 1
    assert not back.state.equals(source)  # the adapted state before the reset
    assert client.post("/admin/rollback", json={"tenant": "nobody"}, headers=AUTH).status_code == 409
    text = client.get("/metrics").text
    for name in ("hf_tta_request_seconds_bucket", "hf_tta_queue_depth", "hf_tta_state_age_seconds{tenant=\"acme\"}",
                 "hf_tta_adapted_batches_total{tenant=\"acme\"}", "hf_tta_safety_actions_total", "hf_tta_queries_not_adapted_total",
                 "hf_tta_worker_up 1.0"):
        assert name in text, name


def test_schema_fuzz_finds_no_5xx_and_changes_no_state(client):
    schemathesis = pytest.importorskip("schemathesis")
    from hypothesis import HealthCheck, settings

    service = client.app.state.service
    client.post("/admin/pause", headers=AUTH)
    before = (service.answerer.version, service.gallery.version)
    from hypothesis import given

    schema = schemathesis.openapi.from_dict(client.get("/openapi.json").json())

    @given(case=schema.as_strategy())  # every operation, valid and invalid data drawn from the app's own schema
    @settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    def fuzz(case):
        kwargs = case.as_transport_kwargs(base_url=str(client.base_url))  # through the running app (no second lifespan)
        response = client.request(**kwargs)
        assert response.status_code < 500, (case.path, response.status_code, response.text[:200])

    try:
        fuzz()
    finally:
        client.post("/admin/resume", headers=AUTH)
    assert (service.answerer.version, service.gallery.version) == before


def test_killed_worker_is_restarted_and_readiness_says_so(client):
    service = client.app.state.service
    assert client.get("/readyz").status_code == 200 and client.get("/livez").status_code == 200
    version = service.answerer.version
    os.kill(service.supervisor.proc.pid, signal.SIGKILL)
    assert wait_for(lambda: client.get("/readyz").status_code == 503, 30)
    assert "dead" in json.dumps(client.get("/readyz").json()) or "starting" in json.dumps(client.get("/readyz").json())
    assert search(client, 40).status_code == 200  # answers go on meanwhile
    assert wait_for(lambda: client.get("/readyz").status_code == 200)
    assert service.supervisor.restart_count == 1
    # versions go on above the last: the restarted worker publishes at start, and the answerer's poll thread reads it
    # (readiness can turn 200 a poll before that on a loaded machine, as in one CI-like run)
    assert wait_for(lambda: service.answerer.version > version, 30), (service.answerer.version, version)


SERVER = """
import sys
import uvicorn
from test_service_app import service_config
from hf_tta.service.app import create_app
uvicorn.run(create_app(service_config(sys.argv[1])), host="127.0.0.1", port=int(sys.argv[2]), log_level="warning")
"""


def test_a_chunked_body_over_the_limit_is_413_and_counted(client):
    """A body without Content-Length (chunked) over the limit is refused as it streams in, with 413, not a parser's 400,
    and the refusal is counted in hf_tta_inputs_refused_total."""

    def refused():
        text = client.get("/metrics").text
        return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith('hf_tta_inputs_refused_total{status="413"}'))

    before = refused()
    chunks = (b"x" * 50_000 for _ in range(8))  # 400 kB against the limit of 200 kB, no Content-Length
    r = client.post("/search", content=chunks, headers={"Content-Type": "application/json"})
    assert r.status_code == 413 and "over the limit" in r.json()["detail"]
    assert refused() == before + 1
    body = json.dumps({"image": png(7), "k": 3}).encode()
    small = (part for part in (body[:100], body[100:]))  # a chunked body under the limit is answered as before
    assert client.post("/search", content=small, headers={"Content-Type": "application/json"}).status_code == 200


def test_a_long_id_is_not_echoed(client):
    r = client.delete(f"/items/{'9' * 400}", headers=AUTH)
    assert 400 <= r.status_code < 500 and "9" * 20 not in r.json()["detail"] and "\n" not in r.json()["detail"]


def test_openapi_documents_the_one_line_error_body(client):
    schema = client.get("/openapi.json").json()
    for path, method in (("/search", "post"), ("/items", "post"), ("/items/{item_id}", "delete"), ("/admin/{op}", "post")):
        responses = schema["paths"][path][method]["responses"]
        for status in ("400", "413", "422"):
            assert responses[status]["content"]["application/json"]["schema"]["$ref"].endswith("/ErrorBody"), (path, status)
    assert "HTTPValidationError" not in json.dumps(schema)
    assert schema["components"]["schemas"]["ErrorBody"]["properties"]["detail"]["type"] == "string"


def test_sigterm_saves_and_a_real_server_resumes_versions(client, state_dir):
    import socket
    import subprocess
    import sys

    import httpx

    service = client.app.state.service
    for i in range(50, 54):
        search(client, i, tenant="beta")
    assert wait_for(lambda: service.answerer.current("beta").version >= 1) and wait_for(service.drained)
    versions = {t: c.version for t, c in service.answerer.states.items()}
    states = {t: c.state for t, c in service.answerer.states.items()}
    client.__exit__(None, None, None)  # the app's shutdown: the worker checkpoints
    saved = TenantAdapters(build_wrapper(partial(make_model, "clip"), TTA))
    saved.load(state_dir / CHECKPOINT_FILE)
    assert {t: x.version for t, x in saved.tenants.items()} == versions
    assert all(saved.state(t).only(PUBLISHED).equals(states[t]) for t in states)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.Popen([sys.executable, "-c", SERVER, str(state_dir), str(port)], env=env)
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10, headers={"X-Tenant": "beta"}) as http:
            def ready():
                try:
                    return http.get("/readyz").status_code == 200
                except httpx.TransportError:
                    return False

            assert wait_for(ready)
            assert http.get("/health").json()["tenants"] == versions  # per-tenant versions survived the restart
            assert http.post("/search", json={"image": png(60)}).json()["version"] == versions["beta"]
            for i in range(61, 65):
                http.post("/search", json={"image": png(i)})
            assert wait_for(lambda: http.get("/health").json()["tenants"]["beta"] == versions["beta"] + 1)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) in (0, -signal.SIGTERM)  # uvicorn re-raises the signal after its graceful shutdown
    finally:
        if proc.poll() is None:
            proc.kill()
    saved.load(state_dir / CHECKPOINT_FILE)  # saved on SIGTERM
    assert saved.tenants["beta"].version == versions["beta"] + 1


def test_redis_replica_answers_from_the_store_and_says_when_it_is_down(redis_server, tmp_path, gallery):
    from hf_tta.service.redis_channel import RedisChannel
    from hf_tta.service.worker import Worker, WorkerSpec
    from support import image_stream

    url, proc = redis_server
    cfg = service_config(tmp_path / "replica", adapt=False, store=url, tenants=False, poll=0.02)
    with TestClient(create_app(cfg)) as replica:  # an answer replica: no worker, the state from Redis
        assert replica.post("/search", json={"image": png(1)}).json()["version"] == 0
        build = partial(build_wrapper, partial(make_model, "clip"), TTA)
        writer = Worker(WorkerSpec(build, {"kind": "redis", "url": url, "key": "hf_tta"}), RedisChannel(url))  # the adapting host
        writer.handle(("gallery", replica.app.state.service.gallery.snapshot().cache.embeddings.numpy()))
        batch = image_stream(1, size=8)[0]
        writer.handle(("adapt", 1, "default", {k: v.numpy() for k, v in batch.items()}))
        assert wait_for(lambda: replica.post("/search", json={"image": png(2)}).json()["version"] == 1, 10)
        assert replica.get("/readyz").status_code == 200
        proc.kill()
        proc.wait(5)
        assert wait_for(lambda: replica.get("/readyz").status_code == 503, 10)
        assert "state store unreachable" in replica.get("/readyz").json()["problems"][0]
        r = replica.post("/search", json={"image": png(3)})
        assert r.status_code == 200 and r.json()["version"] == 1  # answers go on from the last state



@pytest.mark.parametrize("heartbeat, word", [
    (0.0, "has not reported to the state store yet (no heartbeat there)"),  # before: "for 1795896227 s"
    (1000.0 - 20, "has not reported for 20 s"),
    (1000.0 - 5, None),
])
def test_readiness_words_a_missing_heartbeat_apart_from_a_late_one(heartbeat, word):
    from hf_tta.service.service import heartbeat_problem

    got = heartbeat_problem(1000.0, heartbeat, timeout=15.0)
    assert got == (None if word is None else f"the adapting worker {word}")


def test_an_admin_command_behind_a_slow_batch_is_accepted_and_runs_later(tmp_path):
    """Before: a reset that waited over 30 s behind a batch (a saturated machine) answered 409 "did not answer in
    time", and then ran anyway. Now it answers 202 saying it is queued, and the reset happens (here the wait is 0 s)."""
    with TestClient(create_app(service_config(tmp_path / "slow", admin_timeout=0.0))) as c:
        assert wait_for(lambda: c.get("/readyz").status_code == 200)
        service = c.app.state.service
        for i in range(4):  # one batch of "acme"
            search(c, 40 + i)
        assert wait_for(lambda: service.answerer.current("acme").version >= 1)
        version = service.answerer.current("acme").version
        r = c.post("/admin/reset", json={"tenant": "acme"}, headers=AUTH)
        assert r.status_code == 202 and r.json()["accepted"] and "queued and runs after it" in r.json()["message"]
        assert wait_for(lambda: service.answerer.current("acme").version > version, 60)  # it ran
        assert service.answerer.current("acme").state.equals(service.answerer.source.state)
