"""What ``hf-tta run`` will do: the grid of jobs (image-text or audio/video), the objectives and their configs, the
task (emoji, Hub or audio/video benchmark) and the run settings, all from the parsed arguments."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

from .arguments import UsageError, comma_list, validate_args
from .common import say
from .image_streams import check_image_stream_flags
from .text_corruptions import check_text_streams, refuse_missing


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


def _composed(args) -> bool:
    """Whether this run is composed image retrieval (``--direction c2i``, or a composed build as ``--dataset``, whose
    direction then defaults to c2i)."""
    from ..data.builders.composed_hub import is_composed_build

    built = bool(getattr(args, "dataset", None)) and is_composed_build(args.dataset)
    directions = getattr(args, "direction", None)
    if built and directions is None:
        args.direction = directions = ["c2i"]
    wants = "c2i" in (directions or ())
    if built and not wants:
        raise UsageError(f"{args.dataset} is a composed image retrieval build: run it with --direction c2i.")
    if wants and (len(directions) > 1 or not built and args.dataset and Path(str(args.dataset)).is_dir()):
        raise UsageError("--direction c2i runs alone, on a FIQ or CIRR build of `hf-tta build --fashioniq/--cirr`.")
    if wants and not (args.model and args.dataset):
        raise UsageError("--direction c2i needs --model (a Blip2ForImageTextRetrieval checkpoint) and --dataset (a composed build).")
    return wants


def resolve_composed_grid(args) -> tuple[list, dict]:
    """The jobs of a composed run: the build's query configs (``--corruptions`` picks some; ``clean`` with --clean)."""
    from ..benchmarks.composed_task import composed_dataset_configs
    from ..benchmarks.grid import DEFAULT_OBJECTIVES, Condition, jobs_for

    configs = composed_dataset_configs(args.dataset)
    shifts = [c for c in configs if c != "clean"]
    if not args.full and args.corruptions not in ("default", "all"):
        named = comma_list(args.corruptions) + (["diverse"] if args.diverse else [])
        unknown = [n for n in named if n not in shifts]
        if unknown:
            raise UsageError(f"{unknown} are not configs of {args.dataset} (it has {', '.join(configs)}).")
        shifts = named
    objectives = (full_grid_rows() if args.full else list(DEFAULT_OBJECTIVES)) if args.objectives is None else _objectives(args.objectives)
    clean = Condition("c2i", "clean")
    conds = ([clean] if args.clean or args.full or not shifts else []) + [Condition("c2i", s) for s in shifts]
    references = [] if clean in conds or "clean" not in configs else [clean]
    return jobs_for(conds, objectives, run_seeds(args), references), {"dataset_configs": configs}


def make_task(args):
    from ..benchmarks.hub_task import AVTask, HubTask
    from ..benchmarks.tasks import EmojiTask

    if _composed(args):
        from ..benchmarks.composed_task import ComposedTask

        return ComposedTask(args.model, args.dataset, limit=args.limit, device=args.device)
    audio_video = _audio_video(args)  # an audio/video direction needs --model and --dataset
    if args.model is not None or args.dataset is not None:
        if not (args.model and args.dataset):
            raise UsageError("a real run needs both --model and --dataset (or neither, for the emoji benchmark).")
        from ..extras import require

        require("datasets", "--dataset")  # one line naming the extra, before the model loads
        task_class = AVTask if audio_video else HubTask
        return task_class(args.model, args.dataset, limit=args.limit, device=args.device)
    return EmojiTask(limit=args.limit, seed=args.seed, weights=args.weights, device=args.device, cache_dir=args.cache_dir,
                     **{k: getattr(args, k, None) for k in ("render_factor", "concepts", "stream_corruptions")})


def resolve_grid(args) -> tuple[list, dict]:
    """The jobs of ``hf-tta run`` and notes on what was left out."""
    from ..benchmarks.grid import (
        DEFAULT_IMAGE_CONDITIONS,
        DEFAULT_OBJECTIVES,
        FULL_IMAGE_SEVERITIES,
        build_grid,
        image_corruption_names,
        known_image_corruptions,
        offline_text_corruptions,
    )
    from ..data.corruptions import IMAGE_SEVERITIES, TEXT_CORRUPTIONS

    if _composed(args):
        return resolve_composed_grid(args)
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
    unknown = [c for c in corruptions if c not in known_image_corruptions()]
    if unknown:
        raise UsageError(f"unknown image corruptions {unknown}; see `hf-tta list` for the names.")
    built = None if args.full else built_streams(args)
    if built is not None and built["image"] and args.corruptions == "default" and args.severities is None:
        pairs = built["image"]  # a user's build: the streams it has, not the emoji grid's
        corruptions = list(dict.fromkeys(c for c, _ in pairs))
        diverse = diverse or built["diverse"]
        notes["streams_from_build"] = [f"image-{c}-{s}" for c, s in pairs]
    text_corruptions: list[str] = []
    text_severities = [7]
    if "t2i" in directions:
        if built is not None and built["text"] and args.text_corruptions == "offline" and args.text_severities == "7":
            text_corruptions = list(dict.fromkeys(c for c, _ in built["text"]))  # the build's text streams
            text_severities = sorted({s for _, s in built["text"]})
            diverse = diverse or built["diverse"]
            notes["streams_from_build"] = notes.get("streams_from_build", []) + [f"text-{c}-{s}" for c, s in built["text"]]
        else:
            if args.text_corruptions == "offline":
                text_corruptions, missing = offline_text_corruptions()
            else:
                named = comma_list(args.text_corruptions)
                unknown = [n for n in named if n not in TEXT_CORRUPTIONS]
                if unknown:
                    raise UsageError(f"unknown text corruptions {unknown}; choose from {', '.join(TEXT_CORRUPTIONS)} or 'offline'.")
                text_corruptions, missing = offline_text_corruptions(named)
                if missing:  # named ones are the user's grid: run them from the stream cache or refuse, never drop them
                    if not (emoji and args.cache_dir):
                        refuse_missing(missing)
                    notes["text_corruptions_from_cache"] = missing  # prepare_run checks every stream is cached
                    text_corruptions, missing = list(named), {}
            if missing:
                notes["text_corruptions_left_out"] = missing
            text_severities = _ints(args.text_severities, range(1, 8), "--text-severities")
    if notes.get("streams_from_build"):
        say(f"--dataset {args.dataset}: running the {len(notes['streams_from_build'])} corruption streams it has "
            "(--corruptions / --text-corruptions pick others)")
    notes["text_corruptions"] = text_corruptions
    check_image_stream_flags(args, emoji, diverse, directions)
    jobs = build_grid(
        objectives, directions, corruptions, severities, text_corruptions, text_severities, style=style,
        diverse=diverse, clean=clean, seeds=run_seeds(args), switch=args.switch, degenerate=args.degenerate,
        image_conditions=pairs,
    )
    return jobs, notes


def built_streams(args) -> dict | None:
    """The corruption streams a local ``--dataset`` build holds: ``{"image": [(corruption, severity), ...], "text":
    [...], "diverse": bool}`` in the library's order; ``None`` when it is not such a folder or holds no corruption
    config (a real-world set: clean only)."""
    if not getattr(args, "dataset", None) or not Path(str(args.dataset)).expanduser().is_dir():
        return None
    from ..data.builders.base import built_configs
    from ..data.builders.specs import parse_config_name
    from ..data.corruptions import ALL_IMAGE_CORRUPTIONS, TEXT_CORRUPTIONS

    specs = []
    for name in built_configs(Path(str(args.dataset)).expanduser()):
        try:
            specs.append(parse_config_name(name))
        except ValueError:
            continue
    order = {n: i for i, n in enumerate((*ALL_IMAGE_CORRUPTIONS, *TEXT_CORRUPTIONS))}
    pick = lambda modality: sorted(((c.corruption, c.severity) for c in specs if c.modality == modality and c.severity is not None),  # noqa: E731
                                   key=lambda p: (order.get(p[0], len(order)), p[1]))
    image, text = pick("image"), pick("text")
    if not image and not text:
        return None
    return {"image": image, "text": text, "diverse": any(c.corruption == "diverse" for c in specs)}


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
        except ValueError as err:  # a malformed option (two score transforms, a budget of 0 %): its own one line
            if name.split("+")[0].split("@")[0] in (*available_objectives(), "oracle_all", "recommended"):
                raise UsageError(str(err)) from None
            return False

    unknown = [n for n in names if not known(n)]
    if unknown:
        raise UsageError(f"unknown objectives {unknown}; available: {', '.join(available_objectives())}, oracle_all, "
                         "and <objective>+gd, +safe, +route, +all, +dn / +nnn / +qbnorm, +key, +b<percent> (see `hf-tta list`).")
    free = [n for n in names if n != "source" and row_spec(n).gd and not get_objective_class(row_spec(n).objective).requires_grad]
    if free:
        raise UsageError(f"{free}: gradient decoupling (+gd) needs a gradient objective; leave +gd off training-free ones.")
    if not names:
        raise UsageError("--objectives is empty; name at least one, e.g. --objectives tent,tcr.")
    return names


def _gradient_decoupling(value: str | None, rows: list[str]) -> tuple[str, ...] | None:
    """``--gradient-decoupling``: a comma list of objectives, ``none``/``false``, or ``true`` (TTAConfig's boolean:
    every gradient objective of the grid)."""
    from .. import available_objectives
    from ..benchmarks.grid import SOURCE, row_spec
    from ..objectives import get_objective_class

    if value is None:
        return None
    if value.strip().lower() in ("none", "false"):
        return ()
    if value.strip().lower() == "true":
        return tuple(dict.fromkeys(row_spec(r).objective for r in rows if r != SOURCE
                                   and get_objective_class(row_spec(r).objective).requires_grad))
    names = tuple(comma_list(value))
    unknown = [n for n in names if n not in available_objectives()]
    if unknown:
        raise UsageError(f"--gradient-decoupling: unknown objectives {unknown}; give registered names (see `hf-tta list`), 'true' or 'none'.")
    free = [n for n in names if not get_objective_class(n).requires_grad]
    if free:
        raise UsageError(f"--gradient-decoupling: {free} are training-free; it applies to gradient objectives only.")
    return names


def _objective_configs(value: str | None, rows: list[str]) -> dict:
    """``--objective-config``: per-row overrides (``{"tent": {"tau": 0.01}}``), or TTAConfig.objective_config's plain
    form (``{"tau": 0.01}``) when the grid has one objective."""
    from ..benchmarks.grid import SOURCE, row_spec

    if not value:
        return {}
    try:
        data = json.loads(value)
    except json.JSONDecodeError as err:
        raise UsageError(f"--objective-config is not valid JSON ({err.msg} at character {err.pos}); "
                         "write it like '{\"tent\": {\"tau\": 0.01}}'.") from None
    if not isinstance(data, dict):
        raise UsageError("--objective-config must map objective names to dicts, e.g. '{\"tent\": {\"tau\": 0.01}}'.")
    objectives = list(dict.fromkeys(row_spec(r).objective for r in rows if r != SOURCE))
    if data and not any(isinstance(v, dict) for v in data.values()) and not set(data) & set(rows + objectives):
        if len(objectives) != 1:  # TTAConfig.objective_config's plain form needs one objective
            raise UsageError(f"--objective-config {value}: the grid runs {objectives}; map each to its overrides, "
                             "e.g. '{\"tent\": {\"tau\": 0.01}}'.")
        data = {objectives[0]: data}
    if not all(isinstance(v, dict) for v in data.values()):
        raise UsageError("--objective-config must map objective names to dicts, e.g. '{\"tent\": {\"tau\": 0.01}}'.")
    from ..config import TTAConfig

    for key, overrides in data.items():  # a row ("tcr+safe") or an objective ("tcr"); checked now, not per run
        try:
            TTAConfig(objective=row_spec(key).objective, objective_config=overrides)
        except ValueError as err:
            raise UsageError(f"--objective-config {key!r}: {str(err).splitlines()[0]}") from None
    return data


def run_directions(args) -> list[str]:
    """The directions of ``hf-tta run``: ``--direction``, else i2t (both with ``--full``)."""
    return list(args.direction or (["i2t", "t2i"] if args.full else ["i2t"]))


#: The gallery-softmax baselines whose temperature the papers tune per dataset (TCR App. B.2, REST Supp. C-B).
BASELINE_TAU_OBJECTIVES = ("tent", "pl", "shot", "eata", "sar", "read", "deyo", "oracle")


def _dataset_tau(args, objective_configs: dict, notes: dict) -> dict:
    """The baselines' temperature of a built dataset (its spec's ``baseline_tau``: 0.001 Fashion-Gen, 1e-4 ReID) for
    every baseline the user did not configure; logged in the notes and printed."""
    from ..data.builders.loading import built_spec

    spec = built_spec(args.dataset) if getattr(args, "dataset", None) else None
    if spec is None:
        return objective_configs
    from .. import available_objectives

    out = dict(objective_configs)
    applied = []
    for name in BASELINE_TAU_OBJECTIVES:
        if name in available_objectives() and "tau" not in out.get(name, {}):
            out[name] = {**out.get(name, {}), "tau": spec.baseline_tau}
            applied.append(name)
    if applied:
        notes["baseline_tau"] = {"tau": spec.baseline_tau, "benchmark": spec.name, "objectives": applied}
        say(f"{spec.name}: baselines {', '.join(applied)} use tau = {spec.baseline_tau:g} (the papers' value for this set; "
            "--objective-config overrides it)")
    return out


def _dataset_gd(args, notes: dict) -> tuple[str, ...] | None:
    """REST's gradient decoupling for ``rest`` on every stream of a diverse-stream set (Fashion-Gen-D: "the gradient
    decoupling module is employed under the DQS setting"); ``None`` (the runner's default) elsewhere."""
    from ..data.builders.loading import built_spec

    spec = built_spec(args.dataset) if getattr(args, "dataset", None) else None
    if spec is None or not spec.diverse_stream:
        return None
    notes["gradient_decoupling"] = {"objectives": ["rest"], "why": f"{spec.name} is a diverse-stream set (REST's DQS)"}
    say(f"{spec.name}: rest runs with gradient decoupling (REST's DQS protocol; --gradient-decoupling overrides it)")
    return ("rest",)


def _built_jobs(args, task, jobs: list, notes: dict) -> list:
    """The jobs whose config a local built dataset has (a real-world set holds only ``clean``); the others are left
    out with a note, and none left is a :class:`UsageError` naming the configs there."""
    from ..benchmarks.composed_task import ComposedTask
    from ..benchmarks.hub_task import AVTask, HubTask
    from ..data.builders.base import built_configs

    if not isinstance(task, HubTask) or isinstance(task, (AVTask, ComposedTask)) or not Path(str(args.dataset)).is_dir():
        return jobs
    available = set(built_configs(args.dataset))
    if not available:
        return jobs  # a Hub-layout folder: load_dataset reads it
    keep = [j for j in jobs if task._config(j.condition) in available]
    dropped = sorted({task._config(j.condition) for j in jobs} - available)
    if dropped:
        notes["configs_not_built"] = dropped
        say(f"{len(dropped)} streams left out: not built in {args.dataset} ({', '.join(dropped[:6])}"
            f"{', ...' if len(dropped) > 6 else ''})")
    if not keep:
        raise UsageError(f"{args.dataset} has none of the configs this grid needs; it has {', '.join(sorted(available))} "
                         "(a real-world set holds only clean: add --clean).")
    return keep


#: How ``hf-tta run`` scores every row unless ``--scoring`` is given (protocol v3): prequentially, each batch answered
#: by the model as it was before adapting on it (what a service answers); ``--scoring after_update`` is the papers'.
RUN_SCORING = "before_update"


def prepare_run(args, show_progress: bool):
    """What `hf-tta run` and the accelerate recipe share: the grid's jobs, notes, the task and the run settings.

    The adaptation options (TTAConfig's fields, :mod:`hf_tta.cli.config_args`) are resolved first; every row's config
    is then built by the runner and validated by ``TTAConfig`` before anything runs (one path with the Python API)."""
    from ..benchmarks.grid import SOURCE
    from ..benchmarks.runner import GridRunner, RunSettings
    from .config_args import apply_config

    if args.dataset:
        from ..extras import require

        require("datasets", "--dataset")  # one line naming the extra, before anything reads the folder
    validate_args(args)
    overrides = apply_config(args, run_directions(args))
    if "scoring" not in overrides:  # protocol v3: every row of the tables is prequential unless --scoring says otherwise
        overrides["scoring"] = args.scoring = RUN_SCORING
    jobs, notes = resolve_grid(args)
    rows = list(dict.fromkeys(j.objective for j in jobs))
    objective_configs = _objective_configs(args.objective_config, rows)
    gradient_decoupling = _gradient_decoupling(args.gradient_decoupling, rows)
    check_dataset_configs(args, jobs)
    task = make_task(args)
    if args.model:  # a checkpoint hf_tta cannot adapt (e.g. saved as BlipModel) fails now, not in every run
        from ..models import get_adapter

        try:
            get_adapter(task.model)
        except ValueError as err:
            raise UsageError(f"--model {args.model}: {str(err).splitlines()[0]}") from None
    jobs = _built_jobs(args, task, jobs, notes)
    objective_configs = _dataset_tau(args, objective_configs, notes)
    if gradient_decoupling is None:
        gradient_decoupling = _dataset_gd(args, notes)
    if notes.get("text_corruptions"):
        task.text_corruptions = notes["text_corruptions"]
    check_text_streams(task, jobs, notes.get("text_corruptions_from_cache", {}), args.model is None, args.cache_dir)
    settings = RunSettings(
        steps=args.steps, batch_size=args.batch_size, seed=args.seed, lr=args.lr,
        gallery_batch_size=args.gallery_batch_size, config_overrides=overrides,
        objective_configs=objective_configs, show_progress=show_progress, cache_dir=args.cache_dir,
        gradient_decoupling=gradient_decoupling, degenerate_batches=args.degenerate_batches,
    )
    runner, checked = GridRunner(task, settings), set()
    for job in jobs:
        key = (job.objective, job.condition.direction, job.condition.shift)
        if job.objective == SOURCE or key in checked:
            continue
        checked.add(key)
        try:
            runner.row_config(job.objective, job.condition, job.seed)
        except (TypeError, ValueError) as err:
            raise UsageError(f"row {job.objective!r}: {str(err).splitlines()[0]}") from None
    return jobs, notes, task, settings


def check_dataset_configs(args, jobs) -> None:
    """A local image-text benchmark folder must hold every config the grid reads: else one line naming the missing
    ones and what the folder has, before anything runs."""
    from pathlib import Path

    from ..benchmarks.grid import AV_DIRECTIONS

    if not args.dataset or any(d in AV_DIRECTIONS for d in run_directions(args)):
        return
    folder = Path(args.dataset).expanduser()
    if not folder.is_dir():
        return
    from ..benchmarks.hub_task import image_text_config
    from ..data.builders.base import built_configs

    have = set(built_configs(folder))
    if (folder / "README.md").is_file():  # a Hub-layout folder: its configs are in the card
        try:
            from datasets import get_dataset_config_names

            have |= set(get_dataset_config_names(str(folder)))
        except Exception:  # the loader reports what is wrong with the card
            return
    needed = {"clean"} | {image_text_config(j.condition) for j in jobs}
    missing = sorted(needed - have)
    named = getattr(args, "corruptions", "default") not in ("default", "all") or getattr(args, "text_corruptions", "offline") != "offline"
    if missing and not named:
        return  # the grid's defaults: streams the folder lacks are left out with a note (_built_jobs)
    if missing:
        from .build import add_configs_command

        raise UsageError(f"--dataset {args.dataset} has no config {', '.join(missing)} (it has: {', '.join(sorted(have)) or 'none'}); "
                         f"leave it out of --corruptions / --text-corruptions or add it to the build: {add_configs_command(args.dataset, missing)}.")
