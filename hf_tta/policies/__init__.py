"""Batch-level features as policies (issue 46): one protocol (:class:`BatchPolicy`), one public view of a batch
(:class:`BatchContext`) and the answer a policy gives (:class:`Answer`); ``TTAWrapper._finish`` alone turns an answer
into a :class:`~hf_tta.TTAOutput`, counts the batch and resets an episodic stream. :func:`build_policies` (in
:mod:`hf_tta.policies.build`) builds a wrapper's list from its config."""

from .base import Answer, BatchPolicy
from .context import BatchContext

__all__ = ["Answer", "BatchContext", "BatchPolicy"]
