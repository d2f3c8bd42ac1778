"""What a top-k gallery backend changes against the exact dense gallery, on the offline emoji benchmark (issue 11).

With a top-k backend each objective sees the union C of the batch's top-k items, plus what it declares it needs of the
whole gallery (``Objective.gallery_access``): TCR (top-1) and REST (top-K + k-means centroids computed once by the
backend) are exact, DN searches its shifted queries (exact), TITAN's rematching is exact for k > B - 1, and the
softmax objectives (Tent, EATA, SAR, READ, DeYO, PL, SHOT, ClipTTA, training-free TCR) take their softmax over C. This
recipe runs the same streams (image->text, the shipped source model, batches of 64 in the runner's seeded order,
3 steps) with the dense gallery and with the exact chunked backend at several k, and prints R@1/5/10 and how often the
top-1 agrees with the dense run.

    OMP_NUM_THREADS=1 python recipes/topk_vs_dense.py --queries 256 --render-factor 1 --ks 10,100
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import time

import torch

from hf_tta import ChunkedGallery, TTAWrapper, topk_retrieval_metrics
from hf_tta.benchmarks import Condition, GridRunner, RunSettings
from hf_tta.benchmarks.tasks import EmojiTask, take_items
from hf_tta.gallery import TopKScores

#: Every unsupervised objective (the oracles need labels, which a top-k backend does not take).
OBJECTIVES = "tcr,tcr_training_free,rest,tent,eata,sar,read,deyo,pl,shot,dn,cliptta,titan"


def sample_queries(runner: GridRunner, cond: Condition, seed: int, num: int | None):
    """The stream's raw queries and relevant items, or a seeded sample of ``num`` of them (against the whole gallery)."""
    raw, relevant = runner.task.queries(cond, seed)
    if num is None or num >= len(relevant):
        return raw, relevant
    pick = sorted(torch.randperm(len(relevant), generator=torch.Generator().manual_seed(seed))[:num].tolist())
    return take_items(raw, pick), [relevant[i] for i in pick]


def stream(runner: GridRunner, objective: str, cond: Condition, gallery, seed: int, queries) -> tuple[TopKScores, dict]:
    """One adapted stream; each query's top-10 and the top-k metrics."""
    raw, relevant = queries
    tta = TTAWrapper(copy.deepcopy(runner.pristine), runner.row_config(objective, cond, seed))
    order = runner.order(len(raw), seed)
    bs = runner.settings.batch_size
    values = torch.empty(len(raw), 10)
    indices = torch.empty(len(raw), 10, dtype=torch.long)
    for start in range(0, len(order), bs):
        idx = order[start : start + bs]
        out = tta.adapt_step(runner.task.to_inputs(cond.query_modality, take_items(raw, idx)), gallery)
        if out.scores is not None:
            v, i = out.scores.float().sort(dim=1, descending=True, stable=True)
            values[idx], indices[idx] = v[:, :10], i[:, :10]
        else:
            values[idx], indices[idx] = out.topk.values[:, :10].float(), out.topk.indices[:, :10]
    top = TopKScores(values, indices)
    return top, topk_retrieval_metrics(top, relevant, ks=(1, 5, 10))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--corruptions", default="gaussian_noise,defocus_blur")
    p.add_argument("--severity", type=int, default=5)
    p.add_argument("--objectives", default=OBJECTIVES)
    p.add_argument("--ks", default="10,100", help="Neighbours per query of the top-k backend (each >= 10).")
    p.add_argument("--limit", type=int, default=None, help="Use this many emoji concepts (default: all 1,899).")
    p.add_argument(
        "--queries", type=int, default=None, help="A seeded sample of this many queries per stream, against the whole gallery."
    )
    p.add_argument(
        "--render-factor", type=float, default=None,
        help="Query rendering factor k (default: the benchmark's, protocol v2); 1 = protocol v1, where shifts hurt more.",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", default="outputs/topk_vs_dense.json")
    args = p.parse_args(argv)
    ks = [int(x) for x in args.ks.split(",")]
    if min(ks) < 10:
        p.error("--ks: each k must be >= 10 (R@10 is reported).")
    torch.manual_seed(args.seed)
    task = EmojiTask(limit=args.limit, seed=args.seed, render_factor=args.render_factor)
    runner = GridRunner(task, RunSettings(show_progress=False))
    rows = []
    for corruption in args.corruptions.split(","):
        cond = Condition("i2t", corruption, args.severity)
        dense = runner.gallery(cond)
        queries = sample_queries(runner, cond, args.seed, args.queries)
        for objective in args.objectives.split(","):
            galleries = [("dense", dense)] + [
                (f"top-{k}", ChunkedGallery(dense.embeddings, dense.modality, k=k)) for k in ks
            ]
            ref = None
            for name, gallery in galleries:
                t0 = time.perf_counter()
                top, m = stream(runner, objective, cond, gallery, args.seed, queries)
                ref = top if ref is None else ref
                agree = (top.indices[:, 0] == ref.indices[:, 0]).float().mean().item()
                row = {"corruption": corruption, "objective": objective, "gallery": name, **m, "top1_agree": agree}
                rows.append({**row, "seconds": round(time.perf_counter() - t0, 1)})
                print(json.dumps(rows[-1]), flush=True)
    print(f"\ngallery size {len(dense)}, queries per stream {rows[0]['num_queries']}, render factor {task.render_factor}")
    print("| corruption | objective | gallery | R@1 | R@5 | R@10 | top-1 = dense |\n|---|---|---|---|---|---|---|")
    for r in rows:
        agree = "–" if r["gallery"] == "dense" else f"{100 * r['top1_agree']:.1f}%"
        print(
            f"| {r['corruption']} | {r['objective']} | {r['gallery']} | {r['R@1']:.2f} | {r['R@5']:.2f} | "
            f"{r['R@10']:.2f} | {agree} |"
        )
    os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
    with open(args.output, "w") as fh:
        json.dump(rows, fh, indent=2)


if __name__ == "__main__":
    main()
