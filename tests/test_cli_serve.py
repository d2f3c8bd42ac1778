"""``hf-tta serve`` (hf_tta/cli/serve.py) as a user runs it: the console script in a subprocess, a BLIP folder saved
with its processor and loaded by path, a real uvicorn on 127.0.0.1; a mistake exits 2 with one line."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from cli_folders import WORDS, save_retrieval_checkpoint
from conftest import _free_port
from test_service_app import png

pytest.importorskip("fastapi")


@pytest.mark.parametrize("argv, message", [
    (["--config", "{missing}"], "No such file"),
    (["--model", "some/model"], "--model needs --gallery"),
    (["--port", "eighty"], "invalid int value"),
])
def test_a_mistake_exits_2_with_one_line_naming_it(tmp_path, capsys, argv, message):
    from hf_tta.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["serve", *[a.format(missing=tmp_path / "nope.json") for a in argv]])
    err = capsys.readouterr().err.strip()
    assert exc.value.code == 2 and message in err and len(err.splitlines()) == 1 and err.startswith("hf-tta serve")


def test_hf_tta_help_lists_serve_and_serve_has_its_options():
    script = shutil.which("hf-tta") or pytest.skip("the hf-tta console script is not installed")
    listed = subprocess.run([script, "--help"], capture_output=True, text=True, timeout=120)
    assert listed.returncode == 0 and "serve" in listed.stdout
    own = subprocess.run([script, "serve", "--help"], capture_output=True, text=True, timeout=120)
    assert own.returncode == 0 and "--state-dir" in own.stdout and "--no-adapt" in own.stdout


def test_hf_tta_serve_answers_over_http_from_a_saved_folder(tmp_path):
    httpx = pytest.importorskip("httpx")
    script = shutil.which("hf-tta") or pytest.skip("the hf-tta console script is not installed")
    folder = save_retrieval_checkpoint("blip", tmp_path / "blip")
    gallery = tmp_path / "captions.txt"
    gallery.write_text("\n".join(f"a photo of the {a} {b}" for a in WORDS[4:7] for b in WORDS[7:12]) + "\n")
    config = tmp_path / "tta.json"
    config.write_text(json.dumps({"objective": "tcr", "query_modality": "image", "safety": {}}))
    port = _free_port()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "HF_HUB_OFFLINE": "1"}
    proc = subprocess.Popen([script, "serve", "--model", str(folder), "--config", str(config), "--gallery", str(gallery),
                             "--state-dir", str(tmp_path / "state"), "--port", str(port), "--no-access-log"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10) as http:
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                try:
                    if http.get("/readyz").status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                assert proc.poll() is None, proc.stdout.read()
                time.sleep(0.5)
            else:
                pytest.fail("hf-tta serve did not become ready in 120 s")
            got = http.post("/search", json={"image": png(5), "k": 3})
            assert got.status_code == 200, got.text
            body = got.json()
            assert len(body["ids"]) == len(body["scores"]) == 3 and body["version"] >= 0 and set(body["ids"]) <= set(range(15))
            assert http.get("/health").status_code == 200
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) in (0, -signal.SIGTERM)
    finally:
        if proc.poll() is None:
            proc.kill()
