"""The real-world query-gallery shift sets of TCR (Tables 3-4) and REST (DQS), read from the user's raw files into the
COCO-C layout (config ``clean``; the corruption configs build too, but the papers run these sets clean). Each spec
carries the paper's baseline temperature (TCR App. B.2, ``set_temperature``; REST Supp. C-B).

=========================  =====================================================  ====================================
benchmark                  raw files                                              rows
=========================  =====================================================  ====================================
``nocaps-{in,near,out}``   ``nocaps_val_4500_captions.json`` + the validation      the images of one ``domain`` with
                           images (``images_root/<file_name>``)                    their 10 captions; tau 0.01
``fashion-gen``            ``fashiongen_256_256_validation.h5`` (the 32,528        every image; its product's
                           pairs TCR calls the test set): ``input_image``,         description on the product's first
                           ``input_description``, ``input_productID``,             image, ``group`` = product id (the
                           ``input_category``                                      images of a product share it); tau
                                                                                   0.001
``fashion-gen-d``          the same file                                           the same rows with the 48 categories
                                                                                   interleaved (REST's DQS stream)
``cuhk-pedes``             IRRA's ``reid_raw.json`` + ``imgs/``                    the ``split == "test"`` entries;
                                                                                   ``group`` = person ``id``; tau 1e-4,
                                                                                   text→image only
``icfg-pedes``             ``ICFG-PEDES.json`` + ``imgs/``                         as CUHK-PEDES
=========================  =====================================================  ====================================

Fashion-Gen's images live in the HDF5 array: the builder writes them once as lossless PNGs under
``output_dir/.fashiongen-images`` and reads them from there (a resumed build reuses them).
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

from .karpathy import KarpathyImage, SourceReport
from .pairs import RecordsBuilder
from .specs import BenchmarkSpec, register_spec

logger = logging.getLogger(__name__)

NOCAPS_DOMAINS = ("in-domain", "near-domain", "out-domain")
_NOCAPS_COUNTS = {"in-domain": 648, "near-domain": 2938, "out-domain": 914}
_NOCAPS_CITE = """@inproceedings{agrawal2019nocaps,
  title={nocaps: novel object captioning at scale},
  author={Agrawal, Harsh and Desai, Karan and Wang, Yufei and Chen, Xinlei and Jain, Rishabh and Johnson, Mark and Batra, Dhruv and Parikh, Devi and Lee, Stefan and Anderson, Peter},
  booktitle={ICCV}, year={2019}
}"""
_FASHIONGEN_CITE = """@article{rostamzadeh2018fashiongen,
  title={Fashion-Gen: The Generative Fashion Dataset and Challenge},
  author={Rostamzadeh, Negar and Hosseini, Seyedarian and Boquet, Thomas and Stokowiec, Wojciech and Zhang, Ying and Jauvin, Christian and Pal, Chris},
  journal={arXiv:1806.08317}, year={2018}
}"""
_CUHK_CITE = """@inproceedings{li2017person,
  title={Person Search with Natural Language Description},
  author={Li, Shuang and Xiao, Tong and Li, Hongsheng and Zhou, Bolei and Yue, Dayu and Wang, Xiaogang},
  booktitle={CVPR}, year={2017}
}"""
_ICFG_CITE = """@article{ding2021semantically,
  title={Semantically Self-Aligned Network for Text-to-Image Part-aware Person Re-identification},
  author={Ding, Zefeng and Ding, Changxing and Shao, Zhiyin and Tao, Dacheng},
  journal={arXiv:2107.12666}, year={2021}
}"""
_IRRA_CITE = """@inproceedings{jiang2023cross,
  title={Cross-Modal Implicit Relation Reasoning and Aligning for Text-to-Image Person Retrieval},
  author={Jiang, Ding and Ye, Mang},
  booktitle={CVPR}, year={2023}
}"""
_GROUP_IDS = ("Ids are stable: `image_id` is the row's position in the raw file's order, `caption_ids` count the captions, "
              "`source_id` is the raw file's id of the image; `group` makes the images of one {what} relevant to each "
              "other's captions.")


def _nocaps_spec(domain: str) -> BenchmarkSpec:
    short = domain.split("-")[0]
    return BenchmarkSpec(
        name=f"nocaps-{short}",
        pretty_name=f"Nocaps {domain} (real-world query-gallery shift, TCR Table 3)",
        source_name=f"nocaps validation, {domain} images",
        split_file="nocaps_val_4500_captions.json",
        expected_images=_NOCAPS_COUNTS[domain],
        expected_captions=10 * _NOCAPS_COUNTS[domain],
        image_license="Open Images validation images: each under the licence its Flickr author chose (Open Images lists "
        "them as CC BY 2.0); check https://storage.googleapis.com/openimages/web/factsfigures.html.",
        annotation_license="nocaps captions: CC BY 2.0, as stated on https://nocaps.org (check before publishing).",
        license_id="cc-by-2.0",
        source_url="https://nocaps.org",
        citations=(_NOCAPS_CITE,),
        baseline_tau=0.01,
        ids_note="Ids are stable: `image_id` and `caption_ids` are the nocaps `id`s, `source_id` the Open Images id; "
        "`domain` is the nocaps domain.",
        split_license="nocaps_val_4500_captions.json: the nocaps validation annotations (CC BY 2.0).",
        construction=(f"Rows: the images whose `domain` is `{domain}` in file order, each with its captions "
                      "(`annotations` with that `image_id`, in file order).",),
    )


NOCAPS = {d: register_spec(_nocaps_spec(d)) for d in NOCAPS_DOMAINS}

_FG_COMMON = dict(
    source_name="Fashion-Gen validation set (32,528 image-text pairs; TCR's and REST's test set)",
    split_file="fashiongen_256_256_validation.h5",
    expected_images=32528,
    expected_captions=0,
    image_license="Fashion-Gen (SSENSE images): non-commercial research use under the dataset's terms of use "
    "(https://fashion-gen.com); do not publish the data publicly without that permission.",
    annotation_license="Fashion-Gen descriptions: same terms as the images.",
    license_id="other",
    source_url="https://fashion-gen.com",
    citations=(_FASHIONGEN_CITE,),
    baseline_tau=0.001,
    ids_note=_GROUP_IDS.format(what="product") + " `domain` is the product category (`input_category`).",
    split_license="Fashion-Gen HDF5 release: same terms as the images.",
)
FASHION_GEN = register_spec(BenchmarkSpec(
    name="fashion-gen",
    pretty_name="Fashion-Gen (real-world query-gallery shift, TCR Table 3)",
    construction=("Rows: every image of the HDF5 file in its order; the images of one `input_productID` are one "
                  "group, and the product's description (`input_description`, decoded as Latin-1) is the caption of "
                  "its first image only, so several images share one caption as in TCR's code.",),
    **_FG_COMMON,
))
FASHION_GEN_D = register_spec(BenchmarkSpec(
    name="fashion-gen-d",
    pretty_name="Fashion-Gen-D (diverse query shift over 48 product categories, REST Table VI)",
    diverse_stream=True,
    construction=("Rows as `fashion-gen`, reordered so that the categories are interleaved (round robin over the "
                  "categories in order of first appearance): a stream of diverse user demands (REST's DQS; REST "
                  "runs it with gradient decoupling, which `hf-tta run` turns on for this set). `hf-tta run` feeds a "
                  "stream in a seeded random order, itself a mix of the categories; the `domain` column keys the `+key` "
                  "rows.",),
    **_FG_COMMON,
))
_PEDES_COMMON = dict(
    expected_captions=0,
    license_id="other",
    baseline_tau=1e-4,
    directions=("t2i",),
    ids_note=_GROUP_IDS.format(what="person (`id`)"),
)
CUHK_PEDES = register_spec(BenchmarkSpec(
    name="cuhk-pedes",
    pretty_name="CUHK-PEDES test (text→image person retrieval, TCR Table 4: ICFG2CUHK)",
    source_name="CUHK-PEDES, IRRA's test split of reid_raw.json (3,074 images / 6,156 texts / 1,000 identities)",
    split_file="reid_raw.json",
    expected_images=3074,
    image_license="CUHK-PEDES: for non-commercial research, obtained from its authors on request; the images come "
    "from CUHK03, Market-1501, SSM, VIPER and CUHK01 under their own terms. Do not publish it publicly.",
    annotation_license="CUHK-PEDES descriptions: same terms as the images.",
    source_url="https://github.com/ShuangLI59/Person-Search-with-Natural-Language-Description",
    citations=(_CUHK_CITE, _IRRA_CITE),
    split_license="reid_raw.json: CUHK-PEDES's annotation file, split as IRRA uses it.",
    construction=("Rows: the `split == \"test\"` entries in file order; image `imgs/<file_path>`, captions "
                  "`captions`, group = `id`.",),
    **_PEDES_COMMON,
))
ICFG_PEDES = register_spec(BenchmarkSpec(
    name="icfg-pedes",
    pretty_name="ICFG-PEDES test (text→image person retrieval, TCR Table 4: CUHK2ICFG)",
    source_name="ICFG-PEDES test split (19,848 image-text pairs / 1,000 identities)",
    split_file="ICFG-PEDES.json",
    expected_images=19848,
    image_license="ICFG-PEDES: images from MSMT17, for non-commercial research under MSMT17's terms, obtained from "
    "the authors. Do not publish it publicly.",
    annotation_license="ICFG-PEDES descriptions: same terms as the images.",
    source_url="https://github.com/zifyloo/SSAN",
    citations=(_ICFG_CITE, _IRRA_CITE),
    split_license="ICFG-PEDES.json: the dataset's annotation file.",
    construction=("Rows: the `split == \"test\"` entries in file order; image `imgs/<file_path>`, captions "
                  "`captions`, group = `id`.",),
    **_PEDES_COMMON,
))


# ------------------------------------------------------------------------------------------------ readers
def _load_json(path: Path, what: str):
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: no such file; pass the {what}.") from None
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}: not JSON ({err.msg}); pass the {what}.") from None


def read_nocaps(path: str | os.PathLike, domain: str) -> list[KarpathyImage]:
    """The images of one nocaps ``domain`` with their captions (``nocaps_val_4500_captions.json`` layout:
    ``images[{id, file_name, open_images_id, domain}]``, ``annotations[{image_id, id, caption}]``)."""
    path = Path(path)
    domain = {"in": "in-domain", "near": "near-domain", "out": "out-domain"}.get(domain, domain)
    if domain not in NOCAPS_DOMAINS:
        raise ValueError(f"Unknown nocaps domain {domain!r}; choose from {', '.join(NOCAPS_DOMAINS)} (or in, near, out).")
    data = _load_json(path, "nocaps validation captions (nocaps_val_4500_captions.json)")
    if not isinstance(data, dict) or not isinstance(data.get("images"), list):
        raise ValueError(f"{path}: no 'images' list; pass nocaps_val_4500_captions.json.")
    if not data.get("annotations"):
        raise ValueError(f"{path} has no 'annotations' (the nocaps test split's captions are not public); pass "
                         "nocaps_val_4500_captions.json, the validation captions.")
    caps: dict[int, list[tuple[int, str]]] = {}
    for a in data["annotations"]:
        caps.setdefault(int(a["image_id"]), []).append((int(a["id"]), str(a["caption"]).strip()))
    out = []
    for im in data["images"]:
        if "domain" not in im:
            raise ValueError(f"{path}: image {im.get('id')} has no 'domain'; pass nocaps_val_4500_captions.json (its images carry one).")
        if im["domain"] != domain:
            continue
        iid = int(im["id"])
        if iid not in caps:
            raise ValueError(f"{path}: image {iid} ({im.get('file_name')}) has no caption; the file is incomplete.")
        out.append(KarpathyImage(iid, str(im.get("open_images_id", Path(im["file_name"]).stem)), im["file_name"], "", "test",
                                 [c for _, c in caps[iid]], [i for i, _ in caps[iid]], domain=domain))
    if not out:
        found = sorted({str(im.get("domain")) for im in data["images"]})
        raise ValueError(f"{path} has no {domain} image (its domains: {found}); pass nocaps_val_4500_captions.json.")
    return out


FASHION_GEN_FIELDS = ("input_image", "input_description", "input_productID", "input_category")


def _text(value) -> str:
    value = value[0] if hasattr(value, "__len__") and not isinstance(value, (bytes, str)) else value
    return value.decode("latin-1") if isinstance(value, bytes) else str(value)


def read_fashion_gen(path: str | os.PathLike, image_dir: str | os.PathLike, interleave: bool = False) -> list[KarpathyImage]:
    """Every image of a Fashion-Gen HDF5 file, written once to ``image_dir/<index>.png``; grouped by product id
    with the description on each product's first image. ``interleave``: round robin over the categories
    (Fashion-Gen-D)."""
    try:
        import h5py
    except ImportError:
        raise ImportError("Reading Fashion-Gen's HDF5 file needs h5py: pip install 'hf_tta[data]'.") from None
    import numpy as np
    from PIL import Image

    path, image_dir = Path(path), Path(image_dir)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file; pass fashiongen_256_256_validation.h5.")
    with h5py.File(path, "r") as f:
        missing = [k for k in FASHION_GEN_FIELDS if k not in f]
        if missing:
            raise ValueError(f"{path} lacks the fields {missing} (has {sorted(f.keys())[:8]}); pass a Fashion-Gen HDF5 file "
                             "such as fashiongen_256_256_validation.h5.")
        n = len(f["input_image"])
        pids = [str(int(np.asarray(v).reshape(-1)[0])) for v in f["input_productID"][:]]
        cats = [_text(v).strip() for v in f["input_category"][:]]
        descs = [_text(v).strip() for v in f["input_description"][:]]
        image_dir.mkdir(parents=True, exist_ok=True)
        for i in range(n):
            target = image_dir / f"{i:06d}.png"
            if not target.is_file():
                tmp = target.with_suffix(".tmp.png")
                Image.fromarray(np.asarray(f["input_image"][i], dtype=np.uint8)).save(tmp, "PNG")
                os.replace(tmp, target)
    seen: set[str] = set()
    out = []
    for i in range(n):
        first = pids[i] not in seen
        seen.add(pids[i])
        out.append(KarpathyImage(i, pids[i], f"{i:06d}.png", "", "test", [descs[i]] if first else [], [i] if first else [],
                                 group=pids[i], domain=cats[i]))
    if interleave:
        out = interleave_domains(out)
    return out


def interleave_domains(items: list[KarpathyImage]) -> list[KarpathyImage]:
    """Round robin over the items' domains (in order of first appearance), keeping each domain's order: the diverse
    stream of REST's Fashion-Gen (48 categories)."""
    queues: dict[Any, list[KarpathyImage]] = {}
    for it in items:
        queues.setdefault(it.domain, []).append(it)
    out, k = [], 0
    while len(out) < len(items):
        out += [q[k] for q in queues.values() if k < len(q)]
        k += 1
    return out


def read_pedes(path: str | os.PathLike, split: str = "test") -> list[KarpathyImage]:
    """The ``split`` entries of IRRA's ``reid_raw.json`` (CUHK-PEDES) or ``ICFG-PEDES.json``: ``[{split, captions,
    file_path, id}]``; group = person id."""
    path = Path(path)
    data = _load_json(path, "reid_raw.json (CUHK-PEDES) or ICFG-PEDES.json")
    if not isinstance(data, list) or not all(isinstance(e, dict) and {"split", "captions", "file_path", "id"} <= set(e) for e in data):
        raise ValueError(f"{path}: expected a list of {{split, captions, file_path, id}} entries (reid_raw.json / ICFG-PEDES.json).")
    out, n_caps = [], 0
    for e in data:
        if e["split"] != split:
            continue
        caps = [str(c).strip() for c in e["captions"] if str(c).strip()]
        if not caps:
            raise ValueError(f"{path}: {e['file_path']} has no caption; the annotation file is incomplete.")
        out.append(KarpathyImage(len(out), str(e["file_path"]), str(e["file_path"]), "", split, caps,
                                 list(range(n_caps, n_caps + len(caps))), group=str(e["id"])))
        n_caps += len(caps)
    if not out:
        found = sorted({str(e["split"]) for e in data})
        raise ValueError(f"{path} has no {split!r} entry (its splits: {found}); pass the annotation file holding the test split.")
    return out


# ------------------------------------------------------------------------------------------------ builders
REALWORLD = ("nocaps-in", "nocaps-near", "nocaps-out", "fashion-gen", "fashion-gen-d", "cuhk-pedes", "icfg-pedes")


def realworld_builder(benchmark: str, raw: str | os.PathLike, output_dir: str | os.PathLike, *,
                      images_root: str | os.PathLike | None = None, **kwargs) -> RecordsBuilder:
    """A builder of one real-world set from its raw file (see the module table). ``images_root``: the folder of the
    nocaps validation images / of the ReID ``imgs`` (default: the raw file's folder, plus ``imgs/`` for ReID).
    ``kwargs`` go to :class:`~.benchmark.BenchmarkBuilder`."""
    raw, output_dir = Path(raw), Path(output_dir)
    if benchmark.startswith("nocaps-"):
        domain = benchmark.split("-")[1] + "-domain"
        if domain not in NOCAPS_DOMAINS:
            raise ValueError(f"Unknown benchmark {benchmark!r}; choose from {', '.join(REALWORLD)}.")
        spec, root = NOCAPS[domain], images_root or raw.parent

        def read(report: SourceReport):
            return read_nocaps(raw, domain)
    elif benchmark in ("fashion-gen", "fashion-gen-d"):
        spec, root = (FASHION_GEN if benchmark == "fashion-gen" else FASHION_GEN_D), output_dir / ".fashiongen-images"

        def read(report: SourceReport):
            return read_fashion_gen(raw, root, interleave=benchmark == "fashion-gen-d")
    elif benchmark in ("cuhk-pedes", "icfg-pedes"):
        spec = CUHK_PEDES if benchmark == "cuhk-pedes" else ICFG_PEDES
        root = Path(images_root) if images_root is not None else (raw.parent / "imgs" if (raw.parent / "imgs").is_dir() else raw.parent)

        def read(report: SourceReport):
            return read_pedes(raw)
    else:
        raise ValueError(f"Unknown benchmark {benchmark!r}; choose from {', '.join(REALWORLD)}.")
    return RecordsBuilder(spec, read, raw, root, output_dir, source_params={"raw": raw.name}, **kwargs)


__all__ = [
    "CUHK_PEDES",
    "FASHION_GEN",
    "FASHION_GEN_D",
    "ICFG_PEDES",
    "NOCAPS",
    "NOCAPS_DOMAINS",
    "REALWORLD",
    "interleave_domains",
    "read_fashion_gen",
    "read_nocaps",
    "read_pedes",
    "realworld_builder",
]
