"""Video query corruptions: the 12 ImageNet-C noise / blur / digital corruptions of REST Table A.1 (video has no
weather category), applied frame by frame with :func:`~hf_tta.data.corruptions.image.corrupt_image`.

Frame ``t`` of a call with ``seed`` uses ``derive_seed(seed, t)`` (as :func:`corrupt_images` does), so random
corruptions (noise, glass blur, motion-blur angle) differ from frame to frame but are reproducible. READ (the same
group's earlier pipeline) corrupts 224x224 frames; the severities' constants assume images of about that size.
"""

from __future__ import annotations

import numpy as np

from .base import check_severity
from .image import IMAGE_CORRUPTION_CATEGORIES, IMAGE_SEVERITIES, MAX_IMAGE_SEVERITY, corrupt_images

#: REST Table A.1, video: Noise (Gaussian, shot, impulse, speckle), Blur (defocus, glass, motion, zoom),
#: Digital (contrast, elastic, JPEG, pixelate).
VIDEO_CORRUPTION_CATEGORIES: dict[str, str] = {
    n: c for n, c in IMAGE_CORRUPTION_CATEGORIES.items() if c in ("noise", "blur", "digital")
}
VIDEO_CORRUPTIONS: tuple[str, ...] = tuple(VIDEO_CORRUPTION_CATEGORIES)
VIDEO_SEVERITIES = IMAGE_SEVERITIES
MAX_VIDEO_SEVERITY = MAX_IMAGE_SEVERITY
#: One subtype per category for AudioSet-O's N/B/D columns. REST names Gaussian noise; its bold marks for Blur and
#: Digital were lost, so we take the first subtype Table A.1 lists (defocus blur, contrast). Override per build.
VIDEO_REPRESENTATIVES: dict[str, str] = {"noise": "gaussian_noise", "blur": "defocus_blur", "digital": "contrast"}


def corrupt_video(frames: np.ndarray, name: str, severity: int, seed: int | None = None) -> np.ndarray:
    """Corrupt every frame of a ``(T, H, W, 3)`` uint8 video (``T, H, W >= 1``); returns the same shape and dtype.

    Raises:
        ValueError: for an unknown name, a severity outside 1..5, or a video of another shape, dtype or no frame.
    """
    if name not in VIDEO_CORRUPTIONS:
        raise ValueError(f"Unknown video corruption {name!r}; choose from {list(VIDEO_CORRUPTIONS)}.")
    severity = check_severity(name, severity, VIDEO_SEVERITIES)
    frames = np.asarray(frames)
    if frames.dtype != np.uint8 or frames.ndim != 4 or frames.shape[-1] != 3:
        raise ValueError(f"A video must be a (T, H, W, 3) uint8 array; got {frames.dtype} {frames.shape}.")
    if frames.shape[0] == 0:
        raise ValueError("The video has no frames (T = 0); it needs at least one.")
    return np.stack(corrupt_images(list(frames), name, severity, seed=seed))


__all__ = [
    "MAX_VIDEO_SEVERITY",
    "VIDEO_CORRUPTIONS",
    "VIDEO_CORRUPTION_CATEGORIES",
    "VIDEO_REPRESENTATIVES",
    "VIDEO_SEVERITIES",
    "corrupt_video",
]
