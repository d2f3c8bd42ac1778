"""``hf-tta clean``: clean R@1/5/10 of the (emoji or ``--model``) source model, no adaptation."""

from __future__ import annotations

import json

from .arguments import validate_args
from .environment import setup_environment
from .plan import make_task


def cmd_clean(args) -> int:
    from ..benchmarks.grid import SOURCE, Condition, Job
    from ..benchmarks.runner import GridRunner, RunSettings

    validate_args(args)
    setup_environment(args)
    task = make_task(args)
    runner = GridRunner(task, RunSettings(seed=args.seed, show_progress=not args.quiet))
    out = {}
    for d in args.direction or ("i2t", "t2i"):
        row = runner.run(Job(Condition(d, "clean"), SOURCE))
        out[d] = {k: row.get(k) for k in ("R@1", "R@5", "R@10", "num_queries", "gallery_size", "error") if k in row}
    print(json.dumps({"task": task.describe(), "clean": out}, indent=1, default=str))
    return 1 if all("error" in row for row in out.values()) else 0
