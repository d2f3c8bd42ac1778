"""Benchmark builders and loaders: COCO-C / Flickr-C (from the user's local images + the Karpathy split JSON) and
AudioSet-O / AudioSet-D / VGGSound (from local clips; also under :mod:`hf_tta.data.builders.audioset`), Hub
publishing with dataset cards, and the loading helpers that turn a config into queries, gallery and relevance for
``TTAWrapper``.

Layout, dependencies one way (a module imports only from the lines above it):

- :mod:`.base`: shared names and helpers (split, clean config, complete-config check, package versions);
- :mod:`.specs`: what each benchmark is (sources, licences, config names, features, modality pairs);
- :mod:`.karpathy` (COCO / Flickr30K sources) and :mod:`.clips` (local audio-video clips);
- :mod:`.av_plans` (how audio-video queries are corrupted) and :mod:`.card` (dataset cards; a built folder's
  ``README.md`` makes it loadable with ``datasets.load_dataset(folder, config)``);
- :mod:`.benchmark` (the COCO-C / Flickr-C builder) and :mod:`.av_builder` (the audio-video builder);
- :mod:`.loading`: the one loading module (lazy columns, config loading, processor calls, retrieval splits);
- :mod:`.pairs` (any image-text set: a JSONL/CSV of pairs or a folder with sidecar captions, through
  :class:`~.pairs.RecordsBuilder`), :mod:`.realworld` (Nocaps, Fashion-Gen, CUHK-/ICFG-PEDES from their raw files)
  and :mod:`.composed` (FIQ-O/-D, CIRR-O/-D composed queries);
- :mod:`.card` (dataset cards), then :mod:`.hub` (publishing; ``push_benchmark(..., dry_run=True)`` writes the commit plan).
"""

import warnings

from . import audioset  # noqa: F401  (the audio-video names under hf_tta.data.builders.audioset)
from .av_builder import build_av_benchmark, save_av_benchmark
from .av_plans import AVCorruptionSettings, MissingRecordingsError
from .base import BUILD_INFO, CLEAN, SPLIT
from .benchmark import BenchmarkBuilder, build_benchmark
from .card import card_metadata, card_text, dataset_card
from .clips import AVClip, ClipReport, read_clip_list, select_pairs
from .composed import COMPOSED_CONFIGS, ComposedBuilder, composed_builder
from .composed_hub import ComposedSplit, load_composed_split, push_composed
from .hub import push_av_benchmark, push_benchmark, push_card, remote_configs
from .karpathy import KarpathyImage, SourceReport, karpathy_images, read_karpathy_json, scan_sources
from .loading import (
    AVRetrievalSplit,
    LazyImages,
    LazyItems,
    RetrievalSplit,
    load_av_retrieval,
    load_config,
    load_retrieval_split,
    to_model_inputs,
)
from .pairs import RecordsBuilder, pairs_builder, pairs_spec, read_pairs
from .realworld import REALWORLD, realworld_builder
from .specs import (
    AUDIOSET_D_CONFIGS,
    AUDIOSET_O_CONFIGS,
    AV_BENCHMARKS,
    AV_MODALITY_PAIRS,
    COCO_C,
    FLICKR_C,
    IMAGE_TEXT_BENCHMARKS,
    BenchmarkSpec,
    ConfigSpec,
    config_name,
    default_configs,
    image_features,
    parse_config_name,
    parse_direction,
    text_features,
    text_severities,
)


def __getattr__(name: str):
    if name == "BENCHMARKS":  # renamed: the audio-video builders have their own benchmark table
        warnings.warn("hf_tta.data.builders.BENCHMARKS is now IMAGE_TEXT_BENCHMARKS.", DeprecationWarning, stacklevel=2)
        return IMAGE_TEXT_BENCHMARKS
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "push_composed",
    "load_composed_split",
    "composed_builder",
    "ComposedSplit",
    "ComposedBuilder",
    "COMPOSED_CONFIGS",
    "AUDIOSET_D_CONFIGS",
    "AUDIOSET_O_CONFIGS",
    "AVClip",
    "AVCorruptionSettings",
    "AVRetrievalSplit",
    "AV_BENCHMARKS",
    "AV_MODALITY_PAIRS",
    "BUILD_INFO",
    "BenchmarkBuilder",
    "BenchmarkSpec",
    "CLEAN",
    "COCO_C",
    "ClipReport",
    "ConfigSpec",
    "FLICKR_C",
    "IMAGE_TEXT_BENCHMARKS",
    "KarpathyImage",
    "LazyImages",
    "LazyItems",
    "MissingRecordingsError",
    "REALWORLD",
    "RecordsBuilder",
    "RetrievalSplit",
    "SPLIT",
    "SourceReport",
    "build_av_benchmark",
    "build_benchmark",
    "card_metadata",
    "card_text",
    "config_name",
    "dataset_card",
    "default_configs",
    "image_features",
    "karpathy_images",
    "load_av_retrieval",
    "load_config",
    "load_retrieval_split",
    "parse_config_name",
    "pairs_builder",
    "pairs_spec",
    "parse_direction",
    "push_av_benchmark",
    "push_benchmark",
    "push_card",
    "read_clip_list",
    "read_karpathy_json",
    "read_pairs",
    "realworld_builder",
    "remote_configs",
    "save_av_benchmark",
    "scan_sources",
    "select_pairs",
    "text_features",
    "text_severities",
    "to_model_inputs",
]
