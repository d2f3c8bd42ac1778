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
from dataclasses import dataclass
from pathlib import Path

from ...data.corruptions import CHAR_CORRUPTIONS, VALIDATION_IMAGE_CORRUPTIONS, WORD_CORRUPTIONS
from ..grid import ROW_FEATURES
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

__all__ = ["CHOICES", "REGISTRATIONS", "REPO", "check_chosen", "check_registered", "load_choice", "registration_path",
           "run_folder"]  # the registry's names, read here by the runs' users as before

SCORING = "before_update"
SELECTION_SEED = 0
REPORT_SEEDS = (3, 4, 5)
STREAM_SEEDS = (3, 4, 5, 11, 12)
DEGENERATE_BATCHES = 50
#: The safety layer with its degenerate-batch rule only (no drift rollback): the candidates' ``+safe``.
SAFE_LITE = '{"min_agreement": 0, "max_agreement_drop": 1}'
#: The shift gate of rounds 3-6: the two-sample statistic at threshold 4 (``--shift_gate``).
GATE_MEAN4 = ["--shift_gate", json.dumps({"statistic": "batch_mean", "threshold": 4.0})]


@dataclass(frozen=True)
class Run:
    """One ``hf-tta run`` of a study: its folder name (``<phase>-<direction>/<name>``), the study whose registration
    it needs, and its arguments."""

    name: str
    study: str
    args: tuple[str, ...]

    @property
    def split(self) -> str:
        return "selection" if self.name.startswith("sel-") else "report"


def split_arguments(split: str, direction: str, seeds=None, corruptions: bool = True, streams=("clean",),
                    default_grid: bool = False, severities: str = "5") -> list[str]:
    """``hf-tta run`` arguments of a v4 split in a direction: its concept part, seeds, corruption columns (the
    selection split's validation / character-level corruptions, image ones at ``severities``; the report's test /
    word-level ones, or the default grid) and streams (``clean``, ``noto``, ``diverse``, ``switch``, ``degenerate``)."""
    from ...data.corruptions import TEST_IMAGE_CORRUPTIONS

    selection = split == "selection"
    seeds = seeds or ((SELECTION_SEED,) if selection else REPORT_SEEDS)
    args = ["--direction", direction, "--concepts", split, "--seeds", ",".join(map(str, seeds)), "--scoring", SCORING]
    if direction == "i2t":
        if not corruptions:
            args += ["--corruptions", ""]
        elif default_grid:
            args += ["--corruptions", "default"]
        elif selection:
            args += ["--corruptions", ",".join(VALIDATION_IMAGE_CORRUPTIONS), "--severities", severities]
        else:
            args += ["--corruptions", ",".join(TEST_IMAGE_CORRUPTIONS), "--severities", "3,5"]
    else:
        names = (CHAR_CORRUPTIONS if selection else WORD_CORRUPTIONS) if corruptions else ()
        args += ["--text-corruptions", ",".join(names), "--text-severities", "7" if selection else "3,7"]
    args += ["--style" if "noto" in streams else "--no-style"]
    args += [f"--{s}" for s in ("clean", "diverse", "switch", "degenerate") if s in streams]
    if "degenerate" in streams:
        args += ["--degenerate-batches", str(DEGENERATE_BATCHES)]
    return args


def _objectives(*rows: str) -> list[str]:
    return ["--objectives", ",".join(rows)]


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


def fourth_round_runs() -> list[Run]:
    """``default-study-r4``: the incumbent and four candidates on the selection split with its Noto stream (a style
    shift), image queries; chosen by the registration's rule (clean, degenerate and Noto not below)."""
    study = "default-study-r4"
    sel = split_arguments("selection", "i2t", streams=("clean", "noto", "degenerate"))
    lite, gate = ["--safety", SAFE_LITE], GATE_MEAN4
    pull = ["--weight_ensemble", json.dumps({"momentum": 0.9})]
    return [
        Run("sel-i2t/r4-incumbent", study, (*sel, *lite, *gate, *_objectives("tcr+gate+safe@3e-2", "tcr+gate+safe@1e-2"))),
        Run("sel-i2t/r4-fullsafe", study, (*sel, "--safety", "{}", *gate, *_objectives("tcr+gate+safe@3e-2"))),
        Run("sel-i2t/r4-ens0.9", study, (*sel, *lite, *gate, *pull, *_objectives("tcr+gate+ens+safe@3e-2"))),
        Run("sel-i2t/r4-previous", study, (*sel, "--safety", "{}", *_objectives("rest+dn+safe@1e-3"))),
    ]


def fifth_round_runs() -> list[Run]:
    """``default-study-r5``: the gate with lower TCR lrs, the whole safety layer, DN, a stronger pull to the source and
    REST at its best labelled lr, on the fourth round's selection split (with Noto); its incumbent is the fourth
    round's choice, whose committed ``r4-previous`` rows it reads."""
    study = "default-study-r5"
    sel = split_arguments("selection", "i2t", streams=("clean", "noto", "degenerate"))
    lite, gate = ["--safety", SAFE_LITE], GATE_MEAN4
    pull = ["--weight_ensemble", json.dumps({"momentum": 0.9})]
    return [
        Run("sel-i2t/r5-gate-full", study, (*sel, "--safety", "{}", *gate, *_objectives(
            "tcr+gate+safe@3e-3", "tcr+gate+safe@1e-2", "rest+gate+dn+safe@3e-3"))),
        Run("sel-i2t/r5-gate-lite", study, (*sel, *lite, *gate, *_objectives("tcr+gate+safe@3e-3", "tcr+gate+dn+safe@1e-2"))),
        Run("sel-i2t/r5-gate-ens", study, (*sel, *lite, *gate, *pull, *_objectives("tcr+gate+ens+safe@1e-2"))),
    ]


def sixth_round_runs() -> list[Run]:
    """``default-study-r6``: source-anchored answers (:mod:`hf_tta.source_anchor`) behind the gate, at two margins and
    two TCR lrs, on the fourth round's selection split (with Noto); its incumbent is the fourth round's choice."""
    study = "default-study-r6"
    sel = split_arguments("selection", "i2t", streams=("clean", "noto", "degenerate"))
    lite, gate = ["--safety", SAFE_LITE], GATE_MEAN4
    anchor = lambda m: ["--source_anchor", json.dumps({"margin": m, "momentum": 0.8, "temperature": 0.01})]  # noqa: E731
    rows = _objectives("tcr+gate+anchor+safe@3e-2", "tcr+gate+anchor+safe@1e-2")
    return [Run(f"sel-i2t/r6-anchor{m}", study, (*sel, *lite, *gate, *anchor(m), *rows)) for m in (0.01, 0.02)]


#: default-study-r7's anchor settings: the sixth round's choice, with the weight of the adapted scores in the answer
#: while the evidence is at or below the margin (0: the source alone, the sixth round's choice re-run on this split)
def r7_anchor(weight: float) -> list[str]:
    return ["--source_anchor", json.dumps({"margin": 0.01, "momentum": 0.8, "temperature": 0.01, "ensemble_weight": weight})]


def seventh_round_runs() -> list[Run]:
    """``default-study-r7``: source-anchored answers that mix the source's and the adapted scores while the evidence is
    low (``ensemble_weight`` 0.3, 0.5) against the sixth round's choice (0), on the selection split with the diverse
    stream added (validation corruptions, batch by batch)."""
    sel = split_arguments("selection", "i2t", streams=("clean", "noto", "degenerate", "diverse"))
    lite = ["--safety", SAFE_LITE]
    rows = {0: ("tcr+gate+anchor+safe@3e-2",), 0.3: ("tcr+gate+anchor+safe@3e-2", "tcr+gate+anchor+safe@1e-2"),
            0.5: ("tcr+gate+anchor+safe@3e-2", "tcr+gate+anchor+safe@1e-2")}
    return [Run(f"sel-i2t/r7-w{w}", "default-study-r7", (*sel, *lite, *GATE_MEAN4, *r7_anchor(w), *_objectives(*r)))
            for w, r in rows.items()]


def r8_anchor(weight: float, confidence: float | None) -> list[str]:
    """default-study-r8's anchor settings: the seventh round's, with ``source_confidence`` (``None``: every query mixed,
    the seventh round's choice)."""
    fields = {"margin": 0.01, "momentum": 0.8, "temperature": 0.01, "ensemble_weight": weight}
    return ["--source_anchor", json.dumps(fields if confidence is None else {**fields, "source_confidence": confidence})]


#: default-study-r8's candidates: run name -> (ensemble_weight, source_confidence); the incumbent (the seventh round's
#: choice) first
R8_CANDIDATES = {"r8-incumbent": (0.3, None), "r8-w0.3-c0.7": (0.3, 0.7), "r8-w0.5-c0.7": (0.5, 0.7),
                 "r8-w0.5-c0.5": (0.5, 0.5)}


def eighth_round_runs() -> list[Run]:
    """``default-study-r8``: the mix with the queries the source is sure of keeping its scores (``source_confidence``),
    against the seventh round's choice, on the seventh round's selection split with the validation corruptions at
    severity 3 added (image queries, TCR at 3e-2, a run per candidate)."""
    sel = split_arguments("selection", "i2t", streams=("clean", "noto", "degenerate", "diverse"), severities="3,5")
    row = _objectives("tcr+gate+anchor+safe@3e-2")
    return [Run(f"sel-i2t/{name}", "default-study-r8", (*sel, "--safety", SAFE_LITE, *GATE_MEAN4, *r8_anchor(w, c), *row))
            for name, (w, c) in R8_CANDIDATES.items()]


def one_rule_runs() -> list[Run]:
    """``one-rule-text`` (issue 48's moonshot, descriptive): the eighth round's image default, settings unchanged, on
    caption queries (the text selection split with its clean and degenerate streams), and the same at text TCR's lr."""
    sel = split_arguments("selection", "t2i", streams=("clean", "degenerate"))
    return [Run("sel-t2i/one-rule", "one-rule-text", (*sel, "--safety", SAFE_LITE, *GATE_MEAN4, *r8_anchor(0.5, 0.7),
                                                      *_objectives("tcr+gate+anchor+safe@3e-2", "tcr+gate+anchor+safe@1e-3")))]


def selection_runs() -> list[Run]:
    """Every registered selection run, all rounds."""
    return (default_study_runs() + second_round_runs() + third_round_runs() + fourth_round_runs() + fifth_round_runs()
            + sixth_round_runs() + seventh_round_runs() + eighth_round_runs() + one_rule_runs())


#: default-study-r4's report seeds: new ones, since report rows were read before it was registered (its registration)
R4_HEADLINE_SEEDS, R4_STREAM_SEEDS = (6,), (13, 14)


def fourth_round_report_runs(choice: dict) -> list[Run]:
    """``default-study-r4``'s report runs, from its committed choice: the chosen row and the incumbent default
    (``recommended``) with TCR at 3e-2, on the 30-column headline of seed 6 and the default grid with the five streams
    of seeds 13 and 14 (image queries)."""
    c = choice.get("i2t")
    if not c or not c.get("config"):
        return []
    cfg, study = c["config"], "default-study-r4"
    row = c["default"].split("/", 1)[1]  # e.g. rest+dn+safe@1e-3
    if any(cfg.get(k) not in (None, {}) for k in ("safety", "shift_gate", "weight_ensemble")):
        # a run-level setting would reach every row of the run (the incumbent's too): give the chosen row a run of its own
        raise ValueError(f"default-study-r4 chose {c['default']} with run-level settings {cfg}: not supported yet.")
    rows = _objectives(row, "recommended", "tcr@3e-2")
    streams = ("clean", "noto", "diverse", "switch", "degenerate")
    runs = [Run(f"rep-i2t/r4-headline-s{seed}", study, (*split_arguments("report", "i2t", (seed,)), *rows))
            for seed in R4_HEADLINE_SEEDS]
    runs += [Run(f"rep-i2t/r4-streams-s{seed}", study, (*split_arguments("report", "i2t", (seed,), streams=streams,
                                                                         default_grid=True), *rows))
             for seed in R4_STREAM_SEEDS]
    return runs


#: default-study-r6's report seeds (registered by default-study-r5 for its report, which was never run)
R6_HEADLINE_SEEDS, R6_STREAM_SEEDS = (7,), (15, 16)
#: the report seed the main job (``hf-tta`` with no arguments) runs
MAIN_JOB_SEED = 3
#: registered runs that describe (what the main job prints) and that no choice reads: they need no choice of their own
DESCRIPTIVE = frozenset({"main-job-r6", "main-job-r7", "main-job-r8", "headline-paper-lr", "headline-paper-lr-text",
                         "one-rule-text"})


def sixth_round_report_runs(choice: dict) -> list[Run]:
    """``default-study-r6``'s report runs, from its committed choice: the chosen row with its run-level settings, TCR at
    3e-2 and the incumbent (``rest+dn+safe@1e-3``, the whole safety layer), each in a folder of its own, on the
    30-column headline of seed 7 and the default grid with the five streams of seeds 15 and 16 (image queries)."""
    c = choice.get("i2t")
    if not c or not c.get("config") or not c["default"].startswith("r6-"):
        return []
    members = {"chosen": _chosen(c), "tcr": _objectives("tcr@3e-2"),
               "previous": ["--safety", "{}", *_objectives("rest+dn+safe@1e-3")]}
    # with what the main job prints with this default (registrations/main-job-r6.json: descriptive, read by no choice)
    return _member_runs("r6", "default-study-r6", members, R6_HEADLINE_SEEDS, R6_STREAM_SEEDS, f"main-s{MAIN_JOB_SEED}",
                        "main-job-r6")


def _chosen(choice: dict) -> list[str]:
    """The chosen row of a committed image choice with its run-level settings (``--<field> <json>``)."""
    cfg = choice["config"]
    settings = [a for k in ROW_FEATURES.values() if cfg.get(k) is not None for a in (f"--{k}", json.dumps(cfg[k]))]
    return [*settings, *_objectives(choice["default"].split("/", 1)[1])]


def _member_runs(tag: str, study: str, members: dict, headline_seeds, stream_seeds, main_run: str, main_study: str) -> list[Run]:
    """A round's report runs, a folder per member (``rep-i2t/<tag>-headline-<member>-s<seed>`` on the 30-column
    headline, ``<tag>-streams-...`` on the default grid with the five streams) and the main job's run of the chosen
    member (``rep-i2t/<main_run>``: the report concepts, seed 3, the default grid and the clean stream)."""
    streams = ("clean", "noto", "diverse", "switch", "degenerate")
    runs = [Run(f"rep-i2t/{tag}-headline-{k}-s{seed}", study, (*split_arguments("report", "i2t", (seed,)), *a))
            for seed in headline_seeds for k, a in members.items()]
    runs += [Run(f"rep-i2t/{tag}-streams-{k}-s{seed}", study, (*split_arguments("report", "i2t", (seed,), streams=streams,
                                                                               default_grid=True), *a))
             for seed in stream_seeds for k, a in members.items()]
    main = split_arguments("report", "i2t", (MAIN_JOB_SEED,), streams=("clean",), default_grid=True)
    return runs + [Run(f"rep-i2t/{main_run}", main_study, (*main, *members["chosen"]))]


#: default-study-r7's report seeds: new ones (the sixth round's report rows were read before its registration)
R7_HEADLINE_SEEDS, R7_STREAM_SEEDS = (8,), (17, 18)


def seventh_round_report_runs(choice: dict) -> list[Run]:
    """``default-study-r7``'s report runs, from its committed choice, when it is not the incumbent (``r7-w0``): the
    chosen row with its run-level settings, TCR at 3e-2 and the incumbent (the sixth round's choice), each in a
    folder of its own, on seed 8's 30-column headline and seeds 17 and 18's default grid with the five streams; and
    the main job's run of the chosen default (main-job-r7)."""
    c = choice.get("i2t")
    if not c or not c.get("config") or not c["default"].startswith("r7-") or c["default"].startswith("r7-w0/"):
        return []
    members = {"chosen": _chosen(c), "tcr": _objectives("tcr@3e-2"),
               "previous": ["--safety", SAFE_LITE, *GATE_MEAN4, *r7_anchor(0), *_objectives("tcr+gate+anchor+safe@3e-2")]}
    return _member_runs("r7", "default-study-r7", members, R7_HEADLINE_SEEDS, R7_STREAM_SEEDS,
                        f"main-r7-s{MAIN_JOB_SEED}", "main-job-r7")


#: default-study-r8's report seeds: new ones (the seventh round's report rows were read before its registration)
R8_HEADLINE_SEEDS, R8_STREAM_SEEDS = (9,), (19, 20)


def eighth_round_report_runs(choice: dict) -> list[Run]:
    """``default-study-r8``'s report runs, from its committed choice, when it is not the incumbent (``r8-incumbent``):
    the chosen row with its run-level settings and TCR at 3e-2 on seed 9's 30-column headline and seeds 19 and 20's
    default grid with the five streams, the incumbent (the seventh round's choice) on those streams only (its headline
    cut for compute, registered so), each in a folder of its own; and the main job's run of the chosen default
    (main-job-r8)."""
    c = choice.get("i2t")
    if not c or not c.get("config") or not c["default"].startswith("r8-") or c["default"].startswith("r8-incumbent/"):
        return []
    previous = ["--safety", SAFE_LITE, *GATE_MEAN4, *r8_anchor(0.3, None), *_objectives("tcr+gate+anchor+safe@3e-2")]
    members = {"chosen": _chosen(c), "tcr": _objectives("tcr@3e-2"), "previous": previous}
    runs = _member_runs("r8", "default-study-r8", members, R8_HEADLINE_SEEDS, R8_STREAM_SEEDS,
                        f"main-r8-s{MAIN_JOB_SEED}", "main-job-r8")
    return [r for r in runs if r.name != f"rep-i2t/r8-headline-previous-s{R8_HEADLINE_SEEDS[0]}"]


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
    r7, r8 = load_choice("default-study-r7"), load_choice("default-study-r8")
    return (selection_runs() + (report_runs(choice) if choice else []) + (fourth_round_report_runs(r4) if r4 else [])
            + (sixth_round_report_runs(r6) if r6 else []) + (seventh_round_report_runs(r7) if r7 else [])
            + (eighth_round_report_runs(r8) if r8 else []) + paper_lr_runs() + ceiling_all_runs())


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
