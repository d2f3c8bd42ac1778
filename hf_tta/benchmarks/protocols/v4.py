"""Protocol v4's runs: held out in data, registered before they run.

* **Held out in data**: the emoji benchmark's concepts are split once by a fixed rule
  (:func:`hf_tta.benchmarks.emoji.concept_part`, a hash of each concept's name) into a selection part (624 concepts,
  979 captions) and a report part (1,275 concepts, 1,993 captions), each with its own gallery of its own captions
  (``hf-tta run --concepts selection|report``). Every choice reads selection rows only (seed 0, ImageNet-C's
  validation corruptions, character-level text corruptions); every reported figure comes from report rows only
  (seeds 3, 4, 5 and 11, 12, the test corruptions, word-level text corruptions, the five streams).
* **Registered before it runs**: a study's registration (``model_cards/results/protocol-v4/registrations/<study>.json``:
  candidates, grids, the choice rule, margin, bootstrap size and RNG seed, tables) is committed before its first row.
  :func:`check_registered` refuses a run of a study whose registration is missing, not committed, or changed since
  its commit, and every run folder records the registration's commit (``registration.txt``), so git order shows it.
* Every row is prequential (``--scoring before_update``).

Runs are ``hf-tta run`` processes into their own folders (``<out>/<run name>/rows.jsonl``: per-query hits, resumable)::

    python -m hf_tta.benchmarks.protocols.v4 list
    python -m hf_tta.benchmarks.protocols.v4 run --out runs/v4 --only sel-i2t/ --jobs 2
"""

from __future__ import annotations

import argparse
import json
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from .v4_base import (
    GATE_MEAN4,
    REPORT_SEEDS,
    SAFE_LITE,
    SCORING,
    SELECTION_SEED,
    STREAM_SEEDS,
    Run,
    _objectives,
    split_arguments,
)
from .v4_registry import (
    CHOICES,
    REGISTRATIONS,
    REPO,
    check_chosen,
    check_registered,
    load_choice,
    registration_path,
    run_folder,
)
from .v4_rounds import (
    MAIN_JOB_SEED,
    R4_HEADLINE_SEEDS,
    R4_STREAM_SEEDS,
    R6_HEADLINE_SEEDS,
    R6_STREAM_SEEDS,
    R7_HEADLINE_SEEDS,
    R7_STREAM_SEEDS,
    R8_CANDIDATES,
    R8_HEADLINE_SEEDS,
    R8_STREAM_SEEDS,
    R9_CANDIDATES,
    R9_HEADLINE_SEEDS,
    R9_STREAM_SEEDS,
    R10_CANDIDATES,
    R10_HEADLINE_SEEDS,
    R10_MORE_SEEDS,
    R10_MORE_STREAM_SEEDS,
    R10_STREAM_SEEDS,
    R11_CANDIDATES,
    R11_HEADLINE_SEEDS,
    R11_STREAM_SEEDS,
    R12_CANDIDATES,
    eighth_round_report_runs,
    eighth_round_runs,
    eleventh_round_report_runs,
    eleventh_round_runs,
    fifth_round_runs,
    fourth_round_report_runs,
    fourth_round_runs,
    ninth_round_report_runs,
    ninth_round_runs,
    one_rule_r10_runs,
    one_rule_runs,
    r7_anchor,
    r8_anchor,
    r9_anchor,
    r10_diverse_check_runs,
    r10_headline_more_runs,
    r10_streams_more_runs,
    seventh_round_report_runs,
    seventh_round_runs,
    sixth_round_report_runs,
    sixth_round_runs,
    tenth_round_report_runs,
    tenth_round_runs,
    twelfth_round_report_runs,
    twelfth_round_runs,
)

#: the names of the registry, the runs' pieces and the later rounds, read here by the runs' users as before
__all__ = ["CHOICES", "REGISTRATIONS", "REPO", "check_chosen", "check_registered", "load_choice", "registration_path",
           "run_folder", "SCORING", "SELECTION_SEED", "REPORT_SEEDS", "STREAM_SEEDS", "SAFE_LITE", "GATE_MEAN4", "Run",
           "split_arguments", "MAIN_JOB_SEED", "R4_HEADLINE_SEEDS", "R4_STREAM_SEEDS", "R6_HEADLINE_SEEDS",
           "R6_STREAM_SEEDS", "R7_HEADLINE_SEEDS", "R7_STREAM_SEEDS", "R8_CANDIDATES", "R8_HEADLINE_SEEDS",
           "R8_STREAM_SEEDS", "r7_anchor", "r8_anchor", "fourth_round_runs", "fifth_round_runs", "sixth_round_runs",
           "seventh_round_runs", "eighth_round_runs", "one_rule_runs", "fourth_round_report_runs",
           "sixth_round_report_runs", "seventh_round_report_runs", "eighth_round_report_runs", "R9_CANDIDATES",
           "R9_HEADLINE_SEEDS", "R9_STREAM_SEEDS", "ninth_round_report_runs", "ninth_round_runs", "r9_anchor",
           "R10_CANDIDATES", "R10_HEADLINE_SEEDS", "R10_STREAM_SEEDS", "tenth_round_report_runs", "tenth_round_runs",
           "r10_diverse_check_runs", "one_rule_r10_runs", "R11_CANDIDATES", "R11_HEADLINE_SEEDS", "R11_STREAM_SEEDS",
           "eleventh_round_report_runs", "eleventh_round_runs", "R12_CANDIDATES", "twelfth_round_report_runs",
           "twelfth_round_runs", "R10_MORE_SEEDS", "r10_headline_more_runs",
           "R10_MORE_STREAM_SEEDS", "r10_streams_more_runs"]


def default_study_runs() -> list[Run]:
    """The runs of the ``default-study`` registration (issue 48): the labelled comparators and the candidates on
    the selection split. Report runs join once the rule has chosen (they name the chosen rows)."""
    study = "default-study"
    sel_i2t = split_arguments("selection", "i2t")
    sel_i2t_d = split_arguments("selection", "i2t", streams=("clean", "degenerate"))
    sel_t2i = split_arguments("selection", "t2i")
    sel_t2i_d = split_arguments("selection", "t2i", streams=("clean", "degenerate"))
    # run-level settings apply to every row of a run (as --safety does): a run's rows share them. ShiftGateConfig's
    # and WeightEnsembleConfig's defaults are the registered threshold 1.5 and momentum 0.99, so only the threshold-3
    # run names its setting; ``+gate`` / ``+ens`` switch the features on per row.
    lite = ["--safety", SAFE_LITE]
    gate3 = ["--shift_gate", json.dumps({"threshold": 3.0})]
    runs = [
        Run("sel-i2t/comparators", study, (*sel_i2t, *_objectives(
            "tcr@1e-3", "tcr@3e-3", "tcr@1e-2", "tcr@3e-2", "rest@3e-4", "rest@1e-3", "rest@3e-3", "rest@1e-2", "nnn"))),
        Run("sel-i2t/preset", study, (*sel_i2t_d, *_objectives("rest+dn+safe@1e-3"), "--safety", "{}")),
        Run("sel-i2t/lite", study, (*sel_i2t_d, *lite, *_objectives(
            "tcr+safe@3e-3", "tcr+safe@1e-2", "tcr+ens+safe@3e-3", "tcr+ens+safe@1e-2"))),
        Run("sel-i2t/gate1.5", study, (*sel_i2t_d, *lite, *_objectives(
            "tcr+gate+safe@3e-3", "tcr+gate+safe@1e-2", "tcr+gate+ens+safe@3e-3", "tcr+gate+ens+safe@1e-2"))),
        Run("sel-i2t/gate3", study, (*sel_i2t_d, *lite, *gate3, *_objectives("tcr+gate+safe@3e-3", "tcr+gate+safe@1e-2"))),
        Run("sel-t2i/comparators", study, (*sel_t2i, *_objectives(
            "tcr@1e-4", "tcr@3e-4", "tcr@1e-3", "rest@1e-4", "rest@3e-4", "rest@1e-3", "nnn"))),
        Run("sel-t2i/preset", study, (*sel_t2i_d, *_objectives("tcr+dn+safe@3e-4"), "--safety", "{}")),
        Run("sel-t2i/lite", study, (*sel_t2i_d, *lite, *_objectives("rest+nnn+safe@3e-4"))),
        Run("sel-t2i/gate1.5", study, (*sel_t2i_d, *lite, *_objectives(
            "rest+gate+safe@3e-4", "rest+gate+safe@1e-3", "rest+gate+nnn+safe@3e-4"))),
    ]
    return runs


def report_runs(choice: dict) -> list[Run]:
    """The default study's report runs, from its committed choice: per direction, the headline columns (the 15 test
    corruptions at severities 3 and 5; the 5 word-level corruptions at 3 and 7) and the default grid with the five
    streams, one folder per (rows, seeds) so that each finished shard is committed on its own. Rows: the default as
    ``TTAConfig.recommended`` runs it (``recommended``), TCR and REST at their selected and paper lrs, NNN, the
    previous preset and the ceilings."""
    study, runs = "default-study", []
    for d in ("i2t", "t2i"):
        c = choice.get(d)
        if not c:
            continue
        tcr, rest, previous = f"tcr@{c['tcr']}", f"rest@{c['rest']}", c["previous_preset"]
        head = ("recommended", tcr, "nnn")
        # registered but cut for compute (said in the card): the paper-lr rows and the all-parameter ceiling
        more = (rest, "oracle@1e-2") if d == "i2t" else (rest, previous)
        streams = ("clean", "noto", "diverse", "switch", "degenerate")
        for seed in REPORT_SEEDS:
            runs.append(Run(f"rep-{d}/headline-s{seed}", study, (*split_arguments("report", d, (seed,)), *_objectives(*head))))
            runs.append(Run(f"rep-{d}/headline-more-s{seed}", study, (*split_arguments("report", d, (seed,)), *_objectives(*more))))
        for seed in STREAM_SEEDS:
            grid = split_arguments("report", d, (seed,), corruptions=d == "i2t", streams=streams, default_grid=d == "i2t")
            runs.append(Run(f"rep-{d}/streams-s{seed}", study, (*grid, *_objectives("recommended", tcr, previous, "nnn"))))
    return runs


def second_round_runs() -> list[Run]:
    """``default-study-r2``: image candidates with a more sensitive gate (threshold 1.2) and a stronger pull to the
    source (momentum 0.9), chosen together with ``default-study``'s by its rule."""
    study, sel = "default-study-r2", split_arguments("selection", "i2t", streams=("clean", "degenerate"))
    lite = ["--safety", SAFE_LITE]
    gate = ["--shift_gate", json.dumps({"threshold": 1.2})]
    pull = ["--weight_ensemble", json.dumps({"momentum": 0.9})]
    return [
        Run("sel-i2t/r2-gate1.2", study, (*sel, *lite, *gate, *_objectives("tcr+gate+safe@1e-2", "tcr+gate+safe@3e-2"))),
        Run("sel-i2t/r2-gate1.2-ens", study, (*sel, *lite, *gate, *_objectives("tcr+gate+ens+safe@1e-2"))),
        Run("sel-i2t/r2-ens0.9", study, (*sel, *lite, *pull, *_objectives("tcr+ens+safe@1e-2", "tcr+ens+safe@3e-2"))),
    ]


def third_round_runs() -> list[Run]:
    """``default-study-r3``: the gate's two-sample statistic (``batch_mean``) at the selected lrs, both towers."""
    study, lite, runs = "default-study-r3", ["--safety", SAFE_LITE], []
    gate = lambda t: ["--shift_gate", json.dumps({"statistic": "batch_mean", "threshold": t})]  # noqa: E731
    i2t = split_arguments("selection", "i2t", streams=("clean", "degenerate"))
    t2i = split_arguments("selection", "t2i", streams=("clean", "degenerate"))
    runs += [
        Run("sel-i2t/r3-mean4", study, (*i2t, *lite, *gate(4.0), *_objectives("tcr+gate+safe@3e-2", "tcr+gate+safe@1e-2",
                                                                                "tcr+gate+ens+safe@3e-2"))),
        Run("sel-i2t/r3-mean8", study, (*i2t, *lite, *gate(8.0), *_objectives("tcr+gate+safe@3e-2"))),
        Run("sel-t2i/r3-mean4", study, (*t2i, *lite, *gate(4.0), *_objectives("rest+gate+safe@1e-3", "rest+gate+nnn+safe@3e-4",
                                                                                "tcr+gate+safe@1e-3"))),
    ]
    return runs


def selection_runs() -> list[Run]:
    """Every registered selection run, all rounds."""
    return (default_study_runs() + second_round_runs() + third_round_runs() + fourth_round_runs() + fifth_round_runs()
            + sixth_round_runs() + seventh_round_runs() + eighth_round_runs() + ninth_round_runs() + tenth_round_runs()
            + one_rule_runs() + r10_diverse_check_runs() + one_rule_r10_runs() + eleventh_round_runs()
            + twelfth_round_runs())


#: registered runs that describe (what the main job prints) and that no choice reads: they need no choice of their own
DESCRIPTIVE = frozenset({*(f"main-job-r{k}" for k in range(6, 13)), "headline-paper-lr", "headline-paper-lr-text",
                         "one-rule-text", "r10-diverse-check", "one-rule-text-r10", "r10-headline-more", "r10-streams-more"})


#: The image preset that the registered image runs' row ``recommended`` ran (default-study's choice, at the rows'
#: commits): a run that names that row cannot run again once ``TTAConfig.recommended("image")`` is another preset
#: (the fourth round's choice), or its new rows would join the old ones under the same name (:func:`check_preset`).
REGISTERED_IMAGE_PRESET = "tcr+gate+safe@3e-2"


def check_preset(run: Run) -> None:
    """A one-line ``ValueError`` when ``run`` has the row ``recommended`` on image queries and the library's image
    preset is no longer the one its registered rows ran (:data:`REGISTERED_IMAGE_PRESET`)."""
    from ...preset import recommended_row

    rows = run.args[run.args.index("--objectives") + 1].split(",") if "--objectives" in run.args else []
    now = recommended_row("image")
    if "-i2t/" in run.name and "recommended" in rows and now != REGISTERED_IMAGE_PRESET:
        raise ValueError(f"{run.name}'s row `recommended` ran {REGISTERED_IMAGE_PRESET} (the default of its day); it now "
                         f"runs {now}, so its rows would mix two presets under one name: its committed rows stand as "
                         "they are (register a new run, naming the rows explicitly, to measure again).")


def paper_lr_runs() -> list[Run]:
    """``headline-paper-lr`` and ``headline-paper-lr-text`` (issue 47, descriptive): TCR and REST at the papers' lr
    (3e-4 for image queries and for a dual encoder's text queries, TCR's App. B.2 and code; REST states none and TCR's
    code is used) on the 30-column image headline and the 10-column text headline of report seeds 3, 4, 5."""
    return [Run(f"rep-{d}/headline-paper-s{seed}", study, (*split_arguments("report", d, (seed,)), *_objectives("tcr@3e-4", "rest@3e-4")))
            for d, study in (("i2t", "headline-paper-lr"), ("t2i", "headline-paper-lr-text")) for seed in REPORT_SEEDS]


def ceiling_all_runs() -> list[Run]:
    """``default-study``'s all-parameter prequential ceiling (``oracle_all@3e-4``: every parameter of the query tower,
    protocol v3's selected lr, not re-selected), registered with the study's report rows and cut for compute before any
    ran (said in the results card); run on the 30-column headline of report seeds 3, 4, 5, one folder per seed."""
    return [Run(f"rep-i2t/headline-all-s{seed}", "default-study",
                (*split_arguments("report", "i2t", (seed,)), *_objectives("oracle_all@3e-4"))) for seed in REPORT_SEEDS]


def all_runs() -> list[Run]:
    choice, r4, r6 = load_choice("default-study"), load_choice("default-study-r4"), load_choice("default-study-r6")
    r7, r8, r9 = load_choice("default-study-r7"), load_choice("default-study-r8"), load_choice("default-study-r9")
    r10, r11, r12 = load_choice("default-study-r10"), load_choice("default-study-r11"), load_choice("default-study-r12")
    return (selection_runs() + (report_runs(choice) if choice else []) + (fourth_round_report_runs(r4) if r4 else [])
            + (sixth_round_report_runs(r6) if r6 else []) + (seventh_round_report_runs(r7) if r7 else [])
            + (eighth_round_report_runs(r8) if r8 else []) + (ninth_round_report_runs(r9) if r9 else []) + paper_lr_runs()
            + ceiling_all_runs() + (tenth_round_report_runs(r10) if r10 else [])
            + (eleventh_round_report_runs(r11) if r11 else []) + (twelfth_round_report_runs(r12) if r12 else [])
            + r10_headline_more_runs(r10) + r10_streams_more_runs(r10))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hf_tta.benchmarks.protocols.v4", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("list", help="the runs and their arguments")
    run = sub.add_parser("run", help="run (or resume) the runs whose names start with one of --only")
    run.add_argument("--out", required=True, help="the runs' parent folder")
    run.add_argument("--only", nargs="*", default=None, help="run-name prefixes (default: every run)")
    run.add_argument("--jobs", type=int, default=1)
    run.add_argument("--cache-dir", default=None, help="streams and galleries (default: <out>/cache)")
    run.add_argument("--device", default="cpu")
    args = parser.parse_args(argv)
    runs = all_runs()
    if args.command == "list":
        for r in runs:
            print(f"{r.name} [{r.study}, {r.split}]: hf-tta run {' '.join(r.args)}")
        return 0
    chosen = [r for r in runs if args.only is None or any(r.name.startswith(p) for p in args.only)]
    if not chosen:
        print(f"v4: no run starts with {args.only}; `list` shows them.", file=sys.stderr)
        return 2
    try:
        for r in chosen:
            check_preset(r)
        commits = {s: check_registered(s) for s in {r.study for r in chosen}}
        for s in {r.study for r in chosen if r.split == "report"} - DESCRIPTIVE:
            commits[s] += " " + check_chosen(s)
    except ValueError as err:
        print(f"v4: {err}", file=sys.stderr)
        return 2
    out = Path(args.out)
    cache = args.cache_dir or str(out / "cache")
    with ThreadPoolExecutor(max(1, args.jobs)) as pool:
        codes = list(pool.map(lambda r: run_folder(out / r.name, list(r.args), cache, commits[r.study], args.device), chosen))
    for r, code in zip(chosen, codes):
        print(f"{r.name}: {'done' if code == 0 else f'failed (exit {code}; see its log.txt)'}")
    return max(codes)


if __name__ == "__main__":
    sys.exit(main())
