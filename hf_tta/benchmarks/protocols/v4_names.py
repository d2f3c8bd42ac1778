"""How protocol v4's tables name the image rows (:mod:`.v4_tables`): the defaults of the rounds, and the report runs
whose anchored row ran a later round's settings (kept apart so that each module stays under 500 lines)."""

from __future__ import annotations

#: How the tables name protocol v4's image rows: the row ``recommended`` of the committed image runs ran the default
#: of the study's first three rounds (gated TCR, :data:`hf_tta.preset.GATED_TCR_IMAGE`; the runs record it in
#: :data:`.v4.REGISTERED_IMAGE_PRESET`); the fourth round's choice (the default of rounds 4-5) and the sixth's ran under
#: their own row names. The seventh to tenth rounds' choices run the sixth's row name with other run-level settings
#: (the answer's mix): their runs are named in :data:`ANCHOR_RUNS`.
IMAGE_ROW_NAMES = {"recommended": "tcr+gate+safe@3e-2 (default of rounds 1-3)",
                   "rest+dn+safe@1e-3": "rest+dn+safe@1e-3 (default of rounds 4-5)",
                   "tcr+gate+anchor+safe@3e-2": "tcr+gate+anchor+safe@3e-2 (default of round 6)"}
#: The current image default, ``TTAConfig.recommended("image")`` (default-study-r10's choice), as the tables name it.
CURRENT_DEFAULT = ("recommended: tcr+gate+anchor+safe@3e-2, ensemble_weight 0.5, source_confidence 0.7, "
                   "mix_agreement [0.3, 0.9]")
#: The ninth, eighth and seventh rounds' choices (the defaults before the tenth round), as the tables name them.
ROUND9_DEFAULT = "tcr+gate+anchor+safe@3e-2, ensemble_weight 0.5, mix_agreement [0.3, 0.9] (default of round 9)"
ROUND8_DEFAULT = "tcr+gate+anchor+safe@3e-2, ensemble_weight 0.5, source_confidence 0.7 (default of round 8)"
ROUND7_DEFAULT = "tcr+gate+anchor+safe@3e-2, ensemble_weight 0.3 (default of round 7)"
#: The report runs (name prefixes, after ``rep-i2t/``) whose ``tcr+gate+anchor+safe@3e-2`` row ran a later round's
#: anchor settings, and the name the tables give that row there.
ANCHOR_RUNS = ((("r10-headline-chosen", "r10-streams-chosen", "main-r10-", "r10more-headline-chosen",
                 "r10more-streams-chosen"), CURRENT_DEFAULT),
               (("r9-headline-chosen", "r9-streams-chosen", "main-r9-", "r10-streams-previous"), ROUND9_DEFAULT),
               (("r8-headline-chosen", "r8-streams-chosen", "main-r8-", "r9-streams-previous"), ROUND8_DEFAULT),
               (("r7-headline-chosen", "r7-streams-chosen", "main-r7-", "r8-streams-previous"), ROUND7_DEFAULT))


def row_name(r: dict) -> str:
    """The name a report row goes by in the tables (see :data:`IMAGE_ROW_NAMES` and :data:`ANCHOR_RUNS`)."""
    if r["direction"] != "i2t":
        return r["objective"]
    if r["objective"] == "tcr+gate+anchor+safe@3e-2":
        run = r["run"].split("/", 1)[1]
        for prefixes, name in ANCHOR_RUNS:
            if run.startswith(prefixes):
                return name
    return IMAGE_ROW_NAMES.get(r["objective"], r["objective"])
