"""GPU speed of ``adapt_step`` (TCR, 3 steps), measured side by side in one run. Not a test.

1. ``--part ratio``: a ViT-B/32-sized CLIP (batch 64, 25,000-item gallery): median time of one ``adapt_step``
   (``fast_step`` on: one host sync per batch; off: the per-step checked loop) against 3 x (forward + backward with a
   trivial loss) of the query tower, in fp32 and bf16 autocast; host syncs per ``adapt_step`` counted with
   ``torch.cuda.set_sync_debug_mode``; a ``torch.profiler`` table of each (top kernels by CUDA time) and the CUDA time
   in the B x N matmul, the objective and the optimiser.
2. ``--part throughput``: queries/s of ``adapt_step`` against a loop written the way TCR's reference code runs
   (fp32, ``loss.item()`` every step, its queue kept as a Python list of tuples sorted in Python, default AdamW), on a
   ViT-B/16-sized CLIP (224 px) and a BLIP base (``BlipForImageTextRetrieval``, 384 px), both built from configs
   (random weights: timing only). Model FLOP utilisation from ``torch.utils.flop_counter.FlopCounterMode``: the FLOPs
   of one ``adapt_step`` over its time, against the H100 SXM dense peaks (989 TFLOP/s bf16, 495 TFLOP/s TF32; PyTorch
   runs fp32 matmuls without TF32 by default, so fp32 is also given against the 67 TFLOP/s fp32 peak).

    python recipes/benchmark_gpu_throughput.py --out results/        # on a CUDA machine
    python recipes/benchmark_gpu_throughput.py --tiny --device cpu   # smoke test with tiny models
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import time
import warnings

import torch
import torch.nn.functional as F

from hf_tta import GalleryCache, RunConfig, TTAConfig, TTAWrapper
from hf_tta.objectives.tcr import si_score

PEAK_TFLOPS = {"bf16": 989.0, "tf32": 495.0, "fp32": 67.0}  # H100 SXM, dense


# ------------------------------------------------------------------------------------------------ models
TINY_VISION = dict(image_size=32, patch_size=8, hidden_size=32, intermediate_size=37, num_hidden_layers=2, num_attention_heads=4)


def clip_model(patch: int, tiny: bool):
    from transformers import CLIPConfig, CLIPModel

    if tiny:
        vision = dict(TINY_VISION)
        text = dict(
            hidden_size=32, intermediate_size=37, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=16
        )
        return CLIPModel(CLIPConfig(text_config=text, vision_config=vision, projection_dim=16)), 32, 16
    # openai/clip-vit-base-patch32 / -patch16 sizes
    vision = dict(
        image_size=224,
        patch_size=patch,
        hidden_size=768,
        intermediate_size=3072,
        num_hidden_layers=12,
        num_attention_heads=12,
    )
    text = dict(
        hidden_size=512, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=8, max_position_embeddings=77
    )
    return CLIPModel(CLIPConfig(text_config=text, vision_config=vision, projection_dim=512)), 224, 512


def blip_model(tiny: bool):
    from transformers import BlipConfig, BlipForImageTextRetrieval

    if tiny:
        vision = dict(TINY_VISION)
        text = dict(
            vocab_size=99,
            hidden_size=32,
            intermediate_size=37,
            num_hidden_layers=2,
            num_attention_heads=4,
            encoder_hidden_size=32,
        )
        return (
            BlipForImageTextRetrieval(BlipConfig(text_config=text, vision_config=vision, image_text_hidden_size=16)),
            32,
            16,
        )
    # Salesforce/blip-itm-base-coco sizes: ViT-B/16 at 384 px, BERT-base text encoder, 256-d ITC embeddings
    vision = dict(
        image_size=384,
        patch_size=16,
        hidden_size=768,
        intermediate_size=3072,
        num_hidden_layers=12,
        num_attention_heads=12,
    )
    text = dict(
        hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12, encoder_hidden_size=768
    )
    return (
        BlipForImageTextRetrieval(BlipConfig(text_config=text, vision_config=vision, image_text_hidden_size=256)),
        384,
        256,
    )


def build(kind: str, device, tiny: bool):
    torch.manual_seed(0)
    with torch.device(device):  # initialise on the device (fast), weights random
        if kind == "blip":
            model, size, dim = blip_model(tiny)
        else:
            model, size, dim = clip_model(32 if kind == "clip-b32" else 16, tiny)
    return model.eval(), size, dim


def image_embed(model, pixels):
    """The query tower as TCR's code runs it (CLIP: ``encode_image``; BLIP: ``vision_proj`` of the CLS token)."""
    if hasattr(model, "get_image_features"):
        out = model.get_image_features(pixel_values=pixels)
        return getattr(out, "pooler_output", out)
    return model.vision_proj(model.vision_model(pixel_values=pixels).last_hidden_state[:, 0])


def make_gallery(model, pixels, n: int, dim: int) -> torch.Tensor:
    """``n`` random unit vectors, the first ``B`` replaced by the source model's embeddings of the benchmark batch:
    each query has its own item, so TCR selects queries and every step updates (a random gallery against a random
    model leaves steps with nothing selected, which the checked loop skips without a backward)."""
    g = F.normalize(torch.randn(n, dim, device=pixels.device), dim=1)
    with torch.no_grad():
        g[: pixels.shape[0]] = F.normalize(image_embed(model, pixels).float(), dim=-1)
    return g


# ------------------------------------------------------------------------------------------------ timing helpers
def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def median_times(fns: dict, device, repeats: int) -> dict[str, float]:
    """Interleaved repeats (all variants see the same machine state); median seconds per call."""
    for fn in fns.values():
        fn()  # warm-up
    times = {k: [] for k in fns}
    for _ in range(repeats):
        for k, fn in fns.items():
            sync(device)
            t = time.perf_counter()
            fn()
            sync(device)
            times[k].append(time.perf_counter() - t)
    return {k: statistics.median(v) for k, v in times.items()}


def count_syncs(fn, device) -> int:
    """Host syncs during ``fn()`` (``torch.cuda.set_sync_debug_mode('warn')`` warns on each synchronising call)."""
    if device.type != "cuda":
        return -1
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


def count_flops(fn) -> int:
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        fn()
    return counter.get_total_flops()


def autocast_ctx(device, dtype: str | None):
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype={"bf16": torch.bfloat16}[dtype])


def make_tta(model, dtype, fast: bool, lr=None):
    return TTAWrapper(
        model, TTAConfig(objective="tcr", query_modality="image", autocast_dtype=dtype, run=RunConfig(fast_step=fast), lr=lr)
    )


def plain_copy(model_kind, device, tiny, targets):
    """The same model, used plainly, with the same trainable LayerNorms as the wrapper adapts."""
    model = build(model_kind, device, tiny)[0]
    for name, module in model.named_modules():
        for p in module.parameters(recurse=False):
            p.requires_grad_(name in targets)
    return model


# ------------------------------------------------------------------------------------------------ authors' loop
class AuthorsStyleTCR:
    """TCR as its reference code runs it: fp32, AdamW with PyTorch's defaults, the queue as a Python list of
    ``(si, zq, zg, entropy)`` tuples sorted in Python, and ``loss.item()`` read at every step (the code logs it)."""

    def __init__(self, model, gallery: torch.Tensor, lr=3e-4, steps=3, tau=0.02, ratio=0.3):
        self.model, self.gallery, self.steps, self.tau, self.ratio = model, gallery, steps, tau, ratio
        self.opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr, weight_decay=1e-4)
        self.queue: list[tuple] = []
        self.batches = 0

    def step(self, pixels):
        b = pixels.shape[0]
        for step in range(self.steps):
            zq = F.normalize(image_embed(self.model, pixels).float(), dim=-1)
            s = zq @ self.gallery.T
            zg = self.gallery[s.argmax(1)]
            logits = zq @ zg.T / self.tau
            if step == 0 and self.batches < 10:
                with torch.no_grad():
                    si = si_score(zq, zg)
                    p = logits.softmax(1)
                    ent = -(p * p.clamp_min(1e-12).log()).sum(1)
                    idx = si.argsort()[: int(self.ratio * b)].tolist()
                    self.queue += [(si[i].item(), zq[i], zg[i], ent[i].item()) for i in idx]
                    if len(self.queue) >= b:
                        self.queue = sorted(self.queue, key=lambda t: t[0])[:b]
            qq = torch.stack([t[1] for t in self.queue])
            qg = torch.stack([t[2] for t in self.queue])
            delta_s = (F.normalize(qq, dim=1).mean(0) - F.normalize(qg, dim=1).mean(0)).norm()
            e_m = max(t[3] for t in self.queue)
            p = logits.softmax(1)
            e = -(p * p.clamp_min(1e-12).log()).sum(1)
            w = (1 - e.detach() / (e_m + 1e-3)).clamp(min=0)
            sel = e.detach() <= e_m
            l_na = (e * w)[sel].mean() if sel.any() else (e * 0).sum()
            l_mu = torch.exp(-(zq - zq.mean(0)).norm(dim=1) / 10).mean()
            l_mg = ((zq.mean(0) - zg.mean(0)).norm() - delta_s) ** 2
            loss = l_na + l_mu + l_mg
            self.opt.zero_grad()
            loss.backward()
            self.opt.step()
            self.last_loss = loss.item()
            scores = s.detach()
        self.batches += 1
        return scores


# ------------------------------------------------------------------------------------------------ parts
def profile_table(fn, device, path: str) -> dict[str, float]:
    """One call of ``fn`` under ``torch.profiler``: the table of kernels (top 25 by CUDA time) written to ``path``;
    returned: CUDA milliseconds in the B x N matmul (forward and backward), the objective and the optimiser, all
    kernels, and the call's wall time."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    sync(device)
    t = time.perf_counter()
    with profile(activities=acts, record_shapes=True) as prof:
        fn()
        sync(device)
    wall = time.perf_counter() - t
    key = "device_time_total" if device.type == "cuda" else "cpu_time_total"
    ka = prof.key_averages()
    shapes = prof.key_averages(group_by_input_shape=True)
    with open(path, "w") as fh:
        fh.write(ka.table(sort_by=key, row_limit=25, max_name_column_width=70))
        fh.write("\n\nby input shape:\n")
        fh.write(shapes.table(sort_by=key, row_limit=40, max_name_column_width=40))
    out = {"wall_ms": wall * 1e3}
    if device.type != "cuda":
        return out
    cuda = [e for e in prof.events() if e.device_type.name == "CUDA"]
    kernels = [e for e in cuda if not getattr(e, "is_user_annotation", False) and e.name != "tcr_objective"]
    out["kernels_ms"] = sum(e.device_time for e in kernels) / 1e3
    out["n_kernels"] = len(kernels)
    out["optimizer_ms"] = sum(e.device_time for e in kernels if "adam" in e.name.lower()) / 1e3
    annotated = sum(e.device_time for e in cuda if e.name == "tcr_objective") / 1e3
    averaged = sum(e.device_time_total for e in ka if e.key == "tcr_objective") / 1e3
    out["objective_ms"] = max(annotated, averaged)
    big = [
        e.device_time_total
        for e in shapes
        if e.key == "aten::mm"
        and any(isinstance(s, list) and len(s) == 2 and max(s) >= 10000 for s in e.input_shapes or [])
    ]
    out["bxn_matmul_ms"] = sum(big) / 1e3
    return out


def label_objective(tta):
    """Name the objective's range in the profile (benchmark only; the library is unchanged)."""
    cls = type(tta.objective)
    if getattr(cls, "_labelled", False):
        return
    call = cls.__call__

    def labelled(self, inputs, state):
        with torch.profiler.record_function("tcr_objective"):
            return call(self, inputs, state)

    cls.__call__, cls._labelled = labelled, True


def part_ratio(args, device, results):
    source, size, dim = build("clip-b32", device, args.tiny)
    x = {"pixel_values": torch.randn(args.batch_size, 3, size, size, device=device)}
    gallery = GalleryCache(make_gallery(source, x["pixel_values"], args.gallery_size, dim), "text")
    source = None
    rows = []
    for dtype in (None, "bf16"):
        fast = make_tta(build("clip-b32", device, args.tiny)[0], dtype, True)
        checked = make_tta(build("clip-b32", device, args.tiny)[0], dtype, False)
        label_objective(fast)
        plain = plain_copy("clip-b32", device, args.tiny, set(fast.target_modules))
        enqueue = []

        def plain_steps():
            t = time.perf_counter()
            for _ in range(3):
                with autocast_ctx(device, dtype):
                    emb = image_embed(plain, x["pixel_values"])
                emb.float().sum().backward()
                plain.zero_grad(set_to_none=True)
            enqueue.append(time.perf_counter() - t)

        med = median_times(
            {
                "plain": plain_steps,
                "fast": lambda: fast.adapt_step(x, gallery),
                "checked": lambda: checked.adapt_step(x, gallery),
            },
            device,
            args.repeats,
        )
        name = dtype or "fp32"
        row = {
            "dtype": name,
            "plain_ms": med["plain"] * 1e3,
            "plain_enqueue_ms": statistics.median(enqueue) * 1e3,
            "fast_ms": med["fast"] * 1e3,
            "checked_ms": med["checked"] * 1e3,
            "ratio_fast": med["fast"] / med["plain"],
            "ratio_checked": med["checked"] / med["plain"],
            "updates_fast": fast.adapt_step(x, gallery).num_updates,
            "updates_checked": checked.adapt_step(x, gallery).num_updates,
            "syncs_fast": count_syncs(lambda: fast.adapt_step(x, gallery), device),
            "syncs_checked": count_syncs(lambda: checked.adapt_step(x, gallery), device),
        }
        if args.out:
            row["profile_fast"] = profile_table(
                lambda: fast.adapt_step(x, gallery), device, os.path.join(args.out, f"profile_{name}_fast.txt")
            )
            label_objective(checked)
            row["profile_checked"] = profile_table(
                lambda: checked.adapt_step(x, gallery), device, os.path.join(args.out, f"profile_{name}_checked.txt")
            )
            row["profile_plain"] = profile_table(
                plain_steps, device, os.path.join(args.out, f"profile_{name}_plain.txt")
            )
        rows.append(row)
        print(json.dumps(row), flush=True)
        fast = checked = plain = None  # free the models before the next dtype
    results["ratio"] = rows
    results["ratio_setup"] = dict(model="ViT-B/32-sized CLIP", batch=args.batch_size, gallery=args.gallery_size)


def part_throughput(args, device, results):
    rows = []
    for kind in ("clip-b16", "blip"):
        model, size, dim = build(kind, device, args.tiny)
        x = {"pixel_values": torch.randn(args.batch_size, 3, size, size, device=device)}
        gallery_t = make_gallery(model, x["pixel_values"], args.gallery_size, dim)
        gallery = GalleryCache(gallery_t, "text")
        model = None
        ours = {dt or "fp32": make_tta(build(kind, device, args.tiny)[0], dt, True) for dt in (None, "bf16")}
        targets = set(ours["fp32"].target_modules)
        authors = AuthorsStyleTCR(plain_copy(kind, device, args.tiny, targets), gallery_t)
        fns = {f"ours_{k}": (lambda t=t: t.adapt_step(x, gallery)) for k, t in ours.items()}
        fns["authors_fp32"] = lambda: authors.step(x["pixel_values"])
        med = median_times(fns, device, args.repeats_throughput)
        flops = {k: count_flops(lambda t=t: t.adapt_step(x, gallery)) for k, t in ours.items()}
        row = {"model": kind, "batch": args.batch_size, "image_size": size, "gallery": args.gallery_size}
        for k, sec in med.items():
            row[f"{k}_ms"] = sec * 1e3
            row[f"{k}_qps"] = args.batch_size / sec
        for k, f in flops.items():
            row[f"flops_{k}_tflop"] = f / 1e12
            achieved = f / med[f"ours_{k}"] / 1e12
            row[f"ours_{k}_tflops"] = achieved
            row[f"ours_{k}_mfu"] = achieved / (PEAK_TFLOPS["bf16"] if k == "bf16" else PEAK_TFLOPS["tf32"])
            if k == "fp32":
                row["ours_fp32_mfu_vs_fp32_peak"] = achieved / PEAK_TFLOPS["fp32"]
        row["authors_fp32_tflops"] = flops["fp32"] / med["authors_fp32"] / 1e12  # the same work per batch
        row["speedup_bf16_vs_authors"] = med["authors_fp32"] / med["ours_bf16"]
        row["speedup_fp32_vs_authors"] = med["authors_fp32"] / med["ours_fp32"]
        rows.append(row)
        print(json.dumps(row), flush=True)
        ours = authors = fns = None  # free the models before the next one
        if device.type == "cuda":
            torch.cuda.empty_cache()
    results["throughput"] = rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--part", choices=["ratio", "throughput", "all"], default="all")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--gallery-size", type=int, default=25000, help="gallery embeddings (COCO i2t has 25,000)")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--repeats-throughput", type=int, default=5)
    p.add_argument("--tiny", action="store_true", help="tiny models (smoke test on CPU)")
    p.add_argument("--out", default=None, help="folder for profile tables and results.json")
    args = p.parse_args()
    device = torch.device(args.device)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
    results: dict = {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
    }
    print(
        f"device={results['device']} torch={torch.__version__} tf32_matmul={torch.backends.cuda.matmul.allow_tf32}",
        flush=True,
    )
    for part, fn in (("ratio", part_ratio), ("throughput", part_throughput)):
        if args.part in (part, "all"):
            fn(args, device, results)
            if args.out:  # written after each part, so a run cut short keeps what it measured
                with open(os.path.join(args.out, "results.json"), "w") as fh:
                    json.dump(results, fh, indent=1)
    print_tables(results)


def print_tables(results: dict) -> None:
    print(f"\n== {results['device']}, torch {results['torch']}")
    if "ratio" in results:
        s = results["ratio_setup"]
        print(f"adapt_step (TCR, 3 steps) vs 3 x (fwd+bwd), {s['model']}, batch {s['batch']}, gallery {s['gallery']}")
        print("dtype | plain ms (host enqueue) | fast ms (ratio, syncs) | checked ms (ratio, syncs)")
        for r in results["ratio"]:
            print(
                f"{r['dtype']} | {r['plain_ms']:.1f} ({r['plain_enqueue_ms']:.1f}) | {r['fast_ms']:.1f} ({r['ratio_fast']:.3f}, "
                f"{r['syncs_fast']}) | {r['checked_ms']:.1f} ({r['ratio_checked']:.3f}, {r['syncs_checked']}) | updates "
                f"{r['updates_fast']}/{r['updates_checked']}"
            )
            for k in ("profile_plain", "profile_fast", "profile_checked"):
                if k in r:
                    print(f"   {k}: " + ", ".join(f"{a}={b:.2f}" for a, b in r[k].items()))
    for r in results.get("throughput", []):
        print(
            f"{r['model']} {r['image_size']}px batch {r['batch']} gallery {r['gallery']}: queries/s ours bf16 "
            f"{r['ours_bf16_qps']:.0f}, ours fp32 {r['ours_fp32_qps']:.0f}, authors-style fp32 {r['authors_fp32_qps']:.0f} "
            f"(x{r['speedup_bf16_vs_authors']:.2f} bf16, x{r['speedup_fp32_vs_authors']:.2f} fp32); TFLOP/adapt_step "
            f"{r['flops_fp32_tflop']:.2f}; achieved {r['ours_bf16_tflops']:.0f} TFLOP/s bf16 (MFU {r['ours_bf16_mfu']:.1%} of 989), "
            f"{r['ours_fp32_tflops']:.0f} fp32 ({r['ours_fp32_mfu']:.1%} of 495 TF32, {r['ours_fp32_mfu_vs_fp32_peak']:.1%} of 67 fp32), "
            f"authors {r['authors_fp32_tflops']:.0f}"
        )


if __name__ == "__main__":
    main()
