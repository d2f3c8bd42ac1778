"""``hf-tta plot`` and ``hf-tta merge``: redraw the plots of a ``results.json``, or combine the results of several
runs or shards (and the ``rows.jsonl`` of interrupted ones) into one table, JSON, CSV and plots."""

from __future__ import annotations

import json
from pathlib import Path

from .arguments import UsageError, writable_folder
from .run import read_progress, run_identity


def cmd_plot(args) -> int:
    from ..benchmarks.outputs import draw_plots, format_main_tables, scoring_of

    data = _read_results(args.results)
    writable_folder("--output-dir", args.output_dir)
    folder = Path(args.output_dir or Path(args.results).parent)
    folder.mkdir(parents=True, exist_ok=True)
    scoring = scoring_of(data.get("meta") or {})
    paths = draw_plots(data["rows"], folder, scoring)
    print(format_main_tables(data["rows"], scoring), end="\n\n")
    print("wrote " + ", ".join(paths.values()))
    return 0


#: Each identity field (:data:`.run.IDENTITY`): what it is called, and the option that sets it.
_IDENTITY_WORDS = {"model": ("model", "--model"), "dataset": ("build", "--dataset"), "limit": ("build", "--limit"),
                   "concepts": ("concept part", "--concepts"),
                   "render_factor": ("build", "--render-factor"), "scoring": ("scoring rule", "--scoring"),
                   "steps": ("scoring rule", "--steps"), "batch_size": ("scoring rule", "--batch-size"),
                   "lr": ("scoring rule", "--lr")}


def part_identity(path: str, data: dict | None, header: dict | None = None) -> dict:
    """The model, build and scoring rule of one part of a merge: a ``rows.jsonl`` header, a results.json's
    ``meta.identity`` (or of a merge, the identity its parts shared), else what an older results.json's ``meta.task``
    and ``meta.settings`` record (only the fields it has)."""
    if header is not None:
        return run_identity(header)
    meta = (data or {}).get("meta") or {}
    if isinstance(meta.get("identity"), dict):
        return dict(meta["identity"])
    task, settings = meta.get("task") or {}, meta.get("settings") or {}
    out = {k: task[k] for k in ("model", "dataset", "limit", "render_factor") if k in task}
    out.update({k: settings[k] for k in ("steps", "batch_size", "lr") if k in settings})
    if "config_overrides" in settings:
        out["scoring"] = (settings.get("config_overrides") or {}).get("scoring", "after_update")
    if out.get("dataset") is not None and Path(str(out["dataset"])).expanduser().exists():
        out["dataset"] = str(Path(str(out["dataset"])).expanduser().resolve())
    return out


def check_same_identity(parts: list[tuple[str, dict]]) -> dict:
    """The identity the parts share; a :class:`UsageError` naming the first field where two parts differ (results of
    different models, builds or scoring rules would fill one table with columns of each)."""
    first_path, first = parts[0]
    shared = dict(first)
    for path, ident in parts[1:]:
        for key in (k for k in _IDENTITY_WORDS if k in shared and k in ident):
            if shared[key] != ident[key]:
                what, option = _IDENTITY_WORDS[key]
                raise UsageError(f"{path} comes from another {what} than {first_path} ({key} {ident[key]!r} vs "
                                 f"{shared[key]!r}); merge only results of one model, build and scoring rule, or rerun one "
                                 f"with the other's {option}.")
        shared.update({k: v for k, v in ident.items() if k not in shared})
    return shared


def cmd_merge(args) -> int:
    from ..benchmarks.outputs import format_main_tables, write_outputs
    from ..benchmarks.report import merge_rows

    writable_folder("--output-dir", args.output_dir)
    rows, metas, identities = [], [], []
    for path in args.results:
        if str(path).endswith(".jsonl"):  # the progress file of an interrupted run
            if not Path(path).is_file():
                raise UsageError(f"{path}: no such file; pass the rows.jsonl an interrupted `hf-tta run` left in its --output-dir.")
            header, part = read_progress(Path(path))
            rows.extend(part)
            metas.append({"partial": str(path)})
            identities.append((str(path), part_identity(path, None, header) if header is not None else {}))
            continue
        data = _read_results(path)
        rows.extend(data["rows"])
        metas.append(data.get("meta", {}))
        identities.append((str(path), part_identity(path, data)))
    identity = check_same_identity(identities)
    unique = merge_rows(rows)
    meta = {"merged_from": args.results, "identity": identity, "parts": metas}
    paths = write_outputs(unique, args.output_dir, meta, plots=not args.no_plots)
    print(format_main_tables(unique, identity.get("scoring")), end="\n\n")
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
