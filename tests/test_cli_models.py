"""`hf-tta run` as a user runs it: retrieval checkpoints saved to folders with their processors and loaded by path,
a COCO-C-style benchmark folder; the class each checkpoint declares, exit status and one line per failure, and the
safety layer's counts in the tables."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("datasets", reason="needs the data extra: pip install 'hf_tta[data]'")
pytest.importorskip("PIL", reason="needs the data extra: pip install 'hf_tta[data]'")

from cli_folders import save_benchmark, save_retrieval_checkpoint  # noqa: E402
from hf_tta import cli  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
FAST = ["--steps", "1", "--batch-size", "4", "--quiet", "--no-plots", "--threads", "1"]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("user")
    return {
        "dataset": save_benchmark(root / "coco-c"),
        "blip": save_retrieval_checkpoint("blip", root / "blip"),
        "blip2": save_retrieval_checkpoint("blip2", root / "blip2"),
    }


def _hf_tta(*argv, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    """The `hf-tta` command in a fresh process (`python -m hf_tta.cli`, this tree first on the path), run in ``cwd``."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-m", "hf_tta.cli", *map(str, argv)], capture_output=True, text=True, env=env,
                          timeout=600, cwd=str(cwd))


@pytest.mark.parametrize("name, declared", [("blip", "BlipForImageTextRetrieval"), ("blip2", "Blip2ForImageTextRetrieval")])
def test_run_adapts_blip_and_blip2_retrieval_folders_loaded_by_path(folders, name, declared, tmp_path, capsys):
    out = tmp_path / "res"
    code = cli.main(["run", "--model", str(folders[name]), "--dataset", str(folders["dataset"]), "--direction", "both",
                     "--corruptions", "fog", "--text-corruptions", "ocr", "--objectives", "tent,tcr", *FAST,
                     "--output-dir", str(out)])
    assert code == 0
    assert "• tcr" in capsys.readouterr().out
    data = json.loads((out / "results.json").read_text())
    assert data["meta"]["task"]["model_class"] == declared  # the class config.json declares, not AutoModel's
    rows = data["rows"]
    assert not [r for r in rows if "error" in r]
    by = {(r["direction"], r["objective"]): r for r in rows if r["shift"] != "clean"}
    assert (by[("i2t", "tent")]["num_queries"], by[("i2t", "tent")]["gallery_size"]) == (8, 16)  # 2 captions per image
    assert (by[("t2i", "tcr")]["num_queries"], by[("t2i", "tcr")]["gallery_size"]) == (16, 8)
    for (direction, objective), r in by.items():  # every adapted row stepped on every batch of 4
        if objective != "source":
            assert r["updates"] == r["num_queries"] // 4, (direction, objective)


@pytest.mark.parametrize("automodel_class, retrieval_class",
                         [("BlipModel", "BlipForImageTextRetrieval"), ("Blip2Model", "Blip2ForImageTextRetrieval")])
def test_wrapping_the_automodel_class_names_the_retrieval_class(automodel_class, retrieval_class):
    import transformers

    from hf_tta import TTAConfig, TTAWrapper
    from tiny_models import make_model

    config = make_model("blip2" if automodel_class.startswith("Blip2") else "blip").config
    model = getattr(transformers, automodel_class)(config)
    with pytest.raises(ValueError, match=rf"load the checkpoint with transformers\.{retrieval_class}\.from_pretrained"):
        TTAWrapper(model, TTAConfig(objective="tent"))


def test_run_on_a_folder_saved_as_blipmodel_names_the_class_to_save_instead(folders, tmp_path, capsys):
    model = save_retrieval_checkpoint("blip", tmp_path / "blip-model", model_class="BlipModel")
    capsys.readouterr()
    code = cli.main(["run", "--model", str(model), "--dataset", str(folders["dataset"]), "--corruptions", "fog", *FAST,
                     "--output-dir", str(tmp_path / "res")])
    assert code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "transformers.BlipForImageTextRetrieval.from_pretrained" in err, err
    assert not (tmp_path / "res").exists()


def test_checkpoints_without_a_retrieval_class_still_load_with_automodel(tmp_path):
    from hf_tta.models.auto import load_dual_encoder
    from tiny_models import make_model

    make_model("clip").save_pretrained(tmp_path / "clip")
    assert type(load_dual_encoder(str(tmp_path / "clip"))).__name__ == "CLIPModel"


def test_a_failed_run_exits_1_with_one_line_each_and_a_summary(folders, tmp_path):
    dataset = tmp_path / "coco-c"
    shutil.copytree(folders["dataset"], dataset)
    for arrow in (dataset / "image-fog-5").glob("*.arrow"):  # a torn copy of one config
        arrow.write_bytes(b"torn")
    res = _hf_tta("run", "--model", folders["blip"], "--dataset", dataset, "--corruptions", "fog", "--clean",
                  "--objectives", "tent", *FAST, "--output-dir", tmp_path / "res")
    assert res.returncode == 1, res.stderr
    assert "Traceback" not in res.stderr
    failed = [line for line in res.stderr.splitlines() if " failed: " in line]
    assert len(failed) == 2 and all(line.startswith("hf-tta: ") and "i2t/fog-5" in line for line in failed), res.stderr
    assert {line.split(" on ")[0] for line in failed} == {"hf-tta: source", "hf-tta: tent"}
    assert res.stderr.strip().splitlines()[-1].startswith("hf-tta: 2 of 4 runs failed")
    rows = json.loads((tmp_path / "res" / "results.json").read_text())["rows"]
    assert sorted(r["shift"] for r in rows if "error" not in r) == ["clean", "clean"]  # the clean stream still ran


def test_missing_configs_and_folders_are_named_before_anything_runs(folders, tmp_path, monkeypatch, capsys):
    common = ["run", "--model", str(folders["blip"]), *FAST, "--output-dir", str(tmp_path / "res")]
    assert cli.main([*common, "--dataset", str(folders["dataset"]), "--corruptions", "frost"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "has no config image-frost-5 (it has: clean, image-fog-5, text-ocr-7)" in err
    # no build record (a folder made by hand): both ways to add the config
    assert f"`hf-tta build --pairs <your pairs> --output-dir {folders['dataset']} --configs image-frost-5` (a set of your own)" in err
    assert "or `python recipes/build_benchmarks.py --benchmark coco-c --karpathy-json <split json>" in err
    assert not (tmp_path / "res").exists()  # nothing ran
    monkeypatch.chdir(tmp_path)
    for missing in ("coco-c-built", "./coco-c-built", "res/coco-c"):  # a bare name, a path, a/b with a folder a here
        (tmp_path / "res").mkdir(exist_ok=True)
        assert cli.main([*common, "--dataset", missing]) == 2, missing
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and f"(the folder {(tmp_path / missing).absolute()} does not exist)" in err, err


def test_tables_show_the_safety_layers_counts(folders, tmp_path, capsys):
    out = tmp_path / "res"
    code = cli.main(["run", "--model", str(folders["blip"]), "--dataset", str(folders["dataset"]), "--corruptions", "fog",
                     "--objectives", "tent+safe,tent", "--degenerate", "--degenerate-batches", "3", "--steps", "1",
                     "--batch-size", "8", "--quiet", "--no-plots", "--output-dir", str(out)])
    assert code == 0
    printed = capsys.readouterr().out
    rows = json.loads((out / "results.json").read_text())["rows"]
    safe = {r["shift"]: r["safety"] for r in rows if r["objective"] == "tent+safe"}
    assert not [r for r in rows if r["objective"] == "tent" and "safety" in r]
    assert safe["degenerate"]["skip_degenerate"] >= 3  # each batch of one constant query is skipped
    headers = [line for line in printed.splitlines() if line.endswith("| Safety skips/rollbacks/resets |")]
    assert len(headers) == 1 and "| Fog 5 | Avg. | Degen. |" in headers[0]  # one table: both streams are its columns
    (safe_line,) = [line for line in printed.splitlines() if line.startswith("| • tent+safe |")]
    total = {a: sum(s[a] for s in safe.values()) for a in ("skip_degenerate", "rollback", "reset")}  # over its streams
    assert safe_line.endswith(f"| {total['skip_degenerate']}/{total['rollback']}/{total['reset']} |")
    (plain_line,) = [line for line in printed.splitlines() if line.startswith("| • tent |")]
    assert plain_line.endswith("| – |")
    csv_rows = (out / "results.csv").read_text().splitlines()
    column = csv_rows[0].split(",").index("safety_skip_degenerate")
    assert sorted(int(r.split(",")[column]) for r in csv_rows[1:] if ",tent+safe," in r) == sorted(
        s["skip_degenerate"] for s in safe.values())


def test_loading_a_missing_folder_says_it_does_not_exist(tmp_path, monkeypatch):
    from hf_tta.data.builders import load_retrieval_split

    monkeypatch.chdir(tmp_path)
    (tmp_path / "out").mkdir()
    for missing in ("coco-c", "./coco-c", "out/coco-c", str(tmp_path / "coco-c")):
        with pytest.raises(FileNotFoundError, match=rf"The folder {tmp_path}/.*coco-c does not exist"):
            load_retrieval_split(missing, "clean", task="i2t")


def test_model_and_dataset_mistakes_are_one_line_and_exit_2_before_anything_runs(folders, tmp_path, monkeypatch, capsys):
    from tiny_models import make_model

    make_model("clip").save_pretrained(tmp_path / "no-processor")  # weights and config, no processor saved
    (tmp_path / "models").mkdir()
    (tmp_path / "coco-c.zip").write_bytes(b"PK")
    monkeypatch.chdir(tmp_path)
    capsys.readouterr()
    dataset = str(folders["dataset"])
    cases = {
        ("--model", "models/blipp", "--dataset", dataset): "--model models/blipp: no such folder",  # a typo under a folder here
        ("--model", "./blipp", "--dataset", dataset): "--model ./blipp: no such folder",
        ("--model", "blipp", "--dataset", dataset): "and no Hub model 'blipp' in the Hugging Face cache (offline mode)",
        ("--model", "no-processor", "--dataset", dataset): "the folder has no processor (no processor_config.json or "
                                                           "preprocessor_config.json); save it next to the model",
        ("--model", str(folders["blip"]), "--dataset", "coco-c.zip"): "--dataset coco-c.zip is a file; pass the folder",
    }
    for argv, message in cases.items():
        assert cli.main(["run", *argv, *FAST, "--output-dir", str(tmp_path / "res")]) == 2, argv
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and message in err and "huggingface.co" not in err, (argv, err)
        assert not (tmp_path / "res").exists()  # nothing ran
    res = _hf_tta("run", "--model", "models/blipp", "--dataset", dataset, *FAST, "--output-dir", tmp_path / "res", cwd=tmp_path)
    assert res.returncode == 2 and res.stderr.strip().splitlines() == [
        f"hf-tta: error: --model models/blipp: no such folder (the folder {tmp_path / 'models' / 'blipp'} does not exist); "
        "check the path, or pass a Hub model id (owner/name)."]


def test_merge_refuses_results_of_another_model_or_scoring_rule(folders, tmp_path, capsys):
    def run(name, model, *extra):
        argv = ["run", "--model", str(model), "--dataset", str(folders["dataset"]), "--corruptions", "fog",
                "--objectives", "tent", *FAST, *extra, "--output-dir", str(tmp_path / name)]
        assert cli.main(argv) == 0
        return str(tmp_path / name / "results.json")

    blip, blip2 = run("blip", folders["blip"]), run("blip2", folders["blip2"])
    papers = run("papers", folders["blip"], "--scoring", "after_update", "--seed", "1")
    capsys.readouterr()
    out = str(tmp_path / "merged")
    for parts, message in (((blip, blip2), f"comes from another model than {blip} (model {str(folders['blip2'])!r} vs "
                                           f"{str(folders['blip'])!r}); merge only results of one model"),
                           ((blip, papers), "comes from another scoring rule than"),
                           ((str(tmp_path / "blip2" / "rows.jsonl"), blip), "comes from another model than")):
        assert cli.main(["merge", *parts, "--output-dir", out, "--no-plots"]) == 2, parts
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and message in err, err
    assert cli.main(["merge", blip, str(tmp_path / "blip" / "rows.jsonl"), "--output-dir", out, "--no-plots"]) == 0
    merged = json.loads((tmp_path / "merged" / "results.json").read_text())
    assert merged["meta"]["identity"]["model"] == str(folders["blip"]) and merged["meta"]["identity"]["scoring"] == "before_update"


def _write_pairs(folder: Path, n: int = 4) -> Path:
    """A user's own image-text set: ``n`` PNG images and a ``pairs.jsonl`` naming them with a caption each."""
    from PIL import Image

    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    rows = []
    for i in range(n):
        Image.fromarray(rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)).save(folder / f"{i}.png")
        rows.append(json.dumps({"image": f"{i}.png", "caption": f"photo of a red cat {i}"}))
    (folder / "pairs.jsonl").write_text("\n".join(rows) + "\n")
    return folder / "pairs.jsonl"


def _on_a_terminal(*argv, env: dict[str, str]) -> tuple[int, str]:
    """The `hf-tta` command with stdout and stderr on a pseudo-terminal (where every progress bar would draw);
    ``(exit status, everything it wrote)``."""
    import fcntl
    import pty
    import select
    import struct
    import termios

    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 160, 0, 0))  # 160 columns: else bars draw empty
    proc = subprocess.Popen([sys.executable, "-m", "hf_tta.cli", *map(str, argv)], stdout=slave, stderr=slave,
                            stdin=subprocess.DEVNULL, env=env, cwd=str(ROOT))
    os.close(slave)
    chunks = []
    try:
        while select.select([master], [], [], 600)[0]:
            try:
                data = os.read(master, 1 << 16)
            except OSError:  # the command exited and closed the terminal
                break
            if not data:
                break
            chunks.append(data)
    finally:
        os.close(master)
        proc.kill() if proc.poll() is None else None
    return proc.wait(), b"".join(chunks).decode("utf-8", errors="replace")


def _bar_lines(text: str) -> list[str]:
    """Progress-bar lines (tqdm's ``50%|#####     |`` or ``6 examples [00:00, 12.3 examples/s]``), redraws included."""
    import re

    return [line for line in re.split(r"[\r\n]", text) if re.search(r"\d%\||/s\]", line)]


def test_quiet_build_and_run_draw_no_progress_bar_on_a_terminal(folders, tmp_path):
    src = _write_pairs(tmp_path / "src").parent
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_CACHE": str(tmp_path / "cache"),
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    env.pop("HF_DATASETS_DISABLE_PROGRESS_BARS", None)
    code, text = _on_a_terminal("build", "--pairs", src / "pairs.jsonl", "--output-dir", tmp_path / "built",
                                "--configs", "clean,image-fog-5", "--quiet", env=env)
    assert code == 0 and "hf-tta: built 2 configs of pairs" in text, text
    assert not _bar_lines(text), _bar_lines(text)  # before: datasets' generate/save bars, 6 lines here, 58 on a real build
    hub = tmp_path / "hub"  # the same benchmark as a dataset repository (as downloaded from the Hub): read by its card
    shutil.copytree(tmp_path / "built", hub)
    for info in hub.glob("*/dataset_info.json"):
        info.unlink()
    code, text = _on_a_terminal("run", "--model", folders["blip"], "--dataset", hub, "--corruptions", "fog",
                                "--objectives", "tent", *FAST, "--output-dir", tmp_path / "res", env=env)
    assert code == 0 and "| • tent |" in text, text  # the summary still prints
    assert not _bar_lines(text), _bar_lines(text)


def test_a_config_a_pairs_build_lacks_is_named_with_the_build_command_that_adds_it(folders, tmp_path, monkeypatch, capsys):
    pairs, built = _write_pairs(tmp_path / "src"), tmp_path / "built"
    assert cli.main(["build", "--pairs", str(pairs), "--output-dir", str(built), "--configs", "clean,image-fog-5", "--seed", "3",
                     "--quiet"]) == 0
    capsys.readouterr()
    run = ["run", "--model", str(folders["blip"]), "--dataset", str(built), "--corruptions", "frost", "--objectives", "tent",
           *FAST, "--output-dir", str(tmp_path / "res")]
    assert cli.main(run) == 2
    err = capsys.readouterr().err.strip()
    command = f"hf-tta build --pairs pairs.jsonl --seed 3 --output-dir {built} --configs image-frost-5"
    assert len(err.splitlines()) == 1 and f"or add it to the build: `{command}`." in err, err  # before: recipes/build_benchmarks.py
    assert "build_benchmarks" not in err
    monkeypatch.chdir(pairs.parent)  # the command as printed, from the pairs file's folder: the build resumes and adds it
    assert cli.main([*command.split()[1:], "--quiet"]) == 0
    assert sorted(p.parent.name for p in built.glob("*/dataset_info.json")) == ["clean", "image-fog-5", "image-frost-5"]
    assert "hf-tta: built 1 config of pairs" in capsys.readouterr().out  # the one it added, in the singular
    # the same folder with another seed: one line naming the fix, exit status 2, nothing built
    assert cli.main(["build", "--pairs", str(pairs), "--output-dir", str(built), "--configs", "image-snow-2", "--seed", "4",
                     "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "other settings" in err and "same settings to resume" in err, err
    assert not (built / "image-snow-2").exists()
    assert cli.main(run) == 0
    assert "| Frost 5 |" in capsys.readouterr().out


@pytest.mark.parametrize("params, command", [
    ({"benchmark": "coco-c", "seed": 0, "limit": 100}, "python recipes/build_benchmarks.py --benchmark coco-c --karpathy-json "
     "<split json> --images-root <images> --limit 100 --output-dir {out} --configs image-frost-5 text-ocr-7"),
    ({"benchmark": "nocaps-out", "seed": 2, "source": {"raw": "nocaps_val_4500_captions.json"}},
     "hf-tta build --nocaps nocaps_val_4500_captions.json --domain out --images-root <images> --seed 2 --output-dir {out} "
     "--configs image-frost-5,text-ocr-7"),
    ({"benchmark": "shop", "seed": 0, "source": {"pairs": "pairs.csv"}, "spec": {"license_id": "cc-by-4.0"}},
     "hf-tta build --pairs pairs.csv --name shop --license cc-by-4.0 --output-dir {out} --configs image-frost-5,text-ocr-7"),
])
def test_the_command_adding_configs_is_the_builds_own(tmp_path, params, command):
    from hf_tta.cli.build import add_configs_command

    (tmp_path / "build_info.json").write_text(json.dumps({"params": params}))  # the keys a build records
    assert add_configs_command(tmp_path, ["image-frost-5", "text-ocr-7"]) == f"`{command.format(out=tmp_path)}`"


def _prepare_on_rank(rank: int, world: int, init_file: str, argv: list[str], out_dir: str) -> None:
    """One process of a multi-process run (the accelerate recipe's `prepare_run` on every rank): what it printed."""
    import contextlib
    import io

    from support import gloo_worker

    with gloo_worker(rank, world, init_file):
        from hf_tta.cli import build_parser, prepare_run

        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            prepare_run(build_parser().parse_args(["run", *argv]), show_progress=False)
        (Path(out_dir) / f"rank{rank}.txt").write_text(printed.getvalue())


def test_the_runs_notes_print_once_across_processes(folders, tmp_path):
    import torch.multiprocessing as mp

    from hf_tta.data.builders.pairs import pairs_builder

    built = tmp_path / "built"  # a --pairs build: its spec sets the baselines' tau (0.01), a note the run prints
    pairs_builder(_write_pairs(tmp_path / "src"), built, show_progress=False).build(["clean", "image-fog-5"])
    argv = ["--model", str(folders["blip"]), "--dataset", str(built), "--objectives", "tent", "--quiet", "--threads", "1"]
    mp.spawn(_prepare_on_rank, args=(2, str(tmp_path / "init"), argv, str(tmp_path)), nprocs=2, join=True)
    main, other = ((tmp_path / f"rank{r}.txt").read_text() for r in (0, 1))
    tau = [line for line in main.splitlines() if "use tau = 0.01 (the papers' value for this set" in line]
    assert len(tau) == 1 and tau[0].startswith("hf-tta: pairs: baselines "), main
    assert "running the 1 corruption streams it has" in main
    assert other == ""  # before: every process printed the tau line (and the others) once more


def test_a_launchers_other_ranks_print_no_notes(monkeypatch, capsys):
    """`accelerate launch` / torchrun before any process group: the launcher's RANK decides."""
    from hf_tta.cli.common import say

    for rank, printed in (("1", ""), ("0", "hf-tta: a note\n")):
        monkeypatch.setenv("RANK", rank)
        say("a note")
        assert capsys.readouterr().out == printed
