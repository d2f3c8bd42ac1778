"""The raw FashionIQ and CIRR validation files as composed queries (reference image + modification text -> target
image) and a gallery, for :mod:`.composed`.

FashionIQ (``root/captions/cap.<category>.val.json``, ``root/image_splits/split.<category>.val.json``,
``root/images/<asin>.png|.jpg``): entries ``{"candidate", "target", "captions": [two texts]}``; the gallery is the
category's split file. The two captions are joined as the CIR evaluation code does for validation (CLIP4Cir / SPRC):
``"<first, stripped of '.?, ' and capitalised> and <second, stripped>"``.

CIRR (``root/captions/cap.rc2.val.json``, ``root/image_splits/split.rc2.val.json`` mapping names to
``./dev/<name>.png``): entries ``{"pairid", "reference", "target_hard", "caption", "img_set": {"members"}}``; the
gallery is every image of the split file.

Every mistake in the raw files is one ``ValueError`` / ``FileNotFoundError`` naming the file and the fix.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

FIQ_CATEGORIES = ("dress", "shirt", "toptee")
_IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg")


@dataclass
class ComposedQuery:
    """One composed query: ``reference`` + ``text`` should retrieve ``target`` (image names)."""

    query_id: int
    pair_id: str
    category: str
    reference: str
    text: str
    target: str
    members: list[str] = field(default_factory=list)  # CIRR img_set (6 names); [] for FashionIQ

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class ComposedSource:
    """The queries and the gallery (image names in order, with their files) of one composed set."""

    name: str
    queries: list[ComposedQuery]
    gallery: list[str]
    paths: dict[str, str]


def _json(path: Path, fix: str):
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file; {fix}")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}: not JSON ({err.msg}); {fix}") from None


def _other_splits(folder: Path, pattern: str) -> list[str]:
    return sorted(p.name for p in folder.glob(pattern)) if folder.is_dir() else []


def fiq_text(captions: list[str]) -> str:
    """FashionIQ's two relative captions as one modification text (CLIP4Cir / SPRC validation)."""
    caps = [str(c).strip(".?, ") for c in captions]
    if len(caps) == 1:
        return caps[0].capitalize()
    return f"{caps[0].capitalize()} and {caps[1]}"


def _image_path(folder: Path, name: str) -> str | None:
    for suffix in ("", *_IMAGE_SUFFIXES):
        p = folder / f"{name}{suffix}"
        if p.is_file():
            return str(p)
    return None


def read_fashioniq(root: str | os.PathLike, category: str, images_root: str | os.PathLike | None = None,
                   split: str = "val") -> ComposedSource:
    """FashionIQ's ``split`` of one category (see the module docstring). Image files are resolved later
    (:func:`check_files`); ``paths`` maps each name to its file or ``None``."""
    root = Path(root)
    if category not in FIQ_CATEGORIES:
        raise ValueError(f"Unknown FashionIQ category {category!r}; choose from {', '.join(FIQ_CATEGORIES)}.")
    cap_file = root / "captions" / f"cap.{category}.{split}.json"
    others = _other_splits(root / "captions", f"cap.{category}.*.json")
    entries = _json(cap_file, f"pass the FashionIQ folder holding captions/cap.{category}.{split}.json"
                    + (f" (found {', '.join(others)}: the test split's targets are not public)." if others else "."))
    names = _json(root / "image_splits" / f"split.{category}.{split}.json",
                  f"pass the FashionIQ folder holding image_splits/split.{category}.{split}.json.")
    if not isinstance(entries, list) or not entries or not all(isinstance(e, dict) for e in entries):
        raise ValueError(f"{cap_file}: expected a list of {{candidate, target, captions}} entries.")
    if not isinstance(names, list):
        raise ValueError(f"{root / 'image_splits' / f'split.{category}.{split}.json'}: expected a list of image names.")
    gallery = [str(n) for n in names]
    known = set(gallery)
    queries = []
    for i, e in enumerate(entries):
        if "target" not in e or "candidate" not in e or "captions" not in e:
            raise ValueError(f"{cap_file}: entry {i} lacks target/candidate/captions (a caption file of the test split has no "
                             f"targets); pass cap.{category}.{split}.json.")
        if e["target"] not in known:
            raise ValueError(f"{cap_file}: target {e['target']!r} of entry {i} is not in split.{category}.{split}.json; "
                             "the caption and split files are of different splits or categories.")
        queries.append(ComposedQuery(i, f"{category}-{i}", category, str(e["candidate"]), fiq_text(e["captions"]), str(e["target"])))
    folder = Path(images_root) if images_root is not None else root / "images"
    paths = {n: _image_path(folder, n) for n in dict.fromkeys([*gallery, *(q.reference for q in queries)])}
    return ComposedSource(f"fiq-{category}", queries, gallery, paths)


def read_cirr(root: str | os.PathLike, images_root: str | os.PathLike | None = None, split: str = "val") -> ComposedSource:
    """CIRR's ``split`` (``rc2``; see the module docstring)."""
    root = Path(root)
    cap_file = root / "captions" / f"cap.rc2.{split}.json"
    others = _other_splits(root / "captions", "cap.rc2.*.json")
    entries = _json(cap_file, f"pass the CIRR folder holding captions/cap.rc2.{split}.json"
                    + (f" (found {', '.join(others)}: test1's targets are hidden)." if others else "."))
    split_file = root / "image_splits" / f"split.rc2.{split}.json"
    rel = _json(split_file, f"pass the CIRR folder holding image_splits/split.rc2.{split}.json.")
    if not isinstance(rel, dict):
        raise ValueError(f"{split_file}: expected a mapping image name -> relative path.")
    if not isinstance(entries, list) or not entries:
        raise ValueError(f"{cap_file}: expected a list of CIRR entries.")
    queries = []
    for i, e in enumerate(entries):
        if "target_hard" not in e:
            raise ValueError(f"{cap_file}: entry {i} has no 'target_hard' (test1's targets are hidden); pass cap.rc2.{split}.json.")
        members = [str(m) for m in (e.get("img_set") or {}).get("members", [])]
        for name in (e["reference"], e["target_hard"], *members):
            if name not in rel:
                raise ValueError(f"{cap_file}: image {name!r} of entry {i} is not in {split_file.name}; the caption and split "
                                 "files are of different splits.")
        queries.append(ComposedQuery(i, str(e.get("pairid", i)), "cirr", str(e["reference"]), str(e["caption"]).strip(),
                                     str(e["target_hard"]), members))
    base = Path(images_root) if images_root is not None else root
    paths = {n: (str(base / p) if (base / p).is_file() else None) for n, p in rel.items()}
    return ComposedSource("cirr", queries, list(rel), paths)


def check_files(source: ComposedSource, on_missing: str = "error") -> list[str]:
    """The image names without a readable file. ``"error"``: a ``FileNotFoundError`` naming them and the fix;
    ``"skip"``: the queries that need them and gallery items are left out (returned, to be counted)."""
    from .karpathy import is_readable

    needed = dict.fromkeys([*source.gallery, *(q.reference for q in source.queries)])
    bad = [n for n in needed if source.paths.get(n) is None or not is_readable(Path(source.paths[n]))]
    if bad and on_missing == "error":
        raise FileNotFoundError(f"{len(bad)} images of {source.name} are missing or unreadable (e.g. {bad[:3]}); put them "
                                "under the images folder (--images-root), or pass on_missing='skip' (--on-missing skip) to "
                                "leave them and their queries out (counted in build_info.json and the card).")
    if bad:
        gone = set(bad)
        source.gallery = [n for n in source.gallery if n not in gone]
        source.queries = [q for q in source.queries if q.reference not in gone and q.target not in gone]
    return bad


__all__ = ["FIQ_CATEGORIES", "ComposedQuery", "ComposedSource", "check_files", "fiq_text", "read_cirr", "read_fashioniq"]
