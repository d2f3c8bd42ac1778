"""One TTA stream adapted across processes (issue 11): run under ``accelerate launch`` or ``torchrun``.

    accelerate launch --multi_gpu --num_processes 2 --num_machines 1 --mixed_precision no --dynamo_backend no \\
        recipes/distributed_stream.py --batches 4 --batch-size 16
    torchrun --nproc_per_node 2 recipes/distributed_stream.py

``accelerate launch --mixed_precision bf16`` adapts under bf16 autocast (``TTAConfig(autocast_dtype="bf16")``); fp16 and
fp8 are refused in one line (fp16 gradients need a gradient scaler).

Every process gets the same global batches and embeds its share; the adapted state is identical everywhere and is
saved by the main process. With ``--sharded`` each process also holds only its shard of the gallery. The model here is
a small CLIP built from its config (random weights, offline), the gallery random unit vectors: swap in your own.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batches", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=16, help="Global batch (split across the processes).")
    p.add_argument("--gallery-size", type=int, default=10000)
    p.add_argument("--objective", default="tcr")
    p.add_argument(
        "--sharded", action="store_true", help="Shard the gallery across the processes (exact chunked top-k)."
    )
    p.add_argument("--save", default=None, help="Folder to save the adapted state to (main process).")
    args = p.parse_args(argv)
    import os

    mixed = os.environ.get("ACCELERATE_MIXED_PRECISION", "no").lower()  # accelerate launch --mixed_precision
    if mixed not in ("no", "", "bf16"):
        raise SystemExit(f"distributed_stream.py: error: accelerate --mixed_precision {mixed}: hf_tta adapts in fp32 or under "
                         "bf16 autocast only (fp16 gradients of the adapted norms need a gradient scaler); launch with "
                         "--mixed_precision bf16 or no.")
    autocast = "bf16" if mixed == "bf16" else None

    from transformers import CLIPConfig, CLIPModel

    from hf_tta import DistributedTTAWrapper, GalleryCache, TTAConfig, init_distributed
    from hf_tta.gallery import ChunkedGallery, ShardedGallery

    rank, world = init_distributed()
    torch.manual_seed(0)
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
    vision = dict(
        image_size=64, patch_size=16, hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4
    )
    model = CLIPModel(CLIPConfig(text_config=text, vision_config=vision, projection_dim=64)).eval()
    tta = DistributedTTAWrapper(model, TTAConfig(objective=args.objective, query_modality="image", autocast_dtype=autocast))

    emb = F.normalize(torch.randn(args.gallery_size, 64, generator=torch.Generator().manual_seed(1)), dim=1)
    if args.sharded:
        lo, hi = (
            len(x) for x in (emb[: args.gallery_size * rank // world], emb[: args.gallery_size * (rank + 1) // world])
        )
        gallery = ShardedGallery(ChunkedGallery(emb[lo:hi], "text", k=10))
    else:
        gallery = GalleryCache(emb, "text")

    gen = torch.Generator().manual_seed(2)  # the same global batches on every process
    t0 = time.perf_counter()
    for _ in range(args.batches):
        out = tta.adapt_step({"pixel_values": torch.randn(args.batch_size, 3, 64, 64, generator=gen)}, gallery)
    elapsed = time.perf_counter() - t0
    if args.save:
        tta.save_pretrained(args.save)
    if tta.is_main_process:
        top1 = out.topk.indices[:, 0] if out.scores is None else out.scores.argmax(1)
        checksum = sum(float(p.detach().double().sum()) for p in tta.params.values())
        print(
            f"{world} process(es): {args.batches * args.batch_size / elapsed:.1f} queries/s; last loss {out.loss:.6f}; "
            f"parameter checksum {checksum:.8f}; top-1 of the last batch {top1.tolist()[:8]}"
        )


if __name__ == "__main__":
    main()
