"""Dataset cards: for COCO-C / Flickr-C (sources and licences, construction, corruption constants, citations) and
for AudioSet-O / AudioSet-D / VGGSound (protocol, configs, how each was corrupted)."""

from __future__ import annotations

from typing import Any, Iterable, Sequence

from ..corruptions.image import IMAGE_CORRUPTION_CATEGORIES, IMAGE_CORRUPTION_CONSTANTS, IMAGE_CORRUPTIONS
from ..corruptions.seq2seq import DEFAULT_TEXT_MODELS, STYLE_PREFIXES
from ..corruptions.text import TEXT_CORRUPTION_ABBREVIATIONS, TEXT_CORRUPTION_LEVELS, TEXT_CORRUPTIONS
from ..corruptions.video import VIDEO_CORRUPTION_CATEGORIES
from .av_plans import AVCorruptionSettings
from .specs import AUDIOSET_O_CONFIGS, BenchmarkSpec, parse_config_name

CITATIONS: dict[str, str] = {
    "tcr": """@inproceedings{li2025tcr,
  title={Test-time Adaptation for Cross-modal Retrieval with Query Shift},
  author={Li, Haobin and Hu, Peng and Zhang, Qianjun and Peng, Xi and Liu, Xiting and Yang, Mouxing},
  booktitle={International Conference on Learning Representations (ICLR)}, year={2025}
}""",
    "rest": """@article{li2025rest,
  title={Toward Robust and Harmonious Adaptation for Cross-modal Retrieval},
  author={Li, Haobin and Yang, Mouxing and Peng, Xi},
  year={2025}
}""",
    "mm_robustness": """@article{qiu2023benchmarking,
  title={Benchmarking Robustness of Multimodal Image-Text Models under Distribution Shift},
  author={Qiu, Jielin and Zhu, Yi and Shi, Xingjian and Wenzel, Florian and Tang, Zhiqiang and Zhao, Ding and Li, Bo and Li, Mu},
  journal={Journal of Data-centric Machine Learning Research}, year={2023}
}""",
    "imagenet_c": """@inproceedings{hendrycks2019benchmarking,
  title={Benchmarking Neural Network Robustness to Common Corruptions and Perturbations},
  author={Hendrycks, Dan and Dietterich, Thomas},
  booktitle={ICLR}, year={2019}
}""",
    "imagecorruptions": """@article{michaelis2019dragon,
  title={Benchmarking Robustness in Object Detection: Autonomous Driving when Winter is Coming},
  author={Michaelis, Claudio and Mitzkus, Benjamin and Geirhos, Robert and Rusak, Evgenia and Bringmann, Oliver and Ecker, Alexander S. and Bethge, Matthias and Brendel, Wieland},
  journal={arXiv:1907.07484}, year={2019}
}""",
    "eda": """@inproceedings{wei2019eda,
  title={{EDA}: Easy Data Augmentation Techniques for Boosting Performance on Text Classification Tasks},
  author={Wei, Jason and Zou, Kai},
  booktitle={EMNLP-IJCNLP}, year={2019}
}""",
    "aeda": """@inproceedings{karimi2021aeda,
  title={{AEDA}: An Easier Data Augmentation Technique for Text Classification},
  author={Karimi, Akbar and Rossi, Leonardo and Prati, Andrea},
  booktitle={Findings of EMNLP}, year={2021}
}""",
    "nlpaug": """@misc{ma2019nlpaug,
  title={NLP Augmentation}, author={Ma, Edward},
  howpublished={https://github.com/makcedward/nlpaug}, year={2019}
}""",
    "styleformer": """@misc{damodaran2021styleformer,
  title={Styleformer}, author={Damodaran, Prithiviraj},
  howpublished={https://github.com/PrithivirajDamodaran/Styleformer}, year={2021}
}""",
    "wordnet": """@book{fellbaum1998wordnet,
  title={WordNet: An Electronic Lexical Database}, editor={Fellbaum, Christiane},
  publisher={MIT Press}, year={1998}
}""",
}

_TEXT_GENERATORS = {
    "ocr": "`nlpaug.augmenter.char.OcrAug(aug_word_p=0.05*s)`",
    "char_insert": "`nlpaug RandomCharAug(action='insert', aug_word_p=0.05*s)`",
    "char_replace": "`nlpaug RandomCharAug(action='substitute', aug_word_p=0.05*s)`",
    "char_swap": "`nlpaug RandomCharAug(action='swap', aug_word_p=0.05*s)`",
    "char_delete": "`nlpaug RandomCharAug(action='delete', aug_word_p=0.05*s)`",
    "synonym_replacement": "EDA synonym replacement (WordNet 3.0), alpha_sr=0.05*s",
    "random_insertion": "EDA random insertion of WordNet synonyms, alpha_ri=0.05*s",
    "random_swap": "EDA random swap, alpha_rs=0.05*s",
    "random_deletion": "EDA random deletion, p_rd=0.05*s",
    "insert_punctuation": "AEDA: 1..int(0.05*s*len+1) marks from `. , ! ? ; :`",
}


_DIRECTION_NAMES = {"i2t": "image→text (TR)", "t2i": "text→image (IR)"}


def _text_generator(name: str, models: dict | None) -> str:
    if name in _TEXT_GENERATORS:
        return _TEXT_GENERATORS[name]
    used = (models or {}).get(name, DEFAULT_TEXT_MODELS[name])
    if name == "back_translation":
        return f"en→de→en with `{used[0]}` / `{used[1]}`" if isinstance(used, (list, tuple)) else f"en→de→en with `{used}`"
    return f"Styleformer prompt {STYLE_PREFIXES[name]!r} with `{used}`"


def card_metadata(spec: BenchmarkSpec, num_rows: int | None = None) -> dict[str, Any]:
    """Card YAML fields besides ``configs`` / ``dataset_info`` (which ``push_to_hub`` writes)."""
    size = "n<1K" if num_rows is not None and num_rows < 1000 else "1K<n<10K" if (num_rows or 0) < 10000 else "10K<n<100K"
    return {
        "pretty_name": spec.pretty_name,
        "license": spec.license_id,
        "language": ["en"],
        "task_categories": ["image-to-text", "text-to-image"],
        "tags": ["test-time-adaptation", "robustness", "query-shift", "image-text-retrieval", "corruptions", "hf_tta"],
        "size_categories": [size],
        # read back by `hf-tta run --dataset <repo>` (hf_tta.data.builders.loading.built_spec)
        "hf_tta": {"benchmark": spec.name, "baseline_tau": spec.baseline_tau, "directions": list(spec.directions)},
    }


def local_card(
    spec: BenchmarkSpec, folder: str, build_info: dict, configs: Sequence[str], data_files: str = "{config}/data-*.arrow"
) -> str:
    """``README.md`` of a built folder: the card, with YAML ``configs`` whose ``data_files`` are each config's Arrow
    files (``<config>/data-*.arrow``, what ``save_to_disk`` wrote), so that the folder is a dataset repository
    layout: ``datasets.load_dataset(folder, config)`` reads it without a copy of the data. ``data_files="{config}/
    test-*"`` gives the card of the Hub repository (``push_to_hub``'s parquet shards)."""
    from huggingface_hub import DatasetCardData

    num_rows = max((m.get("num_rows", 0) for m in build_info.get("configs", {}).values()), default=None)
    entries = [
        {"config_name": c, "data_files": [{"split": "test", "path": data_files.format(config=c)}], **({"default": True} if c == "clean" else {})}
        for c in configs
    ]
    data = DatasetCardData(**card_metadata(spec, num_rows), configs=entries)
    return f"---\n{data.to_yaml()}\n---\n\n{card_text(spec, folder, build_info, configs)}"


def _fmt(v: Any) -> str:
    if isinstance(v, (list, tuple)):
        return "(" + ", ".join(_fmt(x) for x in v) + ")"
    return f"{v:g}" if isinstance(v, float) else str(v)


def card_text(spec: BenchmarkSpec, repo_id: str, build_info: dict, configs: Iterable[str]) -> str:
    """The Markdown body of the card."""
    configs = list(configs)
    params = build_info.get("params", {})
    report = build_info.get("source_report") or {}
    meta = build_info.get("configs", {})
    image_cfgs = [c for c in configs if c.startswith("image-") and c != "image-diverse"]
    text_cfgs = [c for c in configs if c.startswith("text-") and c != "text-diverse"]
    lines = [
        f"# {spec.pretty_name}",
        "",
        f"Query-shift benchmark for image-text retrieval, built from {spec.source_name} with "
        "the hf_tta builders (`hf_tta.data.builders`). The queries of one modality are corrupted while the "
        "gallery stays clean, as in TCR (ICLR 2025, \"COCO-C / Flickr-C\") and its journal extension REST "
        "(\"-O\" one-shift-per-run and \"-D\" diverse variants).",
        "",
        "## Configs",
        "",
        "| config | rows | what |",
        "|---|---|---|",
    ]

    def rows(c: str) -> str:
        m = meta.get(c, {})
        return f"{m.get('num_rows', '?')} images / {m.get('num_captions', '?')} captions"

    if "clean" in configs:
        lines.append(f"| `clean` | {rows('clean')} | original images (original bytes) and captions |")
    if image_cfgs:
        lines.append(
            f"| `image-<corruption>-<1..5>` ({len(image_cfgs)} configs) | {rows(image_cfgs[0])} | corrupted images + clean "
            "captions (image→text queries) |"
        )
    if "image-diverse" in configs:
        lines.append(f"| `image-diverse` | {rows('image-diverse')} | each image with its own corruption (REST's DQS) |")
    if text_cfgs:
        lines.append(
            f"| `text-<corruption>-<severity>` ({len(text_cfgs)} configs) | {rows(text_cfgs[0])} | corrupted captions, "
            "grouped by image, no image column: the gallery is `clean` (text→image queries) |"
        )
    if "text-diverse" in configs:
        lines.append(f"| `text-diverse` | {rows('text-diverse')} | each caption with its own corruption |")
    lines += [
        "",
        "All configs have one split, `test`, with one row per image in the order of the source file.",
        spec.ids_note,
        "",
        "<details><summary>All configs in this repository</summary>",
        "",
        ", ".join(f"`{c}`" for c in configs),
        "",
        "</details>",
        "",
        "## Usage",
        "",
        "```python",
        "from datasets import load_dataset",
        f'ds = load_dataset("{repo_id}", "image-gaussian_noise-5", split="test")  # image→text queries',
        "",
        "from hf_tta.data.builders import load_retrieval_split",
        f'i2t = load_retrieval_split("{repo_id}", "image-gaussian_noise-5")  # queries, gallery, relevance',
        f't2i = load_retrieval_split("{repo_id}", "text-ocr-7")              # gallery images come from `clean`',
        "```",
        "",
        "The benchmark tables report R@1 at the maximum severity: image severity 5, character/word severity 7, "
        "sentence severity 1.",
        "",
        f"Directions the papers report: {', '.join(_DIRECTION_NAMES.get(d, d) for d in spec.directions)}. "
        f"Softmax temperature of the baselines (TCR App. B.2 / REST Supp. C-B): tau = {spec.baseline_tau:g} "
        "(`hf-tta run --dataset` applies it to the gallery-softmax baselines unless `--objective-config` sets one).",
        "",
        "## Construction",
        "",
        f"- Source: {spec.source_name}, split `{params.get('split', 'test')}`"
        + (f", first {params['limit']} images only" if params.get("limit") else "")
        + (f" ({spec.expected_images:,} images / {spec.expected_captions:,} captions in the benchmark)." if spec.expected_images else "."),
        *[f"- {line}" for line in spec.construction],
        *([f"- Read from: {', '.join(f'{k} = `{v}`' for k, v in params['source'].items())}."] if params.get("source") else []),
        f"- Captions per image: the first {params.get('captions_per_image') or 'all'} of each image"
        + (f" ({report.get('truncated_captions')} extra captions of {report.get('images_with_extra_captions')} images left out)." if report.get("truncated_captions") else "."),
        f"- Source check: {report.get('num_images', '?')} images used; {len(report.get('missing', []))} missing and "
        f"{len(report.get('unreadable', []))} unreadable files"
        + (" (left out of every config)." if report.get("problems") else "."),
        f"- Seed {params.get('seed')}: every corruption draw is a function of the seed, the config and the item's id "
        "(`hf_tta.data.corruptions.derive_seed`), so any row can be regenerated on its own.",
        f"- Corrupted images are stored as {params.get('image_format')}"
        + (f" (quality {params.get('jpeg_quality')})" if params.get("image_format") == "JPEG" else "")
        + "; the clean config keeps the original file bytes. Images are converted to RGB before corruption.",
        "- Image corruptions: ImageNet-C functions (Hendrycks & Dietterich 2019) from the maintained "
        "`imagecorruptions-imaug` package, applied at full resolution (they work on any image size).",
        "- Text corruptions: as the MM_Robustness scripts (Qiu et al. 2023) that TCR used: `nlpaug` character "
        "augmenters, EDA word operations (WordNet 3.0), AEDA punctuation insertion, Styleformer style transfer and "
        "back-translation." + (
            f" Word-level and style (formal, casual, passive, active) outputs were re-drawn until similarity >= {params.get('min_similarity')}."
            if params.get("similarity_filter")
            else " The optional \"re-draw until similarity >= 0.9\" filter of the benchmark was not applied."
        ),
        "",
        "### Image corruption constants (severity 1..5)",
        "",
        "| corruption | category | parameter | s=1 | s=2 | s=3 | s=4 | s=5 |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for n in IMAGE_CORRUPTIONS:
        c = IMAGE_CORRUPTION_CONSTANTS[n]
        lines.append(f"| {n} | {IMAGE_CORRUPTION_CATEGORIES[n]} | {c['param']} | " + " | ".join(_fmt(v) for v in c["values"]) + " |")
    models = params.get("text_models") or None
    lines += [
        "",
        "### Text corruptions",
        "",
        "| corruption | paper | level | generator |",
        "|---|---|---|---|",
    ]
    for n in TEXT_CORRUPTIONS:
        lines.append(f"| {n} | {TEXT_CORRUPTION_ABBREVIATIONS[n]} | {TEXT_CORRUPTION_LEVELS[n]} | {_text_generator(n, models)} |")
    if "image-diverse" in configs or "text-diverse" in configs:
        lines += ["", "### Diverse configs", ""]
        if "image-diverse" in configs:
            pool = params.get("image_pool", [])
            lines.append(f"- `image-diverse`: uniform over {len(pool)} (corruption, severity) pairs: " + ", ".join(f"{a}@{b}" for a, b in pool) + ".")
        if "text-diverse" in configs:
            pool = params.get("text_pool", [])
            lines.append(f"- `text-diverse`: uniform over {len(pool)} (corruption, severity) pairs: " + ", ".join(f"{a}@{b}" for a, b in pool) + ".")
        lines.append("- The `corruption` / `severity` columns record each draw.")
    versions = build_info.get("versions", {})
    if versions:
        lines += ["", "Built with " + ", ".join(f"{k} {v}" for k, v in sorted(versions.items())) + "."]
    lines += [
        "",
        "## Licences",
        "",
        f"- Images: {spec.image_license}",
        f"- Captions: {spec.annotation_license}",
        f"- {spec.split_license}",
        "- The corruptions add no new content; derived data follows the licences of its sources.",
        "",
        "## Citations",
        "",
        "```bibtex",
        "\n\n".join([CITATIONS["tcr"], CITATIONS["rest"], CITATIONS["mm_robustness"], *spec.citations,
                     CITATIONS["imagenet_c"], CITATIONS["imagecorruptions"], CITATIONS["eda"], CITATIONS["aeda"],
                     CITATIONS["nlpaug"], CITATIONS["styleformer"], CITATIONS["wordnet"]]),
        "```",
        "",
    ]
    for c in configs:
        parse_config_name(c)
    return "\n".join(lines)


def dataset_card(
    benchmark: str,
    configs: Sequence[str],
    settings: AVCorruptionSettings,
    num_pairs: int,
    sampling_rate: int,
    source_description: str = "",
    license: str = "other",
) -> Any:
    """A dataset card describing the protocol, the configs and exactly how each was corrupted."""
    from huggingface_hub import DatasetCard, DatasetCardData

    title = {"audioset-o": "AudioSet-O", "audioset-d": "AudioSet-D", "vggsound": "VGGSound (AudioSet2VGG)"}[benchmark]
    rows = []
    for c in configs:
        if c == "clean":
            rows.append("| `clean` | - | the clean pairs: galleries (and queries of the real-world shift) |")
        elif c in AUDIOSET_O_CONFIGS:
            modality, cats = AUDIOSET_O_CONFIGS[c]
            subtypes = " + ".join(settings.corruptions_needed(c))
            rows.append(f"| `{c}` | {modality} | {len(cats)} equal segments, in order: {subtypes} |")
        else:
            pool = ", ".join(settings.corruptions_needed(c))
            rows.append(f"| `{c}` | {c.split('_')[0]} | {settings.num_segments} equal segments, each drawn from: {pool} |")
    video_cats = sorted(set(VIDEO_CORRUPTION_CATEGORIES.values()))
    text = f"""# {title}

Query-shift benchmark for video-audio (and audio/video-text) retrieval, built with
`hf_tta.data.builders` (the hf_tta library) following REST (Li, Yang, Peng, "Toward Robust and
Harmonious Adaptation for Cross-modal Retrieval", §3, Table IV).

{source_description}

## Protocol

- {num_pairs} video-audio pairs (1-to-1), split `test`. Row *i* of every config is the same clip (`id`).
- The gallery is always clean (config `clean`); only queries are corrupted.
- Directions: video->audio (AR), audio->video (VR), and with the `text` column audio<->text and video<->text
  (texts are the clip's caption or label names; equal texts form one gallery item).
- R@1 is REST's metric.

| config | corrupted modality | construction |
|---|---|---|
{chr(10).join(rows)}

## Corruptions

- Video ({', '.join(video_cats)}): ImageNet-C functions (`imagecorruptions-imaug`) applied frame by frame at
  severity {settings.video_severity}; frame *t* of a segment is seeded from the segment's seed.
- Audio: noise mixed into the waveform at {settings.audio_snr_db:g} dB SNR relative to the whole clean clip's power;
  Gaussian noise, or a user-provided recording of crowd / traffic / rain / thunder / wind noise looped from a seeded
  offset.
- Multi-distribution shift (-O): *k* corruptions -> *k* equal temporal segments. Diverse shift (-D): each segment
  draws its corruption uniformly. Seed: {settings.seed}. Columns `corruptions`, `severity`/`snr_db` and `segments`
  ([start, end) in frames or samples) record what each query got.
- Representatives: video {settings.video_representatives}; audio {settings.audio_representatives}.

## Storage

- `video`: a list of frames (`Image`); `audio`: mono 32-bit float WAV bytes (`binary`) at {sampling_rate} Hz,
  decoded with `hf_tta.data.corruptions.audio_io.decode_wav` (or cast to `datasets.Audio()` where torchcodec works).
- Load queries, gallery and relevance with `hf_tta.data.builders.audioset.load_av_retrieval(repo_id, config, direction)`.

## License

The clips come from YouTube (AudioSet / VGGSound); their rights belong to their owners. Check that you may
redistribute them before making this dataset public.
"""
    data = DatasetCardData(license=license, task_categories=["audio-classification", "video-classification"],
                           tags=["hf_tta", "test-time-adaptation", "query-shift", "cross-modal-retrieval", benchmark],
                           pretty_name=title)
    return DatasetCard(f"---\n{data.to_yaml()}\n---\n{text}")


__all__ = ["CITATIONS", "card_metadata", "card_text", "dataset_card"]
