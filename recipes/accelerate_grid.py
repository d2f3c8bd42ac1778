#!/usr/bin/env python
"""Split an ``hf-tta run`` grid (shift x severity x objective) across processes with Accelerate; gather one table.

Takes exactly the options of ``hf-tta run`` (see ``hf-tta run --help``) and builds the grid and the task with the
CLI's own ``resolve_grid`` and ``make_task`` (emoji, image-text and audio/video benchmarks alike). Every process
builds the same grid, takes its share of the (condition, objective) runs with ``PartialState.split_between_processes``, runs them on its
own device (each run starts from the source model, as in ``hf-tta``), and the main process gathers the rows with
``gather_object`` and writes the usual results.json/.csv/.md and plots.

The model is never ``accelerator.prepare``d: TTA must not be wrapped in DistributedDataParallel (a frozen model
raises, and an adapted one would all-reduce the gradients of different query streams). Each run is independent, so
the grid is embarrassingly parallel and the table equals the single-process one.

    # 2 GPUs
    accelerate launch --multi_gpu --num_processes 2 recipes/accelerate_grid.py --full --device cuda
    # bf16 autocast of the query forward (accelerate's --mixed_precision bf16; fp16 is refused: it needs a gradient
    # scaler, which TTA's few-parameter steps do not run)
    accelerate launch --multi_gpu --num_processes 2 --mixed_precision bf16 recipes/accelerate_grid.py --device cuda
    # 2 CPU processes (note: `accelerate launch --cpu` silently runs ONE process; use --multi_gpu on CPU too)
    accelerate launch --multi_gpu --num_processes 2 --num_machines 1 --mixed_precision no --dynamo_backend no \
        recipes/accelerate_grid.py --corruptions all --objectives tent,tcr
    # audio/video benchmarks take the same options (--direction a2t, t2a, v2t, t2v, v2a, a2v or video->audio, ...)
    accelerate launch --multi_gpu --num_processes 2 recipes/accelerate_grid.py --device cuda \
        --model laion/clap-htsat-unfused --dataset ./audioset-o --direction a2t,t2a --objectives all
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def main(argv=None) -> list[dict] | None:
    from hf_tta.extras import require

    require("accelerate", "recipes/accelerate_grid.py")
    from accelerate import PartialState
    from accelerate.utils import gather_object, parse_flag_from_env

    from hf_tta.benchmarks import GridRunner, format_main_tables, merge_rows, write_outputs
    from hf_tta.cli import build_parser, prepare_run, run_signature, setup_environment
    from hf_tta.cli.config_args import autocast_from_accelerate
    from hf_tta.cli.run import run_identity

    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(["run", *argv])
    autocast_from_accelerate(args)  # --mixed_precision bf16: bf16 autocast; fp16 / fp8: one line naming bf16
    import torch

    # CPU processes (debug_launcher sets ACCELERATE_USE_CPU; `accelerate launch --multi_gpu` on a machine without
    # GPUs does not): PartialState must be told, or each process believes it is alone.
    cpu = parse_flag_from_env("ACCELERATE_USE_CPU") or not torch.cuda.is_available() or args.device == "cpu"
    state = PartialState(cpu=cpu)
    if args.device.startswith("cuda"):
        args.device = str(state.device)  # one GPU per process
    setup_environment(args)
    t0 = time.time()
    jobs, notes, task, settings = prepare_run(args, show_progress=not args.quiet and state.is_main_process)
    with state.split_between_processes(jobs) as mine:
        rows = GridRunner(task, settings).run_all(list(mine), desc=f"process {state.process_index}")
        for r in rows:
            r["process"] = state.process_index
    rows = gather_object(rows)
    if not state.is_main_process:
        return None
    rows = merge_rows(rows)  # the order of a single-process run
    meta = {
        "command": "accelerate launch recipes/accelerate_grid.py " + " ".join(argv),
        "identity": run_identity(json.loads(json.dumps(run_signature(args), default=str))),  # what `hf-tta merge` checks
        "task": task.describe(),
        "settings": vars(settings) | {"device": args.device, "num_processes": state.num_processes},
        "notes": notes,
        "seconds": round(time.time() - t0, 1),
    }
    paths = write_outputs(rows, args.output_dir, meta, plots=not args.no_plots)
    print(format_main_tables(rows, meta["identity"]["scoring"]), end="\n\n")  # the table `hf-tta run` prints
    print(f"{state.num_processes} processes, {len(rows)} runs; wrote {', '.join(paths.values())}")
    return rows


if __name__ == "__main__":
    from hf_tta.cli import UsageError
    from hf_tta.extras import MissingExtraError

    try:
        main()
    except (UsageError, MissingExtraError) as err:  # one line naming the fix, as `hf-tta` does
        print(f"accelerate_grid.py: error: {err}", file=sys.stderr)
        sys.exit(2)
