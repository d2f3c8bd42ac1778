"""Helpers shared by the builder modules: the split and file names every benchmark uses, which configs of an output
folder are complete, how images are encoded for an ``Image()`` column, and the package versions recorded with a
build."""

from __future__ import annotations

import io
from pathlib import Path

#: The one split of every benchmark.
SPLIT = "test"
#: The config holding the clean data (the galleries).
CLEAN = "clean"
#: The build record of a COCO-C / Flickr-C output folder.
BUILD_INFO = "build_info.json"


def is_built(folder: str | Path) -> bool:
    """Whether ``folder`` holds a complete ``save_to_disk`` config (written last, so present only when complete)."""
    return (Path(folder) / "dataset_info.json").is_file()


def built_configs(output_dir: str | Path) -> list[str]:
    """The complete configs in ``output_dir`` (sorted; hidden temporary folders left out)."""
    output_dir = Path(output_dir)
    if not output_dir.is_dir():
        return []
    return sorted(p.name for p in output_dir.iterdir() if p.is_dir() and not p.name.startswith(".") and is_built(p))


def encode_image(image, fmt: str = "PNG", quality: int = 95) -> bytes:
    """A PIL image as ``PNG`` (lossless) or ``JPEG`` (at ``quality``) bytes, for an ``Image()`` column."""
    buf = io.BytesIO()
    if fmt == "JPEG":
        image.save(buf, "JPEG", quality=quality)
    else:
        image.save(buf, "PNG")
    return buf.getvalue()


def build_versions() -> dict[str, str]:
    """Versions of the packages that determine a build's content (recorded in ``build_info.json`` and the card)."""
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for pkg in ("hf_tta", "imagecorruptions-imaug", "nlpaug", "nltk", "datasets", "transformers"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            pass
    return out


__all__ = ["BUILD_INFO", "CLEAN", "SPLIT", "build_versions", "built_configs", "encode_image", "is_built"]
