"""``hf-tta run``: run a grid, writing each finished run to ``rows.jsonl`` so that an interrupted run resumes; then
the tables, JSON, CSV, Markdown and plots.

The first line of ``rows.jsonl`` is ``{RUN_HEADER: run_signature(args)}``: a rerun continues from the rows only when
its signature is the same."""

from __future__ import annotations

import contextlib
import json
import logging
import sys
import time
from pathlib import Path

from .common import UsageError
from .environment import setup_environment
from .plan import prepare_run, run_seeds

RUN_HEADER = "hf-tta-run"

#: Options that change no result: a rerun that differs only in these continues an interrupted run. ``cache_dir``
#: holds renders and source-model embeddings that are rebuilt identically when missing.
_PRESENTATION = ("output_dir", "quiet", "no_plots", "fresh", "threads", "command", "cache_dir", "debug", "config", "config_given")


def run_signature(args) -> dict:
    """The arguments that define a run's rows (what a rerun must repeat to continue from them)."""
    return _defining(vars(args))


def _defining(arguments: dict) -> dict:
    """``arguments`` without the options that change no result (also for headers written before one joined them)."""
    return {k: v for k, v in sorted(arguments.items()) if k not in _PRESENTATION}


def _differences(header: dict, signature: dict) -> list[str]:
    """The defining arguments on which a progress file's ``header`` and this run's ``signature`` differ; an option the
    header predates (absent there) differs only when this run sets it off its default (new options default to the
    behaviour before them), so ``hf-tta`` upgrades keep a run resumable."""
    from .arguments import build_parser

    defaults = json.loads(json.dumps(_defining(vars(build_parser().parse_known_args(["run"])[0])), default=str))
    header = _defining(header)
    out = []
    for key in sorted(header.keys() | signature.keys()):
        there = header[key] if key in header else defaults.get(key)
        if key not in signature or there != signature[key]:
            out.append(f"--{key.replace('_', '-')} {there!r} there, {signature.get(key)!r} here")
    return out


def read_progress(path: Path) -> tuple[dict | None, list[dict]]:
    """The header and the finished rows of a ``rows.jsonl`` progress file (a torn last line is dropped)."""
    header, rows = None, []
    for line in path.read_text().splitlines():
        try:
            item = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(item, dict) and RUN_HEADER in item:
            header = item[RUN_HEADER]
        elif isinstance(item, dict) and "direction" in item:
            rows.append(item)
    return header, rows


def cmd_run(args) -> int:
    from ..benchmarks.outputs import format_main_tables, write_outputs
    from ..benchmarks.report import row_key
    from ..benchmarks.runner import GridRunner

    setup_environment(args)
    t0 = time.time()
    jobs, notes, task, settings = prepare_run(args, show_progress=not args.quiet)
    print(f"hf-tta: {len(jobs)} runs ({len({j.condition for j in jobs})} query streams x "
          f"{len({j.objective for j in jobs})} rows incl. the source model x {len({j.seed for j in jobs})} seed(s))", flush=True)
    for name, why in notes.get("text_corruptions_left_out", {}).items():
        print(f"hf-tta: text corruption {name!r} left out: {why}", flush=True)
    if args.shard:
        k, n = (int(v) for v in args.shard.split("/"))
        jobs = jobs[k::n]
        print(f"hf-tta: shard {k}/{n}: {len(jobs)} runs", flush=True)
    Path(args.output_dir).mkdir(parents=True, exist_ok=True)
    progress = Path(args.output_dir) / "rows.jsonl"  # one line per finished run, so an interrupted grid keeps them
    signature = json.loads(json.dumps(run_signature(args), default=str))
    done: list[dict] = []
    if progress.exists() and not args.fresh:
        header, earlier = read_progress(progress)
        differences = _differences(header, signature) if header is not None else ["no header"]
        if not differences:
            wanted = {row_key({"direction": j.condition.direction, "shift": j.condition.shift, "severity": j.condition.severity,
                               "objective": j.objective, "seed": j.seed}): j for j in jobs}
            done = [r for r in earlier if "error" not in r and row_key(r) in wanted]
            finished = {row_key(r) for r in done}
            jobs = [j for k_, j in wanted.items() if k_ not in finished]
            if done:
                print(f"hf-tta: resuming the interrupted run in {progress}: {len(done)} runs already done, {len(jobs)} to go "
                      "(--fresh starts over).", flush=True)
        elif [r for r in earlier if "error" not in r]:  # never overwrite finished rows unasked
            raise UsageError(f"{progress} holds {len(earlier)} rows of a run with other arguments ({'; '.join(differences[:3])}"
                             f"{'; ...' if len(differences) > 3 else ''}): rerun with its arguments to continue, pass --fresh "
                             "to start over, or choose another --output-dir.")
    with open(progress, "w") as f:
        f.write(json.dumps({RUN_HEADER: signature}) + "\n")
        for r in done:
            f.write(json.dumps(r, default=str) + "\n")

    total, finished_runs = len(jobs), [0]
    log_runs = not args.quiet and not sys.stdout.isatty()  # a log file or a pipe: a line per run, not silence

    def save(row):
        with open(progress, "a") as f:
            f.write(json.dumps(row, default=str) + "\n")
        finished_runs[0] += 1
        if "error" in row:  # one line per failed run, as it happens (the traceback with --debug)
            print(f"hf-tta: {failure_line(row)}", file=sys.stderr, flush=True)
        elif log_runs:
            print(f"hf-tta: {progress_line(row, finished_runs[0], total, time.time() - t0)}", flush=True)

    runner = GridRunner(task, settings)
    runner.remember(done)
    with _runner_log_level(logging.DEBUG if getattr(args, "debug", False) else logging.ERROR):
        rows = done + runner.run_all(jobs, on_row=save)
    if done:
        from ..benchmarks.report import merge_rows

        rows = merge_rows(rows)
    meta = {
        "command": "hf-tta " + " ".join(sys.argv[1:]),
        "identity": run_identity(signature),
        "task": task.describe(),
        "settings": vars(settings) | {"device": args.device, "seeds": run_seeds(args)},
        "notes": notes,
        "resumed_rows": len(done),
        "seconds": round(time.time() - t0, 1),
        "versions": _versions(),
    }
    errors = [r for r in rows if "error" in r]
    paths = write_outputs(rows, args.output_dir, meta, plots=not args.no_plots and len(errors) < len(rows))
    print()
    if len(errors) < len(rows):  # a table of nothing but `err` says nothing the failure lines do not
        print(format_main_tables(rows, meta["identity"]["scoring"]))
        print()
    print(f"wrote {', '.join(paths.values())} ({time.time() - t0:.0f} s)")
    if errors:
        print(f"hf-tta: {len(errors)} of {len(rows)} runs failed (one line each above; their cells show 'err'); "
              "fix the cause and rerun the same command to run only those (--debug shows the tracebacks).", file=sys.stderr)
        return 1
    return 0


#: What makes the rows of two runs comparable (``hf-tta merge`` refuses to mix them otherwise): the model, the build
#: and the scoring rule. Keys of :func:`run_signature`; ``model`` is the emoji ``--weights`` when there is no --model.
IDENTITY = ("model", "dataset", "limit", "concepts", "render_factor", "scoring", "steps", "batch_size", "lr")


def run_identity(signature: dict) -> dict:
    """The model, build and scoring rule of a run, from its :func:`run_signature` (the header of ``rows.jsonl``);
    a local dataset folder is named by its absolute path."""
    out = {k: signature.get(k) for k in IDENTITY}
    out["model"] = signature.get("model") or signature.get("weights")
    for key in ("model", "dataset"):
        if out[key] is not None and Path(str(out[key])).expanduser().exists():
            out[key] = str(Path(str(out[key])).expanduser().resolve())
    return out


def progress_line(row: dict, done: int, total: int, seconds: float) -> str:
    """One line per finished run when stdout is not a terminal: which run, its R@1 and the time so far."""
    from ..benchmarks.figures import figure

    where = row["shift"] if row.get("severity") is None else f"{row['shift']}-{row['severity']}"
    return (f"run {done}/{total} done: {row['objective']} on {row['direction']}/{where} (seed {row.get('seed', 0)}): "
            f"R@1 {figure(row.get('R@1'))} ({seconds:.0f} s so far)")


def failure_line(row: dict) -> str:
    """One line for a failed run: which run, and the first line of its error."""
    where = row["shift"] if row.get("severity") is None else f"{row['shift']}-{row['severity']}"
    first = str(row["error"]).strip().splitlines()[0] if str(row["error"]).strip() else "unknown error"
    return f"{row['objective']} on {row['direction']}/{where} (seed {row.get('seed', 0)}) failed: {first}"


@contextlib.contextmanager
def _runner_log_level(level: int):
    """The runner logs each failure; the CLI prints its own line for it (and the traceback under --debug)."""
    log = logging.getLogger("hf_tta.benchmarks.runner")
    old = log.level
    log.setLevel(level)
    if level == logging.DEBUG and not logging.getLogger().handlers:
        logging.basicConfig(level=logging.WARNING)
    try:
        yield
    finally:
        log.setLevel(old)


def _versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for name in ("hf_tta", "torch", "transformers", "peft"):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = "missing"
    return out
