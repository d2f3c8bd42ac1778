#!/usr/bin/env python
"""Source-model R@1 (image->text) per shift at several render factors k of the benchmark's protocol v2.

Protocol v2 (COCO-C): each query is rendered at ``k x`` the model's input side, corrupted there with
``corrupt_image`` and resized to the input side by the model's preprocessing. This script measures, for the source
model only (no adaptation), the i2t R@1 of the clean stream, the unseen Noto style and the 16 ImageNet-C corruptions
at one severity, for each factor, and prints a Markdown table (rows = shifts, columns = k) for the dataset card.

The corrupted images depend only on the render side ``round(k x input side)``, not on the model, so they are cached
per side (``--cache-dir``, ``.npy`` files): a 64 px model at k = 1, 2, 4 reuses the images a 32 px model saw at
k = 2, 4, 8. The caption gallery is embedded once per model.

    python recipes/measure_render_factor.py --factors 1,2,4,8 --out outputs/render-factor/shipped.json
    python recipes/measure_render_factor.py --weights path/to/new-weights --factors 1,2,4
"""

from __future__ import annotations

import argparse
import json
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]

from hf_tta.benchmarks.emoji import load_emoji_benchmark, query_images, render_side  # noqa: E402
from hf_tta.data.corruptions import IMAGE_CORRUPTION_CATEGORIES, IMAGE_CORRUPTIONS  # noqa: E402

SHIFTS = ("clean", "noto", *IMAGE_CORRUPTIONS)


def cache_path(cache_dir: Path, n: int, seed: int, side: int, shift: str, severity: int, queries=None) -> Path:
    sev = "" if shift in ("clean", "noto") else f"-s{severity}"
    sub = "" if queries is None else f"-q{len(queries)}"
    return cache_dir / f"n{n}-seed{seed}{sub}" / f"side{side}" / f"{shift}{sev}.npy"


def query_subset(n: int, count: int | None, seed: int) -> list[int] | None:
    """A seeded sample of ``count`` query images (sorted; the first ``count`` of one seeded permutation, so smaller
    samples nest in larger ones), scored against the full gallery; ``None`` = all."""
    if count is None or count >= n:
        return None
    return sorted(np.random.default_rng(seed + 1).permutation(n)[:count].tolist())


def _make(args) -> tuple[str, int, float]:
    """Worker: render + corrupt one (side, shift) and write it to the cache; returns (shift, side, seconds)."""
    limit, seed, side, shift, severity, path, queries = args
    t0 = time.time()
    bench = load_emoji_benchmark(limit=limit, seed=seed)
    if queries is not None:
        bench = bench.subset(queries)
    images = query_images(bench, shift, severity, input_side=side, factor=1, seed=seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp.npy")
    np.save(tmp, images)
    tmp.replace(path)
    return shift, side, time.time() - t0


def fill_cache(limit, seed, sides, shifts, severity, cache_dir: Path, workers: int, log=print, queries=None) -> dict:
    """Compute every missing (side, shift) image set; returns the seconds each computed one took."""
    n = len(load_emoji_benchmark(limit=limit, seed=seed))
    todo = [
        (limit, seed, side, shift, severity, cache_path(cache_dir, n, seed, side, shift, severity, queries), queries)
        for side in sides
        for shift in shifts
        if not cache_path(cache_dir, n, seed, side, shift, severity, queries).exists()
        and not cache_path(cache_dir, n, seed, side, shift, severity).exists()  # a full set: its rows are used
    ]
    seconds: dict[str, float] = {}
    if not todo:
        return seconds
    log(f"rendering + corrupting {len(todo)} query sets with {workers} worker(s)")
    if workers <= 1:
        results = map(_make, todo)
    else:
        pool = ProcessPoolExecutor(workers)
        results = pool.map(_make, todo)
    for shift, side, sec in results:
        seconds[f"{side}/{shift}"] = round(sec, 1)
        log(f"  side {side:4d} {shift:18s} {sec:6.1f}s")
    if workers > 1:
        pool.shutdown()
    return seconds


@torch.no_grad()
def measure(weights, factors, shifts, severity: int, limit, seed: int, cache_dir: Path, workers: int, log=print,
            num_queries: int | None = None) -> dict:
    from hf_tta.benchmarks.source_model import input_side, load_emoji_source_model, preprocess_images, tokenize

    model, tok = load_emoji_source_model(weights)
    side_in = input_side(model)
    bench = load_emoji_benchmark(limit=limit, seed=seed)
    sides = {k: render_side(side_in, k) for k in factors}
    queries = query_subset(len(bench), num_queries, seed)
    t0 = time.time()
    corrupt_seconds = fill_cache(limit, seed, sorted(set(sides.values())), shifts, severity, cache_dir, workers, log, queries)
    t_corrupt = time.time() - t0

    t0 = time.time()
    txt = torch.cat([model.get_text_features(**tokenize(tok, bench.captions[s : s + 256])).pooler_output
                     for s in range(0, bench.num_captions, 256)])
    txt = F.normalize(txt, dim=-1)
    c2i = torch.tensor(bench.caption_to_image)
    target = torch.arange(len(bench)) if queries is None else torch.tensor(queries)
    table: dict[str, dict[str, float]] = {}
    for k, side in sides.items():
        col = {}
        for shift in shifts:
            full = cache_path(cache_dir, len(bench), seed, side, shift, severity)
            if queries is not None and full.exists():
                images = np.load(full, mmap_mode="r")[queries]  # the same images as the full run
            else:
                images = np.load(cache_path(cache_dir, len(bench), seed, side, shift, severity, queries), mmap_mode="r")
            emb = []
            for s in range(0, len(images), 256):
                px = preprocess_images(np.array(images[s : s + 256]), side_in)
                emb.append(model.get_image_features(pixel_values=px).pooler_output)
            top1 = (F.normalize(torch.cat(emb), dim=-1) @ txt.T).argmax(1)
            col[shift] = round(100 * (c2i[top1] == target).float().mean().item(), 1)
        table[f"{k:g}"] = col
        log(f"k={k:g} (render {side} px -> {side_in} px): " + " ".join(f"{s}={v}" for s, v in col.items()))
    return {
        "weights": str(weights) if weights else "shipped",
        "input_side": side_in,
        "severity": severity,
        "images": len(bench),
        "queries": len(target),
        "captions": bench.num_captions,
        "seed": seed,
        "render_sides": {f"{k:g}": s for k, s in sides.items()},
        "r_at_1_i2t": table,
        "seconds": {"corrupt_and_render": round(t_corrupt, 1), "embed_and_score": round(time.time() - t0, 1),
                    "per_set": corrupt_seconds},
    }


def markdown(result: dict) -> str:
    ks = list(result["r_at_1_i2t"])
    head = f"| shift ({result['queries']} queries) | family | " + " | ".join(f"k = {k} ({result['render_sides'][k]} px)" for k in ks) + " |"
    lines = [head, "|---|---|" + "---|" * len(ks)]
    shifts = list(next(iter(result["r_at_1_i2t"].values())))
    for shift in shifts:
        fam = IMAGE_CORRUPTION_CATEGORIES.get(shift, "clean" if shift == "clean" else "style")
        lines.append(f"| {shift} | {fam} | " + " | ".join(f"{result['r_at_1_i2t'][k][shift]:.1f}" for k in ks) + " |")
    corr = [s for s in shifts if s in IMAGE_CORRUPTIONS]
    if corr:
        means = [np.mean([result["r_at_1_i2t"][k][s] for s in corr]) for k in ks]
        lines.append(f"| mean of {len(corr)} corruptions | | " + " | ".join(f"{m:.1f}" for m in means) + " |")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--weights", default=None, help="folder of trained weights (default: the shipped ones)")
    parser.add_argument("--factors", default="1,2,4", help="comma-separated render factors k >= 1")
    parser.add_argument("--shifts", default="all", help="comma-separated shifts (clean, noto, corruptions) or 'all'")
    parser.add_argument("--severity", type=int, default=5)
    parser.add_argument("--limit", type=int, default=None, help="a seeded slice of the concepts (default: all)")
    parser.add_argument("--queries", type=int, default=None,
                        help="score a seeded sample of this many query images against the full gallery (default: all)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cache-dir", default=str(REPO / "outputs" / "render-factor-cache"))
    parser.add_argument("--workers", type=int, default=1, help="processes that render and corrupt")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--out", default=None, help="write the result as JSON here (and the table next to it as .md)")
    args = parser.parse_args(argv)
    try:
        factors = [float(f) for f in args.factors.split(",") if f.strip()]
    except ValueError:
        parser.error(f"--factors must be comma-separated numbers; got {args.factors!r}")
    shifts = list(SHIFTS) if args.shifts == "all" else [s.strip() for s in args.shifts.split(",") if s.strip()]
    bad = [s for s in shifts if s not in SHIFTS]
    if bad or not factors:
        parser.error(f"unknown shift(s) {bad}; choose from {list(SHIFTS)}" if bad else "--factors is empty")
    if args.threads:
        torch.set_num_threads(args.threads)
    result = measure(args.weights, factors, shifts, args.severity, args.limit, args.seed, Path(args.cache_dir), args.workers,
                     num_queries=args.queries)
    table = markdown(result)
    print(table)
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1) + "\n")
        out.with_suffix(".md").write_text(table + "\n")
        print(f"wrote {out}")


if __name__ == "__main__":
    main()
