"""FIQ-O / FIQ-D and CIRR-O / CIRR-D (REST Tables III, VI and A.8): composed image retrieval under query shift, built
from the user's raw FashionIQ or CIRR validation files (:mod:`.composed_sources`).

=====================  ==========================================================================================
config                 rows
=====================  ==========================================================================================
``gallery``            the target images (clean): ``image_id``, ``name``, ``image``
``clean``              one row per composed query: the reference ``image``, the modification ``text``, ``target``
``<img>_<txt>``        the 12 -O configs (REST: "multi-distribution shift" on both modalities of the query): the
                       reference image corrupted by the representative subtype of ``<img>`` in {noise, blur,
                       weather, digital} and the text by that of ``<txt>`` in {char, word, sent}, at the maximum
                       severity (image 5; char/word 7; sentence 1)
``diverse``            the -D config: each query its own random image corruption and random text corruption
=====================  ==========================================================================================

Representative subtypes: REST names Gaussian noise (image Noise) and OCR (text Char); Word = synonym replacement and
Sent = back-translation follow the digest's reading of Table A.1; Blur, Weather and Digital are not recoverable from
the paper, so this library uses defocus blur, snow and contrast (the first of each category in ImageNet-C's order, as
its video representatives). All are arguments. Every draw is a function of the build seed, the config and the query
id. REST evaluates with batch size 32 (``hf-tta run --batch-size 32``).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any, Mapping, Sequence

from ..corruptions.base import BuildSettingsError, derive_seed
from ..corruptions.diverse import DEFAULT_IMAGE_POOL, DEFAULT_TEXT_POOL, corrupt_image_diverse, corrupt_text_diverse
from ..corruptions.image import MAX_IMAGE_SEVERITY, corrupt_image
from ..corruptions.text import MAX_TEXT_SEVERITY, check_text_resources, corrupt_text
from .base import BUILD_INFO, SPLIT, build_versions, built_configs, encode_image, is_built
from .composed_sources import ComposedSource, check_files, read_cirr, read_fashioniq
from .specs import BenchmarkSpec

logger = logging.getLogger(__name__)

IMAGE_CATEGORIES = ("noise", "blur", "weather", "digital")
TEXT_CATEGORIES = ("char", "word", "sent")
IMAGE_REPRESENTATIVES = {"noise": "gaussian_noise", "blur": "defocus_blur", "weather": "snow", "digital": "contrast"}
TEXT_REPRESENTATIVES = {"char": "ocr", "word": "synonym_replacement", "sent": "back_translation"}
GALLERY = "gallery"
O_CONFIGS = tuple(f"{i}_{t}" for i in IMAGE_CATEGORIES for t in TEXT_CATEGORIES)
COMPOSED_CONFIGS = (GALLERY, "clean", *O_CONFIGS, "diverse")

FIQ_SPEC = dict(
    source_name="FashionIQ validation split", split_file="captions/cap.<category>.val.json", expected_images=0,
    expected_captions=0, license_id="other", source_url="https://github.com/XiaoxiaoGuo/fashion-iq",
    image_license="FashionIQ images: Amazon product images, for non-commercial research (see the FashionIQ repository).",
    annotation_license="FashionIQ relative captions: CDLA-Permissive 1.0 per the FashionIQ repository (check before publishing).",
    citations=("""@inproceedings{wu2021fashion,
  title={Fashion IQ: A New Dataset Towards Retrieving Images by Natural Language Feedback},
  author={Wu, Hui and Gao, Yupeng and Guo, Xiaoxiao and Al-Halah, Ziad and Rennie, Steven and Grauman, Kristen and Feris, Rogerio},
  booktitle={CVPR}, year={2021}
}""",), directions=("c2i",), ids_note="", split_license="FashionIQ captions and image splits: see the FashionIQ repository.",
)
CIRR_SPEC = dict(
    source_name="CIRR validation split (rc2)", split_file="captions/cap.rc2.val.json", expected_images=0, expected_captions=0,
    license_id="other", source_url="https://github.com/Cuberick-Orion/CIRR",
    image_license="CIRR images: from NLVR2 (web images), for research use under NLVR2's terms.",
    annotation_license="CIRR annotations: MIT licence per the CIRR repository (check before publishing).",
    citations=("""@inproceedings{liu2021image,
  title={Image Retrieval on Real-life Images with Pre-trained Vision-and-Language Models},
  author={Liu, Zheyuan and Rodriguez-Opazo, Cristian and Teney, Damien and Gould, Stephen},
  booktitle={ICCV}, year={2021}
}""",), directions=("c2i",), ids_note="", split_license="CIRR captions and image splits: see the CIRR repository.",
)


def composed_spec(kind: str, category: str | None = None) -> BenchmarkSpec:
    """The card fields of FIQ-<category> or CIRR (baseline tau 0.01: REST's value for every set but Fashion-Gen)."""
    if kind == "fashioniq":
        return BenchmarkSpec(name=f"fiq-{category}", pretty_name=f"FIQ-O / FIQ-D ({category}): composed image retrieval under query shift", **FIQ_SPEC)
    return BenchmarkSpec(name="cirr", pretty_name="CIRR-O / CIRR-D: composed image retrieval under query shift", **CIRR_SPEC)


def _features(config: str):
    from datasets import Features, Image, List, Value

    if config == GALLERY:
        return Features({"image_id": Value("int64"), "name": Value("string"), "image": Image()})
    return Features({
        "query_id": Value("int64"), "pair_id": Value("string"), "category": Value("string"), "reference": Value("string"),
        "target": Value("string"), "members": List(Value("string")), "image": Image(), "text": Value("string"),
        "clean_text": Value("string"), "image_corruption": Value("string"), "image_severity": Value("int8"),
        "text_corruption": Value("string"), "text_severity": Value("int8"),
    })


def _rows(data: dict, config: str, seed: int, opts: dict):
    """``Dataset.from_generator`` entry point: the rows of one config (``data``: ``{"queries", "gallery"}``, in a
    dict so that ``datasets`` does not try to shard the two lists)."""
    from PIL import Image

    queries, gallery = data["queries"], data["gallery"]
    if config == GALLERY:
        for i, name, path in gallery:
            with open(path, "rb") as f:
                yield {"image_id": i, "name": name, "image": {"bytes": f.read(), "path": Path(path).name}}
        return
    kw = opts["text_kwargs"]
    for q in queries:
        base = {k: q[k] for k in ("query_id", "pair_id", "category", "reference", "target", "members")}
        if config == "clean":
            with open(q["path"], "rb") as f:
                data = f.read()
            yield {**base, "image": {"bytes": data, "path": Path(q["path"]).name}, "text": q["text"], "clean_text": q["text"],
                   "image_corruption": "none", "image_severity": 0, "text_corruption": "none", "text_severity": 0}
            continue
        with Image.open(q["path"]) as im:
            img = im.convert("RGB")
        if config == "diverse":
            img, iname, isev = corrupt_image_diverse(img, q["query_id"], derive_seed(seed, "composed-image-diverse"), opts["image_pool"])
            text, tname, tsev = corrupt_text_diverse(q["text"], q["query_id"], derive_seed(seed, "composed-text-diverse"), opts["text_pool"], **kw)
        else:
            icat, tcat = config.split("_")
            iname, tname = opts["image_reps"][icat], opts["text_reps"][tcat]
            isev, tsev = MAX_IMAGE_SEVERITY, MAX_TEXT_SEVERITY[tname]
            img = corrupt_image(img, iname, isev, seed=derive_seed(seed, "composed-image", config, q["query_id"]))
            text = corrupt_text(q["text"], tname, tsev, seed=derive_seed(seed, "composed-text", config, q["query_id"]), **kw)
        yield {**base, "image": {"bytes": encode_image(img, "JPEG", 95), "path": f"{q['reference']}.jpg"}, "text": text,
               "clean_text": q["text"], "image_corruption": iname, "image_severity": isev, "text_corruption": tname, "text_severity": tsev}


class ComposedBuilder:
    """Builds the configs of FIQ-<category> or CIRR into ``output_dir`` (one ``save_to_disk`` folder per config,
    written under a temporary name and renamed, so an interrupted build resumes).

    Args:
        kind: ``"fashioniq"`` (with ``category``) or ``"cirr"``.
        root: the dataset folder (``captions/``, ``image_splits/``, images).
        images_root: where the images are (FashionIQ default ``root/images``; CIRR default ``root``).
        on_missing: ``"error"`` stops on a missing/unreadable image naming it; ``"skip"`` leaves it (and the
            queries that need it) out, counted in ``build_info.json`` and the card.
        limit: only the first N queries (smoke tests); the gallery stays whole.
        image_representatives / text_representatives: category -> subtype of the -O configs.
        image_pool / text_pool: ``(corruption, severity)`` pools of ``diverse`` (default: all at maximum severity).
        text_models, wordnet, device: text-corruption resources (see :func:`~hf_tta.data.corruptions.corrupt_text`).
    """

    def __init__(self, kind: str, root: str | os.PathLike, output_dir: str | os.PathLike, *, category: str | None = None,
                 images_root: str | os.PathLike | None = None, seed: int = 0, on_missing: str = "error", limit: int | None = None,
                 image_representatives: Mapping[str, str] | None = None, text_representatives: Mapping[str, str] | None = None,
                 image_pool: Sequence[tuple[str, int]] = DEFAULT_IMAGE_POOL, text_pool: Sequence[tuple[str, int]] = DEFAULT_TEXT_POOL,
                 text_models: Mapping[str, Any] | None = None, wordnet: str | None = None, device: Any = None, show_progress: bool = True):
        if kind not in ("fashioniq", "cirr"):
            raise ValueError(f"kind must be 'fashioniq' or 'cirr'; got {kind!r}.")
        if kind == "fashioniq" and category is None:
            raise ValueError("FashionIQ needs a category: dress, shirt or toptee (--category).")
        if on_missing not in ("error", "skip"):
            raise ValueError(f"on_missing must be 'error' or 'skip'; got {on_missing!r}.")
        self.kind, self.root, self.category = kind, Path(root), category
        self.images_root = images_root
        self.output_dir, self.seed, self.on_missing, self.limit = Path(output_dir), int(seed), on_missing, limit
        self.spec = composed_spec(kind, category)
        self.image_reps = {**IMAGE_REPRESENTATIVES, **(image_representatives or {})}
        self.text_reps = {**TEXT_REPRESENTATIVES, **(text_representatives or {})}
        self.image_pool = tuple((str(n), int(s)) for n, s in image_pool)
        self.text_pool = tuple((str(n), int(s)) for n, s in text_pool)
        self.text_kwargs = {"models": dict(text_models) if text_models else None, "wordnet": wordnet, "device": device}
        self.show_progress = show_progress
        self.source: ComposedSource | None = None
        self.report: _Report | None = None

    def default_configs(self) -> list[str]:
        return list(COMPOSED_CONFIGS)

    def _params(self) -> dict:
        return {"benchmark": self.spec.name, "kind": "composed", "spec": self.spec.to_dict(), "seed": self.seed,
                "limit": self.limit, "image_representatives": self.image_reps, "text_representatives": self.text_reps,
                "image_pool": [list(p) for p in self.image_pool], "text_pool": [list(p) for p in self.text_pool]}

    def prepare(self) -> "_Report":
        if self.source is not None:
            return self.report
        if self.kind == "fashioniq":
            source = read_fashioniq(self.root, self.category, self.images_root)
        else:
            source = read_cirr(self.root, self.images_root)
        if self.limit is not None:
            source.queries = source.queries[: self.limit]
        missing = check_files(source, self.on_missing)
        if not source.queries:
            raise ValueError(f"{self.root}: no composed query left to build.")
        self.source, self.report = source, _Report(len(source.queries), len(source.gallery), missing)
        logger.info(self.report.summary())
        return self.report

    def built_configs(self) -> list[str]:
        return built_configs(self.output_dir)

    def build(self, configs: Sequence[str] | None = None, overwrite: bool = False) -> dict[str, Any]:
        """Build ``configs`` (default :data:`COMPOSED_CONFIGS`); complete ones are skipped. Returns ``{config: Dataset}``."""
        from datasets import Dataset, load_from_disk

        configs = list(COMPOSED_CONFIGS if configs is None else configs)
        bad = [c for c in configs if c not in COMPOSED_CONFIGS]
        if bad:
            raise ValueError(f"Unknown composed configs {bad}; choose from {', '.join(COMPOSED_CONFIGS)}.")
        self.output_dir.mkdir(parents=True, exist_ok=True)
        info_path = self.output_dir / BUILD_INFO
        if info_path.is_file() and self.built_configs():
            old = json.loads(info_path.read_text(encoding="utf-8")).get("params", {})
            if old != json.loads(json.dumps(self._params())):
                raise BuildSettingsError(f"{self.output_dir} holds configs built with other settings: use another output directory, or the same settings to resume.")
        self.prepare()
        needed = {self.text_reps[c.split("_")[1]] for c in configs if c in O_CONFIGS}
        needed |= {n for n, _ in self.text_pool} if "diverse" in configs else set()
        check_text_resources(needed, self.text_kwargs["wordnet"], self.text_kwargs["models"], self.text_kwargs["device"])
        src = self.source
        pos = {n: i for i, n in enumerate(src.gallery)}
        queries = [{**q.to_dict(), "path": src.paths[q.reference]} for q in src.queries]
        gallery = [(pos[n], n, src.paths[n]) for n in src.gallery]
        opts = {"image_reps": self.image_reps, "text_reps": self.text_reps, "image_pool": self.image_pool,
                "text_pool": self.text_pool, "text_kwargs": self.text_kwargs}
        for config in configs:
            final = self.output_dir / config
            if is_built(final) and not overwrite:
                continue
            tmp, cache = self.output_dir / f".tmp-{config}", self.output_dir / ".cache" / config
            for d in (tmp, cache):
                shutil.rmtree(d, ignore_errors=True)
            fingerprint = f"hf_tta-{derive_seed(json.dumps(self._params(), sort_keys=True), config, len(queries)):08x}"
            ds = Dataset.from_generator(_rows, features=_features(config), cache_dir=str(cache), split=SPLIT, fingerprint=fingerprint,
                                        gen_kwargs={"data": {"queries": queries, "gallery": gallery}, "config": config, "seed": self.seed, "opts": opts})
            ds.save_to_disk(str(tmp))
            del ds
            shutil.rmtree(final, ignore_errors=True)
            os.replace(tmp, final)
            shutil.rmtree(cache, ignore_errors=True)
            self._write_info()
        shutil.rmtree(self.output_dir / ".cache", ignore_errors=True)
        self._write_info()
        return {c: load_from_disk(str(self.output_dir / c)) for c in configs}

    def _write_info(self) -> None:
        info = {"params": self._params(), "source_report": self.report.to_dict() if self.report else None,
                "configs": self.built_configs(), "versions": build_versions()}
        (self.output_dir / BUILD_INFO).write_text(json.dumps(info, indent=1, default=str), encoding="utf-8")


class _Report:
    def __init__(self, num_queries: int, num_gallery: int, missing: list[str]):
        self.num_queries, self.num_gallery, self.missing = num_queries, num_gallery, missing

    def summary(self) -> str:
        out = f"{self.num_queries} composed queries, {self.num_gallery} gallery images"
        return out + (f"; {len(self.missing)} missing/unreadable images left out (e.g. {self.missing[:3]})" if self.missing else "")

    def to_dict(self) -> dict:
        return {"num_queries": self.num_queries, "num_gallery": self.num_gallery, "missing": self.missing}


def composed_builder(kind: str, root, output_dir, *, category: str | None = None, images_root=None, **kwargs) -> ComposedBuilder:
    """:class:`ComposedBuilder` (``hf-tta build --fashioniq/--cirr``)."""
    return ComposedBuilder(kind, root, output_dir, category=category, images_root=images_root, **kwargs)


__all__ = ["COMPOSED_CONFIGS", "ComposedBuilder", "GALLERY", "IMAGE_REPRESENTATIVES", "O_CONFIGS", "TEXT_REPRESENTATIVES",
           "composed_builder", "composed_spec"]
