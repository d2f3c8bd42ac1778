"""The ``hf-tta`` command line: its parser, the argument types, and the checks on what the arguments name.

:func:`build_parser` defines every subcommand's options and help; the ``_positive_int`` ... ``_directions`` types
turn a bad value into argparse's one-line error; :func:`validate_args` checks the paths, device and shard before
anything loads. Every mistake is a :class:`UsageError`: one line that names the fix, exit status 2.
"""

from __future__ import annotations

import argparse
import copy
import os
import re
from pathlib import Path

from .common import UsageError, comma_list

SUBCOMMANDS = ("run", "build", "list", "clean", "plot", "merge", "serve")



class _Parser(argparse.ArgumentParser):
    #: Options whose default is argparse.SUPPRESS so that only given ones reach the namespace; after parsing they are
    #: filled with these defaults and ``namespace.config_given`` lists the given ones (see :mod:`.config_args`).
    late_defaults: dict | None = None

    def error(self, message: str):  # one line instead of argparse's usage block
        raise UsageError(f"{message} (see `{self.prog} --help`)")

    def parse_known_args(self, args=None, namespace=None):
        namespace, extra = super().parse_known_args(args, namespace)
        if self.late_defaults is not None:
            namespace.config_given = sorted(k for k in self.late_defaults if hasattr(namespace, k))
            for name, value in self.late_defaults.items():
                if not hasattr(namespace, name):
                    setattr(namespace, name, copy.deepcopy(value))
        return namespace, extra


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


def _render_factor(value: str) -> float:
    v = _float(value)
    if not v >= 1:
        raise argparse.ArgumentTypeError(f"{value!r}: the render factor is a number >= 1 (1 = render at the model's input side)")
    return v


def _seeds(value: str) -> list[int]:
    try:
        out = [int(v) for v in comma_list(value)]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r}: give integers separated by commas, e.g. 0,1,2") from None
    if not out:
        raise argparse.ArgumentTypeError("no seed given")
    return list(dict.fromkeys(out))


def _image_corruptions(value: str) -> list[str]:
    """``--stream-corruptions``: a comma list of image corruptions (COCO-C's 16 or ImageNet-C's validation ones)."""
    from ..data.corruptions import ALL_IMAGE_CORRUPTIONS

    names = list(dict.fromkeys(comma_list(value)))
    unknown = [n for n in names if n not in ALL_IMAGE_CORRUPTIONS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"{value!r}: name image corruptions from {', '.join(ALL_IMAGE_CORRUPTIONS)}")
    return names


def _directions(value: str) -> list[str]:
    """``--direction``: a comma list of direction names (``both`` = i2t,t2i); image-text and audio/video directions
    do not mix (they need different models and datasets)."""
    from ..benchmarks.grid import AV_DIRECTIONS, direction_name

    names: list[str] = []
    for v in comma_list(value):
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
                   "loaded as the class its config.json declares (architectures, e.g. BlipForImageTextRetrieval, Blip2ForImageTextRetrieval "
                   "with use_qformer_text_input=True) when hf_tta adapts it, else AutoModel; + AutoProcessor. Audio/video directions: CLAP (audio-text), X-CLIP or CLIP (video-text, CLIP "
                   "mean-pools its frame embeddings). Only Hugging Face checkpoints load here: a custom dual encoder (e.g. CAV-MAE for "
                   "video-audio) runs from Python with hf_tta.DualEncoderAdapter and hf_tta.benchmarks.AVTask.")
    g.add_argument("--dataset", default=None, help="With --model: a benchmark built by hf_tta.data.builders (folder or Hub id, configs clean/image-<name>-<s>/text-<name>-<s>), "
                   "or for the audio/video directions an AudioSet-O / AudioSet-D / VGGSound benchmark built by hf_tta.data.builders.audioset "
                   "(a save_av_benchmark folder or Hub id).")
    g.add_argument("--weights", default=None, help="Emoji benchmark: folder of other trained source weights.")
    g.add_argument("--limit", type=_positive_int, default=None, help="Emoji: a seeded slice of this many concepts; Hub: the first N queries of each stream.")
    g.add_argument("--concepts", choices=("selection", "report"), default=None, help="Emoji: one part of protocol v4's "
                   "concept split (a hash of each concept's name: a third for choosing, the rest for reporting), each with "
                   "its own gallery of its own captions (default: every concept).")
    g.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, ...")
    g.add_argument("--threads", type=_positive_int, default=None, help="torch CPU threads (default: torch's choice).")
    g.add_argument("--render-factor", type=_render_factor, default=None, help="Emoji: render each query at k x the model's input side, corrupt it "
                   "there, then resize it with the model's preprocessing (COCO-C's protocol); a number >= 1 (default: the benchmark's).")
    g.add_argument("--cache-dir", default=None, help="Emoji: store the query streams and gallery embeddings here and reuse them (a filled cache runs image→text grids without the fonts, corruption packages or MiniLM).")


#: The first line of ``hf-tta --help`` (and of the package docstring of :mod:`hf_tta.cli`).
OVERVIEW = "``hf-tta``: run test-time adaptation benchmarks for cross-modal retrieval under query shift."


def build_parser(config_options: bool = True) -> argparse.ArgumentParser:
    """The ``hf-tta`` parser; ``config_options=False`` leaves out ``run``'s options generated from TTAConfig, which
    import torch and transformers (``main`` builds them only for ``run``, so ``hf-tta --help`` answers at once)."""
    parser = _Parser(
        prog="hf-tta",
        description=OVERVIEW + " Run `hf-tta` alone for the default offline benchmark.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Subcommands have their own --help, e.g. `hf-tta run --help`. A mistake on the command line prints one line "
        "naming the fix (exit status 2); add --debug anywhere for the traceback.",
    )
    sub = parser.add_subparsers(dest="command", metavar="{run,build,list,clean,plot,merge,serve}")

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
    g.add_argument("--direction", type=_directions, default=None, metavar="{i2t,t2i,both,a2t,t2a,v2t,t2v,v2a,a2v,c2i}",
                   help="Query->gallery direction(s), a comma list: i2t: image queries / caption gallery; t2i: caption queries / image gallery "
                   "(default i2t; both with --full). With an audio/video --dataset: a2t (audio->text), t2a (text->audio), v2t (video->text), "
                   "t2v (text->video), v2a (video->audio), a2v (audio->video); long forms such as video->audio or video2audio work too. "
                   "Video queries run the dataset's video_* configs, audio queries its audio_* configs, text queries (and VGGSound) clean. "
                   "c2i: composed queries (reference image + text) -> target images, on a FIQ / CIRR build (the default there).")
    g.add_argument("--corruptions", default="default", help="Image corruptions for i2t: comma list, 'all' (16) or 'default' (one per ImageNet-C family, each at the severity where the source model keeps about half its clean recall; see `hf-tta list`). "
                   "Audio/video: the dataset's configs to run (e.g. video_noise_blur,video_diverse; default: all of the query modality's); "
                   "a direction whose query modality has none of them runs clean.")
    g.add_argument("--severities", default=None, help="Image severities: comma list of 1..5, 'all' or 'max' (default: "
                   "5; the default corruptions run each at its chosen severity; --full: 3,5).")
    g.add_argument("--text-corruptions", default="offline", help="Text corruptions for t2i: comma list or 'offline' (every char/word corruption that runs here).")
    g.add_argument("--text-severities", default="7", help="Text severities (char/word 1..7; sentence-level ones have only 1).")
    g.add_argument("--style", dest="style", action="store_true", default=True, help="Add the unseen Noto style (emoji only; default on).")
    g.add_argument("--no-style", dest="style", action="store_false", help="Leave the style shift out.")
    g.add_argument("--diverse", action="store_true", help="Add the diverse stream (each query its own random corruption, REST's -D).")
    g.add_argument("--clean", action="store_true", help="Add the clean stream.")
    g.add_argument("--switch", action="store_true", help="Emoji: add the switching stream (the shift changes every 128 queries, "
                   "cycling through one corruption per family).")
    g.add_argument("--stream-corruptions", "--stream_corruptions", type=_image_corruptions, default=None, metavar="NAMES",
                   help="Emoji: the image corruptions the diverse and switching streams draw from, a comma list (protocol v4's "
                   "selection split: the validation ones, speckle_noise,gaussian_blur,spatter,saturate; default: COCO-C's 16 for "
                   "the diverse stream, gaussian_noise,defocus_blur,snow,contrast for the switching stream).")
    g.add_argument("--degenerate", action="store_true", help="Add the degenerate stream: --degenerate-batches batches of one "
                   "constant query, then the clean stream, scored on the clean part (a safe method matches the source model).")
    g.add_argument("--degenerate-batches", type=_positive_int, default=200, help="Constant batches before the clean part (default 200).")
    g.add_argument("--full", action="store_true", help="The full grid: all 16 image corruptions at severities 3 and 5, both directions with the offline text corruptions, clean, style and diverse shifts, every objective and the two oracle ceilings (unless --objectives is given).")
    g.add_argument("--batch-size", type=_positive_int, default=64, help="Queries per online batch (TCR: 64).")
    g.add_argument("--objective-config", "--objective_config", default=None,
                   help="JSON of the objective's overrides (TTAConfig.objective_config, e.g. '{\"tau\": 0.01}' with one objective), "
                   "or of per-row overrides, e.g. '{\"tent\": {\"tau\": 0.01}}'.")
    g.add_argument("--gradient-decoupling", "--gradient_decoupling", default=None, metavar="OBJECTIVES",
                   help="REST's gradient decoupling (Eq. 15-17; TTAConfig.gradient_decoupling) on every stream: 'true' (every "
                   "gradient objective), 'false'/'none', or a comma list of objectives. "
                   "Default: REST's protocol, i.e. rest with gradient decoupling on the diverse streams only.")
    g.add_argument("--shard", default=None, help="K/N: run only every N-th run starting at K (0-based), e.g. to spread a grid over several processes by hand; combine with `hf-tta merge`.")
    if config_options:
        from .config_args import add_config_arguments

        add_config_arguments(run)  # --config and one option per TTAConfig field (--steps, --lr, --seed, --safety, ...)
        for action in run._actions:  # hf-tta run scores prequentially unless told (protocol v3; plan.RUN_SCORING)
            if action.dest == "scoring":
                action.help = re.sub(r"\(default: '\w+'\)$", "(hf-tta run's default: 'before_update', protocol v3's "
                                     "prequential scoring; 'after_update' is the papers' protocol)", action.help)
    o = run.add_argument_group("output")
    o.add_argument("--output-dir", default="outputs/hf-tta", help="Where results.json/.csv/.md and the plots go.")
    o.add_argument("--no-plots", action="store_true", help="Skip the PNG plots.")
    o.add_argument("--quiet", action="store_true", help="No progress bars (hf_tta's, datasets', transformers' or the hub's); "
                   "errors and the tables still print.")
    o.add_argument("--fresh", action="store_true", help="Ignore the rows an interrupted run with the same arguments left in --output-dir.")

    from .build import add_build_parser

    add_build_parser(sub)
    lst = sub.add_parser("list", help="list objectives, corruptions and styles", description="List what a grid can contain.")
    lst.add_argument("--check-text", action="store_true", help="Also try each text corruption to see whether it runs offline here.")

    clean = sub.add_parser("clean", help="clean R@1/5/10 of the source model in both directions", description="Clean retrieval of the (emoji or --model) source model.")
    _add_common(clean)
    clean.add_argument("--seed", type=int, default=0, help="Seeds the emoji --limit slice and the query order.")
    clean.add_argument("--direction", type=_directions, default=None, help="Directions to evaluate (default i2t,t2i; an audio/video dataset needs e.g. a2t,t2a or v2t,t2v; see `hf-tta run --help`).")
    clean.add_argument("--quiet", action="store_true", help="No progress bars (errors and the result still print).")

    sub.add_parser("serve", help="the retrieval service that adapts while it serves (see `hf-tta serve --help`)",
                   add_help=False)  # its options are hf_tta.cli.serve's; hf_tta.cli.main hands it the rest of argv
    plot = sub.add_parser("plot", help="redraw the plots of a results.json", description="Redraw the PNG plots and tables from a results.json.")
    plot.add_argument("results", help="a results.json written by `hf-tta run`")
    plot.add_argument("--output-dir", default=None, help="default: the results' folder")

    merge = sub.add_parser("merge", help="combine the results.json of several runs or shards", description="Combine results.json files (e.g. of `--shard K/N` runs) into one table, JSON, CSV and plots.")
    merge.add_argument("results", nargs="+", help="results.json files (or the rows.jsonl of an interrupted run)")
    merge.add_argument("--output-dir", required=True)
    merge.add_argument("--no-plots", action="store_true")
    return parser


_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")
#: A saved processor's image / audio / video part (``processor_config.json`` since transformers 5, else
#: ``preprocessor_config.json``).
PROCESSOR_FILES = ("processor_config.json", "preprocessor_config.json")


def _path_or_hub_id(flag: str, value: str | None, what: str) -> None:
    if value is None or Path(value).expanduser().exists():
        return
    if value.startswith(("/", ".", "~")) or not _HUB_ID.match(value):
        raise UsageError(f"{flag} {value}: no such file or folder, and not a Hub id (owner/name); {what}.")


def _looks_local(value: str) -> bool:
    """A path rather than a Hub id: it starts with ``/``, ``.`` or ``~``, or its first part is a folder here."""
    path = Path(value).expanduser()
    return value.startswith(("/", ".", "~")) or (len(path.parts) > 1 and Path(path.parts[0]).is_dir())


def _offline() -> bool:
    import huggingface_hub.constants

    return bool(huggingface_hub.constants.HF_HUB_OFFLINE) or os.environ.get("HF_HUB_OFFLINE", "") not in ("", "0", "false")


def _model_source(value: str | None) -> None:
    """``--model``: a saved folder holding config.json and its processor, or a Hub id (in the cache when offline).
    Each mistake is one line naming the fix, before anything loads (not transformers' "couldn't connect to
    huggingface.co" for a mistyped folder, nor its multi-clause message for a folder without a processor)."""
    if value is None:
        return
    path = Path(value).expanduser()
    save = "model.save_pretrained(folder) and processor.save_pretrained(folder)"
    if path.is_file():
        raise UsageError(f"--model {value} is a file; pass the folder that {save} wrote, or a Hub model id (owner/name).")
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise UsageError(f"--model {value}: no config.json in this folder; pass the folder that {save} wrote.")
        if not any((path / f).is_file() for f in PROCESSOR_FILES):  # (a missing tokenizer: the text-processor check)
            raise UsageError(f"--model {value}: the folder has no processor (no {' or '.join(PROCESSOR_FILES)}); save it next "
                             f"to the model: AutoProcessor.from_pretrained(<the model's Hub id>).save_pretrained({str(value)!r}).")
        return
    if _looks_local(value) or not _HUB_ID.match(value):
        raise UsageError(f"--model {value}: no such folder (the folder {path.absolute()} does not exist); check the path, or "
                         "pass a Hub model id (owner/name).")
    if _offline():
        from huggingface_hub import try_to_load_from_cache

        if not isinstance(try_to_load_from_cache(value, "config.json"), str):
            raise UsageError(f"--model {value}: no folder {path.absolute()}, and no Hub model {value!r} in the Hugging Face cache "
                             "(offline mode); check the folder's path, or download the model once with HF_HUB_OFFLINE=0.")


def _dataset_folder(value: str | None) -> None:
    """``--dataset``: a benchmark on the Hub is ``owner/name``; a path (``/``, ``.``, ``~``), a bare name, or ``a/b``
    where ``a`` is a folder here is a local folder, and a missing one is reported as such (not as a Hub repo that
    "couldn't be reached"); a file is refused (a benchmark is a folder of configs)."""
    if value is None:
        return
    path = Path(value).expanduser()
    if path.is_file():
        raise UsageError(f"--dataset {value} is a file; pass the folder `hf-tta build` wrote (one sub-folder per config), "
                         "or a Hub dataset id (owner/name).")
    if path.exists():
        return
    if value.startswith(("/", ".", "~")) or "/" not in value.strip("/") or Path(path.parts[0]).is_dir():
        raise UsageError(f"--dataset {value}: no such file or folder (the folder {path.absolute()} does not exist); pass the "
                         "folder `hf-tta build` wrote, or a Hub dataset id (owner/name).")


def writable_folder(flag: str, value: str | None) -> None:
    """A UsageError unless the nearest existing part of ``value`` is a folder we can write to (the rest is created
    later); ``None`` passes."""
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
    if getattr(args, "concepts", None) is not None and (getattr(args, "model", None) or getattr(args, "dataset", None)):
        raise UsageError("--concepts splits the emoji benchmark's concepts: drop it with --model/--dataset.")
    _dataset_folder(getattr(args, "dataset", None))
    _path_or_hub_id("--dataset", getattr(args, "dataset", None), "build a benchmark with `hf-tta build` and pass its folder")
    _model_source(getattr(args, "model", None))
    weights = getattr(args, "weights", None)
    if weights is not None and not Path(weights).expanduser().is_dir():
        raise UsageError(f"--weights {weights}: no such folder; pass the folder recipes/train_source_model.py wrote.")
    if weights is not None and getattr(args, "model", None):
        raise UsageError("--weights is for the emoji source model; with --model the checkpoint is the model itself.")
    if getattr(args, "render_factor", None) is not None and getattr(args, "model", None):
        raise UsageError("--render-factor applies to the emoji benchmark only; a built --dataset has its own protocol.")
    writable_folder("--output-dir", getattr(args, "output_dir", None))
    writable_folder("--cache-dir", getattr(args, "cache_dir", None))
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
