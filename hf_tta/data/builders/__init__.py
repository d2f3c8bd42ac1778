"""COCO-C / Flickr-C builders (from the user's local images + the Karpathy split JSON), Hub publishing and the
loading helpers that turn a config into queries, gallery and relevance for ``TTAWrapper``."""

from .benchmark import (
    BENCHMARKS,
    CLEAN,
    COCO_C,
    FLICKR_C,
    BenchmarkBuilder,
    BenchmarkSpec,
    ConfigSpec,
    build_benchmark,
    config_name,
    default_configs,
    image_features,
    parse_config_name,
    text_features,
    text_severities,
)
from . import audioset  # AudioSet-O / AudioSet-D / VGGSound (audio-video): hf_tta.data.builders.audioset
from .card import card_metadata, card_text
from .hub import push_benchmark, push_card, remote_configs
from .karpathy import KarpathyImage, SourceReport, karpathy_images, read_karpathy_json, scan_sources
from .loading import LazyImages, RetrievalSplit, load_config, load_retrieval_split

__all__ = [
    "BENCHMARKS",
    "BenchmarkBuilder",
    "BenchmarkSpec",
    "CLEAN",
    "COCO_C",
    "ConfigSpec",
    "FLICKR_C",
    "KarpathyImage",
    "LazyImages",
    "RetrievalSplit",
    "SourceReport",
    "build_benchmark",
    "card_metadata",
    "card_text",
    "config_name",
    "default_configs",
    "image_features",
    "karpathy_images",
    "load_config",
    "load_retrieval_split",
    "parse_config_name",
    "push_benchmark",
    "push_card",
    "read_karpathy_json",
    "remote_configs",
    "scan_sources",
    "text_features",
    "text_severities",
]
