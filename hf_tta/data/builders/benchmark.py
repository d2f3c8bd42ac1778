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

import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

from ...logging import tqdm
from ..corruptions.base import BuildSettingsError, MissingResourceError, derive_seed
from ..corruptions.diverse import DEFAULT_IMAGE_POOL, DEFAULT_TEXT_POOL, corrupt_image_diverse, corrupt_text_diverse
from ..corruptions.image import corrupt_image
from ..corruptions.text import (
    REDRAWN_TEXT_CORRUPTIONS,
    TEXT_CORRUPTION_LEVELS,
    corrupt_text,
    corrupt_texts,
    missing_text_resources,
)
from .base import BUILD_INFO, SPLIT, build_versions, built_configs, encode_image, is_built
from .card import local_card
from .karpathy import KarpathyImage, SourceReport, karpathy_images, read_karpathy_json, scan_sources
from .specs import (
    EXTRA_COLUMNS,
    BenchmarkSpec,
    ConfigSpec,
    benchmark_spec,
    default_configs,
    image_features,
    order_configs,
    parse_config_name,
    text_features,
)

logger = logging.getLogger(__name__)


# ------------------------------------------------------------------------------------------------ generation
def _image_rows(records: list[dict], spec: ConfigSpec, seed: int, opts: dict):
    from PIL import Image

    ext = ".jpg" if opts["image_format"] == "JPEG" else ".png"
    for rec in records:
        base = {
            **{c: rec[c] for c in opts["extra"]},
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
        data = encode_image(out, opts["image_format"], opts["jpeg_quality"])
        yield {
            **base,
            "image": {"bytes": data, "path": Path(rec["filename"]).stem + ext},
            "corruption": name,
            "severity": sev,
        }


def _text_rows(records: list[dict], spec: ConfigSpec, seed: int, opts: dict):
    kw = dict(opts["text_kwargs"])
    for rec in records:
        caps, ids = rec["captions"], rec["caption_ids"]
        if spec.corruption == "diverse":
            outs = [corrupt_text_diverse(c, sid, seed, opts["text_pool"], **kw) for c, sid in zip(caps, ids)]
            new, names, sevs = [o[0] for o in outs], [o[1] for o in outs], [o[2] for o in outs]
        else:
            name, sev = spec.corruption, spec.severity
            if TEXT_CORRUPTION_LEVELS[name] == "sentence" and (kw.get("similarity_fn") is None or name not in REDRAWN_TEXT_CORRUPTIONS):
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
            **{c: rec[c] for c in opts["extra"]},
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
            to the word-level and style text corruptions as in the benchmark (not back-translation, which is
            deterministic; see :data:`~hf_tta.data.corruptions.text.REDRAWN_TEXT_CORRUPTIONS`).
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
        self.spec = benchmark_spec(benchmark)
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
        self.left_out: dict[str, list[str]] = {}  # configs a build(skip_missing=True) could not build
        self.missing_resources: dict[str, str] = {}
        self._records: list[KarpathyImage] | None = None

    # ---------------------------------------------------------------------------------------- sources
    def _params(self) -> dict:
        """What determines the content; a resumed build must use the same."""
        params = {
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
        # Written only when set, so that builds made before these keys were recorded still resume.
        if self.text_kwargs["generate_kwargs"]:
            params["generate_kwargs"] = json.loads(json.dumps(self.text_kwargs["generate_kwargs"], sort_keys=True, default=str))
        if self.text_kwargs["similarity_fn"] is not None:
            params["max_tries"] = self.text_kwargs["max_tries"]
        return params

    def prepare(self) -> SourceReport:
        """Read the split file and check the images on disk (once per builder)."""
        if self._records is not None:
            return self.report
        report = SourceReport(split=self.split, expected_images=(self.spec.expected_images or None) if self.limit is None else None)
        images = self._source_images(report)
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

    def _source_images(self, report: SourceReport) -> list[KarpathyImage]:
        """The images of the split with their captions, before the files are checked (subclasses read other raw
        formats: :mod:`.pairs`, :mod:`.realworld`)."""
        data = read_karpathy_json(self.karpathy_json)
        images = karpathy_images(data, self.split, self.captions_per_image, report)
        if not images:
            raise ValueError(f"{self.karpathy_json} has no image in split {self.split!r}.")
        return images

    @property
    def extra_columns(self) -> tuple[str, ...]:
        """The optional columns (``group``, ``domain``) the records carry."""
        return tuple(c for c in EXTRA_COLUMNS if any(getattr(r, c) is not None for r in self.records))

    @property
    def records(self) -> list[KarpathyImage]:
        self.prepare()
        return self._records

    # ---------------------------------------------------------------------------------------- state
    def config_dir(self, config: str) -> Path:
        return self.output_dir / config

    def is_complete(self, config: str) -> bool:
        return is_built(self.config_dir(config))

    def built_configs(self) -> list[str]:
        return built_configs(self.output_dir)

    def _read_info(self) -> dict | None:
        path = self.output_dir / BUILD_INFO
        return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None

    def _write_info(self) -> None:
        info = {
            "params": self._params(),
            "source_report": self.report.to_dict() if self.report else None,
            "configs": {c: self._config_meta(c) for c in self.built_configs()},
            "versions": build_versions(),
        }
        tmp = self.output_dir / (BUILD_INFO + ".tmp")
        tmp.write_text(json.dumps(info, indent=1, default=str), encoding="utf-8")
        os.replace(tmp, self.output_dir / BUILD_INFO)
        # the card, whose YAML `configs` make the folder loadable with datasets.load_dataset(folder, config)
        card = local_card(self.spec, str(self.output_dir), info, order_configs(info["configs"]))
        tmp = self.output_dir / "README.md.tmp"
        tmp.write_text(card, encoding="utf-8")
        os.replace(tmp, self.output_dir / "README.md")

    def _config_meta(self, config: str) -> dict:
        path = self.config_dir(config) / "hf_tta_config.json"
        return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}

    def _check_resume(self) -> None:
        info = self._read_info()
        if info is None:
            return
        # as written to build_info.json (tuples read back as lists: a spec's citations, directions)
        old, new = info.get("params", {}), json.loads(json.dumps(self._params(), default=str))
        diff = {k: (old.get(k), v) for k, v in new.items() if old.get(k) != v}
        if diff and self.built_configs():
            raise BuildSettingsError(
                f"{self.output_dir} holds configs built with other settings {diff} (old, new): use another output "
                "directory, or the same settings to resume."
            )

    # ---------------------------------------------------------------------------------------- preflight
    def check_resources(self, configs: Iterable[str], skip_missing: bool = False) -> dict[str, list[str]]:
        """Fail fast, before hours of work, when text corruptions lack WordNet, nlpaug or a seq2seq model.

        Every missing resource is found (``self.missing_resources``: ``{corruption: why}``), not only the first.
        Raises ``MissingResourceError`` naming them all, unless ``skip_missing``: then returns ``{config: its
        missing corruptions}`` for the configs that cannot be built (``text-diverse`` when its pool needs one).
        """
        needs: dict[str, set[str]] = {}
        for c in configs:
            spec = parse_config_name(c)
            if spec.modality == "text":
                needs[c] = {n for n, _ in self.text_pool} if spec.corruption == "diverse" else {spec.corruption}
        kw = self.text_kwargs
        missing = missing_text_resources(set().union(*needs.values()), kw["wordnet"], kw["models"], kw["device"])
        self.missing_resources = missing
        if missing and not skip_missing:
            lines = "\n".join(f"- {n}: {why}" for n, why in missing.items())
            raise MissingResourceError(f"{len(missing)} text corruptions lack their resources ({', '.join(missing)}):\n{lines}")
        return {c: sorted(n & missing.keys()) for c, n in needs.items() if n & missing.keys()}

    # ---------------------------------------------------------------------------------------- build
    def build(self, configs: Iterable[str] | None = None, overwrite: bool = False, skip_missing: bool = False) -> dict[str, Any]:
        """Build the configs (default: :func:`default_configs`); complete ones are skipped unless ``overwrite``.

        Args:
            skip_missing: build what can be built when text corruptions lack their resources (WordNet, nlpaug, a
                seq2seq checkpoint): the configs that need them are left out, listed in ``self.left_out``
                (``{config: missing corruptions}``) and ``self.missing_resources``; by default the build stops
                before any work, naming every missing resource.

        Returns:
            ``{config: Dataset}`` for every requested config (that was not left out).
        """
        configs = list(default_configs() if configs is None else configs)
        for c in configs:
            parse_config_name(c)
        self.output_dir.mkdir(parents=True, exist_ok=True)
        self._check_resume()
        self.prepare()
        todo = [c for c in configs if overwrite or not self.is_complete(c)]
        self.left_out = self.check_resources(todo, skip_missing) if todo else {}
        if self.left_out:
            logger.warning("Left out %d configs whose text corruptions lack resources: %s", len(self.left_out), ", ".join(self.left_out))
            todo = [c for c in todo if c not in self.left_out]
            configs = [c for c in configs if c not in self.left_out]
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
            "extra": self.extra_columns,
        }
        cache = self.output_dir / ".cache" / config
        tmp = self.output_dir / f".tmp-{config}"
        for d in (cache, tmp):
            shutil.rmtree(d, ignore_errors=True)
        fingerprint = f"hf_tta-{derive_seed(json.dumps(self._params(), sort_keys=True), config, len(records)):08x}"
        ds = Dataset.from_generator(
            _generate_rows,
            features=image_features(opts["extra"]) if spec.has_images else text_features(opts["extra"]),
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


def _describe_models(models: Mapping[str, Any] | None) -> dict[str, Any]:
    def one(spec):
        if isinstance(spec, (str, os.PathLike)):
            return str(spec)
        if isinstance(spec, (list, tuple)) and all(isinstance(s, (str, os.PathLike)) for s in spec):
            return [str(s) for s in spec]
        return type(spec).__name__

    return {k: one(v) for k, v in sorted((models or {}).items())}



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


__all__ = ["BenchmarkBuilder", "build_benchmark"]
