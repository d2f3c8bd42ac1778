"""The card's prequential table (this folder's rows): R@1 per column and the share of lost recall won back over the
four corruption columns (ratio of sums). Run from the repository root: python model_cards/results/v3-prequential-default-seed0/summary.py"""

import json
from pathlib import Path

rows = [json.loads(line) for line in (Path(__file__).parent / "rows.jsonl").read_text().splitlines()[1:]]
clean = next(r["R@1"] for r in rows if r["objective"] == "source" and r["shift"] == "clean")
cols = [("shot_noise", 5), ("motion_blur", 4), ("snow", 2), ("contrast", 1)]
src = {(r["shift"], r.get("severity")): r["R@1"] for r in rows if r["objective"] == "source"}
print("| row | shot noise 5 | motion blur 4 | snow 2 | contrast 1 | Noto | won back (4 corruptions) |")
print("|---|---|---|---|---|---|---|")
print("| source | " + " | ".join(f"{src[c]:.1f}" for c in cols) + f" | {src[('noto', None)]:.1f} | – |")
for name in ("tent", "tcr", "rest", "recommended", "oracle", "oracle_all"):
    val = {(r["shift"], r.get("severity")): r["R@1"] for r in rows if r["objective"] == name}
    share = sum(val[c] - src[c] for c in cols) / sum(clean - src[c] for c in cols)
    print(f"| {name} | " + " | ".join(f"{val[c]:.1f}" for c in cols) + f" | {val[('noto', None)]:.1f} | {100 * share:.1f} % |")
