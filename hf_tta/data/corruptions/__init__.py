"""Query-shift corruptions: 16 ImageNet-C image corruptions, 15 text corruptions and the diverse (per-query) mode;
the audio, video and segment-wise corruptions live in :mod:`.audio`, :mod:`.video` and :mod:`.segments`.

Layout: :mod:`.base` (seeds, severity checks, the missing-resource error) at the bottom; :mod:`.image`,
:mod:`.wordnet` and :mod:`.seq2seq` (the resource stacks of the word- and sentence-level text corruptions) above it;
:mod:`.text` (the 15 text corruptions) on those; :mod:`.diverse`, :mod:`.video`, :mod:`.audio` (+ :mod:`.audio_io`)
and :mod:`.segments` on top.

Heavy dependencies (``imagecorruptions-imaug``, ``nlpaug``, ``nltk``, seq2seq models) are imported on first use;
install them with ``pip install 'hf_tta[data]'``.
"""

from .base import MissingResourceError, derive_seed
from .diverse import (
    DEFAULT_IMAGE_POOL,
    DEFAULT_TEXT_POOL,
    corrupt_image_diverse,
    corrupt_images_diverse,
    corrupt_text_diverse,
    corrupt_texts_diverse,
    diverse_plan,
    draw_corruption,
    make_pool,
)
from .image import (
    ALL_IMAGE_CORRUPTION_CATEGORIES,
    ALL_IMAGE_CORRUPTIONS,
    IMAGE_CORRUPTION_CATEGORIES,
    IMAGE_CORRUPTION_CONSTANTS,
    IMAGE_CORRUPTIONS,
    IMAGE_SEVERITIES,
    MAX_IMAGE_SEVERITY,
    TEST_IMAGE_CORRUPTIONS,
    VALIDATION_IMAGE_CORRUPTIONS,
    corrupt_image,
    corrupt_images,
)
from .seq2seq import DEFAULT_TEXT_MODELS, Seq2SeqGenerator, clear_text_model_cache, register_text_model
from .text import (
    CHAR_CORRUPTIONS,
    MAX_TEXT_SEVERITY,
    PAPER_TEXT_SEVERITIES,
    REDRAWN_TEXT_CORRUPTIONS,
    SENTENCE_CORRUPTIONS,
    TEXT_CORRUPTION_ABBREVIATIONS,
    TEXT_CORRUPTION_LEVELS,
    TEXT_CORRUPTIONS,
    TEXT_SEVERITIES,
    WORD_CORRUPTIONS,
    check_text_resources,
    corrupt_text,
    corrupt_texts,
    missing_text_resources,
)
from .wordnet import load_wordnet

__all__ = [
    "ALL_IMAGE_CORRUPTION_CATEGORIES",
    "ALL_IMAGE_CORRUPTIONS",
    "CHAR_CORRUPTIONS",
    "DEFAULT_IMAGE_POOL",
    "DEFAULT_TEXT_MODELS",
    "DEFAULT_TEXT_POOL",
    "IMAGE_CORRUPTIONS",
    "IMAGE_CORRUPTION_CATEGORIES",
    "IMAGE_CORRUPTION_CONSTANTS",
    "IMAGE_SEVERITIES",
    "MAX_IMAGE_SEVERITY",
    "MAX_TEXT_SEVERITY",
    "MissingResourceError",
    "PAPER_TEXT_SEVERITIES",
    "SENTENCE_CORRUPTIONS",
    "Seq2SeqGenerator",
    "TEST_IMAGE_CORRUPTIONS",
    "TEXT_CORRUPTIONS",
    "TEXT_CORRUPTION_ABBREVIATIONS",
    "VALIDATION_IMAGE_CORRUPTIONS",
    "REDRAWN_TEXT_CORRUPTIONS",
    "TEXT_CORRUPTION_LEVELS",
    "TEXT_SEVERITIES",
    "WORD_CORRUPTIONS",
    "check_text_resources",
    "missing_text_resources",
    "clear_text_model_cache",
    "corrupt_image",
    "corrupt_image_diverse",
    "corrupt_images",
    "corrupt_images_diverse",
    "corrupt_text",
    "corrupt_text_diverse",
    "corrupt_texts",
    "corrupt_texts_diverse",
    "derive_seed",
    "diverse_plan",
    "draw_corruption",
    "load_wordnet",
    "make_pool",
    "register_text_model",
]
