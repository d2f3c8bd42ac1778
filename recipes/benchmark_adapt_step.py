"""Cost of one ``adapt_step`` (TCR, 3 steps) relative to 3 x (forward + backward with a trivial loss) of the
query tower on the same batch, measured side by side (interleaved) in one run.

Model: a ViT-B/32-sized CLIP built from its config (random weights: timing only). Not a test.

    python recipes/benchmark_adapt_step.py                      # CPU, batch 16
    python recipes/benchmark_adapt_step.py --device cuda --batch-size 64 --autocast bf16
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import torch
from transformers import CLIPConfig, CLIPModel

from hf_tta import GalleryCache, TTAConfig, TTAWrapper


def vit_b32_clip() -> CLIPModel:
    # openai/clip-vit-base-patch32 sizes
    vision = dict(image_size=224, patch_size=32, hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12)
    text = dict(hidden_size=512, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=8, max_position_embeddings=77)
    return CLIPModel(CLIPConfig(text_config=text, vision_config=vision, projection_dim=512))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--gallery-size", type=int, default=5000, help="gallery embeddings (COCO i2t has 25,000)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--autocast", choices=["bf16"], default=None)
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    device = torch.device(args.device)

    # Two identical models: one wrapped by hf_tta, one used plainly with the same trainable LayerNorms.
    plain = vit_b32_clip().to(device).eval()
    wrapped = vit_b32_clip().to(device).eval()
    wrapped.load_state_dict(plain.state_dict())
    tta = TTAWrapper(wrapped, TTAConfig(objective="tcr", query_modality="image", autocast_dtype=args.autocast))
    targets = set(tta.target_modules)
    for name, module in plain.named_modules():
        for p_ in module.parameters(recurse=False):
            p_.requires_grad_(name in targets)

    gallery = GalleryCache(torch.nn.functional.normalize(torch.randn(args.gallery_size, 512, device=device), dim=1), "text")
    x = {"pixel_values": torch.randn(args.batch_size, 3, 224, 224, device=device)}
    autocast = (
        torch.autocast(device.type, dtype={"bf16": torch.bfloat16, "fp16": torch.float16}[args.autocast])
        if args.autocast
        else contextlib.nullcontext()
    )

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    def plain_steps():
        for _ in range(3):
            with autocast:
                emb = plain.get_image_features(**x).pooler_output
            emb.float().sum().backward()
            plain.zero_grad(set_to_none=True)

    def ours():
        tta.adapt_step(x, gallery)

    def timed(fn):
        sync()
        t = time.perf_counter()
        fn()
        sync()
        return time.perf_counter() - t

    plain_steps(), ours()  # warm-up
    base, mine = [], []
    for _ in range(args.repeats):  # interleaved so both see the same machine state
        base.append(timed(plain_steps))
        mine.append(timed(ours))
    b, m = statistics.median(base), statistics.median(mine)
    print(f"device={device} batch={args.batch_size} gallery={args.gallery_size} autocast={args.autocast} repeats={args.repeats}")
    print(f"3 x (forward + backward, trivial loss): median {b * 1000:.1f} ms")
    print(f"adapt_step (TCR, 3 steps):              median {m * 1000:.1f} ms")
    print(f"ratio adapt_step / plain: {m / b:.3f}")


if __name__ == "__main__":
    main()
