"""Build COCO-C / Flickr-C (TCR's query-shift benchmarks, REST's -O and -D variants) from local images.

One config per corruption and severity, plus the clean data and the diverse (per-query) variants:

=========================  ==========================================================================
config                     rows (one per image, file order of the Karpathy split)
=========================  ==========================================================================
``clean``                  the original image bytes + its clean captions
``image-<name>-<s>``       the image corrupted by ``<name>`` at severity ``s`` (1..5) + clean captions
``image-diverse``          each image with its own corruption drawn from a pool (REST's DQS, "-D")
``text-<name>-<s>``        the captions corrupted by ``<name>`` at severity ``s``; no image column: the
                           gallery of text→image retrieval is the ``clean`` config
``text-diverse``           each caption with its own corruption drawn from a pool
=========================  ==========================================================================

Every config is written with ``Dataset.from_generator`` + ``save_to_disk`` to ``output_dir/<config>``; a config
whose folder exists is complete (it is written under a temporary name and renamed at the end), so an
interrupted build resumes where it stopped. The corruption of every item is a function of the build seed, the
config and the item's stable id (Karpathy ``imgid`` / ``sentid``), so results do not depend on ``num_proc``.
"""

from __future__ import annotations

import io
import json
import logging
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

from tqdm.auto import tqdm

from ..corruptions._utils import derive_seed
from ..corruptions.diverse import DEFAULT_IMAGE_POOL, DEFAULT_TEXT_POOL
from ..corruptions.image import IMAGE_CORRUPTIONS, IMAGE_SEVERITIES
from ..corruptions.text import (
    MAX_TEXT_SEVERITY,
    PAPER_TEXT_SEVERITIES,
    SENTENCE_CORRUPTIONS,
    TEXT_CORRUPTION_LEVELS,
    TEXT_CORRUPTIONS,
    TEXT_SEVERITIES,
)
from .karpathy import KarpathyImage, SourceReport, karpathy_images, read_karpathy_json, scan_sources

logger = logging.getLogger(__name__)

SPLIT = "test"
CLEAN = "clean"
BUILD_INFO = "build_info.json"


# ------------------------------------------------------------------------------------------------ benchmarks
@dataclass(frozen=True)
class BenchmarkSpec:
    """What a benchmark is built from, for the builder and the dataset card."""

    name: str
    pretty_name: str
    source_name: str
    split_file: str
    expected_images: int
    expected_captions: int
    image_license: str
    annotation_license: str
    license_id: str
    source_url: str
    citations: tuple[str, ...] = field(default_factory=tuple)


_KARPATHY = """@inproceedings{karpathy2015deep,
  title={Deep Visual-Semantic Alignments for Generating Image Descriptions},
  author={Karpathy, Andrej and Fei-Fei, Li},
  booktitle={CVPR}, year={2015}
}"""

COCO_C = BenchmarkSpec(
    name="coco-c",
    pretty_name="COCO-C (query-shift image-text retrieval)",
    source_name="MS-COCO 2014, Karpathy 5k test split",
    split_file="dataset_coco.json",
    expected_images=5000,
    expected_captions=25000,
    image_license=(
        "The COCO images come from Flickr under the Flickr Terms of Use; the COCO Consortium does not own their "
        "copyright. Use them under those terms (see https://cocodataset.org/#termsofuse)."
    ),
    annotation_license="COCO annotations (captions): Creative Commons Attribution 4.0 (CC BY 4.0).",
    license_id="cc-by-4.0",
    source_url="https://cocodataset.org",
    citations=(
        """@inproceedings{lin2014microsoft,
  title={Microsoft {COCO}: Common Objects in Context},
  author={Lin, Tsung-Yi and Maire, Michael and Belongie, Serge and Hays, James and Perona, Pietro and Ramanan, Deva and Doll{\\'a}r, Piotr and Zitnick, C. Lawrence},
  booktitle={ECCV}, year={2014}
}""",
        _KARPATHY,
    ),
)

FLICKR_C = BenchmarkSpec(
    name="flickr-c",
    pretty_name="Flickr-C (query-shift image-text retrieval)",
    source_name="Flickr30K, Karpathy 1k test split",
    split_file="dataset_flickr30k.json",
    expected_images=1000,
    expected_captions=5000,
    image_license=(
        "The Flickr30K images are Flickr photos distributed for non-commercial research and educational use only, "
        "under the Flickr Terms of Use (see the Flickr30K terms at https://shannon.cs.illinois.edu/DenotationGraph/)."
    ),
    annotation_license="Flickr30K captions: distributed by their authors for non-commercial research use.",
    license_id="other",
    source_url="https://shannon.cs.illinois.edu/DenotationGraph/",
    citations=(
        """@article{young2014image,
  title={From image descriptions to visual denotations: New similarity metrics for semantic inference over event descriptions},
  author={Young, Peter and Lai, Alice and Hodosh, Micah and Hockenmaier, Julia},
  journal={TACL}, volume={2}, pages={67--78}, year={2014}
}""",
        _KARPATHY,
    ),
)

BENCHMARKS: dict[str, BenchmarkSpec] = {COCO_C.name: COCO_C, FLICKR_C.name: FLICKR_C}


# ------------------------------------------------------------------------------------------------ config names
@dataclass(frozen=True)
class ConfigSpec:
    modality: str | None  # "image", "text" or None for clean
    corruption: str | None  # a corruption name, "diverse", or None for clean
    severity: int | None

    @property
    def name(self) -> str:
        if self.modality is None:
            return CLEAN
        if self.corruption == "diverse":
            return f"{self.modality}-diverse"
        return f"{self.modality}-{self.corruption}-{self.severity}"

    @property
    def has_images(self) -> bool:
        return self.modality != "text"


def config_name(modality: str | None, corruption: str | None = None, severity: int | None = None) -> str:
    """``clean``, ``image-<name>-<severity>``, ``text-<name>-<severity>``, ``image-diverse``, ``text-diverse``."""
    return parse_config_name(ConfigSpec(modality, corruption, severity).name).name


def parse_config_name(name: str) -> ConfigSpec:
    """Check a config name and split it into modality, corruption and severity."""
    if name == CLEAN:
        return ConfigSpec(None, None, None)
    parts = name.split("-")
    if len(parts) == 2 and parts[1] == "diverse" and parts[0] in ("image", "text"):
        return ConfigSpec(parts[0], "diverse", None)
    if len(parts) == 3 and parts[0] in ("image", "text"):
        modality, corruption, sev = parts
        known = IMAGE_CORRUPTIONS if modality == "image" else TEXT_CORRUPTIONS
        allowed = IMAGE_SEVERITIES if modality == "image" else TEXT_SEVERITIES.get(corruption, ())
        if corruption in known and sev.isdigit() and int(sev) in allowed:
            return ConfigSpec(modality, corruption, int(sev))
        if corruption in known:
            raise ValueError(f"Config {name!r}: {corruption!r} has severities {list(allowed)}.")
    raise ValueError(
        f"Unknown config {name!r}: use 'clean', 'image-<corruption>-<1..5>', 'text-<corruption>-<severity>', "
        f"'image-diverse' or 'text-diverse' (image corruptions: {list(IMAGE_CORRUPTIONS)}; text corruptions: "
        f"{list(TEXT_CORRUPTIONS)})."
    )


def text_severities(mode: str | Sequence[int] = "max") -> dict[str, tuple[int, ...]]:
    """Severities per text corruption: ``"max"`` (char/word 7, sentence 1: the benchmark tables), ``"paper"`` (the
    released TCR data: char 1..7, word 6..7, sentence 1), ``"all"`` (char/word 1..7), or a list (clipped to each
    corruption's range)."""
    if mode == "max":
        return {n: (MAX_TEXT_SEVERITY[n],) for n in TEXT_CORRUPTIONS}
    if mode == "paper":
        return dict(PAPER_TEXT_SEVERITIES)
    if mode == "all":
        return dict(TEXT_SEVERITIES)
    if isinstance(mode, str):
        raise ValueError(f"text severities must be 'max', 'paper', 'all' or a list; got {mode!r}.")
    return {n: tuple(s for s in mode if s in TEXT_SEVERITIES[n]) or (MAX_TEXT_SEVERITY[n],) for n in TEXT_CORRUPTIONS}


def default_configs(
    image_corruptions: Iterable[str] | None = None,
    image_severities: Iterable[int] = IMAGE_SEVERITIES,
    text_corruptions: Iterable[str] | None = None,
    text_severity_mode: str | Sequence[int] = "max",
    diverse: bool = True,
    clean: bool = True,
) -> list[str]:
    """The config names of a full build: clean, 16x5 image configs, 15 text configs (at maximum severity by
    default) and the two diverse configs."""
    names = [CLEAN] if clean else []
    image_corruptions = list(IMAGE_CORRUPTIONS if image_corruptions is None else image_corruptions)
    names += [f"image-{n}-{s}" for n in image_corruptions for s in image_severities]
    sev = text_severities(text_severity_mode)
    text_corruptions = list(TEXT_CORRUPTIONS if text_corruptions is None else text_corruptions)
    names += [f"text-{n}-{s}" for n in text_corruptions for s in sev[n]]
    if diverse:
        names += ["image-diverse", "text-diverse"]
    for n in names:
        parse_config_name(n)
    return names


# ------------------------------------------------------------------------------------------------ features
def image_features():
    from datasets import Features, Image, List, Value

    return Features(
        {
            "image_id": Value("int64"),
            "source_id": Value("string"),
            "filename": Value("string"),
            "image": Image(),
            "captions": List(Value("string")),
            "caption_ids": List(Value("int64")),
            "corruption": Value("string"),
            "severity": Value("int8"),
        }
    )


def text_features():
    from datasets import Features, List, Value

    return Features(
        {
            "image_id": Value("int64"),
            "source_id": Value("string"),
            "filename": Value("string"),
            "captions": List(Value("string")),
            "clean_captions": List(Value("string")),
            "caption_ids": List(Value("int64")),
            "corruption": List(Value("string")),
            "severity": List(Value("int8")),
        }
    )


# ------------------------------------------------------------------------------------------------ generation
def _encode_image(img, fmt: str, quality: int) -> bytes:
    buf = io.BytesIO()
    if fmt == "JPEG":
        img.save(buf, "JPEG", quality=quality)
    else:
        img.save(buf, "PNG")
    return buf.getvalue()


def _image_rows(records: list[dict], spec: ConfigSpec, seed: int, opts: dict):
    from PIL import Image

    from ..corruptions.diverse import corrupt_image_diverse
    from ..corruptions.image import corrupt_image

    ext = ".jpg" if opts["image_format"] == "JPEG" else ".png"
    for rec in records:
        base = {
            "image_id": rec["image_id"],
            "source_id": rec["source_id"],
            "filename": rec["filename"],
            "captions": rec["captions"],
            "caption_ids": rec["caption_ids"],
        }
        if spec.modality is None:
            with open(rec["path"], "rb") as f:
                data = f.read()
            yield {**base, "image": {"bytes": data, "path": rec["filename"]}, "corruption": "none", "severity": 0}
            continue
        with Image.open(rec["path"]) as im:
            img = im.convert("RGB")
        if spec.corruption == "diverse":
            out, name, sev = corrupt_image_diverse(img, rec["image_id"], seed, opts["image_pool"])
        else:
            name, sev = spec.corruption, spec.severity
            out = corrupt_image(img, name, sev, seed=derive_seed(seed, "image", name, sev, rec["image_id"]))
        data = _encode_image(out, opts["image_format"], opts["jpeg_quality"])
        yield {
            **base,
            "image": {"bytes": data, "path": Path(rec["filename"]).stem + ext},
            "corruption": name,
            "severity": sev,
        }


def _text_rows(records: list[dict], spec: ConfigSpec, seed: int, opts: dict):
    from ..corruptions.diverse import corrupt_text_diverse
    from ..corruptions.text import corrupt_text, corrupt_texts

    kw = dict(opts["text_kwargs"])
    for rec in records:
        caps, ids = rec["captions"], rec["caption_ids"]
        if spec.corruption == "diverse":
            outs = [corrupt_text_diverse(c, sid, seed, opts["text_pool"], **kw) for c, sid in zip(caps, ids)]
            new, names, sevs = [o[0] for o in outs], [o[1] for o in outs], [o[2] for o in outs]
        else:
            name, sev = spec.corruption, spec.severity
            if TEXT_CORRUPTION_LEVELS[name] == "sentence" and kw.get("similarity_fn") is None:
                # one generate() per image (its captions as a batch), seeded by the image id
                extra = {k: v for k, v in kw.items() if k in ("models", "device", "generate_kwargs")}
                new = corrupt_texts(
                    caps, name, sev, seed=derive_seed(seed, "text", name, sev, "image", rec["image_id"]),
                    batch_size=max(1, len(caps)), **extra,
                )
            else:
                new = [corrupt_text(c, name, sev, seed=derive_seed(seed, "text", name, sev, sid), **kw) for c, sid in zip(caps, ids)]
            names, sevs = [name] * len(caps), [sev] * len(caps)
        yield {
            "image_id": rec["image_id"],
            "source_id": rec["source_id"],
            "filename": rec["filename"],
            "captions": new,
            "clean_captions": caps,
            "caption_ids": ids,
            "corruption": names,
            "severity": sevs,
        }


def _generate_rows(shards: list[list[dict]], config: str, seed: int, opts: dict):
    """``Dataset.from_generator`` entry point (top level so it pickles for ``num_proc``)."""
    spec = parse_config_name(config)
    rows = _image_rows if spec.has_images else _text_rows
    for shard in shards:
        yield from rows(shard, spec, seed, opts)


# ------------------------------------------------------------------------------------------------ builder
class BenchmarkBuilder:
    """Builds the configs of one benchmark (COCO-C or Flickr-C) into ``output_dir``.

    Args:
        benchmark: ``"coco-c"``, ``"flickr-c"`` or a :class:`BenchmarkSpec`.
        karpathy_json: the split file (``dataset_coco.json`` / ``dataset_flickr30k.json``).
        images_root: the folder holding the images (COCO: the folder with ``val2014/``; Flickr30K: the folder
            with the ``.jpg`` files).
        output_dir: one sub-folder per config (``save_to_disk``), plus ``build_info.json``.
        split: the Karpathy split (``"test"``).
        seed: the build seed; every corruption draw is a function of it and the item's id.
        captions_per_image: keep the first N captions of each image (5, as the benchmark); ``None``: all.
        on_missing: ``"error"`` (default) stops when a source image is missing or unreadable, reporting the counts;
            ``"skip"`` leaves those images out of every config, counted in ``build_info.json`` and the card.
        image_format, jpeg_quality: how corrupted images are stored (the clean config keeps the original bytes).
        limit: build only the first N images of the split (smoke tests).
        image_pool, text_pool: ``(corruption, severity)`` pools of the diverse configs (default: every
            corruption at the maximum severity).
        text_models, wordnet, device, generate_kwargs: resources of the text corruptions (see
            :func:`hf_tta.data.corruptions.text.corrupt_text`).
        similarity_fn, min_similarity, max_tries: the optional "re-draw until similar enough" filter, applied
            to the word- and sentence-level text corruptions as in the benchmark.
        num_proc: processes for ``Dataset.from_generator`` (keep 1 with a GPU seq2seq model).
    """

    def __init__(
        self,
        benchmark: str | BenchmarkSpec,
        karpathy_json: str | os.PathLike,
        images_root: str | os.PathLike,
        output_dir: str | os.PathLike,
        *,
        split: str = SPLIT,
        seed: int = 0,
        captions_per_image: int | None = 5,
        on_missing: str = "error",
        image_format: str = "JPEG",
        jpeg_quality: int = 95,
        limit: int | None = None,
        image_pool: Sequence[tuple[str, int]] = DEFAULT_IMAGE_POOL,
        text_pool: Sequence[tuple[str, int]] = DEFAULT_TEXT_POOL,
        text_models: Mapping[str, Any] | None = None,
        wordnet: str | os.PathLike | None = None,
        device: Any = None,
        generate_kwargs: Mapping[str, Any] | None = None,
        similarity_fn: Callable[[str, str], float] | None = None,
        min_similarity: float = 0.9,
        max_tries: int = 100,
        num_proc: int | None = None,
        check_decode: bool = True,
        show_progress: bool = True,
    ):
        self.spec = BENCHMARKS[benchmark] if isinstance(benchmark, str) else benchmark
        self.karpathy_json = Path(karpathy_json)
        self.images_root = Path(images_root)
        self.output_dir = Path(output_dir)
        if on_missing not in ("error", "skip"):
            raise ValueError(f"on_missing must be 'error' or 'skip'; got {on_missing!r}.")
        image_format = image_format.upper().replace("JPG", "JPEG")
        if image_format not in ("JPEG", "PNG"):
            raise ValueError(f"image_format must be 'JPEG' or 'PNG'; got {image_format!r}.")
        self.split, self.seed, self.captions_per_image = split, int(seed), captions_per_image
        self.on_missing, self.image_format, self.jpeg_quality, self.limit = on_missing, image_format, int(jpeg_quality), limit
        self.image_pool = tuple((str(n), int(s)) for n, s in image_pool)
        self.text_pool = tuple((str(n), int(s)) for n, s in text_pool)
        self.text_kwargs = {
            "models": dict(text_models) if text_models else None,
            "wordnet": str(wordnet) if wordnet is not None else None,
            "device": device,
            "generate_kwargs": dict(generate_kwargs) if generate_kwargs else None,
            "similarity_fn": similarity_fn,
            "min_similarity": min_similarity,
            "max_tries": max_tries,
        }
        self.num_proc, self.check_decode, self.show_progress = num_proc, check_decode, show_progress
        self.report: SourceReport | None = None
        self._records: list[KarpathyImage] | None = None

    # ---------------------------------------------------------------------------------------- sources
    def _params(self) -> dict:
        """What determines the content; a resumed build must use the same."""
        return {
            "benchmark": self.spec.name,
            "split": self.split,
            "seed": self.seed,
            "captions_per_image": self.captions_per_image,
            "image_format": self.image_format,
            "jpeg_quality": self.jpeg_quality,
            "limit": self.limit,
            "image_pool": [list(p) for p in self.image_pool],
            "text_pool": [list(p) for p in self.text_pool],
            "text_models": _describe_models(self.text_kwargs["models"]),
            "similarity_filter": self.text_kwargs["similarity_fn"] is not None,
            "min_similarity": self.text_kwargs["min_similarity"] if self.text_kwargs["similarity_fn"] else None,
        }

    def prepare(self) -> SourceReport:
        """Read the split file and check the images on disk (once per builder)."""
        if self._records is not None:
            return self.report
        report = SourceReport(split=self.split, expected_images=self.spec.expected_images if self.limit is None else None)
        data = read_karpathy_json(self.karpathy_json)
        images = karpathy_images(data, self.split, self.captions_per_image, report)
        if not images:
            raise ValueError(f"{self.karpathy_json} has no image in split {self.split!r}.")
        if self.limit is not None:
            images = images[: self.limit]
        usable = scan_sources(images, self.images_root, report, self.check_decode, self.show_progress)
        self.report = report
        logger.info(report.summary())
        if report.problems and self.on_missing == "error":
            raise FileNotFoundError(
                f"{report.problems} of {len(images)} source images are unusable under {self.images_root}: "
                f"{report.summary()}. Fix the files, or pass on_missing='skip' (--on-missing skip) to leave them "
                "out of every config (they are counted in build_info.json and the dataset card)."
            )
        if report.problems:
            logger.warning("Leaving out %d unusable source images: %s", report.problems, report.summary())
        if report.truncated_captions:
            logger.info("%d extra captions left out (captions_per_image=%s).", report.truncated_captions, self.captions_per_image)
        self._records = usable
        return report

    @property
    def records(self) -> list[KarpathyImage]:
        self.prepare()
        return self._records

    # ---------------------------------------------------------------------------------------- state
    def config_dir(self, config: str) -> Path:
        return self.output_dir / config

    def is_complete(self, config: str) -> bool:
        return (self.config_dir(config) / "dataset_info.json").is_file()

    def built_configs(self) -> list[str]:
        if not self.output_dir.is_dir():
            return []
        return sorted(p.name for p in self.output_dir.iterdir() if p.is_dir() and not p.name.startswith(".") and self.is_complete(p.name))

    def _read_info(self) -> dict | None:
        path = self.output_dir / BUILD_INFO
        return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None

    def _write_info(self) -> None:
        info = {
            "params": self._params(),
            "source_report": self.report.to_dict() if self.report else None,
            "configs": {c: self._config_meta(c) for c in self.built_configs()},
            "versions": _versions(),
        }
        tmp = self.output_dir / (BUILD_INFO + ".tmp")
        tmp.write_text(json.dumps(info, indent=1, default=str), encoding="utf-8")
        os.replace(tmp, self.output_dir / BUILD_INFO)

    def _config_meta(self, config: str) -> dict:
        path = self.config_dir(config) / "hf_tta_config.json"
        return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}

    def _check_resume(self) -> None:
        info = self._read_info()
        if info is None:
            return
        old, new = info.get("params", {}), self._params()
        diff = {k: (old.get(k), v) for k, v in new.items() if old.get(k) != v}
        if diff and self.built_configs():
            raise ValueError(
                f"{self.output_dir} holds configs built with other settings {diff} (old, new): use another output "
                "directory, or the same settings to resume."
            )

    # ---------------------------------------------------------------------------------------- preflight
    def check_resources(self, configs: Iterable[str]) -> None:
        """Fail fast, before hours of work, when a text corruption lacks WordNet, nlpaug or a seq2seq model."""
        from ..corruptions.text import _char_augmenter, load_wordnet, sentence_generators

        needed: set[str] = set()
        for c in configs:
            spec = parse_config_name(c)
            if spec.modality != "text":
                continue
            if spec.corruption == "diverse":
                needed.update(n for n, _ in self.text_pool)
            else:
                needed.add(spec.corruption)
        if any(TEXT_CORRUPTION_LEVELS[n] == "char" for n in needed):
            _char_augmenter("ocr", 1)
        if needed & {"synonym_replacement", "random_insertion"}:
            load_wordnet(self.text_kwargs["wordnet"])
        for n in sorted(needed & set(SENTENCE_CORRUPTIONS)):
            sentence_generators(n, self.text_kwargs["models"], self.text_kwargs["device"])

    # ---------------------------------------------------------------------------------------- build
    def build(self, configs: Iterable[str] | None = None, overwrite: bool = False) -> dict[str, Any]:
        """Build the configs (default: :func:`default_configs`); complete ones are skipped unless ``overwrite``.

        Returns:
            ``{config: Dataset}`` for every requested config.
        """
        configs = list(default_configs() if configs is None else configs)
        for c in configs:
            parse_config_name(c)
        self.output_dir.mkdir(parents=True, exist_ok=True)
        self._check_resume()
        self.prepare()
        todo = [c for c in configs if overwrite or not self.is_complete(c)]
        if todo:
            self.check_resources(todo)
        self._write_info()
        skipped = len(configs) - len(todo)
        if skipped:
            logger.info("%d of %d configs are already built in %s: skipped.", skipped, len(configs), self.output_dir)
        for c in tqdm(todo, desc=f"Building {self.spec.name} configs", disable=not self.show_progress or len(todo) < 2):
            self.build_config(c, overwrite=overwrite)
        return {c: self.load(c) for c in configs}

    def build_config(self, config: str, overwrite: bool = False):
        """Build one config into ``output_dir/<config>`` (atomically) and return it."""
        from datasets import Dataset

        spec = parse_config_name(config)
        final = self.config_dir(config)
        if self.is_complete(config) and not overwrite:
            return self.load(config)
        records = [r.to_dict() for r in self.records]
        n_shards = max(1, min(self.num_proc or 1, len(records)))
        size = -(-len(records) // n_shards)  # contiguous shards keep the file order after concatenation
        shards = [records[i : i + size] for i in range(0, len(records), size)]
        n_shards = len(shards)
        opts = {
            "image_format": self.image_format,
            "jpeg_quality": self.jpeg_quality,
            "image_pool": self.image_pool,
            "text_pool": self.text_pool,
            "text_kwargs": self.text_kwargs,
        }
        cache = self.output_dir / ".cache" / config
        tmp = self.output_dir / f".tmp-{config}"
        for d in (cache, tmp):
            shutil.rmtree(d, ignore_errors=True)
        fingerprint = f"hf_tta-{derive_seed(json.dumps(self._params(), sort_keys=True), config, len(records)):08x}"
        ds = Dataset.from_generator(
            _generate_rows,
            features=image_features() if spec.has_images else text_features(),
            gen_kwargs={"shards": shards, "config": config, "seed": self.seed, "opts": opts},
            cache_dir=str(cache),
            num_proc=n_shards if n_shards > 1 else None,
            split=SPLIT,
            fingerprint=fingerprint,
            writer_batch_size=100 if spec.has_images else 1000,
        )
        if len(ds) != len(records):  # pragma: no cover - a generator that dropped rows would be a bug
            raise RuntimeError(f"{config}: generated {len(ds)} rows for {len(records)} images.")
        ds.save_to_disk(str(tmp))
        meta = {
            "config": config,
            "modality": spec.modality,
            "corruption": spec.corruption,
            "severity": spec.severity,
            "num_rows": len(ds),
            "num_captions": sum(len(r["caption_ids"]) for r in records),
        }
        (tmp / "hf_tta_config.json").write_text(json.dumps(meta, indent=1), encoding="utf-8")
        del ds
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        shutil.rmtree(cache, ignore_errors=True)
        try:
            cache.parent.rmdir()  # only when empty
        except OSError:
            pass
        self._write_info()
        return self.load(config)

    # ---------------------------------------------------------------------------------------- access
    def load(self, config: str):
        """A built config as a ``Dataset`` (split ``test``)."""
        from datasets import load_from_disk

        if not self.is_complete(config):
            raise FileNotFoundError(f"Config {config!r} is not built in {self.output_dir}; run build([{config!r}]).")
        return load_from_disk(str(self.config_dir(config)))

    def dataset_dict(self, config: str):
        """A built config as a ``DatasetDict({"test": ...})``."""
        from datasets import DatasetDict

        return DatasetDict({SPLIT: self.load(config)})

    def push_to_hub(self, repo_id: str, configs: Iterable[str] | None = None, **kwargs):
        """Publish the built configs and a generated dataset card (see :func:`hf_tta.data.builders.hub.push_benchmark`)."""
        from .hub import push_benchmark

        return push_benchmark(self.output_dir, repo_id, configs=configs, spec=self.spec, **kwargs)


def _describe_models(models: Mapping[str, Any] | None) -> dict[str, Any]:
    def one(spec):
        if isinstance(spec, (str, os.PathLike)):
            return str(spec)
        if isinstance(spec, (list, tuple)) and all(isinstance(s, (str, os.PathLike)) for s in spec):
            return [str(s) for s in spec]
        return type(spec).__name__

    return {k: one(v) for k, v in sorted((models or {}).items())}


def _versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for pkg in ("hf_tta", "imagecorruptions-imaug", "nlpaug", "nltk", "datasets", "transformers"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            pass
    return out


def build_benchmark(
    benchmark: str | BenchmarkSpec,
    karpathy_json: str | os.PathLike,
    images_root: str | os.PathLike,
    output_dir: str | os.PathLike,
    configs: Iterable[str] | None = None,
    **kwargs,
) -> dict[str, Any]:
    """Build (or resume) a benchmark: ``{config: Dataset}``. ``kwargs`` go to :class:`BenchmarkBuilder`."""
    return BenchmarkBuilder(benchmark, karpathy_json, images_root, output_dir, **kwargs).build(configs)
