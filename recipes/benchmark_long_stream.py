"""Memory over a long stream: 2,000 ``adapt_step`` calls with TCR and with Tent on a tiny CLIP, printing the
process's resident memory (RSS) every 200 steps. After warm-up the figures must stay flat: nothing may grow with
the number of steps taken (logs, queues, autograd graphs, cached tensors). Not a test.

    python recipes/benchmark_long_stream.py                   # 2,000 steps per objective, CPU
    python recipes/benchmark_long_stream.py --steps 500 --every 100 --objectives tcr

The model is built from a config (random weights: memory only). Each step gets a fresh random batch, as a stream
would; the gallery is fixed. The script exits with status 1 when the RSS grows by more than ``--tolerance-mib``
between the first report after warm-up and the last one.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys

import torch
from transformers import CLIPConfig, CLIPModel

from hf_tta import GalleryCache, TTAConfig, TTAWrapper


def rss_mib() -> float:
    """Resident set size of this process in MiB (``/proc/self/status``; ``psutil`` elsewhere)."""
    try:
        with open("/proc/self/status", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024.0
    except OSError:
        pass
    import psutil  # not a dependency: only needed off Linux

    return psutil.Process(os.getpid()).memory_info().rss / 2**20


def tiny_clip() -> CLIPModel:
    text = dict(vocab_size=99, hidden_size=32, intermediate_size=37, num_hidden_layers=2, num_attention_heads=4,
                max_position_embeddings=64, bos_token_id=0, eos_token_id=2, pad_token_id=1)
    vision = dict(image_size=32, patch_size=8, hidden_size=32, intermediate_size=37, num_hidden_layers=2, num_attention_heads=4)
    return CLIPModel(CLIPConfig(text_config=text, vision_config=vision, projection_dim=16)).eval()


def run(objective: str, steps: int, every: int, batch_size: int, gallery_size: int, warmup: int) -> list[tuple[int, float]]:
    torch.manual_seed(0)
    tta = TTAWrapper(tiny_clip(), TTAConfig(objective=objective, query_modality="image"))
    gallery = GalleryCache(torch.nn.functional.normalize(torch.randn(gallery_size, 16), dim=1), "text")
    gen = torch.Generator().manual_seed(1)
    figures = []
    for step in range(1, steps + 1):
        x = {"pixel_values": torch.randn(batch_size, 3, 32, 32, generator=gen)}
        out = tta.adapt_step(x, gallery)
        del out, x
        if step % every == 0:
            gc.collect()
            figures.append((step, rss_mib()))
            mark = " (warm-up)" if step <= warmup else ""
            print(f"{objective:>5} step {step:5d}: RSS {figures[-1][1]:8.1f} MiB{mark}", flush=True)
    return figures


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--objectives", default="tcr,tent", help="comma-separated objective names")
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--every", type=int, default=200)
    p.add_argument("--warmup", type=int, default=200, help="steps whose reports do not count for the flatness check")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--gallery-size", type=int, default=500)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--tolerance-mib", type=float, default=8.0)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    print(f"start: RSS {rss_mib():.1f} MiB (torch {torch.__version__})", flush=True)
    ok = True
    for objective in args.objectives.split(","):
        figures = run(objective.strip(), args.steps, args.every, args.batch_size, args.gallery_size, args.warmup)
        after = [rss for step, rss in figures if step > args.warmup]
        if len(after) >= 2:
            growth = after[-1] - after[0]
            flat = growth <= args.tolerance_mib
            ok &= flat
            print(f"{objective:>5}: RSS after warm-up {after[0]:.1f} -> {after[-1]:.1f} MiB "
                  f"(growth {growth:+.1f} MiB, max {max(after):.1f}): {'flat' if flat else 'GROWS'}", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
