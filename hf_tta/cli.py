"""``hf-tta``: run test-time adaptation benchmarks for cross-modal retrieval under query shift.

With no arguments it runs the offline emoji benchmark (EmojiRetrieval + the shipped source model, see
``model_cards/``): image→text at severity 5 for one corruption per ImageNet-C category plus the unseen Noto style,
with the source model, Tent and TCR; prints a table shaped like TCR's Table 1, and writes JSON, CSV, Markdown and
PNG plots. ``--full`` runs the whole severity-5 grid (16 image corruptions, the offline text corruptions, the
style and diverse shifts, every registered objective).

Examples::

    hf-tta                                         # the default offline benchmark (a few minutes on 2 CPU cores)
    hf-tta run --objectives tent,tcr,eata --corruptions all --severities 5
    hf-tta run --direction t2i --objectives tcr    # text queries, offline text corruptions
    hf-tta run --full --device cuda                # the full severity-5 grid
    hf-tta run --model openai/clip-vit-base-patch16 --dataset ./coco-c --corruptions all   # a real run
    hf-tta run --model laion/clap-htsat-unfused --dataset ./audioset-o --direction a2t,t2a   # audio <-> text
    hf-tta run --model microsoft/xclip-base-patch32 --dataset ./audioset-d --direction video->text
    hf-tta list                                    # objectives, corruptions, styles
    hf-tta clean                                   # clean R@1/5/10 of the source model
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from pathlib import Path
from typing import Sequence

SUBCOMMANDS = ("run", "list", "clean", "plot", "merge")


class UsageError(ValueError):
    """A mistake in the command line: reported as one line naming the fix, exit status 2 (traceback with --debug)."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line instead of argparse's usage block
        raise UsageError(f"{message} (see `{self.prog} --help`)")


def _positive_int(value: str) -> int:
    try:
        v = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not an integer") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"{value!r} must be a positive integer")
    return v


def _float(value: str) -> float:
    try:
        return float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a number") from None


def _positive_float(value: str) -> float:
    v = _float(value)
    if not v > 0:
        raise argparse.ArgumentTypeError(f"{value!r} must be > 0")
    return v


def _render_factor(value: str) -> float:
    v = _float(value)
    if not v >= 1:
        raise argparse.ArgumentTypeError(f"{value!r}: the render factor is a number >= 1 (1 = render at the model's input side)")
    return v


def _seeds(value: str) -> list[int]:
    try:
        out = [int(v) for v in _csv(value)]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r}: give integers separated by commas, e.g. 0,1,2") from None
    if not out:
        raise argparse.ArgumentTypeError("no seed given")
    return list(dict.fromkeys(out))


def _csv(value: str) -> list[str]:
    return [v.strip() for v in value.split(",") if v.strip()]


def _ints(value: str, allowed: Sequence[int]) -> list[int]:
    if value == "all":
        return list(allowed)
    if value == "max":
        return [max(allowed)]
    try:
        out = [int(v) for v in _csv(value)]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r}: give integers separated by commas, 'all' or 'max'") from None
    bad = [v for v in out if v not in allowed]
    if bad:
        raise argparse.ArgumentTypeError(f"severities {bad} not in {list(allowed)}")
    return out


def _directions(value: str) -> list[str]:
    """``--direction``: a comma list of direction names (``both`` = i2t,t2i); image-text and audio/video directions
    do not mix (they need different models and datasets)."""
    from .benchmarks.grid import AV_DIRECTIONS, direction_name

    names: list[str] = []
    for v in _csv(value):
        try:
            names += ["i2t", "t2i"] if v.lower() == "both" else [direction_name(v)]
        except ValueError as err:
            raise argparse.ArgumentTypeError(str(err)) from None
    if not names:
        raise argparse.ArgumentTypeError("no direction given")
    if len({d in AV_DIRECTIONS for d in names}) > 1:
        raise argparse.ArgumentTypeError(f"{value!r} mixes image-text and audio/video directions; run them separately.")
    return list(dict.fromkeys(names))


def _add_common(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model and data")
    g.add_argument("--model", default=None, help="Hugging Face model id or folder for a real run (default: the shipped emoji source model); "
                   "loaded with AutoModel + AutoProcessor. Audio/video directions: CLAP (audio-text), X-CLIP or CLIP (video-text, CLIP "
                   "mean-pools its frame embeddings). Only Hugging Face checkpoints load here: a custom dual encoder (e.g. CAV-MAE for "
                   "video-audio) runs from Python with hf_tta.DualEncoderAdapter and hf_tta.benchmarks.AVTask.")
    g.add_argument("--dataset", default=None, help="With --model: a benchmark built by hf_tta.data.builders (folder or Hub id, configs clean/image-<name>-<s>/text-<name>-<s>), "
                   "or for the audio/video directions an AudioSet-O / AudioSet-D / VGGSound benchmark built by hf_tta.data.builders.audioset "
                   "(a save_av_benchmark folder or Hub id).")
    g.add_argument("--weights", default=None, help="Emoji benchmark: folder of other trained source weights.")
    g.add_argument("--limit", type=_positive_int, default=None, help="Emoji: a seeded slice of this many concepts; Hub: the first N queries of each stream.")
    g.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, ...")
    g.add_argument("--threads", type=_positive_int, default=None, help="torch CPU threads (default: torch's choice).")
    g.add_argument("--seed", type=int, default=0, help="Seeds corruptions, the query order and the objectives' RNG (emoji: also the --limit slice).")
    g.add_argument("--render-factor", type=_render_factor, default=None, help="Emoji: render each query at k x the model's input side, corrupt it "
                   "there, then resize it with the model's preprocessing (COCO-C's protocol); a number >= 1 (default: the benchmark's).")
    g.add_argument("--cache-dir", default=None, help="Emoji: store the query streams and gallery embeddings here and reuse them (a filled cache runs image→text grids without the fonts, corruption packages or MiniLM).")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="hf-tta",
        description=__doc__.split("\n\n")[0] + " Run `hf-tta` alone for the default offline benchmark.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Subcommands have their own --help, e.g. `hf-tta run --help`. A mistake on the command line prints one line "
        "naming the fix (exit status 2); add --debug anywhere for the traceback.",
    )
    sub = parser.add_subparsers(dest="command", metavar="{run,list,clean,plot,merge}")

    run = sub.add_parser("run", help="run a benchmark grid (the default)", description="Run a (shift x severity x objective) grid; "
                         "every run starts from the source model, streams the queries in a seeded order in batches, "
                         "and is scored against the whole gallery.")
    _add_common(run)
    g = run.add_argument_group("grid")
    g.add_argument("--objectives", default=None, help="Comma list of rows, or 'all' (see `hf-tta list`); default tent,tcr,rest (every objective "
                   "with --full). The source model is always a row. Also: oracle, oracle_all (supervised ceilings: the true captions on the "
                   "query tower's LayerNorms / on all its parameters; not methods) and <objective>+gd (with REST's gradient decoupling).")
    g.add_argument("--seeds", type=_seeds, default=None, help="Comma list, e.g. 0,1,2: run every cell once per seed (stream order, corruptions, "
                   "objectives' RNG); tables show mean ± std and a paired bootstrap 95%% interval of each row's difference to the source model. "
                   "Default: --seed.")
    g.add_argument("--direction", type=_directions, default=None, metavar="{i2t,t2i,both,a2t,t2a,v2t,t2v,v2a,a2v}",
                   help="Query->gallery direction(s), a comma list: i2t: image queries / caption gallery; t2i: caption queries / image gallery "
                   "(default i2t; both with --full). With an audio/video --dataset: a2t (audio->text), t2a (text->audio), v2t (video->text), "
                   "t2v (text->video), v2a (video->audio), a2v (audio->video); long forms such as video->audio or video2audio work too. "
                   "Video queries run the dataset's video_* configs, audio queries its audio_* configs, text queries (and VGGSound) clean.")
    g.add_argument("--corruptions", default="default", help="Image corruptions for i2t: comma list, 'all' (16) or 'default' (one per category: gaussian_noise, defocus_blur, snow, contrast). "
                   "Audio/video: the dataset's configs to run (e.g. video_noise_blur,video_diverse; default: all of the query modality's); "
                   "a direction whose query modality has none of them runs clean.")
    g.add_argument("--severities", default="5", help="Image severities: comma list of 1..5, 'all' or 'max'.")
    g.add_argument("--text-corruptions", default="offline", help="Text corruptions for t2i: comma list or 'offline' (every char/word corruption that runs here).")
    g.add_argument("--text-severities", default="7", help="Text severities (char/word 1..7; sentence-level ones have only 1).")
    g.add_argument("--style", dest="style", action="store_true", default=True, help="Add the unseen Noto style (emoji only; default on).")
    g.add_argument("--no-style", dest="style", action="store_false", help="Leave the style shift out.")
    g.add_argument("--diverse", action="store_true", help="Add the diverse stream (each query its own random corruption, REST's -D).")
    g.add_argument("--clean", action="store_true", help="Add the clean stream.")
    g.add_argument("--switch", action="store_true", help="Emoji: add the switching stream (the shift changes every 128 queries, "
                   "cycling through one corruption per family).")
    g.add_argument("--degenerate", action="store_true", help="Add the degenerate stream: --degenerate-batches batches of one "
                   "constant query, then the clean stream, scored on the clean part (a safe method matches the source model).")
    g.add_argument("--degenerate-batches", type=_positive_int, default=200, help="Constant batches before the clean part (default 200).")
    g.add_argument("--full", action="store_true", help="The full severity-5 grid: all 16 image corruptions, both directions with the offline text corruptions, clean, style and diverse shifts, every objective and the two oracle ceilings (unless --objectives is given).")
    a = run.add_argument_group("adaptation")
    a.add_argument("--steps", type=_positive_int, default=3, help="Gradient steps per batch (TCR: 3).")
    a.add_argument("--batch-size", type=_positive_int, default=64, help="Queries per online batch (TCR: 64).")
    a.add_argument("--lr", type=_positive_float, default=None, help="Learning rate (default: the papers' rate for the model and query modality).")
    a.add_argument("--objective-config", default=None, help="JSON of per-objective overrides, e.g. '{\"tent\": {\"tau\": 0.01}}'.")
    a.add_argument("--gradient-decoupling", default=None, metavar="OBJECTIVES",
                   help="Comma list of objectives run with REST's gradient decoupling (Eq. 15-17) on every stream, or 'none'. "
                   "Default: REST's protocol, i.e. rest with gradient decoupling on the diverse streams only.")
    g.add_argument("--shard", default=None, help="K/N: run only every N-th run starting at K (0-based), e.g. to spread a grid over several processes by hand; combine with `hf-tta merge`.")
    o = run.add_argument_group("output")
    o.add_argument("--output-dir", default="outputs/hf-tta", help="Where results.json/.csv/.md and the plots go.")
    o.add_argument("--no-plots", action="store_true", help="Skip the PNG plots.")
    o.add_argument("--quiet", action="store_true", help="No progress bars.")
    o.add_argument("--fresh", action="store_true", help="Ignore the rows an interrupted run with the same arguments left in --output-dir.")

    lst = sub.add_parser("list", help="list objectives, corruptions and styles", description="List what a grid can contain.")
    lst.add_argument("--check-text", action="store_true", help="Also try each text corruption to see whether it runs offline here.")

    clean = sub.add_parser("clean", help="clean R@1/5/10 of the source model in both directions", description="Clean retrieval of the (emoji or --model) source model.")
    _add_common(clean)
    clean.add_argument("--direction", type=_directions, default=None, help="Directions to evaluate (default i2t,t2i; an audio/video dataset needs e.g. a2t,t2a or v2t,t2v; see `hf-tta run --help`).")
    clean.add_argument("--quiet", action="store_true")

    plot = sub.add_parser("plot", help="redraw the plots of a results.json", description="Redraw the PNG plots and tables from a results.json.")
    plot.add_argument("results", help="a results.json written by `hf-tta run`")
    plot.add_argument("--output-dir", default=None, help="default: the results' folder")

    merge = sub.add_parser("merge", help="combine the results.json of several runs or shards", description="Combine results.json files (e.g. of `--shard K/N` runs) into one table, JSON, CSV and plots.")
    merge.add_argument("results", nargs="+", help="results.json files (or the rows.jsonl of an interrupted run)")
    merge.add_argument("--output-dir", required=True)
    merge.add_argument("--no-plots", action="store_true")
    return parser


def _default_to_run(argv: list[str]) -> list[str]:
    if not argv or (argv[0] not in SUBCOMMANDS and argv[0] not in ("-h", "--help")):
        return ["run", *argv]
    return argv


def setup_environment(args) -> None:
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    if args.model is None:
        go_offline()  # the emoji benchmark never needs the network; say so to the Hugging Face libraries
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def go_offline() -> None:
    """Offline mode for the Hugging Face libraries unless the environment says ``HF_HUB_OFFLINE=0``. The hub reads the
    variable once at import (already done by the time a command runs), so its module flag is set too."""
    if os.environ.setdefault("HF_HUB_OFFLINE", "1") == "0":
        return
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    import huggingface_hub.constants

    huggingface_hub.constants.HF_HUB_OFFLINE = True


def _audio_video(args) -> bool:
    from .benchmarks.grid import AV_DIRECTIONS

    av = any(d in AV_DIRECTIONS for d in getattr(args, "direction", None) or ())
    if av and not (args.model and args.dataset):
        raise UsageError("audio/video directions need --model (a Hugging Face CLAP, X-CLIP or CLIP checkpoint) and "
                         "--dataset (an AudioSet-O/-D or VGGSound benchmark built by hf_tta.data.builders.audioset).")
    return av


def make_task(args):
    from .benchmarks.tasks import AVTask, EmojiTask, HubTask

    if args.model is not None or args.dataset is not None:
        if not (args.model and args.dataset):
            raise UsageError("a real run needs both --model and --dataset (or neither, for the emoji benchmark).")
        task_class = AVTask if _audio_video(args) else HubTask
        return task_class(args.model, args.dataset, limit=args.limit, device=args.device)
    return EmojiTask(limit=args.limit, seed=args.seed, weights=args.weights, device=args.device, cache_dir=args.cache_dir,
                     render_factor=getattr(args, "render_factor", None))


def resolve_grid(args) -> tuple[list, dict]:
    """The jobs of ``hf-tta run`` and notes on what was left out."""
    from .benchmarks.grid import (
        DEFAULT_IMAGE_CORRUPTIONS,
        DEFAULT_OBJECTIVES,
        build_grid,
        image_corruption_names,
        offline_text_corruptions,
    )
    from .data.corruptions import IMAGE_SEVERITIES

    if _audio_video(args):
        return resolve_av_grid(args)
    notes: dict = {}
    emoji = args.model is None
    directions = args.direction or (["i2t", "t2i"] if args.full else ["i2t"])
    if args.full:
        corruptions = list(image_corruption_names())
        severities = [5]
        objectives = full_grid_rows() if args.objectives is None else _objectives(args.objectives)
        diverse, clean, style = True, True, emoji
    else:
        corruptions = (
            list(DEFAULT_IMAGE_CORRUPTIONS) if args.corruptions == "default"
            else list(image_corruption_names()) if args.corruptions == "all" else _csv(args.corruptions)
        )
        severities = _ints(args.severities, IMAGE_SEVERITIES)
        objectives = list(DEFAULT_OBJECTIVES) if args.objectives is None else _objectives(args.objectives)
        diverse, clean, style = args.diverse, args.clean, args.style and emoji
    unknown = [c for c in corruptions if c not in image_corruption_names()]
    if unknown:
        raise UsageError(f"unknown image corruptions {unknown}; see `hf-tta list` for the names.")
    text_corruptions: list[str] = []
    text_severities = [7]
    if "t2i" in directions:
        if args.text_corruptions == "offline":
            text_corruptions, missing = offline_text_corruptions()
        else:
            text_corruptions, missing = offline_text_corruptions(_csv(args.text_corruptions))
        if missing:
            notes["text_corruptions_left_out"] = missing
        text_severities = _ints(args.text_severities, range(1, 8))
    notes["text_corruptions"] = text_corruptions
    if args.switch and not emoji:
        raise UsageError("--switch runs on the emoji benchmark only; leave it out with --model (--degenerate works there).")
    jobs = build_grid(
        objectives, directions, corruptions, severities, text_corruptions, text_severities, style=style,
        diverse=diverse, clean=clean, seeds=_run_seeds(args), switch=args.switch, degenerate=args.degenerate,
    )
    return jobs, notes


def _run_seeds(args) -> list[int]:
    return list(args.seeds) if getattr(args, "seeds", None) else [args.seed]


def resolve_av_grid(args) -> tuple[list, dict]:
    """The jobs of an audio/video ``hf-tta run``: each direction over the dataset's configs of its query modality."""
    from .benchmarks.grid import QUERY_MODALITY, av_dataset_configs, build_av_grid

    if args.switch or args.degenerate:
        raise UsageError("--switch and --degenerate are image-text streams; leave them out for the audio/video directions.")
    configs = av_dataset_configs(args.dataset)
    if "clean" not in configs:
        raise UsageError(f"{args.dataset} has no 'clean' config (found {configs}); build it with "
                         "hf_tta.data.builders.audioset.build_av_benchmark.")
    from .benchmarks.grid import DEFAULT_OBJECTIVES

    if args.objectives is None:
        objectives = full_grid_rows() if args.full else list(DEFAULT_OBJECTIVES)
    else:
        objectives = _objectives(args.objectives)
    selected = None
    if not args.full and args.corruptions not in ("default", "all"):
        modalities = {QUERY_MODALITY[d] for d in args.direction}
        selected, unknown = [], []
        for name in _csv(args.corruptions) + (["diverse"] if args.diverse else []):
            names = {name, *(f"{m}_{name}" for m in modalities)}
            found = [c for c in configs if c in names and c.split("_", 1)[0] in modalities]
            selected += found
            unknown += [] if found else [name]
        if unknown:
            raise UsageError(f"{unknown} are not configs of {args.dataset} for {','.join(args.direction)} "
                             f"(its configs: {', '.join(configs)}).")
    jobs = build_av_grid(objectives, args.direction, configs, selected, clean=args.clean or args.full, seeds=_run_seeds(args))
    return jobs, {"dataset_configs": configs}


def full_grid_rows() -> list[str]:
    """The rows of ``--full``: every method (``--objectives all``), then the two oracle ceilings."""
    from .benchmarks.grid import ORACLE_ROWS

    return _objectives("all") + list(ORACLE_ROWS)


def _objectives(value: str) -> list[str]:
    from . import available_objectives
    from .benchmarks.grid import row_spec
    from .objectives import get_objective_class

    methods = [n for n in available_objectives() if not get_objective_class(n).requires_labels]  # not the oracle
    names = methods if value == "all" else _csv(value)
    def known(name: str) -> bool:
        try:
            return name == "source" or row_spec(name).objective in available_objectives()
        except ValueError:
            return False

    unknown = [n for n in names if not known(n)]
    if unknown:
        raise UsageError(f"unknown objectives {unknown}; available: {', '.join(available_objectives())}, oracle_all, "
                         "and <objective>+gd, +safe, +route, +all, +dn, +key (see `hf-tta list`).")
    if not names:
        raise UsageError("--objectives is empty; name at least one, e.g. --objectives tent,tcr.")
    return names


def _gradient_decoupling(value: str | None) -> tuple[str, ...] | None:
    from . import available_objectives

    if value is None:
        return None
    if value.strip().lower() == "none":
        return ()
    names = tuple(_csv(value))
    unknown = [n for n in names if n not in available_objectives()]
    if unknown:
        raise UsageError(f"--gradient-decoupling: unknown objectives {unknown}; give registered names (see `hf-tta list`) or 'none'.")
    return names


def _objective_configs(value: str | None) -> dict:
    if not value:
        return {}
    try:
        data = json.loads(value)
    except json.JSONDecodeError as err:
        raise UsageError(f"--objective-config is not valid JSON ({err.msg} at character {err.pos}); "
                         "write it like '{\"tent\": {\"tau\": 0.01}}'.") from None
    if not isinstance(data, dict) or not all(isinstance(v, dict) for v in data.values()):
        raise UsageError("--objective-config must map objective names to dicts, e.g. '{\"tent\": {\"tau\": 0.01}}'.")
    return data


_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")


def _path_or_hub_id(flag: str, value: str | None, what: str) -> None:
    if value is None or Path(value).expanduser().exists():
        return
    if value.startswith(("/", ".", "~")) or not _HUB_ID.match(value):
        raise UsageError(f"{flag} {value}: no such file or folder, and not a Hub id (owner/name); {what}.")


def _writable_folder(flag: str, value: str | None) -> None:
    if value is None:
        return
    path = Path(value).expanduser()
    for p in (path, *path.parents):
        if p.exists():
            if not p.is_dir():
                raise UsageError(f"{flag} {value}: {p} is a file, not a folder; pass a folder path (it is created if missing).")
            if not os.access(p, os.W_OK):
                raise UsageError(f"{flag} {value}: {p} is not writable; pass a folder you can write to.")
            return


def validate_args(args) -> None:
    """Check what the command line names before anything loads (each mistake: one line that names the fix)."""
    _path_or_hub_id("--model", getattr(args, "model", None), "pass a Hugging Face model id or a saved model folder")
    _path_or_hub_id("--dataset", getattr(args, "dataset", None), "build a benchmark with recipes/build_benchmarks.py and pass its folder")
    weights = getattr(args, "weights", None)
    if weights is not None and not Path(weights).expanduser().is_dir():
        raise UsageError(f"--weights {weights}: no such folder; pass the folder recipes/train_source_model.py wrote.")
    if weights is not None and getattr(args, "model", None):
        raise UsageError("--weights is for the emoji source model; with --model the checkpoint is the model itself.")
    if getattr(args, "render_factor", None) is not None and getattr(args, "model", None):
        raise UsageError("--render-factor applies to the emoji benchmark only; a built --dataset has its own protocol.")
    _writable_folder("--output-dir", getattr(args, "output_dir", None))
    _writable_folder("--cache-dir", getattr(args, "cache_dir", None))
    device = getattr(args, "device", "cpu")
    try:
        import torch

        dev = torch.device(device)
    except RuntimeError:
        raise UsageError(f"--device {device}: not a device name; use cpu, cuda or cuda:N.") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise UsageError(f"--device {device}: CUDA is not available here; use --device cpu.")
    shard = getattr(args, "shard", None)
    if shard:
        m = re.fullmatch(r"(\d+)/(\d+)", shard.strip())
        if not m or not int(m.group(1)) < int(m.group(2)):
            raise UsageError(f"--shard {shard}: write K/N with 0 <= K < N, e.g. --shard 0/2.")


def prepare_run(args, show_progress: bool):
    """What `hf-tta run` and the accelerate recipe share: the grid's jobs, notes, the task and the run settings."""
    from .benchmarks.runner import RunSettings

    validate_args(args)
    objective_configs = _objective_configs(args.objective_config)
    gradient_decoupling = _gradient_decoupling(args.gradient_decoupling)
    jobs, notes = resolve_grid(args)
    task = make_task(args)
    if notes.get("text_corruptions"):
        task.text_corruptions = notes["text_corruptions"]
    settings = RunSettings(
        steps=args.steps, batch_size=args.batch_size, seed=args.seed, lr=args.lr,
        objective_configs=objective_configs, show_progress=show_progress, cache_dir=args.cache_dir,
        gradient_decoupling=gradient_decoupling, degenerate_batches=args.degenerate_batches,
    )
    return jobs, notes, task, settings


RUN_HEADER = "hf-tta-run"
#: Options that change no result: a rerun that differs only in these continues an interrupted run.
_PRESENTATION = ("output_dir", "quiet", "no_plots", "fresh", "threads", "command")


def run_signature(args) -> dict:
    """The arguments that define a run's rows (what a rerun must repeat to continue from them)."""
    return {k: v for k, v in sorted(vars(args).items()) if k not in _PRESENTATION}


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
    from .benchmarks.report import build_tables, format_table, row_key, won_back_line, write_outputs
    from .benchmarks.runner import GridRunner

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
        if header == signature:
            wanted = {row_key({"direction": j.condition.direction, "shift": j.condition.shift, "severity": j.condition.severity,
                               "objective": j.objective, "seed": j.seed}): j for j in jobs}
            done = [r for r in earlier if "error" not in r and row_key(r) in wanted]
            finished = {row_key(r) for r in done}
            jobs = [j for k_, j in wanted.items() if k_ not in finished]
            if done:
                print(f"hf-tta: resuming the interrupted run in {progress}: {len(done)} runs already done, {len(jobs)} to go "
                      "(--fresh starts over).", flush=True)
        elif earlier:
            print(f"hf-tta: {progress} holds the rows of a run with other arguments; starting afresh.", flush=True)
    with open(progress, "w") as f:
        f.write(json.dumps({RUN_HEADER: signature}) + "\n")
        for r in done:
            f.write(json.dumps(r, default=str) + "\n")

    def save(row):
        with open(progress, "a") as f:
            f.write(json.dumps(row, default=str) + "\n")

    runner = GridRunner(task, settings)
    runner.remember(done)
    rows = done + runner.run_all(jobs, on_row=save)
    if done:
        from .benchmarks.report import merge_rows

        rows = merge_rows(rows)
    meta = {
        "command": "hf-tta " + " ".join(sys.argv[1:]),
        "task": task.describe(),
        "settings": vars(settings) | {"device": args.device, "seeds": _run_seeds(args)},
        "notes": notes,
        "resumed_rows": len(done),
        "seconds": round(time.time() - t0, 1),
        "versions": _versions(),
    }
    paths = write_outputs(rows, args.output_dir, meta, plots=not args.no_plots)
    print()
    for table in build_tables(rows):
        print(format_table(table))
        print()
        print(won_back_line(table))
        print()
    errors = [r for r in rows if "error" in r]
    for r in errors:
        print(f"hf-tta: {r['objective']} on {r['direction']}/{r['shift']} (seed {r.get('seed', 0)}) failed: {r['error']}", file=sys.stderr)
    print(f"\nwrote {', '.join(paths.values())} ({time.time() - t0:.0f} s)")
    return 1 if errors and len(errors) == len(rows) else 0


def cmd_list(args) -> int:
    from . import available_objectives
    from .benchmarks.emoji import STYLES
    from .benchmarks.grid import DEFAULT_IMAGE_CORRUPTIONS, image_corruption_names, offline_text_corruptions
    from .data.corruptions import TEXT_CORRUPTIONS
    from .preset import RECOMMENDED_ROW

    print("objectives:       " + ", ".join(available_objectives()))
    print("image corruptions: " + ", ".join(image_corruption_names()) + " (severities 1..5)")
    print("  default grid:    " + ", ".join(DEFAULT_IMAGE_CORRUPTIONS))
    print("text corruptions:  " + ", ".join(TEXT_CORRUPTIONS) + " (char/word 1..7, sentence 1)")
    if args.check_text:
        go_offline()  # a seq2seq corruption whose checkpoint is not cached is reported, not downloaded
        ok, missing = offline_text_corruptions(TEXT_CORRUPTIONS)
        print("  runs here:       " + ", ".join(ok))
        for name, why in missing.items():
            print(f"  not here:        {name}: {why}")
    print("emoji styles:      " + ", ".join(STYLES) + " (openmoji = source, noto = unseen)")
    print("other shifts:      clean, noto (style), diverse; switch (every 128 queries), degenerate (constant prefix)")
    print("ceiling rows:      oracle (true captions, LayerNorms), oracle_all (true captions, every query-tower parameter)")
    print("row options:       <objective>+gd (REST's gradient decoupling; rest uses it on diverse streams by default),")
    print("                   +safe (the safety layer), +route (per-domain adapters, unsupervised router),")
    print("                   +all (every query-tower parameter), +dn (DN score transform),")
    print("                   +key (one adapter per true shift: a routing ceiling); combine: tcr+gd+safe")
    print("preset row:        recommended (TTAConfig.recommended: " + RECOMMENDED_ROW + ")")
    from .benchmarks.grid import AV_DIRECTIONS
    from .data.builders.audioset import AV_BENCHMARKS

    print("audio/video:       --direction " + ", ".join(f"{d} ({q}->{g})" for d, (q, g) in AV_DIRECTIONS.items()))
    for name, configs in AV_BENCHMARKS.items():
        print(f"  {name + ':':<16} " + ", ".join(configs))
    return 0


def cmd_clean(args) -> int:
    from .benchmarks.grid import SOURCE, Condition, Job
    from .benchmarks.runner import GridRunner, RunSettings

    validate_args(args)
    setup_environment(args)
    task = make_task(args)
    runner = GridRunner(task, RunSettings(seed=args.seed, show_progress=not args.quiet))
    out = {}
    for d in args.direction or ("i2t", "t2i"):
        row = runner.run(Job(Condition(d, "clean"), SOURCE))
        out[d] = {k: row.get(k) for k in ("R@1", "R@5", "R@10", "num_queries", "gallery_size", "error") if k in row}
    print(json.dumps({"task": task.describe(), "clean": out}, indent=1, default=str))
    return 0


def cmd_plot(args) -> int:
    from .benchmarks.report import build_tables, draw_plots, format_table

    data = _read_results(args.results)
    _writable_folder("--output-dir", args.output_dir)
    folder = Path(args.output_dir or Path(args.results).parent)
    folder.mkdir(parents=True, exist_ok=True)
    paths = draw_plots(data["rows"], folder)
    for t in build_tables(data["rows"]):
        print(format_table(t), end="\n\n")
    print("wrote " + ", ".join(paths.values()))
    return 0


def cmd_merge(args) -> int:
    from .benchmarks.report import build_tables, format_table, merge_rows, write_outputs

    _writable_folder("--output-dir", args.output_dir)
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


def _versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for name in ("hf_tta", "torch", "transformers", "peft"):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = "missing"
    return out


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


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point. A user mistake prints one line naming the fix and returns 2; any other failure prints one line
    and returns 1; ``--debug`` (anywhere on the command line) shows the traceback instead."""
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv
    argv = [a for a in argv if a != "--debug"]
    handlers = {"run": cmd_run, "list": cmd_list, "clean": cmd_clean, "plot": cmd_plot, "merge": cmd_merge}
    try:
        args = build_parser().parse_args(_default_to_run(argv))
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


if __name__ == "__main__":
    sys.exit(main())
