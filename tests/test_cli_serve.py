"""``hf-tta serve`` (hf_tta/cli/serve.py) as a user runs it: the console script in a subprocess, a BLIP folder saved
with its processor and loaded by path, a real uvicorn on 127.0.0.1; a mistake exits 2 with one line."""

from __future__ import annotations

import base64
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
    (["--recommended", "--config", "{missing}"], "--config and --recommended both name the TTAConfig: pass one"),
    (["--gate-reference", "{folder}"], "which this TTAConfig does not have: add shift_gate"),
    (["--recommended", "--gate-reference", "{missing}"], "not a folder"),
    (["--recommended", "--gate-reference", "{folder}"], "holds 0 image queries; the shift gate needs at least 32"),
])
def test_a_mistake_exits_2_with_one_line_naming_it(tmp_path, capsys, argv, message):
    from hf_tta.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["serve", *[a.format(missing=tmp_path / "nope.json", folder=tmp_path) for a in argv]])
    err = capsys.readouterr().err.strip()
    assert exc.value.code == 2 and message in err and len(err.splitlines()) == 1 and err.startswith("hf-tta serve")


def test_hf_tta_help_lists_serve_and_serve_has_its_options():
    script = shutil.which("hf-tta") or pytest.skip("the hf-tta console script is not installed")
    listed = subprocess.run([script, "--help"], capture_output=True, text=True, timeout=120)
    assert listed.returncode == 0 and "serve" in listed.stdout
    own = subprocess.run([script, "serve", "--help"], capture_output=True, text=True, timeout=120)
    assert own.returncode == 0 and "--state-dir" in own.stdout and "--no-adapt" in own.stdout


def _blip_folder_and_gallery(tmp_path):
    folder = save_retrieval_checkpoint("blip", tmp_path / "blip")
    gallery = tmp_path / "captions.txt"
    gallery.write_text("\n".join(f"a photo of the {a} {b}" for a in WORDS[4:7] for b in WORDS[7:12]) + "\n")
    return folder, gallery


def test_recommended_serves_the_default_with_its_gate_fitted_on_the_reference_folder(tmp_path, caplog):
    """``--recommended --gate-reference <folder>``: the service's wrapper is ``TTAConfig.recommended("image")`` with its
    shift gate fitted on the folder's images (once, its statistics sent to each process that builds it); without the
    reference the start logs
    that the source answers every query until the gate is fitted."""
    from hf_tta import TTAConfig
    from hf_tta.cli.serve import build_config, parser

    folder, gallery = _blip_folder_and_gallery(tmp_path)
    reference = _clean_folder(tmp_path)
    argv = ["--model", str(folder), "--gallery", str(gallery), "--recommended"]
    service = build_config(parser().parse_args([*argv, "--gate-reference", str(reference)]))
    built = service.build()
    assert built.config.to_dict() == TTAConfig.recommended("image").to_dict()
    assert built.shift_gate.fitted and built.shift_gate.count == 32
    # a spawned process is sent the fitted statistics (kilobytes), not the reference images' input tensors
    sent = [a for a in service.build.args if isinstance(a, dict)]
    assert [sorted(d) for d in sent] == [["shift_gate.count", "shift_gate.mean", "shift_gate.var"]]
    with caplog.at_level("WARNING", logger="hf_tta.serve"):
        bare = build_config(parser().parse_args(argv)).build()
    assert not bare.shift_gate.fitted and "pass --gate-reference with clean queries" in caplog.text


def _clean_folder(tmp_path, n=32):
    """``n`` clean reference images (``ShiftGateConfig.min_reference`` is 32) and a file that is not an image."""
    reference = tmp_path / "clean"
    reference.mkdir()
    for seed in range(n):
        reference.joinpath(f"{seed}.png").write_bytes(base64.b64decode(png(seed)))
    reference.joinpath("notes.txt").write_text("not an image")  # skipped: not an image file
    return reference


@pytest.mark.parametrize("recommended", [False, True], ids=["config-file", "recommended-with-gate-reference"])
def test_hf_tta_serve_answers_over_http_from_a_saved_folder(tmp_path, recommended):
    httpx = pytest.importorskip("httpx")
    script = shutil.which("hf-tta") or pytest.skip("the hf-tta console script is not installed")
    folder, gallery = _blip_folder_and_gallery(tmp_path)
    config = tmp_path / "tta.json"
    config.write_text(json.dumps({"objective": "tcr", "query_modality": "image", "safety": {}}))
    chosen = ["--recommended", "--gate-reference", str(_clean_folder(tmp_path))] if recommended else ["--config", str(config)]
    port = _free_port()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "HF_HUB_OFFLINE": "1"}
    proc = subprocess.Popen([script, "serve", "--model", str(folder), *chosen, "--gallery", str(gallery),
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
