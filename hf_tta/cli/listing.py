"""``hf-tta list``: the objectives, corruptions, styles, row options and audio/video configs a grid can contain, and
every benchmark of the papers with what it needs and its status (:mod:`hf_tta.benchmarks.catalog`)."""

from __future__ import annotations

from .environment import go_offline


def cmd_list(args) -> int:
    from .. import available_objectives
    from ..benchmarks.emoji import STYLES
    from ..benchmarks.grid import DEFAULT_IMAGE_CONDITIONS, image_corruption_names, offline_text_corruptions
    from ..data.corruptions import TEXT_CORRUPTIONS, VALIDATION_IMAGE_CORRUPTIONS
    from ..preset import RECOMMENDED_IMAGE_ROW, RECOMMENDED_ROW, RECOMMENDED_TEXT_ROW

    print("objectives:       " + ", ".join(available_objectives()))
    print("image corruptions: " + ", ".join(image_corruption_names()) + " (severities 1..5; `--corruptions all`)")
    print("  validation:      " + ", ".join(VALIDATION_IMAGE_CORRUPTIONS) + " (ImageNet-C's, for choosing settings)")
    print("  default grid:    " + ", ".join(f"{c} {s}" for c, s in DEFAULT_IMAGE_CONDITIONS)
          + " (per family, where the source keeps about half its clean R@1)")
    print("text corruptions:  " + ", ".join(TEXT_CORRUPTIONS) + " (char/word 1..7, sentence 1)")
    if args.check_text:
        go_offline()  # a seq2seq corruption whose checkpoint is not cached is reported, not downloaded
        ok, missing = offline_text_corruptions(TEXT_CORRUPTIONS)
        print("  runs here:       " + ", ".join(ok))
        for name, why in missing.items():
            print(f"  not here:        {name}: {why}")
    print("emoji styles:      " + ", ".join(STYLES) + " (openmoji = source, noto = unseen)")
    print("other shifts:      clean, noto (style), diverse; switch (every 128 queries), degenerate (constant prefix);")
    print("                   --stream-corruptions names the image corruptions diverse and switch draw from")
    print("ceiling rows:      oracle (true captions, LayerNorms), oracle_all (true captions, every query-tower parameter)")
    print("row options:       <objective>+gd (REST's gradient decoupling; rest uses it on diverse streams by default),")
    print("                   +safe (the safety layer), +route (per-domain adapters, unsupervised router),")
    print("                   +all (every query-tower parameter), +dn / +nnn / +qbnorm (one score transform),")
    print("                   +b<percent> (update budget: adapt on that share of batches, e.g. tcr+b25),")
    print("                   +key (one adapter per true shift: a routing ceiling); combine: tcr+gd+safe")
    print("score transforms:  dn, nnn, qbnorm alone: the source model with the transform, nothing adapted")
    print(f"preset row:        recommended (TTAConfig.recommended: {RECOMMENDED_IMAGE_ROW} for image queries, "
          f"{RECOMMENDED_TEXT_ROW} for text, {RECOMMENDED_ROW} for the others)")
    from ..benchmarks.grid import AV_DIRECTIONS
    from ..data.builders.audioset import AV_BENCHMARKS

    print("audio/video:       --direction " + ", ".join(f"{d} ({q}->{g})" for d, (q, g) in AV_DIRECTIONS.items()))
    for name, configs in AV_BENCHMARKS.items():
        print(f"  {name + ':':<16} " + ", ".join(configs))
    from ..benchmarks.catalog import CATALOG
    from ..data.builders.composed import O_CONFIGS

    print("composed (c2i):    gallery, clean, " + ", ".join(O_CONFIGS) + ", diverse")
    print("benchmarks:        name [status] (papers): what to build it from / how / which model")
    for e in CATALOG:
        print(f"  {e.name} [{e.status}] ({e.paper}): {e.task}")
        print(f"      raw files: {e.raw_files}")
        print(f"      build:     {e.build}")
        print(f"      model:     {e.model}")
    return 0
