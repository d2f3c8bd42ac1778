#!/usr/bin/env python
"""TCR's ReID query-gallery shift (Table 4): an IRRA-style CLIP ViT-B/16 through the custom dual-encoder path.

CUHK2ICFG: the model trained on CUHK-PEDES is tested on ICFG-PEDES; ICFG2CUHK the reverse. Text queries retrieve
person images (IR@1), images are resized to 384 x 128 as IRRA (no crop; CLIP's position embeddings interpolated),
the baselines' softmax temperature is 1e-4 (TCR ``set_temperature``), TCR/REST keep their 0.02, and the learning
rate of text queries on the CLIP-ReID model is 3e-4 (TCR code).

1. Build the test sets from the raw files (no download)::

       hf-tta build --icfg-pedes ICFG-PEDES/ICFG-PEDES.json --images-root ICFG-PEDES/imgs --output-dir build/icfg-pedes
       hf-tta build --cuhk-pedes CUHK-PEDES/reid_raw.json --images-root CUHK-PEDES/imgs --output-dir build/cuhk-pedes

2. Convert IRRA's checkpoint (``irra_cuhk_pedes.pth``, an OpenAI-CLIP state dict under ``base_model.``) into a
   Hugging Face ``CLIPModel`` folder with transformers' ``convert_clip_original_pytorch_to_hf.py`` (strip the
   ``base_model.`` prefix first), and save ``CLIPProcessor.from_pretrained("openai/clip-vit-base-patch16")`` next to
   it. Without IRRA weights, ``openai/clip-vit-base-patch16`` runs the same protocol zero-shot.

3. Run::

       python recipes/reid_irra.py --model irra-cuhk-hf --dataset build/icfg-pedes --name CUHK2ICFG
       python recipes/reid_irra.py --model irra-icfg-hf --dataset build/cuhk-pedes --name ICFG2CUHK

The model is wrapped in :class:`hf_tta.DualEncoderAdapter` (encode functions + tower prefixes), the path any custom
retrieval model takes; rows, tables and per-query hits are written as ``hf-tta run`` writes them.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

#: The ReID input size of IRRA and TCR (height, width).
REID_SIZE = (384, 128)
#: TCR's learning rate for text queries on the CLIP-ReID model.
REID_LR = 3e-4


def irra_adapter(model):
    """A ``CLIPModel`` as a :class:`~hf_tta.DualEncoderAdapter`: projected CLS features, position embeddings
    interpolated to the 384 x 128 ReID input; LayerNorms of the query tower adapt by default."""
    from hf_tta import DualEncoderAdapter
    from hf_tta.models.base import pooled

    def image(m, x):
        return pooled(m.get_image_features(pixel_values=x["pixel_values"], interpolate_pos_encoding=True))

    def text(m, x):
        return pooled(m.get_text_features(input_ids=x["input_ids"], attention_mask=x.get("attention_mask")))

    return DualEncoderAdapter(
        model,
        encoders={"image": image, "text": text},
        towers={"image": ["vision_model", "visual_projection"], "text": ["text_model", "text_projection"]},
        input_names={"image": ["pixel_values"], "text": ["input_ids", "attention_mask"]},
        default_lr={"text": REID_LR, "image": REID_LR},
    )


def reid_processor(processor):
    """The model's processor with IRRA's 384 x 128 resize (no crop)."""
    ip = processor.image_processor
    ip.size = {"height": REID_SIZE[0], "width": REID_SIZE[1]}
    ip.do_center_crop = False
    return processor


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="a CLIPModel folder (converted IRRA weights) or Hub id")
    p.add_argument("--dataset", required=True, help="a folder built by `hf-tta build --cuhk-pedes/--icfg-pedes`")
    p.add_argument("--name", default="ReID", help="row label, e.g. CUHK2ICFG")
    p.add_argument("--objectives", default="tent,eata,sar,read,tcr", help="comma list (the source model is always a row)")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--limit", type=int, default=None, help="first N text queries only")
    p.add_argument("--device", default="cpu")
    p.add_argument("--output-dir", default="outputs/reid")
    args = p.parse_args(argv)

    import torch
    from transformers import CLIPModel, CLIPProcessor

    from hf_tta.benchmarks import GridRunner, RunSettings
    from hf_tta.benchmarks.grid import build_grid
    from hf_tta.benchmarks.hub_task import HubTask
    from hf_tta.benchmarks.outputs import write_outputs
    from hf_tta.benchmarks.report import build_tables, format_table
    from hf_tta.data.builders.loading import built_spec

    spec = built_spec(args.dataset)
    if spec is None or spec.name not in ("cuhk-pedes", "icfg-pedes"):
        print(f"reid_irra: {args.dataset} is not a CUHK-PEDES / ICFG-PEDES build; build it with `hf-tta build --cuhk-pedes ...`.", file=sys.stderr)
        return 2
    model = CLIPModel.from_pretrained(args.model, dtype=torch.float32)
    processor = reid_processor(CLIPProcessor.from_pretrained(args.model))
    task = HubTask(model, args.dataset, processor=processor, limit=args.limit, device=args.device)
    task.model = irra_adapter(task.model)  # GridRunner and TTAWrapper take an adapter where they take a model
    objectives = [o.strip() for o in args.objectives.split(",") if o.strip()]
    taus = {o: {"tau": spec.baseline_tau} for o in objectives if o in ("tent", "pl", "shot", "eata", "sar", "read", "deyo")}
    settings = RunSettings(steps=args.steps, batch_size=args.batch_size, lr=REID_LR, objective_configs=taus, show_progress=False)
    jobs = build_grid(objectives, ["t2i"], (), (5,), (), (7,), clean=True)
    rows = GridRunner(task, settings).run_all(jobs)
    for r in rows:
        r["benchmark"] = args.name
    meta = {"recipe": "reid_irra", "name": args.name, "model": args.model, "dataset": str(args.dataset), "baseline_tau": spec.baseline_tau}
    Path(args.output_dir).mkdir(parents=True, exist_ok=True)
    write_outputs(rows, args.output_dir, meta, plots=False)
    for table in build_tables(rows):
        print(format_table(table))
    print(json.dumps({r["objective"]: round(r["R@1"], 2) for r in rows if "R@1" in r}))
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
