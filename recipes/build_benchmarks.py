#!/usr/bin/env python
"""Build (and optionally publish) COCO-C / Flickr-C from your own copy of COCO 2014 / Flickr30K.

You need the images and the Karpathy split file (``dataset_coco.json`` / ``dataset_flickr30k.json``). The build
writes one folder per config (``clean``, ``image-<corruption>-<1..5>``, ``text-<corruption>-<severity>``,
``image-diverse``, ``text-diverse``) under ``--output-dir``; re-running resumes (complete configs are skipped).

Examples::

    # everything the benchmark tables use (16x5 image configs, 15 text configs at maximum severity, -D variants)
    python recipes/build_benchmarks.py --benchmark coco-c --karpathy-json data/dataset_coco.json \\
        --images-root data/coco --output-dir build/coco-c \\
        --style-model formal=prithivida/informal_to_formal_styletransfer \\
        --style-model casual=prithivida/formal_to_informal_styletransfer \\
        --style-model passive=prithivida/active_to_passive_styleformer \\
        --style-model active=prithivida/passive_to_active_styleformer \\
        --back-translation facebook/wmt19-en-de facebook/wmt19-de-en \\
        --push-to-hub <user>/coco-c

    # image configs only, 4 processes, no upload
    python recipes/build_benchmarks.py --benchmark flickr-c --karpathy-json data/dataset_flickr30k.json \\
        --images-root data/flickr30k-images --output-dir build/flickr-c --no-text --num-proc 4

Word-level synonym corruptions need WordNet (``apt-get install wordnet-base`` or ``python -m nltk.downloader
wordnet``); sentence-level ones need the seq2seq checkpoints above (local paths or cached Hub ids). Leave them out
with ``--text-corruptions`` if you do not have them: the build stops early and says what is missing otherwise.
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Callable

import hf_tta
from hf_tta.data.builders import IMAGE_TEXT_BENCHMARKS, BenchmarkBuilder, default_configs, push_benchmark
from hf_tta.data.corruptions import (
    DEFAULT_TEXT_MODELS,
    IMAGE_CORRUPTIONS,
    IMAGE_SEVERITIES,
    SENTENCE_CORRUPTIONS,
    TEXT_CORRUPTION_LEVELS,
    TEXT_CORRUPTIONS,
    make_pool,
)


def _csv(kind: str, known: tuple[str, ...]):
    def parse(value: str) -> list[str]:
        names = [v.strip() for v in value.split(",") if v.strip()]
        bad = [n for n in names if n not in known]
        if bad:
            raise argparse.ArgumentTypeError(f"unknown {kind} {bad}; choose from {', '.join(known)}")
        return names

    return parse


def _ints(value: str) -> list[int]:
    return [int(v) for v in value.split(",") if v.strip()]


def _text_severity(value: str):
    return value if value in ("max", "paper", "all") else _ints(value)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description="Build (and optionally publish) the COCO-C / Flickr-C query-shift benchmarks from local images.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("Examples::", 1)[1] if "Examples::" in __doc__ else None,
    )
    src = p.add_argument_group("sources and output")
    src.add_argument("--benchmark", choices=sorted(IMAGE_TEXT_BENCHMARKS), required=True, help="which benchmark to build")
    src.add_argument("--karpathy-json", required=True, help="dataset_coco.json / dataset_flickr30k.json (Karpathy split)")
    src.add_argument("--images-root", required=True, help="folder with the images (COCO: the one holding val2014/)")
    src.add_argument("--output-dir", required=True, help="one sub-folder per config; re-running resumes")
    src.add_argument("--split", default="test", help="Karpathy split (default: test)")
    src.add_argument("--captions-per-image", type=int, default=5, help="keep the first N captions per image (0 = all)")
    src.add_argument("--on-missing", choices=["error", "skip"], default="error",
                     help="missing/unreadable source images: stop (default) or leave them out of every config (counted)")
    src.add_argument("--limit", type=int, default=None, help="only the first N images (smoke test)")

    cfg = p.add_argument_group("configs")
    cfg.add_argument("--configs", nargs="+", default=None, help="explicit config names (overrides the options below)")
    cfg.add_argument("--image-corruptions", type=_csv("image corruptions", IMAGE_CORRUPTIONS), default=None,
                     help="comma-separated subset of the 16 image corruptions")
    cfg.add_argument("--image-severities", type=_ints, default=list(IMAGE_SEVERITIES), help="e.g. 5 or 1,2,3,4,5 (default)")
    cfg.add_argument("--text-corruptions", type=_csv("text corruptions", TEXT_CORRUPTIONS), default=None,
                     help="comma-separated subset of the 15 text corruptions")
    cfg.add_argument("--text-severities", type=_text_severity, default="max",
                     help="'max' (char/word 7, sentence 1; default), 'paper' (char 1-7, word 6-7, sentence 1), 'all', or a list")
    cfg.add_argument("--no-image", action="store_true", help="no image-* configs")
    cfg.add_argument("--no-text", action="store_true", help="no text-* configs")
    cfg.add_argument("--no-diverse", action="store_true", help="no image-diverse / text-diverse configs")
    cfg.add_argument("--no-clean", action="store_true", help="no clean config")
    cfg.add_argument("--list-configs", action="store_true", help="print the configs that would be built and exit")

    gen = p.add_argument_group("generation")
    gen.add_argument("--seed", type=int, default=0, help="build seed (every draw depends on it and the item id)")
    gen.add_argument("--image-format", choices=["JPEG", "PNG"], default="JPEG", help="storage of corrupted images")
    gen.add_argument("--jpeg-quality", type=int, default=95)
    gen.add_argument("--num-proc", type=int, default=None, help="processes for Dataset.from_generator (1 with a GPU model)")
    gen.add_argument("--wordnet", default=None, help="WordNet dict folder (default: HF_TTA_WORDNET, nltk data, /usr/share/wordnet)")
    gen.add_argument("--style-model", action="append", default=[], metavar="NAME=PATH",
                     help="seq2seq checkpoint of a style corruption (formal, casual, passive, active); repeatable")
    gen.add_argument("--back-translation", nargs=2, metavar=("EN_DE", "DE_EN"), default=None,
                     help="the two translation checkpoints of back_translation")
    gen.add_argument("--device", default=None, help="device of the seq2seq / similarity models (e.g. cuda)")
    gen.add_argument("--similarity-model", default=None,
                     help="enable the benchmark's re-draw filter with this sentence encoder (mean pooling, cosine), "
                          "e.g. sentence-transformers/paraphrase-mpnet-base-v2")
    gen.add_argument("--min-similarity", type=float, default=0.9)
    gen.add_argument("--max-tries", type=int, default=100)
    gen.add_argument("--diverse-pool-severities", default="max",
                     help="severities of the diverse pools: 'max' (default) or 'all'")

    hub = p.add_argument_group("publishing")
    hub.add_argument("--push-to-hub", metavar="REPO_ID", default=None, help="publish every built config + the card")
    hub.add_argument("--private", action="store_true")
    hub.add_argument("--token", default=None, help="Hub token (default: your login)")
    hub.add_argument("--no-skip-existing", action="store_true", help="re-upload configs already on the Hub")
    hub.add_argument("--dry-run", action="store_true",
                     help="with --push-to-hub: upload nothing; write the commit plan (every file and its path in the "
                          "repository) to OUTPUT_DIR/push_plan.json and the card to OUTPUT_DIR/push_plan.README.md")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bars")
    return p


def sentence_encoder_similarity(model_id: str, device=None) -> Callable[[str, str], float]:
    """Cosine similarity of mean-pooled encoder states (how sentence-transformers' paraphrase-mpnet pools)."""
    import torch
    from transformers import AutoModel, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_id)
    model = AutoModel.from_pretrained(model_id, dtype=torch.float32).eval()
    if device:
        model.to(device)

    @torch.no_grad()
    def similarity(a: str, b: str) -> float:
        enc = tok([a, b], padding=True, truncation=True, return_tensors="pt").to(model.device)
        hidden = model(**enc).last_hidden_state
        mask = enc["attention_mask"].unsqueeze(-1).to(hidden.dtype)
        emb = torch.nn.functional.normalize((hidden * mask).sum(1) / mask.sum(1), dim=-1)
        return float(emb[0] @ emb[1])

    return similarity


def missing_as_flags(missing: dict[str, str], models: dict) -> list[str]:
    """One line per corruption whose resources did not load, as the flags (or install step) that provide them."""
    lines = []
    for name, why in missing.items():
        level = TEXT_CORRUPTION_LEVELS[name]
        spec = models.get(name, DEFAULT_TEXT_MODELS.get(name))
        if name == "back_translation":
            flag = f"--back-translation {spec[0]} {spec[1]}"
        elif level == "sentence":
            flag = f"--style-model {name}={spec}"
        elif level == "word":
            flag = "--wordnet DICT_FOLDER (or `apt-get install wordnet-base`, or `python -m nltk.downloader wordnet`)"
        else:
            flag = "pip install 'hf_tta[data]' (nlpaug)"
        lines.append(f"  {name}: {flag}")
        logging.getLogger(__name__).debug("%s: %s", name, why)
    return lines


def select_configs(args) -> list[str]:
    if args.configs:
        return list(args.configs)
    configs = default_configs(
        image_corruptions=[] if args.no_image else args.image_corruptions,
        image_severities=args.image_severities,
        text_corruptions=[] if args.no_text else args.text_corruptions,
        text_severity_mode=args.text_severities,
        diverse=not args.no_diverse,
        clean=not args.no_clean,
    )
    dropped = {"image-diverse"} if args.no_image else set()
    dropped |= {"text-diverse"} if args.no_text else set()
    return [c for c in configs if c not in dropped]


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING if args.quiet else logging.INFO, format="%(levelname)s %(message)s")
    hf_tta.logging.set_verbosity(logging.WARNING if args.quiet else logging.INFO)  # the hf_tta hierarchy's own level
    if args.quiet:  # datasets' own bars (from_generator, save_to_disk) too, for this call only
        import datasets

        datasets.disable_progress_bars()
        try:
            return _run(args)
        finally:
            datasets.enable_progress_bars()
    return _run(args)


def _run(args) -> int:
    if args.dry_run and not args.push_to_hub:
        raise SystemExit("--dry-run plans a --push-to-hub: give the repository id with --push-to-hub.")
    configs = select_configs(args)
    if args.list_configs:
        print("\n".join(configs))
        return 0

    models: dict = {}
    for item in args.style_model:
        name, sep, path = item.partition("=")
        if not sep or name not in SENTENCE_CORRUPTIONS or name == "back_translation":
            raise SystemExit(f"--style-model expects NAME=PATH with NAME in formal, casual, passive, active; got {item!r}")
        models[name] = path
    if args.back_translation:
        models["back_translation"] = tuple(args.back_translation)

    text_names = args.text_corruptions or list(TEXT_CORRUPTIONS)
    text_pool = make_pool("text", names=text_names, severities=args.diverse_pool_severities)
    image_names = args.image_corruptions or list(IMAGE_CORRUPTIONS)
    image_pool = make_pool("image", names=image_names, severities=args.diverse_pool_severities)
    similarity = sentence_encoder_similarity(args.similarity_model, args.device) if args.similarity_model else None

    builder = BenchmarkBuilder(
        args.benchmark,
        args.karpathy_json,
        args.images_root,
        args.output_dir,
        split=args.split,
        seed=args.seed,
        captions_per_image=args.captions_per_image or None,
        on_missing=args.on_missing,
        image_format=args.image_format,
        jpeg_quality=args.jpeg_quality,
        limit=args.limit,
        image_pool=image_pool,
        text_pool=text_pool,
        text_models=models or None,
        wordnet=args.wordnet,
        device=args.device,
        similarity_fn=similarity,
        min_similarity=args.min_similarity,
        max_tries=args.max_tries,
        num_proc=args.num_proc,
        show_progress=not args.quiet,
    )
    built = builder.build(configs, skip_missing=True)
    print(f"{len(built)} configs in {args.output_dir}: {builder.report.summary()}")
    if builder.left_out:
        print(
            f"build_benchmarks: {len(builder.left_out)} configs not built ({', '.join(builder.left_out)}): "
            f"{len(builder.missing_resources)} text corruptions lack their resources. Rerun with these flags; model "
            "checkpoints must load: local folders, or Hub ids in your Hugging Face cache (`hf download <id>`):",
            *missing_as_flags(builder.missing_resources, models), sep="\n", file=sys.stderr,
        )
        return 1
    if args.push_to_hub:
        pushed = push_benchmark(
            args.output_dir,
            args.push_to_hub,
            configs=configs,
            private=args.private or None,
            token=args.token,
            skip_existing=not args.no_skip_existing,
            show_progress=not args.quiet,
            dry_run=args.dry_run,
        )
        if args.dry_run:
            print(f"Dry run: {len(pushed)} configs (+ the dataset card) would go to {args.push_to_hub}; "
                  f"the commit plan is in {args.output_dir}/push_plan.json. Nothing was uploaded.")
        else:
            print(f"Pushed {len(pushed)} configs (+ the dataset card) to {args.push_to_hub}.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
