"""Query-shift benchmarks: the corruption library (:mod:`hf_tta.data.corruptions`) and the COCO-C / Flickr-C and
AudioSet-O / AudioSet-D / VGGSound builders and loaders (:mod:`hf_tta.data.builders`)."""

from .corruptions import IMAGE_CORRUPTIONS, TEXT_CORRUPTIONS, corrupt_image, corrupt_text

__all__ = ["IMAGE_CORRUPTIONS", "TEXT_CORRUPTIONS", "corrupt_image", "corrupt_text"]
