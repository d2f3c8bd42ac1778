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


def test_a_registered_image_run_of_the_old_preset_is_refused_and_runs_nothing(tmp_path, capsys):
    """The committed image runs' row ``recommended`` ran the gated TCR of the first rounds; once the image default is
    another preset, running them again would file another preset's rows under the same name: refused in one line."""
    from hf_tta.preset import recommended_row

    assert recommended_row("image") != v4.REGISTERED_IMAGE_PRESET  # the fourth round's choice is the default
    old = [r for r in v4.all_runs() if r.name.startswith("rep-i2t/streams-s3")]
    assert old and "recommended" in old[0].args[old[0].args.index("--objectives") + 1].split(",")
    code = v4.main(["run", "--out", str(tmp_path / "runs"), "--only", "rep-i2t/streams-s3"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "would mix two presets" in err[0] and "tcr+gate+safe@3e-2" in err[0]
    assert not (tmp_path / "runs").exists()
    v4.check_preset(v4.Run("rep-t2i/streams-s3", "default-study", ("--objectives", "recommended")))  # text: unchanged
    v4.check_preset(v4.Run("rep-i2t/x", "default-study", ("--objectives", "rest+dn+safe@1e-3")))  # named rows: fine


def test_every_registered_run_is_on_its_split():
    for run in v4.all_runs():
        args = list(run.args)
        part = args[args.index("--concepts") + 1]
        assert part == run.split
        seeds = {int(s) for s in args[args.index("--seeds") + 1].split(",")}
        # rounds 4 and 6 to 12 report on new seeds (report rows were read before they were registered), each on its own
        fresh = {"default-study-r4": set(v4.R4_HEADLINE_SEEDS) | set(v4.R4_STREAM_SEEDS),
                 "default-study-r6": set(v4.R6_HEADLINE_SEEDS) | set(v4.R6_STREAM_SEEDS),
                 "default-study-r7": set(v4.R7_HEADLINE_SEEDS) | set(v4.R7_STREAM_SEEDS),
                 "default-study-r8": set(v4.R8_HEADLINE_SEEDS) | set(v4.R8_STREAM_SEEDS),
                 "default-study-r9": set(v4.R9_HEADLINE_SEEDS) | set(v4.R9_STREAM_SEEDS),
                 "default-study-r10": set(v4.R10_HEADLINE_SEEDS) | set(v4.R10_STREAM_SEEDS),
                 # rounds 11 and 12 share the seeds the eleventh registered and never ran (its incumbent stayed)
                 "default-study-r11": set(v4.R11_HEADLINE_SEEDS) | set(v4.R11_STREAM_SEEDS),
                 "r10-headline-more": set(v4.R10_MORE_SEEDS), "r10-streams-more": set(v4.R10_MORE_STREAM_SEEDS)}
        fresh["default-study-r12"] = fresh["default-study-r11"]
        allowed = fresh.get(run.study, set(v4.STREAM_SEEDS)) if part == "report" else {0}
        assert seeds <= allowed and (part == "report" or seeds == {0})
        rounds = [v for k, v in fresh.items() if k != "default-study-r12"]
        assert all(not a & b for i, a in enumerate(rounds) for b in rounds[i + 1:])
        assert not set().union(*fresh.values()) & (set(v4.STREAM_SEEDS) | {0})
        assert args[args.index("--scoring") + 1] == "before_update"
        assert v4.registration_path(run.study).is_file()


# ------------------------------------------------------------------------------------------ the registered choice
from hf_tta.benchmarks.protocols import v4_choice  # noqa: E402


def _row(label, shift, bits, severity=None, objective=None, split="selection"):
    run, _, obj = label.partition("/")
    return {"objective": objective or obj, "label": label, "run": f"sel-i2t/{run}", "split": split, "concepts": "selection",
            "seed": 0, "direction": "i2t", "shift": shift, "severity": severity, "hits": bits}


N = 400
CLEAN = "1" * N
HALF = "1" * (N // 2) + "0" * (N // 2)


def _rows(candidate_bits: dict):
    rows = [_row("a/source", "clean", CLEAN), _row("a/source", "blur", HALF, 5)]
    for label, (blur, clean, degenerate) in candidate_bits.items():
        rows += [_row(label, "blur", blur, 5), _row(label, "clean", clean), _row(label, "degenerate", degenerate)]
    return rows


def test_the_share_and_the_registered_choice_by_hand():
    # source: clean 100 %, blur 50 %: 50 points lost. good: blur 90 % -> share 40/50 = 80 %, harms clean by 5 points;
    # safe: blur 80 % (60 %), clean and degenerate as the source; close: 79.75 % (59.5 %, tied with safe) and safe.
    good = "1" * 360 + "0" * 40
    safe = "1" * 320 + "0" * 80
    close = "1" * 319 + "0" * 81
    harm = "0" * 20 + "1" * (N - 20)
    rows = _rows({"g/tcr@1e-2": (good, harm, CLEAN), "s/tcr+gate@1e-2": (safe, CLEAN, CLEAN),
                  "c/tcr+ens@1e-2": (close, CLEAN, CLEAN)})
    summaries = {s.label: s for s in v4_choice.summarise(rows, "i2t")}
    assert summaries["g/tcr@1e-2"].share == pytest.approx(0.8)
    assert summaries["s/tcr+gate@1e-2"].share == pytest.approx(0.6)
    assert summaries["g/tcr@1e-2"].streams["clean"][0] == pytest.approx(-5.0)
    assert not summaries["g/tcr@1e-2"].not_below("clean")  # 5 points below: bound far under -0.5
    chosen, notes = v4_choice.choose_default(list(summaries.values()))
    assert chosen.label in ("s/tcr+gate@1e-2", "c/tcr+ens@1e-2")  # tied within 1 point: the safer; both equally safe,
    assert chosen.label == "s/tcr+gate@1e-2"  # no passes recorded: the first listed after a stable sort
    assert any(n.startswith("g/tcr@1e-2: not eligible") for n in notes)


def test_a_choice_refuses_report_rows():
    rows = _rows({"s/tcr@1e-2": (HALF, CLEAN, CLEAN)})
    rows.append(_row("s/tcr@1e-2", "snow", HALF, 5, split="report"))
    with pytest.raises(ValueError, match="not selection rows"):
        v4_choice.summarise(rows, "i2t")


def test_the_comparators_rule_breaks_ties_towards_the_smaller_lr():
    rows = _rows({})
    for lr, bits in (("1e-3", "1" * 300 + "0" * 100), ("3e-3", "1" * 301 + "0" * 99), ("1e-2", "1" * 250 + "0" * 150)):
        rows += [_row(f"comparators/tcr@{lr}", "blur", bits, 5)]
    summaries = v4_choice.summarise(rows, "i2t")
    assert v4_choice.choose_lr(summaries, "tcr").label == "comparators/tcr@1e-3"  # 50.0 vs 50.5 %: tied, smaller lr


def test_run_level_feature_settings_only_in_runs_whose_rows_all_ask_for_the_feature():
    """--shift_gate / --weight_ensemble / --safety apply to every row of a run, so a run that names one must hold only
    rows that switch the feature on (+gate / +ens / +safe), or rows would run a feature their names do not say."""
    for run in v4.all_runs():
        args = list(run.args)
        rows = args[args.index("--objectives") + 1].split(",")
        for flag, option in (("--shift_gate", "+gate"), ("--weight_ensemble", "+ens"), ("--safety", "+safe"),
                             ("--source_anchor", "+anchor")):
            if flag in args:
                assert all(option in r for r in rows), (run.name, flag, rows)


@pytest.mark.parametrize("direction", ["i2t", "t2i"])
def test_every_selection_candidate_maps_to_a_valid_tta_config(direction):
    from hf_tta import TTAConfig

    for run in (r for r in v4.selection_runs() if r.name.startswith(f"sel-{direction}/")):
        args = list(run.args)
        for row in args[args.index("--objectives") + 1].split(","):
            fields = v4_choice.config_of(f"{run.name.split('/')[1]}/{row}", direction)
            cfg = TTAConfig(**fields, query_modality="image" if direction == "i2t" else "text")
            assert ("+gate" in row) == (cfg.shift_gate is not None) and ("+ens" in row) == (cfg.weight_ensemble is not None)
            assert ("+safe" in row) == (cfg.safety is not None) and ("+anchor" in row) == (cfg.source_anchor is not None)


def test_a_tie_between_equally_safe_candidates_goes_to_fewer_passes():
    safe = "1" * 320 + "0" * 80
    rows = _rows({"a/tcr+gate@1e-2": (safe, CLEAN, CLEAN), "b/tcr+gate@3e-2": (safe, CLEAN, CLEAN)})
    for r in rows:  # a: 4 forward + 3 backward per query; b: 2 + 1 (its gate closes more often)
        r["forward_per_query"], r["backward_per_query"] = (4.0, 3.0) if r["label"].startswith("a/") else (2.0, 1.0)
    summaries = v4_choice.summarise(rows, "i2t")
    assert {s.label: s.passes for s in summaries} == {"a/tcr+gate@1e-2": 7.0, "b/tcr+gate@3e-2": 3.0}
    assert v4_choice.choose_default(summaries)[0].label == "b/tcr+gate@3e-2"


def test_the_fourth_rounds_rule_needs_noto_not_below_and_ties_within_half_a_point():
    """default-study-r4's registered rule (by hand on three summaries): eligible = clean, degenerate and Noto not
    below; "a" has the best share but harms Noto; "b" and "c" are 0.4 share points apart (a tie under 0.5, not a
    tie broken by the first rounds' 1.0 either way here) and "c" has the higher smallest bound over the three streams."""
    S = v4_choice.Summary
    ok, noto_bad = {"clean": (0.0, 0.0), "degenerate": (0.0, 0.0)}, {"noto": (-2.0, -3.0)}
    summaries = [S("r4-x/a", 0.60, {**ok, **noto_bad}, 5.0), S("r4-x/b", 0.504, {**ok, "noto": (0.0, -0.4)}, 5.0),
                 S("r4-x/c", 0.500, {**ok, "noto": (0.5, -0.1)}, 5.0)]
    prefix, required, tie = v4_choice.ROUND_RULES["default-study-r4"]
    assert (prefix, required, tie) == (("r4-",), ("clean", "degenerate", "noto"), 0.5)
    assert v4_choice.ROUND_RULES["default-study-r5"][1:] == (required, tie)  # the fifth round: the same rule
    chosen, notes = v4_choice.choose_default(summaries, required, tie)
    assert chosen.label == "r4-x/c" and notes == ["r4-x/a: not eligible (clean bound +0.00, degenerate bound +0.00, noto bound -3.00)"]
    assert v4_choice.choose_default(summaries)[0].label == "r4-x/a"  # the first rounds' rule does not look at Noto
    assert v4_choice.choose_default([summaries[0]], required, tie) == (None, notes)
    b_only = [S("r4-x/b", 0.51, {**ok, "noto": (0.0, -0.4)}, 5.0), summaries[2]]  # 1.0 point apart: no tie
    assert v4_choice.choose_default(b_only, required, tie)[0].label == "r4-x/b"


def test_the_eighth_rounds_rule_needs_each_stream_above_a_quarter_point_and_every_column_not_below():
    """default-study-r8's registered rule by hand: "a" has the best share but its Noto bound (-0.4) is under -0.25
    (eligible under the seventh round's -0.5); "b" has a column bound at -0.6; "c" is eligible."""
    S = v4_choice.Summary
    ok = {"clean": (0.0, 0.0), "degenerate": (0.0, 0.0), "diverse": (1.0, 0.5)}
    cols = {"blur 5": (10.0, 8.0), "blur 3": (0.0, -0.3)}
    summaries = [S("r8-a/x", 0.60, {**ok, "noto": (0.1, -0.4)}, 5.0, cols),
                 S("r8-b/x", 0.55, {**ok, "noto": (0.1, -0.1)}, 5.0, {**cols, "blur 3": (-0.2, -0.6)}),
                 S("r8-c/x", 0.50, {**ok, "noto": (0.3, 0.0)}, 5.0, cols)]
    prefix, required, tie = v4_choice.ROUND_RULES["default-study-r8"]
    options = v4_choice.RULE_OPTIONS["default-study-r8"]
    assert v4_choice.ROUND_RULES["default-study-r9"][1:] == (required, tie)  # the ninth round: the same rule
    assert v4_choice.RULE_OPTIONS["default-study-r9"] == v4_choice.RULE_OPTIONS["default-study-r10"] == options
    # the tenth: the same, with the switching stream required too (its selection split has one)
    _, required10, tie10 = v4_choice.ROUND_RULES["default-study-r10"]
    assert set(required10) == {*required, "switch"} and tie10 == tie
    assert (prefix, required, tie, options) == (("r8-",), ("clean", "degenerate", "noto", "diverse"), 0.5,
                                                {"stream_margin": 0.25, "columns": True})
    chosen, notes = v4_choice.choose_default(summaries, required, tie, **options)
    assert chosen.label == "r8-c/x"
    assert notes[0].startswith("r8-a/x: not eligible (") and "noto bound -0.40" in notes[0]
    assert notes[1].endswith("worst column blur 3 bound -0.60)")
    assert v4_choice.choose_default(summaries, required, tie)[0].label == "r8-a/x"  # the seventh round's rule


def test_the_eleventh_rounds_rule_takes_the_fewest_lost_answers_within_97_percent_of_the_incumbents_share():
    """default-study-r11's registered rule by hand: the tenth round's eligibility, a share floor of 0.97 x the
    incumbent's (0.50 -> 0.485), then the fewest lost answers; equal counts to the higher share."""
    S = v4_choice.Summary
    ok = {s: (0.0, 0.0) for s in v4_choice.STREAMS}
    cols = {"blur 5": (10.0, 8.0)}
    summaries = [S("r11-incumbent/x", 0.50, ok, 5.0, cols, 40), S("r11-a/x", 0.49, ok, 5.0, cols, 12),
                 S("r11-b/x", 0.48, ok, 5.0, cols, 3), S("r11-c/x", 0.495, ok, 5.0, cols, 12),
                 S("r11-d/x", 0.60, {**ok, "switch": (-0.1, -0.3)}, 5.0, cols, 0)]
    prefix, required, tie = v4_choice.ROUND_RULES["default-study-r11"]
    options = v4_choice.RULE_OPTIONS["default-study-r11"]
    assert (prefix, required) == (("r11-",), v4_choice.ROUND_RULES["default-study-r10"][1])
    assert options == {**v4_choice.RULE_OPTIONS["default-study-r10"], "fewest_lost": ("r11-incumbent/", 0.97)}
    chosen, notes = v4_choice.choose_default(summaries, required, tie, **options)
    assert chosen.label == "r11-c/x"  # b loses fewest but is under the floor; a and c tie on 12: the higher share
    assert any(n.startswith("r11-b/x: not eligible (share 48.0 % < 48.5 %") for n in notes)
    assert any(n.startswith("r11-d/x: not eligible (") and "switch bound -0.30" in n for n in notes)
    assert v4_choice.choose_default(summaries[:1], required, tie, **options)[0].label == "r11-incumbent/x"
    # an exact tie (the same lost answers, share and bounds) goes to the first listed in the registration's order, the
    # incumbent, whatever order the rows loaded in (folders sort r11-aa0.9 before r11-incumbent)
    same = [S("r11-aa0.9/x", 0.50, ok, 5.0, cols, 40), S("r11-incumbent/x", 0.50, ok, 5.0, cols, 40)]
    listed = v4_choice.in_listed_order(same, "i2t")
    assert [s.label for s in listed] == ["r11-incumbent/x", "r11-aa0.9/x"]
    assert v4_choice.choose_default(listed, required, tie, **options)[0].label == "r11-incumbent/x"
    with pytest.raises(ValueError, match="needs one incumbent row"):
        v4_choice.choose_default(summaries[1:], required, tie, **options)


def test_a_selection_summary_counts_the_answers_lost_to_the_source():
    # blur: the source (HALF) right on the first 200 items; the row wrong on the first 5 of them (5 lost) and right on
    # 115 the source has wrong (gains do not count); clean: the first 20 lost; degenerate: none. 25 in all.
    row = "0" * 5 + "1" * 305 + "0" * 80 + "1" * 10
    harm = "0" * 20 + "1" * (N - 20)
    rows = _rows({"s/tcr@1e-2": (row, harm, CLEAN)})
    (s,) = v4_choice.summarise(rows, "i2t")
    assert s.lost == 25


def test_a_selection_summary_holds_each_corruption_columns_bound():
    rows = _rows({"s/tcr@1e-2": ("1" * 320 + "0" * 80, CLEAN, CLEAN)})
    (s,) = v4_choice.summarise(rows, "i2t")
    assert set(s.columns) == {"blur 5"} and s.columns["blur 5"][0] == pytest.approx(30.0) and s.columns["blur 5"][1] > 20


@pytest.mark.parametrize(("k", "candidate", "report", "field", "value", "heads", "streams"), [
    (8, "r8-w0.3-c0.7", v4.eighth_round_report_runs, "source_confidence", 0.7, (9,), (19, 20)),
    (9, "r9-w0.5-a0.3-0.9", v4.ninth_round_report_runs, "mix_agreement", [0.3, 0.9], (10,), (21, 22)),
    (10, "r10-w0.5-c0.7-a0.3-0.9", v4.tenth_round_report_runs, "source_confidence", 0.7, (23, 24), (25, 26)),
])
def test_a_later_rounds_report_leaves_the_incumbents_headline_out_and_names_new_seeds(k, candidate, report, field, value,
                                                                                      heads, streams):
    label = f"{candidate}/tcr+gate+anchor+safe@3e-2"
    choice = {"i2t": {"default": label, "config": v4_choice.config_of(label, "i2t")}}
    assert {r.name for r in report(choice)} == {
        *(f"rep-i2t/r{k}-headline-{m}-s{s}" for m in ("chosen", "tcr") for s in heads), f"rep-i2t/main-r{k}-s3",
        *(f"rep-i2t/r{k}-streams-{m}-s{s}" for m in ("chosen", "tcr", "previous") for s in streams)}
    assert choice["i2t"]["config"]["source_anchor"][field] == value
    assert report({"i2t": {**choice["i2t"], "default": f"r{k}-incumbent/tcr+gate+anchor+safe@3e-2"}}) == []


@pytest.mark.parametrize(("run", "studies"), [
    ("sel-i2t/comparators", {"default-study"}), ("sel-i2t/r3-mean4", {"default-study"}), ("sel-i2t/r8-incumbent", {"default-study-r8"}),
    ("sel-i2t/r9-w0.5-a0.3-0.9", {"default-study-r9"}), ("sel-i2t/r10-incumbent", {"default-study-r10"}),
    ("sel-i2t/r10check-incumbent", {"r10-diverse-check"}), ("sel-t2i/moonshot-r10-3e-2", {"one-rule-text-r10"}),
    ("sel-t2i/one-rule", {"one-rule-text"}), ("sel-t2i/lite", {"default-study"}),
    ("sel-i2t/r4-incumbent", {"default-study-r4"}),
    ("sel-i2t/r4-previous", {"default-study-r4", "default-study-r5", "default-study-r6"}),
    ("sel-i2t/r5-gate-full", {"default-study-r5"}), ("sel-i2t/r6-anchor0.01", {"default-study-r6"}),
])
def test_each_round_reads_its_own_selection_runs(run, studies):
    """Rounds 1-3 read every run no later round claims; round 4 its ``r4-`` runs; round 5 its ``r5-`` runs and its
    incumbent's (round 4's choice, ``r4-previous``), round 6 likewise: a later round's rows never reach an earlier round's
    table."""
    assert {s for s in v4_choice.ROUND_RULES if v4_choice.in_study(s, run)} == studies


def test_a_descriptive_study_is_refused_a_choice_in_one_line_and_its_table_says_so(tmp_path, capsys):
    assert v4_choice.main([str(tmp_path), "--study", "one-rule-text", "--write", str(tmp_path / "c.json")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "descriptive" in err[0] and not (tmp_path / "c.json").exists()
    from hf_tta.benchmarks.protocols import v4_tables

    rows = [{**r, "run": "sel-t2i/one-rule", "direction": "t2i"} for r in _rows({"one-rule/tcr@1e-2": (HALF, CLEAN, CLEAN)})]
    text = v4_tables.selection(rows, "t2i", "one-rule-text")
    assert "Descriptive: no choice reads these rows." in text and "Chosen" not in text

