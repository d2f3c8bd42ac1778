"""``hf-tta build``: one command from the user's raw files to a benchmark folder that ``hf-tta run --dataset`` runs
(and, with ``--push-to-hub``, a Hub dataset with its card).

Sources (exactly one)::

    hf-tta build --pairs pairs.jsonl --output-dir build/my-set       # any (image, caption[, group]) rows: .jsonl,
                                                                       # .csv, or a folder of images + .txt captions
    hf-tta build --nocaps nocaps_val_4500_captions.json --domain out --images-root val/ --output-dir build/nocaps-out
    hf-tta build --fashion-gen fashiongen_256_256_validation.h5 [--diverse-stream] --output-dir build/fashion-gen
    hf-tta build --cuhk-pedes reid_raw.json --images-root CUHK-PEDES/imgs --output-dir build/cuhk-pedes
    hf-tta build --icfg-pedes ICFG-PEDES.json --images-root ICFG-PEDES/imgs --output-dir build/icfg-pedes
    hf-tta build --fashioniq fashion-iq/ --category dress --output-dir build/fiq-dress    # FIQ-O / FIQ-D configs
    hf-tta build --cirr cirr/ --output-dir build/cirr                                      # CIRR-O / CIRR-D configs

Default configs: a user's pairs get COCO-C's (``clean``, the 16 image corruptions at severity 5, the text
corruptions that run here at their maximum severity, and the two diverse configs) and the streams of ``hf-tta run``'s
default grid (motion blur 4, snow 2, contrast 1: one corruption per family at its own severity); the real-world sets only
``clean`` (the papers run them clean); the composed sets their 12 -O configs and the -D config. ``--configs``
names others.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from .common import UsageError, comma_list
from .environment import hide_library_progress_bars

SOURCES = ("pairs", "nocaps", "fashion_gen", "cuhk_pedes", "icfg_pedes", "fashioniq", "cirr")


def add_build_parser(sub) -> None:
    p = sub.add_parser("build", help="build a benchmark from your raw files", description=__doc__.split("\n\n")[0],
                       epilog=__doc__.split("\n\n", 1)[1], formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_argument_group("source (one of)").add_mutually_exclusive_group()
    src.add_argument("--pairs", help="a .jsonl/.csv of (image, caption[, group]) rows, or a folder of images with .txt captions")
    src.add_argument("--nocaps", help="nocaps_val_4500_captions.json (with --domain and --images-root)")
    src.add_argument("--fashion-gen", help="the Fashion-Gen HDF5 file (fashiongen_256_256_validation.h5)")
    src.add_argument("--cuhk-pedes", help="IRRA's reid_raw.json of CUHK-PEDES (test split)")
    src.add_argument("--icfg-pedes", help="ICFG-PEDES.json (test split)")
    src.add_argument("--fashioniq", help="the FashionIQ folder (captions/, image_splits/, images/), with --category")
    src.add_argument("--cirr", help="the CIRR folder (captions/, image_splits/, images or dev/)")
    p.add_argument("--output-dir", required=True, help="one sub-folder per config; re-running resumes")
    p.add_argument("--images-root", default=None, help="folder the image paths are relative to (default: next to the raw file)")
    p.add_argument("--name", default=None, help="--pairs: the benchmark's name (default: the file's stem)")
    p.add_argument("--license", default="other", help="--pairs: licence id for the card (state the real one before publishing)")
    p.add_argument("--domain", default=None, help="--nocaps: in, near or out")
    p.add_argument("--category", default=None, help="--fashioniq: dress, shirt or toptee")
    p.add_argument("--diverse-stream", action="store_true", help="--fashion-gen: Fashion-Gen-D (the 48 categories interleaved)")
    p.add_argument("--configs", default=None, help="comma list of configs (default: see above)")
    p.add_argument("--seed", type=int, default=0, help="build seed: every corruption draw is a function of it and the item id")
    p.add_argument("--limit", type=int, default=None, help="only the first N items (smoke test)")
    p.add_argument("--on-missing", choices=["error", "skip"], default="error",
                   help="a missing/unreadable image: stop (default) or leave it out of every config (counted in the card)")
    p.add_argument("--text-model", action="append", default=[], metavar="NAME=ID[,ID]",
                   help="a seq2seq checkpoint of a sentence-level text corruption (folder or cached Hub id), e.g. "
                   "back_translation=facebook/wmt19-en-de,facebook/wmt19-de-en or formal=prithivida/informal_to_formal_styletransfer")
    p.add_argument("--wordnet", default=None, help="WordNet folder for the synonym corruptions (default: nltk's or Debian's)")
    p.add_argument("--push-to-hub", default=None, metavar="REPO", help="publish the built configs and the card to this dataset repo")
    p.add_argument("--private", action="store_true", help="with --push-to-hub: a private repository")
    p.add_argument("--quiet", action="store_true", help="no progress bars (hf_tta's, datasets', the hub's); errors and the summary still print")


def _source(args) -> tuple[str, str]:
    named = [(s, getattr(args, s)) for s in SOURCES if getattr(args, s, None)]
    if len(named) != 1:
        raise UsageError("name one source: --pairs, --nocaps, --fashion-gen, --cuhk-pedes, --icfg-pedes, --fashioniq or --cirr.")
    kind, path = named[0]
    if not Path(path).expanduser().exists():
        raise UsageError(f"--{kind.replace('_', '-')} {path}: no such file or folder; pass your local copy of the raw files.")
    return kind, path


def default_image_text_configs() -> tuple[list[str], dict[str, str]]:
    """COCO-C's configs with the text corruptions that run here; ``(configs, {left-out corruption: why})``."""
    from ..benchmarks.grid import offline_text_corruptions
    from ..data.corruptions import IMAGE_CORRUPTIONS, MAX_TEXT_SEVERITY

    ok, missing = offline_text_corruptions()
    configs = ["clean", *(f"image-{n}-5" for n in IMAGE_CORRUPTIONS), *default_grid_configs(), "image-diverse",
               *(f"text-{n}-{MAX_TEXT_SEVERITY[n]}" for n in ok), "text-diverse"]
    return list(dict.fromkeys(configs)), missing


def default_grid_configs() -> list[str]:
    """The configs of `hf-tta run`'s default grid (one corruption per ImageNet-C family, each at its own severity)."""
    from ..benchmarks.grid import DEFAULT_IMAGE_CONDITIONS

    return [f"image-{c}-{s}" for c, s in DEFAULT_IMAGE_CONDITIONS]


def _text_models(items: list[str]) -> dict:
    from ..data.corruptions import SENTENCE_CORRUPTIONS

    out = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or name not in SENTENCE_CORRUPTIONS or not value:
            raise UsageError(f"--text-model {item!r}: write NAME=ID with NAME in {', '.join(SENTENCE_CORRUPTIONS)} "
                             "(back_translation takes two ids: EN_DE,DE_EN).")
        ids = [v.strip() for v in value.split(",") if v.strip()]
        if name == "back_translation" and len(ids) != 2:
            raise UsageError("--text-model back_translation=EN_DE,DE_EN takes the two translation checkpoints.")
        out[name] = tuple(ids) if name == "back_translation" else ids[0]
    return out


def make_builder(args):
    """The builder of the named source; ``(builder, default configs, notes)``."""
    from ..data.builders.pairs import pairs_builder, pairs_spec
    from ..data.builders.realworld import realworld_builder

    kind, path = _source(args)
    common = {"seed": args.seed, "limit": args.limit, "on_missing": args.on_missing, "show_progress": not args.quiet,
              "text_models": _text_models(args.text_model) or None, "wordnet": args.wordnet}
    if kind in ("fashioniq", "cirr"):
        from ..data.builders.composed import composed_builder

        if args.domain or args.diverse_stream or (kind == "cirr" and args.category):
            raise UsageError("--domain and --diverse-stream are for --nocaps / --fashion-gen; --category only for --fashioniq.")
        if kind == "fashioniq" and not args.category:
            raise UsageError("--fashioniq needs --category dress, shirt or toptee (one build per category, as REST's Table III).")
        try:
            builder = composed_builder(kind, path, args.output_dir, category=args.category, images_root=args.images_root, **common)
        except ValueError as err:
            raise UsageError(str(err)) from None
        return builder, builder.default_configs(), {}
    if kind == "pairs":
        if args.domain or args.category or args.diverse_stream:
            raise UsageError("--domain, --category and --diverse-stream are for --nocaps, --fashioniq and --fashion-gen.")
        configs, missing = default_image_text_configs()
        name = args.name or (Path(path).stem if Path(path).is_file() else Path(path).name)
        from ..data.corruptions import make_pool

        ok = [c.split("-")[1] for c in configs if c.startswith("text-") and c != "text-diverse"]
        builder = pairs_builder(path, args.output_dir, images_root=args.images_root, spec=pairs_spec(name, license_id=args.license),
                                text_pool=make_pool("text", names=ok, severities="max"), **common)
        return builder, configs, {"text corruptions left out": missing}
    if kind == "nocaps":
        if not args.domain:
            raise UsageError("--nocaps needs --domain in, near or out (one benchmark per domain, as TCR's Table 3).")
        benchmark = f"nocaps-{args.domain.split('-')[0]}"
    elif kind == "fashion_gen":
        benchmark = "fashion-gen-d" if args.diverse_stream else "fashion-gen"
    else:
        benchmark = kind.replace("_", "-")
    try:
        builder = realworld_builder(benchmark, path, args.output_dir, images_root=args.images_root, **common)
    except ValueError as err:
        raise UsageError(str(err)) from None
    return builder, ["clean"], {}


def cmd_build(args) -> int:
    from ..data.builders import push_benchmark

    logging.basicConfig(level=logging.WARNING if args.quiet else logging.INFO, format="hf-tta: %(message)s")
    if args.quiet:  # no bar at all: datasets' (generating, saving splits), the hub's and transformers' too
        hide_library_progress_bars()
    builder, configs, notes = make_builder(args)
    if args.configs:
        configs = comma_list(args.configs)
        lacking = [c for c in default_grid_configs() if c not in configs]
        if args.pairs and any(c.startswith("image-") for c in configs) and lacking:
            print(f"hf-tta: the default grid of `hf-tta run` also needs {', '.join(lacking)}: add them to --configs to "
                  "compare with it (the run picks the streams built here)")
    for what, items in notes.items():
        for name, why in (items or {}).items():
            print(f"hf-tta: {what}: {name} ({why})")
    from ..data.corruptions.base import BuildSettingsError, MissingResourceError

    try:  # reading and checking the raw files: their mistakes are the user's to fix (exit status 2)
        builder.prepare()
    except (ValueError, FileNotFoundError) as err:
        raise UsageError(str(err).strip().splitlines()[0]) from None
    try:
        built = builder.build(configs)
    except BuildSettingsError as err:  # resuming a folder with other settings: the user's to fix (exit status 2)
        raise UsageError(str(err).splitlines()[0]) from None
    except MissingResourceError as err:
        raise UsageError(f"{str(err).splitlines()[0][:300]} ... Pass --text-model NAME=ID (or --wordnet DIR), or leave those "
                         "configs out with --configs (e.g. without the *_sent / text-<sentence> ones).") from None
    report = builder.report
    print(f"hf-tta: built {len(built)} config{'' if len(built) == 1 else 's'} of {builder.spec.name} in {args.output_dir}: {report.summary()}")
    if args.push_to_hub:
        from ..data.builders.composed_hub import is_composed_build, push_composed

        push = push_composed if is_composed_build(args.output_dir) else push_benchmark
        pushed = push(args.output_dir, args.push_to_hub, private=args.private or None, show_progress=not args.quiet)
        print(f"hf-tta: pushed {len(pushed)} configs and the dataset card to {args.push_to_hub}")
    print(f"hf-tta: run it with `{suggested_command(builder.spec.directions, args.output_dir)}`")
    return 0


def suggested_command(directions, output_dir) -> str:
    """The `hf-tta run` that runs what was built: every config of the folder (a `--dataset` run picks the streams
    its build has), the clean one adapted on too; composed builds at REST's batch size."""
    direction = ",".join(directions)
    extra = " --batch-size 32" if direction == "c2i" else " --clean"
    return f"hf-tta run --model <model> --dataset {output_dir} --direction {direction}{extra}"


def add_configs_command(folder, configs) -> str:
    """The command that adds ``configs`` to the built benchmark ``folder``, read from its ``build_info.json``: the
    `hf-tta build` source it was built from (``--pairs``, ``--nocaps``, ...) with the settings a resumed build must
    repeat (seed, limit, name, licence), or ``recipes/build_benchmarks.py`` for COCO-C / Flickr-C; both forms for a
    folder without a build record. Re-running a build on its folder resumes it and adds the configs."""
    import json

    from ..data.builders.base import BUILD_INFO

    try:
        params = json.loads((Path(folder) / BUILD_INFO).read_text(encoding="utf-8")).get("params", {})
    except (OSError, ValueError, AttributeError):
        params = {}
    name, source, spec = params.get("benchmark"), params.get("source") or {}, params.get("spec") or {}
    kept = (["--seed", str(params["seed"])] if params.get("seed") else []) + (["--limit", str(params["limit"])] if params.get("limit") else [])
    tail = " ".join([*kept, "--output-dir", str(folder)])
    if "pairs" in source:
        file = source["pairs"]
        named = ["--name", name] if name and name not in (file, Path(file).stem) else []
        licence = ["--license", spec["license_id"]] if spec.get("license_id", "other") != "other" else []
        return f"`hf-tta build --pairs {' '.join([file, *named, *licence])} {tail} --configs {','.join(configs)}`"
    if "raw" in source:
        flag = {"fashion-gen": "--fashion-gen", "fashion-gen-d": "--fashion-gen", "cuhk-pedes": "--cuhk-pedes", "icfg-pedes": "--icfg-pedes"}
        head = (f"--nocaps {source['raw']} --domain {name.split('-')[1]} --images-root <images>" if str(name).startswith("nocaps-")
                else f"{flag.get(name, '--' + str(name))} {source['raw']}" + (" --diverse-stream" if name == "fashion-gen-d" else "")
                + (" --images-root <images>" if str(name).endswith("-pedes") else ""))
        return f"`hf-tta build {head} {tail} --configs {','.join(configs)}`"
    recipe = (f"`python recipes/build_benchmarks.py --benchmark {name or 'coco-c'} --karpathy-json <split json> "
              f"--images-root <images> {tail} --configs {' '.join(configs)}`")
    if name:
        return recipe
    return f"`hf-tta build --pairs <your pairs> {tail} --configs {','.join(configs)}` (a set of your own) or {recipe} (COCO-C / Flickr-C)"


__all__ = ["add_build_parser", "add_configs_command", "cmd_build", "default_grid_configs", "default_image_text_configs", "make_builder", "suggested_command"]
