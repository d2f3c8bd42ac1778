"""Issue 46's re-runs after the batch driver, the slot bank and the readers (run at dbb3143), and again after the
readers built by the constructor and the shorter call path (run at 66e7253), and after the lr search's shadows became
slots of the bank (run at a4b1eaa): are the per-query hits those of the
committed rows (or, for the key-routed row that has none, of the code before the refactor, 6d26979)?

    python model_cards/results/driver-refactor-rerun/compare.py      # one line per row; exit 1 on any difference
"""

import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE.parent


def rows(path: Path, **where) -> dict[tuple, str]:
    """``(objective, stream, seed) -> hits`` of the rows of ``path`` that match ``where``."""
    out = {}
    for line in path.read_text().splitlines():
        r = json.loads(line)
        if "hf-tta-run" in r or any(r.get(k) != v for k, v in where.items()):
            continue
        out[(r["objective"], r["stream"], r["seed"])] = r["hits"]
    return out


V3 = RESULTS / "protocol-v3" / "rows.jsonl"
V4 = RESULTS / "protocol-v4" / "rows.jsonl"
PAIRS = [  # (re-run, its committed counterpart, what the pair checks)
    ("rows-v4-fixed-and-default.jsonl", rows(RESULTS / "protocol-v4" / "rows.jsonl", run="rep-i2t/headline-s3"),
     "a fixed-lr TCR report run and the default (shift-gate policy) vs protocol v4's committed rows"),
    ("rows-v3-rest-leader.jsonl", rows(V3, config="rest-auto+leader"),
     "lr_search={'serve': 'leader'} (the lr search as a policy) vs protocol v3's committed rows"),
    ("rows-v3-rest-b25.jsonl", rows(V3, config="rest-budgets-lr1e-3"),
     "update_budget 25 % (a policy) vs protocol v3's committed rows"),
    ("rows-keys.jsonl", rows(HERE / "rows-keys-before.jsonl"),
     "routed with the stream's keys and with the router (the slot bank) vs the same run before the refactor"),
    # after the readers built by the constructor and the shorter call path (run at 66e7253)
    ("rows-66e7253-v4-default-and-fixed.jsonl",
     {**rows(V4, run="rep-i2t/r7-headline-chosen-s8"), **rows(V4, run="rep-i2t/r7-headline-tcr-s8")},
     "today's default (its settings spelled out) and a fixed-lr TCR report run vs protocol v4's committed rows"),
    ("rows-66e7253-v3-rest-leader.jsonl", rows(V3, config="rest-auto+leader"),
     "lr_search={'serve': 'leader'} vs protocol v3's committed rows"),
    ("rows-66e7253-v3-rest-b25.jsonl", rows(V3, config="rest-budgets-lr1e-3"),
     "update_budget 25 % vs protocol v3's committed rows"),
    ("rows-66e7253-keys.jsonl", rows(HERE / "rows-keys-before.jsonl"),
     "routed with the stream's keys and with the router vs the same run before the first refactor"),
    # after the lr search's shadows became slots of the bank (run at a4b1eaa)
    ("rows-a4b1eaa-v3-rest-leader.jsonl", rows(V3, config="rest-auto+leader"),
     "lr_search={'serve': 'leader'}, its shadows in the slot bank, vs protocol v3's committed rows"),
]


def main() -> int:
    differ = 0
    for name, committed, what in PAIRS:
        print(f"{name}: {what}")
        for key, hits in rows(HERE / name).items():
            if key not in committed:
                print(f"  {key}: no committed row")
                differ += 1
                continue
            same = hits == committed[key]
            differ += not same
            print(f"  {key}: {'identical' if same else 'DIFFERENT'} per-query hits ({len(hits)} queries)")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
