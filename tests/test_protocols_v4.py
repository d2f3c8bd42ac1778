"""Protocol v4: the concept split (disjoint, stable, each part its own gallery) and the registration check."""

import hashlib
import json
import subprocess

import pytest

from hf_tta.benchmarks.emoji import CONCEPT_PARTS, concept_part, emoji_concepts, load_emoji_benchmark
from hf_tta.benchmarks.protocols import v4


def test_the_concept_split_is_the_hash_rule_disjoint_and_covers_every_concept():
    names = [c.name for c in emoji_concepts()]
    parts = {p: load_emoji_benchmark(concepts=p) for p in CONCEPT_PARTS}
    got = {p: [c.name for c in b.concepts] for p, b in parts.items()}
    # the rule, computed here independently: SHA-256 of the UTF-8 name, as an integer, 0 mod 3 -> selection
    expected = [n for n in names if int.from_bytes(hashlib.sha256(n.encode()).digest(), "big") % 3 == 0]
    assert got["selection"] == expected
    assert not set(got["selection"]) & set(got["report"])
    assert sorted(got["selection"] + got["report"]) == sorted(names)
    assert (len(got["selection"]), len(got["report"])) == (624, 1275)  # the dataset card's figures
    assert (parts["selection"].num_captions, parts["report"].num_captions) == (979, 1993)


def test_each_part_has_its_own_gallery_of_its_own_captions():
    for part in CONCEPT_PARTS:
        bench = load_emoji_benchmark(concepts=part)
        assert bench.captions == [cap for c in bench.concepts for cap in c.captions]
        assert len(bench.caption_to_image) == bench.num_captions and max(bench.caption_to_image) == len(bench) - 1


def test_the_split_does_not_depend_on_the_manifest_order():
    assert concept_part("grinning face") == concept_part("grinning face")
    assert {concept_part(n) for n in ("a", "b", "c", "d", "e", "f")} <= set(CONCEPT_PARTS)


def test_an_unknown_part_is_refused_in_one_line():
    with pytest.raises(ValueError, match="concepts must be one of"):
        load_emoji_benchmark(concepts="test")


def test_the_cli_refuses_concepts_with_a_hub_model(tmp_path, capsys):
    from hf_tta.cli import main

    code = main(["run", "--model", str(tmp_path), "--dataset", str(tmp_path), "--concepts", "report", "--output-dir", str(tmp_path / "o")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "drop it with --model/--dataset" in err[0]
    assert not (tmp_path / "o").exists()


def _repo(tmp_path):
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    for k, v in (("user.email", "t@t"), ("user.name", "t")):
        subprocess.run(["git", "-C", str(tmp_path), "config", k, v], check=True)
    path = v4.registration_path("s", tmp_path)
    path.parent.mkdir(parents=True)
    return path


def _commit(repo):
    subprocess.run(["git", "-C", str(repo), "add", "-A"], check=True)
    subprocess.run(["git", "-C", str(repo), "commit", "-qm", "register"], check=True)


def test_a_study_without_a_committed_registration_is_refused(tmp_path):
    path = _repo(tmp_path)
    with pytest.raises(ValueError, match="has no registration"):
        v4.check_registered("s", tmp_path)
    path.write_text(json.dumps({"study": "s"}))
    with pytest.raises(ValueError, match="is not committed"):
        v4.check_registered("s", tmp_path)
    _commit(tmp_path)
    commit = v4.check_registered("s", tmp_path)
    assert len(commit) == 40
    path.write_text(json.dumps({"study": "s", "candidates": ["a late one"]}))  # changed after its commit
    with pytest.raises(ValueError, match="changed since"):
        v4.check_registered("s", tmp_path)


def test_the_run_command_refuses_an_unregistered_study_and_runs_nothing(tmp_path, monkeypatch, capsys):
    _repo(tmp_path)
    monkeypatch.setattr(v4, "all_runs", lambda: [v4.Run("sel-i2t/x", "s", ("--limit", "8"))])
    original = v4.check_registered
    monkeypatch.setattr(v4, "check_registered", lambda study: original(study, tmp_path))
    code = v4.main(["run", "--out", str(tmp_path / "runs")])
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "has no registration" in err[0]
    assert not (tmp_path / "runs").exists()


def test_every_registered_run_is_on_its_split():
    for run in v4.all_runs():
        args = list(run.args)
        part = args[args.index("--concepts") + 1]
        assert part == run.split
        seeds = {int(s) for s in args[args.index("--seeds") + 1].split(",")}
        assert seeds == {0} if part == "selection" else seeds <= set(v4.STREAM_SEEDS)
        assert args[args.index("--scoring") + 1] == "before_update"
        assert v4.registration_path(run.study).is_file()
