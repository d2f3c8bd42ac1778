"""Peak host memory of one ``adapt_step`` with and without gradient checkpointing of the query tower.

Model: a ViT-B/16-sized CLIP built from ``CLIPConfig`` defaults with ``patch_size=16`` (random weights, no
download: memory depends on the sizes only). Each setting runs in its own child process, so that each peak
(``resource.getrusage(...).ru_maxrss``, the process's resident high-water mark) is its own; the parent prints both
and their ratio. CPU only (use ``torch.cuda.max_memory_allocated`` on a GPU instead).

    python recipes/memory_peak.py                  # batch 64, TCR, 1 step
    python recipes/memory_peak.py --batch-size 16

"baseline" is the resident size once the model is wrapped and the gallery encoded; "adapt peak" the high-water
mark after the adapt step; "step" their difference, what the adapt step itself added.

Measured once at commit 4dec4a2 (2 shared CPU cores, torch 2.13, transformers 5.24; times are noisy)::

    ViT-B/16 CLIP (random init), image queries, batch 64, tcr, 1 step(s), CPU
     checkpointing  baseline GiB  adapt peak GiB  step GiB  seconds
             False          1.39            7.64      6.26    246.0
              True          1.40            2.49      1.09    298.3
    peak ratio (on/off): 0.33; step ratio: 0.17
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time


def _rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def child(args: argparse.Namespace) -> None:
    import torch
    from transformers import CLIPConfig, CLIPModel

    from hf_tta import TTAConfig, TTAWrapper
    from hf_tta.models.checkpointing import enable_gradient_checkpointing

    torch.manual_seed(0)
    if args.threads:
        torch.set_num_threads(args.threads)
    config = CLIPConfig(vision_config={"patch_size": 16})  # defaults: ViT-B vision (224 px), 12-layer text tower
    model = CLIPModel(config).eval()
    tta = TTAWrapper(model, TTAConfig(objective=args.objective, query_modality="image", steps=args.steps))
    if args.checkpointing:
        enable_gradient_checkpointing(tta.adapter, "image")
    ids = torch.randint(3, config.text_config.vocab_size - 1, (args.gallery_size, 32))
    gallery = tta.encode_gallery({"input_ids": ids, "attention_mask": torch.ones_like(ids)}, show_progress=False)
    x = {"pixel_values": torch.randn(args.batch_size, 3, 224, 224)}
    base = _rss_gib()
    t = time.perf_counter()
    out = tta.adapt_step(x, gallery)
    seconds = time.perf_counter() - t
    print(json.dumps({
        "checkpointing": args.checkpointing, "baseline_gib": base, "peak_gib": _rss_gib(), "seconds": seconds,
        "num_updates": out.num_updates,
    }))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--gallery-size", type=int, default=256)
    p.add_argument("--objective", default="tcr")
    p.add_argument("--steps", type=int, default=1, help="gradient steps per adapt_step (the peak is per step)")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--checkpointing", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        return child(args)
    rows = []
    for on in (False, True):
        cmd = [sys.executable, __file__, "--child", "--batch-size", str(args.batch_size), "--gallery-size",
               str(args.gallery_size), "--objective", args.objective, "--steps", str(args.steps)]
        cmd += ["--threads", str(args.threads)] if args.threads else []
        cmd += ["--checkpointing"] if on else []
        rows.append(json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.strip().splitlines()[-1]))
    print(f"ViT-B/16 CLIP (random init), image queries, batch {args.batch_size}, {args.objective}, {args.steps} step(s), CPU")
    print(f"{'checkpointing':>14} {'baseline GiB':>13} {'adapt peak GiB':>15} {'step GiB':>9} {'seconds':>8}")
    for r in rows:
        step = r["peak_gib"] - r["baseline_gib"]
        print(f"{str(r['checkpointing']):>14} {r['baseline_gib']:>13.2f} {r['peak_gib']:>15.2f} {step:>9.2f} {r['seconds']:>8.1f}")
    off, on = rows
    print(f"peak ratio (on/off): {on['peak_gib'] / off['peak_gib']:.2f}; "
          f"step ratio: {(on['peak_gib'] - on['baseline_gib']) / (off['peak_gib'] - off['baseline_gib']):.2f}")


if __name__ == "__main__":
    main()
