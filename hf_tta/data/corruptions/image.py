"""The 16 ImageNet-C image corruptions x 5 severities used by COCO-C / Flickr-C (TCR §4.1, REST Table A.1).

The corruption functions and their constants come from the maintained ``imagecorruptions-imaug`` package
(import name ``imagecorruptions``; the ``data`` extra installs it). They work on images of any size: COCO and
Flickr30K images are not 224x224. This module adds:

- determinism: ``seed=`` seeds every random draw (NumPy's global RNG, which the package uses, is saved and
  restored; glass blur's numba RNG and impulse noise's scikit-image RNG get the seed explicitly);
- one call for a PIL image or an ``HxWx3`` uint8 array, returning the same type, size and mode;
- a fix for ``pixelate`` on very small images (the package resizes to 0 pixels below 4 px).

Example:
    >>> from PIL import Image
    >>> img = Image.new("RGB", (56, 40), (120, 90, 60))
    >>> out = corrupt_image(img, "gaussian_noise", 5, seed=0)
    >>> out.size, out.mode
    ((56, 40), 'RGB')
    >>> out.tobytes() == corrupt_image(img, "gaussian_noise", 5, seed=0).tobytes()
    True
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from .base import check_severity, derive_seed, seeded

IMAGE_CORRUPTIONS: tuple[str, ...] = (
    "gaussian_noise",
    "shot_noise",
    "impulse_noise",
    "speckle_noise",
    "defocus_blur",
    "glass_blur",
    "motion_blur",
    "zoom_blur",
    "snow",
    "frost",
    "fog",
    "brightness",
    "contrast",
    "elastic_transform",
    "pixelate",
    "jpeg_compression",
)
#: ImageNet-C's four *validation* corruptions (Hendrycks & Dietterich 2019, §3: "held-out corruptions" set aside
#: for choosing hyper-parameters): speckle noise (also one of COCO-C's 16), Gaussian blur, spatter and saturate.
VALIDATION_IMAGE_CORRUPTIONS: tuple[str, ...] = ("speckle_noise", "gaussian_blur", "spatter", "saturate")
#: ImageNet-C's 15 test corruptions: COCO-C's 16 without the validation corruption speckle noise.
TEST_IMAGE_CORRUPTIONS: tuple[str, ...] = tuple(n for n in IMAGE_CORRUPTIONS if n not in VALIDATION_IMAGE_CORRUPTIONS)
#: Every image corruption :func:`corrupt_image` applies: COCO-C's 16 and the three other validation corruptions.
ALL_IMAGE_CORRUPTIONS: tuple[str, ...] = IMAGE_CORRUPTIONS + tuple(
    n for n in VALIDATION_IMAGE_CORRUPTIONS if n not in IMAGE_CORRUPTIONS
)
IMAGE_SEVERITIES: tuple[int, ...] = (1, 2, 3, 4, 5)
MAX_IMAGE_SEVERITY = 5

#: Category of each corruption (ImageNet-C / REST Table A.1 grouping).
IMAGE_CORRUPTION_CATEGORIES: dict[str, str] = {
    **{n: "noise" for n in ("gaussian_noise", "shot_noise", "impulse_noise", "speckle_noise")},
    **{n: "blur" for n in ("defocus_blur", "glass_blur", "motion_blur", "zoom_blur")},
    **{n: "weather" for n in ("snow", "frost", "fog", "brightness")},
    **{n: "digital" for n in ("contrast", "elastic_transform", "pixelate", "jpeg_compression")},
}
#: Every corruption's family, the three other validation corruptions included (ImageNet-C's "extra" corruptions).
ALL_IMAGE_CORRUPTION_CATEGORIES: dict[str, str] = {
    **IMAGE_CORRUPTION_CATEGORIES, "gaussian_blur": "blur", "spatter": "weather", "saturate": "digital",
}

#: The constants of each corruption for severities 1..5 (ImageNet-C, Hendrycks & Dietterich 2019, as in
#: ``imagecorruptions``), on the [0, 1] pixel scale where it applies. Recorded for dataset cards; the tests check
#: that the package reproduces them.
IMAGE_CORRUPTION_CONSTANTS: dict[str, dict[str, Any]] = {
    "gaussian_noise": {"param": "std of additive N(0, c^2)", "values": [0.08, 0.12, 0.18, 0.26, 0.38]},
    "shot_noise": {"param": "Poisson rate c: Poisson(x*c)/c", "values": [60, 25, 12, 5, 3]},
    "impulse_noise": {"param": "salt-and-pepper amount", "values": [0.03, 0.06, 0.09, 0.17, 0.27]},
    "speckle_noise": {"param": "std of multiplicative x + x*N(0, c^2)", "values": [0.15, 0.2, 0.35, 0.45, 0.6]},
    "defocus_blur": {"param": "(disk radius, alias blur)", "values": [(3, 0.1), (4, 0.5), (6, 0.5), (8, 0.5), (10, 0.5)]},
    "glass_blur": {"param": "(sigma, max delta, iterations)", "values": [(0.7, 1, 2), (0.9, 2, 1), (1, 2, 3), (1.1, 3, 2), (1.5, 4, 2)]},
    "motion_blur": {"param": "(radius, sigma), angle ~ U(-45, 45)", "values": [(10, 3), (15, 5), (15, 8), (15, 12), (20, 15)]},
    "zoom_blur": {"param": "max zoom factor (step)", "values": [(1.10, 0.01), (1.15, 0.01), (1.20, 0.02), (1.25, 0.02), (1.30, 0.03)]},
    "snow": {
        "param": "(loc, scale, zoom, threshold, blur radius, blur sigma, blend)",
        "values": [
            (0.1, 0.3, 3, 0.5, 10, 4, 0.8),
            (0.2, 0.3, 2, 0.5, 12, 4, 0.7),
            (0.55, 0.3, 4, 0.9, 12, 8, 0.7),
            (0.55, 0.3, 4.5, 0.85, 12, 8, 0.65),
            (0.55, 0.3, 2.5, 0.85, 12, 12, 0.55),
        ],
    },
    "frost": {"param": "(image weight, frost weight)", "values": [(1, 0.4), (0.8, 0.6), (0.7, 0.7), (0.65, 0.7), (0.6, 0.75)]},
    "fog": {"param": "(fog strength, plasma wibble decay)", "values": [(1.5, 2), (2.0, 2), (2.5, 1.7), (2.5, 1.5), (3.0, 1.4)]},
    "brightness": {"param": "added to HSV value", "values": [0.1, 0.2, 0.3, 0.4, 0.5]},
    "contrast": {"param": "factor c: (x - mean) * c + mean", "values": [0.4, 0.3, 0.2, 0.1, 0.05]},
    "elastic_transform": {"param": "alpha (sigma = 1% of the image size)", "values": [12.5, 16.25, 21.25, 25.0, 30.0]},
    "pixelate": {"param": "downscale factor (BOX down, NEAREST up)", "values": [0.6, 0.5, 0.4, 0.3, 0.25]},
    "jpeg_compression": {"param": "JPEG quality", "values": [25, 18, 15, 10, 7]},
    "gaussian_blur": {"param": "sigma of the Gaussian kernel (pixels)", "values": [1, 2, 3, 4, 6]},
    "spatter": {
        "param": "(loc, scale, sigma, threshold, intensity, mud): water (mud 0) or mud (mud 1) splashes",
        "values": [
            (0.65, 0.3, 4, 0.69, 0.6, 0),
            (0.65, 0.3, 3, 0.68, 0.6, 0),
            (0.65, 0.3, 2, 0.68, 0.5, 0),
            (0.65, 0.3, 1, 0.65, 1.5, 1),
            (0.67, 0.4, 1, 0.65, 1.5, 1),
        ],
    },
    "saturate": {"param": "(factor, offset) on HSV saturation: s * c0 + c1", "values": [(0.3, 0), (0.1, 0), (2, 0), (5, 0.1), (20, 0.2)]},
}


def _backend():
    """The ``imagecorruptions`` functions, with a clear error when the right package is missing."""
    try:
        from imagecorruptions import corruption_dict
    except Exception as err:  # ImportError, or the old 1.1.2 failing on pkg_resources / numpy 2
        try:
            from importlib.metadata import PackageNotFoundError, version

            try:
                version("imagecorruptions-imaug")
                hint = ""
            except PackageNotFoundError:
                try:
                    old = version("imagecorruptions")
                    hint = (
                        f" The unmaintained `imagecorruptions` {old} is installed: it fails on NumPy 2 and new "
                        "scikit-image. Run `pip uninstall imagecorruptions && pip install imagecorruptions-imaug` "
                        "(same import name)."
                    )
                except PackageNotFoundError:
                    hint = ""
        except Exception:  # pragma: no cover
            hint = ""
        raise ImportError(
            "Image corruptions need the `imagecorruptions-imaug` package: `pip install 'hf_tta[data]'` or "
            f"`pip install imagecorruptions-imaug`.{hint} ({type(err).__name__}: {err})"
        ) from err
    return corruption_dict


def _pixelate(image, severity: int):
    """``imagecorruptions.pixelate`` with a 1-pixel floor (it produced a 0-pixel image below 4 px)."""
    from PIL import Image

    c = IMAGE_CORRUPTION_CONSTANTS["pixelate"]["values"][severity - 1]
    w, h = image.size
    small = image.resize((max(1, int(w * c)), max(1, int(h * c))), Image.BOX)
    return small.resize((w, h), Image.NEAREST)


def _corrupt_array(arr: np.ndarray, name: str, severity: int, seed: int | None) -> np.ndarray:
    from PIL import Image

    if arr.shape[0] == 0 or arr.shape[1] == 0:
        raise ValueError(f"The image is empty ({arr.shape[0]}x{arr.shape[1]} pixels); it needs at least 1x1.")
    funcs = _backend()
    pil = Image.fromarray(arr)
    kwargs = {}
    if name in ("glass_blur", "impulse_noise") and seed is not None:
        # These two take their own RNG seed (numba's RNG / scikit-image's Generator), not NumPy's global one.
        kwargs["seed"] = derive_seed(seed, name)
    with seeded(seed):
        if name == "pixelate":
            out = _pixelate(pil, severity)
        else:
            out = funcs[name](pil, severity, **kwargs)
    out = np.asarray(out)
    if out.dtype != np.uint8:
        out = np.uint8(out)  # truncates, exactly as `imagecorruptions.corrupt` and ImageNet-C do
    if out.ndim == 2:
        out = np.stack([out] * 3, axis=-1)
    if out.shape != arr.shape:  # never seen; kept as a guard so that no size change goes unnoticed
        raise RuntimeError(f"{name} changed the image shape from {arr.shape} to {out.shape}.")
    return out


def corrupt_image(image, name: str, severity: int, seed: int | None = None):
    """Apply one ImageNet-C corruption at one severity.

    Args:
        image: a PIL image (any mode; processed as RGB, returned in its original mode when that is ``"RGB"`` or
            ``"L"``, as RGB otherwise) or an ``HxWx3`` (or ``HxW``) ``uint8`` NumPy array (same shape back).
        name: one of :data:`ALL_IMAGE_CORRUPTIONS` (COCO-C's 16 and ImageNet-C's validation corruptions).
        severity: 1..5.
        seed: makes the result deterministic; ``None`` draws from the global NumPy RNG.

    Returns:
        The corrupted image, of the same type and size as the input.
    """
    if name not in ALL_IMAGE_CORRUPTIONS:
        raise ValueError(f"Unknown image corruption {name!r}; choose from {list(ALL_IMAGE_CORRUPTIONS)}.")
    severity = check_severity(name, severity, IMAGE_SEVERITIES)
    if isinstance(image, np.ndarray):
        if image.dtype != np.uint8:
            raise TypeError(f"A NumPy image must be uint8 (0..255); got {image.dtype}.")
        if image.ndim == 2:
            return _corrupt_array(np.stack([image] * 3, axis=-1), name, severity, seed)[..., 0].copy()
        if image.ndim != 3 or image.shape[2] != 3:
            raise ValueError(f"A NumPy image must be HxWx3 (or HxW); got shape {image.shape}.")
        return _corrupt_array(np.ascontiguousarray(image), name, severity, seed)
    try:
        from PIL import Image
    except ImportError as err:  # pragma: no cover
        raise ImportError("corrupt_image needs Pillow.") from err
    if not isinstance(image, Image.Image):
        raise TypeError(f"image must be a PIL image or a uint8 NumPy array; got {type(image).__name__}.")
    mode = image.mode
    out = Image.fromarray(_corrupt_array(np.asarray(image.convert("RGB")), name, severity, seed), "RGB")
    return out.convert("L") if mode == "L" else out


def corrupt_images(images: Sequence, name: str, severity: int, seed: int | None = None) -> list:
    """:func:`corrupt_image` on a batch; image ``i`` uses the seed ``derive_seed(seed, i)``."""
    return [
        corrupt_image(img, name, severity, None if seed is None else derive_seed(seed, i)) for i, img in enumerate(images)
    ]


__all__ = [
    "ALL_IMAGE_CORRUPTION_CATEGORIES",
    "ALL_IMAGE_CORRUPTIONS",
    "IMAGE_CORRUPTIONS",
    "TEST_IMAGE_CORRUPTIONS",
    "VALIDATION_IMAGE_CORRUPTIONS",
    "IMAGE_CORRUPTION_CATEGORIES",
    "IMAGE_CORRUPTION_CONSTANTS",
    "IMAGE_SEVERITIES",
    "MAX_IMAGE_SEVERITY",
    "corrupt_image",
    "corrupt_images",
]
