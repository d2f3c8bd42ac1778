"""Every benchmark of the seed papers (TCR, ICLR 2025; REST) and this library's own, with what it needs and its
status here: the rows of ``hf-tta list`` and of the README's benchmark table (:func:`markdown_table`).

Status words: ``runs`` = built from the raw files by a command here and run end to end by ``hf-tta run`` (or the named
recipe) in the tests, with tiny models; the papers' checkpoints are the user's to supply (converted where noted).
``dataset only`` = the data builds and runs, the paper's model is not provided by any public Hugging Face checkpoint
we know of. ``not implemented`` = no code here.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class BenchmarkEntry:
    name: str
    paper: str  # where the papers report it
    task: str
    raw_files: str
    build: str
    model: str
    status: str


_COCO = "dataset_coco.json (Karpathy split) + COCO val2014 images"
_FLICKR = "dataset_flickr30k.json (Karpathy split) + Flickr30K images"
_BLIP_COCO = "BLIP ViT-B/16 fine-tuned on COCO (Salesforce/blip-itm-base-coco; ViT-L: blip-itm-large-coco)"
_BLIP_FLICKR = "BLIP ViT-B/16 fine-tuned on Flickr30K (Salesforce/blip-itm-base-flickr; ViT-L: blip-itm-large-flickr)"
_BLIP_PRE = "pre-trained (not fine-tuned) BLIP ViT-B/16 (TCR's model_base.pth: convert it); CLIP ViT-B/16 (openai/clip-vit-base-patch16)"
_BLIP2_CIR = "BLIP-2 fine-tuned for CIR on {} (SPRC / LAVIS checkpoint: convert to Blip2ForImageTextRetrieval)"
_BUILD_C = "recipes/build_benchmarks.py --benchmark {}"

CATALOG: tuple[BenchmarkEntry, ...] = (
    BenchmarkEntry("COCO-C / COCO-O", "TCR Tab. 1-2; REST Tab. II, A.3, A.4", "image->text (16 image corruptions), text->image (15 text corruptions)",
                   _COCO, _BUILD_C.format("coco-c"), _BLIP_COCO, "runs"),
    BenchmarkEntry("Flickr-C / Flickr-O", "TCR Tab. 1-2; REST Tab. A.6, A.7", "as COCO-C", _FLICKR, _BUILD_C.format("flickr-c"), _BLIP_FLICKR, "runs"),
    BenchmarkEntry("COCO-D / Flickr-D", "REST Tab. VI", "diverse shift: each query its own corruption (configs image-diverse, text-diverse)",
                   "as COCO-C / Flickr-C", _BUILD_C.format("coco-c") + " (default configs)", _BLIP_COCO, "runs"),
    BenchmarkEntry("COCO-O single-stream (ITM re-ranking)", "REST Tab. A.9, A.10", "image<->text with BLIP's ITM head re-ranking the top-k",
                   "as COCO-C", _BUILD_C.format("coco-c"), _BLIP_COCO + " with its ITM head", "not implemented (dual-stream ITC only)"),
    BenchmarkEntry("General2COCO / General2Flickr", "TCR Tab. 3; REST Tab. V", "real-world shift: zero-shot model on the clean sets, both directions",
                   "as COCO-C / Flickr-C", _BUILD_C.format("coco-c") + " --configs clean; hf-tta run --clean", _BLIP_PRE, "runs"),
    BenchmarkEntry("General2Nocaps ID / ND / OD", "TCR Tab. 3; REST Tab. V (ID, OD)", "real-world shift, both directions (tau 0.01)",
                   "nocaps_val_4500_captions.json + the nocaps validation images", "hf-tta build --nocaps FILE --domain in|near|out", _BLIP_PRE, "runs"),
    BenchmarkEntry("Fashion-Gen", "TCR Tab. 3; REST Tab. VI (DQS)", "real-world shift, both directions, images grouped by product (tau 0.001)",
                   "fashiongen_256_256_validation.h5", "hf-tta build --fashion-gen FILE", _BLIP_PRE, "runs"),
    BenchmarkEntry("Fashion-Gen-D", "REST Tab. VI, VIII", "diverse shift: the 48 categories interleaved (REST uses gradient decoupling)",
                   "fashiongen_256_256_validation.h5", "hf-tta build --fashion-gen FILE --diverse-stream", _BLIP_PRE, "runs"),
    BenchmarkEntry("Personalised Fashion-Gen", "TCR Tab. 9", "Fashion-Gen with a fashion-fine-tuned CLIP ViT-B/32",
                   "fashiongen_256_256_validation.h5", "hf-tta build --fashion-gen FILE", "OpenFashionCLIP-style fine-tuned CLIP ViT-B/32 (finetuned_clip.pt)",
                   "dataset only"),
    BenchmarkEntry("CUHK2ICFG / ICFG2CUHK", "TCR Tab. 4", "text->image person retrieval (tau 1e-4, 384x128 images)",
                   "ICFG-PEDES.json / IRRA's reid_raw.json + imgs/", "hf-tta build --icfg-pedes / --cuhk-pedes FILE; recipes/reid_irra.py",
                   "IRRA CLIP ViT-B/16 (irra_cuhk_pedes.pth / irra_icfg_pedes.pth: convert to CLIPModel)", "runs (recipe)"),
    BenchmarkEntry("GeneralRSICD / GeneralRSITMD", "REST Supp. (remote sensing)", "real-world shift, both directions",
                   "RSICD / RSITMD captions as (image, caption) pairs + images", "hf-tta build --pairs pairs.jsonl --configs clean", _BLIP_PRE, "runs"),
    BenchmarkEntry("FIQ-O / FIQ-D", "REST Tab. III, VI", "composed (reference image + text) -> target image; 12 image x text configs + diverse; R@10/R@50",
                   "FashionIQ captions/cap.<cat>.val.json, image_splits/split.<cat>.val.json, images/", "hf-tta build --fashioniq DIR --category dress|shirt|toptee",
                   _BLIP2_CIR.format("FashionIQ"), "runs"),
    BenchmarkEntry("CIRR-O / CIRR-D", "REST Tab. A.8, VI", "composed -> target image; R@1/5/10/50, Recall_subset@1/2/3",
                   "CIRR captions/cap.rc2.val.json, image_splits/split.rc2.val.json, dev/ images", "hf-tta build --cirr DIR", _BLIP2_CIR.format("CIRR"), "runs"),
    BenchmarkEntry("FIQ2CIRR / CIRR2FIQ", "REST Tab. V", "real-world shift for CIR: the other set's clean queries",
                   "as CIRR-O / FIQ-O", "hf-tta build --cirr/--fashioniq DIR --configs gallery,clean; hf-tta run --clean",
                   _BLIP2_CIR.format("the source set"), "runs"),
    BenchmarkEntry("AudioSet-O / AudioSet-D", "REST Tab. IV, VI", "video<->audio, segment-wise multi-corruption",
                   "AudioSet clips (video + audio) + optional noise recordings", "hf_tta.data.builders.audioset.build_av_benchmark",
                   "CAV-MAE fine-tuned on AudioSet (custom: DualEncoderAdapter)", "runs"),
    BenchmarkEntry("AudioSet2VGG", "REST Tab. V", "real-world shift: video<->audio on VGGSound", "VGGSound clips",
                   "hf_tta.data.builders.audioset.build_av_benchmark (vggsound)", "CAV-MAE fine-tuned on AudioSet", "runs"),
    BenchmarkEntry("Any image-text set", "this library", "a user's (image, caption[, group]) set as COCO-C", "a .jsonl / .csv of pairs, or images + .txt captions",
                   "hf-tta build --pairs PATH", "any Hugging Face dual encoder", "runs"),
    BenchmarkEntry("Emoji benchmark", "this library", "offline image<->text with a shipped source model", "none (pip packages)", "none",
                   "shipped emoji-convnext-minilm", "runs"),
)


def markdown_table(entries=CATALOG) -> str:
    """The README's benchmark table."""
    lines = ["| Benchmark | Paper | Task | Raw files | Build | Model | Status |", "|---|---|---|---|---|---|---|"]
    def cell(text: str) -> str:
        return text.replace("|", "\\|")

    lines += [f"| {cell(e.name)} | {cell(e.paper)} | {cell(e.task)} | {cell(e.raw_files)} | `{cell(e.build)}` | {cell(e.model)} | "
              f"{cell(e.status)} |" for e in entries]
    return "\n".join(lines)


__all__ = ["CATALOG", "BenchmarkEntry", "markdown_table"]
