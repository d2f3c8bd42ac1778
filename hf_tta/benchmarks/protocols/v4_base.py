"""Protocol v4's runs, the pieces every study's runs are built from: a run, a split's ``hf-tta run`` arguments, the
settings the candidates share (:mod:`.v4` lists the studies' runs, :mod:`.v4_rounds` the later rounds')."""

from __future__ import annotations

import json
from dataclasses import dataclass

from ...data.corruptions import CHAR_CORRUPTIONS, VALIDATION_IMAGE_CORRUPTIONS, WORD_CORRUPTIONS

SCORING = "before_update"
SELECTION_SEED = 0
REPORT_SEEDS = (3, 4, 5)
STREAM_SEEDS = (3, 4, 5, 11, 12)
DEGENERATE_BATCHES = 50
#: The safety layer with its degenerate-batch rule only (no drift rollback): the candidates' ``+safe``.
SAFE_LITE = '{"min_agreement": 0, "max_agreement_drop": 1}'
#: The shift gate of rounds 3-6: the two-sample statistic at threshold 4 (``--shift_gate``).
GATE_MEAN4 = ["--shift_gate", json.dumps({"statistic": "batch_mean", "threshold": 4.0})]


@dataclass(frozen=True)
class Run:
    """One ``hf-tta run`` of a study: its folder name (``<phase>-<direction>/<name>``), the study whose registration
    it needs, and its arguments."""

    name: str
    study: str
    args: tuple[str, ...]

    @property
    def split(self) -> str:
        return "selection" if self.name.startswith("sel-") else "report"


def split_arguments(split: str, direction: str, seeds=None, corruptions: bool = True, streams=("clean",),
                    default_grid: bool = False, severities: str = "5", validation_streams: bool = False) -> list[str]:
    """``hf-tta run`` arguments of a v4 split in a direction: its concept part, seeds, corruption columns (the
    selection split's validation / character-level corruptions, image ones at ``severities``; the report's test /
    word-level ones, or the default grid) and streams (``clean``, ``noto``, ``diverse``, ``switch``, ``degenerate``);
    ``validation_streams``: the selection split's diverse and switching image streams draw from the validation
    corruptions (``--stream-corruptions``; registered from default-study-r10 on, whose selection runs still read the
    COCO-C-16 diverse stream from a stale cache file: the results card's tenth round; before, it drew from COCO-C's 16)."""
    from ...data.corruptions import TEST_IMAGE_CORRUPTIONS

    selection = split == "selection"
    seeds = seeds or ((SELECTION_SEED,) if selection else REPORT_SEEDS)
    args = ["--direction", direction, "--concepts", split, "--seeds", ",".join(map(str, seeds)), "--scoring", SCORING]
    if direction == "i2t":
        if not corruptions:
            args += ["--corruptions", ""]
        elif default_grid:
            args += ["--corruptions", "default"]
        elif selection:
            args += ["--corruptions", ",".join(VALIDATION_IMAGE_CORRUPTIONS), "--severities", severities]
        else:
            args += ["--corruptions", ",".join(TEST_IMAGE_CORRUPTIONS), "--severities", "3,5"]
        if validation_streams and selection:
            args += ["--stream-corruptions", ",".join(VALIDATION_IMAGE_CORRUPTIONS)]
    else:
        names = (CHAR_CORRUPTIONS if selection else WORD_CORRUPTIONS) if corruptions else ()
        args += ["--text-corruptions", ",".join(names), "--text-severities", "7" if selection else "3,7"]
    args += ["--style" if "noto" in streams else "--no-style"]
    args += [f"--{s}" for s in ("clean", "diverse", "switch", "degenerate") if s in streams]
    if "degenerate" in streams:
        args += ["--degenerate-batches", str(DEGENERATE_BATCHES)]
    return args


def _objectives(*rows: str) -> list[str]:
    return ["--objectives", ",".join(rows)]
