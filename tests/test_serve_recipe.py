"""recipes/serve.py's command line (a TTAConfig from JSON or YAML, exit 2 with one line on a bad argument) and the
load test's summary computed by hand."""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from pathlib import Path

import pytest

from hf_tta import TTAConfig
from hf_tta.service.builders import load_config

REPO = Path(__file__).resolve().parents[1]


def _load(name: str, file: str):
    spec = importlib.util.spec_from_file_location(name, REPO / "recipes" / file)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("suffix", [".json", ".yaml"])
def test_config_file(tmp_path, suffix):
    fields = {"objective": "eata", "query_modality": "image", "lr": 0.001, "score_transform": "dn"}
    path = tmp_path / f"tta{suffix}"
    path.write_text(json.dumps(fields) if suffix == ".json" else "\n".join(f"{k}: {v}" for k, v in fields.items()))
    assert load_config(path) == TTAConfig(**fields)


@pytest.mark.parametrize("argv, message", [
    (["--config", "{missing}"], "No such file"),
    (["--config", "{bad}"], "must hold a mapping"),
    (["--model", "some/model"], "--model needs --gallery"),
    (["--model", "some/model", "--gallery", "{empty}"], "no gallery items"),
])
def test_bad_arguments_exit_2_with_one_line(tmp_path, capsys, argv, message):
    pytest.importorskip("fastapi")
    serve = _load("serve_recipe", "serve.py")
    (tmp_path / "bad.json").write_text("[1, 2]")
    (tmp_path / "empty.txt").write_text("\n\n")
    files = {"missing": str(tmp_path / "nope.json"), "bad": str(tmp_path / "bad.json"), "empty": str(tmp_path / "empty.txt")}
    with pytest.raises(SystemExit) as exc:
        serve.main([a.format(**files) for a in argv])
    err = capsys.readouterr().err.strip()
    assert exc.value.code == 2 and message in err and len(err.splitlines()) == 1


def test_loadtest_summary_by_hand():
    lt = _load("serve_loadtest", "serve_loadtest.py")
    rows = [{"status": 200, "latency_ms": float(ms), "query": q, "top1": t, "state_age_s": age}
            for ms, q, t, age in [(10, 0, 5, None), (20, 1, 9, 1.0), (30, 0, 7, 3.0)]]
    rows.append({"status": 500, "latency_ms": 1.0, "query": 0, "top1": -1, "state_age_s": None})
    s = lt.summarise(rows, captions_of=[[5, 6], [8]])
    assert s["n"] == 3 and s["errors"] == 1 and s["p50"] == 20.0
    assert abs(s["p99"] - (20 + 0.98 * 10)) < 1e-9 and abs(s["p95"] - (20 + 0.9 * 10)) < 1e-9  # linear interpolation
    assert s["age50"] == 2.0 and abs(s["r1"] - 100 / 3) < 1e-9  # ages of the adapted answers only; one hit of three


@pytest.mark.parametrize(("cells", "expected"), [
    ([(15, 80.0, 0), (20, 120.0, 0), (25, 400.0, 0), (30, 90.0, 0)], 20),  # the first failing rate ends the ladder
    ([(20, 90.0, 0), (15, 80.0, 0)], 20),                                   # sorted by rate first
    ([(15, 80.0, 1), (20, 90.0, 0)], 0),                                    # a lost request fails the rate
    ([(15, float("nan"), 0)], 0),                                           # no answer at all: no p99, no capacity
])
def test_capacity_is_the_highest_rate_the_whole_ladder_below_sustained(cells, expected):
    lt = _load("serve_loadtest", "serve_loadtest.py")
    got = lt.capacity([{"rate": r, "p99": p99, "errors": e} for r, p99, e in cells], bound_ms=250.0)
    assert got == expected


CAPACITY = REPO / "model_cards" / "results" / "serving" / "capacity"


@pytest.mark.skipif(not (CAPACITY / "cells.csv").is_file(), reason="no committed capacity run")
def test_the_serving_cards_capacity_table_is_recomputed_from_its_rows():
    """Issue 49: each cell of the committed capacity run is its own request rows' (in the order the run wrote them),
    and the serving card's capacity table is what the recipe prints from those cells."""
    lt = _load("serve_loadtest", "serve_loadtest.py")
    cells = lt.read_cells(str(CAPACITY / "cells.csv"))
    rows = lt.read_rows(CAPACITY / "rows.csv.gz")
    start = 0
    for cell in cells:
        n = int(cell["n"] + cell["errors"])
        got = lt.summarise(rows[start : start + n], captions_of=[[]] * 2000)
        assert rows[start]["service"] == cell["service"] and float(rows[start]["rate"]) == cell["rate"]
        assert (got["n"], got["errors"]) == (cell["n"], cell["errors"])
        assert all(abs(got[k] - cell[k]) < 1e-6 for k in ("p50", "p95", "p99"))
        start += n
    assert start == len(rows)
    bound = float(json.loads((CAPACITY / "run.json").read_text())["capacity_p99_ms"])
    table = lt.capacity_table(cells, bound, int(max(c["repeat"] for c in cells)) + 1)
    assert table in (REPO / "model_cards" / "serving.md").read_text()


OPEN_LOOP = re.compile(r"<!-- serving-open-loop: (?P<rows>\S+) -->\n(?P<body>.*?)<!-- /serving-open-loop -->", re.S)


def test_the_serving_cards_open_loop_tables_are_recomputed_from_their_rows():
    """Issue 50: each open-loop table of the serving card is what the recipe prints from its committed request rows
    (answered, errors, latency percentiles, state age, R@1 and the on/off ratios); only the adapted and dropped shares,
    read from ``/health`` during the run, are taken from the table itself."""
    from hf_tta.benchmarks import load_emoji_benchmark

    lt = _load("serve_loadtest", "serve_loadtest.py")
    captions_of = load_emoji_benchmark().image_to_captions
    blocks = list(OPEN_LOOP.finditer((REPO / "model_cards" / "serving.md").read_text()))
    assert len(blocks) == 2
    for block in blocks:
        rows = lt.read_rows(REPO / "model_cards" / block["rows"])
        on = [line.split("|") for line in block["body"].splitlines() if "| adaptation on |" in line]
        shares = {float(c[1]): (float(c[8].strip(" %")) / 100, float(c[9].strip(" %")) / 100) for c in on}
        rates = sorted({r["rate"] for r in rows})
        assert block["body"].strip() == lt.open_loop_table(rows, shares, captions_of, ("adaptation on", "adaptation off"), rates)
