"""The card's severity-3 prequential table (this folder's rows): R@1 per corruption at severity 3 and the share of the
lost recall won back over the eight columns (ratio of sums). Run from the repository root:
python model_cards/results/v3-prequential-severity3-seed0/summary.py"""

import json
from pathlib import Path

rows = [json.loads(line) for line in (Path(__file__).parent / "rows.jsonl").read_text().splitlines()[1:]]
clean = next(r["R@1"] for r in rows if r["objective"] == "source" and r["shift"] == "clean")
cols = ["defocus_blur", "glass_blur", "motion_blur", "zoom_blur", "snow", "frost", "fog", "brightness"]
src = {r["shift"]: r["R@1"] for r in rows if r["objective"] == "source"}
print("| row | " + " | ".join(c.replace("_", " ") for c in cols) + " | won back (8 columns) |")
print("|---|" + "---|" * (len(cols) + 1))
print("| source | " + " | ".join(f"{src[c]:.1f}" for c in cols) + " | – |")
for name in ("tcr", "rest", "oracle", "oracle_all"):
    val = {r["shift"]: r["R@1"] for r in rows if r["objective"] == name}
    if not all(c in val for c in cols):
        continue
    share = sum(val[c] - src[c] for c in cols) / sum(clean - src[c] for c in cols)
    print(f"| {name} | " + " | ".join(f"{val[c]:.1f}" for c in cols) + f" | {100 * share:.1f} % |")
