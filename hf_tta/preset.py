"""The recommended preset, ``TTAConfig.recommended(query_modality)``: the default a user gets, chosen by a registered
rule on a selection split and reported on a held-out report split (``model_cards/emoji-benchmark-results.md``).

**Image queries (protocol v4, issue 48).** Three registered rounds of candidates
(``model_cards/results/protocol-v4/registrations/default-study*.json``, each committed before its first row) ran on
the selection split only: 624 concepts of their own with their own gallery, ImageNet-C's four validation corruptions
at severity 5, the clean and degenerate streams, seed 0. The rule: a candidate is eligible when its clean and
degenerate streams are *not below* the source (one-sided 95 % bound above −0.5 R@1); the highest pooled share of lost
recall won back wins; ties (within one share point) go to the safer candidate, then to fewer passes per query. Every
ungated TCR and REST row fails the clean stream; the shift gate keeps it exactly at the source. The choice
(``choices/default-study.json``): TCR on the query tower's LayerNorms at lr 3e-2 (the lr the labelled comparators
chose for TCR on the same split) behind the shift gate's two-sample statistic at threshold 4
(:mod:`hf_tta.shift_gate`), with the safety layer's degenerate-batch rule only. It needs reference queries
(``tta.fit_shift_gate(clean_queries)``: a few hundred clean, in-distribution queries, no labels); until it has them
the source model answers and nothing adapts. Its selection and report figures are in the results card, recomputed
there from the committed rows.

**Text queries (protocol v4).** The same study on the text selection split (the five character-level corruptions
at text severity 7, clean and degenerate streams, seed 0): REST at lr 3e-4 with Nearest Neighbor Normalization on
the scores and the safety layer's degenerate-batch rule; the gated candidates tied on share and lost the tie on
safety (their clean and degenerate bounds were lower). **Audio and video** queries get TCR, DN and the safety layer at
the modality's default lr (protocol v2's rule), not measured.
"""

from __future__ import annotations

from typing import Any

#: The recommended combination for audio and video queries (protocol v2's rule; v3's preset phase chose it again for
#: text queries, at a named lr): TCR on the query tower's LayerNorms, Distribution Normalization (its code's defaults,
#: lambda = 0.25, means of 100 samples) on the output scores, and the safety layer at its a-priori thresholds (it keeps
#: a degenerate stream from dragging the model down; protocol v2's card), at the modality's default lr.
RECOMMENDED: dict[str, Any] = {"objective": "tcr", "score_transform": "dn", "safety": {}}
#: Image queries: protocol v4's default study (issue 48; ``model_cards/results/protocol-v4/choices/default-study.json``)
#: chose TCR at lr 3e-2 behind the shift gate's two-sample statistic at threshold 4 (:mod:`hf_tta.shift_gate`) with the
#: safety layer's degenerate-batch rule (no drift rollback): on the selection split it wins back as much as the best
#: labelled fixed-lr TCR (50.3 %) with the clean and degenerate streams exactly at the source. It needs reference
#: queries: ``tta.fit_shift_gate(clean_queries)``; until then the source answers.
SAFETY_DEGENERATE_ONLY: dict[str, Any] = {"min_agreement": 0, "max_agreement_drop": 1}
RECOMMENDED_IMAGE: dict[str, Any] = {"objective": "tcr", "lr": 3e-2, "safety": SAFETY_DEGENERATE_ONLY,
                                     "shift_gate": {"statistic": "batch_mean", "threshold": 4.0}}
#: Text queries: protocol v4's default study chose REST at lr 3e-4 with NNN on the scores and the safety layer's
#: degenerate-batch rule (no gate: on caption queries no gated candidate won more, ``choices/default-study.json``).
RECOMMENDED_TEXT: dict[str, Any] = {"objective": "rest", "lr": 3e-4, "score_transform": "nnn", "safety": SAFETY_DEGENERATE_ONLY}

#: The same presets as benchmark rows (:func:`hf_tta.benchmarks.grid.row_spec` syntax); the row ``recommended`` runs
#: the one of the run's query modality.
RECOMMENDED_ROW = "tcr+dn+safe"
RECOMMENDED_IMAGE_ROW = "tcr+gate+safe@3e-2"  # with --safety and --shift_gate as RECOMMENDED_IMAGE's (RowSpec.preset)
RECOMMENDED_TEXT_ROW = "rest+nnn+safe@3e-4"  # with --safety as RECOMMENDED_TEXT's (RowSpec.preset)


def recommended_fields(query_modality: str) -> dict[str, Any]:
    """The preset's :class:`~hf_tta.TTAConfig` fields for queries of ``query_modality`` (a copy)."""
    import copy

    return copy.deepcopy({"image": RECOMMENDED_IMAGE, "text": RECOMMENDED_TEXT}.get(query_modality, RECOMMENDED))


def recommended_row(query_modality: str) -> str:
    """The preset as a benchmark row for queries of ``query_modality``."""
    return {"image": RECOMMENDED_IMAGE_ROW, "text": RECOMMENDED_TEXT_ROW}.get(query_modality, RECOMMENDED_ROW)
