"""Protocol v4's choices, made from selection rows only by the registered rules (``registrations/<study>.json``).

:func:`load` reads the rows of the run folders :mod:`.v4` writes (``<out>/<phase>-<direction>/<run>/rows.jsonl``), each
tagged with its run (``sel-i2t/gate1.5``) and labelled ``<run>/<row>`` (``gate1.5/tcr+gate+safe@1e-2``: the same row
name in two runs with other run-level settings is two candidates). :func:`choose_default` applies the default study's
rule (issue 48) and :func:`choose_lr` the comparators' rule; both refuse any row that is not on the selection split.

    python -m hf_tta.benchmarks.protocols.v4_choice runs/v4 --direction i2t
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..intervals import non_inferiority

SOURCE = "source"
STREAMS = ("clean", "noto", "diverse", "switch", "degenerate")
#: The registration's statistics (``registrations/default-study.json``): resamples, RNG seed, margin.
RESAMPLES = 4000
RNG_SEED = 20261128
MARGIN = 0.5
#: Candidates within this many share points of the best are tied (the registration's rule).
TIE = 1.0
#: Each registered choice: the selection runs it reads (their name prefixes; ``()``: every run that no later round
#: claims), the streams that must be not below, and the tie width in share points (``registrations/<study>.json``).
#: Rounds 5 and 6 read their own runs and the fourth round's choice, their incumbent; round 7 re-runs its incumbent.
ROUND_RULES = {"default-study": ((), ("clean", "degenerate"), TIE),
               "default-study-r4": (("r4-",), ("clean", "degenerate", "noto"), 0.5),
               "default-study-r5": (("r5-", "r4-previous"), ("clean", "degenerate", "noto"), 0.5),
               "default-study-r6": (("r6-", "r4-previous"), ("clean", "degenerate", "noto"), 0.5),
               "default-study-r7": (("r7-",), ("clean", "degenerate", "noto", "diverse"), 0.5),
               "default-study-r8": (("r8-",), ("clean", "degenerate", "noto", "diverse"), 0.5),
               "default-study-r9": (("r9-",), ("clean", "degenerate", "noto", "diverse"), 0.5),
               "default-study-r10": (("r10-",), STREAMS, 0.5),
               "default-study-r11": (("r11-",), STREAMS, 0.5),
               "default-study-r12": (("r12-",), STREAMS, 0.5),
               # descriptive (issue 48's moonshot): its table, under the first rounds' text rule, changes no default
               "one-rule-text": (("one-rule",), ("clean", "degenerate"), TIE),
               # descriptive: default-study-r10's candidates on the diverse stream its registration named
               "r10-diverse-check": (("r10check-",), ("clean", "diverse"), TIE),
               # descriptive (the moonshot again): the tenth round's image default on caption queries
               "one-rule-text-r10": (("moonshot-r10-",), ("clean", "degenerate"), TIE)}
#: Studies whose table describes and whose rows no choice reads (``python -m ...v4_choice`` refuses to choose for them).
DESCRIPTIVE_STUDIES = frozenset({"one-rule-text", "r10-diverse-check", "one-rule-text-r10"})
#: A round's stricter eligibility (``registrations/<study>.json``): the required streams' bound must exceed
#: ``-stream_margin`` (default-study-r8: -0.25, half the protocol's margin), and with ``columns`` every corruption column's
#: bound must exceed -0.5 too (the selection split's severity 3 and 5 columns).
RULE_OPTIONS = {"default-study-r8": {"stream_margin": 0.25, "columns": True},
                "default-study-r9": {"stream_margin": 0.25, "columns": True},
                "default-study-r10": {"stream_margin": 0.25, "columns": True},
                # the safest within 97 % of the incumbent's share: the fewest answers lost to the source
                "default-study-r11": {"stream_margin": 0.25, "columns": True, "fewest_lost": ("r11-incumbent/", 0.97)},
                "default-study-r12": {"stream_margin": 0.25, "columns": True, "fewest_lost": ("r12-incumbent/", 0.97)},
                "r10-diverse-check": {"stream_margin": 0.25}}


def in_study(study: str, run: str) -> bool:
    """Whether the selection run ``run`` (``sel-i2t/r4-previous``) is read by ``study``'s registered choice."""
    own = ROUND_RULES[study][0]
    later = tuple(p for rule in ROUND_RULES.values() for p in rule[0])
    name = run.split("/")[1]
    return name.startswith(own) if own else not name.startswith(later)


def load(out: Path) -> list[dict]:
    """Every finished row under ``out/<phase>-<direction>/<run>/rows.jsonl``, with ``run`` (``sel-i2t/gate1.5``),
    ``label`` (``gate1.5/<row>``), ``split`` and ``concepts`` added."""
    rows = []
    for path in sorted(Path(out).glob("*/*/rows.jsonl")):
        run = f"{path.parts[-3]}/{path.parts[-2]}"
        lines = path.read_text().splitlines()
        head = json.loads(lines[0]).get("hf-tta-run", {}) if lines else {}
        for line in lines[1:]:
            row = json.loads(line)
            if "error" in row:
                continue
            rows.append({**row, "run": run, "label": f"{path.parts[-2]}/{row['objective']}", "concepts": head.get("concepts"),
                         "split": "selection" if run.startswith("sel-") else "report"})
    return rows


def hits(row: dict) -> np.ndarray:
    return np.frombuffer(row["hits"].encode("ascii"), dtype=np.uint8).astype(np.int8) - ord("0")


def column(row: dict) -> tuple:
    return (row["shift"], row.get("severity"))


@dataclass(frozen=True)
class Summary:
    """A candidate on the selection split: its pooled share over the corruption columns, and each stream's mean
    difference to the source and one-sided 95 % lower bound."""

    label: str
    share: float
    streams: dict
    passes: float | None
    #: each corruption column's (mean difference, one-sided 95 % lower bound) against the source, keyed by its name
    columns: dict = field(default_factory=dict)
    #: the answers the source has right and the candidate wrong, summed over its corruption columns and streams
    lost: int = 0

    def not_below(self, stream: str, margin: float = MARGIN) -> bool:
        return self.streams[stream][1] > -margin

    def eligible(self, required: tuple[str, ...], stream_margin: float = MARGIN, columns: bool = False) -> bool:
        """Every ``required`` stream's bound above ``-stream_margin`` and, with ``columns``, every corruption
        column's above the protocol's ``-MARGIN``."""
        return (all(self.not_below(st, stream_margin) for st in required)
                and (not columns or all(b > -MARGIN for _, b in self.columns.values())))

    @property
    def safety(self) -> float:
        """The smallest lower bound over the clean and degenerate streams (the tie-break: higher is safer)."""
        return self.safety_over(("clean", "degenerate"))

    def safety_over(self, streams: tuple[str, ...]) -> float:
        """The smallest lower bound over ``streams`` (those it has)."""
        return min(self.streams[s][1] for s in streams if s in self.streams)


def _by_label(rows: list[dict], direction: str) -> tuple[dict, dict]:
    bad = [r for r in rows if r["split"] != "selection" or r.get("concepts") != "selection" or r["seed"] != 0]
    if bad:
        r = bad[0]
        raise ValueError(f"{len(bad)} rows are not selection rows (first: {r['label']} {column(r)} seed {r['seed']}); "
                         "a choice reads the selection split only.")
    rows = [r for r in rows if r["direction"] == direction]
    sources, labelled = {}, defaultdict(dict)
    for r in rows:
        if r["objective"] == SOURCE:
            held = sources.setdefault(column(r), r)
            if held["hits"] != r["hits"]:
                raise ValueError(f"two source rows of {column(r)} differ in their hits.")
        else:
            labelled[r["label"]][column(r)] = r
    return sources, labelled


def summarise(rows: list[dict], direction: str) -> list[Summary]:
    """Every labelled row of ``direction`` on the selection split: pooled share over the corruption columns it holds,
    and each stream's (mean difference, one-sided 95 % lower bound) against the source, in R@1 points."""
    sources, labelled = _by_label(rows, direction)
    clean = hits(sources[("clean", None)]).mean()
    out = []
    for label, cols in labelled.items():
        corr = [c for c in cols if c[0] not in STREAMS]
        lost = sum(clean - hits(sources[c]).mean() for c in corr)
        won = sum(hits(cols[c]).mean() - hits(sources[c]).mean() for c in corr)
        streams, columns, lost_answers = {}, {}, 0
        for c in cols:
            # the degenerate stream's hits are its clean part: the same items as the clean column's source row
            ref = sources.get(c) or sources[("clean", None)]
            diff = (hits(cols[c]) - hits(ref)).astype(np.float64)[None, :]
            lost_answers += int((diff < 0).sum())
            ni = non_inferiority([diff], margin=MARGIN, samples=RESAMPLES, seed=RNG_SEED)
            if c[0] in STREAMS:
                streams[c[0]] = (float(100 * diff.mean()), float(ni.lower))
            else:
                columns[f"{c[0]} {c[1]}"] = (float(100 * diff.mean()), float(ni.lower))
        counted = [r["forward_per_query"] + r["backward_per_query"] for r in cols.values()
                   if r.get("forward_per_query") is not None and r.get("backward_per_query") is not None]
        passes = float(np.mean(counted)) if counted else None  # forward + backward passes per query, over its columns
        out.append(Summary(label, float(won / lost) if lost > 0 else float("nan"), streams, passes, columns, lost_answers))
    return out


def choose_default(summaries: list[Summary], required: tuple[str, ...] = ("clean", "degenerate"),
                   tie: float = TIE, stream_margin: float = MARGIN, columns: bool = False,
                   fewest_lost: tuple[str, float] | None = None) -> tuple[Summary | None, list[str]]:
    """The registered rule: eligible = every ``required`` stream *not below* (default-study: clean and degenerate;
    default-study-r4: and Noto; default-study-r8: with its bound above ``-stream_margin`` and, with ``columns``, every
    corruption column not below); the highest pooled share; ties (within ``tie`` share points, in %: 1.0 for
    default-study, 0.5 for -r4) to the safer (higher smallest bound over the required streams), then fewer passes,
    then the first listed. With ``fewest_lost`` ``(incumbent label prefix, f)`` (default-study-r11) an eligible
    candidate must also keep at least ``f`` of the incumbent's share, and the fewest lost answers
    (:attr:`Summary.lost`) wins; equal counts go to the higher share, then the safer, then fewer passes, then the first
    listed. ``(None, why)`` when none is eligible (the current default stays)."""
    notes = []
    eligible = []
    for s in summaries:
        missing = [st for st in required if st not in s.streams]
        if missing:
            notes.append(f"{s.label}: no {' or '.join(missing)} stream (not a candidate)")
        elif not s.eligible(required, stream_margin, columns):
            worst = [f"worst column {k} bound {b:+.2f}" for k, (_, b) in sorted(s.columns.items(), key=lambda kv: kv[1][1])[:1]
                     if columns]
            notes.append(f"{s.label}: not eligible (" + ", ".join([f"{st} bound {s.streams[st][1]:+.2f}" for st in required]
                                                                  + worst) + ")")
        else:
            eligible.append(s)
    if fewest_lost is not None:
        floor = share_floor(summaries, fewest_lost)
        notes += [f"{s.label}: not eligible (share {100 * s.share:.1f} % < {100 * floor:.1f} %, {fewest_lost[1]:g} of "
                  "the incumbent's)" for s in eligible if s.share < floor]
        eligible = [s for s in eligible if s.share >= floor]
        eligible.sort(key=lambda s: (s.lost, -s.share, -s.safety_over(required),
                                     s.passes if s.passes is not None else float("inf")))
        return (eligible[0] if eligible else None), notes
    if not eligible:
        return None, notes
    best = max(100 * s.share for s in eligible)
    tied = [s for s in eligible if 100 * s.share >= best - tie]
    tied.sort(key=lambda s: (-s.safety_over(required), s.passes if s.passes is not None else float("inf")))
    return tied[0], notes


def in_listed_order(summaries: list[Summary], direction: str) -> list[Summary]:
    """``summaries`` in the order their runs are registered (:func:`.v4.selection_runs`, each round's runs in its
    registration's order, the incumbent first), which the rules' last tie-break reads ("then the first listed"); rows
    of runs it does not list keep their order, after those it lists. (Rows load in folder order, which is not the
    registration's: ``r11-aa0.9`` sorts before ``r11-incumbent``.)"""
    from .v4 import selection_runs

    order = {run.name: i for i, run in enumerate(selection_runs())}
    return sorted(summaries, key=lambda s: order.get(f"sel-{direction}/{s.label.split('/', 1)[0]}", len(order)))


def share_floor(summaries: list[Summary], fewest_lost: tuple[str, float]) -> float:
    """The least share an eligible candidate keeps under a ``fewest_lost`` rule ``(incumbent label prefix, f)``:
    ``f`` times the incumbent's share (default-study-r11)."""
    prefix, fraction = fewest_lost
    incumbent = [s for s in summaries if s.label.startswith(prefix)]
    if len(incumbent) != 1:
        raise ValueError(f"the rule needs one incumbent row ({prefix}...); found {len(incumbent)}.")
    return fraction * incumbent[0].share


def choose_lr(summaries: list[Summary], objective: str) -> Summary:
    """The comparators' rule: among the ``comparators/<objective>@<lr>`` rows, the highest pooled share; ties (within
    :data:`TIE` points) to the smaller lr."""
    rows = [s for s in summaries if s.label.startswith(f"comparators/{objective}@")]
    if not rows:
        raise ValueError(f"no comparators/{objective}@<lr> rows.")
    best = max(100 * s.share for s in rows)
    return min((s for s in rows if 100 * s.share >= best - TIE), key=lambda s: float(s.label.rsplit("@", 1)[1]))


def config_of(label: str, direction: str) -> dict:
    """The :class:`~hf_tta.TTAConfig` fields a selection row ran with (``<run>/<row>``): its row name's objective, lr,
    score transform and switches, with its run's ``--safety`` / ``--shift_gate`` / ``--weight_ensemble`` /
    ``--source_anchor`` settings."""
    from ..grid import ROW_FEATURES, row_spec
    from .v4 import selection_runs

    run_name, _, row = label.partition("/")
    run = next((r for r in selection_runs() if r.name == f"sel-{direction}/{run_name}"), None)
    if run is None:
        raise ValueError(f"{label}: no registered run sel-{direction}/{run_name}.")
    args = list(run.args)
    setting = lambda flag: json.loads(args[args.index(flag) + 1]) if flag in args else {}  # noqa: E731
    spec = row_spec(row, "image" if direction == "i2t" else "text")
    fields = {"objective": spec.objective, "lr": spec.lr}
    if spec.score_transform:
        fields["score_transform"] = spec.score_transform
    for switch, name in ROW_FEATURES.items():
        if getattr(spec, switch):
            fields[name] = setting(f"--{name}")
    return fields


def table(summaries: list[Summary]) -> str:
    """The selection table (share and each stream's Δ [bound]); figures rounded once, here."""
    from ..figures import figure

    streams = [s for s in STREAMS if any(s in x.streams for x in summaries)]
    head = "| candidate | share | " + " | ".join(f"{s} Δ [bound]" for s in streams) + " |"
    lines = [head, "|---|---:|" + "---:|" * len(streams)]
    for s in sorted(summaries, key=lambda x: -x.share):
        cells = [f"{figure(s.streams[st][0], sign=True)} [{figure(s.streams[st][1], sign=True)}]" if st in s.streams else "–"
                 for st in streams]
        lines.append(f"| {s.label} | {figure(s.share, percent=True)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m hf_tta.benchmarks.protocols.v4_choice")
    p.add_argument("out", help="the runs' folder (hf_tta.benchmarks.protocols.v4 run --out)")
    p.add_argument("--direction", default="i2t")
    p.add_argument("--write", default=None, help="add this direction's choice to a choices/<study>.json file")
    p.add_argument("--previous-preset", default=None, help="the preset row the choice replaces (recorded)")
    p.add_argument("--study", default="default-study", choices=tuple(ROUND_RULES),
                   help="whose registered rule: default-study (rounds 1-3 together), default-study-r4, ..., -r8")
    args = p.parse_args(argv)
    rows = [r for r in load(Path(args.out)) if r["split"] == "selection"]
    if args.study in DESCRIPTIVE_STUDIES:
        print(f"v4_choice: {args.study} is descriptive: no choice is made from its rows (print its table with "
              "hf_tta.benchmarks.protocols.v4_tables).", file=sys.stderr)
        return 2
    _, required, tie = ROUND_RULES[args.study]
    rows = [r for r in rows if in_study(args.study, r["run"])]
    summaries = in_listed_order(summarise(rows, args.direction), args.direction)
    print(table(summaries))
    options = RULE_OPTIONS.get(args.study, {})
    chosen, notes = choose_default([s for s in summaries if not s.label.startswith("comparators/")], required, tie,
                                   **options)
    if "fewest_lost" in options:
        for s in summaries:
            print(f"- {s.label}: {s.lost} answers lost to the source over its columns and streams")
    for n in notes:
        print("-", n)
    print("chosen default:", chosen.label if chosen else "none eligible (the current preset stays)")
    best = {}
    for objective in ("tcr", "rest"):
        try:
            best[objective] = choose_lr(summaries, objective).label.rsplit("@", 1)[1]
            print(f"best labelled {objective}: {objective}@{best[objective]}")
        except ValueError:
            pass
    if args.write:
        path = Path(args.write)
        data = json.loads(path.read_text()) if path.is_file() else {"study": args.study}
        data[args.direction] = {
            "default": chosen.label if chosen else None,
            "config": config_of(chosen.label, args.direction) if chosen else None,
            "share": chosen.share if chosen else None, **best, "previous_preset": args.previous_preset,
            **({"lost": {s.label: s.lost for s in summaries}} if "fewest_lost" in options else {}),
            "notes": notes,
        }
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(data, indent=2) + "\n")
        print("wrote", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
