"""Query-shift corruptions: 16 ImageNet-C image corruptions, 15 text corruptions and the diverse (per-query) mode.

Heavy dependencies (``imagecorruptions-imaug``, ``nlpaug``, ``nltk``, seq2seq models) are imported on first use;
install them with ``pip install 'hf_tta[data]'``.
"""

from ._utils import derive_seed
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
    IMAGE_CORRUPTION_CATEGORIES,
    IMAGE_CORRUPTION_CONSTANTS,
    IMAGE_CORRUPTIONS,
    IMAGE_SEVERITIES,
    MAX_IMAGE_SEVERITY,
    corrupt_image,
    corrupt_images,
)
from .text import (
    CHAR_CORRUPTIONS,
    DEFAULT_TEXT_MODELS,
    MAX_TEXT_SEVERITY,
    PAPER_TEXT_SEVERITIES,
    SENTENCE_CORRUPTIONS,
    TEXT_CORRUPTION_ABBREVIATIONS,
    TEXT_CORRUPTION_LEVELS,
    TEXT_CORRUPTIONS,
    TEXT_SEVERITIES,
    WORD_CORRUPTIONS,
    MissingResourceError,
    Seq2SeqGenerator,
    clear_text_model_cache,
    corrupt_text,
    corrupt_texts,
    load_wordnet,
    register_text_model,
)

__all__ = [
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
    "TEXT_CORRUPTIONS",
    "TEXT_CORRUPTION_ABBREVIATIONS",
    "TEXT_CORRUPTION_LEVELS",
    "TEXT_SEVERITIES",
    "WORD_CORRUPTIONS",
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
