"""Retrieval recall for `evaluate`: R@K, median/mean rank and mAP with several relevant items per query.

A thin shim over :func:`hf_tta.metrics.retrieval_metrics`, so the numbers are the same. Load it offline from the
installed package::

    >>> import evaluate
    >>> from hf_tta.metrics import RETRIEVAL_RECALL_PATH
    >>> metric = evaluate.load(RETRIEVAL_RECALL_PATH)

Each prediction is one query's row of scores over the whole gallery (higher = more similar); each reference
lists the gallery indices relevant to that query (image→text on COCO: the 5 captions of the image).

    >>> scores = [[0.9, 0.1, 0.3], [0.2, 0.8, 0.7], [0.5, 0.6, 0.4]]
    >>> relevant = [[0], [2], [2, 0]]
    >>> out = metric.compute(predictions=scores, references=relevant, k_values=[1, 2])
    >>> round(out["R@1"], 2), out["R@2"], out["medr"], out["num_queries"]
    (33.33, 100.0, 2.0, 3)
    >>> round(out["mAP"], 2)
    69.44

Batches can be added as they come (``add_batch``) and computed at the end:

    >>> metric.add_batch(predictions=scores[:2], references=relevant[:2])
    >>> metric.add_batch(predictions=scores[2:], references=relevant[2:])
    >>> metric.compute(k_values=[1, 2])["R@2"]
    100.0
"""

import datasets
import evaluate
import torch

from hf_tta.metrics.recall import retrieval_metrics

_DESCRIPTION = """Recall@K for cross-modal retrieval (the COCO/Flickr convention: the percentage of queries with at
least one relevant gallery item among their top K), the median and mean rank (1-based) of the best-ranked relevant
item, and the mean average precision over all relevant items (%). Several relevant items per query are allowed.
Ties are counted pessimistically (an item tied with an irrelevant one ranks after it: a model whose scores are all
equal gets R@1 = 0), and the arithmetic is exact (integer counts, float64 percentages: 1 hit in 5 is 20.0)."""

_KWARGS_DESCRIPTION = """
Args:
    predictions (`list` of `list` of `float`): one row of gallery scores per query (all rows the same length).
    references (`list` of `list` of `int`): the relevant gallery indices of each query (at least one each).
    k_values (`list` of `int`, defaults to `[1, 5, 10]`): the cut-offs K of R@K.
Returns:
    `dict`: `R@K` for every K (%), `medr`, `meanr`, `mAP` (%) and `num_queries`.
Examples:
    >>> metric = evaluate.load("path/to/hf_tta/metrics/retrieval_recall")  # doctest: +SKIP
    >>> metric.compute(predictions=[[0.9, 0.1], [0.2, 0.8]], references=[[0], [0]], k_values=[1])  # doctest: +SKIP
    {'R@1': 50.0, 'medr': 1.5, 'meanr': 1.5, 'mAP': 75.0, 'num_queries': 2}
"""

_CITATION = """@inproceedings{li2025tcr,
  title={Test-time Adaptation for Cross-modal Retrieval with Query Shift},
  author={Li, Haobin and Hu, Peng and Zhang, Qianjun and Peng, Xi and Liu, Xiting and Yang, Mouxing},
  booktitle={International Conference on Learning Representations (ICLR)}, year={2025}
}"""


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _KWARGS_DESCRIPTION)
class RetrievalRecall(evaluate.Metric):
    """R@K / medr / meanr / mAP of a query x gallery score matrix (see the module docstring for examples)."""

    def _info(self):
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation=_CITATION,
            inputs_description=_KWARGS_DESCRIPTION,
            features=datasets.Features(
                {
                    "predictions": datasets.List(datasets.Value("float64")),
                    "references": datasets.List(datasets.Value("int64")),
                }
            ),
            reference_urls=["https://arxiv.org/abs/2410.15624"],
        )

    def _compute(self, predictions, references, k_values=(1, 5, 10)):
        lengths = {len(row) for row in predictions}
        if len(lengths) > 1:
            raise ValueError(f"Every prediction must score the whole gallery; got rows of lengths {sorted(lengths)}.")
        scores = torch.tensor([list(row) for row in predictions], dtype=torch.float64)  # no ties created by rounding
        nan_rows = torch.isnan(scores).any(dim=1).nonzero().flatten().tolist()
        if nan_rows:  # a NaN has no rank: every comparison with it is false, and recall would read as 0 without a word
            raise ValueError(f"{len(nan_rows)} of {len(scores)} predictions hold NaN scores (first: row {nan_rows[0]}): "
                             "check the model's outputs before scoring them.")
        relevant = [[int(i) for i in ref] for ref in references]
        return retrieval_metrics(scores, relevant, ks=tuple(int(k) for k in k_values))
