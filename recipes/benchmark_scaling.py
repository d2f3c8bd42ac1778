"""Scaling benchmark (issue 11): ``adapt_step`` time and peak memory against gallery size for each gallery backend, and
queries/s of one stream on 1 vs 2 processes, measured side by side in one run. Not a test.

Gallery: ``N`` random unit vectors of dimension 512, generated block by block (no full float32 copy except for the
dense backend, which is float32 by design). Query tower: a CLIP vision tower of ViT-B/32's size built from its config
(random weights: the cost, not the accuracy, is measured). Objective: TCR, 3 steps per batch (the wrapper's defaults).

Each (backend, size) cell runs in a fresh subprocess so its peak resident memory (``ru_maxrss``) is its own. Per cell:
  * ``build_s``: time to generate the gallery and build the backend (FAISS: train + add);
  * ``gallery_gib``: memory of the gallery structure;
  * ``overhead_ms``: ``adapt_step`` with a one-LayerNorm query tower (so the time is the per-batch gallery work: scoring
    or search + candidate gather + exact re-scoring, the objective, backward and the optimiser), median of repeats;
  * ``vit_ms``: ``adapt_step`` with the ViT-B/32 tower, median of repeats;
  * ``recall@10``: overlap of the backend's top-10 with the exact top-10 (approximate backends; exact = 1.0);
  * ``peak_gib``: the subprocess's peak resident memory.

Examples:
    python recipes/benchmark_scaling.py --sizes 1e3,1e4,1e5,1e6
    python recipes/benchmark_scaling.py --sizes 1e7 --backends chunked,faiss_ivf_sq8 --processes none
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

import torch
import torch.nn.functional as F

BACKENDS = ("dense", "chunked", "faiss_flat", "faiss_ivf", "faiss_ivf_sq8", "faiss_hnsw")
DIM = 512
CHUNK = 65536


# ------------------------------------------------------------------------------------------------ pieces
def random_unit_blocks(n: int, dim: int = DIM, seed: int = 0, chunk: int = CHUNK):
    """``n`` random unit vectors as float32 blocks of ``chunk`` rows (block i seeded with ``seed + i``)."""
    for i, start in enumerate(range(0, n, chunk)):
        g = torch.Generator().manual_seed(seed + i)
        yield F.normalize(torch.randn(min(chunk, n - start), dim, generator=g), dim=1)


def vit_b32_clip():
    from transformers import CLIPConfig, CLIPModel

    torch.manual_seed(0)
    vision = dict(
        hidden_size=768,
        intermediate_size=3072,
        num_hidden_layers=12,
        num_attention_heads=12,
        image_size=224,
        patch_size=32,
    )
    text = dict(
        vocab_size=99,
        hidden_size=32,
        intermediate_size=37,
        num_hidden_layers=1,
        num_attention_heads=4,
        bos_token_id=0,
        eos_token_id=2,
        pad_token_id=1,
    )
    return CLIPModel(CLIPConfig(text_config=text, vision_config=vision, projection_dim=DIM)).eval()


def layernorm_tower():
    """A dual encoder whose query tower is one LayerNorm over (B, 512) inputs: adapt_step then costs the gallery work."""
    from hf_tta import DualEncoderAdapter

    model = torch.nn.ModuleDict({"q": torch.nn.LayerNorm(DIM), "g": torch.nn.LayerNorm(DIM)})
    return DualEncoderAdapter(
        model,
        encoders={"image": lambda m, x: m["q"](x["pixel_values"]), "text": lambda m, x: m["g"](x["input_ids"].float())},
        towers={"image": ["q"], "text": ["g"]},
    )


def build_backend(name: str, n: int, k: int, seed: int = 0):
    from hf_tta import GalleryCache
    from hf_tta.gallery import ChunkedGallery, FaissGallery

    if name == "dense":
        return GalleryCache(torch.cat(list(random_unit_blocks(n, seed=seed))), "text")
    if name == "chunked":
        return ChunkedGallery.from_chunks(random_unit_blocks(n, seed=seed), n, DIM, "text", dtype=torch.float16, k=k)
    preset = name[len("faiss_") :]
    return FaissGallery.build(random_unit_blocks(n, seed=seed), "text", index=preset, num_items=n, k=k)


def gallery_bytes(gallery) -> int:
    from hf_tta import GalleryCache
    from hf_tta.gallery import ChunkedGallery

    if isinstance(gallery, GalleryCache):
        return gallery.embeddings.numel() * gallery.embeddings.element_size()
    if isinstance(gallery, ChunkedGallery):
        return gallery.embeddings.numel() * gallery.embeddings.element_size()
    import faiss

    return int(faiss.serialize_index(gallery.index).nbytes)  # the index's own size (a transient copy)


def time_steps(tta, gallery, make_batch, repeats: int, warmup: bool = True) -> float:
    if warmup:
        tta.adapt_step(make_batch(), gallery)  # warm-up (allocations, FAISS threads)
    times = []
    for _ in range(repeats):
        batch = make_batch()
        t0 = time.perf_counter()
        tta.adapt_step(batch, gallery)
        times.append(time.perf_counter() - t0)
    return 1000 * statistics.median(times)


def exact_top10(gallery_name: str, gallery, queries: torch.Tensor, n: int) -> torch.Tensor:
    """The exact top-10 indices of ``queries`` (a chunked scan of the same generated vectors)."""
    best_v = best_i = None
    for start, block in zip(range(0, n, CHUNK), random_unit_blocks(n)):
        v, i = (queries @ block.T).topk(min(10, block.shape[0]), dim=1)
        i = i + start
        if best_v is not None:
            v, j = torch.cat([best_v, v], 1).topk(10, dim=1)
            i = torch.cat([best_i, i], 1).gather(1, j)
        best_v, best_i = v, i
    return best_i


# ------------------------------------------------------------------------------------------------ one cell
def run_cell(cfg: dict) -> dict:
    from hf_tta import GalleryCache, TTAConfig, TTAWrapper

    torch.set_num_threads(cfg["threads"])
    name, n, k, b = cfg["backend"], cfg["size"], cfg["k"], cfg["batch"]
    t0 = time.perf_counter()
    gallery = build_backend(name, n, k)
    out = {"backend": name, "size": n, "build_s": time.perf_counter() - t0}
    gen = torch.Generator().manual_seed(1)

    ln = TTAWrapper(layernorm_tower(), TTAConfig(objective="tcr", query_modality="image"))
    out["overhead_ms"] = time_steps(
        ln, gallery, lambda: {"pixel_values": torch.randn(b, DIM, generator=gen)}, cfg["repeats"]
    )

    q = F.normalize(torch.randn(64, DIM, generator=gen), dim=1)
    if isinstance(gallery, GalleryCache):
        out["recall@10"] = 1.0
    else:
        got = gallery.search(q, 10).indices
        ref = exact_top10(name, gallery, q, n)
        out["recall@10"] = (got[:, :, None] == ref[:, None, :]).any(-1).float().mean().item()

    if cfg["vit"]:
        vit = TTAWrapper(vit_b32_clip(), TTAConfig(objective="tcr", query_modality="image"))
        out["vit_ms"] = time_steps(
            vit,
            gallery,
            lambda: {"pixel_values": torch.randn(b, 3, 224, 224, generator=gen)},
            cfg["vit_repeats"],
            warmup=cfg.get("vit_warmup", True),
        )
    out["peak_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux: KiB
    out["gallery_gib"] = gallery_bytes(gallery) / 2**30  # after the peak: FAISS's size is measured on a serialised copy
    return out


# ------------------------------------------------------------------------------------------------ 1 vs 2 processes
def _stream_worker(rank: int, world: int, init_file: str, cfg: dict, result_file: str) -> None:
    import torch.distributed as dist

    from hf_tta import DistributedTTAWrapper, GalleryCache, TTAConfig

    torch.set_num_threads(cfg["threads_per_process"])
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        tta = DistributedTTAWrapper(vit_b32_clip(), TTAConfig(objective="tcr", query_modality="image"))
        gallery = GalleryCache(torch.cat(list(random_unit_blocks(cfg["size"]))), "text")
        gen = torch.Generator().manual_seed(1)  # the same global batches on every process
        batches = [
            {"pixel_values": torch.randn(cfg["global_batch"], 3, 224, 224, generator=gen)}
            for _ in range(cfg["batches"] + 1)
        ]
        tta.adapt_step(batches[0], gallery)  # warm-up
        dist.barrier()
        t0 = time.perf_counter()
        for batch in batches[1:]:
            tta.adapt_step(batch, gallery)
        dist.barrier()
        elapsed = time.perf_counter() - t0
        if rank == 0:
            with open(result_file, "w") as fh:
                json.dump(
                    {
                        "processes": world,
                        "threads_per_process": cfg["threads_per_process"],
                        "queries_per_s": cfg["global_batch"] * cfg["batches"] / elapsed,
                    },
                    fh,
                )
    finally:
        dist.destroy_process_group()


def run_processes(world: int, threads: int, cfg: dict) -> dict:
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        result = os.path.join(tmp, "result.json")
        mp.spawn(
            _stream_worker,
            args=(world, os.path.join(tmp, "init"), {**cfg, "threads_per_process": threads}, result),
            nprocs=world,
        )
        with open(result) as fh:
            return json.load(fh)


# ------------------------------------------------------------------------------------------------ main
def parse_sizes(text: str) -> list[int]:
    return [int(float(s)) for s in text.split(",") if s.strip()]


def fmt(x, spec):
    return "–" if x is None else format(x, spec)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--sizes", default="1e3,1e4,1e5,1e6", help="Gallery sizes, comma-separated (1e3,...,1e7).")
    p.add_argument("--backends", default=",".join(BACKENDS), help=f"Comma-separated subset of {','.join(BACKENDS)}.")
    p.add_argument("--batch", type=int, default=4, help="Queries per adapt_step (small: the ViT runs on the CPU).")
    p.add_argument("--k", type=int, default=100, help="Neighbours per query of the top-k backends.")
    p.add_argument("--repeats", type=int, default=5, help="Timed adapt_steps of the LayerNorm tower (median).")
    p.add_argument("--vit-repeats", type=int, default=2, help="Timed adapt_steps of the ViT-B/32 tower (median).")
    p.add_argument("--no-vit-warmup", action="store_true", help="Time the ViT-B/32 tower's first adapt_step too.")
    p.add_argument("--no-vit", action="store_true", help="Skip the ViT-B/32 timing (overhead and memory only).")
    p.add_argument(
        "--vit-backends",
        default="all",
        help="Backends timed with the ViT-B/32 tower ('all' or a list): its "
        "cost does not depend on the backend, and one adapt_step takes tens of seconds on a busy 2-core CPU.",
    )
    p.add_argument("--vit-sizes", default="all", help="Sizes timed with the ViT-B/32 tower ('all' or a list).")
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads per cell (1: small kernels on a shared CPU are "
        "dominated by thread synchronisation otherwise).",
    )
    p.add_argument("--max-dense", type=float, default=3e6, help="Largest N for dense (float32: N x 2 KiB).")
    p.add_argument(
        "--max-flat", type=float, default=1e6, help="Largest N for faiss_flat / faiss_ivf (float32 vectors)."
    )
    p.add_argument(
        "--max-hnsw", type=float, default=1e5, help="Largest N for faiss_hnsw (graph build is slow on a CPU)."
    )
    p.add_argument("--processes", default="1,2", help="Process counts for the one-stream queries/s ('none' to skip).")
    p.add_argument("--stream-size", type=float, default=1e5, help="Dense gallery size of the 1-vs-2-process stream.")
    p.add_argument("--stream-batch", type=int, default=8, help="Global batch of the 1-vs-2-process stream.")
    p.add_argument("--stream-batches", type=int, default=3, help="Timed batches of the 1-vs-2-process stream.")
    p.add_argument(
        "--stream-threads", type=int, default=2, help="torch threads of the stream, split across its processes."
    )
    p.add_argument("--output", default="outputs/benchmark_scaling.json", help="JSON file of every measurement.")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        print("RESULT " + json.dumps(run_cell(json.loads(args.worker))), flush=True)
        return

    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    unknown = set(backends) - set(BACKENDS)
    if unknown:
        p.error(f"unknown backends {sorted(unknown)}; choose from {','.join(BACKENDS)}")
    limits = {
        "dense": args.max_dense,
        "faiss_flat": args.max_flat,
        "faiss_ivf": args.max_flat,
        "faiss_hnsw": args.max_hnsw,
    }
    vit_backends = set(backends) if args.vit_backends == "all" else set(args.vit_backends.split(","))
    vit_sizes = None if args.vit_sizes == "all" else set(parse_sizes(args.vit_sizes))
    rows = []
    for n in parse_sizes(args.sizes):
        for name in backends:
            if n > limits.get(name, float("inf")):
                print(f"skip {name} at N={n:.0e} (over --max-{name.split('_')[-1]}; raise it to run)", flush=True)
                continue
            cfg = {
                "backend": name,
                "size": n,
                "k": args.k,
                "batch": args.batch,
                "repeats": args.repeats,
                "vit_repeats": args.vit_repeats,
                "threads": args.threads,
                "vit_warmup": not args.no_vit_warmup,
                "vit": not args.no_vit and name in vit_backends and (vit_sizes is None or n in vit_sizes),
            }
            proc = subprocess.run(
                [sys.executable, __file__, "--worker", json.dumps(cfg)], capture_output=True, text=True
            )
            lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
            if proc.returncode != 0 or not lines:
                print(
                    f"{name} N={n:.0e} failed (exit {proc.returncode}): {proc.stderr.strip().splitlines()[-1:]}",
                    flush=True,
                )
                rows.append({"backend": name, "size": n, "error": proc.stderr.strip().splitlines()[-1:]})
                continue
            row = json.loads(lines[-1][len("RESULT ") :])
            rows.append(row)
            print(json.dumps(row), flush=True)

    streams = []
    if args.processes != "none":
        cfg = {"size": int(args.stream_size), "global_batch": args.stream_batch, "batches": args.stream_batches}
        for world in [int(x) for x in args.processes.split(",")]:
            threads = max(1, args.stream_threads // world)
            streams.append(run_processes(world, threads, cfg))
            print(json.dumps(streams[-1]), flush=True)

    print(
        "\n| backend | N | build s | gallery GiB | overhead ms/batch | ViT-B/32 adapt_step ms | recall@10 | peak GiB |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['backend']} | {r['size']:.0e} | failed | | | | | |")
            continue
        print(
            f"| {r['backend']} | {r['size']:.0e} | {r['build_s']:.1f} | {r['gallery_gib']:.3f} | {r['overhead_ms']:.1f} | "
            f"{fmt(r.get('vit_ms'), '.0f')} | {r['recall@10']:.3f} | {r['peak_gib']:.2f} |"
        )
    if streams:
        print(f"\nOne stream, ViT-B/32, TCR, global batch {args.stream_batch}, dense gallery N={args.stream_size:.0e}:")
        print("| processes | threads/process | queries/s |\n|---|---|---|")
        for s in streams:
            print(f"| {s['processes']} | {s['threads_per_process']} | {s['queries_per_s']:.2f} |")
    os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
    with open(args.output, "w") as fh:
        json.dump({"args": vars(args), "cells": rows, "streams": streams}, fh, indent=2)


if __name__ == "__main__":
    main()
