"""The service across crashes and restarts (issue 49, items 2 and 3), with real processes on 127.0.0.1: the adapting
process dies with the answering one (kill -9) and never writes the state folder after it, a state folder has one
writer, and the gallery's version goes on across a restart instead of starting again at 0."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("fastapi", reason="needs the serve extra")
httpx = pytest.importorskip("httpx")

from conftest import _free_port  # noqa: E402
from hf_tta.service.service import CHECKPOINT_FILE, Service  # noqa: E402
from test_service_app import AUTH, SERVER, png, service_config, wait_for  # noqa: E402


def _children(pid: int) -> set[int]:
    out = set()
    for task in Path(f"/proc/{pid}/task").iterdir():
        text = (task / "children").read_text().split()
        out |= {int(c) for c in text}
    return out


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"


class _Server:
    def __init__(self, state_dir: Path):
        self.port = _free_port()
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
        self.proc = subprocess.Popen([sys.executable, "-c", SERVER, str(state_dir), str(self.port)], env=env)
        self.http = httpx.Client(base_url=f"http://127.0.0.1:{self.port}", timeout=10, headers={"X-Tenant": "acme"})

        def ready():
            try:
                return self.http.get("/readyz").status_code == 200
            except httpx.TransportError:
                return False

        assert wait_for(ready, 240), "the service did not become ready"

    def close(self):
        self.http.close()
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(30)


def test_kill_9_of_the_answering_process_takes_the_adapting_one_with_it(tmp_path):
    server = _Server(tmp_path)
    try:
        workers = _children(server.proc.pid)  # the adapting process and multiprocessing's resource tracker
        assert workers, "the service has no child process"
        for i in range(8):  # some adaptation, so that the worker has state it could save
            server.http.post("/search", json={"image": png(i), "k": 3})
        checkpoint = tmp_path / CHECKPOINT_FILE
        before = checkpoint.stat().st_mtime_ns if checkpoint.exists() else None
        server.proc.send_signal(signal.SIGKILL)
        server.proc.wait(30)
        assert wait_for(lambda: not any(_alive(p) for p in workers), 30), "a child outlived the answering process"
        after = checkpoint.stat().st_mtime_ns if checkpoint.exists() else None
        assert after == before  # the orphan did not write the folder on its way out
    finally:
        server.close()


def test_a_state_folder_has_one_writer(tmp_path):
    server = _Server(tmp_path)
    try:
        second = Service(service_config(tmp_path))
        with pytest.raises(RuntimeError, match=f"in use by another hf_tta service \\(pid {server.proc.pid}\\)"):
            second.start()
        assert second.wrapper is None  # refused before anything was built
    finally:
        server.close()


def test_the_gallery_version_goes_on_across_a_restart(tmp_path):
    server = _Server(tmp_path)
    try:
        added = server.http.post("/items", json={"id": 1000, "text": "a purple cow"}, headers=AUTH)
        assert added.status_code == 201, added.text
        version = added.json()["gallery_version"]
        assert version >= 1
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(60) in (0, -signal.SIGTERM)
    finally:
        server.close()
    again = _Server(tmp_path)
    try:
        answered = again.http.post("/search", json={"image": png(3), "k": 3}).json()
        assert answered["gallery_version"] == version  # the same gallery, the same number; never 0 again
        added = again.http.post("/items", json={"id": 1001, "text": "a pink pig"}, headers=AUTH).json()
        assert added["gallery_version"] == version + 1
    finally:
        again.close()


def test_every_acknowledged_add_survives_a_kill_9(tmp_path):
    import threading

    server = _Server(tmp_path)
    acknowledged, stop = [], threading.Event()

    def add_many():
        for i in range(2000, 2400):
            if stop.is_set():
                return
            try:
                r = server.http.post("/items", json={"id": i, "text": f"item {i}"}, headers=AUTH)
            except httpx.TransportError:
                return
            if r.status_code == 201:
                acknowledged.append((i, r.json().get("durable")))

    try:
        writer = threading.Thread(target=add_many)
        writer.start()
        assert wait_for(lambda: len(acknowledged) >= 10, 120)
        server.proc.send_signal(signal.SIGKILL)  # in the middle of the burst
        server.proc.wait(30)
        stop.set()
        writer.join(30)
    finally:
        server.close()
    assert all(durable is True for _, durable in acknowledged)  # a 201 says the add is on disk
    again = _Server(tmp_path)
    try:
        for i, _ in acknowledged:
            r = again.http.delete(f"/items/{i}", headers=AUTH)  # 404 if the add was lost
            assert r.status_code == 200, (i, r.text)
    finally:
        again.close()
