"""What ``hf-tta run`` will do: the grid of jobs (image-text or audio/video), the objectives and their configs, the
task (emoji, Hub or audio/video benchmark) and the run settings, all from the parsed arguments."""

from __future__ import annotations

import json
from typing import Sequence

from .arguments import UsageError, comma_list, validate_args


def _ints(value: str, allowed: Sequence[int], flag: str) -> list[int]:
    """A ``--severities``-style value (a comma list, ``all`` or ``max``); a bad one is a :class:`UsageError`."""
    if value == "all":
        return list(allowed)
    if value == "max":
        return [max(allowed)]
    try:
        out = [int(v) for v in comma_list(value)]
    except ValueError:
        raise UsageError(f"{flag} {value!r}: give integers separated by commas, 'all' or 'max'.") from None
    bad = [v for v in out if v not in allowed]
    if bad:
        raise UsageError(f"{flag}: severities {bad} not in {list(allowed)}; e.g. {flag} {max(allowed)}.")
    return out


def _audio_video(args) -> bool:
    from ..benchmarks.grid import AV_DIRECTIONS

    av = any(d in AV_DIRECTIONS for d in getattr(args, "direction", None) or ())
    if av and not (args.model and args.dataset):
        raise UsageError("audio/video directions need --model (a Hugging Face CLAP, X-CLIP or CLIP checkpoint) and "
                         "--dataset (an AudioSet-O/-D or VGGSound benchmark built by hf_tta.data.builders.audioset).")
    return av


def make_task(args):
    from ..benchmarks.tasks import AVTask, EmojiTask, HubTask

    audio_video = _audio_video(args)  # an audio/video direction needs --model and --dataset
    if args.model is not None or args.dataset is not None:
        if not (args.model and args.dataset):
            raise UsageError("a real run needs both --model and --dataset (or neither, for the emoji benchmark).")
        task_class = AVTask if audio_video else HubTask
        return task_class(args.model, args.dataset, limit=args.limit, device=args.device)
    return EmojiTask(limit=args.limit, seed=args.seed, weights=args.weights, device=args.device, cache_dir=args.cache_dir,
                     render_factor=getattr(args, "render_factor", None))


def resolve_grid(args) -> tuple[list, dict]:
    """The jobs of ``hf-tta run`` and notes on what was left out."""
    from ..benchmarks.grid import (
        DEFAULT_IMAGE_CONDITIONS,
        DEFAULT_OBJECTIVES,
        FULL_IMAGE_SEVERITIES,
        build_grid,
        image_corruption_names,
        offline_text_corruptions,
    )
    from ..data.corruptions import IMAGE_SEVERITIES

    if _audio_video(args):
        return resolve_av_grid(args)
    notes: dict = {}
    emoji = args.model is None
    directions = args.direction or (["i2t", "t2i"] if args.full else ["i2t"])
    pairs = None  # (corruption, severity) streams of the default grid
    if args.full:
        corruptions = list(image_corruption_names())
        severities = list(FULL_IMAGE_SEVERITIES) if args.severities is None else _ints(args.severities, IMAGE_SEVERITIES, "--severities")
        objectives = full_grid_rows() if args.objectives is None else _objectives(args.objectives)
        diverse, clean, style = True, True, emoji
    else:
        if args.corruptions == "default" and args.severities is None:
            pairs = [tuple(p) for p in DEFAULT_IMAGE_CONDITIONS]
        corruptions = (
            [c for c, _ in DEFAULT_IMAGE_CONDITIONS] if args.corruptions == "default"
            else list(image_corruption_names()) if args.corruptions == "all" else comma_list(args.corruptions)
        )
        severities = _ints(args.severities or "5", IMAGE_SEVERITIES, "--severities")
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
            from ..data.corruptions import TEXT_CORRUPTIONS

            named = comma_list(args.text_corruptions)
            unknown = [n for n in named if n not in TEXT_CORRUPTIONS]
            if unknown:
                raise UsageError(f"unknown text corruptions {unknown}; choose from {', '.join(TEXT_CORRUPTIONS)} or 'offline'.")
            text_corruptions, missing = offline_text_corruptions(named)
        if missing:
            notes["text_corruptions_left_out"] = missing
        text_severities = _ints(args.text_severities, range(1, 8), "--text-severities")
    notes["text_corruptions"] = text_corruptions
    if args.switch and not emoji:
        raise UsageError("--switch runs on the emoji benchmark only; leave it out with --model (--degenerate works there).")
    jobs = build_grid(
        objectives, directions, corruptions, severities, text_corruptions, text_severities, style=style,
        diverse=diverse, clean=clean, seeds=run_seeds(args), switch=args.switch, degenerate=args.degenerate,
        image_conditions=pairs,
    )
    return jobs, notes


def run_seeds(args) -> list[int]:
    """The seeds every cell runs with: ``--seeds``, else ``--seed``."""
    return list(args.seeds) if getattr(args, "seeds", None) else [args.seed]


def resolve_av_grid(args) -> tuple[list, dict]:
    """The jobs of an audio/video ``hf-tta run``: each direction over the dataset's configs of its query modality."""
    from ..benchmarks.grid import QUERY_MODALITY, av_dataset_configs, build_av_grid

    if args.switch or args.degenerate:
        raise UsageError("--switch and --degenerate are image-text streams; leave them out for the audio/video directions.")
    configs = av_dataset_configs(args.dataset)
    if "clean" not in configs:
        raise UsageError(f"{args.dataset} has no 'clean' config (found {configs}); build it with "
                         "hf_tta.data.builders.audioset.build_av_benchmark.")
    from ..benchmarks.grid import DEFAULT_OBJECTIVES

    if args.objectives is None:
        objectives = full_grid_rows() if args.full else list(DEFAULT_OBJECTIVES)
    else:
        objectives = _objectives(args.objectives)
    selected = None
    if not args.full and args.corruptions not in ("default", "all"):
        modalities = {QUERY_MODALITY[d] for d in args.direction}
        selected, unknown = [], []
        for name in comma_list(args.corruptions) + (["diverse"] if args.diverse else []):
            names = {name, *(f"{m}_{name}" for m in modalities)}
            found = [c for c in configs if c in names and c.split("_", 1)[0] in modalities]
            selected += found
            unknown += [] if found else [name]
        if unknown:
            raise UsageError(f"{unknown} are not configs of {args.dataset} for {','.join(args.direction)} "
                             f"(its configs: {', '.join(configs)}).")
    jobs = build_av_grid(objectives, args.direction, configs, selected, clean=args.clean or args.full, seeds=run_seeds(args))
    return jobs, {"dataset_configs": configs}


def full_grid_rows() -> list[str]:
    """The rows of ``--full``: every method (``--objectives all``), then the two oracle ceilings."""
    from ..benchmarks.grid import ORACLE_ROWS

    return _objectives("all") + list(ORACLE_ROWS)


def _objectives(value: str) -> list[str]:
    from .. import available_objectives
    from ..benchmarks.grid import row_spec
    from ..objectives import get_objective_class

    methods = [n for n in available_objectives() if not get_objective_class(n).requires_labels]  # not the oracle
    names = methods if value == "all" else comma_list(value)
    def known(name: str) -> bool:
        try:
            return name == "source" or row_spec(name).objective in available_objectives()
        except ValueError:
            return False

    unknown = [n for n in names if not known(n)]
    if unknown:
        raise UsageError(f"unknown objectives {unknown}; available: {', '.join(available_objectives())}, oracle_all, "
                         "and <objective>+gd, +safe, +route, +all, +dn, +key (see `hf-tta list`).")
    free = [n for n in names if n != "source" and row_spec(n).gd and not get_objective_class(row_spec(n).objective).requires_grad]
    if free:
        raise UsageError(f"{free}: gradient decoupling (+gd) needs a gradient objective; leave +gd off training-free ones.")
    if not names:
        raise UsageError("--objectives is empty; name at least one, e.g. --objectives tent,tcr.")
    return names


def _gradient_decoupling(value: str | None) -> tuple[str, ...] | None:
    from .. import available_objectives
    from ..objectives import get_objective_class

    if value is None:
        return None
    if value.strip().lower() == "none":
        return ()
    names = tuple(comma_list(value))
    unknown = [n for n in names if n not in available_objectives()]
    if unknown:
        raise UsageError(f"--gradient-decoupling: unknown objectives {unknown}; give registered names (see `hf-tta list`) or 'none'.")
    free = [n for n in names if not get_objective_class(n).requires_grad]
    if free:
        raise UsageError(f"--gradient-decoupling: {free} are training-free; it applies to gradient objectives only.")
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
    from ..benchmarks.grid import row_spec
    from ..config import TTAConfig

    for key, overrides in data.items():  # a row ("tcr+safe") or an objective ("tcr"); checked now, not per run
        try:
            TTAConfig(objective=row_spec(key).objective, objective_config=overrides)
        except ValueError as err:
            raise UsageError(f"--objective-config {key!r}: {str(err).splitlines()[0]}") from None
    return data


def prepare_run(args, show_progress: bool):
    """What `hf-tta run` and the accelerate recipe share: the grid's jobs, notes, the task and the run settings."""
    from ..benchmarks.runner import RunSettings

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
