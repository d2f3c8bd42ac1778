"""Retrieval metrics (pure torch) and embedding-space diagnostics."""

from .recall import (
    RetrievalMetricAccumulator,
    modality_gap,
    relevance_to_index,
    relevant_ranks,
    retrieval_metrics,
    uniformity,
)

__all__ = [
    "RetrievalMetricAccumulator",
    "modality_gap",
    "relevance_to_index",
    "relevant_ranks",
    "retrieval_metrics",
    "uniformity",
]
