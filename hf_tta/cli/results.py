"""``hf-tta plot`` and ``hf-tta merge``: redraw the plots of a ``results.json``, or combine the results of several
runs or shards (and the ``rows.jsonl`` of interrupted ones) into one table, JSON, CSV and plots."""

from __future__ import annotations

import json
from pathlib import Path

from .arguments import UsageError, writable_folder
from .run import read_progress


def cmd_plot(args) -> int:
    from ..benchmarks.report import build_tables, draw_plots, format_table

    data = _read_results(args.results)
    writable_folder("--output-dir", args.output_dir)
    folder = Path(args.output_dir or Path(args.results).parent)
    folder.mkdir(parents=True, exist_ok=True)
    paths = draw_plots(data["rows"], folder)
    for t in build_tables(data["rows"]):
        print(format_table(t), end="\n\n")
    print("wrote " + ", ".join(paths.values()))
    return 0


def cmd_merge(args) -> int:
    from ..benchmarks.report import build_tables, format_table, merge_rows, write_outputs

    writable_folder("--output-dir", args.output_dir)
    rows, metas = [], []
    for path in args.results:
        if str(path).endswith(".jsonl"):  # the progress file of an interrupted run
            if not Path(path).is_file():
                raise UsageError(f"{path}: no such file; pass the rows.jsonl an interrupted `hf-tta run` left in its --output-dir.")
            rows.extend(read_progress(Path(path))[1])
            metas.append({"partial": str(path)})
            continue
        data = _read_results(path)
        rows.extend(data["rows"])
        metas.append(data.get("meta", {}))
    unique = merge_rows(rows)
    paths = write_outputs(unique, args.output_dir, {"merged_from": args.results, "parts": metas}, plots=not args.no_plots)
    for t in build_tables(unique):
        print(format_table(t), end="\n\n")
    print("wrote " + ", ".join(paths.values()))
    return 0


def _read_results(path: str) -> dict:
    p = Path(path)
    if not p.is_file():
        raise UsageError(f"{path}: no such file; pass the results.json that `hf-tta run` wrote in its --output-dir.")
    try:
        data = json.loads(p.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise UsageError(f"{path} is not JSON; pass the results.json that `hf-tta run` wrote.") from None
    if not isinstance(data, dict) or not isinstance(data.get("rows"), list):
        raise UsageError(f"{path} has no 'rows' list; pass the results.json that `hf-tta run` wrote.")
    return data
