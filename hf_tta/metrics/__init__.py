"""Retrieval metrics (pure torch) and embedding-space diagnostics."""

import os as _os

from .composed import cirr_metrics, composed_recall, fiq_metrics, recall_subset
from .recall import (
    RetrievalMetricAccumulator,
    modality_gap,
    relevance_to_index,
    relevant_ranks,
    retrieval_metrics,
    uniformity,
)
from .topk import topk_relevant_ranks, topk_retrieval_metrics

#: Folder of the ``evaluate`` metric module: ``evaluate.load(RETRIEVAL_RECALL_PATH)`` (offline).
RETRIEVAL_RECALL_PATH = _os.path.join(_os.path.dirname(_os.path.abspath(__file__)), "retrieval_recall")

__all__ = [
    "RETRIEVAL_RECALL_PATH",
    "RetrievalMetricAccumulator",
    "cirr_metrics",
    "composed_recall",
    "fiq_metrics",
    "modality_gap",
    "recall_subset",
    "relevance_to_index",
    "relevant_ranks",
    "retrieval_metrics",
    "topk_relevant_ranks",
    "topk_retrieval_metrics",
    "uniformity",
]
