"""Protocol v4's later rounds of the default study (issue 48, ``default-study-r4`` to ``-r12``) and the moonshot's
descriptive run: their selection runs and, from each round's committed choice, its report runs on its own new seeds
(:mod:`.v4` lists and runs them)."""

from __future__ import annotations

import json

from ..grid import ROW_FEATURES
from .v4_base import GATE_MEAN4, SAFE_LITE, Run, _objectives, split_arguments


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
    anchor = lambda m: ["--source_anchor", json.dumps({"margin": m, "momentum": 0.8, "temperature": 0.01})]  # noqa: E731
    rows = ("tcr+gate+anchor+safe@3e-2", "tcr+gate+anchor+safe@1e-2")
    return [Run(f"sel-i2t/r6-anchor{m}", study, (*sel, *_anchored(anchor(m), *rows))) for m in (0.01, 0.02)]


#: default-study-r7's anchor settings: the sixth round's choice, with the weight of the adapted scores in the answer
#: while the evidence is at or below the margin (0: the source alone, the sixth round's choice re-run on this split)
def r7_anchor(weight: float) -> list[str]:
    return ["--source_anchor", json.dumps({"margin": 0.01, "momentum": 0.8, "temperature": 0.01, "ensemble_weight": weight})]


def seventh_round_runs() -> list[Run]:
    """``default-study-r7``: source-anchored answers that mix the source's and the adapted scores while the evidence is
    low (``ensemble_weight`` 0.3, 0.5) against the sixth round's choice (0), on the selection split with the diverse
    stream added (registered as the validation corruptions; it draws each query's from COCO-C's 16: the results card's
    tenth round)."""
    sel = split_arguments("selection", "i2t", streams=("clean", "noto", "degenerate", "diverse"))
    rows = {0: ("tcr+gate+anchor+safe@3e-2",), 0.3: ("tcr+gate+anchor+safe@3e-2", "tcr+gate+anchor+safe@1e-2"),
            0.5: ("tcr+gate+anchor+safe@3e-2", "tcr+gate+anchor+safe@1e-2")}
    return [Run(f"sel-i2t/r7-w{w}", "default-study-r7", (*sel, *_anchored(r7_anchor(w), *r))) for w, r in rows.items()]


def r8_anchor(weight: float, confidence: float | None) -> list[str]:
    """default-study-r8's anchor settings: the seventh round's, with ``source_confidence`` (``None``: every query mixed,
    the seventh round's choice)."""
    return r9_anchor(weight, confidence, None)


#: default-study-r8's candidates: run name -> (ensemble_weight, source_confidence); the incumbent (the seventh round's
#: choice) first
R8_CANDIDATES = {"r8-incumbent": (0.3, None), "r8-w0.3-c0.7": (0.3, 0.7), "r8-w0.5-c0.7": (0.5, 0.7),
                 "r8-w0.5-c0.5": (0.5, 0.5)}


def eighth_round_runs() -> list[Run]:
    """``default-study-r8``: the mix with the queries the source is sure of keeping its scores (``source_confidence``),
    against the seventh round's choice, on the seventh round's selection split with the validation corruptions at
    severity 3 added (image queries, TCR at 3e-2, a run per candidate)."""
    return _anchor_candidate_runs("default-study-r8", {k: (*c, None) for k, c in R8_CANDIDATES.items()}, "3,5")


def _anchored(anchor: list[str], *rows: str) -> list[str]:
    """A later round's run-level settings, the same in every anchored run: the degenerate-batch rule, the gate at
    threshold 4, ``anchor`` (its ``--source_anchor``), and its rows (default: the anchored TCR at 3e-2)."""
    return ["--safety", SAFE_LITE, *GATE_MEAN4, *anchor, *_objectives(*(rows or ("tcr+gate+anchor+safe@3e-2",)))]


def _anchor_candidate_runs(study: str, candidates: dict, severities: str, switch: bool = False) -> list[Run]:
    """A later round's selection runs: per candidate (run name -> anchor settings) the anchored TCR at 3e-2 behind the
    gate on the selection split with Noto, degenerate and diverse streams, the validation corruptions at ``severities``
    (``switch``: and the switching stream, both it and the diverse stream drawn from the validation corruptions)."""
    streams = ("clean", "noto", "degenerate", "diverse", *(("switch",) if switch else ()))
    sel = split_arguments("selection", "i2t", streams=streams, severities=severities, validation_streams=switch)
    return [Run(f"sel-i2t/{name}", study, (*sel, *_anchored(r9_anchor(*c)))) for name, c in candidates.items()]


def one_rule_runs() -> list[Run]:
    """``one-rule-text`` (issue 48's moonshot, descriptive): the eighth round's image default, settings unchanged, on
    caption queries (the text selection split with its clean and degenerate streams), and the same at text TCR's lr."""
    sel = split_arguments("selection", "t2i", streams=("clean", "degenerate"))
    return [Run("sel-t2i/one-rule", "one-rule-text",
                (*sel, *_anchored(r8_anchor(0.5, 0.7), "tcr+gate+anchor+safe@3e-2", "tcr+gate+anchor+safe@1e-3")))]


def one_rule_r10_runs() -> list[Run]:
    """``one-rule-text-r10`` (issue 48's moonshot, descriptive): as ``one-rule-text`` with the tenth round's image
    default (today's ``TTAConfig.recommended("image")``), settings unchanged, a run per lr (3e-2 and text TCR's 1e-3)."""
    sel = split_arguments("selection", "t2i", streams=("clean", "degenerate"))
    return [Run(f"sel-t2i/moonshot-r10-{lr}", "one-rule-text-r10",
                (*sel, *_anchored(r9_anchor(0.5, 0.7, [0.3, 0.9]), f"tcr+gate+anchor+safe@{lr}"))) for lr in ("3e-2", "1e-3")]


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
    runs = _headline_runs(tag, study, members, headline_seeds) + _streams_runs(tag, study, members, stream_seeds)
    main = split_arguments("report", "i2t", (MAIN_JOB_SEED,), streams=("clean",), default_grid=True)
    return runs + [Run(f"rep-i2t/{main_run}", main_study, (*main, *members["chosen"]))]


def _headline_runs(tag: str, study: str, members: dict, seeds) -> list[Run]:
    """A folder per member and seed on the 30-column headline: ``rep-i2t/<tag>-headline-<member>-s<seed>``."""
    return [Run(f"rep-i2t/{tag}-headline-{k}-s{seed}", study, (*split_arguments("report", "i2t", (seed,)), *a))
            for seed in seeds for k, a in members.items()]


def _streams_runs(tag: str, study: str, members: dict, seeds) -> list[Run]:
    """A folder per member and seed on the default grid with the five streams: ``rep-i2t/<tag>-streams-<member>-s<seed>``."""
    streams = ("clean", "noto", "diverse", "switch", "degenerate")
    return [Run(f"rep-i2t/{tag}-streams-{k}-s{seed}", study,
                (*split_arguments("report", "i2t", (seed,), streams=streams, default_grid=True), *a))
            for seed in seeds for k, a in members.items()]


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
               "previous": _anchored(r7_anchor(0))}
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
    return _anchor_report_runs(8, choice, r8_anchor(0.3, None), R8_HEADLINE_SEEDS, R8_STREAM_SEEDS)


def _anchor_report_runs(k: int, choice: dict, incumbent: list[str], headline_seeds, stream_seeds) -> list[Run]:
    """Round ``k``'s report runs (rounds 8 to 10), when its committed choice is not its incumbent: the chosen row and
    TCR at 3e-2 on the headline, those and the incumbent (its ``--source_anchor`` settings) on the streams, the main
    job's run (main-job-r<k>)."""
    c = choice.get("i2t")
    if not c or not c.get("config") or not c["default"].startswith(f"r{k}-") or c["default"].startswith(f"r{k}-incumbent/"):
        return []
    members = {"chosen": _chosen(c), "tcr": _objectives("tcr@3e-2"), "previous": _anchored(incumbent)}
    runs = _member_runs(f"r{k}", f"default-study-r{k}", members, headline_seeds, stream_seeds,
                        f"main-r{k}-s{MAIN_JOB_SEED}", f"main-job-r{k}")
    return [r for r in runs if not r.name.startswith(f"rep-i2t/r{k}-headline-previous-")]


def r9_anchor(weight: float, confidence: float | None, band: list[float] | None, extra: dict | None = None) -> list[str]:
    """default-study-r9's anchor settings: the eighth round's, with ``mix_agreement`` (``None``: every held batch
    mixed, the eighth round's choice); ``extra``: later rounds' fields (default-study-r11's)."""
    fields = {"margin": 0.01, "momentum": 0.8, "temperature": 0.01, "ensemble_weight": weight}
    fields.update({k: v for k, v in (("source_confidence", confidence), ("mix_agreement", band)) if v is not None})
    return ["--source_anchor", json.dumps({**fields, **(extra or {})})]


#: default-study-r9's candidates: run name -> (ensemble_weight, source_confidence, mix_agreement); the incumbent (the
#: eighth round's choice) first
R9_CANDIDATES = {"r9-incumbent": (0.5, 0.7, None), "r9-w0.5-a0.3-0.9": (0.5, None, [0.3, 0.9]),
                 "r9-w0.3-a0.3-0.9": (0.3, None, [0.3, 0.9]), "r9-w0.5-a0.3-0.95": (0.5, None, [0.3, 0.95])}


def ninth_round_runs() -> list[Run]:
    """``default-study-r9``: the mix only on batches whose top-1 agreement between the two models lies in a band,
    against the eighth round's choice, on the eighth round's selection split with the validation corruptions at
    severities 1 and 2 added (image queries, TCR at 3e-2, a run per candidate)."""
    return _anchor_candidate_runs("default-study-r9", R9_CANDIDATES, "1,2,3,5")


#: default-study-r9's report seeds: new ones (the eighth round's report rows were read before its registration)
R9_HEADLINE_SEEDS, R9_STREAM_SEEDS = (10,), (21, 22)


def ninth_round_report_runs(choice: dict) -> list[Run]:
    """``default-study-r9``'s report runs, from its committed choice, when it is not the incumbent: as the eighth
    round's (the chosen row and TCR at 3e-2 on seed 10's headline; those and the incumbent on seeds 21 and 22's streams;
    the main job's run, main-job-r9)."""
    return _anchor_report_runs(9, choice, r9_anchor(0.5, 0.7, None), R9_HEADLINE_SEEDS, R9_STREAM_SEEDS)


#: default-study-r10's candidates: run name -> (ensemble_weight, source_confidence, mix_agreement); the incumbent (the
#: ninth round's choice) first
R10_CANDIDATES = {"r10-incumbent": (0.5, None, [0.3, 0.9]), "r10-w0.5-c0.7-a0.3-0.9": (0.5, 0.7, [0.3, 0.9]),
                  "r10-w0.5-c0.5-a0.3-0.9": (0.5, 0.5, [0.3, 0.9]), "r10-w0.3-c0.7-a0.3-0.9": (0.3, 0.7, [0.3, 0.9])}


def tenth_round_runs() -> list[Run]:
    """``default-study-r10``: the ninth round's band with the queries the source is sure of keeping its scores
    (``source_confidence``), against the ninth round's choice, on the ninth round's selection split with a switching
    stream added and the diverse and switching streams drawn from the validation corruptions only."""
    return _anchor_candidate_runs("default-study-r10", R10_CANDIDATES, "1,2,3,5", switch=True)


def r10_diverse_check_runs() -> list[Run]:
    """``r10-diverse-check`` (descriptive): default-study-r10's four candidates on the selection split's clean stream
    and the diverse stream its registration named (drawn from the validation corruptions), which its selection runs did
    not read (a stale stream-cache file of that name held the COCO-C-16 stream; the results card's tenth round)."""
    sel = split_arguments("selection", "i2t", corruptions=False, streams=("clean", "diverse"), validation_streams=True)
    return [Run(f"sel-i2t/r10check-{name.removeprefix('r10-')}", "r10-diverse-check", (*sel, *_anchored(r9_anchor(*c))))
            for name, c in R10_CANDIDATES.items()]


#: default-study-r10's report seeds: new ones (the ninth round's report rows were read before its registration); two
#: headline seeds, so that a column's interval pools 2,550 queries
R10_HEADLINE_SEEDS, R10_STREAM_SEEDS = (23, 24), (25, 26)


def tenth_round_report_runs(choice: dict) -> list[Run]:
    """``default-study-r10``'s report runs, from its committed choice, when it is not the incumbent: the chosen row and
    TCR at 3e-2 on seeds 23 and 24's headline; those and the incumbent (the ninth round's choice) on seeds 25 and 26's
    streams; the main job's run (main-job-r10)."""
    return _anchor_report_runs(10, choice, r9_anchor(0.5, None, [0.3, 0.9]), R10_HEADLINE_SEEDS, R10_STREAM_SEEDS)


#: default-study-r11's candidates: run name -> (ensemble_weight, source_confidence, mix_agreement, the new fields); the
#: incumbent (the tenth round's choice) first
R11_CANDIDATES = {"r11-incumbent": (0.5, 0.7, [0.3, 0.9], None),
                  "r11-aa0.9": (0.5, 0.7, [0.3, 0.9], {"adapted_agreement": 0.9}),
                  "r11-all": (0.5, 0.7, [0.3, 0.9], {"source_confidence_scope": "all"}),
                  "r11-aa0.9-all": (0.5, 0.7, [0.3, 0.9], {"source_confidence_scope": "all", "adapted_agreement": 0.9})}


def eleventh_round_runs() -> list[Run]:
    """``default-study-r11``: the tenth round's choice with the batches the adapted model answers alone handed back to
    the source when the two models agree on more than 90 % of the top-1 items (``adapted_agreement``), the queries the
    source is sure of keeping its scores there too (``source_confidence_scope="all"``), and both, on the tenth
    round's selection split."""
    return _anchor_candidate_runs("default-study-r11", R11_CANDIDATES, "1,2,3,5", switch=True)


#: default-study-r11's report seeds: new ones (the tenth round's report rows were read before its registration)
R11_HEADLINE_SEEDS, R11_STREAM_SEEDS = (27, 28), (29, 30)


def eleventh_round_report_runs(choice: dict) -> list[Run]:
    """``default-study-r11``'s report runs, from its committed choice, when it is not the incumbent: the chosen row and
    TCR at 3e-2 on seeds 27 and 28's headline; those and the incumbent (the tenth round's choice) on seeds 29 and 30's
    streams; the main job's run (main-job-r11)."""
    return _anchor_report_runs(11, choice, r9_anchor(*R11_CANDIDATES["r11-incumbent"]), R11_HEADLINE_SEEDS,
                               R11_STREAM_SEEDS)


#: default-study-r12's candidates: run name -> (ensemble_weight, source_confidence, mix_agreement, the new fields); the
#: incumbent (the tenth round's choice, kept by the eleventh) first
R12_CANDIDATES = {"r12-incumbent": R11_CANDIDATES["r11-incumbent"],
                  "r12-a0.3-0.85": (0.5, 0.7, [0.3, 0.85], None),
                  "r12-a0.3-0.8": (0.5, 0.7, [0.3, 0.8], None),
                  "r12-aa0.8": (0.5, 0.7, [0.3, 0.9], {"adapted_agreement": 0.8})}


def twelfth_round_runs() -> list[Run]:
    """``default-study-r12``: the tenth round's choice with a lower top of the mix's agreement band (0.85, 0.8: a held
    batch on which the two models share more of the top-1 items is answered by the source) or the batches the adapted
    model answers alone handed back to the source above an agreement of 0.8, on the tenth round's selection split."""
    return _anchor_candidate_runs("default-study-r12", R12_CANDIDATES, "1,2,3,5", switch=True)


def twelfth_round_report_runs(choice: dict) -> list[Run]:
    """``default-study-r12``'s report runs, from its committed choice, when it is not the incumbent: on the seeds the
    eleventh round registered and never ran (its incumbent stayed): the chosen row and TCR at 3e-2 on seeds 27 and 28's
    headline; those and the incumbent on seeds 29 and 30's streams; the main job's run (main-job-r12)."""
    return _anchor_report_runs(12, choice, r9_anchor(*R12_CANDIDATES["r12-incumbent"]), R11_HEADLINE_SEEDS,
                               R11_STREAM_SEEDS)


#: r10-headline-more's seeds, and r10-streams-more's: new ones (no row exists on them)
R10_MORE_SEEDS, R10_MORE_STREAM_SEEDS = (31, 32, 33), (34, 35)


def _current_and_tcr(choice: dict) -> dict:
    """The current default (default-study-r10's committed choice, unchanged) and TCR at 3e-2, as report members."""
    c = choice.get("i2t") if choice else None
    return {"chosen": _chosen(c), "tcr": _objectives("tcr@3e-2")} if c and c.get("config") else {}


def r10_headline_more_runs(choice: dict) -> list[Run]:
    """``r10-headline-more`` (descriptive): the current default and TCR at 3e-2 on three new seeds' 30-column headline,
    a folder each (each column pools 3,825 queries), so that the mild columns' verdicts have the sample the tenth
    round's two seeds lacked."""
    return _headline_runs("r10more", "r10-headline-more", _current_and_tcr(choice), R10_MORE_SEEDS)


def r10_streams_more_runs(choice: dict) -> list[Run]:
    """``r10-streams-more`` (descriptive): the current default and TCR at 3e-2 on the default grid with the five streams
    of two new seeds, a folder each, as the tenth round's streams."""
    return _streams_runs("r10more", "r10-streams-more", _current_and_tcr(choice), R10_MORE_STREAM_SEEDS)
