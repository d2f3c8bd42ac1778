#!/usr/bin/env python
"""Protocol v3's runs: every objective's learning rate chosen on the selection split, then the report on fresh seeds.

The splits are :mod:`hf_tta.benchmarks.protocols.v3_splits` (declared before any run); every row is prequential
(``--scoring before_update``). Every run is an ``hf-tta run`` into its own folder (so its rows carry per-query hits
and an interrupted run resumes from its ``rows.jsonl``); this script names the runs, shards them (``--shard k/n``
takes every n-th run from the k-th: several machines or sessions split one phase) and runs ``--jobs`` of them at a
time, one thread each. :mod:`hf_tta.benchmarks.protocols.v3_summary` makes every choice and table from the rows alone.

Phases (each reads the choices of the earlier ones from the rows):

1. ``select``: every objective (:data:`OBJECTIVES`) at every lr of its direction's grid (:data:`LR_GRID`) on the
   selection split's corruption streams and its clean stream (seed 0, the 500-concept slice).
2. ``degenerate``: the selection split's degenerate stream (:data:`DEGENERATE_BATCHES` constant batches, then the
   clean slice) at the lrs the choice rule walks (``v3_summary.DEGENERATE_WALK`` best clean-passing lrs by
   share, methods only: the ceilings are supervised and not deployable).
3. ``extend``: one more lr beyond the grid's edge for every objective whose best lr sits at the edge.
4. ``preset``: the preset's candidates on the selection split (TCR and REST at their selected lrs with DN and the
   safety layer, default and without its drift rule), every stream of the split.
5. ``report``: the report split on the default grid (seeds 3, 4, 5: source, Tent, TCR and REST at the paper's lr and
   at their selected lrs, the preset and both ceilings; every other objective at both lrs on seed 3), then the report
   split's streams for the preset and TCR/REST at their selected lrs.
6. ``corruptions``: the report split's 15 ImageNet-C test corruptions at severities 3 and 5, seed 3, for TCR and
   REST at their selected lrs, the preset and the LayerNorm ceiling (each run holds its own source rows).
7. ``after``: the papers' after-update scoring (``--scoring after_update``: a batch is answered after the updates on
   it), the secondary column, for Tent, TCR and REST at their selected lrs on the default grid, seed 3.
8. ``auto``: issue 37's label-free lr selectors (:data:`SELECTORS`: the probe, ``TTAConfig(lr="auto")``, and the
   online hypergradient rule, the back-off under the safety layer; :class:`hf_tta.lr_search.LRSearchConfig`) for TCR and REST on the selection split (its
   corruption and clean streams, then its degenerate stream): each row records the lr in use at the end (and the
   probe's choice, and the lr each proxy would have chosen); then on the report split's default grid, seed 3; then the
   selector each objective's rule chooses on the selection split (``v3_summary.chosen_selectors``) on the
   report's seeds 4 and 5 and on its streams (seeds 3, 4, 5).
9. ``cheaper``: what a user would pick instead (issue 39), on the report split's default grid, seeds 3, 4, 5: the
   training-free score transforms alone on the source model (:data:`TRANSFORMS`: DN, NNN, QB-Norm), each under TCR and
   REST at their selected lrs, and TCR and REST at their selected lrs on every batch and at the update budgets of
   :data:`BUDGETS` (``+b<percent>``). One run per method holds its budgets (100 % included) and one its transforms,
   so the rows compared for cost are timed side by side; every row records its passes per query and the seconds of
   its stream beside the source row of its own run (``v3_summary.cheaper_lines``).

    python -m hf_tta.benchmarks.protocols.v3 select --direction i2t --out runs/v3 --jobs 2
    python -m hf_tta.benchmarks.protocols.v3 degenerate --direction i2t --out runs/v3 --jobs 2
    python -m hf_tta.benchmarks.protocols.v3 report --direction i2t --out runs/v3 --jobs 2 --shard 1/2
    python -m hf_tta.benchmarks.protocols.v3 cheaper --direction i2t --out runs/v3 --jobs 1
    python -m hf_tta.benchmarks.protocols.v3 select --direction t2i --out runs/v3 --jobs 8 --device cuda   # where a GPU is lent
    python -m hf_tta.benchmarks.protocols.v3 cheaper --direction t2i --out runs/v3 --jobs 16 --split-runs 4 --device cuda
    python -m hf_tta.benchmarks.protocols.v3_summary runs/v3 --export model_cards/results/protocol-v3
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from .v3_splits import REPORT, SCORING, SELECTION, run_arguments

REPO = Path(__file__).resolve().parents[3]

#: The methods and the two supervised ceilings, in the order of the issue.
METHODS = ("tent", "eata", "sar", "read", "deyo", "shot", "pl", "cliptta", "titan", "tcr", "rest")
CEILINGS = ("oracle", "oracle_all")
OBJECTIVES = (*METHODS, *CEILINGS)
#: Objectives run together in one ``hf-tta run`` of the select phase (one process loads the streams once).
GROUPS = (("tent", "tcr", "rest"), CEILINGS, ("eata", "sar", "read", "titan"), ("deyo", "shot", "pl", "cliptta"))
#: Each direction's lr grid: at least 1e-4 … 1e-2 (image tower) and 1e-5 … 3e-3 (text tower), half-decades.
LR_GRID = {"i2t": ("1e-4", "3e-4", "1e-3", "3e-3", "1e-2"), "t2i": ("1e-5", "3e-5", "1e-4", "3e-4", "1e-3", "3e-3")}
#: One half-decade past each end (the ``extend`` phase, only for objectives whose best lr is at that end).
LR_BEYOND = {"i2t": ("3e-5", "3e-2"), "t2i": ("3e-6", "1e-2")}
#: The papers' learning rate, 3e-4: TCR's and REST's for image queries and for CLIP's text queries. For BLIP's (BERT)
#: text queries their code uses 3e-5, which is the emoji model's text default (its MiniLM tower is a BERT); 3e-5 is on
#: the text selection grid, and the text report's "paper's lr" rows are at 3e-4 (the card says so).
PAPER_LR = "3e-4"
#: Constant batches before the clean slice in the degenerate stream of both splits (the runner's default, 200, costs
#: 7x a full stream; 50 already drove TCR 11 R@1 below the source under protocol v2).
DEGENERATE_BATCHES = 50
#: The preset's components on the report's default grid (TCR and REST at paper and selected lr next to Tent).
REPORT_ALL_SEEDS = ("tent", "tcr", "rest")
#: The papers' scoring rule, the secondary column (phase ``after``).
AFTER = "after_update"
SAFETY_LITE = '{"min_agreement": 0, "max_agreement_drop": 1}'
#: The training-free score transforms of the ``cheaper`` phase (row names: alone, or ``+<name>`` on a method).
TRANSFORMS = ("dn", "nnn", "qbnorm")
#: The update budgets of the ``cheaper`` phase, in % of batches adapted on (100 %: the method's plain row).
BUDGETS = ("50", "25", "10")
#: The preset's row while the preset phase has not chosen: the current ``TTAConfig.recommended`` (the ``recommended``
#: row at the paper's lr).
RECOMMENDED = {"name": "recommended-lr3e-4", "row": "recommended", "args": ["--lr", PAPER_LR]}
#: Issue 37's lr selectors by folder name, as ``hf-tta run`` arguments (``--lr_search`` JSON,
#: :class:`hf_tta.lr_search.LRSearchConfig`): the probe at its defaults (selector (a)); the hypergradient rule alone
#: from the default lr (selector (c)) at its a-priori rate 0.02 and at 0.1; the probe followed by the rule at 0.1; the
#: probe answering with its leading shadow (selector (b), ``serve="leader"``); the back-off alone (selector (d): from the highest candidate, halving the lr at each rollback of the default safety
#: layer, which it needs); the probe serving its leader under the default safety layer (what a user who keeps the
#: safety layer on, as the README advises, runs; added in session 6, after the report rows of the others were read).
SELECTORS = {
    "auto": ["--lr_search", "{}"],
    "hg": ["--lr_search", '{"online": "hypergradient", "probe_batches": 0}'],
    "hg0.1": ["--lr_search", '{"online": "hypergradient", "probe_batches": 0, "hypergradient_rate": 0.1}'],
    "auto+hg0.1": ["--lr_search", '{"online": "hypergradient", "hypergradient_rate": 0.1}'],
    "auto+leader": ["--lr_search", '{"serve": "leader"}'],
    "backoff0.5+safe": ["--lr_search", '{"backoff": 0.5, "probe_batches": 0}', "--safety", "{}"],
    "auto+leader+safe": ["--lr_search", '{"serve": "leader"}', "--safety", "{}"],
}
PHASES = ("select", "extend", "degenerate", "preset", "report", "corruptions", "after", "auto", "cheaper")


def run_folder(folder: Path, args: list[str], cache: str, device: str = "cpu") -> int:
    """One ``hf-tta run`` of ``args`` into ``folder`` (one thread, offline, plots off; its command line in
    ``command.txt``, its output appended to ``log.txt``); returns its exit code. ``recipes/beyond_ln.py`` runs with it
    too."""
    folder.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "hf_tta.cli", "run", *args, "--output-dir", str(folder), "--cache-dir", cache,
           "--no-plots", "--quiet", "--threads", "1", *(["--device", device] if device != "cpu" else [])]
    (folder / "command.txt").write_text(" ".join(cmd) + "\n")
    with open(folder / "log.txt", "a") as log:
        return subprocess.call(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "HF_HUB_OFFLINE": "1"})


def _part(folder: Path, k: int, n: int) -> Path:
    """Where part ``k`` of a run split over ``n`` processes (``hf-tta run --shard k/n``, 0-based) writes: one level
    below the run, out of the tables' reach (``v3_rows.load`` reads ``<phase>/<direction>/<run>/rows.jsonl``)."""
    return folder / f"shard-{k}-of-{n}"


def merge_parts(folder: Path, n: int) -> int:
    """The rows of a run's ``n`` finished parts (:func:`_part`) as the run's own ``rows.jsonl`` (the header of part 0
    without its ``shard``, with ``shards: n``; headers that differ otherwise, a part without ``results.json`` or a
    row in two parts raise) and ``results.json`` (``hf-tta merge``); returns the number of rows."""
    import json  # noqa: PLC0415

    from hf_tta.benchmarks.report import row_key  # noqa: PLC0415
    from hf_tta.cli.run import RUN_HEADER, read_progress  # noqa: PLC0415

    heads, rows = [], []
    for k in range(n):
        part = _part(folder, k, n)
        if not (part / "results.json").is_file():
            raise ValueError(f"{part}: not finished (no results.json); run the phase again to resume it.")
        head, part_rows = read_progress(part / "rows.jsonl")
        heads.append(dict(head or {}))
        rows += part_rows
    shards = [h.pop("shard", None) for h in heads]
    if shards != [f"{k}/{n}" for k in range(n)] or any(h != heads[0] for h in heads):
        raise ValueError(f"{folder}: its parts are not the {n} shards of one run (headers differ).")
    if len({row_key(r) for r in rows}) != len(rows):
        raise ValueError(f"{folder}: a row is in two parts.")
    lines = [json.dumps({RUN_HEADER: {**heads[0], "shards": n}}), *map(json.dumps, rows)]
    (folder / "rows.jsonl").write_text("\n".join(lines) + "\n")
    subprocess.run([sys.executable, "-m", "hf_tta.cli", "merge", *(str(_part(folder, k, n) / "results.json") for k in range(n)),
                    "--output-dir", str(folder), "--no-plots"], check=True, stdout=subprocess.DEVNULL)
    return len(rows)


def _run_split(folder: Path, args: list[str], cache: str, device: str, n: int, pool: ThreadPoolExecutor) -> int:
    """A run as ``n`` processes (``--shard k/n`` each, in the pool), then :func:`merge_parts` (a refusal: one line on
    stderr, exit code 1); a finished run (its ``results.json``) is left as it is."""
    if (folder / "results.json").is_file():
        return 0
    codes = list(pool.map(lambda k: run_folder(_part(folder, k, n), [*args, "--shard", f"{k}/{n}"], cache, device), range(n)))
    if any(codes):
        return 1
    try:
        merge_parts(folder, n)
    except ValueError as err:  # parts of two runs, or a row in two parts: one line, the run counted as failed
        print(f"protocol_v3: {err}", file=sys.stderr)
        return 1
    return 0


def _replace(args: list[str], values: dict[str, str]) -> list[str]:
    """``args`` with each value found in ``values`` replaced (``{"3,4,5": "3"}``: the report's seeds -> seed 3)."""
    return [values.get(a, a) for a in args]


def _objectives(names) -> list[str]:
    return ["--objectives", ",".join(names)]


def _selected_lrs(out: Path, direction: str, needed=OBJECTIVES) -> dict[str, str]:
    """The selected lr of every objective (``v3_summary.selected_lrs``); exits naming those of ``needed``
    whose selection runs have not finished, and the command that runs them."""
    from . import v3_summary as summary  # noqa: PLC0415 (a cycle at import time otherwise)

    lrs = summary.selected_lrs(summary.load(out), direction)
    missing = [name for name in needed if name not in lrs]
    if missing:
        raise SystemExit(f"no finished selection runs for {', '.join(missing)} ({direction}): run "
                         f"`python -m hf_tta.benchmarks.protocols.v3 select --direction {direction} --out {out}` first.")
    return lrs


def jobs(phase: str, direction: str, out: Path) -> list[tuple[str, list[str]]]:
    """The phase's runs as ``(folder under out, hf-tta run arguments)``."""
    from . import v3_summary as summary  # noqa: PLC0415 (a cycle at import time otherwise)

    sel = run_arguments(SELECTION, direction, streams=False)
    sel_clean = [*sel, "--clean"]
    degenerate = [*run_arguments(SELECTION, direction, corruptions=False), "--degenerate-batches", str(DEGENERATE_BATCHES)]
    degenerate = [a for a in degenerate if a != "--clean"]
    out_jobs: list[tuple[str, list[str]]] = []
    if phase == "select":
        for group in GROUPS:  # the preset's components and the ceilings first
            for lr in LR_GRID[direction]:
                out_jobs.append((f"select/{direction}/{'+'.join(group)}-lr{lr}", [*sel_clean, *_objectives(group), "--lr", lr]))
    elif phase == "extend":
        for name, lr in summary.edge_lrs(summary.load(out), direction).items():
            out_jobs.append((f"select/{direction}/{name}-lr{lr}", [*sel_clean, *_objectives([name]), "--lr", lr]))
    elif phase == "degenerate":
        for name, lr in summary.degenerate_walk(summary.load(out), direction):
            out_jobs.append((f"degenerate/{direction}/{name}-lr{lr}", [*degenerate, *_objectives([name]), "--lr", lr]))
    elif phase == "preset":
        lrs = _selected_lrs(out, direction, ("tcr", "rest"))
        for name in ("tcr", "rest"):
            for lr in dict.fromkeys([lrs[name], PAPER_LR]):
                for tag, extra in (("", []), ("-lite", ["--safety", SAFETY_LITE])):
                    rows = _objectives([f"{name}+dn+safe"])
                    out_jobs.append((f"preset/{direction}/{name}+dn+safe{tag}-lr{lr}", [*sel_clean, *rows, "--lr", lr, *extra]))
                    out_jobs.append((f"preset/{direction}/{name}+dn+safe{tag}-lr{lr}-degenerate",
                                     [*degenerate, *rows, "--lr", lr, *extra]))
    elif phase == "report":
        lrs = _selected_lrs(out, direction)
        grid = run_arguments(REPORT, direction, streams=False, default_grid=direction == "i2t")
        seeds3 = _replace(grid, {"3,4,5": "3"})
        streams = [*run_arguments(REPORT, direction, corruptions=False), "--degenerate-batches", str(DEGENERATE_BATCHES)]
        preset = summary.selected_preset(summary.load(out), direction) or RECOMMENDED

        def at(name, lr, args=grid):
            return (f"report/{direction}/{name}-lr{lr}", [*args, *_objectives([name]), "--lr", lr])

        for name in ("tcr", "rest"):  # in the order the card needs them, most needed first
            out_jobs += [at(name, lr) for lr in dict.fromkeys([PAPER_LR, lrs[name]])]
        out_jobs.append(at("oracle", lrs["oracle"]))
        out_jobs += [at("tent", lr) for lr in dict.fromkeys([PAPER_LR, lrs["tent"]])]
        out_jobs.append((f"report/{direction}/{preset['name']}", [*grid, *_objectives([preset["row"]]), *preset["args"]]))
        out_jobs += [at(name, lrs[name], streams) for name in ("tcr", "rest")]
        out_jobs[-2:] = [(f"{n}-streams", a) for n, a in out_jobs[-2:]]
        out_jobs.append((f"report/{direction}/{preset['name']}-streams", [*streams, *_objectives([preset["row"]]), *preset["args"]]))
        out_jobs.append(at("oracle_all", lrs["oracle_all"]))
        for name in METHODS:  # every other objective at both lrs on seed 3
            if name not in REPORT_ALL_SEEDS:
                out_jobs += [at(name, lr, seeds3) for lr in dict.fromkeys([PAPER_LR, lrs[name]])]
    elif phase == "corruptions":
        lrs = _selected_lrs(out, direction, ("tcr", "rest", "oracle"))
        every = run_arguments(REPORT, direction, seeds=(3,), streams=False)
        preset = summary.selected_preset(summary.load(out), direction) or RECOMMENDED
        out_jobs += [(f"corruptions/{direction}/{name}-lr{lrs[name]}", [*every, *_objectives([name]), "--lr", lrs[name]])
                     for name in ("tcr", "rest", "oracle")]
        out_jobs.append((f"corruptions/{direction}/{preset['name']}", [*every, *_objectives([preset["row"]]), *preset["args"]]))
    elif phase == "after":
        lrs = _selected_lrs(out, direction, REPORT_ALL_SEEDS)
        grid = run_arguments(REPORT, direction, streams=False, default_grid=direction == "i2t")
        after = _replace(grid, {"3,4,5": "3", SCORING: AFTER})
        for name in REPORT_ALL_SEEDS:
            out_jobs.append((f"after/{direction}/{name}-lr{lrs[name]}", [*after, *_objectives([name]), "--lr", lrs[name]]))
    elif phase == "auto":
        grid = run_arguments(REPORT, direction, streams=False, default_grid=direction == "i2t")
        seeds3 = _replace(grid, {"3,4,5": "3"})
        for tag, stream in (("", sel_clean), ("-degenerate", degenerate), ("-report", seeds3)):  # every selection run first
            for selector, search in SELECTORS.items():
                out_jobs += [(f"auto/{direction}/{name}-{selector}{tag}", [*stream, *_objectives([name]), *search])
                             for name in ("tcr", "rest")]
        streams = [*run_arguments(REPORT, direction, corruptions=False), "--degenerate-batches", str(DEGENERATE_BATCHES)]
        for name, selector in summary.chosen_selectors(summary.load(out), direction).items():  # then the chosen ones
            out_jobs += [(f"auto/{direction}/{name}-{selector}{tag}", [*args, *_objectives([name]), *SELECTORS[selector]])
                         for tag, args in (("-report45", _replace(grid, {"3,4,5": "4,5"})), ("-streams", streams))]
    elif phase == "cheaper":
        lrs = _selected_lrs(out, direction, ("tcr", "rest"))
        grid = run_arguments(REPORT, direction, streams=False, default_grid=direction == "i2t")
        out_jobs += [(f"cheaper/{direction}/{name}", [*grid, *_objectives([name])]) for name in TRANSFORMS]  # no lr: nothing adapts
        for part, rows in (("budgets", lambda m: [m, *(f"{m}+b{b}" for b in BUDGETS)]),
                           ("transforms", lambda m: [f"{m}+{t}" for t in TRANSFORMS])):
            for method in ("tcr", "rest"):  # one run per method and part: its rows are timed side by side
                out_jobs.append((f"cheaper/{direction}/{method}-{part}-lr{lrs[method]}",
                                 [*grid, *_objectives(rows(method)), "--lr", lrs[method]]))
    return out_jobs


def columns_only(todo: list[tuple[str, list[str]]], corruptions: list[str], error) -> list[tuple[str, list[str]]]:
    """The runs of ``todo`` that name text corruptions, restricted to ``corruptions`` (each one named by every such
    run, else ``error``), into ``<folder>~<abbreviations>``; runs without text corruptions (streams) are left out."""
    from hf_tta.benchmarks.report import abbreviation  # noqa: PLC0415 (imports torch)

    out = []
    for name, args in todo:
        i = args.index("--text-corruptions") + 1 if "--text-corruptions" in args else None
        if i is None or not args[i]:
            continue
        unknown = sorted(set(corruptions) - set(args[i].split(",")))
        if unknown:
            error(f"--text-corruptions: {', '.join(unknown)} not in run {name}'s corruptions ({args[i]}).")
        tag = "-".join(abbreviation(c).lower() for c in corruptions)
        out.append((f"{name}~{tag}", [*args[:i], ",".join(corruptions), *args[i + 1:]]))
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("phase", choices=PHASES)
    parser.add_argument("--direction", choices=["i2t", "t2i"], default="i2t")
    parser.add_argument("--out", type=Path, default=Path("runs/v3"))
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--shard", default="1/1", help="k/n: every n-th run of the phase from the k-th")
    parser.add_argument("--only", nargs="+", help="run only the runs whose folder contains one of these")
    parser.add_argument("--skip", nargs="+", default=[], help="leave out the runs whose folder ends with one of these")
    parser.add_argument("--cache-dir", default=os.path.expanduser("~/.cache/hf_tta/emoji-streams"))
    parser.add_argument("--text-corruptions", help="run only these text corruptions of each run, into "
                        "`<folder>~<abbreviations>` (columns added to finished runs that lack them, e.g. runs from another "
                        "device; the tables merge a label's rows across its folders)")
    parser.add_argument("--dry-run", action="store_true", help="list the runs and exit")
    parser.add_argument("--device", default="cpu", help="every run's --device (e.g. cuda, with --jobs 8 on one GPU); a run "
                        "continues only on the device it started on (its rows.jsonl names it)")
    parser.add_argument("--split-runs", type=int, default=1, metavar="N",
                        help="run each run as N processes (`hf-tta run --shard k/N` into `<folder>/shard-k-of-N`), "
                        "merged into the run's folder when all finish: a GPU with many cores finishes a phase of a few "
                        "long runs sooner (e.g. --device cuda --jobs 16 --split-runs 4); a row's time is then compared with its "
                        "run's source row timed in the same or a sibling process")
    args = parser.parse_args(argv)
    if args.split_runs < 1:
        parser.error(f"--split-runs takes a positive number of processes per run; got {args.split_runs}")
    try:
        k, n = (int(x) for x in args.shard.split("/"))
        assert 1 <= k <= n
    except (ValueError, AssertionError):
        parser.error(f"--shard takes k/n with 1 <= k <= n, e.g. 1/2; got {args.shard!r}")
    todo = [j for j in jobs(args.phase, args.direction, args.out) if not args.only or any(o in j[0] for o in args.only)]
    todo = [j for j in todo[k - 1 :: n] if not any(j[0].endswith(x) for x in args.skip)]
    if args.text_corruptions:
        todo = columns_only(todo, args.text_corruptions.split(","), parser.error)
    if args.dry_run:
        for name, a in todo:
            print(name, " ".join(a))
        return
    if args.split_runs > 1:  # each run's parts share one pool of --jobs processes; the runs are queued from threads
        with ThreadPoolExecutor(args.jobs) as pool, ThreadPoolExecutor(len(todo) or 1) as runs:
            codes = list(runs.map(lambda job: _run_split(args.out / job[0], job[1], args.cache_dir, args.device,
                                                         args.split_runs, pool), todo))
    else:
        with ThreadPoolExecutor(args.jobs) as pool:
            codes = list(pool.map(lambda job: run_folder(args.out / job[0], job[1], args.cache_dir, args.device), todo))
    failed = [name for (name, _), c in zip(todo, codes) if c != 0]
    print(f"{len(todo) - len(failed)} of {len(todo)} runs finished" + (f"; failed: {failed}" if failed else ""))
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
