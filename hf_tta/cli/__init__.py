"""``hf-tta``: run test-time adaptation benchmarks for cross-modal retrieval under query shift.

With no arguments it runs the main job (:data:`MAIN_JOB`): the offline emoji benchmark (EmojiRetrieval + the shipped
source model, see ``model_cards/``), image→text on protocol v4's report concepts and report seed 3, the default grid
(one corruption per ImageNet-C category) and the clean stream, with the source model, ``TTAConfig.recommended`` and
the best labelled fixed-lr TCR; prints a table shaped like TCR's Table 1 with each row's won-back share and verdict,
and writes JSON, CSV, Markdown and PNG plots. ``--full`` runs the whole severity-5 grid (16 image corruptions, the offline text corruptions, the
style and diverse shifts, every registered objective).

Examples::

    hf-tta                                         # the default offline benchmark (a few minutes on 2 CPU cores)
    hf-tta run --objectives tent,tcr,eata --corruptions all --severities 5
    hf-tta run --direction t2i --objectives tcr    # text queries, offline text corruptions
    hf-tta run --full --device cuda                # the full severity-5 grid
    hf-tta run --model openai/clip-vit-base-patch16 --dataset ./coco-c --corruptions all   # a real run
    hf-tta run --model Salesforce/blip-itm-base-coco --dataset ./coco-c --objective tcr --safety '{}'   # BLIP (TCR's model)
    hf-tta run --model ./my-model --dataset ./coco-c --config my_tta_config.yaml   # TTAConfig fields from a file
    hf-tta run --model laion/clap-htsat-unfused --dataset ./audioset-o --direction a2t,t2a   # audio <-> text
    hf-tta run --model microsoft/xclip-base-patch32 --dataset ./audioset-d --direction video->text
    hf-tta build --pairs pairs.jsonl --output-dir ./my-set   # any image-text set -> a query-shift benchmark
    hf-tta list                                    # objectives, corruptions, styles, benchmarks
    hf-tta serve --state-dir /srv/tta --port 8000  # the retrieval service that adapts while it serves
    hf-tta clean                                   # clean R@1/5/10 of the source model

``--model`` loads the class the checkpoint's config.json declares when hf_tta adapts it (``BlipForImageTextRetrieval``,
``Blip2ForImageTextRetrieval``; a BLIP-2 checkpoint needs ``use_qformer_text_input=True`` in its Q-Former config for text),
else ``AutoModel``. A run that fails prints one line as it happens, and the command ends with a
summary and exit status 1.

The package, one idea per module: ``arguments`` (the parser, the argument types, :class:`UsageError` and
:func:`validate_args`), ``config_args`` (the adaptation options generated from :class:`~hf_tta.TTAConfig`'s fields and
``--config``), ``environment`` (threads, offline mode), ``plan`` (the grid, the task and the run settings of
``hf-tta run``), ``run`` (``hf-tta run`` and its resumable ``rows.jsonl``), ``build`` (``hf-tta build``), ``listing`` (``hf-tta list``), ``clean``
(``hf-tta clean``) and ``results`` (``hf-tta plot`` and ``hf-tta merge``); this module holds :func:`main`, the entry
point of the ``hf-tta`` console script and of ``python -m hf_tta.cli``.
"""

from __future__ import annotations

import sys
from typing import Sequence

from .arguments import SUBCOMMANDS, UsageError, build_parser, validate_args
from .build import cmd_build
from .clean import cmd_clean
from .environment import go_offline, setup_environment
from .listing import cmd_list
from .plan import full_grid_rows, make_task, prepare_run, resolve_av_grid, resolve_grid
from .results import cmd_merge, cmd_plot
from .run import RUN_HEADER, cmd_run, read_progress, run_signature

__all__ = [
    "RUN_HEADER",
    "SUBCOMMANDS",
    "UsageError",
    "build_parser",
    "cmd_build",
    "cmd_clean",
    "cmd_list",
    "cmd_merge",
    "cmd_plot",
    "cmd_run",
    "full_grid_rows",
    "go_offline",
    "main",
    "make_task",
    "prepare_run",
    "read_progress",
    "resolve_av_grid",
    "resolve_grid",
    "run_signature",
    "setup_environment",
    "validate_args",
]


#: What ``hf-tta`` runs with no arguments, the main job and the README's headline (protocol v4, issue 47): on the
#: report part of the concepts and one report seed, the default grid and the clean stream, prequential; the source
#: model, ``TTAConfig.recommended`` (row ``recommended``) and the best labelled fixed-lr TCR, its lr chosen on the
#: selection split (``model_cards/results/protocol-v4/choices/default-study.json``, a test checks the two agree).
MAIN_JOB = ("--concepts", "report", "--seeds", "3", "--corruptions", "default", "--clean", "--no-style",
            "--objectives", "recommended,tcr@3e-2")


def _default_to_run(argv: list[str]) -> list[str]:
    if not argv:
        return ["run", *MAIN_JOB]
    if argv[0] not in SUBCOMMANDS and argv[0] not in ("-h", "--help"):
        return ["run", *argv]
    return argv


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point. A user mistake prints one line naming the fix and returns 2; any other failure prints one line
    and returns 1; ``--debug`` (anywhere on the command line) shows the traceback instead."""
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv
    argv = [a for a in argv if a != "--debug"]
    handlers = {"run": cmd_run, "build": cmd_build, "list": cmd_list, "clean": cmd_clean, "plot": cmd_plot, "merge": cmd_merge}
    try:
        if argv[:1] == ["serve"]:  # the service's own parser (hf_tta.cli.serve): exit 2 with one line on a mistake
            from ..extras import require

            require("fastapi", "hf-tta serve")
            from .serve import main as serve

            return serve(argv[1:], prog="hf-tta serve") or 0
        argv = _default_to_run(argv)
        args, extra = build_parser(config_options=argv[0] == "run").parse_known_args(argv)
        if extra:  # argparse would name `hf-tta --help`, which does not list a subcommand's options
            raise UsageError(f"unrecognized arguments: {' '.join(extra)} (see `hf-tta {args.command} --help`)")
        args.debug = debug
        return handlers[args.command](args)
    except UsageError as err:
        if debug:
            raise
        print(f"hf-tta: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        if debug:
            raise
        print("hf-tta: interrupted; rerun the same command to continue from the rows already written.", file=sys.stderr)
        return 130
    except Exception as err:
        if debug:
            raise
        first = str(err).strip().splitlines()[0] if str(err).strip() else ""
        print(f"hf-tta: {type(err).__name__}: {first} (rerun with --debug for the traceback)", file=sys.stderr)
        return 1
