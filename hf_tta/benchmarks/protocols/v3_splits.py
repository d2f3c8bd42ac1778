"""Protocol v3's two splits of the emoji benchmark, declared here before any of their runs.

Every choice (each objective's learning rate, the preset, a selector's settings) is made on the **selection split**
only; every reported figure comes from the **report split** only, which refuses selection rows
(:func:`check_report_rows`). Every row of both is scored prequentially (``scoring="before_update"``: a batch is
answered by the model as it was before adapting on it); the papers' after-update scoring is a secondary column.

* Selection (:data:`SELECTION`): ImageNet-C's four *validation* corruptions, which Hendrycks & Dietterich (2019) set
  aside for choosing hyper-parameters (speckle noise, Gaussian blur, spatter, saturate), at severity 5, for image
  queries (declared first at severities 3 and 5; severity 3 was dropped before any method's row was read, for compute,
  because on the 500-concept slice the source loses under 0.5 R@1 at severity 3 on three of the four, 98.6 / 98.4 /
  98.8 against 98.8 clean, and 15.6 on Gaussian blur, against 77.0, 37.0, 2.6 and 1.2 at severity 5); the
  character-level text corruptions at text severity 7, for caption queries (declared first at 3 and 7; severity 3 was
  dropped for compute after the first run's source rows only, no method row read: the source loses 58-67 R@1 at 3 and
  67-76 at 7 against 84.0 clean, so both are heavy shifts and the heavier is kept, as for images); the clean and
  degenerate streams (for the choice rule's margin); seed 0 only; a seeded 500-concept slice.
* Report (:data:`REPORT`): ImageNet-C's 15 *test* corruptions at severities 3 and 5 and the default grid
  (:data:`~hf_tta.benchmarks.grid.DEFAULT_IMAGE_CONDITIONS`); the word-level text corruptions at 3 and 7; the
  clean, Noto-style, diverse, switching and degenerate streams; the fresh seeds 3, 4 and 5 (no run before protocol
  v3 used them); every query.

A row belongs to the selection split when its seed is :data:`SELECTION_SEED` or its shift is a selection-only
corruption (an ImageNet-C validation corruption or a character-level text corruption); to the report split when its
seed is a report seed and its shift is not selection-only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

from ...data.corruptions import CHAR_CORRUPTIONS, TEST_IMAGE_CORRUPTIONS, VALIDATION_IMAGE_CORRUPTIONS, WORD_CORRUPTIONS
from ..grid import DEFAULT_IMAGE_CONDITIONS

SELECTION_SEED = 0
REPORT_SEEDS = (3, 4, 5)
#: The selection runs' seeded slice of concepts (``hf-tta run --limit``); the report runs use every query.
SELECTION_LIMIT = 500
IMAGE_SEVERITIES = (3, 5)
SELECTION_IMAGE_SEVERITIES = (5,)
TEXT_SEVERITIES = (3, 7)
SELECTION_TEXT_SEVERITIES = (7,)
#: The scoring rule of every protocol-v3 row (prequential).
SCORING = "before_update"


@dataclass(frozen=True)
class Split:
    """One split: its seeds, image streams ``(corruption, severity)``, text corruptions and severities, other
    streams (``clean``, ``noto``, ``diverse``, ``switch``, ``degenerate``) and the concept slice (``None``: all)."""

    name: str
    seeds: tuple[int, ...]
    image_conditions: tuple[tuple[str, int], ...]
    text_corruptions: tuple[str, ...]
    text_severities: tuple[int, ...]
    streams: tuple[str, ...]
    limit: int | None

    @property
    def image_corruptions(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(c for c, _ in self.image_conditions))


SELECTION = Split(
    name="selection",
    seeds=(SELECTION_SEED,),
    image_conditions=tuple((c, s) for c in VALIDATION_IMAGE_CORRUPTIONS for s in SELECTION_IMAGE_SEVERITIES),
    text_corruptions=CHAR_CORRUPTIONS,
    text_severities=SELECTION_TEXT_SEVERITIES,
    streams=("clean", "degenerate"),
    limit=SELECTION_LIMIT,
)
REPORT = Split(
    name="report",
    seeds=REPORT_SEEDS,
    image_conditions=tuple((c, s) for c in TEST_IMAGE_CORRUPTIONS for s in IMAGE_SEVERITIES),
    text_corruptions=WORD_CORRUPTIONS,
    text_severities=TEXT_SEVERITIES,
    streams=("clean", "noto", "diverse", "switch", "degenerate"),
    limit=None,
)
#: The default grid (``hf-tta``'s main job) is on the report split too: its streams are test corruptions.
REPORT_DEFAULT_GRID: tuple[tuple[str, int], ...] = DEFAULT_IMAGE_CONDITIONS
SELECTION_ONLY_SHIFTS = frozenset(VALIDATION_IMAGE_CORRUPTIONS) | frozenset(CHAR_CORRUPTIONS)


def split_of(row: dict) -> str:
    """``"selection"``, ``"report"`` or ``"neither"`` (an earlier protocol's seeds 1 and 2, say) for a result row."""
    seed = int(row.get("seed", 0) or 0)
    if seed == SELECTION_SEED or row.get("shift") in SELECTION_ONLY_SHIFTS:
        return "selection"
    return "report" if seed in REPORT_SEEDS else "neither"


def _refuse(rows: Iterable[dict], wanted: str) -> list[dict]:
    rows = list(rows)
    wrong = [r for r in rows if split_of(r) != wanted]
    if wrong:
        r = wrong[0]
        where = f"{r.get('objective')} on {r.get('direction')}/{r.get('shift')}/{r.get('severity')} seed {r.get('seed')}"
        raise ValueError(
            f"{len(wrong)} of {len(rows)} rows are not on the {wanted} split (first: {where}, on the {split_of(r)} split); "
            f"pass only {wanted} rows (hf_tta.benchmarks.protocols.v3_splits.{wanted.upper()})."
        )
    return rows


def check_report_rows(rows: Iterable[dict]) -> list[dict]:
    """The rows, if every one is on the report split; else one ``ValueError`` naming the first that is not."""
    return _refuse(rows, "report")


def check_selection_rows(rows: Iterable[dict]) -> list[dict]:
    """The rows, if every one is on the selection split; else one ``ValueError`` naming the first that is not."""
    return _refuse(rows, "selection")


def run_arguments(
    split: Split, direction: str, seeds: Sequence[int] | None = None, streams: bool = True, corruptions: bool = True,
    default_grid: bool = False,
) -> list[str]:
    """``hf-tta run`` arguments for a split's streams in a direction (``i2t`` / ``t2i``), prequential: its corruption
    streams (``corruptions``; ``default_grid``: the report split's default grid instead, i2t) and its other streams
    (``streams``)."""
    if default_grid and (split is not REPORT or direction != "i2t"):
        raise ValueError("default_grid is the report split's image→text grid: use it with REPORT and i2t.")
    seeds = split.seeds if seeds is None else tuple(seeds)
    args = ["--direction", direction, "--seeds", ",".join(map(str, seeds)), "--scoring", SCORING]
    if split.limit is not None:
        args += ["--limit", str(split.limit)]
    if direction == "i2t":
        if not corruptions:
            args += ["--corruptions", ""]
        elif default_grid:
            args += ["--corruptions", "default"]
        else:
            args += ["--corruptions", ",".join(split.image_corruptions),
                     "--severities", ",".join(map(str, sorted({s for _, s in split.image_conditions})))]
    else:
        args += ["--text-corruptions", ",".join(split.text_corruptions) if corruptions else "",
                 "--text-severities", ",".join(map(str, split.text_severities))]
    extra = set(split.streams) if streams else set()
    args += ["--style" if "noto" in extra else "--no-style"]
    args += [f"--{s}" for s in ("clean", "diverse", "switch", "degenerate") if s in extra]
    return args
